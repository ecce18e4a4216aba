"""tools/convert_hf.py on DeepSeek-V3.2 (``model_type`` ``deepseek_v32``): a small model made with
transformers' ``DeepseekV32ForCausalLM`` (random weights, saved locally; 4 layers, the first
dense, the others MoE; YaRN; a lightning indexer of 8 heads of 16, top-8) imported onto
``--experimental-attention-variant dsa``:

* at 8 tokens (= top-k: every causal key selected, sparse attention is dense MLA) and at 32
  tokens (each query past the 8th attends to 8 of its keys, in transformers' eager/SDPA path as in
  ours) our logits are transformers' within 1e-5 of the largest logit; at 32 tokens the sparse
  selection matters (transformers' own logits with every key selected are far off);
* given the same hidden states and query latent, every layer's indexer scores (ours with the
  Hadamard rotation, transformers' without) agree within 1e-5 of the largest score and select the
  same keys on every row; the test asserts that no row's k-th and (k+1)-th scores tie, where
  either implementation may keep either key;
* the export of the import gives back every tensor bitwise and the same config.json;
* what the mapping does not convert is refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron.bounded.launch.commands import hf_conversion

from tests.unit.convert.test_convert_hf import (
    fake_model, in_own_process, refusal, save_random_model, tensors_of,
)

TOLERANCE = 1e-5
TOPK, LONG = 8, 32
FIELDS = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=128, intermediate_size=48,
    n_routed_experts=8, moe_intermediate_size=16, num_experts_per_tok=2, first_k_dense_replace=1,
    n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=24,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
    index_n_heads=8, index_head_dim=16, index_topk=TOPK,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                         mscale_all_dim=0.7, original_max_position_embeddings=4096,
                         beta_fast=32, beta_slow=1))


def save_v32(directory: Path, seed: int, **changes) -> Path:
    import transformers

    return save_random_model(transformers.DeepseekV32Config(**{**FIELDS, **changes}), directory,
                             seed)


class _IndexerCapture(torch.overrides.TorchFunctionMode):
    """Records, for each of transformers' indexers, its inputs (hidden states, query latent) and
    the scores it takes the top-k of (the [b, s, t] tensor of ``topk`` inside the indexer)."""

    def __init__(self, model):
        super().__init__()
        self.layer, self.found = None, {}
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.indexer.register_forward_pre_hook(
                lambda module, args, i=i: self._enter(i, args))
            layer.self_attn.indexer.register_forward_hook(
                lambda module, args, output, i=i: self._leave(output))

    def _enter(self, layer, args):
        self.layer = layer
        self.found[layer] = {"x": args[0].detach().clone(), "qr": args[1].detach().clone()}

    def _leave(self, output):
        self.found[self.layer]["indices"] = output.long()
        self.layer = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk and self.layer is not None:
            self.found[self.layer]["scores"] = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


def _transformers_indexers(source: str, tokens: torch.Tensor) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    capture = _IndexerCapture(model)
    with torch.no_grad(), capture:
        model(tokens)
    return capture.found


def _indexer_comparison(tool, source: str, checkpoint: str) -> list:
    """Per layer: our indexer (loaded from the checkpoint) on transformers' indexer inputs."""
    from megatron.bounded.attention.sparse_indexer import blockwise_topk, index_scores

    theirs = _transformers_indexers(source, tool.verification_tokens(source, LONG))
    causal = torch.ones(LONG, LONG, dtype=torch.bool).tril()
    compared = []
    with tool.one_process():
        model = tool.build_model(tool.pipeline.read_args_file(checkpoint), LONG, torch.float32)
        tool.load_into(model, checkpoint)
        model.eval()
        for i, layer in enumerate(model.decoder.layers):
            indexer, found = layer.self_attention.core_attention.indexer, theirs[i]
            with torch.no_grad():
                q, k, weights = indexer.forward_before_topk(found["x"].transpose(0, 1),
                                                            found["qr"].transpose(0, 1))
                ours = index_scores(q, weights, k)[0]
                selected = blockwise_topk(q, weights, k, TOPK)[0]
            reference = found["scores"][0]
            difference = (ours - reference).masked_fill(~causal, 0).abs().max()
            # rows TOPK - 1 on have at least TOPK causal keys: the selection is a choice there
            rows = range(TOPK - 1, LONG)
            ranked = [reference[r, :r + 1].sort(descending=True).values for r in rows]
            gaps = [(row[TOPK - 1] - row[TOPK]).item() for row in ranked if len(row) > TOPK]
            compared.append({
                "score_difference": (difference / reference[causal].abs().max()).item(),
                "smallest_gap": min(gaps) / reference[causal].abs().max().item(),
                "rows_differing": [r for r in rows if set(selected[r].tolist())
                                   != set(found["indices"][0, r].tolist())],
                "rotates": indexer.rotate})
    return compared


def _conversions(rank, world_size, root):
    from transformers import AutoModelForCausalLM

    tool, root = hf_conversion, Path(root)
    source, other = save_v32(root / "v32", seed=1), save_v32(root / "v32-other", seed=2)
    checkpoint, exported = root / "ckpt", root / "export"
    assert tool.run(["import", "--hf-dir", str(source), "--output", str(checkpoint),
                      "--dtype", "fp32"]) == 0
    assert tool.run(["export", "--load", str(checkpoint), "--output", str(exported)]) == 0
    original, back = tensors_of(source), tensors_of(exported)
    tokens = tool.verification_tokens(str(source), LONG)
    dense = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32,
                                                 index_topk=LONG).eval()
    with torch.no_grad():
        dense_logits = dense(tokens).logits
    odd_width = tool.model_layout(tool.pipeline.read_args_file(str(checkpoint)) + [
        "--dsa-indexer-head-dim", "24", "--no-dsa-indexer-rotate-activation"], torch.float32)
    return {
        "source": str(source),
        "at_topk": tool.logit_difference(str(source), str(checkpoint), TOPK),
        "above_topk": tool.logit_difference(str(source), str(checkpoint), LONG),
        "dense_vs_sparse": tool.relative_difference(tool.hf_logits(str(source), tokens),
                                                    dense_logits),
        "other_model": tool.run(["verify", "--hf-dir", str(other), "--load", str(checkpoint),
                                  "--tokens", str(LONG)]),
        "indexers": _indexer_comparison(tool, str(source), str(checkpoint)),
        "names": sorted(original) == sorted(back),
        "indexer_names": sorted(n for n in original if ".indexer." in n),
        "bitwise": [n for n in original if n in back and not (
            original[n].dtype == back[n].dtype and torch.equal(original[n], back[n]))],
        "config": json.loads((exported / "config.json").read_text())
        == json.loads((source / "config.json").read_text()),
        "args": (checkpoint / "pretrain_args.txt").read_text(),
        "odd_width_wq_b": odd_width.tensors[
            "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight"][0],
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return in_own_process(tmp_path_factory, _conversions, "convert_hf_v32")


def test_logits_at_a_length_where_every_key_is_selected(converted):
    assert converted["at_topk"] <= TOLERANCE
    assert converted["other_model"] == 1  # the check can fail: another model is far off


def test_logits_above_topk_follow_transformers_sparse_selection(converted):
    assert converted["above_topk"] <= TOLERANCE
    # the selection matters at this length: transformers with every key selected is far off
    assert converted["dense_vs_sparse"] > 1e-3


def test_indexer_scores_and_selection_equal_transformers(converted):
    layers = converted["indexers"]
    assert len(layers) == 4
    for layer in layers:
        assert layer["rotates"]  # index_head_dim 16: with the Hadamard rotation
        assert layer["score_difference"] <= TOLERANCE, layer
        # on every row the k-th and (k+1)-th scores are further apart than the two indexers'
        # scores (relative to the largest score): no tie, the same selection is defined
        assert layer["smallest_gap"] > 10 * layer["score_difference"], layer
        assert layer["rows_differing"] == [], layer


def test_export_of_the_import_gives_back_every_tensor_bitwise(converted):
    assert converted["names"] and converted["bitwise"] == [] and converted["config"]
    assert len(converted["indexer_names"]) == 4 * 5  # wq_b, wk, k_norm weight/bias, weights_proj


def test_flags_name_the_indexer(converted):
    args = converted["args"]
    for flag in ("--multi-latent-attention", "--rope-type yarn", "--mscale-all-dim 0.7",
                 "--experimental-attention-variant dsa", "--dsa-indexer-n-heads 8",
                 "--dsa-indexer-head-dim 16", "--dsa-indexer-topk 8",
                 "--dsa-indexer-k-norm-epsilon 1e-06", "--moe-layer-freq [0,1,1,1]"):
        assert flag in args, flag
    assert "--no-dsa-indexer-rotate-activation" not in args
    assert "--dsa-indexer-rope-interleaved" not in args  # the indexer's rotary is rotate-half
    # an indexer width that is not a power of two builds without the rotation
    assert converted["odd_width_wq_b"] == (8 * 24, 24)


def v32_config(**changes) -> dict:
    config = dict(model_type="deepseek_v32", **FIELDS, hidden_act="silu", rms_norm_eps=1e-6)
    config.update(changes)
    return config


def test_odd_indexer_width_and_mlp_layer_types_give_their_flags():
    from megatron.bounded.convert.families import family_for

    family, config = family_for(v32_config(index_head_dim=24,
                                           mlp_layer_types=["dense", "sparse", "dense", "sparse"]))
    flags = " ".join(family.flags(config))
    assert "--no-dsa-indexer-rotate-activation" in flags and "--moe-layer-freq [0,1,0,1]" in flags
    rules = {rule.key: rule.hf_names for rule in family.rules(config)}
    assert rules["decoder.layers.2.mlp.linear_fc1.weight"] == (
        "model.layers.2.mlp.gate_proj.weight", "model.layers.2.mlp.up_proj.weight")
    assert "decoder.layers.3.mlp.router.weight" in rules
    assert rules["decoder.layers.1.self_attention.core_attention.indexer.k_norm.bias"] == (
        "model.layers.1.self_attn.indexer.k_norm.bias",)


@pytest.mark.parametrize("changes,named", [
    (dict(index_head_dim=2), "index_head_dim = 2 is below qk_rope_head_dim = 4"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types"),
    (dict(index_topk=None), "has no 'index_topk'"),
    (dict(q_lora_rank=None), "q_lora_rank = null"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps = 1e-05"),
    (dict(topk_method="greedy"), "topk_method = 'greedy'"),
])
def test_what_the_mapping_does_not_convert_is_refused_by_name(tmp_path, capsys, changes, named):
    config = {key: value for key, value in v32_config(**changes).items() if value is not None}
    model = fake_model(tmp_path / "v32", config)
    err = refusal(capsys, ["import", "--hf-dir", str(model), "--output", str(tmp_path / "out")])
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_indexer_tensor_not_mapped_is_refused_by_name(converted, tmp_path, capsys):
    from safetensors.torch import save_file

    model = tmp_path / "v32"
    shutil.copytree(converted["source"], model)
    tensors = tensors_of(model)
    tensors["model.layers.1.self_attn.indexer.wq_b.bias"] = torch.zeros(8 * 16)
    save_file(tensors, str(model / "model.safetensors"))
    err = refusal(capsys, ["import", "--hf-dir", str(model), "--output", str(tmp_path / "out")])
    assert "'model.layers.1.self_attn.indexer.wq_b.bias'" in err
