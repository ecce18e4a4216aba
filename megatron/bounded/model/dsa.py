"""DeepSeek sparse attention (``--experimental-attention-variant dsa``) on the local
implementation, with our multi-latent attention.

megatron-core 0.19.2 builds DSA only through Transformer Engine's spec provider. Here the layer is
our MLA layer (:class:`megatron.bounded.model.mla.BoundedMLASelfAttention`, upstream's
``MLASelfAttention``, which hands the core attention the hidden states ``x`` and the normalized
query latent ``qr`` when the core attention asks for them) whose core attention is
:class:`SparseMLACoreAttention`:

* the indexer is upstream's ``DSAIndexer`` (its projections ``linear_wq_b``, ``linear_wk``,
  ``linear_weights_proj``, its key LayerNorm ``k_norm``, its rotary embedding and scaling, the
  parameter names of upstream's checkpoints) with local, replicated linears
  (:class:`DuplicatedLinear`) and the Hadamard rotation in PyTorch
  (:func:`megatron.bounded.attention.sparse_indexer.hadamard_rotate`);
* the top-k is :func:`megatron.bounded.attention.sparse_indexer.blockwise_topk` (causal, within
  packed documents; nothing s × s);
* attention over the selected keys is :func:`megatron.bounded.attention.sparse_attention.sparse_attention`
  on the heads' expanded keys and values, or, under chunked recompute
  (:func:`megatron.bounded.attention.sparse_mla_latent.attends_in_latent_form`),
  :func:`megatron.bounded.attention.sparse_mla_latent.sparse_mla_latent_attention` on the shared
  latent: the MLA layer then hands over the latent and the key's rotary part as ``key``, no
  ``value``, and the kv up-projection's weight (``kv_up_weight``), and no tensor holds every
  token's expanded keys or values;
* in training with ``--dsa-indexer-loss-coeff`` above 0 the indexer's KL loss
  (``--dsa-indexer-use-sparse-loss``, :func:`megatron.bounded.attention.sparse_attention.sparse_indexer_loss`)
  is attached to the output with upstream's ``DSAIndexerLossAutoScaler`` (its gradient scaled as
  the main loss's) and logged through upstream's ``DSAIndexerLossLoggingHelper``. As upstream,
  the indexer sees ``x`` and ``qr`` detached: only the loss trains it; without the loss it gets
  no gradient.

:func:`check_dsa_flags` refuses, at argument time, what this path does not run.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
    DSAIndexerSubmodules,
    DSAttentionSubmodules,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron.bounded.attention.documents import DocumentParams
from megatron.bounded.attention.sparse_attention import (
    indexer_kl_loss,
    sparse_attention,
    sparse_indexer_loss,
)
from megatron.bounded.attention.sparse_indexer import (
    blockwise_topk,
    document_starts,
    hadamard_rotate,
)
from megatron.bounded.attention.sparse_mla_latent import (
    attends_in_latent_form,
    latent_attention_target_sums,
    sparse_mla_latent_attention,
    split_kv_up_weight,
)
from megatron.bounded.settings import BoundedArgumentError, flag_name
from megatron.bounded.object_changes import object_change

__all__ = ["BoundedDSAIndexer", "DuplicatedLinear", "SparseMLACoreAttention", "check_dsa_flags",
           "dsa_core_attention_spec", "dsa_kernel_note", "uses_dsa"]


def uses_dsa(config) -> bool:
    """Whether ``config`` (args or a config) asks for DeepSeek sparse attention."""
    return getattr(config, "experimental_attention_variant", None) == "dsa"


class DuplicatedLinear(torch.nn.Module):
    """``y = x Wᵀ`` with W replicated on every tensor-parallel rank (Transformer Engine's
    ``Linear`` with ``parallel_mode="duplicated"``, the indexer's projections): the parameter
    ``weight`` [out, in]; returns (y, None) as Megatron's linears do."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: Optional[str] = "duplicated", **kwargs):
        super().__init__()
        if bias or skip_weight_param_allocation or parallel_mode != "duplicated":
            raise ValueError("DuplicatedLinear is a replicated linear without bias")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device,
                                                     dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None


class BoundedDSAIndexer(DSAIndexer):
    """Upstream's indexer with the Hadamard rotation of q and k in PyTorch (upstream's needs the
    ``fast_hadamard_transform`` package and bf16)."""

    def __init__(self, config, submodules, pg_collection=None):
        super().__init__(config, submodules, pg_collection)
        self.rotate = bool(config.dsa_indexer_rotate_activation)
        # upstream's forward reads the flag from its config: rotate here instead
        self.config = object_change("dsa-indexer-rotation-in-torch").copy_with(
            config, dsa_indexer_rotate_activation=False)

    def forward_before_topk(self, x, qr, packed_seq_params=None):
        q, k, weights = super().forward_before_topk(x, qr, packed_seq_params)
        if self.rotate:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        return q, k, weights


class SparseMLACoreAttention(MegatronModule):
    """Core attention of a DSA layer: the indexer's top-k keys per query, attention over them,
    the indexer loss in training. [s, b, heads · d_v] out. Expanded form: multi-latent
    attention's [s, b, heads, d] query, key and value. Latent form (``latent_form``, given
    ``kv_up_weight``): the query [s, b, heads, d_nope + rope], ``key`` the normalized kv latent
    and the key's rotary part [s, b, kv_lora + rope], no value."""

    requires_dsa_inputs = True  # upstream's MLA then passes x and qr

    def __init__(self, config, submodules: DSAttentionSubmodules, layer_number: int,
                 attn_mask_type, attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        check_dsa_flags(config)
        self.layer_number = layer_number
        self.topk = config.dsa_indexer_topk
        self.relu = config.dsa_indexer_scoring_relu
        self.indexer = build_module(submodules.indexer, config=config,
                                    pg_collection=pg_collection)
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(head_dim)
        self.latent_form = attends_in_latent_form(config)

    def forward(self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, kv_up_weight=None, **kwargs):
        if attention_bias is not None:
            raise ValueError("DeepSeek sparse attention takes no attention bias")
        if packed_seq_params is not None and not isinstance(packed_seq_params, DocumentParams):
            raise ValueError("DeepSeek sparse attention takes packed sequences only as "
                             "DocumentParams (the sbhd layout with document boundaries)")
        seq, batch = query.shape[:2]
        coeff = self.config.dsa_indexer_loss_coeff or 0.0
        with_loss = self.training and torch.is_grad_enabled() and coeff > 0
        # as upstream: the indexer learns from its loss only, not from the model's
        x, qr = x.detach(), qr.detach()
        with torch.enable_grad() if with_loss else torch.no_grad():
            q, k, weights = self.indexer.forward_before_topk(x, qr)
        starts = None if packed_seq_params is None else document_starts(
            packed_seq_params, batch, seq, query.device)
        indices = blockwise_topk(q.detach(), weights.detach(), k.detach(), self.topk, starts,
                                 self.relu)
        if kv_up_weight is None:
            output = sparse_attention(query, key, value, indices, self.softmax_scale)
        else:
            latent_inputs = self._latent_inputs(query, key, kv_up_weight)
            output = sparse_mla_latent_attention(*latent_inputs, indices, self.softmax_scale)
        output = output.reshape(seq, batch, -1)
        if with_loss:
            if kv_up_weight is None:
                loss = sparse_indexer_loss(q, weights, k, query, key, indices,
                                           self.softmax_scale, coeff, self.relu)
            else:
                q_nope, q_rope, latent, krope, w_uk, _ = (t.detach() for t in latent_inputs)
                target_sums = latent_attention_target_sums(q_nope, q_rope, latent, krope, w_uk,
                                                           indices, self.softmax_scale)
                loss = indexer_kl_loss(q, weights, k, indices, target_sums, coeff, self.relu)
            DSAIndexerLossLoggingHelper.save_loss_to_tracker(
                loss=loss, layer_number=self.layer_number, num_layers=self.config.num_layers)
            output = DSAIndexerLossAutoScaler.apply(output, loss)
        return output

    def _latent_inputs(self, query, key, kv_up_weight):
        """(q_nope, q_rope, latent, key's rotary part, W_UK, W_UV) of the latent form."""
        config, heads = self.config, query.shape[2]
        rope = config.qk_pos_emb_head_dim
        q_nope, q_rope = torch.split(query, [config.qk_head_dim, rope], dim=-1)
        latent, krope = torch.split(key, [config.kv_lora_rank, rope], dim=-1)
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, heads, config.qk_head_dim,
                                        config.v_head_dim)
        return q_nope, q_rope, latent, krope, w_uk, w_uv


def dsa_core_attention_spec() -> ModuleSpec:
    """The core-attention spec of a DSA layer on the local implementation."""
    return ModuleSpec(
        module=SparseMLACoreAttention,
        submodules=DSAttentionSubmodules(indexer=ModuleSpec(
            module=BoundedDSAIndexer,
            submodules=DSAIndexerSubmodules(
                linear_wq_b=DuplicatedLinear,
                linear_wk=DuplicatedLinear,
                k_norm=LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True),
                linear_weights_proj=DuplicatedLinear,
            ),
        )),
    )


def dsa_kernel_note(args) -> Optional[str]:
    """The start-up note for ``--dsa-kernel-backend tilelang``/``cudnn`` (fused kernels this
    installation does not run), after setting it to ``none``; None when nothing is replaced."""
    backend = getattr(args, "dsa_kernel_backend", "none")
    if not uses_dsa(args) or backend in (None, "none"):
        return None
    args.dsa_kernel_backend = "none"
    return (f"--dsa-kernel-backend {backend} -> none: this implementation's indexer top-k and "
            "sparse attention, Triton kernels on CUDA (the same selected keys and values)")


def check_dsa_flags(config) -> None:
    """Refuse DeepSeek sparse attention settings this implementation does not run (on parsed
    flags or a config; the messages name the flags)."""
    if not uses_dsa(config):
        return
    problems = []
    if not getattr(config, "multi_latent_attention", False):
        problems.append(f"no {flag_name('multi_latent_attention')} (DSA attends with multi-latent "
                        f"attention's queries and keys: add {flag_name('multi_latent_attention')})")
    for field in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
        value = getattr(config, field, None)
        if value is None or value < 1:
            problems.append(f"{flag_name(field)} {value} (give a value >= 1; DeepSeek-V3.2: "
                            "--dsa-indexer-n-heads 64 --dsa-indexer-head-dim 128 "
                            "--dsa-indexer-topk 2048)")
    head_dim = getattr(config, "dsa_indexer_head_dim", None) or 0
    rotary = getattr(config, "qk_pos_emb_head_dim", 0)
    if head_dim and head_dim < rotary:
        problems.append(f"{flag_name('dsa_indexer_head_dim')} {head_dim} below "
                        f"{flag_name('qk_pos_emb_head_dim')} {rotary} (the indexer rotates its "
                        "first qk-pos-emb-head-dim channels)")
    if head_dim and getattr(config, "dsa_indexer_rotate_activation", True) and (
            head_dim & (head_dim - 1)):
        problems.append(f"{flag_name('dsa_indexer_head_dim')} {head_dim} with the Hadamard rotation "
                        "(a power-of-two width: e.g. 128, or pass "
                        "--no-dsa-indexer-rotate-activation)")
    if getattr(config, "dsa_indexer_topk_freq", 1) not in (None, 1):
        problems.append(f"{flag_name('dsa_indexer_topk_freq')} {config.dsa_indexer_topk_freq} "
                        "(top-k shared across layers is not implemented here: every layer "
                        f"runs its own indexer; remove {flag_name('dsa_indexer_topk_freq')})")
    if (getattr(config, "dsa_indexer_loss_coeff", None) or 0) > 0 and not getattr(
            config, "dsa_indexer_use_sparse_loss", False):
        problems.append(f"{flag_name('dsa_indexer_loss_coeff')} {config.dsa_indexer_loss_coeff} "
                        f"without {flag_name('dsa_indexer_use_sparse_loss')} (the dense loss over "
                        "every causal key is s × s; add "
                        f"{flag_name('dsa_indexer_use_sparse_loss')} for the KL over the selected "
                        f"keys, or {flag_name('dsa_indexer_loss_coeff')} 0)")
    backend = getattr(config, "dsa_kernel_backend", "none")
    if backend not in (None, "none"):
        problems.append(f"{flag_name('dsa_kernel_backend')} {backend} (megatron-core's fused "
                        "kernels; the local implementation runs its own: pass "
                        f"{flag_name('dsa_kernel_backend')} none)")
    if getattr(config, "context_parallel_size", 1) > 1:
        problems.append(f"{flag_name('context_parallel_size')} {config.context_parallel_size} "
                        "(DSA runs on whole sequences: context parallelism 1)")
    if getattr(config, "tensor_model_parallel_size", 1) > 1:
        problems.append(f"{flag_name('tensor_model_parallel_size')} "
                        f"{config.tensor_model_parallel_size} (DSA runs with tensor "
                        "parallelism 1 here; use expert and data parallelism)")
    if getattr(config, "qk_layernorm", False) and getattr(config, "q_lora_rank", None) is None:
        problems.append(f"{flag_name('qk_layernorm')} without {flag_name('q_lora_rank')} (DSA's indexer "
                        "reads the normalized query latent: give --q-lora-rank, as DeepSeek-V3.2 "
                        "does)")
    if problems:
        raise BoundedArgumentError(
            f"{flag_name('experimental_attention_variant')} dsa (DeepSeek sparse attention, local "
            "implementation) cannot run with: " + "; ".join(problems) + ".")
