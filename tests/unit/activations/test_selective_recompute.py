"""Upstream's selective recompute (``--recompute-granularity selective --recompute-modules``) in
the layers of the local implementation (megatron.bounded.activations.selective_recompute), on
CPU: every module gives the losses and gradients of the model without it and keeps fewer bytes
for backward (counted with ``torch.autograd.graph.saved_tensors_hooks``); the grouped experts
never keep their activation (``moe_act``); the memory budget's per-layer saving of ``layernorm``
and ``moe_act`` is what the hooks count on a one-layer model.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.conftest import one_cpu_rank, small_bounded_gpt
from tests.unit.distributed import run_on_ranks

VOCAB, SEQ, BATCH = 64, 24, 2
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1,
           bounded_moe_backend="torch", moe_grouped_gemm=True)
SHARED = dict(moe_shared_expert_intermediate_size=16)
FIRST_DENSE = dict(moe_layer_freq=[0, 1])
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, rope_type="rope")
NO_Q_LORA = dict(q_lora_rank=None, qk_layernorm=False)


def saved_bytes(run, exclude=()):
    """``(run(), bytes)``: the bytes of every storage a tensor saved for backward during
    ``run()`` holds once it returns (a storage an output-discarding checkpoint freed counts 0),
    each storage once, those of ``exclude`` (parameters, inputs) left out."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in excluded:
            continue
        storages[storage.data_ptr()] = storage.nbytes()
    return result, sum(storages.values())


def _losses_grads_and_bytes(config, modules):
    """A two-layer GPT's per-token losses, parameter gradients and the bytes its forward saves,
    with selective recompute of ``modules`` (None: without recompute)."""
    if modules is not None:
        config = dict(config, recompute_granularity="selective", recompute_modules=list(modules))
    model = small_bounded_gpt(SEQ, VOCAB, **config)
    model.train()
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand_as(inputs)
    losses, nbytes = saved_bytes(
        lambda: model(inputs, positions, attention_mask=None, labels=labels),
        exclude=list(model.parameters()))
    losses.sum().backward()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}, nbytes


# (model, modules): every module of upstream's list on a model that has its part
CASES = {
    "core_attn": (MOE, ["core_attn"]),
    "layernorm": (MOE, ["layernorm"]),
    "moe": (MOE, ["moe"]),
    "shared_experts": ({**MOE, **SHARED}, ["shared_experts"]),
    "mlp": ({**MOE, **FIRST_DENSE}, ["mlp"]),
    "moe_act": (MOE, ["moe_act"]),
    "mla_up_proj": ({**MOE, **MLA}, ["mla_up_proj"]),
    "mla_up_proj-no-q-lora": ({**MOE, **MLA, **NO_Q_LORA}, ["mla_up_proj"]),
    "mla-all": ({**MOE, **MLA, **SHARED}, ["core_attn", "layernorm", "mla_up_proj", "moe_act",
                                           "shared_experts"]),
}


def _every_module(rank, world_size):
    from megatron.bounded.upstream import patches

    results = {}
    with one_cpu_rank():
        patches.apply_patches()  # as pretrain_gpt.py does
        for name, (config, modules) in CASES.items():
            losses, grads, plain = _losses_grads_and_bytes(config, None)
            got_losses, got_grads, recomputed = _losses_grads_and_bytes(config, modules)
            assert got_grads.keys() == grads.keys()
            torch.testing.assert_close(got_losses, losses, rtol=1e-13, atol=0, msg=name)
            for param, grad in grads.items():
                if grad is None:
                    assert got_grads[param] is None, (name, param)
                    continue
                torch.testing.assert_close(got_grads[param], grad, rtol=1e-11, atol=1e-14,
                                           msg=f"{name}: {param}")
            results[name] = (plain, recomputed)
    return results


@pytest.fixture(scope="module")
def every_module():
    return run_on_ranks(_every_module, 1, timeout_s=600)[0]


@pytest.mark.parametrize("name", [name for name in CASES if name != "moe_act"])
def test_module_recomputes_exactly_and_keeps_fewer_bytes(every_module, name):
    """Losses and every gradient as without recompute (fp64, within rounding: the recompute
    runs the same operations), and fewer bytes kept for backward."""
    plain, recomputed = every_module[name]
    assert recomputed < plain, (name, plain, recomputed)


def test_moe_act_changes_nothing_in_the_grouped_experts(every_module):
    """The grouped experts recompute their activation whether moe_act is asked or not (below):
    asking keeps the same bytes and gives the same gradients."""
    plain, recomputed = every_module["moe_act"]
    assert recomputed == plain


def test_mla_up_proj_frees_what_attention_keeps_of_q_k_and_v(every_module):
    """Multi-latent attention's up-projections run under upstream's output-discarding
    checkpoint: q, k and v are freed after the core attention. The CPU's attention keeps scaled
    copies of q and k and v itself, so at least v is freed per token and layer (a GPU's flash
    kernel keeps q and k themselves, which are freed too)."""
    value = BATCH * SEQ * 2 * 4 * MLA["v_head_dim"] * 8  # tokens × layers × heads × v × fp64
    for name in ("mla_up_proj", "mla_up_proj-no-q-lora"):
        plain, recomputed = every_module[name]
        assert plain - recomputed >= value, (name, plain, recomputed)


# --- moe_act: the grouped experts never keep their activation ----------------------------------

ROWS, HIDDEN, FFN, EXPERTS = 10, 16, 8, 3


def _experts_against_sequential_mlp(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bounded.moe.experts import GroupedExperts

    parallel_state.initialize_model_parallel(1, 1)
    try:
        pg = get_default_pg_collection()
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
            moe_router_topk=2, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
            params_dtype=torch.float64, moe_grouped_gemm=True,
            recompute_granularity="selective", recompute_modules=["moe_act"])
        torch.manual_seed(0)
        upstream = SequentialMLP(EXPERTS, config, MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=pg)
        ours = GroupedExperts(EXPERTS, config, pg_collection=pg)
        ours.load_from_sequential_mlp(upstream)
        generator = torch.Generator().manual_seed(1)
        rows = torch.randn(ROWS, HIDDEN, dtype=torch.float64, generator=generator)
        probs = torch.rand(ROWS, dtype=torch.float64, generator=generator)
        grad = torch.randn(ROWS, HIDDEN, dtype=torch.float64, generator=generator)
        counts = torch.tensor([4, 0, 6])
        results = {}
        for name, experts in (("upstream", upstream), ("ours", ours)):
            x, p = rows.clone().requires_grad_(), probs.clone().requires_grad_()
            (out, _), nbytes = saved_bytes(lambda: experts(x, counts, p),
                                           exclude=[x, p, *experts.parameters()])
            (out * grad).sum().backward()
            weights = (torch.stack([e.linear_fc1.weight.grad.t() for e in experts.local_experts])
                       if name == "upstream" else experts.weight1.grad)
            results[name] = (out.detach(), x.grad, p.grad, weights, nbytes)
    finally:
        parallel_state.destroy_model_parallel()
    return results


def test_grouped_experts_recompute_their_activation():
    """With moe_act the grouped experts equal upstream's experts (outputs, input, probability
    and weight gradients), and keep for backward only the fc1 output besides their inputs and
    the experts' offsets: at least the activation output (rows × F) less than upstream's."""
    results = run_on_ranks(_experts_against_sequential_mlp, 1, timeout_s=120)[0]
    *want, upstream_bytes = results["upstream"]
    *got, our_bytes = results["ours"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    fc1, offsets = ROWS * 2 * FFN * 8, EXPERTS * 4
    assert our_bytes == fc1 + offsets
    assert upstream_bytes - our_bytes >= ROWS * FFN * 8


# --- the memory budget's saving against the bytes the hooks count ---------------------------

HIDDEN_SIZE, HEADS, GROUPS, KV, FFN_MOE, TOPK = 32, 4, 2, 8, 16, 2


def _one_layer_bytes(rank, world_size):
    """Bytes a one-layer MoE GPT's layer keeps for backward (fp32, LayerNorm, the grouped
    experts), without recompute and with each module set; and what its experts keep."""
    from megatron.bounded.upstream import patches

    results = {}
    with one_cpu_rank():
        patches.apply_patches()
        for modules in (None, ("layernorm",), ("moe_act",)):
            config = dict(MOE, normalization="LayerNorm", params_dtype=torch.float32, num_layers=1)
            if modules:
                config.update(recompute_granularity="selective", recompute_modules=list(modules))
            layer = small_bounded_gpt(SEQ, VOCAB, **config).float().decoder.layers[0]
            layer.train()
            hidden = torch.randn(SEQ, BATCH, HIDDEN_SIZE, requires_grad=True)
            experts_saved = []
            experts = layer.mlp.experts
            counted = experts.register_forward_hook(
                lambda module, inputs, output: experts_saved.append(inputs))
            (out, _), nbytes = saved_bytes(lambda: layer(hidden, attention_mask=None),
                                           exclude=[hidden, *layer.parameters()])
            counted.remove()
            rows, tokens_per_expert, probs = experts_saved[0]
            _, expert_bytes = saved_bytes(lambda: experts(rows.detach(), tokens_per_expert,
                                                          probs.detach()),
                                          exclude=list(experts.parameters()))
            out.sum().backward()
            results[modules] = (nbytes, expert_bytes, rows.shape[0])
    return results


def _budget_args(modules):
    """The one-layer model of :func:`_one_layer_bytes` as the budget reads its flags."""
    return argparse.Namespace(
        num_layers=1, hidden_size=HIDDEN_SIZE, ffn_hidden_size=64, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=KV,
        seq_length=SEQ, max_position_embeddings=SEQ, micro_batch_size=BATCH,
        position_embedding_type="rope", normalization="LayerNorm", swiglu=True,
        add_bias_linear=False, num_experts=4, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN_MOE,
        moe_layer_freq=1, moe_grouped_gemm=True, bounded_moe_backend="torch",
        world_size=1, data_parallel_size=1, vocab_size=VOCAB,
        recompute_granularity="selective" if modules else None,
        recompute_modules=list(modules) if modules else None)


def test_budget_savings_are_the_bytes_the_hooks_count():
    """layernorm: the layer keeps N·2·H·b fewer bytes, the budget's per-layer saving, and the
    norms' per-token mean and 1/std (fp32 each), which the budget's count of a layer leaves out;
    moe_act: the same bytes with and without (the budget's saving is 0), and the grouped experts
    keep rows·(H + fc1)·b, the budget's routed-row width, besides each row's routing probability
    (fp32) and the experts' offsets, which the budget leaves out."""
    from megatron.bounded import budget as B
    from megatron.bounded.budget import widths as W

    measured = run_on_ranks(_one_layer_bytes, 1, timeout_s=300)[0]
    tokens = SEQ * BATCH
    plain = B.estimate(_budget_args(None))
    for modules in (("layernorm",), ("moe_act",)):
        budget = B.estimate(_budget_args(modules))
        budget_saving = plain.terms["layer_activations"] - budget.terms["layer_activations"]
        cut = W.selective_savings(budget.config)
        assert budget_saving == tokens * (cut["attention"] + cut["moe_tokens"])
        hooks_saving = measured[None][0] - measured[modules][0]
        norm_statistics = tokens * 2 * 2 * 4 if "layernorm" in modules else 0
        assert hooks_saving == budget_saving + norm_statistics, (modules, hooks_saving)
    assert W.selective_savings(B.estimate(_budget_args(("layernorm",))).config)["attention"] \
        == 2 * HIDDEN_SIZE * 4
    row_saved = W.activation_widths(plain.config)["row_saved"]
    for modules, (_, expert_bytes, rows) in measured.items():
        assert rows == tokens * TOPK  # dropless: each token's top-k rows
        assert expert_bytes == rows * row_saved + rows * 4 + 4 * 4, modules
