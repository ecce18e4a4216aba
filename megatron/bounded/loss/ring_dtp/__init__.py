"""Ring-DTP: exact ring vocabulary-parallel linear + cross-entropy, and the GPT output layer
sharded for it.

Each of the P ranks of a group keeps its own tokens and one contiguous slice of the output
weight's vocabulary rows; every token meets every shard once around the ring, one N x V/P fp32
strip at a time, folded into a running (max, sum, target logit) state and released, so no rank
forms the N x V logits. The derivation, the schedules and the memory bound are in
docs/operators/ring_dtp.md. The modules: ``function`` (the entry point and its autograd
function), ``ring`` (the layout, the ``auto`` choice, the exchange), ``schedules`` (the two ring
schedules), ``single`` (one rank), ``strips`` (forming and folding the strips), ``kernels`` (the
strip kernels), ``workspace`` (the bound), ``output`` (the model integration and
``RingDTPSettings``).
"""

from megatron.bounded.loss.ring_dtp.function import reference_cross_entropy, ring_dtp_cross_entropy
from megatron.bounded.loss.ring_dtp.output import (
    IGNORE_INDEX,
    RingDTPLoss,
    RingDTPSettings,
    labels_for_loss,
    shard_output_layer,
)
from megatron.bounded.loss.ring_dtp.ring import MODES, choose_ring_mode, vocab_shard_range
from megatron.bounded.loss.ring_dtp.single import check_gradient_rows, gradient_group_rows
from megatron.bounded.loss.ring_dtp.strips import reset_ring_dtp_stats, ring_dtp_stats
from megatron.bounded.loss.ring_dtp.workspace import ring_dtp_workspace_bytes

__all__ = [
    "MODES",
    "IGNORE_INDEX",
    "check_gradient_rows",
    "choose_ring_mode",
    "gradient_group_rows",
    "labels_for_loss",
    "reference_cross_entropy",
    "reset_ring_dtp_stats",
    "ring_dtp_cross_entropy",
    "ring_dtp_stats",
    "ring_dtp_workspace_bytes",
    "shard_output_layer",
    "vocab_shard_range",
    "RingDTPLoss",
    "RingDTPSettings",
]
