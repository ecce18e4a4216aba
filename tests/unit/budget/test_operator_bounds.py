"""Each operator's memory-bound function, owned by the operator's module and composed by the
budget: the arithmetic, the GPU live set recorded by tools/benchmarks/bench_reach.py, and the
budget holding no copy of any of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron.bounded.activations.chunked_attention import (
    backward_bytes_per_token,
    chunk_backward_bytes_per_token,
    kept_attention_bytes,
    saved_bytes_per_token,
)
from megatron.bounded.attention.blockwise import KEY_BLOCKS_PER_CALL
from megatron.bounded.moe.pipelined_llep import pipelined_llep_live_bytes
from megatron.bounded.moe.dispatch.token_dispatcher import capacity_rows
from megatron.bounded.activations.sco import boundaries_on_device
from megatron.bounded.optimizer.offload_stream_adamw import staging_bound_bytes

REPO = Path(__file__).resolve().parents[3]
RECORD = REPO / "docs/results/reach_1xh200/offload_stream_8L_262144.trial.json"
CHUNKED_ATTENTION_RECORD = (REPO / "docs/results/chunked_recompute_1xh200/30fc881/snapshot/"
                            "chunked_attention_8L_1048576.trial.json")


def test_pipelined_llep_parts():
    # N = 1,000, c = 300: K = 4, c_eff = 250; k = 2, E_p = 2: send 500 rows, receive 1,000
    parts = pipelined_llep_live_bytes(1000, 8, 4, 2, 2, 3, 300, 10, act_bytes=2, gated=True)
    assert parts["dispatch"] == 2 * (500 + 1000) * 8 * 2
    assert parts["expert_backward"] == 1000 * 2 * (2 * 8 + 2 * 4 + 8)
    assert parts["weight_grads"] == 3 * (8 + 4) * 8 * 2
    # one chunk: nothing else in flight
    single = pipelined_llep_live_bytes(100, 8, 4, 2, 2, 3, 300, 10)
    assert single["dispatch"] == (200 + 400) * 8 * 2


def test_pipelined_llep_bound_matches_the_recorded_live_set():
    """One H200, all four operators at 262,144 tokens: the dispatch rows alive at the peak (the
    allocator's snapshot, by allocating line) are what the bound says, within 1%."""
    owners = json.loads(RECORD.read_text())["peak_owners"]
    dispatched = sum(nbytes for owner, nbytes in owners.items()
                     if owner.startswith("megatron/bounded/moe/pipelined_llep")
                     and " _dispatch " in owner)
    bound = pipelined_llep_live_bytes(262_144, 1024, 1024, 4, 1, 32, 16_384, 10)["dispatch"]
    assert abs(dispatched - bound) <= 0.01 * bound


def test_staging_bound():
    assert staging_bound_bytes(94_864, 20_000, 2) == 2 * 20_000 * 16
    assert staging_bound_bytes(94_864, 100_000_000, 2) == 94_864 * 16
    assert staging_bound_bytes(0, 10, 2) == 0


def test_sco_boundaries_on_device():
    assert boundaries_on_device(8, 100, 0) == (0, 8)
    assert boundaries_on_device(8, 100, 350) == (3, 5 + 2)
    assert boundaries_on_device(8, 100, 10_000) == (8, 2)
    assert boundaries_on_device(8, 100, 150) == (1, 7 + 1)
    # a checkpoint of two boundaries (an MTP layer) restores both, plus one prefetched
    assert boundaries_on_device(8, 100, 10_000, restored_together=2) == (8, 3)


def test_capacity_rows_is_the_dispatchers():
    assert capacity_rows(100, 8, 2, 1.1) == 440


def test_budget_holds_no_operator_formula():
    """The budget composes the operators' functions: no copy of their arithmetic in the budget package."""
    source = "".join(path.read_text() for path in (REPO / "megatron/bounded/budget").glob("*.py"))
    for function in ("pipelined_llep_live_bytes", "capacity_rows", "boundaries_on_device",
                     "staging_bound_bytes", "ring_dtp_workspace_bytes", "agree_num_chunks",
                     "SCOSettings", "saved_bytes_per_token", "backward_bytes_per_token",
                     "chunk_backward_bytes_per_token", "released_bytes_per_token",
                     "kept_attention_bytes"):
        assert re.search(rf"import \(?[\w\s,]*\b{function}\b", source), function
    for copied in (r"limit_denominator", r"min\(offloaded, 2\)", r"\* 16\b", r"4 \* rows \* s",
                   r"\* GiB\)", r"/ GiB, 3\)"):  # (the last two: SCO's GiB -> bytes rule)
        assert not re.search(copied, source), copied


def test_chunked_attention_parts():
    # the small example: H 1024, 16 heads and 4 groups of 64, bf16
    assert saved_bytes_per_token(1024, 256, 16, 2) == 2 * 256 * 2 + 1024 * 2 + 16 * 4
    assert backward_bytes_per_token(1024, 256, 2) == 1024 * 2 + 2 * 256 * 4
    recomputed = 1024 * 2 + (1024 + 512) * 2 + (1024 + 256) * 2 + 1024 * 2
    gradients = 1024 * 2 + 1024 * 4
    kernel = 1024 * 4 + 2 * 1024 * 2 + (1024 + 512) * 2
    merged_keys = (KEY_BLOCKS_PER_CALL - 1) * (2 * 1024 * 2 + 2 * 256 * 4)
    assert chunk_backward_bytes_per_token(1024, 1024, 256, 2) == (
        recomputed + gradients + kernel + merged_keys)


def test_kept_attention_parts():
    # 8 layers of 1,000 tokens, 3,136 B per token and layer
    layer = 1000 * 3136
    assert kept_attention_bytes("gpu", 8, 1000, 3136) == {"loss": 8 * layer, "layer": 7 * layer,
                                                          "host": 0}
    assert kept_attention_bytes("host", 8, 1000, 3136) == {"loss": layer, "layer": layer,
                                                           "host": 8 * layer}
    assert kept_attention_bytes("off", 8, 1000, 3136) == {"loss": 0, "layer": 0, "host": 0}


def test_chunked_attention_bound_matches_the_recorded_live_set():
    """One H200, 1,048,576 tokens: what the node saves besides its input (K and V, the output
    and its log-sum-exp) and what its backward adds for the sequence (the input gradient, fp32
    dK and dV) are, at the peak, what the two functions say, within 1%."""
    tokens = 1_048_576
    owners = json.loads(CHUNKED_ATTENTION_RECORD.read_text())["peak_owners"]  # files and lines of 30fc881

    def allocated_at(*places):
        return sum(nbytes for owner, nbytes in owners.items()
                   if owner.split(" < ")[0].startswith(places))

    kept = allocated_at("megatron/bounded/chunked_attention.py:156",  # K, V
                        "megatron/bounded/attention_blocks.py:105")  # output, log-sum-exp
    backward = allocated_at("megatron/bounded/chunked_attention.py:186",  # input gradient
                            "megatron/bounded/chunked_attention.py:187",  # fp32 dK
                            "megatron/bounded/chunked_attention.py:188")  # fp32 dV
    for measured, per_token in ((kept, saved_bytes_per_token(1024, 256, 16, 2)),
                                (backward, backward_bytes_per_token(1024, 256, 2))):
        assert abs(measured - tokens * per_token) <= 0.01 * tokens * per_token
