"""Error measures and the dispatcher round trip shared by the MoE tests (dispatcher, PipelinedLLEP);
the context-parallel comparison of GPT models (packed documents, multi-latent attention)."""

from __future__ import annotations

import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (||a|| when b is all zeros)."""
    a, b = a.double(), b.double()
    denom = b.norm()
    if denom == 0:
        return a.norm().item()
    return ((a - b).norm() / denom).item()


def moe_errors(ours: dict, ref: dict, rank: int, local: int) -> dict:
    """Relative errors of output, grad x, grad probs and grad w1 / w2 (this rank's expert slice
    of ``local`` experts); each dict has ``out`` and ``grads`` = (x, probs, w1, w2)."""
    sl = slice(rank * local, (rank + 1) * local)
    return {
        "out": relative_error(ours["out"], ref["out"]),
        "x": relative_error(ours["grads"][0], ref["grads"][0]),
        "probs": relative_error(ours["grads"][1], ref["grads"][1]),
        "w1": relative_error(ours["grads"][2], ref["grads"][2][sl]),
        "w2": relative_error(ours["grads"][3], ref["grads"][3][sl]),
    }


def dispatch_experts_combine(dispatcher, x, routing_map, probs, experts):
    """A token dispatcher's whole round trip (ours or upstream's, same interface): dispatch,
    ``experts(rows, tokens_per_expert, probs) -> rows``, combine. Returns the token output, the
    experts' ``tokens_per_expert`` and their input rows."""
    rows, row_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    rows, row_probs = dispatcher.token_dispatch(rows, row_probs)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(rows, row_probs)
    y = experts(rows, tokens_per_expert, row_probs)
    y = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(y)))
    return y, tokens_per_expert, rows


def assert_context_parallel_share(model, tokens, expected, documents=None) -> tuple:
    """Run ``model`` (context parallel over upstream's CP group) on this rank's zigzag share of
    ``tokens`` [b, s + 1]: its losses must be that share of ``expected`` (losses [b, s], grads by
    name, of the same model on one rank) and its gradients, summed over the CP ranks, those of
    ``expected``. Returns the local losses' shape."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = parallel_state.get_context_parallel_group()
    batch, seq = tokens.shape[0], tokens.shape[1] - 1
    local = get_batch_on_this_cp_rank(
        {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
         "position_ids": torch.arange(seq).expand(batch, seq)}, False, cp_group=group)
    model.train()
    losses = model(local["tokens"], local["position_ids"], attention_mask=None,
                   labels=local["labels"], packed_seq_params=documents)
    losses.sum().backward()
    share = get_batch_on_this_cp_rank({"x": expected[0]}, False, cp_group=group)["x"]
    torch.testing.assert_close(losses.detach(), share, rtol=1e-12, atol=1e-13)
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each rank's tokens give their part
        torch.testing.assert_close(param.grad, expected[1][name], rtol=1e-10, atol=1e-13,
                                   msg=name)
    return tuple(losses.shape)
