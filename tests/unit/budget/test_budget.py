"""Launch-time memory budget (megatron.bounded.budget, tools/memory_budget.py).

Every term is checked against the arithmetic written out here for a small configuration; the
paper's tables against the figures the paper prints; the paper's three models
(H=7168, 384 experts, top-8, V=200,000; 7/14/39 layers on 16/32/64 GPUs) are evaluated at 128K
and 1M tokens with and without the operators, the planner (``plan_run``) on command lines parsed as
pretrain_gpt.py parses them, and the CLI is run on an example script's flags.
"""

from __future__ import annotations

import argparse
import types
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.bounded import budget as B
from megatron.bounded.budget import cost as C, phases as P, planner as PLANNER, widths as W
from megatron.bounded.units import GB, GiB, ceil_div

REPO_ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------------------
# A small configuration, every number small enough to follow by hand
# ------------------------------------------------------------------------------------------
# H=64, 4 heads of 16 in 2 query groups, SwiGLU, RMSNorm, no biases, untied embeddings, rope;
# 4 MoE layers of 8 experts (F_m=32), top-2; vocab 1000 -> padded to 1024; seq 256, mbs 1;
# world 4 = DP 4, EP 2 (expert-DP 2); bf16, distributed optimizer, full recompute uniform 1.
N, H, V_PAD, L = 256, 64, 1024, 4
NHB = N * H * 2  # one checkpoint boundary: 32,768 B


def small(**overrides) -> argparse.Namespace:
    args = argparse.Namespace(
        num_layers=L, hidden_size=H, ffn_hidden_size=128, num_attention_heads=4,
        group_query_attention=True, num_query_groups=2, kv_channels=16,
        seq_length=N, max_position_embeddings=N, micro_batch_size=1,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True,
        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,
        expert_model_parallel_size=2, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, context_parallel_size=1,
        world_size=4, data_parallel_size=4,
        vocab_size=1000, make_vocab_size_divisible_by=128,
        bf16=True, use_distributed_optimizer=True,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        hbm_gb=1.0,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


# hand-counted parameters of the small model (per rank)
ATTN = H * (4 + 2 * 2) * 16 + 4 * 16 * H + H  # QKV 8192 + proj 4096 + input norm 64 = 12,352
MOE_DENSE = 8 * H + H  # router 512 + pre-MLP norm 64 = 576
EXPERT = H * 32 * 2 + 32 * H  # 6,144 per expert; 4 local experts (8 / EP 2)
DENSE = L * (ATTN + MOE_DENSE) + V_PAD * H + V_PAD * H + H  # + embedding, output, final norm
EXPERTS = L * 4 * EXPERT


# The small configuration as pretrain_gpt.py flags, with EP = DP = 4 (Ring-DTP needs one rank per
# expert shard), for the planner, which plans on the flags as upstream's validation leaves them.
SMALL_ARGV = [
    "--num-layers", str(L), "--hidden-size", str(H), "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--seq-length", str(N), "--max-position-embeddings", str(N),
    "--micro-batch-size", "1", "--global-batch-size", "4", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--expert-model-parallel-size", "4", "--vocab-size", "1000",
    "--make-vocab-size-divisible-by", "128", "--tokenizer-type", "NullTokenizer", "--mock-data",
    "--bf16", "--use-distributed-optimizer", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1", "--train-iters", "3",
    "--eval-iters", "0", "--lr", "1e-4", "--transformer-impl", "local", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
OPERATOR_FLAGS = ("offload_stream_optimizer", "sco_host_budget_gb", "ring_dtp", "pipelined_llep")


def parsed(monkeypatch, argv, world):
    """(args, settings) of ``argv`` parsed and validated as pretrain_gpt.py does, on ``world``
    ranks; pinned host memory planned for 250 GB per GPU, not this machine's RAM."""
    from megatron.bounded.activations import host_memory
    from megatron.bounded.launch.planning import validate_quietly
    from megatron.bounded.upstream import patches

    patches.apply_patches()
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(host_memory, "_planned_bytes_per_gpu", 250 * GB)  # restored after
    args, settings, _ = validate_quietly(argv)
    return args, settings


def planned(monkeypatch, argv, world):
    """(args, settings, plan): ``B.plan_run`` on ``argv`` as pretrain_gpt.py plans it, for the
    GPU of --hbm-gb (default one H200), changing none of the flags ``argv`` gives."""
    from megatron.bounded.launch.planning import given_attributes

    args, settings = parsed(monkeypatch, argv, world)
    args.hbm_gb = settings.budget.hbm_gb
    return args, settings, B.plan_run(args, given_attributes(argv))


def operators_on(plan):
    """The operator flags ``plan`` turns on."""
    return {name for name in OPERATOR_FLAGS if plan.flags.get(name)}


def test_parameter_counts_by_hand():
    counts = B.parameter_counts(small())
    assert ATTN == 12_352 and MOE_DENSE == 576 and EXPERT == 6_144
    assert counts["attention"] == L * ATTN
    assert counts["moe_router_shared"] == L * MOE_DENSE
    assert counts["embedding"] == 1024 * 64 and counts["output_layer"] == 1024 * 64
    assert counts["dense"] == DENSE == 182_848
    assert counts["expert"] == EXPERTS == 98_304
    # a shared expert adds H·F_s·2 + F_s·H per MoE layer to the dense parameters
    shared = B.parameter_counts(small(moe_shared_expert_intermediate_size=32))
    assert shared["dense"] - counts["dense"] == L * (64 * 32 * 2 + 32 * 64)
    # --moe-layer-freq 2: layers 0 and 2 are MoE, 1 and 3 dense (H·F·2 + F·H + norm each)
    freq = B.parameter_counts(small(moe_layer_freq=2))
    assert freq["expert"] == 2 * 4 * EXPERT
    assert freq["dense_mlp"] == 2 * (64 * 128 * 2 + 128 * 64 + 64)
    listed = B.parameter_counts(small(moe_layer_freq=[0, 1, 1, 0]))
    assert listed["expert"] == 2 * 4 * EXPERT


def test_model_state_distributed_optimizer():
    b = B.estimate(small())
    # bf16 param 2 B + fp32 grad 4 B (upstream accumulates bf16 grads in fp32) + 12 B / W;
    # dense W = DP = 4, experts W_e = world / EP = 2
    expected = DENSE * (2 + 4 + 12 / 4) + EXPERTS * (2 + 4 + 12 / 2)
    assert b.terms["model_state"] == math.ceil(expected)
    assert b.terms["optimizer_staging"] == 0
    # without the distributed optimizer nothing is divided
    plain = B.estimate(small(use_distributed_optimizer=False))
    assert plain.terms["model_state"] == (DENSE + EXPERTS) * 18
    # --grad-reduce-in-bf16: 2 B gradients
    bf16_grads = B.estimate(small(grad_reduce_in_bf16=True))
    assert bf16_grads.terms["model_state"] == math.ceil(expected - 2 * (DENSE + EXPERTS))
    # fp32 training: 4 B params + 4 B grads + 8 B moments, no separate master
    fp32 = B.estimate(small(bf16=False, use_distributed_optimizer=False))
    assert fp32.terms["model_state"] == (DENSE + EXPERTS) * 16


def test_streamed_optimizer_state_and_staging():
    b = B.estimate(small(offload_stream_optimizer=True, offload_stream_bucket_numel=20_000))
    # GPU keeps 2 B params + 4 B grads; the 12 B of optimizer state go to the host
    assert b.terms["model_state"] == (DENSE + EXPERTS) * 6
    state_params = DENSE / 4 + EXPERTS / 2  # 45,712 + 49,152 = 94,864 updated on this rank
    assert b.host_terms["optimizer state"] == math.ceil(12 * state_params)
    # 94,864 params in buckets of 20,000 -> 5 buckets; 2 slots × 20,000 × 16 B
    assert b.terms["optimizer_staging"] == 2 * 20_000 * 16
    one_bucket = B.estimate(small(offload_stream_optimizer=True))  # default 1e8 > 94,864
    assert one_bucket.terms["optimizer_staging"] == 1 * 94_864 * 16


def test_paper_staging_figures():
    # Table 14: staging = slots × largest bucket × 16 B; 142M × 2 -> 4.234 GiB, 245M × 3 -> 10.95
    for bucket, slots, gib in ((142_000_000, 2, 4.234), (245_000_000, 3, 10.95)):
        big = paper("667B", SEQ_128K, offload_stream_optimizer=True,
                    offload_stream_bucket_numel=bucket, offload_stream_slots=slots)
        staging = B.estimate(big).terms["optimizer_staging"]
        assert staging == slots * bucket * 16
        assert staging / GiB == pytest.approx(gib, abs=0.005)


def test_checkpoint_boundaries_and_sco():
    rope_table = N * 16 * 4  # [S, kv_channels] fp32, one tensor shared by every layer
    b = B.estimate(small())
    assert b.terms["checkpoint_boundaries"] == L * NHB + rope_table  # 4 boundaries of N·H·b
    assert b.terms["layer_activations"] == 0
    two = B.estimate(small(recompute_num_layers=2))
    assert two.terms["checkpoint_boundaries"] == 2 * NHB + rope_table
    learned = B.estimate(small(position_embedding_type="learned_absolute"))
    assert learned.terms["checkpoint_boundaries"] == L * NHB
    # SCO with room for 3 boundaries: (4 - 3) stay + at most 2 restored = 3 on the device
    # --sco-host-budget-gb is GiB (pretrain_gpt.py: int(value × 1024³) bytes)
    sco = B.estimate(small(sco_host_budget_gb=(3 * NHB + 100) / GiB))
    assert sco.terms["checkpoint_boundaries"] == 3 * NHB + rope_table
    assert sco.host_terms["SCO boundaries"] == 3 * NHB
    # room for all 4: only 2 on the device; room for 1: 3 stay + 1 restored
    assert B.estimate(small(sco_host_budget_gb=1.0)).terms["checkpoint_boundaries"] == (
        2 * NHB + rope_table
    )
    assert B.estimate(small(sco_host_budget_gb=(NHB + 1) / GiB)).terms[
        "checkpoint_boundaries"
    ] == 4 * NHB + rope_table


def test_sco_boundary_matches_paper():
    # gpt-oss-20b, 557,056 tokens over 8 ranks = 69,632 tokens/rank, H=2880: 0.3735 GiB
    args = small(hidden_size=2880, num_attention_heads=64, num_query_groups=8, kv_channels=64,
                 seq_length=69_632, max_position_embeddings=69_632,
                 position_embedding_type="learned_absolute")
    b = B.estimate(args)
    per = b.terms["checkpoint_boundaries"] / L
    assert per == 69_632 * 2880 * 2
    assert per / GiB == pytest.approx(0.3735, abs=1e-4)


# per-token and per-row widths of the small model, counted as the module docstring says
ATTN_SAVED = 2 * (4 * 64 + 3 * 64 + 2 * 32) + 4 * 4  # 1,040 B/token (heads·kv 64, groups·kv 32)
ATTN_GRAD = 2 * (3 * 64 + 2 * 32) + 4 * 64  # 768 B/token
MOE_TOKEN = 2 * 8 * 4  # router logits + probabilities, fp32: 64 B/token
ROW_SAVED = 2 * (64 + 2 * 32)  # input row + fc1 output: 256 B/row
ROW_GRAD = 2 * (64 + 2 * 64 + 2 * 32)  # row grad + 2 × fc1 + 2 × F_m: 512 B/row
ROWS = 2 * N * 2  # skew 2 × N·k = 1,024 rows


def test_multi_token_prediction_layers():
    # one MTP layer: a MoE layer like the last one, the projection 2H·H and three norms
    counts = B.parameter_counts(small(mtp_num_layers=1))
    assert counts["mtp"] == ATTN + MOE_DENSE + 2 * H * H + 3 * H
    assert counts["mtp_experts"] == 4 * EXPERT
    assert counts["dense"] == DENSE + counts["mtp"] and counts["expert"] == EXPERTS + 4 * EXPERT
    # full recompute: its hidden state and the next tokens' embedding are two more boundaries
    rope_table = N * 16 * 4
    b = B.estimate(small(mtp_num_layers=1))
    assert b.details["boundaries"] == L + 2
    assert b.terms["checkpoint_boundaries"] == (L + 2) * NHB + rope_table
    # SCO with room for all 6: the MTP checkpoint's two come back together with one prefetched
    sco = B.estimate(small(mtp_num_layers=1, sco_host_budget_gb=1.0))
    assert sco.terms["checkpoint_boundaries"] == 3 * NHB + rope_table
    # without recompute the MTP layer is stored like a decoder MoE layer, and its loss keeps
    # the fp32 N×V softmax and its N·H·b output until the backward
    plain, mtp = (B.estimate(small(recompute_granularity=None, **extra))
                  for extra in ({}, {"mtp_num_layers": 1}))
    per_layer = N * ATTN_SAVED + N * MOE_TOKEN + ROWS * ROW_SAVED
    assert mtp.terms["layer_activations"] - plain.terms["layer_activations"] == per_layer
    assert mtp.terms["vocab_projection"] - plain.terms["vocab_projection"] == (
        4 * N * V_PAD + NHB)
    # upstream's MTP layer does not recompute under --recompute-method block: stored in full
    block = B.estimate(small(mtp_num_layers=1, recompute_method="block", recompute_num_layers=4))
    assert block.details["boundaries"] == L
    assert block.terms["layer_activations"] == per_layer


def test_moe_dispatch_three_ways():
    # upstream's dispatcher (the default here): permuted, sorted, expert-output and combine-sorted
    # rows, 4·rows·H·b, with rows = N·k × the assumed skew (EP = 2 > 1)
    standard = B.estimate(small())
    assert standard.terms["moe_dispatch"] == 4 * (2 * N * 2) * 64 * 2
    skew3 = B.estimate(small(budget_routing_skew=3.0))
    assert skew3.terms["moe_dispatch"] == 4 * (3 * N * 2) * 64 * 2
    # one rank in the expert group receives every routed row: no skew
    ep1 = B.estimate(small(expert_model_parallel_size=1, budget_routing_skew=3.0))
    assert ep1.terms["moe_dispatch"] == 4 * (N * 2) * 64 * 2
    # static capacity cf 1.5 (torch-native): send + receive buffers of E_p slabs of
    # ceil(1.5·256·2/2) = 384 rows
    cap = B.estimate(small(moe_expert_rank_capacity_factor=1.5))
    assert cap.terms["moe_dispatch"] == 2 * (2 * 384) * 64 * 2
    # PipelinedLLEP c = 64: K = 4, c_eff = 64; two chunks' send (k·c) and receive (E_p·k·c) rows
    llep = B.estimate(small(pipelined_llep=True, pipelined_llep_token_budget=64))
    assert llep.terms["moe_dispatch"] == 2 * (2 * 64 + 2 * 2 * 64) * 64 * 2
    # c = 16 would need 16 chunks: K = K_max = 10 and c_eff = ceil(256/10) = 26
    capped = B.estimate(small(pipelined_llep=True, pipelined_llep_token_budget=16))
    assert capped.terms["moe_dispatch"] == 2 * (2 * 26 + 2 * 2 * 26) * 64 * 2
    more = B.estimate(small(pipelined_llep=True, pipelined_llep_token_budget=16,
                            pipelined_llep_max_chunks=16))
    assert more.terms["moe_dispatch"] == 2 * (2 * 16 + 2 * 2 * 16) * 64 * 2
    # PipelinedLLEP's bound does not move with the assumed skew
    assert B.estimate(small(pipelined_llep=True, pipelined_llep_token_budget=64,
                            budget_routing_skew=5.0)).terms["moe_dispatch"] == (
        llep.terms["moe_dispatch"]
    )
    dense = B.estimate(small(num_experts=None))
    assert dense.terms["moe_dispatch"] == 0


def test_paged_stash_pages():
    # full recompute: one layer's pages, 1.10 × N·k × (H + 2F_m)·b
    b = B.estimate(small(moe_paged_stash=True, moe_expert_rank_capacity_factor=1.5))
    assert b.terms["paged_stash"] == math.ceil(1.10 * N * 2 * ROW_SAVED)
    # no recompute: every MoE layer is paged, and its rows leave the layer activations
    no_rc = dict(recompute_granularity=None, moe_expert_rank_capacity_factor=1.5)
    paged = B.estimate(small(moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=1.2,
                             **no_rc))
    resident = B.estimate(small(**no_rc))
    assert paged.terms["paged_stash"] == math.ceil(1.2 * N * 2 * ROW_SAVED * L)
    cap_rows = 2 * 384
    assert resident.terms["layer_activations"] - paged.terms["layer_activations"] == (
        L * cap_rows * ROW_SAVED
    )
    assert B.estimate(small()).terms["paged_stash"] == 0


def test_layer_activations_without_recompute():
    b = B.estimate(small(recompute_granularity=None))
    per_layer = N * ATTN_SAVED + N * MOE_TOKEN + ROWS * ROW_SAVED  # 266,240 + 16,384 + 262,144
    assert per_layer == 544_768
    assert b.terms["layer_activations"] == L * per_layer
    assert b.terms["checkpoint_boundaries"] == 0
    # backward transient only: max(attention, MoE tokens + rows) + 2·N·H·b
    transient = max(N * ATTN_GRAD, N * MOE_TOKEN + ROWS * ROW_GRAD)
    assert b.terms["recompute_working_set"] == transient + 2 * NHB


def test_selective_recompute_takes_each_modules_saving_off_the_layers():
    """Each module of selective recompute takes what it frees off every layer's saved bytes
    (tests/unit/activations/test_selective_recompute.py checks the savings against the bytes counted on a
    layer); the layer in backward holds them again, in the recompute working set."""
    plain = B.estimate(small(recompute_granularity=None))

    def saving(*modules, **overrides):
        before = B.estimate(small(recompute_granularity=None, **overrides))
        b = B.estimate(small(recompute_granularity="selective", recompute_modules=list(modules),
                             **overrides))
        return (before.terms["layer_activations"] - b.terms["layer_activations"],
                b.terms["recompute_working_set"] - before.terms["recompute_working_set"], b)

    core_attn = 2 * 64 + 4 * 4  # SDPA output heads·kv·b and log-sum-exp: 144 B/token
    layernorm = 2 * H * 2  # both norm outputs: 256 B/token
    moe = N * MOE_TOKEN + ROWS * ROW_SAVED  # router tensors and routed rows: 278,528 B
    assert saving("core_attn")[:2] == (L * N * core_attn, N * core_attn)
    assert saving("layernorm")[:2] == (L * N * layernorm, N * layernorm)
    assert saving("moe")[:2] == (L * moe, moe)  # the rows at the active count, here the kept
    assert saving("core_attn", "layernorm", "moe")[:2] == (
        L * (N * (core_attn + layernorm) + moe), N * (core_attn + layernorm) + moe)
    assert saving("moe_act")[:2] == (0, 0)  # the grouped experts always recompute it
    shared = 2 * (2 * 64 + 64)  # the shared expert's fc1 output and activation: 384 B/token
    assert saving("shared_experts", moe_shared_expert_intermediate_size=64)[:2] == (
        L * N * shared, N * shared)
    dense = 2 * (2 * 128 + 128)  # the dense MLP's fc1 output and activation: 768 B/token
    assert saving("mlp", moe_layer_freq=[0, 1, 1, 1])[:2] == (N * dense, N * dense)  # one
    # dense layer; its backward's recomputed MLP is added to the largest transient (an upper bound)
    b = saving("layernorm", "moe_act")[2]
    assert "less, recomputed in backward (layernorm, moe_act): attention N·256 B" in \
        b.notes["layer_activations"]
    assert f"what layernorm, moe_act recomputed, {N * layernorm:,} B" in \
        b.notes["recompute_working_set"]
    assert "recompute" not in plain.notes["layer_activations"]


# what a recomputed layer of the small model keeps per token, tensor by tensor: residual after
# attention and layer output 2·H·b, two norm outputs with fp32 inverse RMS 2·(H·b + 4), QKV
# (4 + 2·2)·16·b, rotated q and k (4 + 2)·16·b, attention output and log-sum-exp 4·16·b + 4·4,
# rotary cos/sin 2·16·4, router logits and load-balancing scores 2·8·4
LAYER_SAVED = 256 + 264 + 256 + 192 + 144 + 128 + 64  # 1,304 B/token


def test_recompute_working_set():
    b = B.estimate(small())
    assert W.recomputed_layer_bytes_per_token(b.config, moe=True) == LAYER_SAVED
    assert b.details["peak_phase"] == "layer"
    rows = 2 * N * 2  # skew 2 × N·k
    upstream_experts = rows * 2 * (2 * 32 + 32)  # fc1 output and activation of the rows
    upstream_extra = (L - 1) * NHB  # the further N·H·b blocks of upstream's MoE layer
    assert b.terms["recompute_working_set"] == (
        N * LAYER_SAVED + 2 * NHB + upstream_extra + upstream_experts + B.KERNEL_WORKSPACE_BYTES
    )
    # PipelinedLLEP c = 64: one chunk's expert backward on R = E_p·k·c = 256 rows and the
    # local experts' weight gradients
    llep = B.estimate(small(pipelined_llep=True, pipelined_llep_token_budget=64))
    backward = 256 * 2 * (2 * 64 + 2 * 32 + 64)
    weight_grads = 4 * (64 + 32) * 64 * 2
    assert llep.terms["recompute_working_set"] == (
        N * LAYER_SAVED + 2 * NHB + backward + weight_grads + B.KERNEL_WORKSPACE_BYTES
    )
    # the peak is the model state plus the largest phase, not the sum of every term
    phases = llep.details["phases"]
    assert llep.peak_allocated == max(phases.values())
    assert llep.peak_allocated < sum(v for k, v in llep.terms.items()
                                     if k != "cuda_context_fragmentation")


def test_chunked_attention_layer_phase_composes_the_nodes_bounds():
    """--chunked-recompute-attention: the layer phase is what the attention node keeps + two
    gradients + the larger of attention's backward and the MLP block's, from the operator's own
    functions (megatron.bounded.activations.chunked_attention)."""
    from megatron.bounded.activations.chunked_attention import (
        backward_bytes_per_token, chunk_backward_bytes_per_token, saved_bytes_per_token)

    chunk = 32
    flags = dict(pipelined_llep=True, pipelined_llep_token_budget=64,
                 chunked_recompute_tokens=chunk)
    mlp_only = B.estimate(small(**flags))
    both = B.estimate(small(chunked_recompute_attention=True, **flags))
    saved = saved_bytes_per_token(4 * 16, 2 * 16, 4, 2)
    attention = N * backward_bytes_per_token(H, 2 * 16, 2) \
        + chunk * chunk_backward_bytes_per_token(H, 4 * 16, 2 * 16, 2)
    mlp = N * H * 2 + P._mlp_chunk_bytes(both.config, 1, 0)
    assert both.terms["recompute_working_set"] == (
        N * saved + 2 * NHB + max(attention, mlp) + B.KERNEL_WORKSPACE_BYTES)
    assert both.terms["recompute_working_set"] < mlp_only.terms["recompute_working_set"]
    # without the chunks the flag changes nothing the budget counts
    plain = small(pipelined_llep=True, pipelined_llep_token_budget=64)
    assert B.estimate(plain).terms == B.estimate(
        small(chunked_recompute_attention=True, pipelined_llep=True,
              pipelined_llep_token_budget=64)).terms


def test_context_parallel_attention_exchange():
    # CP = 4 over the same 4 ranks: N = 256 / 4 = 64 tokens per rank; the 2 query groups are
    # repeated to lcm(2, 4) = 4 for the exchange (groups·kv 64), which adds two copies of the
    # exchanged b·(heads + 2·groups')·kv to the backward transient
    b = B.estimate(small(context_parallel_size=4, data_parallel_size=1, expert_model_parallel_size=4))
    widths = W.activation_widths(b.config)
    assert b.details["tokens"] == N // 4
    assert widths["attn_saved"] == 2 * (4 * 64 + 3 * 64 + 2 * 64) + 4 * 4
    assert widths["attn_grad"] == 2 * (3 * 64 + 2 * 64) + 4 * 64 + 2 * 2 * (64 + 2 * 64)
    # groups that split over the ranks are exchanged as they are
    b2 = B.estimate(small(context_parallel_size=2, data_parallel_size=2))
    assert W.activation_widths(b2.config)["attn_saved"] == ATTN_SAVED


def test_ring_dtp_gradient_rows_reach_the_budget_on_one_rank():
    from megatron.bounded.loss.ring_dtp import ring_dtp_workspace_bytes

    one_rank = dict(world_size=1, data_parallel_size=1, expert_model_parallel_size=1, ring_dtp=True,
                    ring_dtp_chunk_tokens=32, ring_dtp_grad_in_forward=True)
    default = B.estimate(small(**one_rank)).terms["vocab_projection"]
    more = B.estimate(small(**one_rank, ring_dtp_gradient_rows=128)).terms["vocab_projection"]
    expected = ring_dtp_workspace_bytes(N, H, V_PAD, 1, chunk_tokens=32, input_bytes=2,
                                        grad_in_forward=True, gradient_rows=128,
                                        cuda_kernels=True)
    returned = (N + V_PAD) * H * 2  # dX and dW in bf16, the returned gradients
    assert more == expected + returned + N * 32 and more > default  # + the batch tensors (below)


def test_vocabulary_projection_standard_and_ring():
    b = B.estimate(small())
    # upstream's output layer: bf16 logits and their fp32 copy in the cross entropy, + the batch
    assert b.terms["vocab_projection"] == N * V_PAD * (2 + 4) + N * (4 + 28)
    # Ring-DTP over DP = 4 ranks, chunks of 64 tokens; s = ceil(1024/4) = 256 vocab rows.
    # auto mode: N = 256 is not > V/P = 256, so the activations travel.
    ring = B.estimate(small(ring_dtp=True, ring_dtp_chunk_tokens=64))
    s = 256
    work = (
        4 * 64 * s * 4  # four fp32 strips of 64 tokens × 256 vocab rows
        + 8 * N * 4  # per-token state vectors
        + s * H * 4 + 64 * H * 4  # fp32 copies of the bf16 shard and of one chunk
        + 64 * s * 2  # the bf16 gradient strip (16-bit GEMMs writing fp32)
        + 2 * N * (H * 2 + 8 + 8)  # double-buffered travelling batch
        + 3 * N * H * 4  # travelling dX accumulator
        + s * H * 4  # local dW accumulator
    )
    assert work == 720_896
    assert ring.terms["vocab_projection"] == work + N * 32
    # weights mode: the shards travel instead
    weights = B.estimate(small(ring_dtp=True, ring_dtp_chunk_tokens=64, ring_dtp_mode="weights"))
    w_work = (
        4 * 64 * s * 4 + 8 * N * 4 + s * H * 4 + 64 * H * 4 + 64 * s * 2
        + 2 * s * H * 2  # double-buffered visiting bf16 shards
        + 3 * s * H * 4  # travelling dW accumulator
        + N * H * 4  # local dX accumulator
    )
    assert weights.terms["vocab_projection"] == w_work + N * 32
    # gradients in forward (activations): one round's kept strips instead of four, the kept
    # hidden rows of the P visiting chunks, and the unit dW kept from forward to backward (the
    # unit dX is kept in bf16: it becomes the returned gradient)
    in_forward = B.estimate(small(ring_dtp=True, ring_dtp_chunk_tokens=64, ring_dtp_grad_in_forward=True))
    f_work = (
        4 * 64 * s * 4  # P = 4 kept strips of 64 tokens × 256 vocab rows
        + 64 * s * 4  # one temporary strip
        + s * H * 4  # unit dW, fp32
        + 8 * N * 4  # per-token vectors
        + 4 * 64 * (H * 2 + 8)  # kept bf16 hidden rows and labels of the visiting chunks
        + 3 * 64 * H * 4 + 3 * 64 * 2 * 4 + 9 * 64 * 4  # dX, pack and state hops
        + s * H * 4 + 64 * H * 4  # fp32 products of the 16-bit GEMMs
    )
    # (the unit dX and dW in bf16 are the returned gradients: dX N·H, dW this rank's s·H rows)
    assert in_forward.terms["vocab_projection"] == f_work + (N + s) * H * 2 + N * 32
    # the output layer's parameters become this rank's shard, ceil(V/P)·H, replicated W = 4/4 = 1
    assert ring.details["params_ring_output"] == s * H
    assert ring.details["params_dense"] == DENSE - V_PAD * H
    assert ring.terms["model_state"] == math.ceil(
        (DENSE - V_PAD * H) * (6 + 12 / 4) + EXPERTS * (6 + 12 / 2) + s * H * 18
    )


def test_ring_dtp_counts_the_returned_gradients():
    """One rank writes dX in bf16 (the returned gradient) beside its working set; on a ring the
    fp32 dX and dW are live beside their bf16 copies at the backward's end, which with short
    strips is more than the strips' working set."""
    from megatron.bounded.loss.ring_dtp import ring_dtp_workspace_bytes

    one_rank = dict(world_size=1, data_parallel_size=1, expert_model_parallel_size=1, ring_dtp=True,
                    ring_dtp_chunk_tokens=16)
    work = ring_dtp_workspace_bytes(N, H, V_PAD, 1, chunk_tokens=16, input_bytes=2,
                                    cuda_kernels=True)
    assert (B.estimate(small(**one_rank)).terms["vocab_projection"]
            == work + (N + V_PAD) * H * 2 + N * 32)
    n = 16 * N  # many tokens per rank: dX outweighs the travelling shards
    ring = dict(ring_dtp=True, ring_dtp_chunk_tokens=4, ring_dtp_mode="weights", seq_length=n,
                max_position_embeddings=n)
    s = V_PAD // 4
    work = ring_dtp_workspace_bytes(n, H, V_PAD, 4, "weights", chunk_tokens=4, input_bytes=2,
                                    cuda_kernels=True)
    end = (n + s) * H * (4 + 2) + 8 * n * 4
    assert end > work
    assert B.estimate(small(**ring)).terms["vocab_projection"] == end + n * 32


def test_vocabulary_projection_matches_paper():
    # at N = 16,384, V = 200,000 upstream's output layer holds the bf16 logits and their fp32
    # copy, 6·N·V = 18.31 GiB (the paper's standard increment, 36.62 GiB, is three fp32 tensors)
    args = small(seq_length=16_384, max_position_embeddings=16_384, vocab_size=200_000,
                 make_vocab_size_divisible_by=64, hidden_size=7168)
    std = B.estimate(args).terms["vocab_projection"] - 16_384 * 32
    assert std == 6 * 16_384 * 200_000
    assert std / GiB == pytest.approx(36.62 / 2, abs=0.01)
    # Ring-DTP at P = 8: four strips of N × V/P fp32 = 6.10 GiB (measured 6.15 GiB)
    ring = B.estimate(small(seq_length=16_384, max_position_embeddings=16_384, hidden_size=7168,
                            vocab_size=200_000, make_vocab_size_divisible_by=64, ring_dtp=True,
                            ring_dtp_group_size=8))
    strips = 4 * 16_384 * 25_000 * 4
    assert strips / GiB == pytest.approx(6.10, abs=0.01)
    # the bound (strips + accumulators + travelling batch) is not below the measured peak
    assert ring.terms["vocab_projection"] / GiB >= 7.322


def test_context_and_total_and_feasibility():
    b = B.estimate(small())
    assert b.terms["cuda_context_fragmentation"] == (
        B.CUDA_CONTEXT_BYTES + int(B.FRAGMENTATION_FRACTION * b.peak_allocated)
    )
    assert b.total == b.peak_allocated + b.terms["cuda_context_fragmentation"]
    assert list(b.terms) == list(B.TERM_LABELS)
    # the default HBM is one H200 as torch reports it
    assert B.H200_HBM_BYTES == 150_109_880_320
    assert B.estimate(small(hbm_gb=None)).hbm_bytes == B.H200_HBM_BYTES
    fits = B.estimate(small(hbm_gb=(b.total + 1000) / GB))
    short = B.estimate(small(hbm_gb=(b.total - 1000) / GB))
    assert fits.feasible and not short.feasible
    assert fits.total == short.total == b.total
    assert f"peak allocated  {b.peak_allocated / GiB:.2f} GiB" in B.render(b)


def test_operator_flips_feasibility_and_fixes_name_it():
    # a vocabulary of 512K at 4,096 tokens: the materialized logits (11.7 GiB) dominate a 12 GB GPU
    args = small(vocab_size=512_000, seq_length=4096, max_position_embeddings=4096, hbm_gb=12.0)
    without = B.estimate(args)
    assert not without.feasible and without.dominant == "vocab_projection"
    assert any(fix.startswith("--ring-dtp") for fix in B.fixes(without))
    with_ring = B.estimate(small(vocab_size=512_000, seq_length=4096, max_position_embeddings=4096,
                                 hbm_gb=12.0, ring_dtp=True, ring_dtp_chunk_tokens=1024))
    assert with_ring.feasible and B.fixes(with_ring) == []
    text = B.render(without)
    assert "DOES NOT FIT" in text and "--ring-dtp" in text and "vocabulary projection" in text
    assert "FITS" in B.render(with_ring)


def test_refusal_names_the_routing_skew_it_assumed():
    """The standard dispatch's rows are sized at the assumed skew; a refusal says what a balanced
    router would need, and only for that dispatch (the bounded ones do not use the skew)."""
    def skew_fixes(budget):
        return [fix for fix in B.fixes(budget) if fix.startswith("--budget-routing-skew")]

    long_seq = dict(seq_length=65536, max_position_embeddings=65536)
    balanced = B.estimate(small(**long_seq, budget_routing_skew=B.BALANCED_ROUTING_SKEW))
    # an HBM between the two estimates: the assumed skew decides
    hbm_gb = (balanced.total + 1000) / GB
    skewed = B.estimate(small(**long_seq, hbm_gb=hbm_gb))
    assert not skewed.feasible and balanced.total < skewed.total
    (fix,) = skew_fixes(skewed)
    assert "2× its even share" in fix and "which fits" in fix and "not a bound" in fix
    # no suggestion once the skew is already balanced, or for a bounded dispatch
    assert skew_fixes(B.estimate(small(**long_seq, hbm_gb=0.001,
                                       budget_routing_skew=B.BALANCED_ROUTING_SKEW))) == []
    assert skew_fixes(B.estimate(small(**long_seq, hbm_gb=0.001,
                                       moe_expert_rank_capacity_factor=1.5))) == []


def test_pipeline_stages_keep_micro_batches_in_flight():
    # PP = 2 (world 4 = PP 2 × DP 2): stage 0 holds 2 micro-batches of its 2 layers' boundaries
    # and the embedding; stage 1 one micro-batch, the output layer and the logits
    args = small(pipeline_model_parallel_size=2, data_parallel_size=2)
    first, last = B.stage_budgets(args)
    assert first.details["inflight"] == 2 and last.details["inflight"] == 1
    assert first.terms["checkpoint_boundaries"] == 2 * 2 * NHB + N * 16 * 4
    assert last.terms["checkpoint_boundaries"] == 2 * NHB + N * 16 * 4
    assert first.terms["vocab_projection"] == 0
    assert last.terms["vocab_projection"] == 6 * N * V_PAD + N * 32
    counts0, counts1 = B.parameter_counts(args, 0), B.parameter_counts(args, 1)
    assert counts0["embedding"] == V_PAD * H and counts0["output_layer"] == 0
    assert counts1["embedding"] == 0 and counts1["output_layer"] == V_PAD * H
    assert counts0["expert"] == counts1["expert"] == 2 * 4 * EXPERT
    # expert-DP = world / (EP × PP) = 1: expert state is not divided
    assert B.estimate(args).total == max(first.total, last.total)
    assert first.details["edp"] == 1


def test_runs_without_distributed_or_cuda(monkeypatch):
    import torch

    B.estimate(small())
    _, _, plan = planned(monkeypatch, SMALL_ARGV, 4)
    assert plan.feasible
    assert not torch.distributed.is_initialized()
    assert not torch.cuda.is_initialized()


def test_max_seq_length_is_the_boundary():
    args = small(hbm_gb=3.3)
    longest = B.max_seq_length(args, granularity=256)
    assert longest > 0
    cfg = B.BudgetConfig.from_args(args)
    assert B.estimate_config(cfg.replace(seq_length=longest)).feasible
    assert not B.estimate_config(cfg.replace(seq_length=longest + 256)).feasible


# a vocabulary of 512K at 4,096 tokens: the logits (11.7 GiB) do not fit a 14 GB GPU
LARGE_VOCABULARY = ["--vocab-size", "512000", "--seq-length", "4096",
                    "--max-position-embeddings", "4096", "--hbm-gb", "14"]


def test_plan_picks_the_cheapest_sufficient_operator(monkeypatch):
    # the logits do not fit; Ring-DTP (not the streamed optimizer, not SCO) is what is needed
    argv = SMALL_ARGV + LARGE_VOCABULARY
    args, settings, plan = planned(monkeypatch, argv, 4)
    as_given = B.estimate(args, settings)
    assert not as_given.feasible and as_given.dominant == "vocab_projection"
    assert plan.feasible and plan.budget.feasible
    assert operators_on(plan) == {"ring_dtp"}
    assert "--ring-dtp" in plan.command_line()
    # the plan fits the planning share of the GPU
    assert plan.budget.hbm_bytes == int(14 * PLANNER.PLAN_HBM_FRACTION * GB)
    # the planned command line reproduces the planned budget, and fits the GPU
    run_args, run_settings = parsed(monkeypatch, argv + plan.command_line(), 4)
    run = B.estimate(run_args, run_settings)
    assert run.total == plan.budget.total and run.feasible
    assert not args.ring_dtp  # the parsed flags are not written
    # no operator when the flags as given fit
    _, _, fits = planned(monkeypatch, SMALL_ARGV + ["--hbm-gb", "100"], 4)
    assert fits.feasible and operators_on(fits) == set()


def test_plan_offloads_just_enough_boundaries(monkeypatch):
    # 48 dense layers of H=1024 at 64K tokens: boundaries of 128 MiB; an HBM whose planning share
    # is half a boundary short of the fastest plan, and SCO saves boundaries only from the third
    # offloaded one on ((B-k)+2). Tied embeddings (which Ring-DTP refuses), a dense model (no
    # dispatch or chunked recompute to choose) and a given micro-batch and recompute leave the
    # streamed optimizer, slower than SCO here, as the only other knob.
    argv = [
        "--num-layers", "48", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
        "--num-attention-heads", "16", "--seq-length", "65536",
        "--max-position-embeddings", "65536", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--vocab-size", "1000",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--bf16",
        "--use-distributed-optimizer", *FULL_RECOMPUTE, "--train-iters", "3", "--eval-iters", "0",
        "--lr", "1e-4", "--transformer-impl", "local", "--hidden-dropout", "0",
        "--attention-dropout", "0",
    ]
    per = 65_536 * 1024 * 2
    _, _, fastest = planned(monkeypatch, argv, 1)  # on one H200: fits without SCO
    assert fastest.feasible and "sco_host_budget_gb" not in fastest.flags
    hbm_gb = (fastest.budget.total - per // 2) / PLANNER.PLAN_HBM_FRACTION / GB
    args, _, plan = planned(monkeypatch, argv + ["--hbm-gb", repr(hbm_gb)], 1)
    assert plan.feasible
    # the same plan, with the fewest boundaries offloaded that make it fit
    assert {k: v for k, v in plan.flags.items() if k != "sco_host_budget_gb"} == fastest.flags
    host = int(plan.flags["sco_host_budget_gb"] * GiB)  # as pretrain_gpt.py converts it
    assert host // per == 3 and plan.flags["sco_host_budget_gb"] == 0.375
    assert fastest.budget.total - plan.budget.total == pytest.approx(
        per * (1 + B.FRAGMENTATION_FRACTION), rel=1e-6)
    # the planned command line has the planned budget
    run_args, run_settings = parsed(monkeypatch, argv + ["--hbm-gb", repr(hbm_gb)]
                                    + plan.command_line(), 1)
    assert B.estimate(run_args, run_settings).total == plan.budget.total


def test_phases_without_recompute():
    """Without full recompute the saved activations are live from the forward to the backward;
    the output layer and its loss beside them at the loss, the dispatch buffers and the backward
    transient in the layers' backward, and neither in the optimizer step: the peak is the
    largest of the three."""
    throughout = ("model_state", "optimizer_staging", "checkpoint_boundaries",
                  "layer_activations", "paged_stash", "kept_attention")
    for seq in (N, 8):  # activations dominate at N; the step at 8 tokens
        b = B.estimate(small(recompute_granularity=None, seq_length=seq,
                             max_position_embeddings=seq))
        step = 4 * b.details["state_params"]
        assert b.terms["optimizer_step"] == step
        live = sum(b.terms[k] for k in throughout)
        phases = {"loss": live + b.terms["vocab_projection"],
                  "backward": live + b.terms["moe_dispatch"] + b.terms["recompute_working_set"],
                  "step": b.terms["model_state"] + step}
        assert b.details["phases"] == phases
        peak_phase = max(phases, key=phases.get)
        assert b.details["peak_phase"] == peak_phase
        assert b.peak_allocated == phases[peak_phase]
        assert ("the peak" in b.notes["optimizer_step"]) == (peak_phase == "step")
        assert b.dominant in b.details["peak_terms"]
        assert ("vocab_projection" in b.details["peak_terms"]) == (peak_phase == "loss")
    assert peak_phase == "step"  # 8 tokens
    assert B.estimate(small(recompute_granularity=None)).details["peak_phase"] == "loss"


# (1, 2048): the functional budget test's baseline, whose peak is the optimizer step's
@pytest.mark.parametrize("gpus, seq, measured_gib", [(2, 2048, 9.29), (1, 4096, 18.35),
                                                     (1, 2048, 18.35)])
def test_small_example_against_measured_peaks(gpus, seq, measured_gib):
    """torch.cuda.max_memory_allocated of examples/moe_small/train.sh on H200 without recompute
    (docs/operators/memory_budget.md). The budget without its fixed CUDA
    context / fragmentation allowance (which max_memory_allocated does not see) must not be below
    the measured peak by more than 5%, and not more than 10% above it."""
    args = argparse.Namespace(
        num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
        group_query_attention=True, num_query_groups=4, seq_length=seq,
        max_position_embeddings=seq, position_embedding_type="rope", normalization="RMSNorm",
        swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
        num_experts=32, moe_router_topk=4, moe_ffn_hidden_size=1024,
        expert_model_parallel_size=gpus, micro_batch_size=1, bf16=True,
        use_distributed_optimizer=True, vocab_size=32_000, world_size=gpus,
    )
    b = B.estimate(args)
    allocated = (b.total - b.terms["cuda_context_fragmentation"]) / GiB
    print(f"{gpus} GPU(s), seq {seq}: budget {allocated:.2f} GiB vs measured {measured_gib} GiB")
    assert 0.95 * measured_gib <= allocated <= 1.10 * measured_gib


def test_launch_check_modes_and_the_planned_flags(capsys, monkeypatch):
    args = small(vocab_size=512_000, seq_length=4096, max_position_embeddings=4096)

    def mode(check):
        return types.SimpleNamespace(
            budget=B.BudgetSettings(memory_budget_check=check, hbm_gb=12.0))

    with pytest.raises(B.MemoryBudgetError, match="--ring-dtp"):
        B.launch_check(args, mode("error"))
    assert not B.launch_check(args, mode("warn")).feasible
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert not B.launch_check(args, mode("off")).feasible
    assert capsys.readouterr().out == ""
    # the default mode is error; the planned command line passes it
    argv = SMALL_ARGV + LARGE_VOCABULARY
    parsed_args, parsed_settings, plan = planned(monkeypatch, argv, 4)
    assert parsed_settings.budget.memory_budget_check == "error"
    with pytest.raises(B.MemoryBudgetError, match="--ring-dtp"):
        B.launch_check(parsed_args, parsed_settings)
    assert B.launch_check(*parsed(monkeypatch, argv + plan.command_line(), 4)).feasible


# ------------------------------------------------------------------------------------------
# The paper's models
# ------------------------------------------------------------------------------------------

PAPER_MODELS = {"120B": (7, 16), "241B": (14, 32), "667B": (39, 64)}
SEQ_128K, SEQ_1M = 131_072, 1_048_576
# PipelinedLLEP chunks of examples/moe_*/train.sh (the 667B script uses 20, see there)
PAPER_CHUNKS = {"120B": 10, "241B": 10, "667B": 20}


def paper(model: str, seq: int, operators: bool = False, **overrides) -> argparse.Namespace:
    """The flags of examples/common/paper_moe.sh: every sequence split over all W GPUs
    (CP = EP = W, DP = 1), bf16 gradients, full recompute; with ``operators`` its OPERATORS=all
    (streamed optimizer 2 × 1e8, SCO with 16 GiB of pinned host memory per GPU, Ring-DTP with
    8,192-token chunks, PipelinedLLEP in the script's number of chunks)."""
    layers, world = PAPER_MODELS[model]
    args = argparse.Namespace(
        num_layers=layers, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=64,
        group_query_attention=True, num_query_groups=8, kv_channels=128,
        seq_length=seq, max_position_embeddings=seq, position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, num_experts=384, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_layer_freq=1,
        expert_model_parallel_size=world, micro_batch_size=1, bf16=True, grad_reduce_in_bf16=True,
        use_distributed_optimizer=True, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1, vocab_size=200_000,
        make_vocab_size_divisible_by=128, world_size=world, data_parallel_size=1,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=world,
    )
    if operators:
        chunks = PAPER_CHUNKS[model]
        operator_flags = dict(
            offload_stream_optimizer=True, sco_host_budget_gb=16.0, ring_dtp=True,
            ring_dtp_chunk_tokens=8192, pipelined_llep=True, pipelined_llep_max_chunks=chunks,
            pipelined_llep_token_budget=ceil_div(seq, world * chunks),
        )
        for key, value in operator_flags.items():
            setattr(args, key, value)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def example_flags(script: str, env: dict, extra=()) -> list:
    """The pretrain_gpt.py flags ``script`` launches with (the planner on unless PLAN=off), ``extra`` after them."""
    from tests.unit.launch.test_examples import recorded_flags

    flags = recorded_flags(script, env, extra)
    at = flags.index("--metrics-jsonl")  # the extra flag recorded_flags passes
    return flags[:at] + flags[at + 2:]


def test_paper_model_parameter_counts():
    # 384 experts × 3·7168·2048 per MoE layer; 667B: 39 layers × 16.9B = 659.5B routed
    total_experts = 384 * 3 * 7168 * 2048
    for model, (layers, world) in PAPER_MODELS.items():
        counts = B.parameter_counts(paper(model, SEQ_128K))
        assert counts["expert"] == layers * total_experts // world
    c667 = B.parameter_counts(paper("667B", SEQ_128K))
    total = c667["expert"] * 64 + c667["dense"]
    assert 660e9 < total < 680e9


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_paper_models_verdicts(model):
    """The paper's reach claim as a dry run of the example scripts' layout: with the four
    operators the model trains at 128K and at 1M context; without them it fits at no length (the
    model state alone takes over 90% of one H200). Pinned because docs/operators/memory_budget.md
    quotes it.
    """
    layers, world = PAPER_MODELS[model]
    table = {}
    for seq in (SEQ_128K, SEQ_1M):
        for ops in (False, True):
            b = B.estimate(paper(model, seq, ops))
            table[(seq, ops)] = b
            print(f"{model} seq {seq:>9,} operators {'all ' if ops else 'none'}: "
                  f"{b.total / GiB:8.1f} GiB {'fits' if b.feasible else 'DOES NOT FIT'} "
                  f"(dominant: {b.dominant})")
    for seq in (SEQ_128K, SEQ_1M):
        none = table[(seq, False)]
        assert not none.feasible and none.terms["model_state"] > 0.9 * none.hbm_bytes
        assert "--offload-stream-optimizer" in " ".join(B.fixes(none))
        assert table[(seq, True)].feasible
    assert B.max_seq_length(paper(model, SEQ_128K)) == 0  # without operators: at no length
    # ... and each operator bounds its term
    all_1m, none_1m = table[(SEQ_1M, True)], table[(SEQ_1M, False)]
    tokens = SEQ_1M // world
    assert all_1m.details["tokens"] == tokens
    assert all_1m.terms["vocab_projection"] < none_1m.terms["vocab_projection"] / 10
    per = tokens * 7168 * 2  # one boundary N·H·b; 16 GiB of pinned host memory holds them all
    assert 16 * GiB // per >= layers
    assert all_1m.terms["checkpoint_boundaries"] == 2 * per + tokens * 128 * 4  # + rotary table
    c = ceil_div(tokens, PAPER_CHUNKS[model])
    # two chunks' send (k·c) and receive (E_p·k·c) rows
    assert all_1m.terms["moe_dispatch"] == 2 * (8 * c + world * 8 * c) * 7168 * 2
    print(B.render(all_1m))


def test_667b_twenty_chunks_hold_less_than_ten_at_1m(monkeypatch):
    """PipelinedLLEP's live set grows with E_p = 64 and the chunk size: the script's 20 chunks
    hold less than the default 10; both fit one H200 at 1M, and the planner finds a plan for the
    example's flags without the operators given."""
    ten_chunks = B.estimate(paper("667B", SEQ_1M, True, pipelined_llep_max_chunks=10,
                                  pipelined_llep_token_budget=ceil_div(SEQ_1M, 64 * 10)))
    twenty = B.estimate(paper("667B", SEQ_1M, True))
    assert twenty.terms["moe_dispatch"] < ten_chunks.terms["moe_dispatch"]
    assert twenty.peak_allocated < ten_chunks.peak_allocated
    assert twenty.feasible and ten_chunks.feasible
    flags = example_flags("examples/moe_667b/train.sh", {"SEQ_LENGTH": str(SEQ_1M)}, FULL_RECOMPUTE)
    args, settings, plan = planned(monkeypatch, flags, 64)
    assert not B.estimate(args, settings).feasible and plan.feasible


def test_plan_on_a_paper_model(monkeypatch):
    # 120B with the sequence split over the 16 ranks at 128K (the paper's layout, full
    # recompute): infeasible as launched, the streamed optimizer is the one operator planned
    flags = example_flags("examples/moe_120b/train.sh", {}, FULL_RECOMPUTE)
    args, settings, plan = planned(monkeypatch, flags, 16)
    assert not B.estimate(args, settings).feasible
    assert B.estimate(args, settings).terms == B.estimate(paper("120B", SEQ_128K)).terms
    assert plan.feasible and operators_on(plan) == {"offload_stream_optimizer"}
    # its step moves 12 B of optimizer state per local element each way over the host link
    assert plan.cost.terms["optimizer"] == pytest.approx(
        12 * plan.budget.details["state_params"] / C.HOST_LINK_EACH_WAY_DUPLEX_BYTES_PER_S)


# ------------------------------------------------------------------------------------------
# The command-line tool
# ------------------------------------------------------------------------------------------


def _run_tool(*argv, env=None):
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "memory_budget.py"), *argv],
        capture_output=True, text=True, env=dict(os.environ, **(env or {})), timeout=120,
    )


def test_cli_on_the_120b_example_flags(tmp_path):
    # PLAN=off: the flags as given, the paper's layout with full recompute and no operator (the
    # hand-built plan below)
    flags = example_flags("examples/moe_120b/train.sh", {"PLAN": "off"}, FULL_RECOMPUTE)
    assert "--bounded-plan" in flags
    out = tmp_path / "budget.json"
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # launch.sh's, upstream needs it
    proc = _run_tool("--world-size", "16", "--json", str(out), "--no-formulas", *flags, env=env)
    # --memory-budget-check error (the default): refused as pretrain_gpt.py refuses it
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "refuses this plan" in proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "dominant term" in proc.stdout
    record = json.loads(out.read_text())
    # the real parser's namespace gives the same terms as the hand-built one
    expected = B.estimate(paper("120B", SEQ_128K))
    assert record["budget"]["terms"] == expected.terms
    assert record["budget"]["feasible"] is False
    assert record["plan"] is None  # --bounded-plan off: no plan line
    # warn: pretrain_gpt.py would launch it; the tool says it does not fit
    warned = _run_tool("--world-size", "16", "--no-formulas", *flags,
                       "--memory-budget-check", "warn", env=env)
    assert warned.returncode == 3, warned.stderr[-3000:]
    assert "DOES NOT FIT" in warned.stdout


def test_cli_plans_with_every_operator_flag(tmp_path):
    flags = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "3",
        "--eval-iters", "0", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--bf16", "--use-distributed-optimizer",
        "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
        "--disable-bias-linear", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
        "--offload-stream-optimizer", "--offload-stream-slots", "3", "--ring-dtp",
        "--untie-embeddings-and-output-weights", "--ring-dtp-chunk-tokens", "64", "--sco-host-budget-gb", "1", "--pipelined-llep",
        "--pipelined-llep-token-budget", "32", "--hbm-gb", "80",
    ]
    out = tmp_path / "b.json"
    proc = _run_tool("--json", str(out), *flags, env={"WORLD_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FITS" in proc.stdout
    record = json.loads(out.read_text())
    assert record["budget"]["hbm_bytes"] == 80 * GB
    assert record["budget"]["terms"]["optimizer_staging"] > 0
    assert record["budget"]["details"]["operators"].count("(") >= 4
    bad = _run_tool("--num-layers", "2", "--no-such-flag", env={"WORLD_SIZE": "1"})
    assert bad.returncode == 2


def test_streamed_optimizer_staging_is_live_after_the_first_step():
    """With full recompute the phases do not overlap, but OffloadStreamAdamW keeps its staging
    from the first step on: every later iteration's phases hold it. The first iteration's
    peak (what a one-iteration job measures) is kept apart."""
    b = B.estimate(small(offload_stream_optimizer=True, recompute_granularity="full",
                         recompute_method="uniform", recompute_num_layers=1))
    staging = b.terms["optimizer_staging"]
    assert staging > 0 and b.details["peak_phase"] != "step"
    assert b.peak_allocated == b.details["first_iteration_peak"] + staging
    assert b.peak_allocated == b.details["phases"][b.details["peak_phase"]]
    assert "optimizer_staging" in b.details["peak_terms"]
    assert "kept from the first step on" in b.notes["optimizer_staging"]
    plain = B.estimate(small(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1))
    assert plain.details["first_iteration_peak"] == plain.peak_allocated
