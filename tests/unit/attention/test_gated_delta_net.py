"""Gated DeltaNet layers without Transformer Engine (``megatron/bounded/attention/gated_delta_net.py``).

* the chunked gated delta rule equals a float64 token-by-token recurrence (outputs and
  gradients; chunk sizes 1 to 64, lengths not a multiple of the chunk, an initial state), and
  with ``cu_seqlens`` the recurrence reset at each document start;
* the whole token mixer (input norm, projections, short convolution, gates, gated output norm,
  output projection) equals transformers' Qwen3-Next gated DeltaNet layer after its input norm,
  weights copied by name, forward and backward, with float64 and float32 weights (to float32's
  precision: transformers computes its norms, the decay and the rule in float32);
* over packed documents (float64) the token mixer gives each document the outputs and gradients
  of that document alone, the convolution's first rows and the chunks' documents included, and
  one document's inputs change no other document's outputs, bitwise;
* a Qwen3-Next-shaped model (3 gated DeltaNet layers : 1 full-attention layer, gated attention
  output, partial rotary, zero-centred norms, MoE with a gated shared expert) goes through
  ``pretrain_gpt.py``'s parsing, builds the layers the flags ask for and trains a step on CPU,
  also over packed documents (``--reset-attention-mask``);
* the options that do not run here are refused before the model is built, naming the flag.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.bounded.attention.gated_delta_rule import chunk_gated_delta_rule
from tests.conftest import one_cpu_rank
from tests.unit.distributed import run_on_ranks
from megatron.bounded.units import ceil_div


def recurrent_reference(q, k, v, g, beta, scale, initial_state=None, starts=()):
    """The gated delta rule token by token in float64: ``S ← e^g S; u = β (v − Sᵀk);
    S ← S + k uᵀ; o = Sᵀ (scale · q)``, ``S`` back to 0 before each token of ``starts``
    (document starts); returns (outputs [b, t, h, dv], final state)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    batch, tokens, heads, dk = k.shape
    state = (torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float64)
             if initial_state is None else initial_state.double())
    outputs = []
    for t in range(tokens):
        if t in starts:
            state = torch.zeros_like(state)
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    return torch.stack(outputs, dim=1), state


def _rule_inputs(tokens, dtype, seed=0, heads=3, dk=8, dv=6, batch=2):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator)

    q = F.normalize(draw(batch, tokens, heads, dk), dim=-1)
    k = F.normalize(draw(batch, tokens, heads, dk), dim=-1)
    v = draw(batch, tokens, heads, dv)
    # decays from strong (e^-3) to none, β across (0, 1)
    g = -3 * torch.rand(batch, tokens, heads, dtype=torch.float64, generator=generator)
    beta = torch.rand(batch, tokens, heads, dtype=torch.float64, generator=generator)
    return [x.to(dtype).requires_grad_(True) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("chunk_size,tokens", [(1, 9), (4, 37), (16, 37), (16, 48), (64, 100)])
def test_chunked_rule_equals_the_float64_recurrence(chunk_size, tokens):
    inputs = _rule_inputs(tokens, torch.float64)
    initial = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    scale = 8 ** -0.5
    out, final = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size, initial_state=initial,
                                        output_final_state=True)
    ref_inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    want, want_final = recurrent_reference(*ref_inputs, scale=scale, initial_state=initial)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    for name, got, ref in zip("q k v g beta".split(), inputs, ref_inputs):
        assert ref.grad.abs().max() > 0, name  # every input reaches the output
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-9, atol=1e-11, msg=name)


# documents of 1, 2 and 3 tokens (fewer than a chunk, some fewer than the convolution's taps),
# one of 16, then ones that are no multiple of any chunk, across chunk boundaries
DOCUMENT_LENGTHS = (1, 2, 3, 16, 21, 40, 5)


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunked_rule_over_documents_equals_the_recurrence_reset_at_each_start(chunk_size):
    """With ``cu_seqlens``, outputs and gradients equal the float64 recurrence whose state
    returns to 0 at every document start."""
    inputs = _rule_inputs(sum(DOCUMENT_LENGTHS), torch.float64, seed=7, batch=1)
    offsets = torch.tensor((0, *DOCUMENT_LENGTHS)).cumsum(0)
    out, _ = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size, cu_seqlens=offsets)
    ref_inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    want, _ = recurrent_reference(*ref_inputs, scale=8 ** -0.5, starts=set(offsets.tolist()))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    for name, got, ref in zip("q k v g beta".split(), inputs, ref_inputs):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-9, atol=1e-11, msg=name)


def test_chunked_rule_in_float32_and_bfloat16_inputs():
    """float32 and bfloat16 inputs run in float32 and come back in their dtype, close to the
    float64 recurrence (the bfloat16 tolerance is its rounding of the inputs and output)."""
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        inputs = _rule_inputs(45, dtype, seed=3)
        out, _ = chunk_gated_delta_rule(*inputs, chunk_size=16)
        assert out.dtype == dtype
        want, _ = recurrent_reference(*inputs, scale=8 ** -0.5)
        torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)


def test_chunked_rule_is_causal():
    """Changing the last token changes no earlier output."""
    inputs = [x.detach() for x in _rule_inputs(40, torch.float64)]
    out, _ = chunk_gated_delta_rule(*inputs, chunk_size=16)
    changed = [x.clone() for x in inputs]
    changed[2][:, -1] += 1.0
    out_changed, _ = chunk_gated_delta_rule(*changed, chunk_size=16)
    assert torch.equal(out[:, :-1], out_changed[:, :-1])
    assert not torch.equal(out[:, -1], out_changed[:, -1])


# --- the whole token mixer against transformers' Qwen3-Next layer -------------------------------

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, TAPS = 48, 2, 4, 16, 12, 4
SEQ = 37


def _hf_layer(dtype):
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextGatedDeltaNet,
        Qwen3NextRMSNorm,
    )

    config = Qwen3NextConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM,
        linear_conv_kernel_dim=TAPS, rms_norm_eps=1e-6, hidden_act="silu")
    torch.manual_seed(0)
    layer, norm = Qwen3NextGatedDeltaNet(config, layer_idx=0), Qwen3NextRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():  # random weights everywhere (the norms' included)
        for module in (layer, norm):
            for parameter in module.parameters():
                parameter.copy_(torch.randn_like(parameter) * 0.3)
        layer.A_log.copy_(torch.rand(VALUE_HEADS).mul(3).add(0.1).log())
    return layer.to(dtype), norm.to(dtype)


def _our_layer(dtype):
    from megatron.core.transformer.spec_utils import build_module

    from megatron.bounded.model.config import transformer_config_class
    from megatron.bounded.model.specs import gated_delta_net_spec
    from megatron.bounded.model.norms import use_zero_centered_norms

    config = transformer_config_class(False)(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
        layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        use_cpu_initialization=True, params_dtype=dtype, transformer_impl="local",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1],
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM,
        linear_conv_kernel_dim=TAPS)
    spec = use_zero_centered_norms(gated_delta_net_spec(), config)
    # the torch norms are made in the default dtype; the model wrapper casts them, here .to
    return build_module(spec, config=config, layer_number=1).to(dtype)


SHAPE = dict(key_heads=KEY_HEADS, value_heads=VALUE_HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM)


def _copy_hf_weights(ours, hf, hf_norm):
    """transformers' names -> ours, as the Qwen3-Next import maps them: in_proj_qkvz (per key
    head: q, k, its value heads' v and z) and in_proj_ba (per key head: β, α) -> in_proj's
    [q, k, v, z, β, α]; the gated norm's weight w (applied as w) -> out_norm's w − 1
    (zero-centred, applied as 1 + w); the input norm's (zero-centred in both) as it is."""
    from megatron.bounded.convert.qwen3_next import join_in_proj

    with torch.no_grad():
        ours.in_proj.weight.copy_(join_in_proj(hf.in_proj_qkvz.weight, hf.in_proj_ba.weight,
                                               **SHAPE))
        ours.in_proj.layer_norm_weight.copy_(hf_norm.weight)
        ours.conv1d.weight.copy_(hf.conv1d.weight)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.A_log.copy_(hf.A_log)
        ours.out_norm.weight.copy_(hf.norm.weight - 1)
        ours.out_proj.weight.copy_(hf.out_proj.weight)


def _assert_agree(got, want, name, relative=2e-5):
    """``got`` equals ``want`` to ``relative`` × the largest entry of ``want``: transformers'
    layer computes its norms, the decay and the rule in float32 whatever the weights' dtype, so
    float64 weights agree to float32's precision (a wrong layout or gate is off by O(1))."""
    error = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert scale > 0 and error <= relative * scale, (name, error, scale)


def _layers_agree(rank, world_size, dtype_name):
    dtype = getattr(torch, dtype_name)
    with one_cpu_rank():
        hf, hf_norm = _hf_layer(dtype)
        ours = _our_layer(dtype)
        _copy_hf_weights(ours, hf, hf_norm)
        hidden = torch.randn(2, SEQ, HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(1))
        grad = torch.randn_like(hidden)
        x_hf = hidden.clone().requires_grad_(True)
        want = hf(hf_norm(x_hf))
        want.backward(grad)
        x_ours = hidden.transpose(0, 1).clone().requires_grad_(True)  # [s, b, h]
        out, bias = ours(x_ours, attention_mask=None)
        assert bias is None
        out.transpose(0, 1).backward(grad)
    _assert_agree(out.transpose(0, 1), want, "output")
    _assert_agree(x_ours.grad.transpose(0, 1), x_hf.grad, "input gradient")
    from megatron.bounded.convert.qwen3_next import join_in_proj

    hf_grads = {
        "in_proj.layer_norm_weight": hf_norm.weight.grad, "conv1d.weight": hf.conv1d.weight.grad,
        "dt_bias": hf.dt_bias.grad, "A_log": hf.A_log.grad, "out_norm.weight": hf.norm.weight.grad,
        "out_proj.weight": hf.out_proj.weight.grad,
    }
    hf_grads["in_proj.weight"] = join_in_proj(hf.in_proj_qkvz.weight.grad,
                                              hf.in_proj_ba.weight.grad, **SHAPE)
    ours_grads = dict(ours.named_parameters())
    assert set(ours_grads) == set(hf_grads), sorted(ours_grads)
    for name, want_grad in hf_grads.items():
        assert want_grad.abs().max() > 0, name
        _assert_agree(ours_grads[name].grad, want_grad, name)
    return sorted(ours_grads)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_token_mixer_equals_transformers_qwen3_next_layer(dtype_name):
    names = run_on_ranks(_layers_agree, 1, args=(dtype_name,), timeout_s=180)[0]
    assert "in_proj.layer_norm_weight" in names and "A_log" in names


# --- packed documents -----------------------------------------------------------------------------

# two sequences of 100 tokens: documents of 1, 2 and 3 tokens (fewer than or as many as the
# convolution's 4 taps less one), a whole 64-token chunk out of line with the chunks, 28; then
# 37, 1 and 62 (across the chunk boundary)
PACKED = ((0, 1, 3, 6, 70, 100), (0, 37, 38, 100))
CHANGED_DOCUMENT = (0, 6, 70)  # (sequence, start, end)


def _packed_documents():
    from megatron.bounded.attention.documents import DocumentParams

    seq = PACKED[0][-1]
    ends = torch.tensor([index * seq + end for index, bounds in enumerate(PACKED)
                         for end in bounds[1:]])
    return DocumentParams.from_ends(ends, len(PACKED), seq)


def _random_layer(conv_bias):
    """The float64 token mixer with random weights everywhere (a convolution bias too with
    ``conv_bias``) and decays from e^-0.1 to e^-3 per token."""
    layer = _our_layer(torch.float64)
    if conv_bias:
        layer.conv1d.bias = torch.nn.Parameter(torch.zeros(layer.conv1d.out_channels,
                                                           dtype=torch.float64))
    torch.manual_seed(2)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
        layer.A_log.copy_(torch.rand(VALUE_HEADS).mul(3).add(0.1).log())
    return layer


def _relative_error(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _packed_layer(rank, world_size, conv_bias):
    """Per document, the largest difference between the layer over the packed sequences and
    over that document alone (outputs, input gradients; parameter gradients summed over the
    documents); and whether changing one document's inputs changed another's outputs."""
    with one_cpu_rank():
        layer = _random_layer(conv_bias)
        documents = _packed_documents()
        generator = torch.Generator().manual_seed(3)
        hidden = torch.randn(documents.seq_length, len(PACKED), HIDDEN, dtype=torch.float64,
                             generator=generator).requires_grad_(True)
        packed, _ = layer(hidden, attention_mask=None, packed_seq_params=documents)
        grad = torch.randn(packed.shape, dtype=torch.float64, generator=generator)
        packed.backward(grad)
        packed_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        layer.zero_grad()
        errors = {"output": 0.0, "input gradient": 0.0}
        for index, bounds in enumerate(PACKED):
            for start, end in zip(bounds, bounds[1:]):
                alone_input = hidden[start:end, index:index + 1].detach().clone()
                alone_input.requires_grad_(True)
                alone, _ = layer(alone_input, attention_mask=None)
                alone.backward(grad[start:end, index:index + 1])
                for name, got, want in (
                        ("output", packed[start:end, index:index + 1], alone),
                        ("input gradient", hidden.grad[start:end, index:index + 1],
                         alone_input.grad)):
                    errors[name] = max(errors[name], _relative_error(got, want))
        for name, p in layer.named_parameters():  # summed over the documents
            errors[name] = _relative_error(packed_grads[name], p.grad)

        sequence, start, end = CHANGED_DOCUMENT
        changed_input = hidden.detach().clone()
        changed_input[start:end, sequence] += 1.0
        with torch.no_grad():
            changed, _ = layer(changed_input, attention_mask=None, packed_seq_params=documents)
        others = torch.ones(packed.shape[:2], dtype=torch.bool)
        others[start:end, sequence] = False
        isolated = torch.equal(changed[others], packed.detach()[others])
        moved = not torch.equal(changed[~others], packed.detach()[~others])
    return errors, isolated, moved


@pytest.mark.parametrize("conv_bias", [False, True], ids=["no-conv-bias", "conv-bias"])
def test_packed_documents_run_as_each_document_alone(conv_bias):
    """float64: over packed documents (shorter than the convolution, out of line with the
    kernel's chunks, two sequences), every document's outputs and input gradients are those of
    the layer run on that document alone, and the parameter gradients their sum; changing one
    document's inputs leaves every other document's outputs bitwise unchanged."""
    errors, isolated, moved = run_on_ranks(_packed_layer, 1, args=(conv_bias,),
                                           timeout_s=180)[0]
    assert "conv1d.bias" in errors if conv_bias else "conv1d.bias" not in errors
    # A_log's gradient is a float32 sum (the decay is computed in float32, as upstream's)
    tolerance = {"A_log": 1e-6}
    assert all(error < tolerance.get(name, 1e-12) for name, error in errors.items()), errors
    assert isolated and moved


# --- a Qwen3-Next-shaped model through pretrain_gpt.py ------------------------------------------

# Qwen3-Next's architecture flags (megatron-core 0.19.2's names), scaled: 48 -> 4 layers with
# the same 3 : 1 pattern, widths, heads, experts and vocabulary smaller
QWEN3_NEXT = (
    "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "256",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "32", "--experimental-attention-variant", "gated_delta_net",
    "--linear-attention-freq", "4", "--linear-conv-kernel-dim", "4",
    "--linear-key-head-dim", "16", "--linear-value-head-dim", "16",
    "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
    "--attention-output-gate", "--qk-layernorm", "--apply-layernorm-1p",
    "--position-embedding-type", "rope", "--rotary-percent", "0.25", "--rotary-base", "10000000",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
    "--moe-shared-expert-gate", "--moe-grouped-gemm", "--moe-router-load-balancing-type",
    "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-dtype", "fp32", "--bf16",
    "--seq-length", "80", "--max-position-embeddings", "80", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
)


def _check_qwen3_next_layers(model, args):
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.bounded.attention.core import SDPACoreAttention
    from megatron.bounded.attention.gated_delta_net import BoundedGatedDeltaNet
    from megatron.bounded.model.norms import ZeroCenteredNorm

    kinds = []
    for layer in model.decoder.layers:
        mixer = layer.self_attention
        if isinstance(mixer, BoundedGatedDeltaNet):
            assert isinstance(layer.input_layernorm, IdentityOp)  # in_proj normalises
            assert isinstance(mixer.out_norm, ZeroCenteredNorm)
            assert mixer.in_proj.zero_centered
            kinds.append("gdn")
        else:
            assert isinstance(mixer, SelfAttention) and isinstance(mixer.core_attention,
                                                                   SDPACoreAttention)
            assert isinstance(layer.input_layernorm, ZeroCenteredNorm)
            assert isinstance(mixer.q_layernorm, ZeroCenteredNorm)
            # the output gate doubles the query part of the fused projection
            heads, groups, kv = args.num_attention_heads, args.num_query_groups, args.kv_channels
            assert mixer.linear_qkv.weight.shape[0] == (2 * heads + 2 * groups) * kv
            kinds.append("attention")
        assert isinstance(layer.mlp, MoELayer) and layer.mlp.shared_experts.use_shared_expert_gate
    assert model.rotary_pos_emb.inv_freq.numel() * 2 == int(args.kv_channels * 0.25)
    return kinds


def _qwen3_next_body(rank, world_size):
    from tests.conftest import keep_upstream_dispatcher_on_cpu
    from tests.unit.model.test_families import _build, _parse, _train_step

    torch._dynamo.config.disable = True  # upstream's compiled helpers: the same values eager
    keep_upstream_dispatcher_on_cpu()
    args, settings = _parse(list(QWEN3_NEXT))
    model = _build(args, settings)
    kinds = _check_qwen3_next_layers(model, args)
    budget = _budget_against_model(model, args, settings)
    loss, missing, bad, zero = _train_step(model, args)
    gdn_grads = [param.grad.float().abs().sum().item() for name, param in model.named_parameters()
                 if ".self_attention." in name and param.grad is not None
                 and name.split(".self_attention.")[1].split(".")[0] in ("in_proj", "conv1d",
                                                                           "A_log", "dt_bias")]
    return kinds, loss, missing, bad + zero, gdn_grads, budget


def _budget_against_model(model, args, settings):
    """The memory budget's parameters of the token mixers (attention part: input norm and
    mixer) against the model built, and its per-token saved bytes of the stage against the
    same model with full attention in every layer."""
    import dataclasses

    from megatron.bounded.budget.config import BudgetConfig
    from megatron.bounded.budget.terms import _stage_shape
    from megatron.bounded.budget.widths import parameter_counts
    from megatron.bounded.attention.gated_delta_net import gdn_saved_bytes_per_token

    cfg = BudgetConfig.from_args(args, settings)
    built = sum(param.numel() for name, param in model.named_parameters()
                if ".self_attention." in name or ".input_layernorm." in name)
    all_attention = dataclasses.replace(cfg, linear_layers=(False,) * cfg.layers)
    saved_full = _stage_shape(all_attention, 0).attn_tok // cfg.tokens
    return {"linear_layers": cfg.linear_layers, "counted": parameter_counts(cfg)["attention"],
            "built": built, "saved": _stage_shape(cfg, 0).attn_tok // cfg.tokens,
            "saved_full": saved_full,
            "saved_gdn": gdn_saved_bytes_per_token(cfg.gdn, cfg.act_bytes)}


def test_qwen3_next_shaped_model_parses_builds_and_trains_a_step():
    kinds, loss, missing, bad, gdn_grads, budget = run_on_ranks(
        _qwen3_next_body, 1, timeout_s=300)[0]
    assert kinds == ["gdn", "gdn", "gdn", "attention"]  # --linear-attention-freq 4
    assert loss == loss and abs(loss) < float("inf")
    assert not missing, f"parameters without a gradient: {missing}"
    assert not bad, f"non-finite or all-zero gradients: {bad}"
    # in_proj (weight, norm weight), conv1d, A_log, dt_bias of the three gated DeltaNet layers
    assert len(gdn_grads) == 3 * 5 and all(total > 0 for total in gdn_grads), gdn_grads
    # the budget counts the gated DeltaNet layers as built, not as full attention
    assert budget["linear_layers"] == (True, True, True, False)
    assert budget["counted"] == budget["built"], budget
    assert budget["saved_gdn"] != budget["saved_full"]
    assert budget["saved"] == (3 * budget["saved_gdn"] + budget["saved_full"]) // 4, budget


# --- chunked recompute: the state handed from chunk to chunk ------------------------------------


def _chunked_layer_body(rank, world_size, chunk_tokens):
    with one_cpu_rank():
        layer = _our_layer(torch.float64).train()
        torch.manual_seed(5)
        hidden = torch.randn(SEQ, 2, HIDDEN, dtype=torch.float64)
        grad_out = torch.randn(SEQ, 2, HIDDEN, dtype=torch.float64)

        def run(tokens):
            layer.recompute_in_chunks(tokens)
            layer.zero_grad()
            x = hidden.clone().requires_grad_(True)
            out, _ = layer(x)
            out.backward(grad_out)
            return {"output": out.detach(), "input gradient": x.grad,
                    **{name: p.grad.clone() for name, p in layer.named_parameters()}}

        want = run(0)
        got = run(chunk_tokens * 2)  # tokens of the micro-batch: 2 sequences
    for name, value in want.items():
        # float64 sums in another order; the decay's parameters through its fp32 arithmetic
        _assert_agree(got[name], value, name,
                      relative=1e-6 if name in ("A_log", "dt_bias") else 1e-12)
    return sorted(want)


@pytest.mark.parametrize("chunk_tokens", [3, 8, 16])
def test_layer_in_chunks_equals_the_whole_sequence(chunk_tokens):
    """In chunks (shorter than the convolution's taps, not dividing the sequence, several of
    the kernel's), outputs and every gradient equal the unchunked layer's (float64)."""
    names = run_on_ranks(_chunked_layer_body, 1, args=(chunk_tokens,), timeout_s=180)[0]
    assert "conv1d.weight" in names and "input gradient" in names


def _chunk_carries_body(rank, world_size):
    from megatron.bounded.attention import chunked_scan

    kept = []
    original = chunked_scan._ChunkedScan.forward

    def spy(ctx, *args):
        kept.append(ctx)
        return original(ctx, *args)

    with one_cpu_rank():
        layer = _our_layer(torch.float32).train()
        layer.recompute_in_chunks(8)
        chunked_scan._ChunkedScan.forward = staticmethod(spy)
        try:
            output = layer(torch.randn(SEQ, 1, HIDDEN, requires_grad=True))
        finally:
            chunked_scan._ChunkedScan.forward = staticmethod(original)
        # read while the graph is alive: it holds the node's saved tensors
        shapes = [([tuple(t.shape) for t in ctx.saved_tensors],
                   [(tuple(state.shape), state.dtype, tuple(tail.shape))
                    for state, tail in ctx.carries]) for ctx in kept]
        del output
    return shapes


def test_chunked_layer_keeps_its_input_and_one_state_per_chunk():
    """What the chunked node keeps for its backward: the layer's input and, per chunk, the state
    entering it (fp32 [b, nv, dk, dv] and the convolution's taps − 1 inputs), nothing per token
    of the mixer's intermediates."""
    (saved, carries), = run_on_ranks(_chunk_carries_body, 1, timeout_s=180)[0]
    assert saved == [(SEQ, 1, HIDDEN)]
    assert len(carries) == ceil_div(SEQ, 8)
    conv_channels = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
    assert set(carries) == {((1, VALUE_HEADS, KEY_DIM, VALUE_DIM), torch.float32,
                             (1, conv_channels, TAPS - 1))}


def _chunked_model_body(rank, world_size, chunk_flags):
    from tests.conftest import keep_upstream_dispatcher_on_cpu
    from tests.unit.model.test_families import _build, _parse, _train_step

    torch._dynamo.config.disable = True
    keep_upstream_dispatcher_on_cpu()
    base = [flag for flag in QWEN3_NEXT if flag != "--bf16"]  # fp32: compare within rounding
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1", "--bounded-moe-backend", "torch",
                 "--moe-expert-rank-capacity-factor", "8"]
    args, settings = _parse([*base, *recompute, *chunk_flags])
    torch.manual_seed(0)
    model = _build(args, settings)
    loss, missing, bad, _ = _train_step(model, args)
    grads = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
    return loss, grads, missing + bad  # numpy: pickled by value to the test


def test_qwen3_next_shaped_model_with_chunked_recompute_equals_unchunked():
    """--chunked-recompute-tokens on a model with gated DeltaNet layers (the layers hand their
    state from chunk to chunk): the loss and every gradient as without chunks (fp32)."""
    loss, grads, problems = run_on_ranks(_chunked_model_body, 1, args=([],), timeout_s=300)[0]
    chunked_loss, chunked_grads, chunked_problems = run_on_ranks(
        _chunked_model_body, 1, args=(["--chunked-recompute-tokens", "24"],), timeout_s=300)[0]
    assert not problems and not chunked_problems, problems + chunked_problems
    assert sorted(grads) == sorted(chunked_grads)
    assert abs(chunked_loss - loss) <= 1e-6 * abs(loss), (loss, chunked_loss)
    largest = max(float(abs(grad).max()) for grad in grads.values())
    for name, grad in grads.items():  # fp32 sums in another order
        got, want = torch.from_numpy(chunked_grads[name]), torch.from_numpy(grad)
        if name.endswith(("A_log", "dt_bias")):
            # sums over every token of terms that cancel to almost nothing: within the rounding
            # of the model's gradients, not of their own tiny total
            assert (got - want).abs().max() <= 1e-5 * largest, name
        else:
            _assert_agree(got, want, name, relative=1e-4)


def _qwen3_next_documents_body(rank, world_size):
    from megatron.bounded.attention.documents import DocumentParams
    from megatron.bounded.attention.gated_delta_net import BoundedGatedDeltaNet
    from tests.conftest import keep_upstream_dispatcher_on_cpu
    from tests.unit.model.test_families import _build, _parse, _train_step

    torch._dynamo.config.disable = True
    keep_upstream_dispatcher_on_cpu()
    args, settings = _parse(list(QWEN3_NEXT) + [
        "--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
        "--attention-dropout", "0"])
    model = _build(args, settings)
    given = []
    for layer in model.decoder.layers:
        if isinstance(layer.self_attention, BoundedGatedDeltaNet):
            layer.self_attention.register_forward_pre_hook(
                lambda module, args, kwargs: given.append(
                    isinstance(kwargs.get("packed_seq_params"), DocumentParams)),
                with_kwargs=True)
    loss, missing, bad, zero = _train_step(model, args, eod=args.padded_vocab_size - 1)
    return given, loss, missing, bad + zero


def test_qwen3_next_shaped_model_trains_a_step_on_packed_documents():
    """``--reset-attention-mask`` with gated DeltaNet layers: the flags pass, and a step over
    documents of 1, 1, 2 and more tokens hands them to every gated DeltaNet layer and gives a
    finite loss and a finite, non-zero gradient to every parameter."""
    given, loss, missing, bad = run_on_ranks(_qwen3_next_documents_body, 1, timeout_s=300)[0]
    assert given == [True, True, True], given
    assert loss == loss and abs(loss) < float("inf")
    assert not missing, f"parameters without a gradient: {missing}"
    assert not bad, f"non-finite or all-zero gradients: {bad}"


# --- refusals -----------------------------------------------------------------------------------

def _without(flags, *names):
    """``flags`` without each flag of ``names`` and its value."""
    flags, kept = list(flags), []
    while flags:
        token = flags.pop(0)
        if token in names:
            if flags and not flags[0].startswith("--"):
                flags.pop(0)
            continue
        kept.append(token)
    return kept


REFUSALS = {
    "no-pattern": (_without(QWEN3_NEXT, "--linear-attention-freq"), "--linear-attention-freq"),
    "pattern-length": (_without(QWEN3_NEXT, "--linear-attention-freq")
                       + ["--linear-attention-freq", "[1,1,0]"], "--linear-attention-freq"),
    "context-parallel": (list(QWEN3_NEXT) + ["--context-parallel-size", "2"],
                         "--context-parallel-size"),
    "tensor-parallel": (list(QWEN3_NEXT) + ["--tensor-model-parallel-size", "2"],
                        "--tensor-model-parallel-size"),
    "mtp": (list(QWEN3_NEXT) + ["--mtp-num-layers", "1"], "--mtp-num-layers"),
    "documents-in-chunks": (list(QWEN3_NEXT) + [
        "--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
        "--attention-dropout", "0", "--recompute-granularity", "full", "--recompute-method",
        "uniform", "--recompute-num-layers", "1", "--chunked-recompute-tokens", "32",
        "--bounded-moe-backend", "torch", "--moe-expert-rank-capacity-factor", "8"],
        "--chunked-recompute-tokens"),
    "gdn-norm-recompute": (list(QWEN3_NEXT) + ["--recompute-granularity", "selective",
                                               "--recompute-modules", "gdn_norm_out"],
                           "gdn_norm_out"),
}


def _refusals_body(rank, world_size):
    import contextlib
    import io
    import sys
    from unittest import mock

    import pretrain_gpt

    results = {}
    for name, (flags, _) in REFUSALS.items():
        sys.argv = ["pretrain_gpt.py", *flags]
        errors = io.StringIO()
        # the model is built after parse_flags returns: reaching the builder is a failure
        with mock.patch.object(pretrain_gpt, "build_model_config",
                               side_effect=AssertionError("model built")), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            try:
                pretrain_gpt.parse_flags()
                results[name] = (None, errors.getvalue())
            except SystemExit as exit:
                results[name] = (exit.code, errors.getvalue())
    return results


def test_what_does_not_run_is_refused_before_the_model_is_built():
    results = run_on_ranks(_refusals_body, 1, timeout_s=300)[0]
    for name, (_, flag) in REFUSALS.items():
        code, printed = results[name]
        assert code == 2, (name, code, printed[-2000:])
        message = printed.split("[bounded] error: ", 1)[-1]
        assert "[bounded] error: " in printed and flag in message, (name, printed[-2000:])
        # refused for what it asks of these layers, not for another reason naming the flag
        assert "gated" in message.lower() or "Transformer Engine's layers" in message, message


def _planned(seq_length: int):
    """(exit status, printed) of tools/memory_budget.py planning the Qwen3-Next-shaped model
    (hidden 1024, Qwen3-Next's gated DeltaNet widths) at ``seq_length`` tokens for one 85 GB
    GPU."""
    from tests.unit.model.test_families import _memory_budget_tool

    flags = list(QWEN3_NEXT)
    for flag, value in (("--seq-length", seq_length), ("--max-position-embeddings", seq_length),
                        ("--hidden-size", 1024), ("--ffn-hidden-size", 2048),
                        ("--linear-key-head-dim", 128), ("--linear-value-head-dim", 128),
                        ("--linear-num-key-heads", 16), ("--linear-num-value-heads", 32)):
        flags[flags.index(flag) + 1] = str(value)
    return _memory_budget_tool([*flags, "--hbm-gb", "85"])


def test_the_planner_recomputes_the_gated_deltanet_layers_in_chunks_at_long_context():
    """At 1M tokens the plan recomputes in chunks (the gated DeltaNet layers hand their state
    on) and pretrain_gpt.py accepts it; beyond reach, the refusal names the longest length."""
    status, printed = _planned(1_048_576)
    assert status == 0 and "[bounded] plan: added" in printed, printed[-2000:]
    assert "--chunked-recompute-tokens" in printed.split("[bounded] plan: added", 1)[1]
    assert "a gated DeltaNet layer in" in printed  # the layer phase's costliest layer
    status, printed = _planned(8_388_608)
    assert status == 2 and "The longest --seq-length that fits is" in printed, printed[-2000:]
    assert "refuses these flags" not in printed
