"""Chunked recompute: a layer's per-token work recomputed in sequence chunks.

Under full recompute a layer is run twice: without gradients in the forward, and again with
gradients in its backward, where everything the layer's backward reads is alive at once for the
whole sequence. Only attention needs the whole sequence; the MLP block (pre-MLP norm, router,
experts or dense MLP, the residual add) is per token. With ``--chunked-recompute-tokens T``
(:class:`ChunkedRecomputeTransformerLayer`):

* **MLP block in chunks.** The block runs as one autograd node (:class:`_ChunkedBlock`) over
  chunks of T tokens: its forward runs the chunks without gradients into one output; its backward
  recomputes chunk by chunk with gradients and back-propagates each at once, so only one chunk's
  norm output, router tensors and expert working set are alive (PipelinedLLEP then sees T tokens
  per call). It keeps only its input, the residual after attention, which the layer needs anyway.
* **Outputs released.** Inside the recompute of upstream's checkpoint a node's output is read by
  nothing once the node's backward starts (for the MLP node it is the layer's output, where the
  backward begins), so the node frees the output's storage then (the tensor keeps its shape for
  autograd's checks).
* **Input norm and QKV projection in chunks.** A second node of the same kind runs the input norm
  and the fused QKV projection, so the norm's output (kept for the projection's weight gradient)
  is only ever one chunk; it saves the layer's input, which the recompute holds anyway.
* **Compact attention inputs.** Attention keeps q, k, v for its backward; v (and q, k without
  rotary embeddings) are views of the fused QKV projection and would keep all of it alive, so
  the attention copies them out (``megatron.bounded.attention.core.compact_attention_inputs``).
* **Recurrent token mixers** (gated DeltaNet layers) run their whole sublayer in the same
  chunks, handing their state from chunk to chunk
  (:func:`megatron.bounded.attention.chunked_scan.chunked_scan`): the backward recomputes the
  chunks last to first, each from the state the forward kept for it.
* **DeepSeek sparse attention** (``--experimental-attention-variant dsa``) layers attend over
  the whole sequence in multi-latent attention's latent form
  (:func:`megatron.bounded.attention.sparse_mla_latent.attends_in_latent_form`): the selected
  keys' shared latent rows, never the heads' expanded keys and values of every token.
* **The attention sublayer too** (``--chunked-recompute-attention``): input norm, QKV
  projection, rotary embedding, attention and output projection become one node over the same
  chunks whose backward runs attention block by block (:mod:`megatron.bounded.activations.chunked_attention`);
  the QKV node above is then not used.

Exact: the chunks see the same inputs, and the load-balancing loss uses the counts of the whole
micro-batch (:mod:`megatron.bounded.moe.chunk_routing`), so each token's gradients are computed by
the same operations as without chunks; weight gradients are summed over the chunks in a
different order (within floating-point rounding of the unchunked sum;
``tests/unit/activations/test_chunked_recompute.py`` checks both).

Memory, per token of a recomputed layer, this removes (``released_bytes_per_token``): the layer
output H·b, both norm outputs and their fp32 inverse RMS 2·(H·b + 4), the fused QKV less the
copied-out v (heads + groups)·kv·b, and the router's fp32 logits and load-balancing scores 2·E·4;
the MLP block's working set then grows with T instead of N. A layer without a fused QKV
projection (multi-latent attention) keeps its input norm's output, which its down-projections
save, and its attention's own inputs: only the layer output, the pre-MLP norm's output and the
router's tensors go.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, is_checkpointing
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.bounded.attention.core import SDPACoreAttention
from megatron.bounded.attention.documents import DocumentParams, document_source
from megatron.bounded.attention.blockwise import block_bounds, rows_by_block
from megatron.bounded.attention.chunked_scan import input_and_its_gradient
from megatron.bounded.activations.chunked_attention import chunked_self_attention, skipped_bias
from megatron.bounded.moe.backend import select_moe_backend
from megatron.bounded.moe.chunk_routing import RoutingCounts, applying, collecting
from megatron.bounded.object_changes import object_change
from megatron.bounded.settings import BoundedArgumentError, Settings, flag_name, knob

__all__ = [
    "ChunkedRecomputeSettings",
    "ChunkedRecomputeTransformerLayer",
    "chunked_block",
    "check_chunked_recompute",
    "released_bytes_per_token",
]

@dataclass
class ChunkedRecomputeSettings(Settings):
    """The chunked recompute's flag. Not frozen: the model config inherits the field."""

    EARLY = False  # after the Transformer Engine substitutions of validate_bounded_args

    chunked_recompute_tokens: int = knob(
        0, "With --recompute-granularity full: recompute each layer's MLP block in backward in "
        "sequence chunks of T tokens (0: off).", metavar="T")

    @property
    def enabled(self) -> bool:
        return bool(self.chunked_recompute_tokens)

    def check(self, args) -> None:
        check_chunked_recompute(args)


def check_chunked_recompute(config) -> None:
    """Refuse settings the chunked recompute cannot run exactly (on parsed flags or a config;
    the messages name the flags)."""
    tokens = getattr(config, "chunked_recompute_tokens", 0) or 0
    if tokens < 0:
        raise BoundedArgumentError(
            f"--chunked-recompute-tokens must be >= 0 (0: off), got {tokens}."
        )
    if tokens == 0:
        return
    problems = []
    if getattr(config, "transformer_impl", "local") != "local":
        problems.append("it is part of the local layer spec: use --transformer-impl local")
    if getattr(config, "recompute_granularity", None) != "full":
        problems.append(
            "it reorganises the recompute of full activation recompute: add "
            "--recompute-granularity full"
        )
    variant = getattr(config, "experimental_attention_variant", None)
    if variant not in (None, "gated_delta_net", "dsa"):
        problems.append(
            f"--experimental-attention-variant {variant} (only gated_delta_net and dsa "
            "layers run under it): remove one of the two"
        )
    if variant == "gated_delta_net" and document_source(config) is not None:
        documents = ("--reset-attention-mask" if document_source(config) == "eod"
                     else "--dataloader-inter-document-masking")
        problems.append(
            f"{documents} (packed documents) with gated DeltaNet layers, whose chunks hand one "
            "sequence's state on: remove one of the two"
        )
    if getattr(config, "sequence_parallel", False):
        problems.append(
            "--sequence-parallel (the QKV projection would gather chunks of every "
            "rank's rows out of order): remove it"
        )
    if getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None):
        if select_moe_backend(config) != "torch":
            problems.append(
                "its MoE layers need the torch-native MoE backend, whose router splits the "
                "load-balancing loss over chunks: add --pipelined-llep (or "
                "--bounded-moe-backend torch with --moe-expert-rank-capacity-factor)"
            )
        balancing = getattr(config, "moe_router_load_balancing_type", "aux_loss")
        balancing = [balancing] if isinstance(balancing, str) else list(balancing)
        if any(kind not in ("aux_loss", "none") for kind in balancing):
            problems.append(
                f"--moe-router-load-balancing-type {' '.join(balancing)} (only aux_loss "
                "or none split exactly over chunks)"
            )
        for field in ("moe_z_loss_coeff", "moe_input_jitter_eps"):
            if getattr(config, field, None):
                problems.append(f"{flag_name(field)} (remove it)")
        if getattr(config, "moe_router_force_load_balancing", False):
            problems.append("--moe-router-force-load-balancing (remove it)")
    if problems:
        raise BoundedArgumentError(
            f"--chunked-recompute-tokens {tokens} cannot be used here: "
            + "; ".join(problems) + "."
        )


def released_bytes_per_token(hidden: int, q_width: int, kv_width: int, experts: int,
                             act_bytes: int, fused_qkv: bool) -> int:
    """Bytes per token a recomputed layer no longer keeps with chunked recompute (see the module
    docstring): layer output, the pre-MLP norm's output and inverse RMS, router tensors and, with
    a fused QKV projection (``fused_qkv``: folded with the input norm into chunks), the input
    norm's output and inverse RMS and QKV less v. ``hidden``, ``q_width`` (heads·kv) and
    ``kv_width`` (groups·kv) are per-rank widths."""
    b = act_bytes
    released = hidden * b + (hidden * b + 4) + 2 * experts * 4
    if fused_qkv:
        released += (hidden * b + 4) + (q_width + kv_width) * b
    return released


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_cuda_rng_tracker().set_states(tracker)


class _ChunkedBlock(torch.autograd.Function):
    """y = block(x) computed over row chunks; backward recomputes one chunk at a time."""

    @staticmethod
    def forward(ctx, block: Callable, chunk_rows: int, release_output: bool, x: torch.Tensor):
        bounds = block_bounds(x.shape[0], chunk_rows)
        counts = RoutingCounts()
        rng = []

        def chunk(start, end):
            rng.append(_rng_states())
            return (block(x[start:end]),)

        with collecting(counts):
            (out,) = rows_by_block(x.shape[0], bounds, chunk)
        counts.finalize()
        ctx.block, ctx.bounds, ctx.rng, ctx.counts = block, bounds, rng, counts
        ctx.output = weakref.ref(out) if release_output else None
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, grad_x = input_and_its_gradient(ctx)
        current = _rng_states()
        try:
            for (start, end), states in zip(ctx.bounds, ctx.rng):
                _set_rng_states(states)
                chunk = x[start:end].detach().requires_grad_(True)
                with torch.enable_grad(), applying(ctx.counts):
                    y = ctx.block(chunk)
                torch.autograd.backward(y, grad_out[start:end])
                grad_x[start:end] = chunk.grad
                del y, chunk
        finally:
            _set_rng_states(current)
        return None, None, None, grad_x


def chunked_block(block: Callable, x: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """``block(x)`` with ``block`` applied to chunks of ``chunk_rows`` rows (dim 0) of ``x``.

    With gradients, the chunks are recomputed one at a time in backward (one autograd node that
    saves only ``x``); inside the recompute of upstream's checkpoint, the output's storage is
    freed when that backward starts. Without gradients, the chunks run one after the other.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        bounds = block_bounds(x.shape[0], chunk_rows)
        return rows_by_block(x.shape[0], bounds, lambda start, end: (block(x[start:end]),))[0]
    return _ChunkedBlock.apply(block, chunk_rows, is_checkpointing(), x)


class ChunkedRecomputeTransformerLayer(TransformerLayer):
    """Upstream's ``TransformerLayer`` that, while training, runs through :func:`chunked_block`
    in chunks of ``config.chunked_recompute_tokens`` tokens

    * its MLP block (pre-MLP norm, MLP or MoE, residual add), and
    * its input norm with the fused QKV projection: the layer skips the input norm and the QKV
      projection applies it chunk by chunk, so the norm's output is never held for the whole
      sequence (the node saves the layer's input, which the recompute holds anyway).

    The second is done on this instance's modules (``forward`` of ``input_layernorm`` and
    ``self_attention.linear_qkv`` are wrapped; chunked attention wraps ``self_attention``'s: the
    entries ``chunked-recompute-input-norm-in-qkv`` and ``chunked-attention-forward`` of
    :mod:`megatron.bounded.object_changes`), so parameter names and checkpoints stay upstream's.
    Inference and evaluation take upstream's path."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        recompute_in_chunks = getattr(self.self_attention, "recompute_in_chunks", None)
        if recompute_in_chunks is not None:  # a recurrent token mixer chunks itself
            recompute_in_chunks(config.chunked_recompute_tokens)
        linear_qkv = getattr(self.self_attention, "linear_qkv", None)
        if linear_qkv is not None and isinstance(self.input_layernorm, torch.nn.Module) \
                and hasattr(self.input_layernorm, "weight"):
            self._fold_input_norm_into_qkv(self.input_layernorm, linear_qkv)
        if config.chunked_recompute_attention and recompute_in_chunks is None:
            if linear_qkv is None or not isinstance(self.self_attention.core_attention,
                                                    SDPACoreAttention):
                raise ValueError("chunked attention (--chunked-recompute-attention) needs "
                                 "self-attention with a fused QKV projection and the SDPA core "
                                 "attention of the local layer spec")
            self._chunk_attention(self.self_attention)

    def _chunk_rows(self, hidden_states) -> int:
        return max(1, self.config.chunked_recompute_tokens // hidden_states.shape[1])

    def _fold_input_norm_into_qkv(self, norm, linear_qkv) -> None:
        norm_forward, linear_forward = norm.forward, linear_qkv.forward

        def input_norm(hidden_states):
            return hidden_states if self.training else norm_forward(hidden_states)

        def norm_and_qkv(hidden_states, *args, **kwargs):
            if not self.training:
                return linear_forward(hidden_states, *args, **kwargs)

            def block(chunk):
                output, bias = linear_forward(norm_forward(chunk), *args, **kwargs)
                if bias is not None:
                    raise ValueError("chunked recompute: the QKV projection must add its bias")
                return output

            if self.config.chunked_recompute_attention:
                return block(hidden_states), None  # the attention node chunks the rows
            return chunked_block(block, hidden_states, self._chunk_rows(hidden_states)), None

        change = object_change("chunked-recompute-input-norm-in-qkv")
        change.set(norm, forward=input_norm)
        change.set(linear_qkv, forward=norm_and_qkv)

    def _chunk_attention(self, attention) -> None:
        attention_forward = attention.forward

        def forward(hidden_states, attention_mask=None, **kwargs):
            if not self.training or kwargs.get("inference_context") is not None:
                return attention_forward(hidden_states, attention_mask, **kwargs)
            for unsupported in ("attention_bias", "key_value_states"):
                if kwargs.get(unsupported) is not None:
                    raise ValueError(f"chunked attention (--chunked-recompute-attention) takes "
                                     f"no {unsupported}")
            documents = kwargs.get("packed_seq_params")
            if documents is not None and not isinstance(documents, DocumentParams):
                raise ValueError("chunked attention (--chunked-recompute-attention) takes packed "
                                 "sequences only as DocumentParams")
            output = chunked_self_attention(attention, hidden_states,
                                            kwargs.get("rotary_pos_emb"),
                                            self._chunk_rows(hidden_states), documents,
                                            keep=self.config.chunked_recompute_keep_attention)
            return output, skipped_bias(attention)

        object_change("chunked-attention-forward").set(attention, forward=forward)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None,
                     packed_seq_params=None):
        tokens = self.config.chunked_recompute_tokens
        if inference_context is not None or not self.training or not tokens:
            return super()._forward_mlp(hidden_states, inference_context,
                                        padding_mask=padding_mask,
                                        packed_seq_params=packed_seq_params)
        if padding_mask is not None:
            raise ValueError("chunked recompute (--chunked-recompute-tokens) takes no padding mask")
        chunk_rows = self._chunk_rows(hidden_states)
        if chunk_rows >= hidden_states.shape[0]:
            return super()._forward_mlp(hidden_states, packed_seq_params=packed_seq_params)
        block = functools.partial(
            TransformerLayer._forward_mlp, self, packed_seq_params=packed_seq_params
        )
        return chunked_block(block, hidden_states, chunk_rows)
