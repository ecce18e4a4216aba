"""Real ``torch_dist`` checkpoints on CPU (2 gloo ranks, expert parallelism 2): megatron-core's
own save and load of a small MoE GPT, so that a missing run-time dependency of the writer (it
imports ``psutil`` while saving) fails here, and the torch-native grouped experts and upstream's
``SequentialMLP`` load each other's checkpoints (switching ``--bounded-moe-backend``,
``--moe-expert-rank-capacity-factor`` or ``--pipelined-llep`` between save and resume)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.unit.distributed import run_on_ranks

NUM_EXPERTS, LAYERS, HIDDEN, FFN = 4, 2, 16, 8


def cpu_checkpointing() -> None:
    """Let megatron-core's torch_dist writer run without a GPU (this worker process only).

    Two calls of the save path assume CUDA: the writer's preload waits for its device-to-host
    copies with ``torch.cuda.synchronize()`` (filesystem_async.py, preload_tensors; there are
    no device copies of CPU tensors to wait for), and the save's finalize all-reduces a failure
    flag placed on ``torch.cuda.current_device()`` (state_dict_saver.py; on gloo the flag lives
    on the CPU). Nothing else is stubbed: planning, writing, metadata and loading are upstream's.
    """
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def _config(gated: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=32, num_attention_heads=2,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN,
        expert_model_parallel_size=2, gated_linear_unit=gated, add_bias_linear=False,
        bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
    )


def build_moe_gpt(experts: str, gated: bool, seed: int):
    """A 2-layer MoE GPT whose experts are ``"grouped"`` (ours) or ``"sequential"`` (upstream)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.bounded.moe.moe_layer import bounded_moe_submodules

    config = _config(gated)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    if experts == "grouped":
        spec.submodules.mlp = bounded_moe_submodules(config, experts="grouped")
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=64, max_sequence_length=16)


def expert_weights(model) -> list:
    """Per layer, this rank's experts as (fc1 [out, in], fc2 [out, in]) whatever the class."""
    layers = []
    for layer in model.decoder.layers:
        experts = layer.mlp.experts
        if hasattr(experts, "weight1"):
            layers.append([(experts.weight1[e].t(), experts.weight2[e].t())
                           for e in range(experts.num_local_experts)])
        else:
            layers.append([(local.linear_fc1.weight, local.linear_fc2.weight)
                           for local in experts.local_experts])
    return layers


def other_weights(model) -> dict:
    return {name: param for name, param in model.named_parameters() if ".experts." not in name}


def same_weights(a, b) -> bool:
    experts_equal = all(
        torch.equal(x, y)
        for layer_a, layer_b in zip(expert_weights(a), expert_weights(b))
        for pair_a, pair_b in zip(layer_a, layer_b)
        for x, y in zip(pair_a, pair_b)
    )
    others_a, others_b = other_weights(a), other_weights(b)
    return experts_equal and others_a.keys() == others_b.keys() and all(
        torch.equal(others_a[name], others_b[name]) for name in others_a
    )


def optimizer_like(model, scale: float) -> dict:
    """The model's sharded state dict re-keyed and re-pointed at other tensors, the way the
    distributed optimizer's model-space format (``--dist-ckpt-optim-fully-reshardable``) saves
    Adam moments: same sharding, key ``optimizer.state.exp_avg.<model key>``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    params = dict(model.named_parameters())
    state = {}
    for name, sharded in model.sharded_state_dict().items():
        if isinstance(sharded, (list, ShardedObject)) or name not in params:
            continue
        state[name] = dataclasses.replace(
            sharded, key=f"optimizer.state.exp_avg.{sharded.key}",
            data=(params[name].detach() * scale).clone(),
        )
    return state


def _round_trips(rank, world_size, root):
    import os

    from megatron.core import dist_checkpointing, parallel_state

    cpu_checkpointing()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    results = {}
    try:
        for gated in (True, False):
            saved = {}
            for kind in ("grouped", "sequential"):
                model = build_moe_gpt(kind, gated, seed=10 + (kind == "grouped"))
                directory = os.path.join(root, f"{kind}-{gated}")
                if rank == 0:
                    os.makedirs(directory)
                torch.distributed.barrier()
                dist_checkpointing.save(model.sharded_state_dict(), directory)
                moments = os.path.join(directory, "moments")
                if rank == 0:
                    os.makedirs(moments)
                torch.distributed.barrier()
                dist_checkpointing.save(optimizer_like(model, 3.0), moments)
                saved[kind] = (model, directory)
            for source in ("grouped", "sequential"):
                for target in ("grouped", "sequential"):
                    model, directory = saved[source]
                    resumed = build_moe_gpt(target, gated, seed=99)
                    assert not same_weights(model, resumed)  # the load has something to do
                    loaded = dist_checkpointing.load(resumed.sharded_state_dict(), directory)
                    resumed.load_state_dict(loaded)  # strict: every key of the module is restored
                    weights = same_weights(model, resumed)
                    template = optimizer_like(resumed, 0.0)
                    moments = dist_checkpointing.load(template, os.path.join(directory, "moments"))
                    params = dict(resumed.named_parameters())
                    expected = build_moe_gpt(source, gated, seed=0)
                    with torch.no_grad():
                        for name, tensor in moments.items():
                            params[name].copy_(tensor)
                        for param, saved_param in zip(expected.parameters(), model.parameters()):
                            param.copy_(saved_param * 3.0)
                    results[(gated, source, target)] = {
                        "weights": weights,
                        "moments": same_weights(expected, resumed),
                        "files": sorted(os.listdir(directory)),
                    }
    finally:
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist_checkpoint"))
    # daemon=False: the torch_dist writer starts a helper process of its own
    return run_on_ranks(_round_trips, 2, args=(root,), timeout_s=420, daemon=False)


CASES = [(gated, source, target) for gated in (True, False)
         for source in ("grouped", "sequential") for target in ("grouped", "sequential")]


def test_torch_dist_checkpoint_is_written_by_every_expert_rank(round_trips):
    files = round_trips[0][(True, "grouped", "grouped")]["files"]
    assert ".metadata" in files and "metadata.json" in files
    # both expert-parallel ranks hold experts of their own, so both write a shard file
    assert any(name.startswith("__0_") for name in files)
    assert any(name.startswith("__1_") for name in files)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'swiglu' if c[0] else 'gelu'}-{c[1]}-to-{c[2]}")
def test_weights_and_model_space_moments_resume_across_expert_backends(round_trips, case):
    for rank, result in enumerate(round_trips):
        assert result[case]["weights"], f"rank {rank}: loaded weights differ from the saved ones"
        assert result[case]["moments"], f"rank {rank}: model-space optimizer state differs"


def _moe_args(**overrides):
    from argparse import Namespace

    values = dict(num_experts=4, moe_expert_rank_capacity_factor=None, bounded_moe_backend="auto",
                  pipelined_llep=False, transformer_impl="local", use_distributed_optimizer=True,
                  no_load_optim=False, finetune=False, moe_token_dispatcher_type="alltoall",
                  non_persistent_ckpt_type=None, ckpt_step=None, verify_checkpoint=False)
    values.update(overrides)
    return Namespace(**values)


@pytest.mark.parametrize("saved,resumed,sharding,refused", [
    (dict(moe_expert_rank_capacity_factor=1.5), {}, "dp_reshardable", True),
    ({}, dict(pipelined_llep=True), None, True),  # no metadata: upstream's default bucket format
    ({}, dict(bounded_moe_backend="torch"), "dp_reshardable", True),
    (dict(moe_expert_rank_capacity_factor=1.5), {}, "fully_reshardable", False),
    (dict(moe_expert_rank_capacity_factor=1.5), dict(no_load_optim=True), "dp_reshardable", False),
    (dict(moe_expert_rank_capacity_factor=1.5), dict(pipelined_llep=True), "dp_reshardable", False),
    ({}, dict(moe_expert_rank_capacity_factor=1.5, bounded_moe_backend="upstream"),
     "dp_reshardable", False),
])
def test_bucket_format_optimizer_state_is_refused_across_expert_classes(saved, resumed, sharding,
                                                                        refused):
    """The load patch: weights resume across expert classes, but a distributed-optimizer state in
    a bucket format would load silently into the wrong parameters, so it is refused."""
    from megatron.bounded.upstream.checkpointing import verify_checkpoint_before_load

    state_dict = {"args": _moe_args(**saved)}
    if sharding is not None:
        state_dict["content_metadata"] = {"distrib_optim_sharding_type": sharding}
    load = verify_checkpoint_before_load(lambda *a, **k: (state_dict, "dir", False, None))
    if refused:
        with pytest.raises(RuntimeError, match="--no-load-optim.*--dist-ckpt-optim-fully-reshardable"):
            load(None, _moe_args(**resumed), rank0=True)
    else:
        assert load(None, _moe_args(**resumed), rank0=True)[0] is state_dict
