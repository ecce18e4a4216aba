"""Grouped MoE experts on ``torch._grouped_mm`` with a static row count.

The experts take the dispatcher's expert-grouped rows ``[R, H]`` where only the first
``tokens_per_expert.sum()`` rows are valid (the rest is padding of a static-capacity buffer),
``tokens_per_expert`` as an int64 *device* tensor, and one routing probability per row.  They
compute, for every valid row of local expert e::

    out = (act(x @ W1[e]) * prob) @ W2[e]

with ``act`` either a gated unit (``act(gate) * (linear + glu_linear_offset)``, gate = first
half of the fc1 output, as upstream's MLP) or a plain activation.  The probability multiplies
the activation output before fc2 in the activation's dtype, exactly as upstream's experts do
when ``moe_apply_probs_on_input`` is False; with it True the input rows are scaled instead.

Padding rows are unspecified: the output and the gradients of the input rows and of the
probabilities hold whatever the kernels leave there (``torch._grouped_mm`` does not write rows at
or beyond the last offset; they may be NaN or Inf), and the caller must not read them (the
static-capacity dispatcher never does).  In return nothing here reads padding rows into a valid
row or a weight gradient: every GEMM and every activation is row-wise and the weight-gradient
GEMMs stop at ``tokens_per_expert.sum()``.  So garbage in the padding rows of the input rows, the
probabilities, the output gradient or a restored stash page reaches no consumed result, and no
full-size mask is spent on them.  Nothing here synchronizes with the host: offsets are computed
on the device.

The activation: plain SwiGLU on CUDA runs as one fused Triton kernel per direction over the
valid rows only (``megatron.bounded.moe.kernels.weighted_swiglu``); every other activation, and CPU
tensors, run the eager chain above (the backward recomputes it under autograd). Either way only
the input rows and the fc1 output are kept for backward and the activation is computed again
there: what upstream's selective recompute ``--recompute-modules moe_act`` asks of its experts,
done whether it is asked or not.

Weights are stored grouped: ``weight1`` ``[El, H, F]`` (``[El, H, 2F]`` for gated units) and
``weight2`` ``[El, F, H]``; ``load_from_sequential_mlp`` copies upstream ``SequentialMLP``
weights in (``weight1[e] = local_experts[e].linear_fc1.weight.T``). Checkpoints use upstream's
``SequentialMLP`` keys and sharding (``GroupedExperts.sharded_state_dict``), so a run can save
with these experts and resume with upstream's, or the other way round.

Paged stash: when ``config.moe_paged_stash`` is true at forward time (upstream's
``PagedStashRunner`` flips it) and the rows are on CUDA, the forward is bracketed with
upstream's ``paged_stash_group_start`` / ``get_paged_stash_context`` /
``paged_stash_group_commit``, and the two large saved activations (the input rows and the fc1
output) are marked with ``grouped_tensor_scale_inv = False`` so upstream's manager pages them.
Their padding rows, which the manager does not restore, reach no result of the backward.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import utils as mcore_utils
from megatron.core.transformer.module import MegatronModule

from megatron.bounded.moe.kernels.weighted_swiglu import weighted_swiglu_backward, weighted_swiglu_forward
from megatron.bounded.moe.wgrad_handoff import ExpertWeightGradOverlap, WeightGradHandoff
from megatron.bounded.moe.kernels.zero_if_flag import zero_empty_groups, zero_if_flag
from megatron.bounded.kernels.triton_support import HAVE_TRITON

logger = logging.getLogger(__name__)

__all__ = [
    "grouped_mm",
    "grouped_mm_wgrad",
    "grouped_mlp",
    "grouped_mlp_grads",
    "GroupedExperts",
]


# --------------------------------------------------------------------------------------------
# Grouped GEMM with a device-side fallback
# --------------------------------------------------------------------------------------------

_GROUPED_MM_SUPPORT: Dict[Tuple[str, torch.dtype], bool] = {}


def _grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs for this device type and dtype (probed once)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.zeros(16, 16, dtype=dtype, device=device)
                b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
                offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
                torch._grouped_mm(a, b, offs=offs)
                torch._grouped_mm(a.t(), a, offs=offs)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM_SUPPORT[key] = ok
    return _GROUPED_MM_SUPPORT[key]


def _aligned(*tensors: torch.Tensor) -> bool:
    # _grouped_mm needs 16-byte aligned strides on its feature dimensions.
    for t in tensors:
        if (t.shape[-1] * t.element_size()) % 16 != 0:
            return False
    return True


def _row_expert(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Local expert of every row (== number of experts for padding rows), on the device."""
    rows = torch.arange(num_rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of expert e (``offs[e-1] <= row < offs[e]``) times ``b[e]``; ``[M, K] x [E, K, N]``.

    Rows at or beyond ``offs[-1]`` are unspecified (the kernel does not write them).
    """
    if _grouped_mm_supported(a.device, a.dtype) and _aligned(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    # Fallback: one dense GEMM per expert over all rows, masked by the row's expert.
    row_expert = _row_expert(offs, a.shape[0]).unsqueeze(-1)
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    for e in range(b.shape[0]):
        out = torch.where(row_expert == e, a @ b[e], out)
    return out


def grouped_mm_wgrad(a: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert ``a_e^T @ g_e`` -> ``[E, K, N]``; rows at or beyond ``offs[-1]`` of ``a`` and
    ``g`` are ignored, whatever they hold (NaN and Inf included)."""
    num_experts = offs.shape[0]
    if _grouped_mm_supported(a.device, a.dtype) and _aligned(a, g):
        # The kernel takes expert e's rows from [offs[e-1], offs[e]) only.
        out = torch._grouped_mm(a.t(), g, offs=offs)
    else:
        row_expert = _row_expert(offs, a.shape[0]).unsqueeze(-1)
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        # Zeroing a's rows of other experts is not enough: 0 * NaN in g's padding rows is NaN.
        g = torch.where(row_expert < num_experts, g, zero)
        out = torch.stack(
            [torch.where(row_expert == e, a, zero).t() @ g for e in range(num_experts)]
        )
    # Experts with no rows get an exact zero whatever the kernel leaves there (on CUDA in place,
    # writing only the empty experts' slices).
    return zero_empty_groups(offs, out)


# --------------------------------------------------------------------------------------------
# The grouped MLP as one autograd function
# --------------------------------------------------------------------------------------------


def _scaled_activation(fc1: torch.Tensor, probs: torch.Tensor, activation: Callable) -> torch.Tensor:
    act = activation(fc1)
    return (act * probs.unsqueeze(-1)).to(act.dtype)


def _scaled_activation_backward(
    fc1, probs, grad_scaled, activation: Callable, probs_grad: bool
):
    """(d fc1, the recomputed scaled activation, d probs or None), eagerly through autograd."""
    with torch.enable_grad():
        fc1_leaf = fc1.detach().requires_grad_(True)
        probs_leaf = probs.detach().requires_grad_(probs_grad)
        scaled = _scaled_activation(fc1_leaf, probs_leaf, activation)
    inputs = (fc1_leaf, probs_leaf) if probs_grad else (fc1_leaf,)
    grads = torch.autograd.grad(scaled, inputs, grad_scaled)
    return grads[0], scaled.detach(), grads[1] if probs_grad else None


def _zero_if_stash_overflowed(*restored: torch.Tensor):
    """After a paged-stash overflow the restored activations were never written (upstream's pop
    kernel skips them) and may hold NaN/Inf, which upstream's NaN checks would trip on before the
    runner discards the step and reruns it. Zero them instead, on the device (no sync; on CUDA
    nothing is read or written while the flag is clear)."""
    from megatron.core.transformer.moe.paged_stash import PagedStashManager

    overflow = PagedStashManager.get_instance().overflow
    if overflow is None:
        return restored
    return zero_if_flag(overflow, *restored)


def _runs_fused(activation: Callable, fc1: torch.Tensor) -> bool:
    """Whether ``activation`` on ``fc1`` takes the fused Triton kernels (``weighted_swiglu``):
    only a config's ``_Activation`` that is plain SwiGLU, on CUDA; any other callable (the
    functional API takes any) runs eagerly."""
    plain_swiglu = (
        isinstance(activation, _Activation) and activation.gated and activation.func is F.silu
        and not activation.offset and activation.clamp is None
    )
    return plain_swiglu and fc1.is_cuda and HAVE_TRITON


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a no-op .to() still costs a dispatch; in an eager step every operation's host time counts
    return t if t.dtype == dtype else t.to(dtype)


def _grouped_mm_operands(x, weight1, weight2, tokens_per_expert):
    """Expert end offsets (int32, on the device) and the weights in the rows' dtype."""
    offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    return offs, _in_dtype(weight1, x.dtype), _in_dtype(weight2, x.dtype)


def _grouped_mlp_backward(x, fc1, probs, w1, w2, offs, grad_out, activation, fused: bool,
                          need_x: bool, need_probs: bool, need_weights: bool = True,
                          wgrad_handoff: Optional[WeightGradHandoff] = None, w1_dtype=None):
    """(d x, d probs, d w1, d w2) of the grouped MLP from its fc1 output (None where not needed).

    Padding rows of grad_out, x and fc1 (e.g. unrestored stash pages) are left unmasked: the
    GEMMs and the activation below are row-wise and the wgrads stop at offs[-1].

    With ``wgrad_handoff`` the d w1 GEMM is left in it (returned d w1 is None; the handoff gives
    it in ``w1_dtype``) after d x is computed, so the exchange of d x can run alongside it.
    """
    # _grouped_mm needs a real row stride, which an expanded gradient lacks.
    grad_out = grad_out.contiguous()
    grad_scaled = grouped_mm(grad_out, w2.transpose(1, 2), offs)
    if fused:
        grad_fc1, scaled, grad_probs = weighted_swiglu_backward(
            fc1, probs.contiguous(), offs, grad_scaled.contiguous(), need_probs
        )
    else:
        grad_fc1, scaled, grad_probs = _scaled_activation_backward(
            fc1, probs, grad_scaled, activation, need_probs
        )
    grad_w1 = grad_w2 = None
    if need_weights:
        grad_w2 = grouped_mm_wgrad(scaled, grad_out, offs)
        if wgrad_handoff is None:
            grad_w1 = grouped_mm_wgrad(x, grad_fc1, offs)
    grad_x = grouped_mm(grad_fc1, w1.transpose(1, 2), offs) if need_x else None
    if need_weights and wgrad_handoff is not None:
        wgrad_handoff.defer(lambda: (_in_dtype(grouped_mm_wgrad(x, grad_fc1, offs), w1_dtype),))
    return grad_x, grad_probs, grad_w1, grad_w2


class _GroupedMLPFunction(torch.autograd.Function):
    """fc1 -> activation * prob -> fc2 over expert-grouped rows; saves only x and fc1."""

    @staticmethod
    def forward(ctx, x, probs, weight1, weight2, tokens_per_expert, activation, mark_for_stash,
                wgrad_handoff):
        offs, w1, w2 = _grouped_mm_operands(x, weight1, weight2, tokens_per_expert)
        # Padding rows of fc1 and of the output stay as the kernel leaves them (see the module
        # docstring: nothing reads them into a result).
        fc1 = grouped_mm(x, w1, offs)
        fused = _runs_fused(activation, fc1)
        if fused:
            scaled = weighted_swiglu_forward(fc1, probs.contiguous(), offs)
        else:
            scaled = _scaled_activation(fc1, probs, activation)
        out = grouped_mm(scaled, w2, offs)
        if mark_for_stash:
            # Upstream's paged-stash manager pages saved tensors that carry this attribute
            # (False = ordinary row-major activation whose first dim is the static row count).
            x.grouped_tensor_scale_inv = False
            fc1.grouped_tensor_scale_inv = False
        ctx.save_for_backward(x, fc1, probs, w1, w2, offs)
        ctx.stashed = mark_for_stash
        ctx.activation = activation
        ctx.fused = fused
        ctx.weight_dtypes = (weight1.dtype, weight2.dtype)
        ctx.wgrad_handoff = wgrad_handoff
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, fc1, probs, w1, w2, offs = ctx.saved_tensors
        if ctx.stashed:
            x, fc1 = _zero_if_stash_overflowed(x, fc1)
        handoff, ctx.wgrad_handoff = ctx.wgrad_handoff, None
        grad_x, grad_probs, grad_w1, grad_w2 = _grouped_mlp_backward(
            x, fc1, probs, w1, w2, offs, grad_out, ctx.activation, ctx.fused,
            ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            wgrad_handoff=handoff, w1_dtype=ctx.weight_dtypes[0],
        )
        return (
            grad_x,
            grad_probs,
            None if grad_w1 is None else _in_dtype(grad_w1, ctx.weight_dtypes[0]),
            _in_dtype(grad_w2, ctx.weight_dtypes[1]),
            None,
            None,
            None,
            None,
        )


def grouped_mlp_grads(x, tokens_per_expert, probs, weight1, weight2, activation, grad_out,
                      need_x: bool = True, need_probs: bool = True, need_weights: bool = True):
    """(d x, d probs, d weight1, d weight2) of ``grouped_mlp`` for the output gradient
    ``grad_out``, recomputing only fc1: the same values as autograd through a recomputed
    ``grouped_mlp`` (bitwise), without its fc2 GEMM, whose output a recompute never uses."""
    offs, w1, w2 = _grouped_mm_operands(
        x, weight1, weight2, _in_dtype(tokens_per_expert, torch.int64)
    )
    fc1 = grouped_mm(x, w1, offs)
    grad_x, grad_probs, grad_w1, grad_w2 = _grouped_mlp_backward(
        x, fc1, probs, w1, w2, offs, grad_out, activation, _runs_fused(activation, fc1),
        need_x, need_probs, need_weights,
    )
    if need_weights:
        grad_w1, grad_w2 = _in_dtype(grad_w1, weight1.dtype), _in_dtype(grad_w2, weight2.dtype)
    return grad_x, grad_probs, grad_w1, grad_w2


def grouped_mlp(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    probs: torch.Tensor,
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    mark_for_stash: bool = False,
    wgrad_handoff: Optional[WeightGradHandoff] = None,
) -> torch.Tensor:
    """Functional grouped MLP: ``[R, H]`` rows -> ``[R, H]`` (padding rows unspecified).

    ``wgrad_handoff``: leave ``weight1``'s gradient GEMM to it (``wgrad_handoff`` module); the
    handoff must be for ``(weight1,)``.
    """
    if wgrad_handoff is not None and (
        len(wgrad_handoff.params) != 1 or wgrad_handoff.params[0] is not weight1
    ):
        raise ValueError("the weight-gradient handoff must be for (weight1,)")
    if tokens_per_expert.shape[0] != weight1.shape[0]:
        raise ValueError(
            f"tokens_per_expert has {tokens_per_expert.shape[0]} entries, "
            f"weights have {weight1.shape[0]} experts"
        )
    return _GroupedMLPFunction.apply(
        x, probs, weight1, weight2, _in_dtype(tokens_per_expert, torch.int64), activation,
        mark_for_stash, wgrad_handoff,
    )


# --------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------


class _Activation:
    """The expert activation of a config, evaluated on an fc1 output (picklable callable)."""

    def __init__(self, config):
        self.gated = bool(config.gated_linear_unit)
        self.func = config.activation_func
        self.offset = getattr(config, "glu_linear_offset", 0.0) or 0.0
        self.clamp = getattr(config, "activation_func_clamp_value", None)

    def __call__(self, fc1: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.func(fc1)
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        if self.clamp is not None:
            gate = gate.clamp(min=None, max=self.clamp)
            linear = linear.clamp(min=-self.clamp, max=self.clamp)
        if self.offset:
            linear = linear + self.offset
        return self.func(gate) * linear


class GroupedExperts(MegatronModule):
    """Local experts as two grouped weights, computed with ``torch._grouped_mm``.

    Builder signature as upstream's experts: ``(num_local_experts, config, *, pg_collection,
    name)``; forward ``(rows, tokens_per_expert, probs) -> (output, None)``.
    """

    def __init__(self, num_local_experts: int, config, *, pg_collection=None, name=None, **_):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        if getattr(config, "add_bias_linear", False):
            raise ValueError("GroupedExperts has no bias support; set add_bias_linear=False")
        self.ep_group = pg_collection.ep
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        expt_tp = getattr(pg_collection, "expt_tp", None)
        if mcore_utils.get_pg_size(expt_tp) != 1:
            raise ValueError("GroupedExperts supports expert tensor parallel size 1 only")
        if getattr(config, "moe_latent_size", None):
            raise ValueError("GroupedExperts does not support moe_latent_size")
        self.num_local_experts = num_local_experts
        self.name = name
        hidden = config.hidden_size
        ffn = config.moe_ffn_hidden_size
        if ffn is None:
            ffn = config.ffn_hidden_size
        self.hidden_size = hidden
        self.ffn_hidden_size = ffn
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.activation = _Activation(config)

        if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = config.params_dtype
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, fc1_out, dtype=dtype, device=device)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, ffn, hidden, dtype=dtype, device=device)
        )
        if getattr(config, "perform_initialization", True):
            self._initialize(config)
        expert_parallel = (
            getattr(config, "expert_model_parallel_size", 1) > 1
            or mcore_utils.get_pg_size(self.ep_group) > 1
        )
        for param in (self.weight1, self.weight2):
            # allreduce=False: gradients are reduced over the expert data-parallel group.
            setattr(param, "allreduce", not expert_parallel)
        # Set by BoundedMoELayer with the static dispatcher (wgrad_handoff).
        self.wgrad_overlap: Optional[ExpertWeightGradOverlap] = None

    @torch.no_grad()
    def _initialize(self, config) -> None:
        rng = nullcontext()
        if self.weight1.is_cuda:
            try:
                from megatron.core.tensor_parallel.random import (
                    get_cuda_rng_tracker,
                    get_expert_parallel_rng_tracker_name,
                )

                tracker = get_cuda_rng_tracker()
                name = get_expert_parallel_rng_tracker_name()
                if name in tracker.get_states():
                    rng = tracker.fork(name)
            except (ImportError, AttributeError, KeyError):
                rng = nullcontext()
        with rng:
            for e in range(self.num_local_experts):
                # Initialize in the [out, in] layout of a linear layer, then store transposed.
                w1 = torch.empty_like(self.weight1[e].t())
                config.init_method(w1)
                self.weight1[e].copy_(w1.t())
                w2 = torch.empty_like(self.weight2[e].t())
                config.output_layer_init_method(w2)
                self.weight2[e].copy_(w2.t())

    @torch.no_grad()
    def load_from_sequential_mlp(self, sequential_mlp) -> None:
        """Copy the weights of an upstream ``SequentialMLP`` with the same shapes."""
        if len(sequential_mlp.local_experts) != self.num_local_experts:
            raise ValueError("different number of local experts")
        for e, expert in enumerate(sequential_mlp.local_experts):
            if getattr(expert.linear_fc1, "bias", None) is not None:
                raise ValueError("SequentialMLP with biases cannot be loaded")
            self.weight1[e].copy_(expert.linear_fc1.weight.t())
            self.weight2[e].copy_(expert.linear_fc2.weight.t())

    def _stash_enabled(self, x: torch.Tensor) -> bool:
        return bool(getattr(self.config, "moe_paged_stash", False)) and x.is_cuda

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """Expert outputs for expert-grouped rows; returns ``(output, None)``."""
        x = permuted_local_hidden_states
        probs = permuted_probs
        if getattr(self.config, "moe_apply_probs_on_input", False):
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        tokens_per_expert = torch.as_tensor(tokens_per_expert, device=x.device)
        handoff = self.wgrad_overlap.take() if self.wgrad_overlap is not None else None

        stash = self._stash_enabled(x)
        if stash:
            from megatron.core.transformer.moe.paged_stash import (
                get_paged_stash_context,
                paged_stash_group_commit,
                paged_stash_group_start,
            )

            x = paged_stash_group_start(x)
            max_num_tokens = x.shape[0]
            factor = getattr(self.config, "moe_expert_rank_capacity_factor", None)
            avg_num_tokens = int(max_num_tokens // factor) if factor else None
            context = get_paged_stash_context(
                name="grouped_mlp",
                max_num_tokens=max_num_tokens,
                num_tokens_tensor=tokens_per_expert.sum(),
                avg_num_tokens=avg_num_tokens,
            )
        else:
            context = nullcontext()
        with context:
            output = grouped_mlp(
                x,
                tokens_per_expert,
                probs,
                self.weight1,
                self.weight2,
                self.activation,
                mark_for_stash=stash,
                wgrad_handoff=handoff,
            )
        if stash:
            output = paged_stash_group_commit(output, name="grouped_mlp")
        return output, None

    def backward_dw(self):
        """Weight gradients are computed in the main backward (no delayed wgrad)."""
        return None

    # Checkpoint layout: the keys and sharding of upstream's ``SequentialMLP`` (and of
    # ``TEGroupedMLP``, which writes the same), so a checkpoint saved with these experts resumes
    # with upstream's and the other way round. Per global expert g of E, stacked on one axis after
    # the caller's offsets: ``{prefix}experts.linear_fc1.weight`` [E, fc1_out, H] (a gated unit's
    # gate rows first, then its linear rows, saved as two chunks of that axis as upstream does),
    # ``{prefix}experts.linear_fc2.weight`` [E, H, F], and an empty ``_extra_state`` object per
    # expert and linear. Our grouped weights are the transposes: weight1[e] = fc1[g].T.
    CHECKPOINT_FC1 = "experts.linear_fc1"
    CHECKPOINT_FC2 = "experts.linear_fc2"

    def get_extra_state(self):
        """Upstream's linears checkpoint an (empty) extra state per expert; so do we."""
        return None

    def set_extra_state(self, state) -> None:
        """Nothing to restore (upstream's local linears keep none either)."""

    def _global_experts(self) -> Tuple[int, int]:
        """(index of this rank's first expert among all experts, number of experts in all)."""
        ep_size = mcore_utils.get_pg_size(self.ep_group)
        ep_rank = mcore_utils.get_pg_rank(self.ep_group)
        return ep_rank * self.num_local_experts, ep_size * self.num_local_experts

    def _expert_shards(self, key: str, grouped: torch.Tensor, sharded_offsets, replica_id,
                       gated: bool) -> list:
        """ShardedTensors of upstream's per-expert linear weights, viewing ``grouped``
        ([El, in, out]; expert e's linear weight is grouped[e].T)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        first, total = self._global_experts()
        expert_axis = len(sharded_offsets)
        shards = []
        for e in range(self.num_local_experts):
            weight = grouped[e].t()  # [out, in] as a linear layer holds it; a view, no copy
            halves = torch.chunk(weight, 2, dim=0) if gated else (weight,)
            for half, part in enumerate(halves):
                shards.append(
                    ShardedTensor.from_rank_offsets(
                        key,
                        part,
                        *sharded_offsets,
                        (expert_axis, first + e, total),
                        (expert_axis + 1, half, len(halves)),
                        replica_id=replica_id,
                        prepend_axis_num=expert_axis + 1,
                    )
                )
        return shards

    def _grouped_factory(self, name: str, key: str, sharded_offsets, replica_id):
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        gated = name == "weight1" and self.activation.gated
        num_local = self.num_local_experts

        def build(factory_key, data, factory_replica_id, flattened_range):
            if flattened_range is not None:
                raise ValueError("GroupedExperts checkpoints do not support flattened ranges")
            return self._expert_shards(factory_key, data, sharded_offsets, factory_replica_id,
                                       gated)

        def merge(loaded: list) -> torch.Tensor:
            per_expert = len(loaded) // num_local
            weights = [
                torch.cat(loaded[e * per_expert:(e + 1) * per_expert], dim=0).t()
                for e in range(num_local)
            ]
            return torch.stack(weights)

        return ShardedTensorFactory(key, getattr(self, name), build, merge, replica_id)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Expert weights in upstream ``SequentialMLP``'s checkpoint layout (see above), each
        rank holding its experts' rows of the global expert axis, replicated over the expert
        data-parallel group."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError(
                "GroupedExperts checkpoints use the stacked expert layout (megatron-core's default); "
                "singleton_local_shards is not supported"
            )
        replica_id = (0, 0, mcore_utils.get_pg_rank(self.expt_dp_group))
        first, total = self._global_experts()
        state = {}
        for name, linear in (("weight1", self.CHECKPOINT_FC1), ("weight2", self.CHECKPOINT_FC2)):
            state[f"{prefix}{name}"] = self._grouped_factory(
                name, f"{prefix}{linear}.weight", sharded_offsets, replica_id
            )
        outer_shape = tuple(size for _, _, size in sorted(sharded_offsets))
        outer_offset = tuple(offset for _, offset, _ in sorted(sharded_offsets))
        state[f"{prefix}_extra_state"] = [
            ShardedObject(
                f"{prefix}{linear}._extra_state",
                None,
                (*outer_shape, total),
                (*outer_offset, first + e),
                replica_id=replica_id,
            )
            for linear in (self.CHECKPOINT_FC1, self.CHECKPOINT_FC2)
            for e in range(self.num_local_experts)
        ]
        return state


# Distributed-optimizer checkpoint formats whose state is keyed like the model's weights (so it
# follows the layout above); the others store flat per-bucket state whose order is the order of
# the parameters, which differs between these experts and upstream's.
MODEL_SPACE_OPTIMIZER_FORMATS = ("fully_reshardable", "fully_sharded_model_space")


def expert_parameter_layout(args) -> Optional[str]:
    """``"grouped"`` (these experts), ``"upstream"`` (upstream's experts) or None (no MoE)."""
    if not getattr(args, "num_experts", None):
        return None
    from megatron.bounded.moe.backend import select_moe_backend

    torch_native = select_moe_backend(args) == "torch"
    return "grouped" if torch_native and getattr(args, "transformer_impl", "local") == "local" \
        else "upstream"


def check_expert_layout_on_resume(checkpoint_args, args, content_metadata) -> None:
    """Refuse to load distributed-optimizer state saved with the other expert class in a bucket
    format (it would load without error into the wrong parameters); weights alone are fine."""
    if checkpoint_args is None or getattr(args, "no_load_optim", False) or getattr(
        args, "finetune", False
    ) or not getattr(args, "use_distributed_optimizer", False):
        return
    sharding = (content_metadata or {}).get("distrib_optim_sharding_type")
    if sharding in MODEL_SPACE_OPTIMIZER_FORMATS:
        return
    saved, now = expert_parameter_layout(checkpoint_args), expert_parameter_layout(args)
    if saved is None or now is None or saved == now:
        return
    names = {"grouped": "the torch-native grouped experts", "upstream": "upstream's experts"}
    raise RuntimeError(
        f"this checkpoint was saved with {names[saved]} and this run uses {names[now]} "
        "(--bounded-moe-backend, --moe-expert-rank-capacity-factor and --pipelined-llep choose "
        f"them). The weights load either way, but its distributed-optimizer state is in the "
        f"{sharding or 'dp_reshardable'} format, ordered by the parameters of the class that "
        "saved it. Resume with the same expert flags, or with --no-load-optim (fresh optimizer "
        "state), or save with --dist-ckpt-optim-fully-reshardable to switch freely."
    )
