"""Gated DeltaNet layers (``--experimental-attention-variant gated_delta_net``, Qwen3-Next and
Qwen3.5-MoE's linear attention) on the local implementation, without Transformer Engine.

megatron-core 0.19.2 builds these layers only with Transformer Engine's spec provider (and
flash-linear-attention installed). :class:`BoundedGatedDeltaNet` is the same layer on local
modules, with upstream's parameters (names, shapes, initialisation), so its checkpoints name
what upstream's do:

* ``in_proj``: the input norm fused with the input projection
  (:class:`~megatron.bounded.model.mla.NormedColumnParallelLinear`, parameters ``weight`` and
  ``layer_norm_weight`` as Transformer Engine's fused module), whose output is the sections
  ``[q, k, v, z, β, α]`` in this order (widths ``nk·dk, nk·dk, nv·dv, nv·dv, nv, nv``);
* ``conv1d``: the causal depthwise convolution over ``[q, k, v]`` (``--linear-conv-kernel-dim``
  taps), then the config's activation;
* q and k L2-normalised per head, each key head repeated for the ``nv / nk`` value heads it
  serves; ``β = sigmoid(β)``, the decay ``g = −exp(A_log) · softplus(α + dt_bias)`` (fp32);
* the gated delta rule (:func:`megatron.bounded.attention.gated_delta_rule.gated_delta_rule`:
  flash-linear-attention's Triton kernel on CUDA when installed, else ours);
* ``out_norm``: the config's norm over each value head (zero-centred with
  ``--apply-layernorm-1p``, as upstream's), times ``activation(z)``;
* ``out_proj``: the output projection (row-parallel, its bias added by the layer).

:func:`megatron.bounded.model.specs.gated_delta_net_spec` is the ``self_attention`` slot of such
a layer (the layer's own input norm is then the identity: ``in_proj`` normalises);
:func:`gated_delta_net_pattern` is
upstream's reading of ``--linear-attention-freq``. :func:`gdn_saved_bytes_per_token`,
:func:`gdn_grad_bytes_per_token` and :func:`gdn_carry_bytes` are what the memory budget counts
for one such layer.

With ``--chunked-recompute-tokens T`` (:meth:`BoundedGatedDeltaNet.recompute_in_chunks`) the
whole token mixer runs in chunks of T tokens, handing the recurrent state and the convolution's
last inputs from chunk to chunk (:func:`megatron.bounded.attention.chunked_scan.chunked_scan`).

Packed documents (:class:`~megatron.bounded.attention.documents.DocumentParams`, from
``--reset-attention-mask`` or ``--dataloader-inter-document-masking``) reset the layer at every
document start, as if each document ran alone: the convolution over the whole sequence is
recomputed on the first ``taps − 1`` rows of each document from that document's rows alone
(:func:`document_start_rows`), and the gated delta rule starts each document from a zero state
(``cu_seqlens``). No document's outputs depend on another's values.

Scope: one tensor-parallel rank, no context parallelism, packed documents without chunked
recompute (refused at argument time, ``megatron.bounded.launch.arguments``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
)
from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megatron.bounded.attention.chunked_scan import chunked_scan
from megatron.bounded.attention.documents import DocumentParams, to_device
from megatron.bounded.attention.gated_delta_rule import (
    DEFAULT_CHUNK_SIZE,
    gated_delta_rule,
    l2_normalize,
)

__all__ = ["BoundedGatedDeltaNet", "gated_delta_net_pattern", "check_gated_delta_net_flags",
           "is_gated_delta_net", "gdn_saved_bytes_per_token", "gdn_grad_bytes_per_token",
           "gdn_carry_bytes", "gdn_params", "document_start_rows"]

VARIANT = "gated_delta_net"


def is_gated_delta_net(config_or_args) -> bool:
    """Whether the model has gated DeltaNet layers."""
    return getattr(config_or_args, "experimental_attention_variant", None) == VARIANT


def gated_delta_net_pattern(config_or_args) -> List[int]:
    """Per layer, 1 for a gated DeltaNet layer and 0 for a full-attention one: upstream's
    ``get_linear_attention_pattern`` (an integer N makes every N-th layer, 1-based, full
    attention; a list is the pattern itself)."""
    return list(get_linear_attention_pattern(config_or_args))


class BoundedGatedDeltaNet(MegatronModule):
    """A gated DeltaNet layer's token mixer (module docstring), in the ``self_attention`` slot
    of a ``TransformerLayer``: ``forward(hidden [s, b, h]) -> (output [s, b, h], bias)``."""

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int = None,
                 pg_collection=None, bias: bool = False, conv_bias: bool = False,
                 A_init_range=(1, 16), **_unused):
        super().__init__(config)
        tp = 1 if pg_collection is None else pg_collection.tp.size()
        if tp != 1:
            raise ValueError("BoundedGatedDeltaNet runs on one tensor-parallel rank")
        self.layer_number = layer_number
        self.chunk_tokens = 0  # recompute_in_chunks
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.sections = (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim,
                         self.num_value_heads, self.num_value_heads)
        self.act_fn = config.activation_func
        tp_group = None if pg_collection is None else pg_collection.tp
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, sum(self.sections), config=config,
            init_method=config.init_method, gather_output=False, bias=bias,
            skip_bias_add=False, is_expert=False, tp_group=tp_group)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        conv_dim = 2 * self.qk_dim + self.v_dim
        self.conv1d = torch.nn.Conv1d(
            conv_dim, conv_dim, kernel_size=config.linear_conv_kernel_dim, groups=conv_dim,
            bias=conv_bias, device=device,
            dtype=config.params_dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(
            self.num_value_heads, device=device, dtype=config.params_dtype))
        a = torch.empty(self.num_value_heads, device=device, dtype=config.params_dtype)
        self.A_log = torch.nn.Parameter(torch.log(a.uniform_(*A_init_range)))
        for parameter in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
            if parameter is not None:  # split by heads or channels as upstream's (one rank here)
                parameter.tensor_model_parallel = True
                parameter.partition_dim = 0
        self.out_norm = build_module(submodules.out_norm, config=config,
                                     hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        self.out_proj = build_module(
            submodules.out_proj, self.v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args,
                packed_seq_params=None, inference_context=None, **kwargs):
        if inference_context is not None:
            raise NotImplementedError("gated DeltaNet layers keep no inference cache")
        seq_len, batch, _ = hidden_states.shape
        documents = _documents(packed_seq_params, seq_len, batch)
        if self.training and self.chunk_tokens and self.chunk_tokens // batch < seq_len:
            if documents is not None:
                raise ValueError("gated DeltaNet layers recompute in chunks whole sequences only "
                                 "(no packed documents)")
            gated = chunked_scan(self._mix, hidden_states, self.initial_carry(hidden_states),
                                 max(1, self.chunk_tokens // batch))
        else:
            gated, _ = self._mix(hidden_states, None, documents)
        return self.out_proj(gated)

    def recompute_in_chunks(self, tokens: int) -> None:
        """In training, mix the sequence in chunks of ``tokens`` tokens handing the state on
        (:func:`~megatron.bounded.attention.chunked_scan.chunked_scan`): the backward recomputes
        one chunk at a time, so only one chunk's intermediates are alive (0: off)."""
        self.chunk_tokens = tokens

    def initial_carry(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The state before a sequence's first token: the recurrent state (fp32) and the
        convolution's last ``taps − 1`` inputs, zeros."""
        batch = hidden_states.shape[1]
        taps = self.conv1d.kernel_size[0]
        state = hidden_states.new_zeros(batch, self.num_value_heads, self.key_head_dim,
                                        self.value_head_dim, dtype=torch.float32)
        return state, hidden_states.new_zeros(batch, self.conv1d.in_channels, taps - 1)

    def _mix(self, hidden_states: torch.Tensor, carry, documents=None) -> tuple:
        """``(gated output [s, b, nv·dv], carry after the last token or None)`` of the rows
        ``hidden_states`` [s, b, h]: from ``carry`` (:meth:`initial_carry`), or from zeros
        with no carry returned when ``carry`` is None; ``documents``: packed documents, each
        from zeros (without a carry)."""
        seq_len, batch, _ = hidden_states.shape
        projected, _ = self.in_proj(hidden_states)
        projected = projected.transpose(0, 1)  # [b, s, ·]
        qkv, z, beta, alpha = torch.split(
            projected, (2 * self.qk_dim + self.v_dim, self.v_dim, self.num_value_heads,
                        self.num_value_heads), dim=-1)
        taps = self.conv1d.kernel_size[0]
        # causal: each output sees its taps − 1 predecessors, zeros (or the carry) before the start
        history = torch.cat((qkv.new_zeros(batch, qkv.shape[-1], taps - 1) if carry is None
                             else carry[1].to(qkv.dtype), qkv.transpose(1, 2)), dim=-1)
        qkv = self.act_fn(self._convolution(history, qkv, documents))
        q, k, v = torch.split(qkv, (self.qk_dim, self.qk_dim, self.v_dim), dim=-1)
        repeat = self.num_value_heads // self.num_key_heads
        q, k = (l2_normalize(x.reshape(batch, seq_len, self.num_key_heads, self.key_head_dim))
                .repeat_interleave(repeat, dim=2) for x in (q, k))
        v = v.reshape(batch, seq_len, self.num_value_heads, self.value_head_dim)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        core, state = gated_delta_rule(
            q.contiguous(), k.contiguous(), v.contiguous(), g, beta.sigmoid(),
            deterministic=self.config.deterministic_mode,
            initial_state=None if carry is None else carry[0], output_final_state=carry is not None,
            **_kernel_documents(documents))
        normed = self.out_norm(core.reshape(-1, self.value_head_dim))
        gated = (normed * self.act_fn(z.reshape(-1, self.value_head_dim).float())).to(core.dtype)
        gated = gated.reshape(batch, seq_len, self.v_dim).transpose(0, 1).contiguous()
        if carry is None:
            return gated, None
        return gated, (state, history[..., history.shape[-1] - (taps - 1):])

    def _convolution(self, history: torch.Tensor, qkv: torch.Tensor,
                     documents: Optional[DocumentParams]) -> torch.Tensor:
        """The causal depthwise convolution of ``qkv`` [b, s, ·] (before its activation) given
        ``history`` [b, ·, taps − 1 + s] (what precedes the rows, then the rows); with
        ``documents``, each document's rows preceded by zeros as if it ran alone: over the whole
        sequence, then the first taps − 1 rows of every document again from that document's
        rows only."""
        mixed = F.conv1d(history, self.conv1d.weight, self.conv1d.bias,
                         groups=self.conv1d.groups).transpose(1, 2)
        if documents is None:
            return mixed
        rows = document_start_rows(documents, self.conv1d.kernel_size[0])
        sequence, position, reads, inside = (to_device(x, qkv.device) for x in rows)
        window = qkv[sequence.unsqueeze(-1), reads] * inside.unsqueeze(-1)  # [rows, taps, ·]
        restarted = torch.einsum("rkc,ck->rc", window, self.conv1d.weight[:, 0])
        if self.conv1d.bias is not None:
            restarted = restarted + self.conv1d.bias
        return mixed.index_put((sequence, position), restarted)


def _documents(packed_seq_params, seq_len: int, batch: int) -> Optional[DocumentParams]:
    """The packed documents a layer over ``seq_len`` × ``batch`` tokens is given (None: whole
    sequences); upstream's other packed layouts are refused."""
    if packed_seq_params is None:
        return None
    if not isinstance(packed_seq_params, DocumentParams):
        raise ValueError("gated DeltaNet layers take packed sequences only as DocumentParams "
                         "(the sbhd layout with document boundaries)")
    packed_seq_params.check_shape(seq_len, batch)
    return packed_seq_params


def _kernel_documents(documents: Optional[DocumentParams]) -> dict:
    """:func:`gated_delta_rule`'s document arguments: the offsets on the device and on the
    host (none without documents)."""
    if documents is None:
        return {}
    return dict(cu_seqlens=documents.cu_seqlens_q, cu_seqlens_cpu=documents.host_cu_seqlens())


def document_start_rows(documents: DocumentParams, taps: int) -> Tuple[torch.Tensor, ...]:
    """The rows where a causal convolution of ``taps`` taps over whole sequences reads before a
    document's start: the first ``taps − 1`` tokens of every document (host tensors). Returns
    their sequence and position [r], the positions their taps read [r, taps] (tap k reads
    ``taps − 1 − k`` rows back; clamped to the document's start) and which of those lie in the
    document [r, taps] (the others read the zeros before it)."""
    sequence, starts, ends = zip(*((index, start, end)
                                   for index, bounds in enumerate(documents.sequences)
                                   for start, end in zip(bounds, bounds[1:])))
    sequence, starts, ends = (torch.tensor(x).unsqueeze(-1) for x in (sequence, starts, ends))
    offset = torch.arange(taps - 1)  # within the document
    position = starts + offset  # [documents, taps − 1]
    real = position < ends  # a document shorter than taps − 1 has fewer such rows
    back = torch.arange(taps - 1, -1, -1)
    reads = torch.maximum(position.unsqueeze(-1) - back, starts.unsqueeze(-1))
    inside = (offset.unsqueeze(-1) >= back).expand(len(starts), -1, -1)
    return sequence.expand_as(position)[real], position[real], reads[real], inside[real]


def gdn_params(config_or_args, norm_params) -> int:
    """Parameters of one gated DeltaNet token mixer: in_proj H·(2·nk·dk + 2·nv·dv + 2·nv), its
    input norm, conv1d (2·nk·dk + nv·dv)·taps, dt_bias and A_log nv each, out_norm dv, out_proj
    nv·dv·H; ``norm_params(width)`` counts a norm's parameters."""
    c = config_or_args
    qk, v = c.linear_key_head_dim * c.linear_num_key_heads, \
        c.linear_value_head_dim * c.linear_num_value_heads
    h = c.hidden_size
    return (h * (2 * qk + 2 * v + 2 * c.linear_num_value_heads) + norm_params(h)
            + (2 * qk + v) * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads
            + norm_params(c.linear_value_head_dim) + v * h)


def gdn_saved_bytes_per_token(config_or_args, act_bytes: int) -> int:
    """Bytes per token one gated DeltaNet token mixer keeps for its backward, its input norm
    included (the layer's MLP part is counted as any layer's); the kernel's share is that of our
    PyTorch kernel, more than flash-linear-attention's (which recomputes its chunk products).

    ``act_bytes`` wide: the norm's input and output (2·H); in_proj's output
    (2·qk + 2·v + 2·nv); the convolution's output and its activation (2·(2·qk + v)); q and k
    normalised and repeated to nv heads (2·nv·dk); the output norm's input and output and the
    gated product (3·v). fp32, the kernel with chunks of C = 64: the decay and β (2·nv); q, k,
    k·β, the key solve, the decayed q and k (6·nv·dk); v, the value solve, the chunk's delta and
    output (4·nv·dv); the system, the pair decays and the scores (3·C·nv); the state carried
    between chunks (nv·dk·dv / C)."""
    c = config_or_args
    nv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    qk, v = dk * c.linear_num_key_heads, dv * nv
    projected = 2 * qk + 2 * v + 2 * nv
    saved = act_bytes * (2 * c.hidden_size + projected + 2 * (2 * qk + v) + 2 * nv * dk + 3 * v)
    chunk = DEFAULT_CHUNK_SIZE
    kernel = 4 * (2 * nv + 6 * nv * dk + 4 * nv * dv + 3 * chunk * nv) + 4 * nv * dk * dv // chunk
    return saved + kernel


def gdn_grad_bytes_per_token(config_or_args, act_bytes: int) -> int:
    """Bytes per token a gated DeltaNet token mixer's backward holds at once besides what it
    saved: the gradients of what it saved, at the same widths (:func:`gdn_saved_bytes_per_token`
    less its input norm's input, which the hidden gradient counts)."""
    return gdn_saved_bytes_per_token(config_or_args, act_bytes) - act_bytes * \
        config_or_args.hidden_size


def gdn_carry_bytes(config_or_args, act_bytes: int) -> int:
    """Bytes of the state one sequence hands from chunk to chunk under chunked recompute: the
    recurrent state nv·dk·dv fp32 and the convolution's last taps − 1 inputs (2·qk + v wide)."""
    c = config_or_args
    nv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv = 2 * dk * c.linear_num_key_heads + dv * nv
    return 4 * nv * dk * dv + act_bytes * conv * (c.linear_conv_kernel_dim - 1)


def check_gated_delta_net_flags(args) -> None:
    """Refuse, from the parsed flags, what gated DeltaNet models cannot run here (the local
    implementation; with Transformer Engine's ``--transformer-impl transformer_engine`` upstream's
    layers run and upstream checks them): a missing or mis-sized ``--linear-attention-freq``,
    tensor or context parallelism, multi-token prediction and ``--recompute-modules
    gdn_norm_out`` (chunked recompute refuses packed documents with these layers itself)."""
    from megatron.bounded.settings import BoundedArgumentError

    if (getattr(args, "experimental_attention_variant", None) != VARIANT
            or getattr(args, "transformer_impl", "local") == "transformer_engine"):
        return  # (dsa: megatron.bounded.model.dsa checks its flags)
    freq = getattr(args, "linear_attention_freq", None)
    if freq is None:
        raise BoundedArgumentError(
            "--experimental-attention-variant gated_delta_net needs --linear-attention-freq: "
            "give N (every N-th layer full attention, the others gated DeltaNet; Qwen3-Next: 4) "
            "or a pattern such as '([1]*3+[0]*1)*12' (1: gated DeltaNet).")
    if isinstance(freq, list) and len(freq) != args.num_layers:
        raise BoundedArgumentError(
            f"--linear-attention-freq gives {len(freq)} layers, --num-layers {args.num_layers}: "
            "give one entry per layer (1: gated DeltaNet, 0: full attention).")
    refused = (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size", "use 1 (split the model "
         "with --pipeline-model-parallel-size or --expert-model-parallel-size)"),
        ("context_parallel_size", "--context-parallel-size", "use 1 (the gated DeltaNet layers "
         "carry their state along the whole sequence)"),
        ("mtp_num_layers", "--mtp-num-layers", "remove it (megatron-core 0.19.2 builds no "
         "multi-token-prediction layer for these models either)"),
    )
    for field, flag, fix in refused:
        value = getattr(args, field, None) or 0
        if value > 1 if field.endswith("_size") else value:
            raise BoundedArgumentError(
                f"{flag} {value} with --experimental-attention-variant gated_delta_net does not "
                f"run without Transformer Engine: {fix}.")
    if "gdn_norm_out" in (getattr(args, "recompute_modules", None) or []):
        raise BoundedArgumentError(
            "--recompute-modules gdn_norm_out would recompute nothing here: the gated DeltaNet "
            "layers of the local implementation keep their output norm; remove it.")
