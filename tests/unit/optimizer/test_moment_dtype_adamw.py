"""MomentDtypeAdamW (``--exp-avg-dtype bf16`` / ``--exp-avg-sq-dtype bf16`` without Transformer
Engine): torch's AdamW arithmetic with the moments stored in bf16, inside megatron-core's
distributed optimizer, resumed exactly; the flags' replacement and refusals; the budget's bytes."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.bounded.launch import te_choices
from megatron.bounded.optimizer import moment_dtype_adamw
from megatron.bounded.optimizer.moment_dtype_adamw import MomentDtypeAdamW, use_moment_dtypes
from megatron.bounded.settings import BoundedArgumentError
from tests.unit.optimizer.test_offload_stream_distributed import (  # noqa: F401 (process_group: a fixture)
    _emulated_load,
    _emulated_save,
    _Model,
    _project_distrib_optimizer_patches,
    _torch_adamw_distributed_optimizer,
    _torch_adamw_steps,
    process_group,
)

LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1
SIZES = (37, 256, 5)  # with the slice size set to 16 below: one, many and a partial slice


def _params(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(size, generator=generator)) for size in SIZES]


def _set_grads(params, step: int):
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * (1 + step)


def _adamw(params, optimizer_class=torch.optim.AdamW, **extra):
    return optimizer_class(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **extra)


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(moment_dtype_adamw, "STEP_CHUNK_ELEMENTS", 16)


def _six_steps_beside_torch_adamw(after_each_step=None, **moment_dtypes):
    """(our parameters, ours, torch's parameters, torch's single-tensor AdamW) after 6 steps of
    the same gradients from the same weights."""
    ours, reference = _params(0), _params(0)
    optimizer = _adamw(ours, MomentDtypeAdamW, **moment_dtypes)
    torch_adamw = _adamw(reference, foreach=False)
    for step in range(6):
        for params, stepping in ((ours, optimizer), (reference, torch_adamw)):
            _set_grads(params, step)
            stepping.step()
        if after_each_step is not None:
            after_each_step(torch_adamw)
    return ours, optimizer, reference, torch_adamw


def test_fp32_moments_are_torch_adamw_bit_for_bit(small_slices):
    ours, optimizer, reference, torch_adamw = _six_steps_beside_torch_adamw(
        exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[a][name], torch_adamw.state[b][name])


def test_bf16_moments_are_torch_adamw_from_rounded_moments(small_slices):
    """Each step equals torch's AdamW run from the stored (bf16) moments in fp32, its new moments
    then rounded to bf16: the update uses the moments before rounding."""

    def round_moments(torch_adamw):  # the reference keeps its moments as bf16 would hold them
        for state in torch_adamw.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                state[name].copy_(state[name].to(torch.bfloat16).float())

    ours, optimizer, reference, torch_adamw = _six_steps_beside_torch_adamw(round_moments)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            stored = optimizer.state[a][name]
            assert stored.dtype == torch.bfloat16
            assert torch.equal(stored.float(), torch_adamw.state[b][name])
    # and the rounding is not a no-op: fp32 moments give other weights
    fp32 = _params(0)
    exact = _adamw(fp32, foreach=False)
    for step in range(6):
        _set_grads(fp32, step)
        exact.step()
    assert not all(torch.equal(a, b) for a, b in zip(ours, fp32))


def test_moments_take_two_bytes_per_element():
    params = _params(0)
    optimizer = _adamw(params, MomentDtypeAdamW, exp_avg_sq_dtype=torch.float32)
    _set_grads(params, 0)
    optimizer.step()
    state = optimizer.state[params[1]]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.bfloat16, torch.float32)
    assert state["exp_avg"].untyped_storage().nbytes() == 2 * params[1].numel()


def test_a_torch_adamw_is_turned_in_place_and_loaded_moments_keep_the_dtype():
    params = _params(0)
    optimizer = _adamw(params)
    for param in params:  # the distributed optimizer's state at step 0
        optimizer.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                      exp_avg_sq=torch.zeros_like(param))
    turned = use_moment_dtypes(optimizer, torch.bfloat16, torch.bfloat16)
    assert turned is optimizer and isinstance(optimizer, MomentDtypeAdamW)
    assert optimizer.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    optimizer.state[params[0]]["exp_avg_sq"] = torch.ones(SIZES[0])  # a load assigns fp32
    _set_grads(params, 0)
    optimizer.step()
    assert optimizer.state[params[0]]["exp_avg_sq"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match="torch's AdamW"):
        use_moment_dtypes(torch.optim.SGD(_params(1), lr=0.1), torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        MomentDtypeAdamW(_params(1), exp_avg_dtype=torch.float16)


def _with_moment_dtypes(optimizer):
    use_moment_dtypes(optimizer.optimizer, torch.bfloat16, torch.bfloat16)
    return optimizer


def test_distributed_optimizer_resumes_bf16_moments_bit_for_bit(process_group, monkeypatch):
    """Through upstream's DistributedOptimizer with this project's patches: save after 3 steps
    (dp_reshardable), load into a fresh optimizer, 3 more steps: the master weights and the bf16
    moments equal 6 uninterrupted steps."""
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    for patch in _project_distrib_optimizer_patches():
        monkeypatch.setattr(patch.owner(), patch.attribute.split(".")[-1],
                            patch.make_replacement(patch.target()))

    def build(seed):
        model = _Model(seed=seed)
        optimizer, masters = _torch_adamw_distributed_optimizer(model, process_group)
        optimizer.init_state_fn(optimizer.optimizer)
        for state in optimizer.optimizer.state.values():
            state["step"] = torch.tensor(0.0)
        return model, _with_moment_dtypes(optimizer), masters

    reference_model, reference, reference_masters = build(0)
    _torch_adamw_steps(reference, reference_model, reference_masters, range(6))
    model, saving, masters = build(0)
    _torch_adamw_steps(saving, model, masters, range(3))
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    storage = _emulated_save(saving.sharded_state_dict({}, is_loading=False, metadata=metadata))
    resumed_model, resumed, resumed_masters = build(1)
    template = resumed.sharded_state_dict({}, is_loading=True, metadata=metadata)
    resumed.load_state_dict(_emulated_load(template, storage, False))
    with torch.no_grad():  # the weights come from the model checkpoint
        for resumed_master, master in zip(resumed_masters, masters):
            resumed_master.copy_(master)
    _torch_adamw_steps(resumed, resumed_model, resumed_masters, range(3, 6))
    for resumed_master, reference_master in zip(resumed_masters, reference_masters):
        assert torch.equal(resumed_master, reference_master)
        for name in ("exp_avg", "exp_avg_sq"):
            got = resumed.optimizer.state[resumed_master][name]
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, reference.optimizer.state[reference_master][name])


def test_the_construction_patch_turns_the_inner_optimizer(monkeypatch):
    from megatron.bounded.upstream import optimizer as upstream_optimizer

    params = _params(0)

    def original(self, *args, **kwargs):
        self.optimizer, self.init_state_fn = _adamw(params), None

    monkeypatch.setattr(upstream_optimizer, "_adam_moment_dtypes", None)
    built = type("Built", (), {})()
    upstream_optimizer.allocate_torch_adam_state_at_construction(original)(built)
    assert type(built.optimizer) is torch.optim.AdamW
    upstream_optimizer.keep_adam_moments_in(torch.bfloat16, torch.float32)
    upstream_optimizer.allocate_torch_adam_state_at_construction(original)(built)
    assert isinstance(built.optimizer, MomentDtypeAdamW)
    assert built.optimizer.moment_dtypes == {"exp_avg": torch.bfloat16,
                                             "exp_avg_sq": torch.float32}


# --- the flags ------------------------------------------------------------------------------


def _args(**values):
    base = dict(use_precision_aware_optimizer=True, main_grads_dtype="fp32",
                main_params_dtype="fp32", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
                optimizer="adam", use_distributed_optimizer=True, optimizer_cpu_offload=False,
                offload_stream_optimizer=False)
    return argparse.Namespace(**{**base, **values})


def test_precision_aware_with_bf16_moments_is_replaced_and_named():
    args = _args()
    te_choices.check_optimizer_dtypes(args)
    notes = te_choices.substitute(args)
    assert args.use_precision_aware_optimizer is False
    assert any("moments stored in bf16" in note and "--exp-avg-dtype bf16" in note for note in notes)
    assert te_choices.moment_dtypes(args) == (torch.bfloat16, torch.bfloat16)
    assert te_choices.moment_dtypes(_args(exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32")) is None
    assert te_choices.moment_dtypes(_args(optimizer_cpu_offload=True)) is None  # host state


@pytest.mark.parametrize("values, named", [
    (dict(exp_avg_dtype="fp16"), "--exp-avg-dtype fp16"),
    (dict(main_params_dtype="bf16"), "--main-params-dtype bf16"),
    (dict(main_grads_dtype="bf16"), "--main-grads-dtype bf16"),
    (dict(use_distributed_optimizer=False), "--use-distributed-optimizer"),
    (dict(optimizer="sgd"), "--optimizer sgd"),
    (dict(optimizer_cuda_graph=True), "--optimizer-cuda-graph"),
])
def test_dtypes_this_build_cannot_keep_are_refused_by_name(values, named):
    with pytest.raises(BoundedArgumentError, match=named):
        te_choices.check_optimizer_dtypes(_args(**values))


def test_the_budget_counts_bf16_moments_and_the_sliced_step():
    from megatron.bounded.budget.config import _state_fields
    from megatron.bounded.optimizer.distributed import OffloadStreamSettings

    off = OffloadStreamSettings()
    fields = _state_fields(_args(use_precision_aware_optimizer=False, bf16=True), off)
    assert (fields["master_bytes"], fields["moment_bytes"]) == (4, 4)
    fp32 = _state_fields(_args(use_precision_aware_optimizer=False, bf16=True,
                               exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32"), off)
    assert fp32["moment_bytes"] == 8
    assert moment_dtype_adamw.step_transient_bytes(10, 4) == 3 * 4 * 10
    assert moment_dtype_adamw.step_transient_bytes(10, 8) == 4 * 10
    limit = moment_dtype_adamw.STEP_CHUNK_ELEMENTS
    assert moment_dtype_adamw.step_transient_bytes(10 * limit, 6) == 2 * 4 * limit
