"""PipelinedLLEP: chunked expert-parallel MoE with a per-source token budget and LLEP balancing.

A rank's routed batch is cut into K chunks that go through dispatch -> grouped expert GEMM ->
combine, pipelined two chunks at a time and recomputed chunk by chunk in backward, so what a rank
receives is bounded by the launch configuration whatever the routing. The derivation (how K is
chosen, the bound, exactness and recompute, the pipeline, LLEP) is in
docs/operators/pipelined_llep.md.
"""

from megatron.bounded.moe.pipelined_llep.balance import LLEPPlan, Spill, plan_llep
from megatron.bounded.moe.pipelined_llep.chunks import (
    agree_num_chunks,
    contiguous_chunk,
    dispatch_live_bytes_bound,
    num_chunks,
    strided_chunk,
)
from megatron.bounded.moe.pipelined_llep.function import pipelined_moe
from megatron.bounded.moe.pipelined_llep.layer import PipelinedLLEPMoE
from megatron.bounded.moe.pipelined_llep.settings import PipelinedLLEPSettings, pipelined_llep_live_bytes

__all__ = [
    "num_chunks",
    "agree_num_chunks",
    "strided_chunk",
    "contiguous_chunk",
    "dispatch_live_bytes_bound",
    "pipelined_llep_live_bytes",
    "Spill",
    "LLEPPlan",
    "plan_llep",
    "pipelined_moe",
    "PipelinedLLEPMoE",
    "PipelinedLLEPSettings",
]
