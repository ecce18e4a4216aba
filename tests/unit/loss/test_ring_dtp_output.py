"""Ring-DTP wired into a GPT model: output-layer sharding hook, loss processor, layout checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.bounded.launch.arguments import BoundedArgumentError, validate_bounded_args
from tests.unit.distributed import run_on_ranks
from tests.unit.launch.test_arguments import parse, without_te  # noqa: F401  (fixture)

VOCAB, HIDDEN, SEQ, BATCH = 12, 8, 5, 2


class _OutputLayer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0


class _Model(torch.nn.Module):
    """What the hook and processor touch: post_process and output_layer (behind a wrapper)."""

    def __init__(self, weight):
        super().__init__()
        self.post_process = True
        self.output_layer = _OutputLayer(weight)


class _Wrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def _full_weight():
    torch.manual_seed(0)
    return torch.randn(VOCAB, HIDDEN, dtype=torch.float64)


def _batch(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return hidden, labels


def _ring_body(rank, world_size, mode, chunk_tokens, grad_in_forward=False):
    from megatron.bounded.loss.ring_dtp import RingDTPLoss, shard_output_layer

    group = torch.distributed.group.WORLD
    model = _Model(_full_weight())
    chunks = shard_output_layer([_Wrapper(model)], group=group)
    layer = chunks[0].module.output_layer
    start, end = rank * VOCAB // world_size, (rank + 1) * VOCAB // world_size
    assert torch.equal(layer.weight.detach(), _full_weight()[start:end])
    assert layer.weight.allreduce is False and layer.weight.tensor_model_parallel is True
    sharded = layer.sharded_state_dict(prefix="output_layer.")["output_layer.weight"]
    assert sharded.global_shape == (VOCAB, HIDDEN) and sharded.global_offset == (start, 0)

    hidden, labels = _batch(rank)
    hidden.requires_grad_(True)
    from megatron.bounded.loss.ring_dtp import reset_ring_dtp_stats, ring_dtp_stats

    reset_ring_dtp_stats()
    loss = RingDTPLoss(mode, chunk_tokens, group=group, grad_in_forward=grad_in_forward)(
        hidden_states=hidden, output_layer=layer, labels=labels, loss_mask=None
    )
    assert loss.shape == (BATCH, SEQ)
    strips_in_forward = ring_dtp_stats()["num_strips"]
    loss.sum().backward()  # a sum: one loss-gradient value for every token
    replayed = ring_dtp_stats()["num_strips"] - strips_in_forward
    assert replayed == (0 if grad_in_forward else strips_in_forward)

    # reference: the full weight on this rank's batch; its weight gradient summed over ranks
    full = _full_weight().requires_grad_(True)
    reference_loss = torch.zeros(())
    for source in range(world_size):
        ref_hidden, ref_labels = _batch(source)
        ref_hidden.requires_grad_(source == rank)
        logits = ref_hidden.transpose(0, 1) @ full.T  # [b, s, V]
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), ref_labels.reshape(-1), reduction="none")
        if source == rank:
            torch.testing.assert_close(loss.double(), per_token.view(BATCH, SEQ), rtol=1e-6, atol=1e-6)
            reference_loss = per_token.sum()
            reference_hidden = ref_hidden
        else:
            per_token.sum().backward()
    reference_loss.backward()
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, full.grad[start:end], rtol=1e-6, atol=1e-6)
    return True


@pytest.mark.parametrize("mode,chunk_tokens,grad_in_forward", [
    ("weights", None, False), ("activations", 3, False), ("auto", None, False),
    ("activations", 3, True),
])
def test_sharded_output_layer_loss_matches_full_vocabulary_reference(mode, chunk_tokens, grad_in_forward):
    assert run_on_ranks(_ring_body, 2, args=(mode, chunk_tokens, grad_in_forward)) == [True, True]


def test_labels_for_loss_ignores_masked_tokens():
    from megatron.bounded.loss.ring_dtp import IGNORE_INDEX, labels_for_loss

    labels = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    assert labels_for_loss(labels, mask).tolist() == [[5, IGNORE_INDEX, 7], [IGNORE_INDEX, 9, 10]]
    assert labels.tolist() == [[5, 6, 7], [8, 9, 10]]  # not in place


def test_loss_needs_labels():
    from megatron.bounded.loss.ring_dtp import RingDTPLoss

    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    with pytest.raises(ValueError, match="labels are required"):
        RingDTPLoss()(hidden_states=hidden, output_layer=_OutputLayer(_full_weight()), labels=None)


RING_FLAGS = ["--ring-dtp", "--untie-embeddings-and-output-weights"]


def _validated(monkeypatch, world_size, *flags):
    from megatron.bounded.upstream import patches
    from megatron.training.arguments import validate_args

    patches.apply_patches()  # as pretrain_gpt.py does (flag validation without a GPU)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = parse(monkeypatch, *flags)
    validate_args(args, {})
    return args


@pytest.mark.parametrize(
    "world_size,flags,message",
    [
        (2, ["--ring-dtp"], "tied embedding"),
        (2, RING_FLAGS + ["--num-experts", "4", "--moe-router-topk", "2"], "--expert-model-parallel-size"),
        (2, RING_FLAGS + ["--ring-dtp-chunk-tokens", "0"], "--ring-dtp-chunk-tokens must be a positive"),
        (3, RING_FLAGS + ["--make-vocab-size-divisible-by", "128", "--global-batch-size", "3",
                          "--num-experts", "3", "--moe-router-topk", "1", "--expert-model-parallel-size", "3"],
         "multiple of the data-parallel × context-parallel size \\(3\\)"),
        (2, RING_FLAGS, "an MoE model with --expert-model-parallel-size"),
        (2, ["--ring-dtp-grad-in-forward"], "--ring-dtp-grad-in-forward has no effect without --ring-dtp"),
        (1, ["--ring-dtp-gradient-rows", "1024"], "no effect without --ring-dtp"),
        (1, RING_FLAGS + ["--ring-dtp-gradient-rows", "1024"],
         "--ring-dtp-gradient-rows needs --ring-dtp-chunk-tokens"),
        (1, RING_FLAGS + ["--ring-dtp-chunk-tokens", "768", "--ring-dtp-gradient-rows", "1000"],
         "--ring-dtp-gradient-rows must be a positive multiple of --ring-dtp-chunk-tokens"),
        (2, RING_FLAGS + ["--num-experts", "4", "--moe-router-topk", "2",
                          "--expert-model-parallel-size", "2", "--ring-dtp-chunk-tokens", "64",
                          "--ring-dtp-gradient-rows", "128"], "one rank only"),
    ],
)
def test_ring_dtp_layout_misuse_is_refused(monkeypatch, without_te, world_size, flags, message):  # noqa: F811
    args = _validated(monkeypatch, world_size, *flags)
    with pytest.raises(BoundedArgumentError, match=message):
        validate_bounded_args(args)


def test_ring_dtp_gradient_rows_on_one_rank_pass_and_reach_the_loss(monkeypatch, without_te):  # noqa: F811
    args = _validated(monkeypatch, 1, *RING_FLAGS, "--ring-dtp-chunk-tokens", "768",
                      "--ring-dtp-gradient-rows", "3072")
    validate_bounded_args(args)
    assert args.ring_dtp_gradient_rows == 3072
    from megatron.bounded.loss.ring_dtp import output

    seen = {}
    monkeypatch.setattr(output, "ring_dtp_cross_entropy",
                        lambda tokens, *a, **kw: seen.update(kw) or tokens.sum(dim=1))
    loss = output.RingDTPLoss(chunk_tokens=768, group=object(), gradient_rows=3072)(
        hidden_states=torch.ones(4, 2, HIDDEN, dtype=torch.float64),
        output_layer=_OutputLayer(_full_weight()), labels=torch.zeros(2, 4, dtype=torch.int64))
    assert loss.shape == (2, 4) and seen["gradient_rows"] == 3072 and seen["chunk_tokens"] == 768


def test_ring_dtp_with_tensor_parallelism_is_refused(monkeypatch, without_te):  # noqa: F811
    args = _validated(monkeypatch, 2, *RING_FLAGS)
    args.tensor_model_parallel_size = 2  # upstream's own TP checks need CUDA; ours do not
    with pytest.raises(BoundedArgumentError, match="--tensor-model-parallel-size"):
        validate_bounded_args(args)


def test_ring_dtp_with_expert_parallel_over_all_ranks_passes(monkeypatch, without_te):  # noqa: F811
    args = _validated(
        monkeypatch, 2, *RING_FLAGS, "--num-experts", "4", "--moe-router-topk", "2",
        "--expert-model-parallel-size", "2",
    )
    validate_bounded_args(args)


def test_ring_dtp_over_data_and_context_parallel_ranks_passes(monkeypatch, without_te):  # noqa: F811
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = _validated(
        monkeypatch, 4, *RING_FLAGS, "--num-experts", "4", "--moe-router-topk", "2",
        "--expert-model-parallel-size", "4", "--context-parallel-size", "2", "--cp-comm-type", "a2a",
    )
    assert (args.data_parallel_size, args.context_parallel_size) == (2, 2)
    validate_bounded_args(args)  # the ring spans DP × CP = 4 ranks = the expert-parallel group


def test_ring_dtp_needs_one_rank_per_expert_shard_across_context_parallel_ranks(monkeypatch, without_te):  # noqa: F811
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = _validated(
        monkeypatch, 4, *RING_FLAGS, "--num-experts", "4", "--moe-router-topk", "2",
        "--expert-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "a2a",
    )
    with pytest.raises(BoundedArgumentError, match="data-parallel × context-parallel size \\(4\\)"):
        validate_bounded_args(args)
