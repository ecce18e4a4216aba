"""Gradient-norm and scaling for upstream's optimizer when neither Apex nor Transformer Engine is
installed, with the values of upstream's own fallbacks and fewer operations.

Upstream's fallbacks (``megatron.core.utils.local_multi_tensor_l2_norm`` and
``local_multi_tensor_scale``) read every gradient's norm to the host one at a time (a device
synchronization per parameter, every step) and scale the gradients with two operations per
parameter. These functions take the same arguments and give bitwise the same results:

- :func:`l2_norm` computes the same per-tensor ``torch.norm`` values, copies them to the host in
  one transfer and takes their norm there, as upstream does with ``torch.tensor`` of the list;
- :func:`scale` multiplies in the source dtype by the same scalar, as upstream's ``src * scale``,
  in one ``torch._foreach_mul_`` when the gradients are scaled in place.
"""

from __future__ import annotations

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``(total L2 norm as a one-element fp32 tensor on the tensors' device, None)``."""
    del chunk_size, noop_flag, per_tensor, args  # the fallback's signature; unused, as upstream
    norms = [torch.norm(tensor) for tensors in tensor_lists for tensor in tensors]
    rows, columns = len(tensor_lists), len(tensor_lists[0])
    on_host = torch.stack(norms).cpu().view(rows, columns)
    total = torch.norm(on_host)
    return torch.tensor([float(total)], dtype=torch.float, device=norms[0].device), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """``dst = src * factor`` for each pair of ``tensor_lists = [srcs, dsts]``."""
    del chunk_size, noop_flag
    sources, destinations = tensor_lists
    if all(s is d for s, d in zip(sources, destinations)):
        torch._foreach_mul_(destinations, factor)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, factor))
