"""Surviving faults: upstream's signal-driven exit, and nvidia-resiliency-ext when installed.

``--exit-signal-handler`` (upstream; the signal is ``--exit-signal``, SIGTERM by default)
    On the signal, every rank finishes the current iteration, the job saves a checkpoint to
    ``--save`` and exits with status 0; pretrain_gpt.py's cleanup (CUDA graph release, the
    checkpoint's integrity manifest) still runs. Without ``--save`` it exits without saving.
    A scheduler's SIGTERM with enough grace (the save's time plus one iteration) then loses no
    work: restart the job with the same flags and ``--load`` set to the ``--save`` directory.

``--enable-ft-package`` and ``--inprocess-restart`` (upstream, through nvidia-resiliency-ext)
    The fault-tolerance heartbeat monitor (used with ``ft_launcher``) and in-process restart
    after a rank fails. Both need the ``nvidia_resiliency_ext`` package, which upstream imports
    only once training has started; :func:`check_resiliency_args` refuses the flags at argument
    time when it is not installed. pretrain_gpt.py wraps upstream's ``pretrain`` for in-process
    restart as upstream's own entry point does (:func:`wrap_for_inprocess_restart`).
"""

from __future__ import annotations

import importlib.util

PACKAGE = "nvidia_resiliency_ext"
INSTALL_HINT = "pip install -e '.[resiliency]' (or pip install nvidia-resiliency-ext)"
# upstream flag -> args attribute of the features that need the package
FLAGS_NEEDING_PACKAGE = (
    ("--enable-ft-package", "enable_ft_package"),
    ("--inprocess-restart", "inprocess_restart"),
)


def resiliency_available() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def check_resiliency_args(args, error_class=ValueError) -> None:
    """Refuse resiliency flags whose package is missing, naming the flag and the install."""
    given = [flag for flag, attribute in FLAGS_NEEDING_PACKAGE if getattr(args, attribute, False)]
    if given and not resiliency_available():
        raise error_class(
            f"{' and '.join(given)} need nvidia-resiliency-ext (module {PACKAGE}), which is not "
            f"installed: {INSTALL_HINT}, or remove {' and '.join(given)}."
        )


def wrap_for_inprocess_restart(pretrain, args):
    """(the function to call for ``pretrain``, extra keyword arguments for it): upstream's
    in-process restart wrapper and its rendezvous store with ``--inprocess-restart``, else
    ``pretrain`` unchanged."""
    if not getattr(args, "inprocess_restart", False):
        return pretrain, {}
    from megatron.training.inprocess_restart import maybe_wrap_for_inprocess_restart

    wrapped, store = maybe_wrap_for_inprocess_restart(pretrain)
    return wrapped, {"store": store}
