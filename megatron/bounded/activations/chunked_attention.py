"""Chunked recompute of the attention sublayer: only K, V, the output and its log-sum-exp whole.

With ``--chunked-recompute-tokens T`` the MLP block and the input norm with the QKV projection
are recomputed in chunks (:mod:`megatron.bounded.activations.chunked_recompute`), but attention's backward
still holds, for the whole sequence, the rotated q and k, v, the output, the output's gradient,
the rotary tables and the kernel's workspace (for flash attention an fp32 dQ and, with grouped
query attention, dK and dV expanded to every head). ``--chunked-recompute-attention`` runs the
whole attention sublayer (input norm, QKV projection, rotary embedding, causal attention, output
projection) as one autograd node over the same chunks (:class:`_ChunkedAttention`):

* forward (without gradients): q, k, v chunk by chunk into whole-sequence tensors, attention over
  the whole sequence, the output projection chunk by chunk. It saves the layer's input (which the
  recompute holds anyway), the rotated keys, the values, attention's output and its log-sum-exp;
  the queries are dropped.
* backward, chunks from the last to the first: recompute the chunk's q, k, v with gradients;
  back-propagate the chunk's output projection (its weight gradient, and attention's output
  gradient for the chunk only; the projection is re-run without its tensor-parallel all-reduce,
  whose backward is the identity); back-propagate attention for the chunk's queries block by block
  over the keys they see (:func:`megatron.bounded.attention.blockwise.query_block_backward`, dK and
  dV summed in fp32 for the sequence); by then the chunk's own dK, dV are complete, so the
  chunk's q, k, v are back-propagated through rotary, QKV projection and norm into the layer
  input's gradient.

With ``--chunked-recompute-keep-attention gpu|host`` the forward inside full recompute's checkpoint
keeps the rotated keys, the values, attention's output and its log-sum-exp, and the recompute's
forward takes them (:mod:`megatron.bounded.activations.kept_attention`) instead of running q, k, v
and attention again: only the output projection is recomputed before the backward above.

Exact up to the order of sums (weight gradients summed over chunks, attention's dQ, dK, dV summed
over blocks in fp32); causal self-attention without dropout. With packed documents
(:class:`megatron.bounded.attention.documents.DocumentParams`) attention stays within each
document, forward and backward (block pairs no document spans are skipped). The layer's
sliding window and sink (its core attention's ``window`` and ``softmax_offset``) apply as there:
pairs outside the window are skipped, the sink is folded into the saved output and log-sum-exp,
and its gradient is summed over the chunks.

Memory, per token of the recomputed layer: the node saves its input (the layer's input, a
checkpoint boundary) and K, V, the output and its log-sum-exp (:func:`saved_bytes_per_token`,
2·g·d·b + h·d·b + 4·h); its backward adds the input's gradient and the fp32 dK, dV accumulators
(:func:`backward_bytes_per_token`, H·b + 2·g·d·4) and one chunk's working set
(:func:`chunk_backward_bytes_per_token` per token of the chunk). Whole-sequence q, rotary tables,
the output's gradient and the kernel's workspace are gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer import attention as upstream_attention
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.tensor_parallel.random import is_checkpointing
from torch.nn.attention import SDPBackend

from megatron.bounded.attention.blockwise import (
    accumulation_dtype,
    attention_forward,
    block_bounds,
    KEY_BLOCKS_PER_CALL,
    query_block_backward,
    rows_by_block,
)
from megatron.bounded.activations.kept_attention import kept_attention
from megatron.bounded.attention.sinks import sink_gradient
from megatron.bounded.settings import BoundedArgumentError, Settings, flag_name, knob
from megatron.bounded.units import log_once

logger = logging.getLogger(__name__)

__all__ = [
    "ChunkedAttentionSettings",
    "AttentionChunks",
    "check_chunked_attention",
    "chunked_self_attention",
    "backward_bytes_per_token",
    "chunk_backward_bytes_per_token",
    "saved_bytes_per_token",
    "skipped_bias",
    "kept_attention_bytes",
    "KEEP_ATTENTION_CHOICES",
]

# --chunked-recompute-keep-attention: where the recompute's attention tensors wait ("auto" is
# resolved by the launch-time memory budget; a model config holds one of the others)
KEEP_ATTENTION_CHOICES = ("off", "gpu", "host", "auto")


@dataclass
class ChunkedAttentionSettings(Settings):
    """The chunked attention sublayer's flags. Not frozen: the model config inherits the fields."""

    EARLY = False  # after the Transformer Engine substitutions of validate_bounded_args

    chunked_recompute_attention: bool = knob(
        False, "With --chunked-recompute-tokens: recompute the whole attention sublayer in the same "
        "chunks, keeping K, V, the output and log-sum-exp, and back-propagate block by block.")
    chunked_recompute_keep_attention: str = knob(
        "off", "Keep attention's K, V, output and log-sum-exp for the recompute instead of "
        "running attention again (exact): on the gpu, on the host (pinned), or auto (where the "
        "budget fits).", choices=KEEP_ATTENTION_CHOICES)

    @property
    def enabled(self) -> bool:
        return bool(self.chunked_recompute_attention)

    def check_values(self) -> None:
        """Refuse kept attention without the chunked attention sublayer, and a placement that is
        not one of :data:`KEEP_ATTENTION_CHOICES`."""
        keep = self.chunked_recompute_keep_attention
        if not self.chunked_recompute_attention:
            if keep != "off":
                raise BoundedArgumentError(
                    f"--chunked-recompute-keep-attention {keep} keeps what the chunked attention "
                    "sublayer saves: add --chunked-recompute-attention or remove "
                    "--chunked-recompute-keep-attention.")
            return
        if keep not in KEEP_ATTENTION_CHOICES:
            raise BoundedArgumentError(
                f"--chunked-recompute-keep-attention {keep!r}: choose one of "
                f"{', '.join(KEEP_ATTENTION_CHOICES)}.")

    def check_placed(self) -> None:
        """Refuse ``auto`` where the kept tensors' place must be known: a model config (``auto``
        is resolved by ``pretrain_gpt.py``'s launch-time memory budget before the config is
        built)."""
        if self.chunked_recompute_keep_attention == "auto":
            raise BoundedArgumentError(
                "--chunked-recompute-keep-attention auto is resolved by pretrain_gpt.py's "
                "launch-time memory budget: a config built in code states the placement "
                "(off, gpu or host).")

    def check(self, args) -> None:
        self.check_values()
        check_chunked_attention(args)

    def kept_text(self) -> str:
        """Where attention's tensors wait for the recompute, for the start-up line ("" when
        attention is recomputed)."""
        keep = self.chunked_recompute_keep_attention
        if not self.chunked_recompute_attention or keep == "off":
            return ""
        where = {"gpu": "on the GPU", "host": "in pinned host memory"}.get(keep, keep)
        return f", kept {where} for the recompute (not run again)"

    def placed_text(self, why: str) -> str:
        """The start-up line of ``auto`` as the memory budget placed it (``self``: the placed
        settings, ``why``: the budget's reason), printed by pretrain_gpt.py and memory_budget."""
        return (f"--chunked-recompute-keep-attention auto: {self.chunked_recompute_keep_attention}"
                f" ({why})")

# SDPA backends with a blocked counterpart (megatron.bounded.attention.blockwise.KERNELS)
KERNEL_OF_BACKEND = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash"}


def check_chunked_attention(config) -> None:
    """Refuse what the chunked attention sublayer cannot run with the rest of the flags or the
    model config ``config`` (its own fields: :meth:`ChunkedAttentionSettings.check_values`)."""
    if not config.chunked_recompute_attention:
        return
    keep = config.chunked_recompute_keep_attention
    pipeline = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if keep != "off" and pipeline > 1:
        raise BoundedArgumentError(
            f"--chunked-recompute-keep-attention {keep} cannot be used with "
            f"--pipeline-model-parallel-size {pipeline}: the kept tensors are matched to each "
            "layer's recompute in backward order, which pipeline schedules interleave across "
            "micro-batches (remove --chunked-recompute-keep-attention or use "
            "--pipeline-model-parallel-size 1).")

    problems = []
    if not getattr(config, "chunked_recompute_tokens", 0):
        problems.append("it uses the chunks of --chunked-recompute-tokens: set it (> 0)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"--attention-dropout {config.attention_dropout} (set it to 0)")
    if getattr(config, "context_parallel_size", 1) > 1:
        problems.append(f"--context-parallel-size {config.context_parallel_size}")
    if getattr(config, "multi_latent_attention", False):
        # MLA rotates q and k inside get_query_key_value_tensors, from positions counted from
        # the rows it is given: a chunk would get the angles of the sequence's first rows
        problems.append("--multi-latent-attention (its projections apply the rotary embedding "
                        "from the chunk's own positions: remove --chunked-recompute-attention, "
                        "keep --chunked-recompute-tokens)")
    for field in ("fused_single_qkv_rope", "qk_clip", "apply_rope_fusion"):
        if getattr(config, field, False):
            problems.append(f"{flag_name(field)} (remove it)")
    if problems:
        raise BoundedArgumentError(
            "--chunked-recompute-attention cannot be used here: " + "; ".join(problems) + ".")


def kept_attention_bytes(keep: str, layers: int, tokens: int, saved_per_token: int) -> dict:
    """Bytes of the tensors --chunked-recompute-keep-attention keeps for ``layers`` recomputed
    layers of ``tokens`` tokens (``saved_per_token``: :func:`saved_bytes_per_token`), beyond
    the one the layer in backward holds as its node's saved tensors: ``{"loss": on the GPU at the
    loss, "layer": on the GPU in the last layer's backward, "host": pinned on the host}``. On the
    GPU every layer's wait until its recompute; on the host one layer's copy may be in flight
    at the loss and one layer is copied back ahead in backward."""
    per_layer = tokens * saved_per_token
    if keep == "gpu":
        return {"loss": layers * per_layer, "layer": (layers - 1) * per_layer, "host": 0}
    if keep == "host":
        return {"loss": per_layer, "layer": per_layer, "host": layers * per_layer}
    return {"loss": 0, "layer": 0, "host": 0}


def saved_bytes_per_token(q_width: int, kv_width: int, heads: int, act_bytes: int) -> int:
    """Bytes per token the node saves besides its input: K and V, attention's output and its
    fp32 log-sum-exp. ``q_width`` = heads·d and ``kv_width`` = groups·d, per rank."""
    return 2 * kv_width * act_bytes + q_width * act_bytes + 4 * heads


def backward_bytes_per_token(hidden: int, kv_width: int, act_bytes: int) -> int:
    """Bytes per token the node's backward adds for the whole sequence: the input's gradient and
    the fp32 dK, dV accumulators."""
    return hidden * act_bytes + 2 * kv_width * 4


def chunk_backward_bytes_per_token(hidden: int, q_width: int, kv_width: int,
                                   act_bytes: int, gate_width: int = 0) -> int:
    """Bytes per token of ONE chunk while the node back-propagates it: the recomputed norm
    output, fused QKV, rotated q and k and output projection; attention output's gradient, the
    fp32 dQ, and the block kernel's own (an fp32 dQ accumulator, dK and dV expanded to every
    head, and its dQ, dK, dV). A kernel call covers up to ``KEY_BLOCKS_PER_CALL`` key blocks
    (each a chunk long): per key token beyond the first block, dK and dV expanded to every head
    and the call's fp32 dK, dV (2·q_width·b + 2·kv_width·4, the extra peak
    ``tools/benchmarks/bench_block_backward.py`` measures per key block). With an output gate
    (``gate_width``: q wide), the gate in the fused QKV, its gradient and the gated output."""
    b = act_bytes
    recomputed = hidden * b + (q_width + 2 * kv_width) * b + (q_width + kv_width) * b + hidden * b
    gradients = q_width * b + q_width * 4
    kernel = q_width * 4 + 2 * q_width * b + (q_width + 2 * kv_width) * b
    merged_keys = (KEY_BLOCKS_PER_CALL - 1) * (2 * q_width * b + 2 * kv_width * 4)
    return recomputed + gradients + kernel + merged_keys + 3 * gate_width * b


class AttentionChunks:
    """Upstream's ``SelfAttention`` modules, applied to a chunk of rows [start, end)."""

    def __init__(self, attention, rotary_pos_emb):
        self.attention = attention
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        self.rotary = rotary_pos_emb or (None, None)
        core = attention.core_attention
        self.scale, self.window, self.sink = core.softmax_scale, core.window, core.softmax_offset
        # the same kernels, in the same order, as the layer's SDPA core attention
        self.kernels = [KERNEL_OF_BACKEND[backend] for backend in attention.core_attention.backends
                        if backend in KERNEL_OF_BACKEND]
        self.kernel = None  # the one the forward ran, whose log-sum-exp the backward reads
        self.gated = bool(attention.config.attention_output_gate)

    def _rotate(self, t, freqs, start: int, end: int):
        if freqs is None:
            return t
        # the binding upstream's attention calls (megatron.bounded.upstream.layers fuses it)
        return upstream_attention.apply_rotary_pos_emb(
            t, freqs[start:end], config=self.attention.config,
            mscale=self.attention._yarn_concentration_factor,
            cp_group=self.attention.pg_collection.cp,
        )

    def qkv(self, hidden, start: int, end: int):
        """Rotated query, key and value ``[rows, b, heads or groups, d]`` of the rows, and the
        output gate ``[rows, b, heads, d]`` with ``--attention-output-gate`` (else None)."""
        query, key, value, *gate = self.attention.get_query_key_value_tensors(
            hidden, None, output_gate=self.gated)
        q_freqs, k_freqs = self.rotary
        return (self._rotate(query, q_freqs, start, end), self._rotate(key, k_freqs, start, end),
                value, gate[0] if gate else None)

    def _gate(self, context, gate):
        """Attention's output through the output gate (upstream's arithmetic), when there is one."""
        return context if gate is None else self.attention._apply_output_gate(context, gate)

    def project(self, context, gate=None):
        """Output projection of ``[rows, b, heads, d]`` attention output, gated by ``gate``
        (bias added later when the projection skips it)."""
        context = self._gate(context, gate)
        rows, batch = context.shape[:2]
        output, _ = self.attention.linear_proj(context.reshape(rows, batch, -1))
        return output

    def project_for_backward(self, context, gate=None):
        """What the backward differentiates: this rank's share of the output projection without
        the tensor-parallel all-reduce, whose backward is the identity on a row-parallel layer's
        input gradient (the gradients are the module's; one collective less per chunk). Upstream's
        module itself where it accumulates its weight gradient in a fused kernel."""
        proj = self.attention.linear_proj
        if getattr(proj, "gradient_accumulation_fusion", False) or not isinstance(
                proj, RowParallelLinear):
            return self.project(context, gate)
        context = self._gate(context, gate)
        rows, batch = context.shape[:2]
        output = torch.nn.functional.linear(context.reshape(rows, batch, -1), proj.weight)
        if proj.bias is not None and not proj.skip_bias_add:
            output = output + proj.bias
        return output

    def attend(self, hidden, chunk_rows: int, sequences=None):
        """What the backward keeps of attention over the whole sequence: (key, value, attention
        output, log-sum-exp), and the output gate (None without one: not kept, only the forward's
        projection reads it). ``sequences``: each sequence's document bounds, or None."""
        rows = hidden.shape[0]
        bounds = block_bounds(rows, chunk_rows)

        def projected(start, end):
            return tuple(t for t in self.qkv(hidden[start:end], start, end) if t is not None)

        query, key, value, *gate = rows_by_block(rows, bounds, projected)
        context, lse, self.kernel = attention_forward(query, key, value, self.scale, self.kernels,
                                                      sequences, self.window, self.sink)
        log_once(logger, "chunked attention runs the %s attention kernels (preference: %s)",
                 self.kernel, ", ".join(self.kernels) or "reference",
                 key=("chunked attention kernel", self.kernel))
        return key, value, context, lse, gate[0] if gate else None

    def project_rows(self, context, chunk_rows: int, hidden, gate=None):
        """The sublayer's output: the output projection of attention's output, chunk by chunk;
        gated by ``gate``, or, with an output gate not given (attention kept by the forward),
        by the gate recomputed from the chunk's rows of ``hidden``."""
        rows = context.shape[0]

        def chunk(start, end):
            rows_gate = gate[start:end] if gate is not None else (
                self.qkv(hidden[start:end], start, end)[3] if self.gated else None)
            return (self.project(context[start:end], rows_gate),)

        (output,) = rows_by_block(rows, block_bounds(rows, chunk_rows), chunk)
        return output


class _ChunkedAttention(torch.autograd.Function):
    """y = attention sublayer(x) over row chunks; backward recomputes one chunk at a time."""

    @staticmethod
    def forward(ctx, chunks: AttentionChunks, chunk_rows: int, sequences, kept,
                hidden: torch.Tensor, sink):  # sink: chunks.sink, an input for its gradient
        gate = None
        if kept is None:
            key, value, context, lse, gate = chunks.attend(hidden, chunk_rows, sequences)
        else:  # what the forward kept (megatron.bounded.activations.kept_attention)
            (key, value, context, lse), chunks.kernel = kept
            if key.shape[:2] != hidden.shape[:2]:
                raise RuntimeError(
                    f"kept attention tensors of {tuple(key.shape[:2])} rows and batch do not "
                    f"match the recomputed layer's input {tuple(hidden.shape[:2])}: each "
                    f"layer's forward must be followed by its own recompute")
        output = chunks.project_rows(context, chunk_rows, hidden, gate)
        del gate
        ctx.chunks, ctx.bounds = chunks, block_bounds(hidden.shape[0], chunk_rows)
        ctx.sequences = sequences
        ctx.save_for_backward(hidden, key, value, context, lse)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden, key, value, context, lse = ctx.saved_tensors
        chunks, bounds = ctx.chunks, ctx.bounds
        grad_hidden = torch.empty_like(hidden)
        grad_key = torch.zeros(key.shape, dtype=accumulation_dtype(key.dtype), device=key.device)
        grad_value = torch.zeros_like(grad_key)
        sink = chunks.sink
        grad_sink = None if sink is None or not ctx.needs_input_grad[5] else torch.zeros(
            sink.shape, dtype=lse.dtype, device=sink.device)
        for start, end in reversed(bounds):
            rows = hidden[start:end].detach().requires_grad_(True)
            chunk_context = context[start:end].detach().requires_grad_(True)
            with torch.enable_grad():
                q, k, v, gate = chunks.qkv(rows, start, end)
                # the gate's gradient joins q, k and v's below, through their shared projection
                gate_input = None if gate is None else gate.detach().requires_grad_(True)
                out = chunks.project_for_backward(chunk_context, gate_input)
            torch.autograd.backward(out, grad_output[start:end])
            del out
            grad_q = query_block_backward(
                chunk_context.grad, q.detach(), key, value, context[start:end],
                lse[:, :, start:end], start, bounds, grad_key, grad_value, chunks.scale,
                chunks.kernel, ctx.sequences, chunks.window,
            )
            if grad_sink is not None:
                grad_sink += sink_gradient(*(t.permute(1, 2, 0, 3) for t in (
                    chunk_context.grad, context[start:end])), lse[:, :, start:end], sink)
            del chunk_context
            outputs = (q, k, v) + (() if gate is None else (gate,))
            grads = (grad_q.to(q.dtype), grad_key[start:end].to(k.dtype),
                     grad_value[start:end].to(v.dtype))
            torch.autograd.backward(outputs, grads + (() if gate is None else (gate_input.grad,)))
            grad_hidden[start:end] = rows.grad
            del q, k, v, gate, gate_input, rows, grad_q, outputs
        return None, None, None, None, grad_hidden, (
            None if grad_sink is None else grad_sink.to(sink.dtype))


def chunked_self_attention(attention, hidden: torch.Tensor, rotary_pos_emb, chunk_rows: int,
                           documents=None, keep: str = "off") -> torch.Tensor:
    """Upstream ``SelfAttention``'s output (before its skipped bias) for ``hidden`` ``[s, b, H]``,
    computed over chunks of ``chunk_rows`` rows; with gradients, one node as described above.
    ``documents``: the micro-batch's :class:`DocumentParams`, or None. ``keep`` ("gpu" or
    "host"; :mod:`megatron.bounded.activations.kept_attention`): inside full recompute's
    checkpoint, the forward keeps what the node saves and the recompute takes it instead of
    running attention again."""
    chunks = AttentionChunks(attention, rotary_pos_emb)
    sequences = None if documents is None else documents.sequences
    keep = keep if keep != "off" and is_checkpointing() else "off"
    if not (torch.is_grad_enabled() and hidden.requires_grad):
        key, value, context, lse, gate = chunks.attend(hidden, chunk_rows, sequences)
        if keep != "off" and not torch.is_grad_enabled():  # the checkpoint's first forward
            kept_attention().keep(attention, (key, value, context, lse), chunks.kernel,
                                  on_host=keep == "host")
        elif keep != "off":  # a recompute whose input needs no gradient
            kept_attention().drop(attention)
        return chunks.project_rows(context, chunk_rows, hidden, gate)
    kept = kept_attention().take(attention) if keep != "off" else None
    return _ChunkedAttention.apply(chunks, chunk_rows, sequences, kept, hidden, chunks.sink)


def skipped_bias(attention) -> Optional[torch.Tensor]:
    """The output projection's bias when the projection leaves adding it to the caller."""
    proj = attention.linear_proj
    return getattr(proj, "bias", None) if getattr(proj, "skip_bias_add", False) else None
