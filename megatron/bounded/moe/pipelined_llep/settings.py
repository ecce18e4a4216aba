"""PipelinedLLEP's flags and the per-rank memory bound the launch-time budget composes.

The bound's derivation is in docs/operators/pipelined_llep.md ("How it works").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.bounded.moe.pipelined_llep.chunks import agree_num_chunks
from megatron.bounded.settings import BoundedArgumentError, Settings, knob


@dataclass
class PipelinedLLEPSettings(Settings):
    """PipelinedLLEP's flags. Not frozen: :class:`~megatron.bounded.model.config.BoundedTransformerConfig`
    inherits the fields, so the MoE layer reads them from its config."""

    SWITCH = "pipelined_llep"
    EARLY = False  # after the Transformer Engine substitutions of validate_bounded_args

    pipelined_llep: bool = knob(
        False, "PipelinedLLEP: dispatch each MoE layer in strided chunks of at most "
        "--pipelined-llep-token-budget tokens per source rank, pipelined and recomputed per chunk.")
    pipelined_llep_token_budget: Optional[int] = knob(
        None, "PipelinedLLEP: tokens per chunk and source rank (c); required.", metavar="C")
    pipelined_llep_max_chunks: int = knob(
        10, "PipelinedLLEP: most chunks per layer (K_max).", metavar="K")
    llep_imbalance_threshold: Optional[float] = knob(
        None, "PipelinedLLEP: spill overloaded experts to the least-loaded ranks when the hottest "
        "rank's load exceeds this multiple of the mean (>= 1.0). Default: off.")
    llep_min_spill_tokens: int = knob(
        1024, "PipelinedLLEP: smallest number of tokens worth moving to a helper rank.")

    def check_values(self) -> None:
        """Refuse a missing or non-positive token budget, a cap or spill size below 1 and a
        threshold below 1.0 (nothing while PipelinedLLEP is off)."""
        if not self.pipelined_llep:
            return
        budget = self.pipelined_llep_token_budget
        if budget is None or budget <= 0:
            raise BoundedArgumentError(
                "--pipelined-llep needs --pipelined-llep-token-budget C > 0 (tokens per chunk and "
                f"source rank; e.g. ceil(N / 10)), got {budget}."
            )
        for flag, value in (("--pipelined-llep-max-chunks", self.pipelined_llep_max_chunks),
                            ("--llep-min-spill-tokens", self.llep_min_spill_tokens)):
            if value < 1:
                raise BoundedArgumentError(f"{flag} must be >= 1, got {value}.")
        threshold = self.llep_imbalance_threshold
        if threshold is not None and not threshold >= 1.0:
            raise BoundedArgumentError(
                f"--llep-imbalance-threshold is a ratio of the hottest rank's load to the mean and "
                f"must be >= 1.0 (e.g. 1.3), got {threshold}."
            )

    def check(self, args) -> None:
        """Refuse settings PipelinedLLEP cannot run: no MoE model, the values of
        :meth:`check_values`, and the MoE options it replaces."""
        if not self.pipelined_llep:
            return
        if args.num_experts is None:
            raise BoundedArgumentError("--pipelined-llep needs an MoE model (--num-experts).")
        self.check_values()
        conflicts = [
            (args.bounded_moe_backend == "upstream", "--bounded-moe-backend upstream"),
            (args.moe_expert_rank_capacity_factor is not None,
             "--moe-expert-rank-capacity-factor (chunks already have a no-drop static size)"),
            (args.moe_paged_stash, "--moe-paged-stash"),
            ((args.expert_tensor_parallel_size or 1) > 1, "--expert-tensor-parallel-size > 1"),
            (bool(getattr(args, "moe_latent_size", None)), "--moe-latent-size"),
            (args.moe_shared_expert_overlap, "--moe-shared-expert-overlap"),
        ]
        for is_set, what in conflicts:
            if is_set:
                raise BoundedArgumentError(
                    f"--pipelined-llep cannot be combined with {what}: remove one of them."
                )

    def dispatcher_text(self, ep_size: int) -> str:
        """What the MoE layers' dispatch runs, for the start-up line."""
        return (f"PipelinedLLEP chunked all-to-all (token budget {self.pipelined_llep_token_budget}"
                f" per chunk, at most {self.pipelined_llep_max_chunks} chunks, EP={ep_size})")

    def operators_text(self) -> list:
        """This operator's entries of the start-up line's operators part."""
        if not self.pipelined_llep:
            return []
        threshold = self.llep_imbalance_threshold
        if threshold is None:
            return ["PipelinedLLEP"]
        return ["PipelinedLLEP", f"LLEP balancing (threshold {threshold:g})"]


def pipelined_llep_live_bytes(num_tokens: int, hidden: int, ffn: int, topk: int, ep_size: int,
                              local_experts: int, budget: int, max_chunks: int,
                              act_bytes: int = 2, gated: bool = True) -> dict:
    """Bytes one rank's MoE layer holds at its peak in backward (the recomputed chunks), by part.

    With K chunks of c_eff = ceil(N / K) tokens (:func:`agree_num_chunks` on one rank), a chunk sends at most
    S = k·c_eff rows and receives at most R = E_p·k·c_eff (every source sending its whole chunk
    here: the bound is independent of the routing). Live together:

    * ``dispatch``: the send and receive rows of the chunk in flight and of the next one,
      2·(S + R)·H·b (one chunk when K = 1);
    * ``expert_backward``: one chunk's expert backward, R·b·(2·fc1 + 2F + H) (fc1 output and its
      gradient, the scaled activation and its gradient, the rows' gradient);
    * ``weight_grads``: the local experts' weight gradients E_local·(fc1 + F)·H·b.

    fc1 = 2F with a gated activation, else F.
    """
    k_chunks, c_eff = agree_num_chunks(num_tokens, budget, max_chunks)
    send = topk * c_eff
    receive = ep_size * topk * c_eff
    fc1 = (2 if gated else 1) * ffn
    in_flight = 2 if k_chunks > 1 else 1
    return {
        "dispatch": in_flight * (send + receive) * hidden * act_bytes,
        "expert_backward": receive * act_bytes * (2 * fc1 + 2 * ffn + hidden),
        "weight_grads": local_experts * (fc1 + ffn) * hidden * act_bytes,
    }
