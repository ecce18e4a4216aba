"""A GPT model with context parallelism on CPU (2 gloo ranks): the TE-free layer spec, upstream's
zigzag batch split and rotary embeddings, and our sequence-to-head attention together give every
token the loss, and every weight the gradient, of the same model on the whole sequence."""

from __future__ import annotations

import torch

from tests.conftest import keep_upstream_rotary_on_cpu
from tests.unit.distributed import run_on_ranks

SEQ, BATCH, VOCAB = 16, 2, 64


def _model(context_parallel_size):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bounded.model.specs import use_sdpa_attention

    config = TransformerConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, kv_channels=8, attention_dropout=0.0, hidden_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float64,
        context_parallel_size=context_parallel_size, cp_comm_type="a2a",
        init_method_std=0.2,
    )
    torch.manual_seed(0)
    spec = use_sdpa_attention(get_gpt_layer_local_spec(normalization="RMSNorm"))
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).double()


def _losses_and_grads(model, batch):
    losses = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    losses.sum().backward()
    return losses.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _body(rank, world_size):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    keep_upstream_rotary_on_cpu()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    batch = {
        "tokens": tokens[:, :-1], "labels": tokens[:, 1:],
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
    }

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=1)
    try:
        expected_losses, expected_grads = _losses_and_grads(_model(1), batch)
    finally:
        parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world_size)
    try:
        cp_group = parallel_state.get_context_parallel_group()
        local = get_batch_on_this_cp_rank(dict(batch), False, cp_group=cp_group)
        losses, grads = _losses_and_grads(_model(world_size), local)
        expected_share = get_batch_on_this_cp_rank({"x": expected_losses}, False, cp_group=cp_group)["x"]
        torch.testing.assert_close(losses, expected_share, rtol=1e-9, atol=1e-12)
        for name, grad in grads.items():
            dist.all_reduce(grad, group=cp_group)  # each rank's tokens contribute their part
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-8, atol=1e-12, msg=name)
    finally:
        parallel_state.destroy_model_parallel()
    return losses.shape


def test_context_parallel_gpt_equals_the_whole_sequence_model():
    shapes = run_on_ranks(_body, 2, timeout_s=180)
    assert shapes == [(BATCH, SEQ // 2)] * 2
