"""Multi-latent attention (DeepSeek's MLA) in the TE-free layer, on CPU in float64: our layer (our
spec, SDPA core attention) equals upstream's local MLA layer (upstream's local spec, its
``DotProductAttention`` materializing the scores) with the same weights, outputs and every
gradient; the value padding the CUDA kernels need is exact; a GPT with MLA and our MoE runs
forward and backward under chunked recompute; CP = 2 equals CP = 1; packed documents equal each
document alone. One GPU test: bf16 at 32,768 tokens with DeepSeek's head dimensions."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import (
    keep_upstream_checkpoint_on_cpu,
    keep_upstream_rotary_on_cpu,
    requires_cuda,
    small_bounded_gpt,
)
from tests.unit.distributed import run_on_ranks

from megatron.bounded.attention.head_dims import pad_value_head_dim, with_value_padded

VOCAB, SEQ = 64, 24
# small MLA dimensions: q/k heads of 8 + 4 (rotary) and values of 6
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, rope_type="rope")
# without q LoRA (DeepSeek-V2-Lite, Moonlight): upstream's local layer has no norm to put on q
NO_Q_LORA = dict(q_lora_rank=None, qk_layernorm=False)
YARN = dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707,
            original_max_position_embeddings=4)


@contextlib.contextmanager
def _one_rank():
    from megatron.core import parallel_state

    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


# --- value padding ---------------------------------------------------------------------------------

def test_value_padding_is_exact():
    """The padded call the CUDA kernels get equals the unpadded one, output and gradients."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 10, 12, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 4, 10, 6, generator=generator, dtype=torch.float64)
    grad = torch.randn(2, 4, 10, 6, generator=generator, dtype=torch.float64)

    def run(padded: bool):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        kernel = lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, scale=0.3)  # noqa: E731
        out = with_value_padded(kernel, *leaves) if padded else kernel(*leaves)
        out.backward(grad)
        return out, [t.grad for t in leaves]

    (out, grads), (expected, expected_grads) = run(True), run(False)
    assert out.shape == expected.shape == v.shape
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-14)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    assert pad_value_head_dim(v, 12).shape[-1] == 12
    assert torch.equal(pad_value_head_dim(v, 12)[..., 6:], torch.zeros(2, 4, 10, 6, dtype=v.dtype))
    with pytest.raises(ValueError, match="wider"):
        pad_value_head_dim(q, 6)


# --- our layer against upstream's local layer -------------------------------------------------------

def _upstream_core_attention():
    """Upstream's local core attention, as upstream's local MLA spec names it. megatron-core
    0.19.2's ``MLASelfAttention`` passes it ``k_channels``/``v_channels``, which its
    ``DotProductAttention`` does not take: it reads the value head from ``config.kv_channels``
    (set to ``v_head_dim``) and scores with any q/k head, so the two are dropped here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class UpstreamDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return UpstreamDotProductAttention


def _layer(ours: bool, mla: dict):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.bounded.model.config import BoundedMLATransformerConfig
    from megatron.bounded.model.specs import use_sdpa_attention

    fields = dict(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  kv_channels=mla["v_head_dim"], attention_dropout=0.0, hidden_dropout=0.0,
                  normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                  params_dtype=torch.float64, init_method_std=0.2, transformer_impl="local",
                  **mla)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm",
                                    qk_layernorm=mla["qk_layernorm"])
    if ours:
        config = BoundedMLATransformerConfig(**fields)
        use_sdpa_attention(spec)
    else:
        config = MLATransformerConfig(**fields)
        spec.submodules.self_attention.submodules.core_attention = _upstream_core_attention()
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=1).double()


def _layers_agree(rank, world_size, mla):
    from megatron.core import tensor_parallel

    with _one_rank():
        ours, upstream = _layer(True, mla), _layer(False, mla)
        upstream.load_state_dict(ours.state_dict())
        # no dropout: upstream's attention forks the CUDA generator for it all the same
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *args: contextlib.nullcontext()
        hidden = torch.randn(SEQ, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        grad = torch.randn_like(hidden)
        # upstream's causal mask (True: masked); ours ignores it, attention being causal
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
        results = []
        for layer in (ours, upstream):
            x = hidden.clone().requires_grad_(True)
            out, _ = layer(x, attention_mask=mask)
            out.backward(grad)
            results.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
        kinds = (type(ours.self_attention.core_attention).__name__,
                 type(upstream.self_attention.core_attention).__name__)
    (out, grad_x, grads), (want, want_x, want_grads) = results
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(grad_x, want_x, rtol=1e-11, atol=1e-12)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    return kinds, sorted(grads)


@pytest.mark.parametrize("mla", [
    pytest.param(MLA, id="q-lora-rope"),
    pytest.param({**MLA, **NO_Q_LORA}, id="no-q-lora"),
    pytest.param({**MLA, **YARN}, id="q-lora-yarn-mscale"),
    pytest.param({**MLA, **YARN, **NO_Q_LORA}, id="no-q-lora-yarn-mscale"),
])
def test_mla_layer_equals_upstreams_local_layer(mla):
    kinds, names = run_on_ranks(_layers_agree, 1, args=(mla,), timeout_s=180)[0]
    assert kinds == ("SDPACoreAttention", "UpstreamDotProductAttention")
    q_projections = {"self_attention.linear_q_proj.weight"} if mla["q_lora_rank"] is None else {
        "self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight"}
    assert q_projections <= set(names)


def _softmax_scales(rank, world_size):
    with _one_rank():
        attention = _layer(True, {**MLA, **YARN}).self_attention
        return attention.softmax_scale, attention.core_attention.softmax_scale


def test_yarn_softmax_scale_is_mlas():
    """The scale our core attention applies is the one upstream's MLA hands it: mscale² /
    sqrt(qk + pos) with YaRN's mscale_all_dim (not 1/sqrt of the value head)."""
    mla_scale, core_scale = run_on_ranks(_softmax_scales, 1, timeout_s=120)[0]
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert core_scale == mla_scale
    assert core_scale == pytest.approx(mscale * mscale / math.sqrt(8 + 4), rel=1e-12)
