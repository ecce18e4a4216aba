"""Deterministic top-k routings for the MoE tests (dispatcher, PipelinedLLEP, MoE layer).

``make_routing(kind, num_tokens, num_experts, topk, seed, ep_size=1)`` returns one rank's
``routing_map`` ``[N, E]`` (bool) and ``probs`` ``[N, E]`` (fp32, the softmax scores of the
chosen experts, zero elsewhere), the same for the same arguments on every machine. Experts are
laid out rank by rank (E / ep_size local experts each). Kinds:

``balanced``   random logits: every expert about equally loaded.
``skew``       expert 0 is in every token's top-k.
``skew80``     80% of the tokens go to expert 0 (plus k - 1 others); the rest at random.
``skew80_split``  top-1 only: the first 80% of the tokens to expert 0, the rest to the last
               rank's experts.
``one_rank``   every pair of every token goes to rank 0's experts (the receive worst case; needs
               topk <= E / ep_size).
``hot2``       two hot experts on different ranks: expert 0 and the last one, 45% of tokens each.
``zipf``       expert popularity ~ 1 / (index + 1)^1.2, sampled with Gumbel noise.
"""

from __future__ import annotations

import torch

KINDS = ("balanced", "skew", "skew80", "skew80_split", "one_rank", "hot2", "zipf")


def make_routing(kind: str, num_tokens: int, num_experts: int, topk: int, seed: int,
                 ep_size: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    local = num_experts // ep_size
    if kind == "skew":
        logits[:, 0] += 100.0
    elif kind == "skew80":
        cut = (num_tokens * 4) // 5
        logits[:cut, 0] += 100.0
    elif kind == "skew80_split":
        assert topk == 1
        cut = (num_tokens * 4) // 5
        logits[:cut, 0] += 100.0
        logits[cut:, num_experts - local:] += 100.0
    elif kind == "one_rank":
        assert topk <= local
        logits[:, :local] += 100.0
    elif kind == "hot2":
        cut = (num_tokens * 9) // 20
        logits[:cut, 0] += 100.0
        logits[cut:2 * cut, num_experts - 1] += 100.0
    elif kind == "zipf":
        popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32) ** 1.2
        u = torch.rand(num_tokens, num_experts, generator=g).clamp_(1e-6, 1 - 1e-6)
        logits = popularity.log() - torch.log(-torch.log(u))
    elif kind != "balanced":
        raise ValueError(f"unknown routing kind {kind!r}; one of {KINDS}")
    scores = logits.softmax(dim=-1)
    val, idx = scores.topk(topk, dim=-1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(num_tokens, num_experts).scatter(1, idx, val)
    return routing_map, probs
