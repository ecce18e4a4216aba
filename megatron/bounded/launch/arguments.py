"""This project's flags on Megatron's command line, and their validation.

:func:`add_bounded_args` is the ``extra_args_provider`` that ``pretrain_gpt.py`` hands to
upstream's parser: it adds the fields of every settings dataclass in :data:`RUN_SETTINGS` as
flags (each operator declares its own, in its module) and adapts upstream *defaults* to the
installed stack (without Transformer Engine or Apex: the local implementation, the fusions that
need them off; flags the user passes always win).

:func:`validate_bounded_args` runs right after upstream's validation, before the model config is
built and before any GPU allocation, and returns the run's :class:`RunSettings`: every operator's
settings object, checked. Each refusal raises :class:`BoundedArgumentError`, naming the flags and
the fix; :func:`check_flags_before_upstream` runs the checks that need no derived value (with
the rules on upstream's own flags, :mod:`megatron.bounded.launch.upstream_checks`, and the data
files, :mod:`megatron.bounded.data.indexed_check`) before upstream's validation prints its
argument table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import os
import sys
from typing import List, Sequence, Tuple

from megatron.bounded.activations.chunked_attention import ChunkedAttentionSettings
from megatron.bounded.activations.chunked_recompute import ChunkedRecomputeSettings
from megatron.bounded.activations.sco import SCOSettings
from megatron.bounded.activations.selective_recompute import (
    MLA_RECOMPUTE_MODULES,
    check_selective_recompute,
)
from megatron.bounded.attention.documents import check_document_attention, check_document_sources
from megatron.bounded.attention.windows import check_window_flags
from megatron.bounded.budget.config import OPERATOR_SETTINGS, BudgetSettings
from megatron.bounded.budget.planner import check_whole_iteration_graph
from megatron.bounded.budget.report import check_host_memory
from megatron.bounded.data.indexed_check import check_data_splits
from megatron.bounded.launch import te_choices
from megatron.bounded.launch.upstream_checks import check_upstream_flags
from megatron.bounded.loss.ring_dtp import RingDTPSettings
from megatron.bounded.model.dsa import check_dsa_flags
from megatron.bounded.attention.gated_delta_net import check_gated_delta_net_flags
from megatron.bounded.model.mla import check_mla_dimensions
from megatron.bounded.moe.backend import MoEBackendSettings
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPSettings
from megatron.bounded.object_changes import object_change
from megatron.bounded.optimizer.distributed import OffloadStreamSettings
from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.training.checkpoint_manifest import CheckpointManifestSettings
from megatron.bounded.training.progress import ProgressSettings
from megatron.bounded.training.resume_check import check_load_directory, check_save_directory
from megatron.bounded.units import GB

# Every settings dataclass whose fields are flags, by RunSettings field, in --help order.
RUN_SETTINGS = {
    **OPERATOR_SETTINGS,
    "progress": ProgressSettings,
    "checkpoint_manifest": CheckpointManifestSettings,
}

GROUP_TITLE = "megatron-bounded"
HELP_FLAG = "--help-bounded"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The settings objects of one run (``RunSettings.from_args``); ``pretrain_gpt.py`` hands
    each to its operator, and the memory budget reads them."""

    moe_backend: MoEBackendSettings
    pipelined_llep: PipelinedLLEPSettings
    chunked_recompute: ChunkedRecomputeSettings
    chunked_attention: ChunkedAttentionSettings
    sco: SCOSettings
    ring_dtp: RingDTPSettings
    offload_stream: OffloadStreamSettings
    budget: BudgetSettings
    progress: ProgressSettings
    checkpoint_manifest: CheckpointManifestSettings

    @classmethod
    def from_args(cls, args: argparse.Namespace, early: bool = False) -> "RunSettings":
        """Every settings object of ``args``, checked (``early``: only the checks that need
        nothing upstream's validation derives)."""
        return cls(**{name: settings.from_args(args, check=settings.EARLY or not early)
                      for name, settings in RUN_SETTINGS.items()})

    def replace(self, **settings) -> "RunSettings":
        return dataclasses.replace(self, **settings)

    def flag_values(self) -> dict:
        """``{flag attribute: value}`` of every setting."""
        values = {}
        for name in RUN_SETTINGS:
            values.update(getattr(self, name).fields())
        return values

    def view_of(self, args: argparse.Namespace) -> argparse.Namespace:
        """A copy of ``args`` with these settings' values (``args`` itself is left as parsed):
        what upstream's config builder and the start-up line read."""
        return argparse.Namespace(**{**vars(args), **self.flag_values()})

    def transformer_config(self, args: argparse.Namespace):
        """The model's transformer config: upstream's ``core_transformer_config_from_args`` on
        :meth:`view_of` with our config class, ``BoundedMLATransformerConfig`` with
        ``--multi-latent-attention``."""
        from megatron.training.argument_utils import core_transformer_config_from_args

        from megatron.bounded.model.config import transformer_config_class

        view = self.view_of(args)
        mla = bool(getattr(args, "multi_latent_attention", False))
        if not mla:
            return core_transformer_config_from_args(view, config_class=transformer_config_class(False))
        # Upstream replaces any config class by its MLATransformerConfig when it sees the flag
        # (and then asserts a non-MLA --rope-type is rope): both are hidden from that choice,
        # and set again on the config built, whose __post_init__ runs once more with them. The
        # recompute modules that need MLA are hidden with it (upstream refuses them without MLA)
        # and checked in that second __post_init__.
        view.multi_latent_attention, view.rope_type = False, None
        mla_fields = {"multi_latent_attention": True}
        modules = view.recompute_modules
        if modules and set(modules) & MLA_RECOMPUTE_MODULES:
            view.recompute_modules = [m for m in modules if m not in MLA_RECOMPUTE_MODULES]
            mla_fields["recompute_modules"] = list(modules)
        config = core_transformer_config_from_args(view, config_class=transformer_config_class(True))
        if args.rope_type is not None:
            mla_fields["rope_type"] = args.rope_type
        return dataclasses.replace(config, **mla_fields)


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None


# Upstream defaults that need Transformer Engine or Apex, and the TE-free value for each
# (measured: each otherwise raises at config construction or model build without TE/Apex).
TE_FREE_DEFAULTS = {
    "transformer_impl": "local",
    "apply_rope_fusion": False,  # --no-rope-fusion
    "no_persist_layer_norm": True,  # --no-persist-layer-norm
    "gradient_accumulation_fusion": False,  # --no-gradient-accumulation-fusion
    "masked_softmax_fusion": False,  # --no-masked-softmax-fusion
}


# Evaluation interval when --train-iters is given without --eval-interval: older Megatron-LM's
# default (megatron-core 0.19.2 has none and divides by it when sizing the datasets).
DEFAULT_EVAL_INTERVAL = 1000


def add_bounded_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider``: add our flags and TE-free defaults when TE is absent."""
    _add_our_group(parser)
    parser.set_defaults(
        # one_logger is an internal NVIDIA package; upstream defaults it on and warns without it.
        enable_one_logger=False,
        # the attention of this project is causal by construction: an [s, s] mask per sample
        # built by the dataloader would cost s² bytes (16 GiB at 128K tokens) for nothing.
        create_attention_mask_in_dataloader=False,
    )
    if not transformer_engine_available():
        parser.set_defaults(**TE_FREE_DEFAULTS)
    return parser


def _add_our_group(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        title=GROUP_TITLE, description=f"This project's flags ({HELP_FLAG} lists only these).")
    for settings in RUN_SETTINGS.values():
        settings.add_arguments(group)


def bounded_help() -> str:
    """What ``pretrain_gpt.py --help-bounded`` prints: this project's flags only."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py", usage="pretrain_gpt.py [Megatron flags] [megatron-bounded flags]",
        add_help=False, description="--help lists Megatron's flags too.")
    _add_our_group(parser)
    return parser.format_help()


def validate_bounded_args(args: argparse.Namespace) -> RunSettings:
    """The run's settings; refuses flag combinations this project cannot run. Call after
    upstream's validation, before building the model."""
    _check_transformer_engine(args)
    validate_flags_early(args)
    settings = RunSettings.from_args(args)
    if args.transformer_impl == "local":
        from megatron.bounded.attention.core import check_sdpa_attention_supported

        check_sdpa_attention_supported(args)
    check_document_attention(args)
    check_selective_recompute(args)
    _check_unsupported_upstream_flags(args)
    check_data_splits(args)  # upstream's validation has set the default --split
    _default_eval_interval(args)
    check_host_memory(args, settings)
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if decay_iters is not None and args.lr_warmup_iters and args.lr_warmup_iters >= decay_iters:
        # upstream's scheduler asserts on this only after the model and optimizer are built
        raise BoundedArgumentError(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than the decay length "
            f"(--lr-decay-iters, default --train-iters: {decay_iters}): lower --lr-warmup-iters "
            "or raise --train-iters."
        )
    return settings


def with_this_gpu_memory(settings: RunSettings) -> RunSettings:
    """``settings`` whose memory budget, without --hbm-gb, plans for the memory of this process's
    GPU as torch reports it (where one is visible; else the budget's default, one H200). Asked
    of the device's properties, which allocates nothing on it."""
    import torch

    if settings.budget.hbm_gb is not None or not torch.cuda.is_available():
        return settings
    device = int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count()
    total = torch.cuda.get_device_properties(device).total_memory
    return settings.replace(budget=dataclasses.replace(settings.budget, hbm_gb=total / GB))


def recheck(args: argparse.Namespace, settings: RunSettings) -> RunSettings:
    """``settings`` (e.g. chosen by --auto-bounds) through the same checks as flags."""
    view = settings.view_of(args)
    for name in RUN_SETTINGS:
        own = getattr(settings, name)
        if not own.enabled:  # an operator left off: its knobs as parsed (unset, not defaults)
            for knob_field in own.knobs():
                setattr(view, knob_field.name, getattr(args, knob_field.name, None))
    settings = RunSettings.from_args(view)
    check_host_memory(args, settings)
    return settings


def hand_over_optimizer(args: argparse.Namespace, settings: RunSettings) -> None:
    """OffloadStreamAdamW through upstream's host-optimizer path: the upstream flags that select
    it (upstream's optimizer build reads them from ``args``), and our class bound where upstream
    builds its HybridDeviceOptimizer. Without Transformer Engine, moments below fp32 are kept by
    MomentDtypeAdamW, bound where upstream builds its distributed optimizer; upstream's config
    takes such dtypes only with FusedAdam, so it is handed fp32 ones."""
    moments = None if transformer_engine_available() else te_choices.moment_dtypes(args)
    if moments is not None:
        import torch

        from megatron.bounded.upstream.optimizer import keep_adam_moments_in

        keep_adam_moments_in(*moments)
        args.exp_avg_dtype = args.exp_avg_sq_dtype = torch.float32
    offload = settings.offload_stream
    if not offload.enabled:
        return
    from megatron.bounded.upstream import patches

    object_change("offload-stream-upstream-flags").set(args, **offload.UPSTREAM_OPTIMIZER_FLAGS)
    patches.use_offload_stream_optimizer(offload.offload_stream_bucket_numel,
                                         offload.offload_stream_slots)


def _check_unsupported_upstream_flags(args: argparse.Namespace) -> None:
    if getattr(args, "heterogeneous_layers_config_path", None) is not None:
        raise BoundedArgumentError(
            "--heterogeneous-layers-config-path is not supported by this pretrain_gpt.py: "
            "remove the flag."
        )


def _default_eval_interval(args: argparse.Namespace) -> None:
    if args.train_iters is not None and args.eval_interval is None:
        # upstream divides by eval_interval when sizing the datasets (a TypeError on None)
        args.eval_interval = DEFAULT_EVAL_INTERVAL
        _note(args, "bounded_defaults", f"--eval-interval {DEFAULT_EVAL_INTERVAL} (not given; "
              "megatron-core 0.19.2 has no default, older Megatron-LM's was 1000)")


def validate_flags_early(args: argparse.Namespace) -> RunSettings:
    """The checks that need nothing upstream's validation derives: :func:`check_flags_before_upstream`
    runs them on the parsed flags before upstream validates (and prints its argument table);
    :func:`validate_bounded_args` runs them again."""
    from megatron.bounded.moe.dispatch.token_dispatcher import check_capacity_flags
    from megatron.bounded.training.resiliency import check_resiliency_args

    check_upstream_flags(args)
    check_window_flags(args)
    check_document_sources(args)
    check_mla_dimensions(args)
    check_dsa_flags(args)
    check_gated_delta_net_flags(args)
    _check_sequence_parallel_norms(args)
    check_capacity_flags(args, BoundedArgumentError)
    check_resiliency_args(args, BoundedArgumentError)
    check_whole_iteration_graph(args)
    if not transformer_engine_available():
        te_choices.check_optimizer_dtypes(args)
    return RunSettings.from_args(args, early=True)


def refuse(error: Exception) -> None:
    """Print a refused flag's message once (rank 0 by ``RANK``; every process runs this before
    torch.distributed exists) and exit with status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[bounded] error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_flags_before_upstream(argv=None) -> argparse.Namespace:
    """``argv`` (default: this process's command line) parsed without validation; refuses the
    flags that :func:`validate_flags_early` rejects (parsed without
    validation, nothing printed), before upstream's validation prints its argument table and
    fails on some of them with a less direct message; then ``--save`` and ``--load``
    (:mod:`megatron.bounded.training.resume_check`: checked here and not in
    :func:`validate_flags_early`, which tools/memory_budget.py runs for another machine too)."""
    parsed = parse_without_validation(sys.argv[1:] if argv is None else argv)
    try:
        validate_flags_early(parsed)
        check_save_directory(parsed)
        note = check_load_directory(parsed)
    except BoundedArgumentError as error:
        refuse(error)
    if note is not None and os.environ.get("RANK", "0") == "0":
        print(f"[bounded] {note}", flush=True)
    return parsed


def parse_without_validation(flags) -> argparse.Namespace:
    """Upstream's parser with this project's flags, as ``pretrain_gpt.py`` builds it."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        return parse_args(add_bounded_args)
    finally:
        sys.argv = saved


# Choices megatron-core 0.19.2 refuses on every stack, and what runs instead: (flag, refused
# value, replacement, the note). Its validation asserts on them, so they are replaced on the
# command line before it parses.
REFUSED_UPSTREAM_CHOICES = (
    ("--cross-entropy-fusion-impl", "te", "native",
     "--cross-entropy-fusion-impl te -> native (megatron-core's fused vocabulary-parallel "
     "cross-entropy: it disables Transformer Engine's)"),
)

# GPT-OSS's YaRN RoPE, the values Megatron-LM's --enable-gpt-oss sets on the model config.
GPT_OSS_YARN = (
    "--position-embedding-type", "yarn", "--rotary-scaling-factor", "32",
    "--yarn-original-max-position-embeddings", "131072", "--yarn-beta-fast", "32",
    "--yarn-beta-slow", "1", "--mscale", "1", "--mscale-all-dim", "0",
    "--no-yarn-correction-range-round-to-int",
)

# Flags Megatron-LM's pretrain_gpt.py has only with NVIDIA ModelOpt installed (its post-training
# arguments; megatron-core's parser does not know them), and the flags that do the same here:
# (flag, replacement appended to the command line, the note). The replacement goes last, as
# ModelOpt's model builder applies them over the other flags.
MODELOPT_FLAGS = (
    ("--export-force-local-attention", (), "--export-force-local-attention -> nothing to do: "
     "the attention here is always local (SDPA core attention)"),
    ("--enable-gpt-oss", GPT_OSS_YARN, "--enable-gpt-oss -> its YaRN RoPE as megatron-core flags: "
     + " ".join(GPT_OSS_YARN)),
)


# Flags of earlier releases that the planner (--bounded-plan auto, the default) replaces: taken
# off the command line, with a note on the start-up line.
REPLACED_BY_PLANNER = {
    "--bounded-fast-path": "--bounded-fast-path -> nothing: the planner (--bounded-plan auto, the "
    "default) chooses the fastest exact plan that fits",
    "--auto-bounds": "--auto-bounds -> nothing: the planner (--bounded-plan auto, the default) "
    "chooses every knob left open, the operators' included",
}


def replace_refused_flags(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(argv with each choice of REFUSED_UPSTREAM_CHOICES and each flag of MODELOPT_FLAGS
    replaced, each flag of REPLACED_BY_PLANNER removed, ``--attention-dropout 0`` added for
    windows or sinks when no dropout is given, and without Transformer Engine its choices
    replaced (:func:`replace_transformer_engine_flags`); the notes)``; the notes go to the
    start-up line once the flags are parsed (:func:`note_substitution`)."""
    argv, notes = list(argv), []
    for flag, refused, replacement, note in REFUSED_UPSTREAM_CHOICES:
        for index, token in enumerate(argv):
            if token == f"{flag}={refused}":
                argv[index] = f"{flag}={replacement}"
            elif token == flag and argv[index + 1:index + 2] == [refused]:
                argv[index + 1] = replacement
            else:
                continue
            if note not in notes:
                notes.append(note)
    for flag, replacement, note in MODELOPT_FLAGS:
        if flag in argv:
            argv = [token for token in argv if token != flag] + list(replacement)
            notes.append(note)
    for flag, note in REPLACED_BY_PLANNER.items():
        if flag in argv:
            argv = [token for token in argv if token != flag]
            notes.append(note)
    if _windows_or_sinks(argv) and not any(
            token.split("=")[0] == "--attention-dropout" for token in argv):
        # upstream's default attention dropout is not 0; the windowed and sink kernels run
        # without dropout, so the default (never asked for) becomes 0; a value given is refused
        argv += ["--attention-dropout", "0"]
        notes.append(WINDOW_DROPOUT_NOTE)
    argv, te_notes = replace_transformer_engine_flags(argv)
    return argv, notes + te_notes


WINDOW_DROPOUT_NOTE = ("--attention-dropout (megatron-core's default, not given) -> 0: "
                       "sliding-window and sink attention run without dropout")


def _windows_or_sinks(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for sliding windows or softmax sinks (the same for ``--flag=value``)."""
    tokens = [part for token in argv for part in token.split("=", 1)]
    if "--window-size" in tokens:
        return True
    if "--softmax-type" in tokens:
        return tokens[tokens.index("--softmax-type") + 1:][:1] != ["vanilla"]
    return False


def note_substitution(args: argparse.Namespace, text: str) -> None:
    """Record what the command line asked for and what runs instead (printed at start-up by
    :mod:`megatron.bounded.launch.run_summary`)."""
    _note(args, "bounded_substitutions", text)


def _note(args: argparse.Namespace, attribute: str, text: str) -> None:
    """Append ``text`` once to the list ``args.<attribute>`` (created when missing)."""
    notes = getattr(args, attribute, None)
    if notes is None:
        notes = []
        setattr(args, attribute, notes)
    if text not in notes:
        notes.append(text)


def _substitute_transformer_engine_choices(args: argparse.Namespace) -> None:
    """Scripts written for Transformer Engine run without it: each TE-only choice is replaced
    (:func:`megatron.bounded.launch.te_choices.substitute`) and named on the start-up line
    (``note_substitution``), before anything is built."""
    for note in te_choices.substitute(args):
        note_substitution(args, note)


@functools.lru_cache(maxsize=1)
def _flag_parser() -> argparse.ArgumentParser:
    """Upstream's parser with this project's flags (built once: it takes about a second)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_bounded_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def replace_transformer_engine_flags(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(argv with the TE-only choices replaced, the notes)`` when Transformer Engine is not
    installed (``argv`` unchanged otherwise, or when it does not parse: the parse that follows
    says why). Upstream's validation asserts on some of these choices, so they are replaced on
    the command line, before it parses."""
    if transformer_engine_available():
        return list(argv), []
    parser = _flag_parser()
    try:
        # quiet: the parse that follows prints argparse's errors (and --help) once
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parsed = parser.parse_args(list(argv))
    except SystemExit:
        return list(argv), []
    before = dict(vars(parsed))
    notes = te_choices.substitute(parsed)
    changed = {name: value for name, value in vars(parsed).items() if before.get(name) != value}
    return te_choices.set_on_command_line(argv, parser, changed), notes


def _check_sequence_parallel_norms(args: argparse.Namespace) -> None:
    """Sequence parallelism needs norms that take a sequence shard: Transformer Engine's, or in
    the local implementation Apex's fused LayerNorm; upstream's torch norm (RMSNorm always, and
    LayerNorm without Apex) asserts at model build."""
    if not getattr(args, "sequence_parallel", False) or args.tensor_model_parallel_size == 1:
        return
    local = args.transformer_impl == "local" or not transformer_engine_available()
    if not local or (apex_available() and args.normalization == "LayerNorm"):
        return
    raise BoundedArgumentError(
        f"--sequence-parallel with --tensor-model-parallel-size {args.tensor_model_parallel_size} "
        f"cannot run here: the local implementation's --normalization {args.normalization} is "
        "torch's norm, which takes whole sequences (only Apex's fused LayerNorm takes a sequence "
        "shard): remove --sequence-parallel (tensor parallelism still splits the weights), or "
        "install Transformer Engine and use --transformer-impl transformer_engine."
    )


def _check_transformer_engine(args: argparse.Namespace) -> None:
    if not transformer_engine_available():
        _substitute_transformer_engine_choices(args)
    if transformer_engine_available() or apex_available():
        return
    te_only = [
        ("apply_rope_fusion", "--no-rope-fusion"),
        ("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion"),
        ("masked_softmax_fusion", "--no-masked-softmax-fusion"),
    ]
    for name, fix in te_only:
        if getattr(args, name, False):
            raise BoundedArgumentError(
                f"{name.replace('_', '-')} is on but needs Transformer Engine or Apex, neither of "
                f"which is installed: pass {fix}."
            )
