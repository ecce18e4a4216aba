"""OffloadStreamHybridOptimizer: OffloadStreamAdamW inside megatron-core's DistributedOptimizer.

CPU tests build the optimizer the way megatron-core does (upstream's own construction code, then
DistributedOptimizer's rebuild over shard views with ``decoupled_grad``), check the update bitwise
against torch's fused AdamW on fp32 master weights, and drive upstream's ``DistributedOptimizer``
checkpoint methods (``state_dict``, ``load_state_dict``, the ``dp_reshardable``,
``fully_reshardable`` and legacy ``dp_zero`` parameter-state paths)
on a stand-in object with the attributes those methods read: ``DistributedOptimizer.__init__``
itself needs CUDA parameters and buffers. The distributed-checkpoint storage (torch_dist needs
CUDA) is emulated by :func:`_emulated_save` / :func:`_emulated_load`, which keep the part of its
behaviour the optimizer depends on: saved tensors are copies, ``ShardedObject`` data round-trips,
and a ``LocalNonpersistentObject`` comes back as the very object the load template held.

The test marked ``gpu`` builds the real ``DistributedOptimizer`` on one GPU.
"""

from __future__ import annotations

import copy
import io
import socket
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core import optimizer as core_optimizer
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from megatron.bounded.optimizer.distributed import (
    HYBRID_DEVICE_OPTIMIZER_BINDINGS,
    OffloadStreamHybridOptimizer,
    offload_stream_hybrid_optimizer_class,
)
from megatron.bounded.optimizer.offload_stream_adamw import OffloadStreamAdamW
from tests.conftest import requires_cuda
from megatron.bounded.units import MiB

BUCKET = 64
SLOTS = 2
# Shard sizes: below, at and above a bucket; the last two are fp32 parameters.
BF16_SIZES = [100, 37, 300, 5, 64]
FP32_SIZES = [20, 130]
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq")


# ------------------------------------------------------------------------------------- helpers


def _optimizer_class():
    return offload_stream_hybrid_optimizer_class(BUCKET, SLOTS)


def _upstream_kwargs() -> dict:
    """HybridDeviceOptimizer's arguments as core/optimizer/__init__.py passes them for adam."""
    return dict(
        offload_fraction=1.0,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        overlap_cpu_optimizer_d2h_h2d=False,
        pin_cpu_grads=True,
        pin_cpu_params=True,
        param_update_in_fp32=True,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
        eps=EPS,
        bias_correction=True,
        fused=True,
    )


def _megatron_group(params, wd_mult=1.0, is_expert_parallel=False) -> dict:
    """A param group with the keys megatron-core's _get_param_groups gives it."""
    return {
        "params": params,
        "is_expert_parallel": is_expert_parallel,
        "default_config": True,
        "wd_mult": wd_mult,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": LR,
        "min_lr": LR / 10,
    }


class _Model:
    """Model parameters and their shard views, as DistributedOptimizer builds them.

    bf16 parameters live in one flat bf16 buffer and fp32 ones in another (DDP's param buffers);
    the shards handed to the optimizer are 1-D views of the model parameters, and the gradients
    ``decoupled_grad`` are 1-D views of one fp32 grad buffer (``grad_reduce_in_fp32``).
    """

    def __init__(self, seed: int, grad_dtype=torch.float32):
        generator = torch.Generator().manual_seed(seed)
        sizes = BF16_SIZES + FP32_SIZES
        self.bf16_buffer = torch.randn(sum(BF16_SIZES), generator=generator).to(torch.bfloat16)
        self.fp32_buffer = torch.randn(sum(FP32_SIZES), generator=generator)
        self.grad_buffer = torch.zeros(sum(sizes), dtype=grad_dtype)
        self.model_params = []
        for buffer, group_sizes in ((self.bf16_buffer, BF16_SIZES), (self.fp32_buffer, FP32_SIZES)):
            offset = 0
            for size in group_sizes:
                self.model_params.append(torch.nn.Parameter(buffer[offset : offset + size]))
                offset += size
        # bf16 shards are detached views; fp32 shards are plain views (distrib_optimizer.py 408, 467).
        self.shards = [
            p.detach().view(-1) if p.dtype == torch.bfloat16 else p.view(-1) for p in self.model_params
        ]
        offsets = torch.tensor([0] + sizes).cumsum(0).tolist()
        self.grad_views = [self.grad_buffer[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def groups(self):
        # Two groups, fp32 shards first within a group (the order DistributedOptimizer uses).
        s = self.shards
        return [
            _megatron_group([s[5], s[0], s[1], s[2]], wd_mult=1.0),
            _megatron_group([s[6], s[3], s[4]], wd_mult=0.0),
        ]

    def group_index_map(self):
        s, m = self.shards, self.model_params
        order = [[5, 0, 1, 2], [6, 3, 4]]
        return {m[i]: (g, k) for g, members in enumerate(order) for k, i in enumerate(members)}

    def set_grads(self, step: int, seed: int = 777):
        generator = torch.Generator().manual_seed(seed + step)
        self.grad_buffer.copy_(torch.randn(self.grad_buffer.numel(), generator=generator) * (1 + step))
        for shard, grad in zip(self.shards, self.grad_views):
            shard.decoupled_grad = grad

    def clear_grads(self):
        for shard in self.shards:
            shard.decoupled_grad = None


def _schedule(optimizer, step: int):
    """What megatron's scheduler does every step: lr and weight decay per group."""
    for group in optimizer.param_groups:
        group["lr"] = LR * (0.5 + 0.1 * step)
        group["weight_decay"] = WEIGHT_DECAY * group["wd_mult"]


def _build(model: _Model):
    """First construction (as get_megatron_optimizer) and DistributedOptimizer's rebuild."""
    cls = _optimizer_class()
    first = cls([_megatron_group(list(model.model_params))], **_upstream_kwargs())
    return cls(params=model.groups(), **first.defaults)


def _train(optimizer, model: _Model, steps: range):
    for step in steps:
        _schedule(optimizer, step)
        model.set_grads(step)
        optimizer.step()
        model.clear_grads()


@pytest.fixture(scope="module")
def process_group():
    """One gloo rank in this process (the DistributedOptimizer methods ask for group ranks)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-rank process group is already initialized")
        yield dist.group.WORLD
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _distributed_optimizer(inner, model: _Model, group) -> DistributedOptimizer:
    """A DistributedOptimizer whose attributes are those __init__ would set for one DP rank
    (``use_precision_aware_optimizer`` + ``optimizer_cpu_offload``, one buffer, one bucket)."""
    opt = object.__new__(DistributedOptimizer)
    opt.optimizer = inner
    opt.config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        bf16=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    )
    assert opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    opt.grad_scaler = None
    opt.init_state_fn = None
    opt.is_stub_optimizer = False
    opt.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    opt.model_chunks = []
    opt.model_param_group_index_map = model.group_index_map()
    # Buffer layout in backward order, as DDP lays it out.
    ranges, start = {}, 0
    for param in reversed(model.model_params):
        ranges[param] = (start, start + param.numel())
        start += param.numel()
    total = start
    param_map = {
        p: {
            "param": Range(0, p.numel()),
            "gbuf_world": Range(*ranges[p]),
            "gbuf_local": Range(*ranges[p]),
            "gbuf_world_in_bucket": Range(*ranges[p]),
        }
        for p in reversed(model.model_params)
    }
    key = (torch.bfloat16, torch.float32)
    opt.gbuf_ranges = [{key: [{"param_map": param_map}]}]
    opt.model_param_gbuf_map = {p: (0, key, 0) for p in model.model_params}
    opt.per_bucket_numel = [{key: [total]}]
    opt.per_bucket_numel_unpadded = [{key: [total]}]
    bucket = types.SimpleNamespace(numel_unpadded=total, grad_data=torch.empty(total))
    opt.buffers = [
        types.SimpleNamespace(
            buckets=[bucket],
            numel_unpadded=total,
            param_index_map={p: (*ranges[p], 0) for p in model.model_params},
            params=list(reversed(model.model_params)),
        )
    ]
    opt.data_parallel_group = group
    opt.data_parallel_group_gloo = group
    opt.data_parallel_group_idx = 0
    opt.distributed_optimizer_instance_id = 0
    return opt


def _model_sharded_state_dict(model: _Model) -> dict:
    """The model's sharded state dict: one ShardedTensor per parameter (replica ids (PP, TP, DP))."""
    return {
        f"layer{i}.weight": ShardedTensor.from_rank_offsets(f"layer{i}.weight", p, replica_id=(0, 0, 0))
        for i, p in enumerate(model.model_params)
    }


def _leaves(tree, path=()):
    """(path, leaf) pairs of a nested dict/list state dict."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _leaves(value, path + (index,))
    else:
        yield path, tree


def _tensor_key(leaf: ShardedTensor):
    flat = leaf.flattened_range
    return ("tensor", leaf.key, leaf.global_offset, None if flat is None else (flat.start, flat.stop))


def _emulated_save(sharded_state_dict) -> dict:
    """Storage of a distributed checkpoint: copies of the sharded tensors' data, of the
    ShardedObjects' data and of the common (plain) values; local non-persistent objects are not
    stored."""
    storage = {}
    for path, leaf in _leaves(sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            storage[_tensor_key(leaf)] = leaf.data.detach().clone()
        elif isinstance(leaf, ShardedObject):
            storage[("object", leaf.key)] = copy.deepcopy(leaf.data)
        elif not isinstance(leaf, LocalNonpersistentObject):
            storage[("common", path)] = copy.deepcopy(leaf)
    return storage


def _emulated_load(sharded_state_dict, storage: dict, in_place: bool):
    """The loaded state dict for a load template: sharded tensors read either into the template's
    own tensors (``in_place``) or into new ones, objects and common values from the storage, and
    each local non-persistent object is the template's object itself."""

    def load(tree, path=()):
        if isinstance(tree, dict):
            return {key: load(value, path + (key,)) for key, value in tree.items()}
        if isinstance(tree, list):
            return [load(value, path + (index,)) for index, value in enumerate(tree)]
        if isinstance(tree, ShardedTensor):
            saved = storage[_tensor_key(tree)]
            if in_place:
                tree.data.copy_(saved)
                return tree.data
            return saved.clone()
        if isinstance(tree, ShardedObject):
            return copy.deepcopy(storage[("object", tree.key)])
        if isinstance(tree, LocalNonpersistentObject):
            return tree.unwrap()
        return copy.deepcopy(storage[("common", path)])

    return load(sharded_state_dict)


def _assert_same_training_state(a, a_model: _Model, b, b_model: _Model):
    for pa, pb in zip(a_model.model_params, b_model.model_params):
        assert torch.equal(pa.detach(), pb.detach())
    for ga, gb in zip(a.param_groups, b.param_groups):
        for pa, pb in zip(ga["params"], gb["params"]):
            sa, sb = a.state[pa], b.state[pb]
            for key in STATE_KEYS + ("step",):
                assert torch.equal(sa[key], sb[key]), key


def _project_distrib_optimizer_patches():
    """This project's run-time patches of DistributedOptimizer (they are active in real runs)."""
    try:
        from megatron.bounded.upstream.patches import PATCHES
    except ImportError:
        return []
    return [p for p in PATCHES if p.module == "megatron.core.optimizer.distrib_optimizer"]


# ------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("bucket_numel", [0, -1, 15, 2.0, True, None])
def test_factory_refuses_bad_bucket_numel(bucket_numel):
    with pytest.raises(ValueError, match="bucket_numel"):
        offload_stream_hybrid_optimizer_class(bucket_numel, 2)


@pytest.mark.parametrize("num_slots", [0, -2, 1.0, True, None])
def test_factory_refuses_bad_num_slots(num_slots):
    with pytest.raises(ValueError, match="num_slots"):
        offload_stream_hybrid_optimizer_class(64, num_slots)


def test_factory_gives_one_configured_hdo_subclass_per_plan():
    cls = offload_stream_hybrid_optimizer_class(1024, 3)
    assert cls is offload_stream_hybrid_optimizer_class(1024, 3)
    assert cls is not offload_stream_hybrid_optimizer_class(1024, 2)
    assert issubclass(cls, HybridDeviceOptimizer) and issubclass(cls, OffloadStreamAdamW)
    optimizer = cls([torch.nn.Parameter(torch.zeros(8))], **_upstream_kwargs())
    assert (optimizer.bucket_numel, optimizer.num_slots) == (1024, 3)
    assert optimizer.defaults["bucket_numel"] == 1024 and optimizer.defaults["num_slots"] == 3


def test_unconfigured_base_class_needs_a_bucket_plan():
    param = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="not configured"):
        OffloadStreamHybridOptimizer([param], **_upstream_kwargs())
    optimizer = OffloadStreamHybridOptimizer([param], bucket_numel=32, num_slots=1, **_upstream_kwargs())
    assert (optimizer.bucket_numel, optimizer.num_slots) == (32, 1)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(offload_fraction=0.5), ValueError, "offload_fraction"),
        (dict(param_update_in_fp32=False), ValueError, "param_update_in_fp32"),
        (dict(bias_correction=False), ValueError, "bias_correction"),
        (dict(cpu_optimizer_cls=torch.optim.SGD), ValueError, "implements AdamW"),
        (dict(momentum=0.9), TypeError, "momentum"),
        (dict(amsgrad=True), ValueError, "amsgrad"),
        (dict(bucket_numel=0), ValueError, "bucket_numel"),
        (dict(num_slots=0), ValueError, "num_slots"),
        (dict(lr=-1.0), ValueError, "learning rate"),
    ],
)
def test_bad_arguments_are_refused(change, error, match):
    kwargs = {**_upstream_kwargs(), **change}
    with pytest.raises(error, match=match):
        _optimizer_class()([torch.nn.Parameter(torch.zeros(8))], **kwargs)


def test_parameters_on_different_devices_are_refused():
    params = [torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8, device="meta"))]
    with pytest.raises(RuntimeError, match="one device"):
        _optimizer_class()(params, **_upstream_kwargs())


def test_upstream_construction_and_rebuild_use_the_bound_class(monkeypatch):
    """Upstream's own construction code builds the bound class with its HDO arguments, and the
    rebuild statement of DistributedOptimizer.__init__ reproduces the configuration."""
    cls = _optimizer_class()
    for module, attribute in HYBRID_DEVICE_OPTIMIZER_BINDINGS:
        monkeypatch.setattr(f"{module}.{attribute}", cls)
    captured = {}

    def distributed_optimizer_stub(optimizer, config, grad_scaler, init_state_fn, **kwargs):
        captured.update(optimizer=optimizer, init_state_fn=init_state_fn)
        return types.SimpleNamespace()

    monkeypatch.setattr(core_optimizer, "DistributedOptimizer", distributed_optimizer_stub)
    config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
        bf16=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    )
    model = _Model(seed=0)
    core_optimizer._get_megatron_optimizer_based_on_param_groups(
        config,
        model_chunks=[],
        param_groups=[_megatron_group(list(model.model_params))],
        pg_collection=types.SimpleNamespace(tp=None),
    )
    first = captured["optimizer"]
    assert type(first) is cls and captured["init_state_fn"] is None
    assert first.host_state_bytes() == 0  # the discarded first instance allocates nothing
    # distrib_optimizer.py: HybridDeviceOptimizer(params=[orig groups], **self.optimizer.defaults)
    rebuilt = distrib_optimizer.HybridDeviceOptimizer(params=model.groups(), **first.defaults)
    assert type(rebuilt) is cls
    assert isinstance(rebuilt, HybridDeviceOptimizer)
    assert rebuilt.defaults == first.defaults
    assert (rebuilt.bucket_numel, rebuilt.num_slots) == (BUCKET, SLOTS)
    group = rebuilt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (LR, WEIGHT_DECAY, BETAS, EPS)
    assert rebuilt.sub_optimizers == []


# ------------------------------------------------------------------------------------- the update


def _regroup(groups, params_by_shard):
    """The same param groups (hyperparameters and order) over other tensors."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params_by_shard[id(s)] for s in g["params"]]}
        for g in groups
    ]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_step_is_bitwise_fused_adamw_on_fp32_masters(grad_dtype):
    model = _Model(seed=0, grad_dtype=grad_dtype)
    optimizer = _build(model)
    # Reference: torch's fused AdamW on fp32 masters initialized from the parameters, with the
    # same groups, fed the fp32 value of the same gradients.
    masters = [s.detach().float().clone().requires_grad_() for s in model.shards]
    reference = torch.optim.AdamW(
        _regroup(optimizer.param_groups, {id(s): m for s, m in zip(model.shards, masters)}),
        lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True,
    )
    for step in range(5):
        for opt in (optimizer, reference):
            _schedule(opt, step)
        model.set_grads(step)
        for master, grad in zip(masters, model.grad_views):
            master.grad = grad.float()
        optimizer.step()
        reference.step()
        model.clear_grads()
        for index, shard in enumerate(model.shards):
            state, ref_state = optimizer.state[shard], reference.state[masters[index]]
            assert torch.equal(state["master_param"], masters[index].detach()), (step, index)
            assert torch.equal(shard, masters[index].detach().to(shard.dtype)), (step, index)
            assert torch.equal(state["exp_avg"], ref_state["exp_avg"]), (step, index)
            assert torch.equal(state["exp_avg_sq"], ref_state["exp_avg_sq"]), (step, index)
            assert float(state["step"]) == float(ref_state["step"]) == step + 1


def test_step_is_bitwise_offload_stream_adamw_fed_through_grad():
    """bf16 decoupled gradients give exactly what OffloadStreamAdamW gives with the same .grad."""
    model = _Model(seed=3, grad_dtype=torch.bfloat16)
    optimizer = _build(model)
    leaves = [torch.nn.Parameter(s.detach().clone()) for s in model.shards]
    plain = OffloadStreamAdamW(
        _regroup(optimizer.param_groups, {id(s): leaf for s, leaf in zip(model.shards, leaves)}),
        lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, bucket_numel=BUCKET, num_slots=SLOTS,
    )
    for step in range(4):
        _schedule(optimizer, step)
        _schedule(plain, step)
        model.set_grads(step)
        for leaf, grad in zip(leaves, model.grad_views):
            leaf.grad = grad.to(leaf.dtype)  # exact for the bf16 leaves; fp32 leaves widen bf16 exactly
        optimizer.step()
        plain.step()
        model.clear_grads()
        for shard, leaf in zip(model.shards, leaves):
            assert torch.equal(shard, leaf.detach()), step
            for key in STATE_KEYS:
                assert torch.equal(optimizer.state[shard][key], plain.state[leaf][key]), (step, key)


def test_state_has_host_master_moments_and_cpu_step():
    model = _Model(seed=0)
    optimizer = _build(model)
    _train(optimizer, model, range(2))
    host = optimizer._host.master
    for shard in model.shards:
        state = optimizer.state[shard]
        assert set(state) == {"master_param", "exp_avg", "exp_avg_sq", "step"}
        for key in STATE_KEYS:
            assert state[key].device.type == "cpu" and state[key].dtype == torch.float32
            assert state[key].shape == shard.shape
        step = state["step"]
        assert step.device.type == "cpu" and step.dtype == torch.float32 and step.dim() == 0
        assert float(step) == 2.0
        # master weights are views of the one flat host buffer (12 B per element in all)
        assert host.data_ptr() <= state["master_param"].data_ptr() < host.data_ptr() + host.numel() * 4
    assert optimizer.host_state_bytes() == 12 * sum(s.numel() for s in model.shards)


def test_gradient_is_decoupled_grad_when_set_else_grad():
    param = torch.nn.Parameter(torch.ones(16))
    optimizer = _optimizer_class()([param], **_upstream_kwargs())
    assert optimizer.grad_of(param) is None
    param.grad = torch.full((16,), 2.0)
    assert optimizer.grad_of(param) is param.grad
    param.decoupled_grad = torch.full((16,), 3.0)
    assert optimizer.grad_of(param) is param.decoupled_grad
    param.decoupled_grad = None
    assert optimizer.grad_of(param) is param.grad


def test_bad_gradients_are_refused():
    param = torch.nn.Parameter(torch.ones(16))
    optimizer = _optimizer_class()([param], **_upstream_kwargs())
    param.decoupled_grad = torch.ones(15)
    with pytest.raises(ValueError, match="15 elements"):
        optimizer.step()
    param.decoupled_grad = torch.ones(16, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        optimizer.step()
    param.decoupled_grad = torch.ones(16).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()
    assert torch.equal(param.detach(), torch.ones(16)) and len(optimizer.state) == 0


def test_zero_grad_clears_decoupled_grad_and_grad():
    model = _Model(seed=0)
    optimizer = _build(model)
    model.set_grads(0)
    model.shards[0].grad = torch.ones_like(model.shards[0])
    optimizer.zero_grad()
    assert all(s.decoupled_grad is None for s in model.shards) and model.shards[0].grad is None
    model.set_grads(1)
    optimizer.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(s.decoupled_grad) == 0 for s in model.shards)


def test_dummy_step_creates_state_without_changing_anything():
    model = _Model(seed=0)
    optimizer = _build(model)
    before = [s.detach().clone() for s in model.shards]
    optimizer.dummy_step()
    for shard, old in zip(model.shards, before):
        assert torch.equal(shard, old)
        state = optimizer.state[shard]
        assert float(state["step"]) == 0.0
        assert torch.equal(state["master_param"], old.float())
        assert torch.count_nonzero(state["exp_avg"]) == 0 and torch.count_nonzero(state["exp_avg_sq"]) == 0
        assert getattr(shard, "decoupled_grad", None) is None
    # After real steps a dummy step changes nothing.
    _train(optimizer, model, range(2))
    snapshot = {k: v.clone() for k, v in optimizer.state[model.shards[0]].items()}
    params = [s.detach().clone() for s in model.shards]
    optimizer.dummy_step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.shards))
    assert all(torch.equal(snapshot[k], v) for k, v in optimizer.state[model.shards[0]].items())


def test_distributed_optimizer_construction_allocates_the_host_state_and_changes_no_step():
    """The project's change to DistributedOptimizer.__init__ gives the inner optimizer its step-0
    state in host memory at construction (not at the first step), and training is bitwise the
    same as with the state created by the first step."""
    from megatron.bounded.upstream.optimizer import allocate_torch_adam_state_at_construction

    def upstream_init(self, inner):  # what the patch wraps: upstream's constructor
        self.optimizer, self.init_state_fn = inner, None

    eager_model, lazy_model = _Model(seed=0), _Model(seed=0)
    eager = _build(eager_model)
    holder = types.SimpleNamespace()
    allocate_torch_adam_state_at_construction(upstream_init)(holder, eager)
    numel = sum(s.numel() for s in eager_model.shards)
    assert eager.host_state_bytes() == 12 * numel
    assert all(float(eager.state[s]["step"]) == 0.0 for s in eager_model.shards)
    lazy = _build(lazy_model)
    assert lazy.host_state_bytes() == 0
    _train(eager, eager_model, range(3))
    _train(lazy, lazy_model, range(3))
    for a, b in zip(eager_model.shards, lazy_model.shards):
        assert torch.equal(a, b)
    for key in ("master_param", "exp_avg", "exp_avg_sq"):
        for a, b in zip(eager_model.shards, lazy_model.shards):
            assert torch.equal(eager.state[a][key], lazy.state[b][key])


def test_update_fp32_param_by_new_param_copies_parameters_into_masters():
    model = _Model(seed=0)
    optimizer = _build(model)
    _train(optimizer, model, range(2))
    with torch.no_grad():
        model.bf16_buffer.mul_(2)
        model.fp32_buffer.add_(1)
    optimizer.update_fp32_param_by_new_param()
    for shard in model.shards:
        assert torch.equal(optimizer.state[shard]["master_param"], shard.detach().float())
    fresh = _build(_Model(seed=1))
    fresh.update_fp32_param_by_new_param()  # no state yet: nothing to update, nothing created
    assert len(fresh.state) == 0


def test_reading_state_waits_for_the_last_write_back(monkeypatch):
    optimizer = _build(_Model(seed=0))
    calls = []
    monkeypatch.setattr(optimizer, "synchronize", lambda: calls.append(1))
    optimizer._writeback_in_flight = True
    optimizer.state
    optimizer.state
    assert calls == [1]


# ------------------------------------------------------------------------------------- state dicts


def test_state_dict_round_trip_is_exact():
    model = _Model(seed=0)
    optimizer = _build(model)
    _train(optimizer, model, range(3))
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "bf16": model.bf16_buffer, "fp32": model.fp32_buffer}, buffer)
    _train(optimizer, model, range(3, 6))

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_model = _Model(seed=5)  # other values everywhere, then the checkpoint
    resumed_model.bf16_buffer.copy_(saved["bf16"])
    resumed_model.fp32_buffer.copy_(saved["fp32"])
    resumed = _build(resumed_model)
    resumed.load_state_dict(saved["optimizer"])
    assert all("step" not in group for group in resumed.param_groups)
    _train(resumed, resumed_model, range(3, 6))
    _assert_same_training_state(optimizer, model, resumed, resumed_model)


def test_state_dict_writes_the_common_step_into_param_groups():
    model = _Model(seed=0)
    optimizer = _build(model)
    fresh = optimizer.state_dict()  # a fresh optimizer gets its state at step 0
    assert [g["step"] for g in fresh["param_groups"]] == [0, 0]
    assert len(fresh["state"]) == len(model.shards)
    _train(optimizer, model, range(3))
    assert [g["step"] for g in optimizer.state_dict()["param_groups"]] == [3, 3]
    assert all("step" not in g for g in optimizer.param_groups)


def test_load_refuses_a_state_of_another_parameter_layout():
    model = _Model(seed=0)
    optimizer = _build(model)
    _train(optimizer, model, range(2))
    good = optimizer.state_dict()
    snapshot = [optimizer.state[s]["exp_avg"].clone() for s in model.shards]

    fewer_groups = {"state": good["state"], "param_groups": good["param_groups"][:1]}
    with pytest.raises(ValueError, match="another parameter layout"):
        optimizer.load_state_dict(fewer_groups)
    moved = copy.deepcopy(good)
    moved["param_groups"][1]["params"].append(moved["param_groups"][0]["params"].pop())
    with pytest.raises(ValueError, match="another parameter layout"):
        optimizer.load_state_dict(moved)
    resized = copy.deepcopy(good)
    first_id = resized["param_groups"][0]["params"][1]
    resized["state"][first_id]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match="another parameter layout"):
        optimizer.load_state_dict(resized)
    # Nothing changed.
    assert all(torch.equal(a, optimizer.state[s]["exp_avg"]) for a, s in zip(snapshot, model.shards))


def test_assigned_state_is_adopted_and_the_step_is_kept():
    model = _Model(seed=0)
    optimizer = _build(model)
    _train(optimizer, model, range(2))
    shard = model.shards[1]
    own_master = optimizer.state[shard]["master_param"]
    assigned = {k: torch.full_like(optimizer.state[shard][k], 0.25 + i) for i, k in enumerate(STATE_KEYS)}
    for key, value in assigned.items():
        optimizer.state[shard][key] = value  # what _set_main_param_and_optimizer_states does
    optimizer.state[shard]["step"] = torch.tensor(99.0)  # a stale step object
    optimizer._sync_hdo_state_to_sub_optimizers()
    state = optimizer.state[shard]
    for key, value in assigned.items():
        assert torch.equal(state[key], value) and state[key] is not value
    assert state["master_param"].data_ptr() == own_master.data_ptr()  # back in the host buffer
    assert float(state["step"]) == 2.0
    wrong = torch.zeros(3)
    optimizer.state[shard]["exp_avg"] = wrong
    with pytest.raises(ValueError, match="another parameter layout"):
        optimizer.step()


# ------------------------------------------------------------------------------------- DistributedOptimizer


def _checkpoint_and_resume(fmt, process_group, in_place, tmp_path):
    reference_model = _Model(seed=0)
    reference = _build(reference_model)
    _train(reference, reference_model, range(6))

    model = _Model(seed=0)
    saving = _distributed_optimizer(_build(model), model, process_group)
    _train(saving.optimizer, model, range(3))
    params_at_save = [p.detach().clone() for p in model.model_params]
    metadata = {"distrib_optim_sharding_type": fmt, "distrib_optim_fully_reshardable_mem_efficient": True}
    if fmt == "dp_zero":
        saving.save_parameter_state(str(tmp_path / "param_state.pt"))
        common = copy.deepcopy(saving.state_dict())
    else:
        storage = _emulated_save(
            saving.sharded_state_dict(_model_sharded_state_dict(model), is_loading=False, metadata=metadata)
        )
    _train(saving.optimizer, model, range(3, 6))  # the saved copy must not follow later steps

    resumed_model = _Model(seed=11)
    with torch.no_grad():
        for param, value in zip(resumed_model.model_params, params_at_save):
            param.copy_(value)
    resuming = _distributed_optimizer(_build(resumed_model), resumed_model, process_group)
    if fmt == "dp_zero":
        resuming.load_state_dict(common)
        resuming.load_parameter_state(str(tmp_path / "param_state.pt"))
    else:
        template = resuming.sharded_state_dict(
            _model_sharded_state_dict(resumed_model), is_loading=True, metadata=metadata
        )
        resuming.load_state_dict(_emulated_load(template, storage, in_place))
    _train(resuming.optimizer, resumed_model, range(3, 6))
    _assert_same_training_state(reference, reference_model, resuming.optimizer, resumed_model)
    _assert_same_training_state(saving.optimizer, model, resuming.optimizer, resumed_model)


# 'fully_sharded_model_space' is left out: megatron-core 0.19.2 cannot build it (its
# ShardedTensors need flattened_range, which dist_checkpointing.mapping now refuses).
FORMATS = ["dp_reshardable", "fully_reshardable", "dp_zero"]


@pytest.mark.parametrize("apex_or_te", [False, True], ids=["torch-adam-path", "apex-te-path"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new-tensors", "in-place"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_distributed_optimizer_checkpoint_resumes_bitwise(fmt, in_place, apex_or_te, process_group, tmp_path, monkeypatch):
    """Save at step 3 through upstream's DistributedOptimizer methods, load into a fresh optimizer
    (other initial values), train steps 4-6: equal bit for bit to training 6 steps uninterrupted."""
    if fmt == "dp_zero" and in_place:
        pytest.skip("the legacy format has no load template")
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", apex_or_te)
    _checkpoint_and_resume(fmt, process_group, in_place, tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_resumes_bitwise_with_the_project_patches(fmt, process_group, tmp_path, monkeypatch):
    """The same with this project's run-time patches of DistributedOptimizer installed (one of
    them replaces every ``step`` tensor after a load)."""
    patches = _project_distrib_optimizer_patches()
    if not patches:
        pytest.skip("no run-time patch of DistributedOptimizer in this tree")
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    for patch in patches:
        monkeypatch.setattr(patch.owner(), patch.attribute.split(".")[-1], patch.make_replacement(patch.target()))
    _checkpoint_and_resume(fmt, process_group, True, tmp_path)


@pytest.mark.parametrize("apex_or_te", [False, True], ids=["torch-adam-path", "apex-te-path"])
def test_distributed_optimizer_state_dict_carries_the_step(apex_or_te, process_group, monkeypatch):
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", apex_or_te)
    model = _Model(seed=0)
    opt = _distributed_optimizer(_build(model), model, process_group)
    fresh = opt.state_dict()  # upstream asserts on a missing step without Apex/TE
    assert [g["step"] for g in fresh["optimizer"]["param_groups"]] == [0, 0]
    _train(opt.optimizer, model, range(4))
    assert [g["step"] for g in opt.state_dict()["optimizer"]["param_groups"]] == [4, 4]
    # A fresh optimizer loading it gets step 4 everywhere.
    other = _Model(seed=1)
    loaded = _distributed_optimizer(_build(other), other, process_group)
    loaded.load_state_dict(opt.state_dict())
    assert all(float(loaded.optimizer.state[s]["step"]) == 4.0 for s in other.shards)


def test_parameter_state_tensors_are_the_host_state(process_group):
    """What the checkpoint formats read per parameter: fp32 host tensors, never GPU copies."""
    model = _Model(seed=0)
    opt = _distributed_optimizer(_build(model), model, process_group)
    _train(opt.optimizer, model, range(1))
    inner = opt.optimizer
    for param, (group, order) in opt.model_param_group_index_map.items():
        shard = inner.param_groups[group]["params"][order]
        tensors = opt._get_main_param_and_optimizer_states(param)
        assert set(tensors) == {"param", "exp_avg", "exp_avg_sq", "step"}
        assert tensors["param"] is inner.state[shard]["master_param"]
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert tensors[key].device.type == "cpu" and tensors[key].dtype == torch.float32


# ------------------------------------------------------------------------------------- on a GPU


class _FusedAdamW(torch.optim.AdamW):
    """torch's AdamW with the fused kernel: the GPU-resident reference with the same arithmetic.

    megatron-core builds ``torch.optim.AdamW`` without ``fused`` (the foreach kernel on CUDA,
    whose rounding differs: p*(1-lr*wd) and lerp instead of the fused kernel's expressions)."""

    def __init__(self, params, **kwargs):
        kwargs.setdefault("fused", True)
        super().__init__(params, **kwargs)


def _gpu_model_and_optimizer(offload: bool, seed: int):
    """A small bf16 + fp32 model under megatron's DDP and get_megatron_optimizer on one GPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    class Tiny(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            generator = torch.Generator().manual_seed(seed)
            up = torch.randn(1024, 512, generator=generator) * 0.02
            down = torch.randn(512, 1024, generator=generator) * 0.02
            self.up = torch.nn.Parameter(up.to("cuda", torch.bfloat16))
            self.down = torch.nn.Parameter(down.to("cuda", torch.bfloat16))
            self.scale = torch.nn.Parameter(torch.ones(512, device="cuda"))  # an fp32 parameter

        def forward(self, x):
            return (torch.relu(x @ self.up.t()) @ self.down.t()).float() * self.scale

    config = TransformerConfig(
        num_layers=1, hidden_size=512, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=300_000
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Tiny(config))
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.1,
        bf16=True,
        clip_grad=1.0,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=offload,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=1.0,
    )
    return model, core_optimizer.get_megatron_optimizer(optimizer_config, [model])


def _gpu_train(model, optimizer, steps):
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        x = torch.randn(64, 512, generator=generator).to("cuda", torch.bfloat16)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        model.finish_grad_sync()
        update_successful, _, _ = optimizer.step()
        assert update_successful


def _real_distributed_optimizer_body(checkpoint_dir: str, port: int) -> None:
    """Runs in a fresh process (own NCCL process group and model-parallel state)."""
    from megatron.core import dist_checkpointing, parallel_state

    cls = offload_stream_hybrid_optimizer_class(65_536, 2)
    distrib_optimizer.HybridDeviceOptimizer = cls  # the two bindings; this process is disposable
    core_optimizer.HybridDeviceOptimizer = cls
    torch.optim.AdamW = _FusedAdamW  # megatron builds torch.optim.AdamW(...) by that name
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    try:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        base_model, baseline = _gpu_model_and_optimizer(False, seed=0)
        _gpu_train(base_model, baseline, range(4))
        torch.cuda.synchronize()
        baseline_bytes = torch.cuda.memory_allocated() - start
        assert isinstance(baseline.chained_optimizers[0].optimizer, _FusedAdamW)

        start = torch.cuda.memory_allocated()
        model, optimizer = _gpu_model_and_optimizer(True, seed=0)
        inner = optimizer.chained_optimizers[0].optimizer
        assert type(inner) is cls
        _gpu_train(model, optimizer, range(2))
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        dist_checkpointing.save(optimizer.sharded_state_dict({}, metadata=metadata), checkpoint_dir)
        params_at_save = [p.detach().clone() for p in model.parameters()]
        _gpu_train(model, optimizer, range(2, 4))
        torch.cuda.synchronize()
        offload_bytes = torch.cuda.memory_allocated() - start

        for p, q in zip(base_model.parameters(), model.parameters()):
            assert torch.equal(p, q), "differs from the GPU-resident fused AdamW"
        numel = sum(p.numel() for p in model.parameters())
        for group in inner.param_groups:
            for param in group["params"]:
                assert all(t.device.type == "cpu" for t in inner.state[param].values())
        assert inner.staging_bytes() > 0
        # fp32 master + exp_avg + exp_avg_sq: 12 B per element on the GPU in the baseline only
        # (1 MiB for its device-side step counters and allocator rounding).
        assert offload_bytes <= baseline_bytes - 12 * numel + inner.staging_bytes() + MiB, (
            offload_bytes, baseline_bytes, numel, inner.staging_bytes()
        )

        resumed_model, resumed = _gpu_model_and_optimizer(True, seed=1)
        with torch.no_grad():
            for param, value in zip(resumed_model.parameters(), params_at_save):
                param.copy_(value)
        template = resumed.sharded_state_dict({}, is_loading=True, metadata=metadata)
        resumed.load_state_dict(dist_checkpointing.load(template, checkpoint_dir))
        _gpu_train(resumed_model, resumed, range(2, 4))
        for p, q in zip(model.parameters(), resumed_model.parameters()):
            assert torch.equal(p, q), "the resumed run differs"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _report_to(queue, fn, *args) -> None:
    import traceback

    try:
        fn(*args)
        queue.put(None)
    except BaseException:  # every failure, assertion errors included, goes back to the test
        queue.put(traceback.format_exc())


@pytest.mark.gpu
@requires_cuda
def test_real_distributed_optimizer_on_one_gpu(tmp_path):
    """The real DistributedOptimizer with the bound class: its inner state is on the host only
    (12 B per element less GPU memory, plus the staging), bitwise equal to the GPU-resident
    optimizer with torch's fused AdamW, and a dp_reshardable checkpoint through megatron's
    dist_checkpointing resumes bitwise."""
    if not core_optimizer.USING_PYTORCH_OPTIMIZER:
        pytest.skip("the GPU-resident reference is Apex/TE FusedAdam here, not torch's fused AdamW")
    checkpoint_dir = tmp_path / "checkpoint"
    checkpoint_dir.mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(
        target=_report_to, args=(queue, _real_distributed_optimizer_body, str(checkpoint_dir), port)
    )
    process.start()
    try:
        failure = queue.get(timeout=600)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert failure is None, failure


def _torch_adamw_distributed_optimizer(model: _Model, group):
    """Upstream's torch-AdamW path (no Apex/TE): inner torch AdamW on fp32 masters."""
    masters = [shard.detach().float().clone() for shard in model.shards]
    groups = _regroup(model.groups(), {id(s): m for s, m in zip(model.shards, masters)})
    inner = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    optimizer = _distributed_optimizer(inner, model, group)
    optimizer.config = OptimizerConfig(optimizer="adam", lr=LR, bf16=True, use_distributed_optimizer=True)

    def init_state_fn(opt, config=None):  # what upstream hands the distributed optimizer
        for group_ in opt.param_groups:
            for param in group_["params"]:
                if len(opt.state[param]) == 0:
                    opt.state[param]["exp_avg"] = torch.zeros_like(param)
                    opt.state[param]["exp_avg_sq"] = torch.zeros_like(param)

    optimizer.init_state_fn = init_state_fn
    return optimizer, masters


def _torch_adamw_steps(optimizer, model: _Model, masters, steps):
    for step in steps:
        _schedule(optimizer.optimizer, step)
        model.set_grads(step)
        for master, grad in zip(masters, model.grad_views):
            master.grad = grad.float().clone()
        optimizer.optimizer.step()


def test_torch_adamw_resume_with_the_project_patches_keeps_each_step(process_group, monkeypatch):
    """The GPU-resident path (plain torch AdamW, no Apex/TE) with this project's patches: after a
    load every parameter has its own step counter holding the saved step, and training goes on
    bit for bit as if uninterrupted (upstream alone cannot even build the load template)."""
    patches = _project_distrib_optimizer_patches()
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    for patch in patches:
        monkeypatch.setattr(patch.owner(), patch.attribute.split(".")[-1], patch.make_replacement(patch.target()))
    reference_model = _Model(seed=0)
    reference, reference_masters = _torch_adamw_distributed_optimizer(reference_model, process_group)
    _torch_adamw_steps(reference, reference_model, reference_masters, range(6))

    model = _Model(seed=0)
    saving, masters = _torch_adamw_distributed_optimizer(model, process_group)
    _torch_adamw_steps(saving, model, masters, range(3))
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}  # the torch_dist default
    storage = _emulated_save(saving.sharded_state_dict({}, is_loading=False, metadata=metadata))
    resumed_model = _Model(seed=1)
    resumed, resumed_masters = _torch_adamw_distributed_optimizer(resumed_model, process_group)
    template = resumed.sharded_state_dict({}, is_loading=True, metadata=metadata)
    resumed.load_state_dict(_emulated_load(template, storage, False))
    steps = [state["step"] for state in resumed.optimizer.state.values()]
    assert [float(step) for step in steps] == [3.0] * len(steps)
    assert len({id(step) for step in steps}) == len(steps), "parameters share a step counter"
    with torch.no_grad():  # the model weights come from the model checkpoint, not from here
        for resumed_master, master in zip(resumed_masters, masters):
            resumed_master.copy_(master)
    _torch_adamw_steps(resumed, resumed_model, resumed_masters, range(3, 6))
    for resumed_master, reference_master in zip(resumed_masters, reference_masters):
        assert torch.equal(resumed_master, reference_master)
