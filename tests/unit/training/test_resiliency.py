"""Resiliency flags: nvidia-resiliency-ext features are refused at argument time when the package
is missing (naming the flag and the install); --inprocess-restart wraps upstream's pretrain."""

from __future__ import annotations

from argparse import Namespace

import pytest

from megatron.bounded.training import resiliency


@pytest.mark.parametrize("given,named", [
    ({"enable_ft_package": True}, ["--enable-ft-package"]),
    ({"inprocess_restart": True}, ["--inprocess-restart"]),
    ({"enable_ft_package": True, "inprocess_restart": True},
     ["--enable-ft-package", "--inprocess-restart"]),
])
def test_missing_package_is_refused_naming_the_flag_and_the_install(monkeypatch, given, named):
    monkeypatch.setattr(resiliency, "resiliency_available", lambda: False)
    with pytest.raises(ValueError) as refused:
        resiliency.check_resiliency_args(Namespace(**given))
    for flag in named:
        assert flag in str(refused.value)
    assert "pip install -e '.[resiliency]'" in str(refused.value)


def test_flags_pass_when_the_package_is_there_or_not_asked_for(monkeypatch):
    monkeypatch.setattr(resiliency, "resiliency_available", lambda: True)
    resiliency.check_resiliency_args(Namespace(enable_ft_package=True, inprocess_restart=True))
    monkeypatch.setattr(resiliency, "resiliency_available", lambda: False)
    resiliency.check_resiliency_args(Namespace(enable_ft_package=False, inprocess_restart=False))


def test_availability_is_the_importable_module(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not resiliency.resiliency_available()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == resiliency.PACKAGE else None)
    assert resiliency.resiliency_available()


def test_inprocess_restart_wraps_pretrain_with_upstreams_wrapper_and_store(monkeypatch):
    from megatron.training import inprocess_restart

    def pretrain(*args, **kwargs):
        return "trained"

    def wrapped(*args, **kwargs):
        return ("restartable", kwargs)

    monkeypatch.setattr(inprocess_restart, "maybe_wrap_for_inprocess_restart",
                        lambda function: (wrapped, "store") if function is pretrain else None)
    run, extra = resiliency.wrap_for_inprocess_restart(pretrain, Namespace(inprocess_restart=True))
    assert run is wrapped and extra == {"store": "store"}
    run, extra = resiliency.wrap_for_inprocess_restart(pretrain, Namespace(inprocess_restart=False))
    assert run is pretrain and extra == {}
