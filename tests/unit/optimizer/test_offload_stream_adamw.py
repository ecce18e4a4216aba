"""OffloadStreamAdamW: bucket plan, exactness against torch's fused AdamW, checkpoints, arguments.

CPU tests run everywhere; tests marked ``gpu`` need CUDA (run through scripts/gpu_functional.sh).
"""

from __future__ import annotations

import io
import random

import pytest
import torch

from megatron.bounded.optimizer.offload_stream_adamw import (
    HOST_BYTES_PER_ELEMENT,
    SPLIT_ALIGN,
    STAGED_BYTES_PER_ELEMENT,
    OffloadStreamAdamW,
    plan_buckets,
)
from tests.conftest import requires_cuda

# Parameter shapes with sizes below, at and above a bucket of 100 elements.
SHAPES = [(7,), (33, 9), (4, 5), (130,), (3, 2, 16), (1,), (250,), (10, 10)]
BUCKET = 100


# ------------------------------------------------------------------------------------- helpers


def _make_params(shapes, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(device=device, dtype=dtype))
        for shape in shapes
    ]


def _copy_params(params, dtype=None):
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


def _random_grads(params, step, dtype=None, seed=1234):
    """Non-zero gradients that differ per step, identical for every optimizer under test."""
    generator = torch.Generator().manual_seed(seed + step)
    return [
        (torch.randn(p.shape, generator=generator) * (1.0 + step)).to(device=p.device, dtype=dtype or p.dtype)
        for p in params
    ]


def _two_groups(params, split=3):
    return [
        {"params": params[:split], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[split:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6},
    ]


def _lr_lambda(step):
    return 0.5**step + 0.1


def _assert_state_equal(ours, reference, params_ours, params_ref):
    ours.synchronize()
    for p, q in zip(params_ours, params_ref):
        assert (p in ours.state) == (q in reference.state)
        if q not in reference.state:
            continue
        mine, theirs = ours.state[p], reference.state[q]
        assert torch.equal(mine["step"], theirs["step"].cpu())
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"].float().cpu())
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"].float().cpu())


def _has_split_param(optimizer):
    pieces = {}
    for bucket in optimizer.buckets:
        for segment in bucket.segments:
            pieces[segment.param_index] = pieces.get(segment.param_index, 0) + 1
    return any(count > 1 for count in pieces.values())


# ------------------------------------------------------------------------------------- bucket plan


def _check_plan(numels, bucket_numel):
    buckets = plan_buckets(numels, bucket_numel)
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    coverage = [torch.zeros(n, dtype=torch.int32) for n in numels]
    flat_position = 0
    for index, bucket in enumerate(buckets):
        assert 0 < bucket.numel <= bucket_numel
        assert bucket.start == flat_position  # buckets partition the flat state in order
        assert sum(s.numel for s in bucket.segments) == bucket.numel
        bucket_offset = 0
        for segment in bucket.segments:
            assert segment.bucket_offset == bucket_offset
            assert segment.numel > 0
            # The piece's flat position agrees with the parameter's own flat range.
            assert bucket.start + segment.bucket_offset == offsets[segment.param_index] + segment.param_offset
            coverage[segment.param_index][segment.param_offset : segment.param_offset + segment.numel] += 1
            bucket_offset += segment.numel
        flat_position += bucket.numel
        if index + 1 < len(buckets):
            # Greedy: a bucket closes only when the next piece could not go into it.
            first = buckets[index + 1].segments[0]
            room = bucket_numel - bucket.numel
            if numels[first.param_index] > bucket_numel:
                assert room < SPLIT_ALIGN or first.numel > room
            else:
                assert first.numel > room
    assert flat_position == sum(numels)
    for n, counts in zip(numels, coverage):
        assert torch.all(counts == 1), "every element must be in exactly one bucket"
    for param_index, n in enumerate(numels):
        pieces = sorted(
            (s for b in buckets for s in b.segments if s.param_index == param_index),
            key=lambda s: s.param_offset,
        )
        if n <= bucket_numel:
            assert len(pieces) == (1 if n else 0), "a parameter that fits a bucket is never split"
        for piece in pieces[:-1]:
            assert (piece.param_offset + piece.numel) % SPLIT_ALIGN == 0
    return buckets


@pytest.mark.parametrize(
    "numels, bucket_numel",
    [
        ([7, 297, 20, 130, 96, 1, 250, 100], 100),
        ([100, 100, 100], 100),
        ([1000], 100),
        ([60, 250, 5], 100),
        ([0, 5, 0, 17], 16),
        ([16, 15, 33, 1], 16),
        ([99, 2, 101], 101),
    ],
)
def test_plan_covers_every_element_once(numels, bucket_numel):
    _check_plan(numels, bucket_numel)


def test_plan_random_sizes():
    rng = random.Random(7)
    for _ in range(200):
        bucket_numel = rng.randint(SPLIT_ALIGN, 300)
        numels = [rng.choice([0, 1, rng.randint(1, 40), rng.randint(1, 900)]) for _ in range(rng.randint(1, 12))]
        _check_plan(numels, bucket_numel)


def test_plan_examples():
    # A big parameter first fills the aligned room of the current bucket, then whole buckets.
    buckets = plan_buckets([60, 250, 5], 100)
    pieces = [[(s.param_index, s.param_offset, s.numel) for s in b.segments] for b in buckets]
    assert pieces == [
        [(0, 0, 60), (1, 0, 32)],  # 40 elements of room, 32 of them on a 16-element boundary
        [(1, 32, 96)],
        [(1, 128, 96)],
        [(1, 224, 26), (2, 0, 5)],
    ]
    assert [b.start for b in buckets] == [0, 92, 188, 284]
    # Parameters that fit a bucket but not the room left start a new one.
    assert [b.numel for b in plan_buckets([70, 40, 30], 100)] == [70, 70]


# ------------------------------------------------------------------------------------- exactness (CPU)


def test_bitwise_equal_to_fused_adamw_fp32_groups_and_scheduler():
    params = _make_params(SHAPES)
    ref_params = _copy_params(params)
    ours = OffloadStreamAdamW(_two_groups(params), bucket_numel=BUCKET)
    reference = torch.optim.AdamW(_two_groups(ref_params), fused=True)
    assert _has_split_param(ours), "the test must exercise a parameter split across buckets"
    sched_ours = torch.optim.lr_scheduler.LambdaLR(ours, _lr_lambda)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(reference, _lr_lambda)
    for step in range(6):
        for p, q, g in zip(params, ref_params, _random_grads(params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
        sched_ours.step()
        sched_ref.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q)
    assert ours.param_groups[0]["lr"] == reference.param_groups[0]["lr"] != 1e-2
    _assert_state_equal(ours, reference, params, ref_params)
    for p in params:
        assert torch.equal(ours.state[p]["master_param"], p.detach())
    # Control: the parameters did move, so equality is not vacuous.
    assert not torch.equal(params[1], _make_params(SHAPES)[1])


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_twenty_steps_with_a_mid_run_state_dict_round_trip_stay_bitwise(num_slots):
    """A training run in miniature on CPU: 20 steps, weight decay, two param groups, parameters
    larger and smaller than a bucket; at step 10 the state goes through state_dict() into a fresh
    optimizer, which continues: every parameter and state tensor equals fused AdamW bit for bit."""
    params = _make_params(SHAPES)
    ref_params = _copy_params(params)
    ours = OffloadStreamAdamW(_two_groups(params), bucket_numel=BUCKET, num_slots=num_slots)
    reference = torch.optim.AdamW(_two_groups(ref_params), fused=True)
    assert _has_split_param(ours) and any(p.numel() < BUCKET for p in params)
    for step in range(20):
        if step == 10:
            buffer = io.BytesIO()
            torch.save(ours.state_dict(), buffer)
            buffer.seek(0)
            ours = OffloadStreamAdamW(_two_groups(params), bucket_numel=BUCKET, num_slots=num_slots)
            ours.load_state_dict(torch.load(buffer, weights_only=True))
        for p, q, g in zip(params, ref_params, _random_grads(params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), f"step {step}"
    _assert_state_equal(ours, reference, params, ref_params)
    assert reference.param_groups[0]["weight_decay"] > 0  # weight decay is exercised


def test_bf16_params_update_fp32_master_then_round():
    shapes = [(40,), (130,), (9, 9)]
    params = _make_params(shapes, dtype=torch.bfloat16)
    masters = _copy_params(params, dtype=torch.float32)  # reference: fused AdamW on fp32 copies
    ours = OffloadStreamAdamW(params, lr=5e-3, weight_decay=0.05, bucket_numel=64)
    reference = torch.optim.AdamW(masters, lr=5e-3, weight_decay=0.05, fused=True)
    assert _has_split_param(ours)
    for step in range(5):
        grads = _random_grads(params, step, dtype=torch.bfloat16)
        for p, m, g in zip(params, masters, grads):
            p.grad, m.grad = g, g.float()
        ours.step()
        reference.step()
        for p, m in zip(params, masters):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, m.detach().to(torch.bfloat16))
            assert torch.equal(ours.state[p]["master_param"], m.detach())
    # The master holds bits the bf16 parameter cannot: dropping it would change the result.
    assert any(not torch.equal(ours.state[p]["master_param"], p.detach().float()) for p in params)
    _assert_state_equal(ours, reference, params, masters)


def test_params_without_grad_are_skipped():
    params = _make_params(SHAPES)
    ref_params = _copy_params(params)
    never = 2  # this parameter never gets a gradient
    initial = params[never].detach().clone()
    ours = OffloadStreamAdamW(_two_groups(params), bucket_numel=BUCKET)
    reference = torch.optim.AdamW(_two_groups(ref_params), fused=True)
    skip_at = {0: {never}, 1: {never, 0, 6}, 2: {never, 3}, 3: {never}}
    for step, skipped in skip_at.items():
        for index, (p, q, g) in enumerate(zip(params, ref_params, _random_grads(params, step))):
            p.grad, q.grad = (None, None) if index in skipped else (g.clone(), g.clone())
        ours.step()
        reference.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q)
    assert params[never] not in ours.state
    assert torch.equal(params[never].detach(), initial)
    assert ours.state[params[0]]["step"].item() == 3.0 and ours.state[params[1]]["step"].item() == 4.0
    _assert_state_equal(ours, reference, params, ref_params)


def test_step_without_any_grad_changes_nothing():
    params = _make_params(SHAPES)
    before = [p.detach().clone() for p in params]
    ours = OffloadStreamAdamW(params, bucket_numel=BUCKET)
    for p, g in zip(params, _random_grads(params, 0)):
        p.grad = g
    ours.step()
    ours.zero_grad()
    after_first = [p.detach().clone() for p in params]
    ours.step()
    assert all(p.grad is None for p in params)
    assert all(torch.equal(p, a) for p, a in zip(params, after_first))
    assert not all(torch.equal(p, b) for p, b in zip(params, before))


def test_closure_is_evaluated_with_grad_enabled():
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 5)
    ref_model = torch.nn.Linear(12, 5)
    ref_model.load_state_dict(model.state_dict())
    inputs, targets = torch.randn(8, 12), torch.randn(8, 5)
    ours = OffloadStreamAdamW(model.parameters(), lr=1e-2, bucket_numel=32)
    reference = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)

    def closure_for(net, opt):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(inputs), targets)
            loss.backward()
            return loss

        return closure

    for _ in range(3):
        loss = ours.step(closure_for(model, ours))
        ref_loss = reference.step(closure_for(ref_model, reference))
        assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------- checkpoints


def _run_steps(optimizer, scheduler, params, steps, dtype=None):
    for step in steps:
        for p, g in zip(params, _random_grads(params, step, dtype=dtype)):
            p.grad = g
        optimizer.step()
        scheduler.step()


def test_state_dict_round_trip_is_exact():
    params_a = _make_params(SHAPES, dtype=torch.bfloat16)
    opt_a = OffloadStreamAdamW(_two_groups(params_a), bucket_numel=BUCKET)
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, _lr_lambda)
    _run_steps(opt_a, sched_a, params_a, range(3))

    buffer = io.BytesIO()
    torch.save({"optimizer": opt_a.state_dict(), "scheduler": sched_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    def resumed(drop_master):
        params = _copy_params(params_a)
        opt = OffloadStreamAdamW(_two_groups(params), bucket_numel=BUCKET)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        state_dict = saved["optimizer"]
        if drop_master:
            state_dict = {
                "state": {
                    k: {n: v for n, v in e.items() if n != "master_param"} for k, e in state_dict["state"].items()
                },
                "param_groups": state_dict["param_groups"],
            }
        opt.load_state_dict(state_dict)
        sched.load_state_dict(saved["scheduler"])
        return params, opt, sched

    params_b, opt_b, sched_b = resumed(drop_master=False)
    params_c, opt_c, sched_c = resumed(drop_master=True)
    for params, opt, sched in ((params_a, opt_a, sched_a), (params_b, opt_b, sched_b), (params_c, opt_c, sched_c)):
        _run_steps(opt, sched, params, range(3, 6))

    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    for p, q in zip(params_a, params_b):
        for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])
        assert opt_b.state[q]["exp_avg"].data_ptr() != opt_a.state[p]["exp_avg"].data_ptr()
    assert opt_b.param_groups[1]["lr"] == opt_a.param_groups[1]["lr"]
    # Control: resuming without the fp32 master (bf16 params only) diverges, so the check can fail.
    assert not all(torch.equal(p, q) for p, q in zip(params_a, params_c))


def test_state_dict_follows_torch_conventions():
    params = _make_params(SHAPES)
    ref_params = _copy_params(params)
    ours = OffloadStreamAdamW(_two_groups(params), bucket_numel=BUCKET)
    reference = torch.optim.AdamW(_two_groups(ref_params), fused=True)
    for step in range(2):
        for index, (p, q, g) in enumerate(zip(params, ref_params, _random_grads(params, step))):
            if index != 4:
                p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
    sd, ref_sd = ours.state_dict(), reference.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert sorted(sd["state"]) == sorted(ref_sd["state"]) == [i for i in range(len(SHAPES)) if i != 4]
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref_sd["param_groups"]]
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert [g[key] for g in sd["param_groups"]] == [g[key] for g in ref_sd["param_groups"]]
    for index, entry in sd["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        assert set(ref_sd["state"][index]) <= set(entry)
        assert entry["step"].dtype == torch.float32 and entry["step"].dim() == 0
        assert torch.equal(entry["step"], ref_sd["state"][index]["step"])
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert entry[key].device.type == "cpu" and entry[key].dtype == torch.float32
            assert entry[key].shape == params[index].shape


def test_loads_torch_adamw_state_dict():
    params = _make_params(SHAPES)
    reference = torch.optim.AdamW(_two_groups(params), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(reference, _lr_lambda)
    _run_steps(reference, sched, params, range(3))

    ours_params = _copy_params(params)
    ours = OffloadStreamAdamW(_two_groups(ours_params), bucket_numel=BUCKET)
    ours_sched = torch.optim.lr_scheduler.LambdaLR(ours, _lr_lambda)
    ours.load_state_dict(reference.state_dict())
    ours_sched.load_state_dict(sched.state_dict())
    _run_steps(reference, sched, params, range(3, 6))
    _run_steps(ours, ours_sched, ours_params, range(3, 6))
    for p, q in zip(ours_params, params):
        assert torch.equal(p, q)
    _assert_state_equal(ours, reference, ours_params, params)


def test_load_rejects_mismatched_state():
    params = _make_params(SHAPES)
    source = OffloadStreamAdamW(params, bucket_numel=BUCKET)
    for p, g in zip(params, _random_grads(params, 0)):
        p.grad = g
    source.step()
    sd = source.state_dict()
    sd["state"][1]["exp_avg"] = torch.zeros(5)
    target = OffloadStreamAdamW(_copy_params(params), bucket_numel=BUCKET)
    with pytest.raises(ValueError, match="exp_avg has 5 elements"):
        target.load_state_dict(sd)


# ------------------------------------------------------------------------------------- memory


def test_host_state_is_twelve_bytes_per_parameter():
    params = _make_params(SHAPES)
    ours = OffloadStreamAdamW(params, bucket_numel=BUCKET)
    assert ours.host_state_bytes() == 0  # allocated lazily, as torch creates state at first step
    for p, g in zip(params, _random_grads(params, 0)):
        p.grad = g
    ours.step()
    numel = sum(p.numel() for p in params)
    assert HOST_BYTES_PER_ELEMENT == 12
    assert ours.host_state_bytes() == HOST_BYTES_PER_ELEMENT * numel
    assert ours.staging_bytes() == 0  # CPU parameters are updated in place: nothing is staged
    assert sum(b.numel for b in ours.buckets) == numel


def test_add_param_group_before_first_step_only():
    params = _make_params(SHAPES)
    ours = OffloadStreamAdamW(params[:4], bucket_numel=BUCKET)
    ours.add_param_group({"params": params[4:], "lr": 1e-4})
    assert sum(b.numel for b in ours.buckets) == sum(p.numel() for p in params)
    for p, g in zip(params, _random_grads(params, 0)):
        p.grad = g
    ours.step()
    with pytest.raises(RuntimeError, match="cannot add a param group"):
        ours.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})


# ------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1e-3}, "learning rate"),
        ({"eps": -1.0}, "epsilon"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"betas": (1.0, 0.999)}, "beta1"),
        ({"betas": (0.9, 1.5)}, "beta2"),
        ({"betas": (-0.1, 0.999)}, "beta1"),
        ({"betas": (0.9,)}, "betas"),
        ({"bucket_numel": 0}, "bucket_numel"),
        ({"bucket_numel": -5}, "bucket_numel"),
        ({"bucket_numel": SPLIT_ALIGN - 1}, "bucket_numel"),
        ({"bucket_numel": 100.0}, "bucket_numel"),
        ({"num_slots": 0}, "num_slots"),
        ({"num_slots": -1}, "num_slots"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadStreamAdamW(_make_params(SHAPES), **kwargs)


def test_bad_group_and_params_raise():
    params = _make_params(SHAPES)
    with pytest.raises(ValueError, match="learning rate"):
        OffloadStreamAdamW([{"params": params[:2]}, {"params": params[2:], "lr": -1.0}])
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        OffloadStreamAdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))])
    with pytest.raises(ValueError, match="contiguous"):
        OffloadStreamAdamW([torch.nn.Parameter(torch.randn(4, 6).t())])
    ours = OffloadStreamAdamW(params[:2])
    with pytest.raises(ValueError, match="beta2"):
        ours.add_param_group({"params": params[2:], "betas": (0.9, 1.0)})
    assert len(ours.param_groups) == 1  # the rejected group was not kept


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_gpu_bitwise_equal_to_fused_adamw_fp32(num_slots):
    shapes = SHAPES + [(1000, 7), (4097,), (3, 333)]
    params = _make_params(shapes, device="cuda")
    ref_params = _copy_params(params)
    ours = OffloadStreamAdamW(_two_groups(params), bucket_numel=1000, num_slots=num_slots)
    reference = torch.optim.AdamW(_two_groups(ref_params), fused=True)
    assert _has_split_param(ours) and len(ours.buckets) > num_slots
    sched_ours = torch.optim.lr_scheduler.LambdaLR(ours, _lr_lambda)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(reference, _lr_lambda)
    for step in range(5):
        for index, (p, q, g) in enumerate(zip(params, ref_params, _random_grads(params, step))):
            skip = step == 2 and index in (0, 9)
            p.grad, q.grad = (None, None) if skip else (g.clone(), g.clone())
        ours.step()
        reference.step()
        sched_ours.step()
        sched_ref.step()
    torch.cuda.synchronize()
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    _assert_state_equal(ours, reference, params, ref_params)
    for p in params:
        assert torch.equal(ours.state[p]["master_param"], p.detach().cpu())
        assert ours.state[p]["exp_avg"].is_pinned()


@pytest.mark.gpu
@requires_cuda
def test_gpu_bf16_params_and_state_dict_round_trip():
    shapes = [(40,), (1300,), (90, 9), (2048,)]
    params_a = _make_params(shapes, dtype=torch.bfloat16, device="cuda")
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params_a]
    opt_a = OffloadStreamAdamW(params_a, lr=5e-3, bucket_numel=512)
    reference = torch.optim.AdamW(masters, lr=5e-3, fused=True)
    for step in range(3):
        grads = _random_grads(params_a, step, dtype=torch.bfloat16)
        for p, m, g in zip(params_a, masters, grads):
            p.grad, m.grad = g, g.float()
        opt_a.step()
        reference.step()
    for p, m in zip(params_a, masters):
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    sd = opt_a.state_dict()
    for index, m in enumerate(masters):
        assert torch.equal(sd["state"][index]["master_param"], m.detach().cpu())

    params_b = _copy_params(params_a)
    opt_b = OffloadStreamAdamW(params_b, lr=5e-3, bucket_numel=512)
    opt_b.load_state_dict(sd)
    for step in range(3, 6):
        grads = _random_grads(params_a, step, dtype=torch.bfloat16)
        for p, q, g in zip(params_a, params_b, grads):
            p.grad, q.grad = g, g.clone()
        opt_a.step()
        opt_b.step()
    torch.cuda.synchronize()
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    for index in sd_a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(sd_a["state"][index][key], sd_b["state"][index][key])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_slots", [2, 3])
def test_gpu_staging_bytes_match_measured_allocation(num_slots):
    bucket_numel = 1 << 16
    # Six full buckets (one parameter spans two), bf16 working parameters.
    half = bucket_numel // 2
    shapes = [(bucket_numel,), (2 * bucket_numel,), (256, 256), (half,), (half,), (bucket_numel,)]
    params = _make_params(shapes, dtype=torch.bfloat16, device="cuda")
    ours = OffloadStreamAdamW(params, bucket_numel=bucket_numel, num_slots=num_slots)
    assert [b.numel for b in ours.buckets] == [bucket_numel] * 6
    expected = num_slots * bucket_numel * STAGED_BYTES_PER_ELEMENT

    for p, g in zip(params, _random_grads(params, 0, dtype=torch.bfloat16)):
        p.grad = g
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ours.step()
    torch.cuda.synchronize()
    after_first = torch.cuda.memory_allocated()
    assert ours.staging_bytes() == expected
    assert after_first - before == expected  # the staging is the only persistent GPU allocation
    # The first step also creates the fp32 masters from the bf16 parameters, without a GPU copy.
    assert torch.cuda.max_memory_allocated() - before <= expected + 4096

    for p, g in zip(params, _random_grads(params, 1, dtype=torch.bfloat16)):
        p.grad = g
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before_second = torch.cuda.memory_allocated()
    ours.step()
    torch.cuda.synchronize()
    # A steady-state step allocates nothing beyond a few bytes of step counters.
    assert torch.cuda.max_memory_allocated() - before_second <= 4096
    assert torch.cuda.memory_allocated() == before_second
    assert ours.host_state_bytes() == HOST_BYTES_PER_ELEMENT * sum(p.numel() for p in params)


@pytest.mark.gpu
@requires_cuda
def test_gpu_first_step_after_load_waits_for_work_queued_on_the_slots_memory():
    """The staging slots are allocated at the first CUDA step, on the current stream. After a
    ``load_state_dict`` that step makes no host sync before its copies, and the allocator may
    hand the slots a block that the current stream freed while a kernel queued on it still
    writes it. Here that kernel runs late (after a GPU sleep) and writes NaN: the copy stream
    must wait for it, or the loaded state in the slot is overwritten. (Found in training: a
    resumed job reached NaN two steps after its checkpoint when the GPUs were shared.)"""
    bucket_numel = 1 << 18
    shapes = [(1 << 17,), (512, 256)]
    params_a = _make_params(shapes, device="cuda")
    opt_a = OffloadStreamAdamW(params_a, bucket_numel=bucket_numel, num_slots=1)
    for p, g in zip(params_a, _random_grads(params_a, 0)):
        p.grad = g
    opt_a.step()
    params_b = _copy_params(params_a)
    opt_b = OffloadStreamAdamW(params_b, bucket_numel=bucket_numel, num_slots=1)
    opt_b.load_state_dict(opt_a.state_dict())
    for p, q, g in zip(params_a, params_b, _random_grads(params_a, 1)):
        p.grad, q.grad = g, g.clone()
    torch.cuda.synchronize()

    late = torch.empty(STAGED_BYTES_PER_ELEMENT // 4 * bucket_numel, dtype=torch.float32, device="cuda")
    torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time before the write below
    late.fill_(float("nan"))
    del late  # its block is free for the next allocation of its size: the slot's
    opt_b.step()
    assert opt_b.staging_bytes() == STAGED_BYTES_PER_ELEMENT * bucket_numel
    opt_a.step()
    torch.cuda.synchronize()
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
