"""DeepSeek-V3.2 (``model_type`` ``deepseek_v32``): DeepSeek-V3's multi-latent attention and MoE
(:mod:`megatron.bounded.convert.deepseek_v3`) with the lightning indexer of DeepSeek sparse
attention on every layer, converted onto ``--experimental-attention-variant dsa``
(:mod:`megatron.bounded.model.dsa`).

The indexer's tensors keep their layouts: ``indexer.wq_b`` -> ``linear_wq_b`` (per head
``index_head_dim`` rows, the rotary ones first), ``indexer.wk`` -> ``linear_wk``, the key
LayerNorm ``indexer.k_norm`` (weight and bias) -> ``k_norm``, ``indexer.weights_proj`` ->
``linear_weights_proj``; ``index_n_heads``, ``index_head_dim`` and ``index_topk`` are
``--dsa-indexer-n-heads``, ``--dsa-indexer-head-dim`` and ``--dsa-indexer-topk``.

Both indexers compute the same scores, written differently:

* rotary embedding on the first ``qk_rope_head_dim`` channels of each query head and of the
  key, rotate-half (not the interleaved pairs of the main attention): megatron-core's indexer
  without ``--dsa-indexer-rope-interleaved``; with YaRN both scale cos and sin by the same
  mscale ratio;
* transformers scales each head's ``q · k`` by ``index_head_dim^-1/2`` before the ReLU and the
  weights by ``index_n_heads^-1/2``; megatron-core folds both factors into the weights. The
  factor is positive, so ``ReLU(c·x) = c·ReLU(x)``: the same sum over heads;
* megatron-core rotates q and k by the orthonormal Hadamard matrix before the dot product
  (DeepSeek's reference does, for its FP8 scoring); transformers does not: ``(Hq)·(Hk) = q·k``,
  so only the rounding differs. Kept on for a power-of-two ``index_head_dim`` (the release's
  128), off (``--no-dsa-indexer-rotate-activation``) otherwise;
* transformers' key LayerNorm has epsilon 1e-6 whatever the config says:
  ``--dsa-indexer-k-norm-epsilon 1e-6``;
* each query keeps its ``index_topk`` best causal keys, ties aside (either may break them
  either way), and attends to them only: transformers' eager and SDPA paths mask every other key.

Dense and MoE layers follow ``mlp_layer_types`` (transformers' decoder layer reads it; it
defaults to the first ``first_k_dense_replace`` layers dense).
"""

from __future__ import annotations

import megatron.bounded.convert.core as core
from megatron.bounded.convert import deepseek_v3, sigmoid_moe

MODEL_TYPE = "deepseek_v32"
skipped = sigmoid_moe.skipped
# transformers' indexer LayerNorm uses this epsilon whatever rms_norm_eps says
INDEXER_NORM_EPSILON = 1e-6
_INDEXER = (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
            ("linear_weights_proj.weight", "weights_proj.weight"))


def dense_layers(config: core.HFConfig) -> set:
    """The layers with a dense MLP: the ``"dense"`` entries of ``mlp_layer_types``, or the first
    ``first_k_dense_replace`` layers when it is absent."""
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return sigmoid_moe.first_dense_layers(config)
    layers = config["num_hidden_layers"]
    if len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
        raise core.refuse(f"config.json sets mlp_layer_types = {kinds} (the deepseek_v32 mapping "
                          f"takes {layers} entries, each 'dense' or 'sparse')",
                          "restore the model's own config.json")
    return {layer for layer, kind in enumerate(kinds) if kind == "dense"}


def indexer_flags(config: core.HFConfig) -> list:
    """``--experimental-attention-variant dsa`` and the indexer's flags."""
    heads, width, topk = (config[key] for key in ("index_n_heads", "index_head_dim", "index_topk"))
    rotary = config["qk_rope_head_dim"]
    if width < rotary:
        raise core.refuse(f"index_head_dim = {width} is below qk_rope_head_dim = {rotary} (the "
                          "indexer rotates its first qk_rope_head_dim channels)",
                          "convert a model whose indexer heads hold the rotary channels")
    flags = ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", heads,
             "--dsa-indexer-head-dim", width, "--dsa-indexer-topk", topk,
             "--dsa-indexer-k-norm-epsilon", INDEXER_NORM_EPSILON]
    if width & (width - 1):  # the Hadamard rotation needs a power of two; transformers has none
        flags.append("--no-dsa-indexer-rotate-activation")
    return flags


def flags(config: core.HFConfig) -> list:
    attention = deepseek_v3.mla_flags(config) + indexer_flags(config)
    return core.decoder_flags(config, attention=attention, mlp=core.swiglu_flags(config)) + \
        sigmoid_moe.flags(config, dense_layers(config))


def indexer_rules(layer: int) -> list:
    ours = f"decoder.layers.{layer}.self_attention.core_attention.indexer."
    hf = f"model.layers.{layer}.self_attn.indexer."
    return [core.same(ours + mine, hf + theirs) for mine, theirs in _INDEXER]


def rules(config: core.HFConfig) -> list:
    dense = dense_layers(config)
    return core.model_rules(config, lambda i: deepseek_v3.attention_rules(i) + indexer_rules(i)
                            + sigmoid_moe.mlp_rules(config, i, False, dense))
