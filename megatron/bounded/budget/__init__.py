"""Launch-time per-GPU memory budget: the paper's Eq. (6), term by term, from the flags alone.

"Flattening Every Memory Peak in Long-Context MoE Training" writes the per-GPU peak as a sum of
live sets, each fixed by the model and the launch configuration (Eq. 6)::

    M_peak = 4Θ/W + O(sβ) + O(NHb) + O(E_p q H b) + O(NVb/P) + O(NHb)

:func:`estimate` evaluates every term of that sum for a parsed Megatron argument namespace
(upstream flags plus ours), adds the terms the paper leaves implicit (the working set of one layer
during recompute and backward, the CUDA context and allocator fragmentation), and compares the
total with the HBM of one GPU. It runs on the CPU, reads nothing but ``args`` (and the
``WORLD_SIZE`` environment variable when ``args.world_size`` is unset), and never initializes
``torch.distributed`` or CUDA. :func:`plan_run` chooses every knob the command line leaves open:
the fastest plan, by the cost model of :mod:`~megatron.bounded.budget.cost`, that fits
(``--bounded-plan auto``); :func:`max_seq_length` bisects the longest sequence that fits.

Notation (per rank): N = micro_batch_size × seq_length / context_parallel_size tokens (one
micro-batch live per stage with pipeline size 1; with pipeline parallelism, stage s of PP keeps
PP - s micro-batches in flight, 1F1B), H hidden, V the padded vocabulary (vocab_size rounded up to
a multiple of make_vocab_size_divisible_by × TP), k top-k, E experts, E_p expert-parallel size,
F / F_m / F_s dense / expert / shared-expert FFN widths, L layers of the stage, b bytes per
activation element (2 for bf16/fp16, 4 for fp32), W the data-parallel size sharding dense state
(DP × CP), W_e = world / (E_p × expert TP × PP) for expert state.

Terms (bytes per GPU; ``Budget.notes`` repeats each with the numbers filled in):

* model state: Θ_dense·(p + g + o/W) + Θ_expert·(p + g + o/W_e), with p = 2 (bf16 param),
  g = 4 (fp32 gradient buffer, upstream's default for bf16), o = 12 (fp32 master + two moments),
  divided only with the distributed optimizer; Megatron-FSDP also shards g (and p). With
  OffloadStreamAdamW the GPU keeps p + g per parameter and o moves to the host. Ring-DTP shards
  the output layer to ceil(V/P)·H.
* optimizer staging: min(slots, buckets) × largest bucket × 16 B (OffloadStreamAdamW only).
* checkpoint boundaries (full recompute): N·H·b × ceil(L/recompute_num_layers) × micro-batches
  in flight (+ one shared rotary table); with SCO (B - k) + min(k, 2) boundaries stay on the
  device, k = min(B, floor(host budget / N·H·b)).
* layer activations (layers not checkpointed): per layer N·(attention + MLP token widths) +
  routed rows kept × row width (see :func:`activation_widths`).
* MoE dispatch (one layer in flight): standard 2·k·N·H·b × skew; static capacity
  2·E_p·ceil(cf·N·k/E_p)·H·b; PipelinedLLEP 2·E_p·k·c_eff·H·b.
* paged stash: factor × N·k × (H + fc1 width)·b × layers whose expert activations are paged.
* vocabulary projection: standard (4 + b)·N·V/TP (fp32 logits, softmax and gradient in place,
  and the logits in the activation dtype b < 4); Ring-DTP 4 strips of
  n × ceil(V/P) × 4 B (n = chunk tokens or N) plus its accumulators; + N·H·b input.
* kept attention (``--chunked-recompute-keep-attention``): K, V, attention's output and
  log-sum-exp kept from the forward for the recompute, ``kept_attention_bytes`` of the chunked
  attention module (on the GPU L·N·saved at the loss; on the host N·saved on the GPU, L·N·saved
  pinned).
* recompute working set: the activations one recomputed chunk saves + the largest backward
  transient of a sub-block (attention, or MLP/MoE with its routed rows) + 2·N·H·b.
* CUDA context + fragmentation: 1 GiB + 3% of the peak allocated (an allowance the allocator does
  not see); the verdict compares the peak allocated plus this allowance with the HBM.

With full recompute the peak allocated (:attr:`Budget.peak_allocated`) is the model state plus
the largest of three phases (loss, layer, step; ``docs/operators/memory_budget.md``); without it
the terms are added (an upper estimate). ``--hbm-gb`` and ``--budget-host-gb`` are decimal GB,
``--sco-host-budget-gb`` GiB.

Modules: :mod:`~megatron.bounded.budget.config` reads the flags (:class:`BudgetConfig`);
:mod:`~megatron.bounded.budget.widths` sizes parameters, per-token widths and routed rows;
:mod:`~megatron.bounded.budget.terms` computes each term and a stage's budget, with the phases
of :mod:`~megatron.bounded.budget.phases`; :mod:`~megatron.bounded.budget.planner` chooses the
run's knobs, with the step times of :mod:`~megatron.bounded.budget.cost`;
:mod:`~megatron.bounded.budget.fixes` suggests the flags that make a plan fit; :mod:`~megatron.bounded.budget.report` prints the table and runs
the launch-time check. Every operator's bound is a function of its own module.
"""

from megatron.bounded.budget.config import (
    BALANCED_ROUTING_SKEW, DEFAULT_HBM_GB, DEFAULT_ROUTING_SKEW, H200_HBM_BYTES,
    OPERATOR_SETTINGS, BudgetConfig, BudgetSettings,
)
from megatron.bounded.budget.cost import StepCost, step_cost
from megatron.bounded.budget.fixes import fixes
from megatron.bounded.budget.planner import Plan, flags_of, longest_plan, plan_run, predicted_step
from megatron.bounded.budget.planner import refusal as planner_refusal
from megatron.bounded.budget.report import (
    MemoryBudgetError, check_host_memory, launch_check, plan_refusal, render, to_dict,
)
from megatron.bounded.budget.phases import KERNEL_WORKSPACE_BYTES
from megatron.bounded.budget.terms import (
    CUDA_CONTEXT_BYTES, FRAGMENTATION_FRACTION, TERM_LABELS, Budget, estimate, estimate_config,
    max_seq_length, place_kept_attention, stage_budgets,
)
from megatron.bounded.budget.widths import parameter_counts, pipelined_llep_chunks

__all__ = [
    "BALANCED_ROUTING_SKEW", "Budget", "BudgetConfig", "BudgetSettings", "CUDA_CONTEXT_BYTES",
    "OPERATOR_SETTINGS", "DEFAULT_HBM_GB", "DEFAULT_ROUTING_SKEW", "FRAGMENTATION_FRACTION",
    "H200_HBM_BYTES", "KERNEL_WORKSPACE_BYTES", "MemoryBudgetError", "Plan", "StepCost",
    "TERM_LABELS", "check_host_memory", "estimate", "estimate_config", "fixes", "flags_of",
    "launch_check", "longest_plan", "max_seq_length", "parameter_counts", "pipelined_llep_chunks",
    "place_kept_attention", "plan_refusal", "plan_run", "planner_refusal", "predicted_step", "render", "stage_budgets", "step_cost",
    "to_dict",
]
