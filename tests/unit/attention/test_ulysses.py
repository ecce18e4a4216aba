"""Context-parallel SDPA attention (sequence-to-head all-to-all) against single-rank attention on
the whole sequence, on 2 and 4 gloo ranks: values and gradients of query, key and value."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron.bounded.attention.core import check_sdpa_attention_supported
from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.attention.context_parallel import expanded_query_groups, zigzag_to_natural
from tests.unit.distributed import run_on_ranks
from tests.unit.attention.test_attention import _config, reference_attention

SEQ, BATCH, HEAD_DIM = 32, 2, 8


class _Groups:
    def __init__(self, cp):
        self.cp = cp
        self.tp = _SingleRank()


class _SingleRank:
    def size(self):
        return 1


def _zigzag_share(full: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of a [S, ...] tensor, cut the way upstream's data path cuts them."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch_first = {"x": full.transpose(0, 1).contiguous()}  # upstream splits dim 1 of [b, S, ...]
    return get_batch_on_this_cp_rank(batch_first, False, cp_group=dist.group.WORLD)["x"].transpose(0, 1)


LAYOUTS = [(8, 8), (8, 4), (8, 2), (4, 1)]  # (heads, query groups): split, split, repeated


def _body(rank, world_size):
    for heads, groups in LAYOUTS:
        _check_layout(rank, world_size, heads, groups)


def _check_layout(rank, world_size, heads, groups):
    from megatron.bounded.attention.core import SDPACoreAttention
    from megatron.core.transformer.enums import AttnMaskType

    generator = torch.Generator().manual_seed(heads * 10 + groups)
    full = [
        torch.randn(SEQ, BATCH, n, HEAD_DIM, dtype=torch.float64, generator=generator)
        for n in (heads, groups, groups)
    ]
    grad_out = torch.randn(SEQ, BATCH, heads * HEAD_DIM, dtype=torch.float64, generator=generator)
    leaves = [t.clone().requires_grad_() for t in full]
    expected = reference_attention(*leaves, 1.0 / math.sqrt(HEAD_DIM))
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)

    config = _config(heads, groups, HEAD_DIM, context_parallel_size=world_size, cp_comm_type="a2a")
    attention = SDPACoreAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=_Groups(dist.group.WORLD),
    )
    local = [_zigzag_share(t).clone().requires_grad_() for t in full]
    out = attention(*local, attention_mask=None)
    assert out.shape == (SEQ // world_size, BATCH, heads * HEAD_DIM)
    grads = torch.autograd.grad(out, local, _zigzag_share(grad_out))
    torch.testing.assert_close(out, _zigzag_share(expected), rtol=1e-10, atol=1e-10)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, _zigzag_share(expected_grad), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_equals_whole_sequence_attention(world_size):
    run_on_ranks(_body, world_size)


def test_zigzag_chunk_order():
    natural_from_gathered, gathered_from_natural = zigzag_to_natural(2)
    # gathered = [c0, c3, c1, c2] (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)
    assert natural_from_gathered.tolist() == [0, 2, 3, 1]
    assert gathered_from_natural[natural_from_gathered].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("groups,cp,expected", [(8, 4, 8), (8, 16, 16), (2, 4, 4), (1, 4, 4), (6, 4, 12)])
def test_key_value_heads_are_repeated_to_split_over_the_ranks(groups, cp, expected):
    assert expanded_query_groups(groups, cp) == expected


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"context_parallel_size": 2}, "--cp-comm-type p2p.*pass --cp-comm-type a2a"),
        ({"context_parallel_size": 2, "cp_comm_type": "p2p"}, "--cp-comm-type p2p"),
        ({"context_parallel_size": 16, "cp_comm_type": "a2a"}, "16 with 8 attention heads"),
        ({"context_parallel_size": 2, "cp_comm_type": "a2a", "tensor_model_parallel_size": 8},
         "2 with 1 attention heads per tensor-parallel rank"),
    ],
)
def test_context_parallel_layouts_the_exchange_cannot_run_are_refused(overrides, message):
    from types import SimpleNamespace

    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, tensor_model_parallel_size=1,
                             cp_comm_type=None)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(BoundedArgumentError, match=message):
        check_sdpa_attention_supported(config)
