"""The public name of SCO's context manager: ``megatron.bounded.offload.sco.CheckpointOffload``.

SCO lives in :mod:`megatron.bounded.activations.sco`, beside the other bounds on activation
memory; this module keeps the published import path.
"""

from megatron.bounded.activations.sco import CheckpointOffload

__all__ = ["CheckpointOffload"]
