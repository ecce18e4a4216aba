"""What the budget's terms are made of: the parameters of one rank, the bytes per token or per
routed row that a layer saves or holds in backward, and the routed rows of a MoE layer."""

from __future__ import annotations

import math
from typing import Dict, Tuple

from megatron.bounded.activations.sco import boundaries_on_device
from megatron.bounded.attention.sparse_mla_latent import (
    attends_in_latent_form,
    latent_working_set_bytes,
)
from megatron.bounded.attention.context_parallel import expanded_query_groups
from megatron.bounded.budget.config import BudgetConfig, as_config, stage_layers
from megatron.bounded.attention.gated_delta_net import (
    gdn_grad_bytes_per_token,
    gdn_params,
    gdn_saved_bytes_per_token,
)
from megatron.bounded.moe.dispatch.token_dispatcher import capacity_rows
from megatron.bounded.moe.pipelined_llep import agree_num_chunks
from megatron.bounded.units import ceil_div


def _norm_params(cfg: BudgetConfig, width: int) -> int:
    return 2 * width if cfg.layernorm else width



def _attention_params(cfg: BudgetConfig) -> int:
    """Parameters of one layer's attention and input norm on one rank."""
    if cfg.mla is not None:
        return _mla_params(cfg)
    h, tp = cfg.hidden, cfg.tp
    q_width = cfg.heads * cfg.kv_channels
    qkv_width = (cfg.heads + 2 * cfg.groups) * cfg.kv_channels
    if cfg.output_gate:  # the fused projection makes the gate too, q wide
        qkv_width += q_width
    attn = h * qkv_width // tp + q_width * h // tp + _norm_params(cfg, h)
    if cfg.bias_linear or cfg.qkv_bias:
        attn += qkv_width // tp
    if cfg.bias_linear:
        attn += h
    if cfg.qk_layernorm:
        attn += 2 * _norm_params(cfg, cfg.kv_channels)
    return attn


def _mla_params(cfg: BudgetConfig) -> int:
    """Multi-latent attention's parameters on one rank (upstream's ``MLASelfAttention``, every
    projection column-parallel, no biases but the output projection's): q down H·r_q/TP and up
    r_q·heads·(qk+pos)/TP, or H·heads·(qk+pos)/TP without q LoRA; kv down H·(r_kv+pos)/TP and up
    r_kv·heads·(qk+v)/TP; proj heads·v·H/TP; input norm, and with qk norms those of the two
    latents (r_q, r_kv)."""
    m, h, tp, heads = cfg.mla, cfg.hidden, cfg.tp, cfg.heads
    if m.q_lora_rank:
        attn = h * m.q_lora_rank // tp + m.q_lora_rank * heads * m.q_head_dim // tp
    else:
        attn = h * heads * m.q_head_dim // tp
    attn += h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) // tp
    attn += m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim) // tp
    attn += heads * m.v_head_dim * h // tp + _norm_params(cfg, h)
    if cfg.bias_linear:
        attn += h
    if cfg.qk_layernorm:
        attn += _norm_params(cfg, m.kv_lora_rank)
        if m.q_lora_rank:
            attn += _norm_params(cfg, m.q_lora_rank)
    return attn


def parameter_counts(args_or_cfg, stage: int = 0) -> Dict[str, int]:
    """Parameters held by one rank of ``stage``, by kind (after TP / EP / Ring-DTP sharding).

    * attention per layer: QKV H·(heads + 2·groups)·kv/TP + proj heads·kv·H/TP (+ biases),
      input norm, qk norms; with multi-latent attention :func:`_mla_params` instead;
      a gated DeltaNet layer's token mixer instead where --linear-attention-freq makes one
      (``megatron.bounded.attention.gated_delta_net.gdn_params``);
    * dense MLP per layer: H·F·(2 if gated else 1)/TP + F·H/TP (+ biases), pre-MLP norm;
    * MoE layer: router E·H; E/E_p local experts of H·F_m·(2 if gated else 1) + F_m·H, divided by
      expert TP; shared expert H·F_s·(2 if gated else 1)/TP + F_s·H/TP (+ gate H); pre-MLP norm;
    * embedding V·H/TP (+ learned positions) on the first stage; final norm and output layer
      V·H/TP on the last (ceil(V/P)·H with Ring-DTP; a copy of the embedding when tied and
      PP > 1);
    * each multi-token-prediction layer (last stage): a layer of the decoder's last layer's kind
      (``mtp``, its experts in ``mtp_experts``), the projection 2H·H/TP and three norms (of the
      embedding, of the hidden state, after the layer).

    Returns ``dense`` (replicated over DP: state sharded by W = DP × CP), ``expert`` (sharded by
    W_e), ``ring_output`` (the Ring-DTP output shard: unique per rank of the ring) and
    a breakdown.
    """
    cfg = as_config(args_or_cfg)
    layers = stage_layers(cfg)[stage]
    h, tp, g = cfg.hidden, cfg.tp, (2 if cfg.gated else 1)
    attn = _attention_params(cfg)
    dense_mlp = h * cfg.ffn * g // tp + cfg.ffn * h // tp + _norm_params(cfg, h)
    if cfg.bias_linear:
        dense_mlp += cfg.ffn * g // tp + h
    moe_dense = cfg.experts * h + _norm_params(cfg, h)
    if cfg.shared_ffn:
        moe_dense += h * cfg.shared_ffn * g // tp + cfg.shared_ffn * h // tp
        if cfg.bias_linear:
            moe_dense += cfg.shared_ffn * g // tp + h
        if cfg.shared_gate:
            moe_dense += h
    expert_one = h * cfg.moe_ffn * g + cfg.moe_ffn * h
    if cfg.bias_linear:
        expert_one += cfg.moe_ffn * g + h
    local_experts = ceil_div(cfg.experts, cfg.ep) if cfg.experts else 0
    expert_layer = local_experts * expert_one // cfg.etp

    n_moe = sum(1 for i in layers if cfg.moe_layers[i])
    n_dense = len(layers) - n_moe
    n_linear = sum(1 for i in layers if cfg.linear_layers[i])
    mixers = (len(layers) - n_linear) * attn
    if n_linear:
        mixers += n_linear * gdn_params(cfg.gdn, lambda width: _norm_params(cfg, width))
    counts = {
        "attention": mixers,
        "dense_mlp": n_dense * dense_mlp,
        "moe_router_shared": n_moe * moe_dense,
        "experts": n_moe * expert_layer,
        "embedding": 0,
        "output_layer": 0,
        "ring_output": 0,
        "final_norm": 0,
        "mtp": 0,
        "mtp_experts": 0,
    }
    first, last = stage == 0, stage == cfg.pp - 1
    if last and cfg.mtp_layers:
        mtp_moe = cfg.moe_layers[-1]
        counts["mtp"], counts["mtp_experts"] = _mtp_counts(
            cfg, attn + (moe_dense if mtp_moe else dense_mlp), expert_layer if mtp_moe else 0)
    if first:
        counts["embedding"] = cfg.vocab * h // tp + cfg.learned_positions * h
    if last:
        counts["final_norm"] = _norm_params(cfg, h)
        if cfg.ring_dtp.enabled and (cfg.untied or not first):
            counts["ring_output"] = ceil_div(cfg.vocab, cfg.ring_group) * h
        elif cfg.untied or not first:
            counts["output_layer"] = cfg.vocab * h // tp
    counts["dense"] = (
        counts["attention"] + counts["dense_mlp"] + counts["moe_router_shared"]
        + counts["embedding"] + counts["output_layer"] + counts["final_norm"] + counts["mtp"]
    )
    counts["expert"] = counts["experts"] + counts["mtp_experts"]
    return counts



def _mtp_counts(cfg: BudgetConfig, layer: int, layer_experts: int) -> Tuple[int, int]:
    """(dense, expert) parameters of the MTP layers, each ``layer`` + ``layer_experts`` (the
    decoder's last layer's kind), the projection 2H·H/TP and three norms."""
    h = cfg.hidden
    dense = layer + 2 * h * h // cfg.tp + 3 * _norm_params(cfg, h)
    return cfg.mtp_layers * dense, cfg.mtp_layers * layer_experts



def token_widths(cfg: BudgetConfig) -> Tuple[int, int, int]:
    """Elements per token on this rank: (hidden, heads·kv, groups·kv). The hidden is divided by
    TP with sequence parallelism; with context parallelism (the sequence-to-head all-to-all of
    ``megatron.bounded.attention.context_parallel``) groups not divisible by CP are repeated to lcm(groups, CP).
    Multi-latent attention: (hidden, heads·(qk+pos), heads·(qk+pos)), every head its own key and
    value, the values counted at the q/k width as the CUDA kernels hold them (padded,
    ``megatron.bounded.attention.head_dims``)."""
    tp = cfg.tp
    h_tok = cfg.hidden // tp if cfg.sequence_parallel else cfg.hidden
    if cfg.mla is not None:
        width = cfg.heads * cfg.mla.q_head_dim // tp
        return h_tok, width, width
    groups = cfg.groups // tp
    if cfg.cp > 1:
        groups = expanded_query_groups(groups, cfg.cp)
    return h_tok, cfg.heads * cfg.kv_channels // tp, groups * cfg.kv_channels



def boundary_and_rope_bytes(cfg: BudgetConfig) -> Tuple[int, int]:
    """(one checkpoint boundary N·H·b, the rotary table (S/CP)·kv·4 shared by every layer)."""
    per = cfg.tokens * token_widths(cfg)[0] * cfg.act_bytes
    rope = cfg.seq_length // max(1, cfg.cp) * _rotary_dim(cfg) * 4 if cfg.rope else 0
    return per, rope


def _rotary_dim(cfg: BudgetConfig) -> int:
    """Head dimension the rotary embedding turns: MLA's positional part, or the whole head."""
    return cfg.mla.qk_pos_emb_head_dim if cfg.mla is not None else cfg.kv_channels


def _mla_saved_width(cfg: BudgetConfig) -> int:
    """Bytes per token multi-latent attention saves besides what :func:`activation_widths`
    counts for any attention: the latents (the q down-projection's output r_q and the kv one's
    r_kv + pos, and with qk norms the norms' outputs r_q and r_kv), less the output projection's
    input being heads·v wide, not heads·(qk+pos); 0 without MLA."""
    m = cfg.mla
    if m is None:
        return 0
    norms = 2 if cfg.qk_layernorm else 1
    latents = norms * (m.q_lora_rank + m.kv_lora_rank) + m.qk_pos_emb_head_dim
    narrower_output = cfg.heads * (m.q_head_dim - m.v_head_dim) // cfg.tp
    return cfg.act_bytes * (latents - narrower_output)



def activation_widths(cfg: BudgetConfig) -> Dict[str, int]:
    """Bytes saved for backward, per token or per routed row, counted tensor by tensor from the
    local (TE-free) layer of this project.

    Attention, per token: input-norm input (H) and output = QKV input (H); q (heads·kv), k, v
    (groups·kv each) as SDPA saves them; SDPA output (heads·kv) and its [s, b, heads·kv] copy
    that linear_proj saves (heads·kv); pre-MLP-norm input (H) and output = MLP input (H): that is
    b·(4H + 3·heads·kv + 2·groups·kv), plus the flash log-sum-exp (4 bytes × heads); with
    --attention-output-gate the gate (heads·kv, b) and its fp32 sigmoid (4·heads·kv). Head-sized
    widths are divided by TP; H-sized ones too with sequence parallelism. Multi-latent attention:
    the same with its widths (:func:`token_widths`) and its latents (:func:`_mla_saved_width`).

    MoE, per token: router logits and probabilities, fp32 (2·E·4); shared expert fc1 output and
    activation (b·(2F_s + F_s) gated, b·2F_s otherwise). Per routed row, as the grouped experts
    save them: input row (H) and fc1 output (2F_m gated, F_m otherwise). Dense MLP per token:
    fc1 output and activation, b·(2F + F) gated.

    With context parallelism (the sequence-to-head all-to-all of ``megatron.bounded.attention.context_parallel``)
    the kernel holds the exchanged q, k, v, the same count per token as the local ones except
    that groups not divisible by CP are repeated to lcm(groups, CP) (``groups'``): the formulas
    use groups' for k and v, and the backward transient adds two more copies of the exchanged
    b·(heads + 2·groups')·kv on their way back through the exchange.

    DeepSeek sparse attention (``--experimental-attention-variant dsa``) adds, per token, its
    layer's selected keys and indexer tensors to the saved widths and its blockwise working set
    to the attention's transient (:func:`_dsa_bytes`, the formula of its module); in latent form
    (under chunked recompute) its attention widths are :func:`_latent_attention_widths` and its
    transient the top-k pass's or the latent backward's.

    Backward transients (one sub-block at a time): attention dq, dk, dv, d_out and the proj-input
    gradient, b·(3·heads·kv + 2·groups·kv), plus the kernel's fp32 dq accumulator (4·heads·kv);
    per routed row, as the grouped experts' backward holds them together: the masked fc1 copy
    and the fc1 gradient (2 × fc1 width), the recomputed scaled activation and its gradient
    (2F_m) and the row gradient (H), b·(H + 2·fc1 + 2F_m); per token the MLP/MoE token-side
    tensors once more.
    """
    b, tp = cfg.act_bytes, cfg.tp
    h_tok, hq, hkv = token_widths(cfg)
    exchange_copies = 2 * b * (hq + 2 * hkv) if cfg.cp > 1 else 0
    g = 2 if cfg.gated else 1
    fc1_m = g * cfg.moe_ffn // cfg.etp
    f_m = cfg.moe_ffn // cfg.etp
    fc1_s = g * cfg.shared_ffn // tp
    fc1_d = g * cfg.ffn // tp
    # gated or not, the activation output has the FFN width: fc1 out + activation out per token
    shared_saved = b * (fc1_s + cfg.shared_ffn // tp) if cfg.shared_ffn else 0
    widths = {
        "attn_saved": b * (4 * h_tok + 3 * hq + 2 * hkv) + 4 * (cfg.heads // tp)
        + _mla_saved_width(cfg) + (b + 4) * hq * cfg.output_gate,
        "attn_grad": b * (3 * hq + 2 * hkv) + 4 * hq + exchange_copies,
        "moe_token_saved": 2 * cfg.experts * 4 + shared_saved,
        "shared_saved": shared_saved,
        "dense_mlp_saved": b * (fc1_d + cfg.ffn // tp),
        "row_saved": b * (cfg.hidden + fc1_m),
        "row_inputs": b * cfg.hidden,
        "row_grad": b * (cfg.hidden + 2 * fc1_m + 2 * f_m),
    }
    if cfg.mla is not None and cfg.mla.dsa_topk:
        # DeepSeek sparse attention: what its layer adds, the formulas of its own modules
        dsa = _dsa_bytes(cfg)
        widths["attn_saved"] += ceil_div(dsa["saved"], cfg.tokens)
        if _latent_form(cfg):
            saved, grad, working_set = _latent_attention_widths(cfg)
            widths["attn_saved"] += saved
            # the top-k pass runs in the recompute, the latent backward after it
            widths["attn_grad"] = grad + ceil_div(max(working_set, dsa["topk_pass"]), cfg.tokens)
        else:
            widths["attn_grad"] += ceil_div(dsa["transient"], cfg.tokens)
    widths["moe_token_grad"] = widths["moe_token_saved"]
    widths["dense_mlp_grad"] = widths["dense_mlp_saved"]
    return widths



def _latent_form(cfg: BudgetConfig) -> bool:
    """Whether the DSA layers attend in multi-latent attention's latent form
    (:func:`megatron.bounded.attention.sparse_mla_latent.attends_in_latent_form`)."""
    return bool(cfg.mla is not None and cfg.mla.dsa_topk
                and attends_in_latent_form(cfg.chunked_recompute))


def _latent_attention_widths(cfg: BudgetConfig) -> Tuple[int, int, int]:
    """DSA in latent form: (bytes per token it saves less what :func:`activation_widths` counts
    for the expanded form, bytes per token of the gradients its backward holds, the bytes of its
    backward's working set). It keeps the query heads·(qk+pos), the latent with the key's rotary
    part (kv_lora + pos) and the output heads·v, not the expanded key and the padded value and
    output (3·heads·(qk+pos)); its backward holds dQ, the output's gradient and the latent's,
    and the formula's working set
    (:func:`megatron.bounded.attention.sparse_mla_latent.latent_working_set_bytes`: fp32
    accumulators, one block), never a per-head key or value."""
    m, b, heads = cfg.mla, cfg.act_bytes, cfg.heads // cfg.tp
    latent = latent_working_set_bytes(cfg.tokens, m.dsa_topk, heads, m.kv_lora_rank,
                                      m.qk_pos_emb_head_dim)
    expanded_kv_out = 3 * heads * m.q_head_dim
    saved = b * (m.kv_lora_rank + m.qk_pos_emb_head_dim + heads * m.v_head_dim - expanded_kv_out)
    grad = b * (heads * (m.q_head_dim + m.v_head_dim) + m.kv_lora_rank + m.qk_pos_emb_head_dim)
    return saved, grad, latent["transient"]


def _dsa_bytes(cfg: BudgetConfig) -> Dict[str, int]:
    """One DSA layer's saved bytes and working set at this rank's tokens
    (:func:`megatron.bounded.attention.sparse_attention.dsa_working_set_bytes`)."""
    from megatron.bounded.attention.sparse_attention import dsa_working_set_bytes

    mla = cfg.mla
    return dsa_working_set_bytes(
        tokens=cfg.tokens, topk=mla.dsa_topk, heads=cfg.heads // cfg.tp,
        qk_dim=mla.q_head_dim, v_dim=mla.v_head_dim, index_heads=mla.dsa_index_heads,
        index_dim=mla.dsa_index_dim, act_bytes=cfg.act_bytes, indexer_loss=mla.dsa_indexer_loss)


def token_mixer_bytes_per_token(cfg: BudgetConfig, layer_ids, saved_full: int) -> Tuple[int, int]:
    """(saved, backward transient) bytes per token of the token mixers of ``layer_ids``: each
    full-attention layer ``saved_full`` (:func:`activation_widths`' attention, less what
    selective recompute takes off) and its ``attn_grad``, each gated DeltaNet layer what its
    module counts (``gdn_saved_bytes_per_token``, ``gdn_grad_bytes_per_token``); saved: the
    mean over the layers (exact for the stage's total when every layer keeps its activations),
    transient: the largest."""
    layer_ids = list(layer_ids)
    n_linear = sum(1 for i in layer_ids if cfg.linear_layers[i])
    full_grad = activation_widths(cfg)["attn_grad"]
    if not n_linear:
        return saved_full, full_grad
    saved_gdn = gdn_saved_bytes_per_token(cfg.gdn, cfg.act_bytes)
    grad_gdn = gdn_grad_bytes_per_token(cfg.gdn, cfg.act_bytes)
    n_full = len(layer_ids) - n_linear
    saved = (n_full * saved_full + n_linear * saved_gdn) // len(layer_ids)
    return saved, max(grad_gdn, full_grad if n_full else 0)


def selective_savings(cfg: BudgetConfig) -> Dict[str, int]:
    """What a layer no longer keeps from its forward to its backward with the modules of
    selective recompute (``cfg.recompute_modules``), less what :func:`activation_widths` counts:
    bytes per token of its attention part (``attention``, every layer), of a MoE layer's token
    side (``moe_tokens``) and of a dense MLP (``dense_mlp``), and whether a MoE layer keeps no
    routed row (``rows``: 1 with ``moe``, else 0).

    * ``core_attn``: SDPA's output b·heads·kv and its log-sum-exp 4·heads (q, k and v are the
      checkpoint's inputs; the output projection keeps its own copy of the output);
    * ``layernorm``: both norm outputs, 2·H·b (their per-token statistics, which the layer's
      count leaves out, go too);
    * ``mla_up_proj``: q and k, 2·b·heads·(qk + pos) (the value the attention keeps is its padded
      copy, made after the up-projection);
    * ``mlp``: the dense MLP's fc1 output and activation (its input is the norm's output);
    * ``moe``: the MoE layer's router tensors, shared expert and routed rows (its input is the
      norm's output);
    * ``shared_experts``: the shared expert's fc1 output and activation;
    * ``moe_act``: nothing: the grouped experts keep only their input rows and fc1 output
      (``row_saved``) and recompute the activation whether it is asked or not."""
    modules, b, tp = set(cfg.recompute_modules), cfg.act_bytes, cfg.tp
    w = activation_widths(cfg)
    h_tok, hq, _ = token_widths(cfg)
    attention = 0
    if "core_attn" in modules:
        attention += b * hq + 4 * (cfg.heads // tp)
    if "layernorm" in modules:
        attention += 2 * h_tok * b
    if "mla_up_proj" in modules and cfg.mla is not None:
        attention += 2 * b * hq
    moe_tokens = w["moe_token_saved"] if "moe" in modules else (
        w["shared_saved"] if "shared_experts" in modules else 0)
    return {
        "attention": attention,
        "moe_tokens": moe_tokens,
        "dense_mlp": w["dense_mlp_saved"] if "mlp" in modules else 0,
        "rows": int("moe" in modules),
    }


def recomputed_layer_bytes_per_token(cfg: BudgetConfig, moe: bool) -> int:
    """Bytes per token a recomputed layer keeps for its backward, tensor by tensor as the
    allocator's snapshot shows them (the formula is on ``docs/operators/memory_budget.md``)."""
    b, tp = cfg.act_bytes, cfg.tp
    h_tok, hq, hkv = token_widths(cfg)
    if cfg.mla is not None:
        width = 2 * h_tok * b + 2 * (h_tok * b + 4) + _mla_recomputed_width(cfg)
    else:
        width = 2 * h_tok * b + 2 * (h_tok * b + 4) + (hq + 2 * hkv) * b + (hq + hkv) * b
        width += hq * b + 4 * (cfg.heads // tp)
    if cfg.rope:
        width += 2 * _rotary_dim(cfg) * 4
    if moe:
        width += 2 * cfg.experts * 4
    return width



def _mla_recomputed_width(cfg: BudgetConfig) -> int:
    """Multi-latent attention's part of :func:`recomputed_layer_bytes_per_token`: q, k, the
    value padded to the q/k width and the output at that width as the kernel saves them
    (4·heads·(qk+pos)), the output projection's input heads·v, the log-sum-exp (DSA in latent
    form: q, the latent and rotary part, the output heads·v, the log-sum-exp); the latents
    (q down-projection's output r_q and its norm's, kv down-projection's r_kv + pos and its
    norm's r_kv, the key's rotary part pos twice as the snapshot shows it); with DSA what its
    layer saves besides (:func:`_dsa_bytes`: the selected keys, the indexer loss's tensors)."""
    m, b, heads = cfg.mla, cfg.act_bytes, cfg.heads // cfg.tp
    if _latent_form(cfg):
        # DSA in latent form: q, the latent with the key's rotary part, the output heads·v (the
        # output projection's input) and the formula's log-sum-exp
        lse = latent_working_set_bytes(cfg.tokens, m.dsa_topk, heads, m.kv_lora_rank,
                                       m.qk_pos_emb_head_dim)["saved"]
        width = b * (heads * (m.q_head_dim + m.v_head_dim) + m.kv_lora_rank
                     + m.qk_pos_emb_head_dim) + ceil_div(lse, cfg.tokens)
    else:
        width = b * heads * (4 * m.q_head_dim + m.v_head_dim) + 4 * heads
    width += b * (m.q_lora_rank + m.kv_lora_rank + 2 * m.qk_pos_emb_head_dim)
    if cfg.qk_layernorm:
        # the norms' outputs (and fp32 reciprocal RMS); without q LoRA the query projection
        # normalizes its own input, which it keeps (H wide)
        q_normed = m.q_lora_rank or token_widths(cfg)[0]
        width += b * (q_normed + m.kv_lora_rank) + 2 * 4
    if m.dsa_topk:
        # DSA: the selected keys and, with its loss, the indexer's tensors, kept in either form
        width += ceil_div(_dsa_bytes(cfg)["saved"], cfg.tokens)
    return width


def dense_mlp_backward_bytes_per_token(cfg: BudgetConfig) -> int:
    """A dense MLP's backward per token: its fc1 output, that output's gradient and the
    activation's gradient, b·(2·fc1 + F) (the activation's output is gone once fc2's backward
    has run)."""
    fc1 = (2 if cfg.gated else 1) * cfg.ffn // cfg.tp
    return cfg.act_bytes * (2 * fc1 + cfg.ffn // cfg.tp)


def mtp_boundaries(cfg: BudgetConfig, last: bool) -> int:
    """Checkpoint boundaries of the multi-token-prediction layers (last stage, full recompute):
    two per layer, its input hidden state and the next tokens' embedding (upstream's MTP layer
    recomputes only with --recompute-method uniform; with block it stores the layer in full)."""
    if not (last and cfg.recompute == "full" and cfg.recompute_method != "block"):
        return 0
    return 2 * cfg.mtp_layers


def sco_boundaries_on_device(cfg: BudgetConfig, boundaries: int, last: bool) -> Tuple[int, int]:
    """SCO's (offloaded, on the GPU at once) of this stage's ``boundaries``."""
    per = boundary_and_rope_bytes(cfg)[0]
    together = 2 if mtp_boundaries(cfg, last) else 1
    return boundaries_on_device(boundaries, per, cfg.sco.host_budget_bytes, together)


def mtp_stored_layers(cfg: BudgetConfig, last: bool) -> int:
    """Multi-token-prediction layers stored in full (not checkpointed) on this stage."""
    return cfg.mtp_layers if last and not mtp_boundaries(cfg, last) else 0


def mtp_loss_bytes(cfg: BudgetConfig) -> Tuple[int, str]:
    """What the multi-token-prediction losses keep from their forward to the backward at the
    main loss: per MTP layer the cross entropy's fp32 N×V/TP softmax and the layer's output
    N·H·b, chunked out of the hidden states upstream concatenates."""
    if not cfg.mtp_layers:
        return 0, ""
    n, v = cfg.tokens, cfg.vocab // cfg.tp
    per = 4 * n * v + n * token_widths(cfg)[0] * cfg.act_bytes
    return cfg.mtp_layers * per, (
        f"; {cfg.mtp_layers} MTP loss(es) keep the fp32 N×V/TP softmax and the N·H·b output "
        f"each, {per:,} B")


def pipelined_llep_chunks(cfg: BudgetConfig) -> Tuple[int, int]:
    """(K, c_eff) of PipelinedLLEP for this configuration, as the operator's ``agree_num_chunks``
    gives them when every rank has this rank's N (c = N without a budget)."""
    n = cfg.tokens
    llep = cfg.pipelined_llep
    return agree_num_chunks(n, max(1, llep.pipelined_llep_token_budget or n),
                            max(1, llep.pipelined_llep_max_chunks))



def moe_rows(cfg: BudgetConfig) -> Dict[str, int]:
    """Routed rows of one MoE layer on this rank.

    ``buffer``: rows of the dispatch (and combine) buffer of the layer in flight.
    ``active``: rows whose expert activations are live during that layer's recompute/backward.
    ``kept``: rows a MoE layer keeps for backward after its forward (without recompute).
    """
    n, k = cfg.tokens, cfg.topk
    # with one rank in the expert-parallel group every routed row lands here: no skew
    skewed = math.ceil((cfg.routing_skew if cfg.ep > 1 else 1.0) * n * k)
    if cfg.pipelined_llep.enabled:
        _, c_eff = pipelined_llep_chunks(cfg)
        chunk = cfg.ep * k * c_eff  # worst case: every source sends its whole chunk here
        return {"buffer": chunk, "active": chunk, "kept": skewed}
    if cfg.capacity_factor:
        cap = cfg.ep * capacity_rows(n, k, cfg.ep, float(cfg.capacity_factor))
        return {"buffer": cap, "active": cap, "kept": cap}
    return {"buffer": skewed, "active": skewed, "kept": skewed}

