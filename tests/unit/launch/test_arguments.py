"""Flag parsing and validation: TE-free defaults and every check of megatron.bounded.launch.arguments.

Arguments are parsed with upstream's parser plus our extra_args_provider, without initializing
anything: these checks must fail at argument time, before any GPU allocation.
"""

from __future__ import annotations

import sys

import pytest

from megatron.bounded.launch import arguments
from megatron.bounded.launch.arguments import BoundedArgumentError, add_bounded_args, validate_bounded_args
from tests.conftest import MINIMAL_PRETRAIN_FLAGS
from megatron.bounded.units import GB, GiB

BASE_FLAGS = list(MINIMAL_PRETRAIN_FLAGS)


def parse(monkeypatch, *flags):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE_FLAGS, *flags])
    return parse_args(add_bounded_args)


@pytest.fixture
def without_te(monkeypatch):
    monkeypatch.setattr(arguments, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(arguments, "apex_available", lambda: False)


def test_defaults_without_transformer_engine_are_te_free(monkeypatch, without_te):
    args = parse(monkeypatch)
    for name, value in arguments.TE_FREE_DEFAULTS.items():
        assert getattr(args, name) == value, name
    assert args.enable_one_logger is False
    assert args.create_attention_mask_in_dataloader is False
    validate_bounded_args(args)


def test_defaults_with_transformer_engine_stay_upstream(monkeypatch):
    monkeypatch.setattr(arguments, "transformer_engine_available", lambda: True)
    args = parse(monkeypatch)
    assert args.transformer_impl == "transformer_engine"


def test_explicit_transformer_engine_without_te_runs_local_and_says_so(monkeypatch, without_te):
    args = parse(monkeypatch, "--transformer-impl", "transformer_engine", "--use-transformer-engine-op-fuser")
    validate_bounded_args(args)
    assert args.transformer_impl == "local" and args.use_transformer_engine_op_fuser is False
    assert any(note.startswith("--transformer-impl transformer_engine -> local")
               for note in args.bounded_substitutions)
    assert any(note.startswith("--use-transformer-engine-op-fuser -> local linears")
               for note in args.bounded_substitutions)


def test_fused_moe_and_fp8_choices_without_te_run_unfused_and_say_so(monkeypatch, without_te):
    """Qwen3/GLM/DeepSeek scripts pass --moe-permute-fusion and --moe-router-fusion, some
    --fp8-format: without Transformer Engine the config builds (upstream raises there for the
    permutation fusion, at the first forward for the router's) and the start-up line names
    each replacement."""
    from megatron.bounded.launch.run_summary import describe
    from megatron.bounded.model.config import BoundedTransformerConfig

    args = parse(monkeypatch, "--num-experts", "4", "--moe-router-topk", "2",
                 "--moe-permute-fusion", "--moe-router-fusion", "--fp8-format", "hybrid", "--bf16",
                 "--fp8-param-gather", "--use-distributed-optimizer")
    from megatron.training.arguments import validate_args

    validate_args(args, {})
    settings = validate_bounded_args(args)
    assert (args.moe_permute_fusion, args.moe_router_fusion, args.fp8) == (False, False, None)
    assert args.fp8_param_gather is False
    config = settings.transformer_config(args)
    assert type(config) is BoundedTransformerConfig
    assert not config.moe_permute_fusion and not config.moe_router_fusion and config.fp8 is None
    line = describe(settings.view_of(args))
    for flag in ("--moe-permute-fusion", "--moe-router-fusion", "--fp8-format", "--fp8-param-gather"):
        assert f"{flag} -> " in line and "Transformer Engine is not installed" in line, flag


@pytest.mark.parametrize("given", [["--cross-entropy-fusion-impl", "te"],
                                   ["--cross-entropy-fusion-impl=te"]])
def test_te_cross_entropy_fusion_runs_upstreams_native_one_and_says_so(monkeypatch, given):
    """megatron-core 0.19.2's validation refuses --cross-entropy-fusion-impl te on every stack
    (Qwen3-235B's script passes it): it is replaced by native before upstream parses, on the
    start-up line too, and tools/memory_budget.py plans the same flags."""
    from megatron.training.arguments import validate_args

    from megatron.bounded.launch.run_summary import describe

    flags = ["--cross-entropy-loss-fusion", *given]
    with pytest.raises(AssertionError, match="--cross-entropy-fusion-impl native"):
        validate_args(parse(monkeypatch, *flags), {})  # what upstream does with them
    replaced_flags, notes = arguments.replace_refused_flags(flags)
    args = parse(monkeypatch, *replaced_flags)
    validate_args(args, {})
    for note in notes:
        arguments.note_substitution(args, note)
    settings = validate_bounded_args(args)
    assert args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "native"
    assert "--cross-entropy-fusion-impl te -> native" in describe(settings.view_of(args))
    from megatron.bounded.activations import host_memory
    from megatron.bounded.launch.commands import memory_budget

    try:
        assert memory_budget.main(["--world-size", "1", *BASE_FLAGS, *flags]) in (0, 3)
    finally:
        # the tool plans pinned memory for --budget-host-gb (default 250 GB), process-wide:
        # the later tests check against this host's RAM again
        host_memory.plan_for_host(None)


def test_transformer_engine_is_kept_when_installed(monkeypatch):
    monkeypatch.setattr(arguments, "transformer_engine_available", lambda: True)
    args = parse(monkeypatch, "--transformer-impl", "transformer_engine")
    args.use_transformer_engine_op_fuser = True
    arguments._check_transformer_engine(args)
    assert args.transformer_impl == "transformer_engine" and args.use_transformer_engine_op_fuser
    assert getattr(args, "bounded_substitutions", None) is None


@pytest.mark.parametrize(
    "field,fix",
    [
        ("apply_rope_fusion", "--no-rope-fusion"),
        ("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion"),
        ("masked_softmax_fusion", "--no-masked-softmax-fusion"),
    ],
)
def test_fusions_needing_te_or_apex_are_refused(monkeypatch, without_te, field, fix):
    args = parse(monkeypatch)
    setattr(args, field, True)  # e.g. a config file or wrapper turned it back on
    with pytest.raises(BoundedArgumentError, match=fix):
        validate_bounded_args(args)


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--window-size", "64,2"], "--window-size"),
        (["--context-parallel-size", "2"], "--context-parallel-size"),
    ],
)
def test_attention_features_sdpa_lacks_are_refused_with_flag_names(monkeypatch, without_te, flags, named):
    args = parse(monkeypatch, *flags)
    with pytest.raises(BoundedArgumentError, match=named):
        validate_bounded_args(args)


def test_gpt_oss_attention_is_accepted(monkeypatch, without_te):
    """Windows on every other layer with learnable sinks run on the local implementation."""
    args = parse(monkeypatch, "--window-size", "128,0", "--window-attn-skip-freq", "2",
                 "--softmax-type", "learnable", "--attention-dropout", "0")
    validate_bounded_args(args)
    assert args.window_size == (128, 0) and args.softmax_type == "learnable"


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_multi_latent_attention_builds_our_mla_config(monkeypatch, without_te, q_lora_rank):
    """Upstream's builder would swap our class for its MLATransformerConfig: the config is ours,
    with MLA's flags, YaRN's and this project's settings."""
    from megatron.training.arguments import validate_args

    from megatron.bounded.model.config import BoundedMLATransformerConfig

    rank = [] if q_lora_rank is None else ["--q-lora-rank", str(q_lora_rank)]
    args = parse(monkeypatch, "--multi-latent-attention", *rank, "--kv-lora-rank", "16",
                 "--qk-head-dim", "12", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10",
                 "--rope-type", "yarn", "--rotary-scaling-factor", "40", "--mscale", "0.707",
                 "--mscale-all-dim", "0.707", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1",
                 "--chunked-recompute-tokens", "64")
    validate_args(args, {})
    config = validate_bounded_args(args).transformer_config(args)
    assert type(config) is BoundedMLATransformerConfig and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
            config.qk_pos_emb_head_dim, config.v_head_dim) == (q_lora_rank, 16, 12, 8, 10)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim) == ("yarn", 40, 0.707, 0.707)
    assert config.chunked_recompute_tokens == 64


def test_mla_up_proj_recompute_builds_our_mla_config(monkeypatch, without_te):
    """Upstream refuses mla_up_proj without multi-latent attention, which the config build
    hides from upstream's class choice: the module is hidden with it and checked once MLA is
    set again, so the combination builds."""
    from megatron.training import arguments as upstream

    from megatron.bounded.model.config import BoundedMLATransformerConfig
    from megatron.bounded.upstream import patches

    patches.apply_patches()  # --moe-grouped-gemm validates without a GPU

    args = parse(monkeypatch, "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank",
                 "16", "--qk-head-dim", "12", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10",
                 "--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm",
                 "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj",
                 "moe_act", "layernorm")
    upstream.validate_args(args, {})
    config = validate_bounded_args(args).transformer_config(args)
    assert type(config) is BoundedMLATransformerConfig and config.multi_latent_attention
    assert (config.recompute_granularity, config.recompute_modules) == (
        "selective", ["mla_up_proj", "moe_act", "layernorm"])
    assert args.recompute_modules == ["mla_up_proj", "moe_act", "layernorm"]  # left as parsed


def test_train_iters_without_eval_interval_gets_the_old_default(monkeypatch, without_te):
    args = parse(monkeypatch)
    args.eval_interval = None  # megatron-core 0.19.2's default
    validate_bounded_args(args)
    assert args.eval_interval == arguments.DEFAULT_EVAL_INTERVAL == 1000
    assert args.bounded_defaults == ["--eval-interval 1000 (not given; megatron-core 0.19.2 has no "
                                     "default, older Megatron-LM's was 1000)"]
    validate_bounded_args(args)  # validated again: noted once
    assert len(args.bounded_defaults) == 1
    given = parse(monkeypatch)  # BASE_FLAGS pass --eval-interval 3
    validate_bounded_args(given)
    assert given.eval_interval == 3 and getattr(given, "bounded_defaults", None) is None


@pytest.mark.parametrize("flags", [("--lr-warmup-iters", "3"), ("--lr-warmup-iters", "2", "--lr-decay-iters", "2")])
def test_warmup_not_shorter_than_the_decay_is_refused(monkeypatch, without_te, flags):
    args = parse(monkeypatch, *flags)
    with pytest.raises(BoundedArgumentError, match="--lr-warmup-iters.*--train-iters"):
        validate_bounded_args(args)


def test_empty_metrics_path_is_refused(monkeypatch, without_te):
    args = parse(monkeypatch, "--metrics-jsonl", " ")
    with pytest.raises(BoundedArgumentError, match="--metrics-jsonl"):
        validate_bounded_args(args)


def test_unknown_flag_fails_at_parse_time(monkeypatch, without_te, capsys):
    with pytest.raises(SystemExit):
        parse(monkeypatch, "--no-such-flag")
    assert "--no-such-flag" in capsys.readouterr().err


MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--moe-expert-rank-capacity-factor", "0"], "--moe-expert-rank-capacity-factor must be a positive"),
        (["--moe-expert-rank-capacity-factor", "-1.5"], "--moe-expert-rank-capacity-factor must be a positive"),
        (["--moe-paged-stash"], "--moe-paged-stash needs --moe-expert-rank-capacity-factor"),
        (
            ["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.5", "--moe-paged-stash-page-size", "0"],
            "--moe-paged-stash-page-size must be a positive",
        ),
        (
            ["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.5", "--cpu-offloading-num-layers", "1"],
            "--moe-paged-stash cannot be combined with --cpu-offloading-num-layers",
        ),
        (
            ["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.5",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
            "--moe-paged-stash cannot be combined with --recompute-granularity full",
        ),
        (
            ["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.5",
             "--recompute-granularity", "selective", "--recompute-modules", "moe"],
            "--recompute-modules moe",
        ),
        (
            ["--moe-expert-rank-capacity-factor", "1.5", "--bounded-moe-backend", "upstream"],
            "--bounded-moe-backend upstream with --moe-expert-rank-capacity-factor needs",
        ),
        (
            # upstream's MoE backend (no grouped GEMM, the default allgather dispatcher): its
            # overlap hooks live in the alltoall and flex dispatchers
            ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"],
            "--moe-shared-expert-overlap with upstream's MoE backend needs "
            "--moe-token-dispatcher-type alltoall or flex",
        ),
        (
            ["--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm"],
            "--moe-pad-expert-input-to-capacity pads each expert's input to its capacity, which "
            "--moe-expert-capacity-factor sets",
        ),
    ],
)
def test_capacity_factor_and_paged_stash_misuse_is_refused(monkeypatch, without_te, flags, message):
    from megatron.training.arguments import validate_args

    args = parse(monkeypatch, *MOE_FLAGS, *flags)
    if "--cpu-offloading-num-layers" in flags:
        validate_args(args, {})  # upstream derives args.cpu_offloading there
    with pytest.raises(BoundedArgumentError, match=message):
        validate_bounded_args(args)


def test_valid_paged_stash_plan_passes(monkeypatch, without_te):
    args = parse(monkeypatch, *MOE_FLAGS, "--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.5")
    validate_bounded_args(args)


def test_config_accepts_torch_native_capacity_and_paged_stash():
    from megatron.bounded.model.config import BoundedTransformerConfig

    config = BoundedTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
        moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True, transformer_impl="local",
        add_bias_linear=False,
    )
    # upstream alone rejects both without HybridEP; our config keeps them for our backend
    assert config.moe_expert_rank_capacity_factor == 1.5 and config.moe_paged_stash is True


def test_config_refuses_expert_tensor_parallelism_of_the_torch_native_backend():
    """The rule of the flags holds for a config built in code, in the same words."""
    from megatron.bounded.model.config import BoundedTransformerConfig

    with pytest.raises(BoundedArgumentError, match="--expert-tensor-parallel-size 1 only"):
        BoundedTransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
            moe_expert_rank_capacity_factor=1.5, transformer_impl="local", add_bias_linear=False,
            expert_tensor_parallel_size=2,
        )


def test_config_refuses_expert_biases_of_the_torch_native_backend_naming_the_flags():
    from megatron.bounded.model.config import BoundedTransformerConfig

    with pytest.raises(BoundedArgumentError, match="pass --disable-bias-linear, or "
                       "--bounded-moe-backend upstream"):
        BoundedTransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
            moe_expert_rank_capacity_factor=1.5, transformer_impl="local",
        )


def test_config_rejects_paged_stash_with_full_recompute():
    from megatron.bounded.model.config import BoundedTransformerConfig

    with pytest.raises(BoundedArgumentError, match="--moe-paged-stash cannot be combined with --recompute-granularity full"):
        BoundedTransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
            moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True, transformer_impl="local",
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        )


FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--sco-host-budget-gb", "-1"] + FULL_RECOMPUTE, "--sco-host-budget-gb must be >= 0"),
        (["--sco-host-budget-gb", "4"], "--recompute-granularity full"),
        (["--sco-host-budget-gb", "4", "--pipeline-model-parallel-size", "2"] + FULL_RECOMPUTE,
         "--pipeline-model-parallel-size"),
        (["--sco-host-budget-gb", "100000000"] + FULL_RECOMPUTE, "lower --sco-host-budget-gb"),
    ],
)
def test_sco_misuse_is_refused(monkeypatch, without_te, flags, message):
    args = parse(monkeypatch, *flags)
    with pytest.raises(BoundedArgumentError, match=message):
        validate_bounded_args(args)


def test_sco_budget_counts_every_process_on_the_host(monkeypatch, without_te):
    from megatron.bounded.activations import host_memory

    host_gib = host_memory.host_memory_bytes() / GiB
    args = parse(monkeypatch, "--sco-host-budget-gb", str(host_gib * 0.6), *FULL_RECOMPUTE)
    validate_bounded_args(args)  # one process fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(BoundedArgumentError, match="2 GPU process"):
        validate_bounded_args(args)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--hbm-gb", "0"], "--hbm-gb must be positive"),
        (["--budget-routing-skew", "0.5"], "--budget-routing-skew must be >= 1.0"),
        (["--budget-host-gb", "0"], "--budget-host-gb must be positive"),
        (["--bounded-plan", "auto", "--memory-budget-check", "off"],
         "pass --bounded-plan off with --memory-budget-check off"),
        (["--memory-budget-check", "off"], r"the planner \(--bounded-plan auto, the default\)"),
    ],
)
def test_budget_flag_misuse_is_refused(monkeypatch, without_te, flags, message):
    args = parse(monkeypatch, *flags)
    with pytest.raises(BoundedArgumentError, match=message):
        validate_bounded_args(args)


def test_budget_routing_skew_reaches_the_budget(monkeypatch, without_te):
    from megatron.bounded import budget

    assert budget.BudgetConfig.from_args(parse(monkeypatch)).routing_skew == budget.DEFAULT_ROUTING_SKEW
    args = parse(monkeypatch, "--budget-routing-skew", "1.25")
    validate_bounded_args(args)
    assert budget.BudgetConfig.from_args(args).routing_skew == 1.25


def test_the_budget_off_is_taken_with_the_planner_off(monkeypatch, without_te):
    args = parse(monkeypatch, "--bounded-plan", "off", "--memory-budget-check", "off")
    settings = validate_bounded_args(args)
    assert settings.budget.bounded_plan == "off" and settings.budget.memory_budget_check == "off"


@pytest.mark.parametrize("old_flag", ["--auto-bounds", "--bounded-fast-path"])
def test_flags_the_planner_replaced_are_removed_with_a_note_and_the_plan_is_made(
        monkeypatch, without_te, old_flag):
    """--auto-bounds and --bounded-fast-path of earlier releases are taken off the command line
    (upstream's parser does not know them) with a note on the start-up line; the planner
    (--bounded-plan auto, the default) chooses the knobs left open, operators included, and
    changes none of the flags given: this sequence fits 85% of 34 GB only with the optimizer
    state streamed from the host, on top of the full recompute given."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron.bounded import budget
    from megatron.bounded.activations import host_memory
    from megatron.bounded.budget import planner
    from megatron.bounded.launch.planning import given_attributes, plan_command_line
    from megatron.bounded.launch.run_summary import describe

    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 64 * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = [*BASE_FLAGS, "--num-layers", "4", "--hidden-size", "4096", "--num-attention-heads",
             "32", "--seq-length", "32768", "--max-position-embeddings", "32768",
             *FULL_RECOMPUTE, "--use-distributed-optimizer", "--hbm-gb", "34", old_flag]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    with pytest.raises(SystemExit):  # unknown to upstream's parser
        parse_args(add_bounded_args)
    argv, notes = arguments.replace_refused_flags(flags)
    assert argv == flags[:-1]
    assert notes == [arguments.REPLACED_BY_PLANNER[old_flag]]
    assert notes[0].startswith(f"{old_flag} -> nothing: the planner (--bounded-plan auto")
    planned, line = plan_command_line(argv, plan_off=False)
    added = planned[len(argv):]
    assert planned[:len(argv)] == argv  # only appends
    assert line.startswith("[bounded] plan: added ") and "that fits" in line
    assert "--offload-stream-optimizer" in added
    assert not given_attributes(added) & given_attributes(argv)  # the recompute given is kept
    args = parse(monkeypatch, *planned[len(BASE_FLAGS):])
    validate_args(args, {})
    for note in notes:
        arguments.note_substitution(args, note)
    settings = validate_bounded_args(args)
    assert notes[0] in describe(settings.view_of(args))
    assert args.recompute_granularity == "full" and args.recompute_num_layers == 1
    assert settings.offload_stream.enabled
    assert budget.estimate(args, settings).feasible
    # with the planner off nothing is added, and the flags as given need more than the 85% of
    # the GPU's memory the planner plans for
    off, line = plan_command_line(argv + ["--bounded-plan", "off"], plan_off=True)
    assert off == argv + ["--bounded-plan", "off"] and line is None
    args = parse(monkeypatch, *off[len(BASE_FLAGS):])
    validate_args(args, {})
    as_given = budget.estimate(args, validate_bounded_args(args))
    assert as_given.total > planner.PLAN_HBM_FRACTION * 34 * GB


LLEP = ["--num-experts", "4", "--moe-router-topk", "2", "--pipelined-llep"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (LLEP, "--pipelined-llep needs --pipelined-llep-token-budget"),
        (LLEP + ["--pipelined-llep-token-budget", "0"], "--pipelined-llep-token-budget C > 0"),
        (LLEP + ["--pipelined-llep-token-budget", "64", "--pipelined-llep-max-chunks", "0"],
         "--pipelined-llep-max-chunks must be >= 1"),
        (LLEP + ["--pipelined-llep-token-budget", "64", "--llep-imbalance-threshold", "0.5"],
         "must be >= 1.0"),
        (LLEP + ["--pipelined-llep-token-budget", "64", "--bounded-moe-backend", "upstream"],
         "cannot be combined with --bounded-moe-backend upstream"),
        (LLEP + ["--pipelined-llep-token-budget", "64", "--moe-expert-rank-capacity-factor", "1.5"],
         "cannot be combined with --moe-expert-rank-capacity-factor"),
        (["--pipelined-llep", "--pipelined-llep-token-budget", "64"], "needs an MoE model"),
        (["--pipelined-llep-token-budget", "64"], "has no effect without --pipelined-llep"),
    ],
)
def test_pipelined_llep_misuse_is_refused(monkeypatch, without_te, flags, message):
    args = parse(monkeypatch, *flags)
    with pytest.raises(BoundedArgumentError, match=message):
        validate_bounded_args(args)


def test_pipelined_llep_plan_passes_and_selects_torch_backend(monkeypatch, without_te):
    from megatron.bounded.moe.moe_layer import select_moe_backend

    args = parse(monkeypatch, *LLEP, "--pipelined-llep-token-budget", "64", "--llep-imbalance-threshold", "1.3")
    validate_bounded_args(args)
    assert select_moe_backend(args) == "torch"


OFFLOAD = ["--offload-stream-optimizer", "--use-distributed-optimizer"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--offload-stream-optimizer"], "add --use-distributed-optimizer"),
        (OFFLOAD + ["--optimizer", "sgd"], "use --optimizer adam"),
        (OFFLOAD + ["--offload-stream-bucket-numel", "0"], "--offload-stream-bucket-numel: Invalid bucket_numel: 0 .must be >= 16"),
        (OFFLOAD + ["--offload-stream-slots", "0"], "--offload-stream-slots: Invalid num_slots: 0"),
        (OFFLOAD + ["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction must be 1.0"),
        (OFFLOAD + ["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d"),
        (OFFLOAD + ["--optimizer-cuda-graph"], "--optimizer-cuda-graph is not supported"),
    ],
)
def test_offload_stream_optimizer_misuse_is_refused(monkeypatch, without_te, flags, message):
    args = parse(monkeypatch, *flags)
    with pytest.raises(BoundedArgumentError, match=message):
        validate_bounded_args(args)


def test_offload_stream_optimizer_selects_upstreams_host_optimizer_path(monkeypatch, without_te):
    from megatron.bounded.upstream import patches

    bound = []
    monkeypatch.setattr(patches, "use_offload_stream_optimizer", lambda *plan: bound.append(plan))
    args = parse(monkeypatch, *OFFLOAD, "--offload-stream-slots", "3")
    settings = validate_bounded_args(args)
    assert not args.optimizer_cpu_offload and not args.use_precision_aware_optimizer
    arguments.hand_over_optimizer(args, settings)
    assert args.optimizer_cpu_offload and args.use_precision_aware_optimizer
    assert bound == [(settings.offload_stream.offload_stream_bucket_numel, 3)]


MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2", "--swiglu")


def deterministic(args):
    # set after parsing: upstream's parse of --deterministic-mode flips torch's global
    # deterministic-algorithms switch for the whole test process
    args.deterministic_mode = True
    return args


def test_deterministic_mode_refuses_upstreams_compiled_weighted_swiglu(monkeypatch, without_te):
    args = deterministic(parse(monkeypatch, *MOE_FLAGS))
    with pytest.raises(BoundedArgumentError, match="--deterministic-mode.*--no-bias-swiglu-fusion"):
        validate_bounded_args(args)


@pytest.mark.parametrize("flags", [
    ("--no-bias-swiglu-fusion",),
    ("--moe-expert-rank-capacity-factor", "2.0"),  # our torch-native experts run eager
])
def test_deterministic_mode_accepts_history_independent_experts(monkeypatch, without_te, flags):
    validate_bounded_args(deterministic(parse(monkeypatch, *MOE_FLAGS, *flags)))


def test_modelopt_only_gpt_oss_flags_become_megatron_core_flags(monkeypatch):
    """--enable-gpt-oss and --export-force-local-attention (gpt-oss scripts; Megatron-LM has them
    only with NVIDIA ModelOpt installed, megatron-core's parser not at all): the first becomes
    GPT-OSS's YaRN RoPE, over the script's --position-embedding-type, the second nothing; both
    named on the start-up line."""
    from megatron.training.arguments import validate_args

    from megatron.bounded.launch.run_summary import describe

    given = ["--position-embedding-type", "rope", "--enable-gpt-oss", "--export-force-local-attention"]
    with pytest.raises(SystemExit):
        parse(monkeypatch, *given)  # what upstream's parser does with them
    flags, notes = arguments.replace_refused_flags(given)
    assert "--enable-gpt-oss" not in flags and "--export-force-local-attention" not in flags
    args = parse(monkeypatch, *flags)
    validate_args(args, {})
    for note in notes:
        arguments.note_substitution(args, note)
    settings = validate_bounded_args(args)
    assert args.position_embedding_type == "yarn"
    assert (args.rotary_scaling_factor, args.yarn_original_max_position_embeddings) == (32, 131072)
    assert (args.yarn_beta_fast, args.yarn_beta_slow, args.mscale, args.mscale_all_dim) == (32, 1, 1, 0)
    assert args.yarn_correction_range_round_to_int is False
    line = describe(settings.view_of(args))
    assert "--enable-gpt-oss -> " in line and "--export-force-local-attention -> " in line


def test_default_attention_dropout_with_windows_or_sinks_becomes_zero_and_is_named():
    """gpt-oss's scripts pass no --attention-dropout: megatron-core's default becomes 0 (the
    windowed and sink kernels run without dropout) with a start-up note; a value given stays
    (and is refused by the attention's check), and plain attention keeps the default."""
    from megatron.bounded.launch.arguments import WINDOW_DROPOUT_NOTE, replace_refused_flags

    for flags in (["--window-size", "127,0"], ["--softmax-type=learnable"]):
        argv, notes = replace_refused_flags(flags)
        assert argv[-2:] == ["--attention-dropout", "0"] and notes == [WINDOW_DROPOUT_NOTE]
    for flags in (["--window-size", "127,0", "--attention-dropout", "0.1"],
                  ["--softmax-type", "vanilla"], ["--num-layers", "2"]):
        assert replace_refused_flags(flags) == (flags, [])
