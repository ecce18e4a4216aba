"""``--bounded-fast-path``: the fastest exact configuration that the other flags allow.

The example scripts pass ``--bounded-fast-path``; :func:`expand_fast_path` turns it into plain
flags before upstream parses the command line, so what runs is an ordinary Megatron command line
that upstream's and our validation check like any other, and one start-up line says what was
added and, for each part left out, why. Flags given explicitly always win: the fast path only
adds flags that are absent.

What it adds to an MoE model, in order (the whole-iteration graph needs the static dispatch):

1. ``--bounded-moe-backend torch``: this project's all-to-all dispatcher and grouped experts
   (measured on the small example, one H200: 4.5x upstream's alltoall + ``SequentialMLP``).
2. ``--moe-expert-rank-capacity-factor EP``: static per-peer slabs with no host sync. With the
   expert-parallel size as the factor a slab holds every row a rank can send, so no step can go
   over budget (a step that did would be rerun dropless by upstream's ``PagedStashRunner``: exact,
   but slower). Above :data:`MAX_NO_DROP_EP` ranks that buffer (EP x the average routed rows per
   rank) is too large, and the dispatch stays dropless with exact sizes instead.
3. ``--moe-paged-stash --moe-paged-stash-buffer-size-factor-cuda EP``: the experts' saved
   activations in pages sized to the rows actually routed; a rank receives at most EP x its
   average, so the CUDA pool never overflows (an overflow would rerun the step). Left out at
   EP = 1 with a factor of at most 1, where the experts' rows are exactly the routed ones: paging
   them saves nothing, and its hooks cost host time in every layer.
4. ``--no-bias-dropout-fusion`` when there is no hidden dropout and no bias: the residual add is
   then a single add, which upstream's "fusion" runs through ``torch.compile`` (the same values;
   its guard checks cost more host time than the add).
5. ``--manual-gc --manual-gc-interval 100``: upstream's manual garbage collection (Python's
   collector disabled, one collection every 100 steps). An eager step creates and frees
   thousands of Python objects per layer, so the automatic collector would run its passes in
   the middle of steps, holding up the launches. Collecting changes no value.
6. ``--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad``: upstream's
   whole-iteration CUDA graph (2.2x on the small example). It needs a step that never syncs with
   the host and is never rerun, so only the configuration above with none of the operators or
   layouts that were not run under the graph. Upstream's per-step NaN check cannot run inside
   the graph; :mod:`megatron.bounded.training.progress` then checks the loss on the host every log
   interval and stops the job on a NaN or inf.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from megatron.bounded.attention.documents import document_source
from megatron.bounded.settings import BoundedArgumentError, Settings, flag_name, knob



@dataclass(frozen=True)
class FastPathSettings(Settings):
    """The fast path's flag (it acts on the command line, before upstream parses it)."""

    bounded_fast_path: bool = knob(
        False, "Add the flags of the fastest exact configuration the other flags allow (torch-"
        "native MoE, no-drop capacity, paged stash, whole-iteration CUDA graph); explicit flags win.")

    def check(self, args) -> None:
        """Refuse an explicit whole-iteration graph around an operator that cannot run under it."""
        if getattr(args, "cuda_graph_impl", "none") != "full_iteration":
            return
        operators = operators_not_under_graph(args)
        if operators:
            raise BoundedArgumentError(
                f"--cuda-graph-impl full_iteration with {', '.join(operators)}: the whole-iteration "
                "graph replays one captured step, and these were not run under it: remove "
                f"--cuda-graph-impl full_iteration (or use none), or remove {', '.join(operators)}."
            )


FLAG = flag_name("bounded_fast_path")
# Steps between two garbage collections with --manual-gc (upstream's default, 0, collects only at
# evaluation and checkpoints; a bounded interval keeps reference cycles from accumulating).
MANUAL_GC_INTERVAL = 100
# Largest expert-parallel size at which the no-drop factor (= EP) is used: each rank's receive
# buffer holds EP x its average routed rows (a node of 8 GPUs: 8x).
MAX_NO_DROP_EP = 8


@dataclass
class FastPath:
    """What ``--bounded-fast-path`` adds (``flags``) and why any part of it is left out."""

    flags: List[str] = field(default_factory=list)
    left_out: List[str] = field(default_factory=list)

    def add(self, flag: str, *values) -> None:
        self.flags += [flag, *(_number(value) for value in values)]

    @property
    def whole_iteration_graph(self) -> bool:
        return "full_iteration" in self.flags

    def line(self) -> str:
        added = " ".join(self.flags) if self.flags else "nothing"
        text = f"[bounded] fast path: added {added}"
        if self.whole_iteration_graph:
            text += " (NaN/inf: the loss is checked on the host every log interval)"
        if self.left_out:
            text += "; " + "; ".join(self.left_out)
        return text


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def given_flags(argv: Sequence[str]) -> set:
    """The ``--flags`` present on a command line (``--flag=value`` included)."""
    return {token.split("=", 1)[0] for token in argv if token.startswith("--")}


def plan(args: argparse.Namespace, given: set) -> FastPath:
    """The fast path for parsed (not yet validated) ``args``; ``given``: the flags on the command
    line, which the fast path never overrides."""
    fast = FastPath()
    if args.num_experts is None:
        fast.left_out.append("a dense model: the fast path concerns the MoE layers")
        return fast
    reason = _torch_backend_blocker(args)
    if reason:
        fast.left_out.append(f"upstream's MoE path kept: {reason}")
        return fast
    if args.pipelined_llep:
        fast.left_out.append(
            "--pipelined-llep bounds the dispatch itself (exact sizes, one host sync per step): "
            "no capacity factor, paged stash or whole-iteration graph"
        )
        return fast
    if "--bounded-moe-backend" not in given:
        fast.add("--bounded-moe-backend", "torch")
    ep = args.expert_model_parallel_size
    factor = args.moe_expert_rank_capacity_factor
    if factor is None:
        if ep > MAX_NO_DROP_EP:
            fast.left_out.append(
                f"dropless dispatch (exact sizes, a host sync per layer): at EP={ep} a no-drop "
                f"rank capacity factor would size every receive buffer for {ep}x the average "
                "rows; no paged stash or whole-iteration graph"
            )
            return fast
        factor = ep
        fast.add("--moe-expert-rank-capacity-factor", factor)
    stash_factor = args.moe_paged_stash_buffer_size_factor_cuda
    if not args.moe_paged_stash:
        reason = _paged_stash_blocker(args, factor)
        if reason:
            fast.left_out.append(f"no paged stash: {reason}")
        else:
            fast.add("--moe-paged-stash")
            if "--moe-paged-stash-buffer-size-factor-cuda" not in given:
                stash_factor = ep
                fast.add("--moe-paged-stash-buffer-size-factor-cuda", stash_factor)
    if args.bias_dropout_fusion and args.hidden_dropout == 0 and not args.add_bias_linear:
        # Without dropout and biases the "fusion" is one add, which upstream compiles with
        # torch.compile: its guards cost more host time than the add's launch in eager steps.
        fast.add("--no-bias-dropout-fusion")
    if not args.manual_gc:
        fast.add("--manual-gc")
        if "--manual-gc-interval" not in given:
            fast.add("--manual-gc-interval", MANUAL_GC_INTERVAL)
    stash_on = args.moe_paged_stash or "--moe-paged-stash" in fast.flags
    reason = _graph_blocker(args, given, factor, stash_on, stash_factor)
    if reason:
        fast.left_out.append(f"no whole-iteration CUDA graph: {reason}")
    else:
        fast.add("--cuda-graph-impl", "full_iteration")
        if args.check_for_nan_in_loss_and_grad:
            fast.add("--no-check-for-nan-in-loss-and-grad")
    return fast


def _torch_backend_blocker(args) -> Optional[str]:
    if args.bounded_moe_backend == "upstream":
        return "--bounded-moe-backend upstream"
    if args.transformer_impl != "local":
        return (
            f"--transformer-impl {args.transformer_impl} builds upstream's MoE layer (the "
            "torch-native path needs --transformer-impl local)"
        )
    if args.moe_shared_expert_overlap:
        return "--moe-shared-expert-overlap needs upstream's dispatcher"
    return None


def _paged_stash_blocker(args, factor) -> Optional[str]:
    if args.recompute_granularity == "full":
        return "--recompute-granularity full runs the experts' forward twice"
    if args.recompute_granularity == "selective" and "moe" in (args.recompute_modules or []):
        return "--recompute-modules moe runs the experts' forward twice"
    if getattr(args, "cpu_offloading_num_layers", 0):
        return "--cpu-offloading-num-layers"
    if args.expert_model_parallel_size == 1 and factor <= 1:
        # One slab of N·k rows holds exactly the routed pairs: no padding rows to leave out.
        return (
            "with EP = 1 and a rank capacity factor of at most 1 the experts' rows are exactly the routed "
            "ones, so paging them saves no memory (and costs host time every layer)"
        )
    return None


def _graph_blocker(args, given, factor, stash_on, stash_factor) -> Optional[str]:
    ep = args.expert_model_parallel_size
    if "--cuda-graph-impl" in given or args.cuda_graph_impl != "none":  # "none" given: eager
        return f"--cuda-graph-impl {args.cuda_graph_impl} given"
    if factor < ep:
        return (
            f"rank capacity factor {_number(factor)} < EP={ep} lets a step go over budget, and "
            "its dropless rerun resets the graph"
        )
    if stash_on and not stash_factor >= ep:
        return (
            f"--moe-paged-stash-buffer-size-factor-cuda {_number(stash_factor)} < EP={ep} lets "
            "the stash overflow, and the rerun resets the graph"
        )
    not_run_under_graph = [
        (args.context_parallel_size > 1, "--context-parallel-size > 1"),
        (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1"),
        (args.tensor_model_parallel_size > 1, "--tensor-model-parallel-size > 1"),
        (args.eval_iters != 0, f"evaluation (--eval-iters {args.eval_iters})"),
        (document_source(args) is not None, "attention within packed documents"),
    ]
    blockers = operators_not_under_graph(args)
    blockers += [what for present, what in not_run_under_graph if present]
    if blockers:
        return ", ".join(blockers) + " not run under the graph yet"
    return None


def operators_not_under_graph(args) -> List[str]:
    """The flags of this project's operators on ``args`` that were not run under the
    whole-iteration CUDA graph: the fast path leaves the graph out with them, and an explicit
    ``--cuda-graph-impl full_iteration`` with them is refused."""
    operators = [
        (args.pipelined_llep, "--pipelined-llep"),
        (args.sco_host_budget_gb > 0, "--sco-host-budget-gb"),
        (args.ring_dtp, "--ring-dtp"),
        (args.offload_stream_optimizer, "--offload-stream-optimizer"),
    ]
    return [flag for present, flag in operators if present]


def expand_fast_path(argv: Sequence[str], parsed: argparse.Namespace):
    """``(argv with the fast path's flags appended, its start-up line)``; argv unchanged and no
    line without ``--bounded-fast-path``. ``parsed``: ``argv`` parsed without validation."""
    argv = list(argv)
    if not parsed.bounded_fast_path:
        return argv, None
    fast = plan(parsed, given_flags(argv))
    return argv + fast.flags, fast.line()
