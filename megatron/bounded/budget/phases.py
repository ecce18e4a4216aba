"""The phases of a step with full recompute: what is live besides the model state at the loss, in
the first layer's recompute and backward (plain, chunked, or with the attention sublayer chunked
too) and in the optimizer step. The peak is the model state plus the largest phase."""

from __future__ import annotations

from typing import Dict, Tuple

from megatron.bounded.activations.chunked_attention import (
    backward_bytes_per_token,
    chunk_backward_bytes_per_token,
    kept_attention_bytes,
    saved_bytes_per_token,
)
from megatron.bounded.activations.chunked_recompute import released_bytes_per_token
from megatron.bounded.budget.config import BudgetConfig
from megatron.bounded.budget.widths import (
    activation_widths, boundary_and_rope_bytes, dense_mlp_backward_bytes_per_token, moe_rows,
    mtp_loss_bytes, mtp_stored_layers, pipelined_llep_chunks, recomputed_layer_bytes_per_token,
    sco_boundaries_on_device, token_widths,
)
from megatron.bounded.attention.documents import cumulative_lengths_bytes
from megatron.bounded.attention.gated_delta_net import (
    gdn_carry_bytes,
    gdn_grad_bytes_per_token,
    gdn_saved_bytes_per_token,
)
from megatron.bounded.loss.ring_dtp import ring_dtp_workspace_bytes
from megatron.bounded.moe.pipelined_llep import pipelined_llep_live_bytes
from megatron.bounded.units import MiB, ceil_div

# Kernel workspaces taken from PyTorch's caching allocator (cuDNN attention, cuBLAS): a 192 MiB
# block live at the layer peak at every length measured.
KERNEL_WORKSPACE_BYTES = 192 * MiB

# int64 tokens, labels and positions, fp32 loss mask
BATCH_BYTES_PER_TOKEN = 28

# {phase: ({term: bytes}, {term: note})}
Phases = Dict[str, Tuple[Dict[str, int], Dict[str, str]]]


def recompute_phases(cfg: BudgetConfig, n_moe: int, n_dense: int, n_linear: int,
                     n_boundaries: int, last: bool, step: Tuple[int, str]) -> Phases:
    """What is live besides the model state in each phase of a step with full recompute: ``loss``
    (last stage), ``layer`` (the recompute and backward of the stage's costliest layer: a
    full-attention one, or one of its ``n_linear`` gated DeltaNet layers) and ``step``
    (``step``: the optimizer step's bytes and note). The phases do not overlap: the peak is the
    largest."""
    n = cfg.tokens
    per, rope = boundary_and_rope_bytes(cfg)
    offloaded, on_device = sco_boundaries_on_device(cfg, n_boundaries, last)
    restored = on_device - (n_boundaries - offloaded)
    sco_note = f" (SCO offloads {offloaded}; at most {restored} back at once)" if offloaded else ""
    phases: Phases = {}

    documents, documents_note = _document_bytes(cfg)
    if last:
        vocab, vocab_note = output_layer_bytes(cfg)
        mtp, mtp_note = mtp_loss_bytes(cfg)
        # SCO restores boundaries only in the backward: at the loss the ones it offloaded are
        # all on the host
        kept_on_device = n_boundaries - offloaded
        restores_later = (f" (SCO offloads {offloaded}; its restores start in the backward)"
                          if offloaded else "")
        terms = {
            "checkpoint_boundaries": (kept_on_device + 2) * per + rope,
            "vocab_projection": vocab + mtp + n * (4 + BATCH_BYTES_PER_TOKEN) + documents,
        }
        notes = {
            "checkpoint_boundaries": (
                f"at the loss: {kept_on_device} of {n_boundaries} boundaries on the "
                f"GPU{restores_later} + the last layer's output + the final norm's output, N·H·b = {per:,} B each; rotary "
                f"table {rope:,} B"),
            "vocab_projection": vocab_note + mtp_note
            + f"; batch tensors N·{BATCH_BYTES_PER_TOKEN} B" + documents_note,
        }
        phases["loss"] = (terms, notes)

    kept, kept_notes = kept_attention_terms(cfg, n_moe + n_dense, last)
    if last:
        phases["loss"][0]["kept_attention"] = kept["loss"]
        phases["loss"][1]["kept_attention"] = kept_notes["loss"]

    chunked = cfg.chunk_tokens and cfg.chunk_tokens < n
    if chunked and cfg.chunked_attention.chunked_recompute_attention:
        terms, notes = _chunked_attention_layer_phase(cfg, n_moe, n_dense, per)
    else:
        phase = _chunked_layer_phase if chunked else _layer_phase
        terms, notes = phase(cfg, n_moe, n_dense, per)
    if n_linear:
        linear = _gated_delta_net_layer_phase(cfg, n_moe, n_dense, per, chunked)
        all_linear = n_linear == n_moe + n_dense
        if all_linear or sum(linear[0].values()) > sum(terms.values()):
            terms, notes = linear
    terms["recompute_working_set"] += documents
    notes["recompute_working_set"] += documents_note
    terms["checkpoint_boundaries"] = on_device * per + rope
    notes["checkpoint_boundaries"] = (
        f"in the first layer's backward: {on_device} of {n_boundaries} boundaries on the "
        f"GPU{sco_note}, N·H·b = {per:,} B each; rotary table {rope:,} B")
    terms["kept_attention"], notes["kept_attention"] = kept["layer"], kept_notes["layer"]
    phases["layer"] = (terms, notes)

    name = "optimizer_staging" if cfg.offload_stream.enabled else "optimizer_step"
    phases["step"] = ({name: step[0]}, {name: step[1]})
    return phases



def kept_attention_layers(cfg: BudgetConfig, decoder_layers: int, last: bool) -> int:
    """Layers of a stage whose attention --chunked-recompute-keep-attention keeps: every
    checkpointed layer (the multi-token-prediction layers too, when checkpointed)."""
    if cfg.chunked_attention.chunked_recompute_keep_attention in ("off", None):
        return 0
    if not (cfg.chunk_tokens and cfg.chunked_attention.chunked_recompute_attention):
        return 0
    return decoder_layers + (cfg.mtp_layers if last and not mtp_stored_layers(cfg, last) else 0)


def kept_attention_terms(cfg: BudgetConfig, decoder_layers: int, last: bool):
    """({"loss", "layer", "host"}: bytes, {"loss", "layer": note}) of the kept attention."""
    layers = kept_attention_layers(cfg, decoder_layers, last)
    keep = cfg.chunked_attention.chunked_recompute_keep_attention
    if not layers:
        off = "0: attention is recomputed (--chunked-recompute-keep-attention off)"
        return kept_attention_bytes("off", 0, 0, 0), {"loss": off, "layer": off}
    _, hq, hkv = token_widths(cfg)
    saved = saved_bytes_per_token(hq, hkv, cfg.heads // cfg.tp, cfg.act_bytes)
    kept = kept_attention_bytes(keep, layers, cfg.tokens, saved)
    where = {"gpu": f"on the GPU for {layers} layers", "host": "on the host"}[keep]
    per_layer = f"N·{saved} B each (saved_bytes_per_token)"
    notes = {
        "loss": f"--chunked-recompute-keep-attention {keep}: K, V, output and log-sum-exp {where}; "
                + ("at the loss every layer's, " if keep == "gpu" else
                   "at the loss one layer's copy in flight, ") + per_layer,
        "layer": f"--chunked-recompute-keep-attention {keep}: "
                 + ("the other layers' kept tensors wait, " if keep == "gpu" else
                    "the next layer's tensors copied back ahead, ")
                 + f"{kept['layer'] // max(1, cfg.tokens * saved)} × " + per_layer,
    }
    return kept, notes


def _document_bytes(cfg: BudgetConfig) -> Tuple[int, str]:
    """The batch's document boundaries with --reset-attention-mask (attention per document
    holds nothing that grows with N², and its kernels' workspaces are within the whole
    sequence's)."""
    if not cfg.packed_documents:
        return 0, ""
    documents = cumulative_lengths_bytes(cfg.micro_batch * cfg.seq_length)
    return documents, f" + the documents' cumulative lengths {documents:,} B"


def _layer_phase(cfg: BudgetConfig, n_moe: int, n_dense: int, per: int):
    """The layer phase less the boundaries: the recomputed layer's saved activations, gradients
    and MoE work, or a dense layer's MLP backward where that is larger."""
    n = cfg.tokens
    saved = recomputed_layer_bytes_per_token(cfg, moe=n_moe > 0)
    dispatch, experts, moe_note = _moe_layer_working_set(cfg, n_moe)
    # upstream's MoE layer under full recompute: the snapshot shows one further N·H·b block per
    # other layer, allocated inside the checkpoint's backward, alive during the recompute
    upstream_extra = (cfg.layers - 1) * per if (n_moe and cfg.upstream_experts) else 0
    working_set = n * saved + 2 * per + upstream_extra + experts + KERNEL_WORKSPACE_BYTES
    dense = _dense_layer_bytes(cfg, n_dense, n) + 2 * per + KERNEL_WORKSPACE_BYTES
    if n_dense and dense > working_set + dispatch:
        return {"recompute_working_set": dense, "moe_dispatch": 0}, {
            "recompute_working_set": (
                f"a dense layer's (larger than a MoE layer's): its saved activations "
                f"N·{recomputed_layer_bytes_per_token(cfg, moe=False)} B + its MLP's backward "
                f"N·{dense_mlp_backward_bytes_per_token(cfg)} B + its input and output gradients "
                f"2·N·H·b + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
            "moe_dispatch": "0: the peak is in a dense layer"}
    terms = {"recompute_working_set": working_set, "moe_dispatch": dispatch}
    notes = {
        "recompute_working_set": (
            f"the recomputed layer's saved activations N·{saved} B + its input and output "
            f"gradients 2·N·H·b"
            + (f" + {cfg.layers - 1} further N·H·b blocks (upstream's MoE layer)"
               if upstream_extra else "")
            + (f" + the experts' working set {experts:,} B" if experts else "")
            + f" + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
        "moe_dispatch": moe_note,
    }
    return terms, notes


def _dense_layer_bytes(cfg: BudgetConfig, n_dense: int, tokens: int) -> int:
    """A dense layer's saved activations and MLP backward at ``tokens`` tokens; 0 without one
    on this stage."""
    if not n_dense:
        return 0
    return tokens * (recomputed_layer_bytes_per_token(cfg, moe=False)
                     + dense_mlp_backward_bytes_per_token(cfg))



def _chunked_layer_phase(cfg: BudgetConfig, n_moe: int, n_dense: int, per: int):
    """The layer phase less the boundaries with chunked recompute: the saved activations less
    ``released_bytes_per_token``, and the larger of attention's backward and one MLP chunk's."""
    n, b = cfg.tokens, cfg.act_bytes
    h_tok, hq, hkv = token_widths(cfg)
    saved = recomputed_layer_bytes_per_token(cfg, moe=n_moe > 0)
    # multi-latent attention has no fused QKV projection for the recompute to fold into chunks
    kept = saved - released_bytes_per_token(h_tok, hq, hkv, cfg.experts if n_moe else 0, b,
                                            fused_qkv=cfg.mla is None)
    # attention's backward: its gradients plus the output projection's input gradient N·H·b;
    # the MLP node has returned by then, so its saved input (the residual after attention, H·b
    # per token, counted in ``kept``) is gone: the two cancel
    attention_backward = n * activation_widths(cfg)["attn_grad"]
    mlp_chunk = _mlp_chunk_bytes(cfg, n_moe, n_dense)
    work = max(attention_backward, mlp_chunk)
    terms = {
        "recompute_working_set": n * kept + 2 * per + work + KERNEL_WORKSPACE_BYTES,
        "moe_dispatch": 0,
    }
    notes = {
        "recompute_working_set": (
            f"chunked recompute ({cfg.chunk_tokens:,}-token chunks): the recomputed layer keeps "
            f"N·{kept} B (N·{saved} B less released_bytes_per_token) + its input and output "
            f"gradients 2·N·H·b + the larger of attention's backward N·{attention_backward // n} B "
            f"and one MLP chunk's backward {mlp_chunk:,} B + "
            f"{KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
        "moe_dispatch": "0: inside the MLP chunk's working set (recompute working set)",
    }
    return terms, notes



def _gated_delta_net_layer_phase(cfg: BudgetConfig, n_moe: int, n_dense: int, per: int,
                                 chunked: bool):
    """The layer phase less the boundaries in a gated DeltaNet layer (the module's own counts:
    ``gdn_saved_bytes_per_token``, ``gdn_grad_bytes_per_token``, ``gdn_carry_bytes``).

    Whole: the layer keeps its residual, the pre-MLP norm's output and statistics and the router's
    fp32 tensors beside what the token mixer saves; the MLP's backward (the experts' working set)
    runs before the mixer's (its gradients), so the larger of the two. In chunks: the MLP block's
    input and one chunk, or one token-mixer chunk's saved activations and gradients with the state
    kept for every chunk (the mixer's node keeps only the layer's input, a boundary)."""
    n, b = cfg.tokens, cfg.act_bytes
    h_tok = token_widths(cfg)[0]
    saved = gdn_saved_bytes_per_token(cfg.gdn, b)
    grad = gdn_grad_bytes_per_token(cfg.gdn, b)
    if chunked:
        t = cfg.chunk_tokens
        carries = ceil_div(n, t) * cfg.micro_batch * gdn_carry_bytes(cfg.gdn, b)
        mixer = t * (saved + grad) + carries
        mlp = n * h_tok * b + _mlp_chunk_bytes(cfg, n_moe, n_dense)
        return {"recompute_working_set": 2 * per + max(mixer, mlp) + KERNEL_WORKSPACE_BYTES,
                "moe_dispatch": 0}, {
            "recompute_working_set": (
                f"a gated DeltaNet layer in {t:,}-token chunks: the larger of one token-mixer "
                f"chunk's saved activations and gradients {t:,}·({saved} + {grad}) B with the "
                f"state kept for each chunk {carries:,} B and the MLP block's {mlp:,} B (its "
                f"input and one chunk) + its input and output gradients 2·N·H·b + "
                f"{KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
            "moe_dispatch": "0: inside the MLP chunk's working set (recompute working set)"}
    dispatch, experts, moe_note = _moe_layer_working_set(cfg, n_moe)
    layer = 2 * h_tok * b + (h_tok * b + 4) + saved + (2 * cfg.experts * 4 if n_moe else 0)
    dense = n * dense_mlp_backward_bytes_per_token(cfg) if n_dense else 0
    backward = max(experts, n * grad, dense)
    return {"recompute_working_set": n * layer + 2 * per + backward + KERNEL_WORKSPACE_BYTES,
            "moe_dispatch": dispatch}, {
        "recompute_working_set": (
            f"a gated DeltaNet layer: its saved activations N·{layer} B (the token mixer's "
            f"{saved} B, gdn_saved_bytes_per_token) + its input and output gradients 2·N·H·b + "
            f"the larger of the MLP's backward and the mixer's gradients N·{grad} B "
            f"({backward:,} B) + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
        "moe_dispatch": moe_note}


def _mlp_chunk_bytes(cfg: BudgetConfig, n_moe: int, n_dense: int) -> int:
    """One MLP chunk's backward under chunked recompute: the MLP block's saved activations and
    MoE working set at T tokens, or a dense layer's chunk where that is larger."""
    chunk = cfg.replace(seq_length=cfg.chunk_tokens * max(1, cfg.cp) // max(1, cfg.micro_batch))
    dispatch, experts, _ = _moe_layer_working_set(chunk, n_moe)
    moe = chunk.tokens * recomputed_layer_bytes_per_token(chunk, moe=n_moe > 0) + dispatch \
        + experts
    return max(moe, _dense_layer_bytes(chunk, n_dense, chunk.tokens))



def _chunked_attention_layer_phase(cfg: BudgetConfig, n_moe: int, n_dense: int, per: int):
    """The layer phase less the boundaries with the attention sublayer in chunks too: what the
    attention node keeps, and the larger of attention's backward and the MLP block's."""
    n, b, t = cfg.tokens, cfg.act_bytes, cfg.chunk_tokens
    h_tok, hq, hkv = token_widths(cfg)
    saved = saved_bytes_per_token(hq, hkv, cfg.heads // cfg.tp, b)
    attention = n * backward_bytes_per_token(h_tok, hkv, b) \
        + t * chunk_backward_bytes_per_token(h_tok, hq, hkv, b, hq * cfg.output_gate)
    mlp = n * h_tok * b + _mlp_chunk_bytes(cfg, n_moe, n_dense)
    terms = {
        "recompute_working_set": n * saved + 2 * per + max(attention, mlp)
        + KERNEL_WORKSPACE_BYTES,
        "moe_dispatch": 0,
    }
    notes = {
        "recompute_working_set": (
            f"chunked recompute with the attention sublayer ({t:,}-token chunks): K, V, "
            f"attention's output and log-sum-exp N·{saved} B (saved_bytes_per_token) + two "
            f"gradients 2·N·H·b + the larger of attention's backward {attention:,} B "
            f"(backward_bytes_per_token, chunk_backward_bytes_per_token) and the MLP block's "
            f"{mlp:,} B (its input and one chunk) + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel "
            f"workspaces"),
        "moe_dispatch": "0: inside the MLP chunk's working set (recompute working set)",
    }
    return terms, notes



def output_layer_bytes(cfg: BudgetConfig) -> Tuple[int, str]:
    """Live bytes of the output layer and its loss at their peak (the loss forward)."""
    n, h, v, b = cfg.tokens, cfg.hidden, cfg.vocab, cfg.act_bytes
    ring, p = cfg.ring_dtp, max(1, cfg.ring_group)
    if ring.enabled:
        work = ring_dtp_workspace_bytes(
            n, h, v, world_size=p, mode=ring.ring_dtp_mode, chunk_tokens=ring.ring_dtp_chunk_tokens,
            input_bytes=b, grad_in_forward=ring.ring_dtp_grad_in_forward,
            gradient_rows=ring.ring_dtp_gradient_rows, cuda_kernels=True,
        )
        rows = min(ring.ring_dtp_chunk_tokens, n) if ring.ring_dtp_chunk_tokens else n
        note = (f"Ring-DTP over P={p}, {rows:,}-token strips × ceil(V/P)={ceil_div(v, p):,} fp32 "
                f"(mode {ring.ring_dtp_mode}"
                f"{', gradients in forward' if ring.ring_dtp_grad_in_forward else ''}): strips, "
                f"accumulators and travelling buffers (ring_dtp_workspace_bytes) = {work:,} B")
        s = ceil_div(v, p)
        if p == 1 or ring.ring_dtp_grad_in_forward:
            # dX is formed in the input dtype (it is the returned gradient) beside the working
            # set; dW's copy in the input dtype at the end
            returned = n * h * b + (s * h * b if b < 4 else 0)
            return work + returned, note + (
                f" + the returned dX N·H·{b} B and dW copy = {work + returned:,} B")
        # the ring's fp32 dX and dW beside their copies in the input dtype at the backward's end
        # (the returned gradients), with the per-token vectors: more than the strips when those
        # are short
        returned = (n + s) * h * (4 + b) + 8 * n * 4 if b < 4 else 0
        if returned > work:
            return returned, note + (
                f"; more at the backward's end: fp32 dX and dW and their {b}-byte copies "
                f"(N + V/P)·H·{4 + b} B + per-token vectors = {returned:,} B")
        return work, note
    local = v // cfg.tp
    # upstream's cross entropy takes an fp32 copy of the logits (none when they are fp32
    # already) and turns it into the softmax and then the gradient in place; the logits in the
    # activation dtype stay alive beside it through the loss's forward
    per_logit = 4 + (b if b < 4 else 0)
    return n * local * per_logit, (
        f"upstream's output layer: the N×V/TP logits"
        f"{f' in the {b}-byte activation dtype and their' if b < 4 else ' and the'} fp32 "
        f"softmax and gradient in place in the cross entropy, {per_logit}·{n:,}·{local:,} B")



def _moe_layer_working_set(cfg: BudgetConfig, n_moe: int) -> Tuple[int, int, str]:
    """(dispatch buffers, expert working set, note): the MoE part of the layer in recompute and
    backward."""
    if not n_moe:
        return 0, 0, "0: no MoE layer on this stage"
    h, b = cfg.hidden, cfg.act_bytes
    f = cfg.moe_ffn // cfg.etp
    fc1 = (2 if cfg.gated else 1) * f
    if cfg.pipelined_llep.enabled:
        parts = pipelined_llep_live_bytes(
            cfg.tokens, h, f, cfg.topk, cfg.ep, ceil_div(cfg.experts, cfg.ep),
            cfg.pipelined_llep.pipelined_llep_token_budget or cfg.tokens,
            cfg.pipelined_llep.pipelined_llep_max_chunks, act_bytes=b, gated=cfg.gated,
        )
        k_chunks, c_eff = pipelined_llep_chunks(cfg)
        return parts["dispatch"], parts["expert_backward"] + parts["weight_grads"], (
            f"PipelinedLLEP (pipelined_llep_live_bytes, K = {k_chunks}, c_eff = {c_eff:,}): "
            f"send and receive rows of two chunks 2·(k + E_p·k)·c_eff·H·b; one chunk's expert "
            f"backward E_p·k·c_eff·b·(2·fc1 + 2F + H) and the expert weight gradients")
    rows = moe_rows(cfg)["active"]
    skew = f" (assumed skew {cfg.routing_skew:g})" if cfg.ep > 1 else ""
    if cfg.upstream_experts:
        return 4 * rows * h * b, rows * b * (fc1 + f), (
            f"upstream's dispatcher and SequentialMLP in recompute: {rows:,} rows{skew} × 4·H·b "
            f"(permuted, sorted, expert output, combine-sorted rows); fc1 output and activation "
            f"rows·b·(fc1 + F)")
    return 2 * rows * h * b, rows * activation_widths(cfg)["row_grad"], (
        f"torch-native dispatch: send and receive buffers 2·{rows:,}{skew}·H·b; the grouped "
        f"experts' backward rows·b·(2·fc1 + 2F + H)")

