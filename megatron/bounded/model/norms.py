"""Torch norms with zero-centred gamma (``--apply-layernorm-1p``, e.g. Qwen3-Next).

With ``layernorm_zero_centered_gamma`` a norm's weight is initialised to 0 and applied as
``1 + weight`` (Transformer Engine's ``zero_centered_gamma``); megatron-core's torch norm
(``WrappedTorchNorm``) refuses it, so :func:`use_zero_centered_norms` puts :class:`ZeroCenteredNorm`
in its place in a spec. :func:`normalize` is the one computation of both, and of the norm inside
:class:`megatron.bounded.model.mla.NormedColumnParallelLinear`. ``1 + weight`` is formed in the
weight's dtype, which keeps torch's fused norm kernels (they take input and weight of one dtype).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["normalize", "initial_norm_weight", "ZeroCenteredNorm", "use_zero_centered_norms"]


def initial_norm_weight(size: int, zero_centered: bool, **tensor_kwargs) -> torch.Tensor:
    """A norm's initial weight: ones, or zeros where it is applied as ``1 + weight``."""
    return (torch.zeros if zero_centered else torch.ones)(size, **tensor_kwargs)


def normalize(input_: torch.Tensor, weight: torch.Tensor, bias, eps: float, rms_norm: bool,
              zero_centered: bool) -> torch.Tensor:
    """RMSNorm or LayerNorm of ``input_``'s last dimension with gain ``weight`` (``1 + weight``
    when ``zero_centered``) and ``bias`` (LayerNorm)."""
    gain = weight + 1 if zero_centered else weight
    shape = (input_.shape[-1],)
    if rms_norm:
        return F.rms_norm(input_, shape, gain, eps)
    return F.layer_norm(input_, shape, gain, bias, eps)


class ZeroCenteredNorm(torch.nn.Module):
    """The config's normalization (RMSNorm or LayerNorm) with zero-centred gamma: parameters
    ``weight`` (and ``bias``) as in torch's norms, created like them (default dtype and device;
    the model wrapper casts and moves them)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"zero-centred gamma needs RMSNorm or LayerNorm, not {config.normalization}")
        self.rms_norm = config.normalization == "RMSNorm"
        self.eps = eps
        self.weight = torch.nn.Parameter(initial_norm_weight(hidden_size, zero_centered=True))
        self.bias = None if self.rms_norm else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return normalize(input_, self.weight, self.bias, self.eps, self.rms_norm, zero_centered=True)


def use_zero_centered_norms(spec, config):
    """``spec`` (freshly built: a layer, block or MTP block spec) with every megatron-core torch
    norm replaced by :class:`ZeroCenteredNorm` when ``config.layernorm_zero_centered_gamma``."""
    if not getattr(config, "layernorm_zero_centered_gamma", False):
        return spec
    return _replace_torch_norms(spec)


def _replace_torch_norms(node):
    if node is WrappedTorchNorm:
        return ZeroCenteredNorm
    if isinstance(node, list):
        return [_replace_torch_norms(item) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        # ModuleSpec and the submodule dataclasses; the same object may sit in several places
        # (one spec per layer kind), which replaces it once and then finds nothing to replace
        for field in dataclasses.fields(node):
            setattr(node, field.name, _replace_torch_norms(getattr(node, field.name)))
    return node
