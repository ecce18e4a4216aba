"""tools/convert_hf.py on the gated-DeltaNet hybrid families, small models made with transformers'
own classes (random weights; 4 layers, 3 gated DeltaNet : 1 full attention, MoE with a gated
shared expert): the import gives transformers' logits (fp32, within 1e-5 of the largest logit),
the export gives back every tensor bitwise (fp32 and bf16 models), and what does not map is
refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.distributed import run_on_ranks
from tests.unit.test_convert_hf import (
    COMMON, TOLERANCE, compare_export, fake_model, load_tool, one_line_refusal, save_model, tensors_of,
)

GDN = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4)
FAMILIES = {
    # layer 1 dense (mlp_only_layers); layer_types from full_attention_interval 4: [1, 1, 1, 0]
    "qwen3_next": ("Qwen3NextConfig", dict(
        GDN, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=24,
        intermediate_size=48, mlp_only_layers=[1], rope_parameters=dict(
            rope_type="default", rope_theta=5000.0, partial_rotary_factor=0.25))),
}
FLAGS = {
    "qwen3_next": ("--experimental-attention-variant gated_delta_net",
                   "--linear-attention-freq [1,1,1,0]", "--linear-conv-kernel-dim 4",
                   "--linear-key-head-dim 16", "--linear-value-head-dim 12",
                   "--linear-num-key-heads 2", "--linear-num-value-heads 4",
                   "--attention-output-gate", "--apply-layernorm-1p", "--qk-layernorm",
                   "--rotary-percent 0.25", "--rotary-base 5000",
                   "--moe-shared-expert-intermediate-size 24", "--moe-shared-expert-gate",
                   "--moe-layer-freq [1,0,1,1]", "--num-experts 8"),
}


def _round_trips(rank, world_size, root):
    tool, root, results = load_tool(), Path(root), {}
    for family in FAMILIES:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            source = save_model(family, root / f"{family}-{name}", seed=1, dtype=dtype,
                                families=FAMILIES)
            checkpoint, exported = root / f"{family}-{name}-ckpt", root / f"{family}-{name}-export"
            assert tool.main(["import", "--hf-dir", str(source), "--output", str(checkpoint),
                              "--dtype", name]) == 0
            assert tool.main(["export", "--load", str(checkpoint), "--output", str(exported)]) == 0
            results[family, name] = {
                **compare_export(source, exported),
                "args": (checkpoint / "pretrain_args.txt").read_text(),
            }
        source, checkpoint = root / f"{family}-fp32", root / f"{family}-fp32-ckpt"
        other = save_model(family, root / f"{family}-other", seed=2, families=FAMILIES)
        results[family, "fp32"].update(
            difference=tool.logit_difference(str(source), str(checkpoint), 24),
            verify=tool.main(["verify", "--hf-dir", str(source), "--load", str(checkpoint),
                              "--tokens", "24"]),
            other_model=tool.main(["verify", "--hf-dir", str(other), "--load", str(checkpoint),
                                   "--tokens", "8"]))
    return results


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """{(family, fp32 / bf16): the export compared with the source, the flags; for fp32 the
    logit difference, verify's exit status and verify's against another model}"""
    pytest.importorskip("transformers")
    return run_on_ranks(_round_trips, 1, args=(str(tmp_path_factory.mktemp("gdn")),),
                        timeout_s=900)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_imported_checkpoint_gives_the_logits_of_transformers(round_trips, family):
    result = round_trips[family, "fp32"]
    # verify's exit status 1 against a checkpoint of another model: the check can fail
    assert (result["verify"], result["other_model"]) == (0, 1)
    assert result["difference"] <= TOLERANCE


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_of_the_import_gives_back_every_tensor_bitwise(round_trips, family, dtype):
    result = round_trips[family, dtype]
    assert result["names"] and result["bitwise"] == [] and result["config"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flags_name_the_family_options(round_trips, family):
    args = round_trips[family, "fp32"]["args"]
    assert [flag for flag in FLAGS[family] if flag not in args] == []
    # norm_topk_prob (true) renormalizes over the k chosen: no softmax over all experts
    assert "--moe-router-pre-softmax" not in args


def test_in_proj_layout_is_per_head_sections():
    """in_proj's rows are q, k, v, z, β, α, each head after head; transformers' are grouped by
    key head (q, k, then the v and z of its value heads; β, then α of its value heads)."""
    from megatron.bounded.convert.qwen3_next import join_in_proj, split_in_proj

    shape = dict(key_heads=2, value_heads=4, key_dim=3, value_dim=2)
    # row r of transformers' tensors holds the label of what it is: (section, head, row)
    labels = {"q": [], "k": [], "v": [], "z": [], "b": [], "a": []}
    qkvz, ba = [], []
    for head in range(2):
        for section, width in (("q", 3), ("k", 3), ("v", 4), ("z", 4)):
            rows = [(section, head, r) for r in range(width)]
            qkvz += rows
            labels[section] += rows
        for section in "ba":
            rows = [(section, head, r) for r in range(2)]
            ba += rows
            labels[section] += rows
    index = {label: i for i, label in enumerate(qkvz + ba)}
    qkvz_t = torch.tensor([[float(index[label])] for label in qkvz])
    ba_t = torch.tensor([[float(index[label])] for label in ba])
    joined = join_in_proj(qkvz_t, ba_t, **shape)
    want = [index[label] for section in "qkvzba" for label in labels[section]]
    assert joined[:, 0].tolist() == want
    back = split_in_proj(joined, **shape)
    assert torch.equal(back[0], qkvz_t) and torch.equal(back[1], ba_t)


def test_the_attention_output_gate_rows_follow_the_query_heads_of_each_group():
    """transformers' q_proj holds per head its query rows then its gate rows; megatron-core's
    linear_qkv holds per query group its query heads, their gates, the key, the value."""
    from megatron.bounded.convert.core import grouped_qkv

    heads, groups, dim = 4, 2, 2
    query = torch.arange(heads * 2 * dim, dtype=torch.float32).reshape(-1, 1)
    key, value = torch.full((groups * dim, 1), -1.0), torch.full((groups * dim, 1), -2.0)
    rule = grouped_qkv("qkv", "q", "k", "v", heads, groups, dim, gated=True)
    joined = rule.join([query, key, value])[:, 0].tolist()
    # group 0: heads 0 and 1 (query rows 0-1 and 4-5; gates 2-3 and 6-7), key, value
    assert joined[:12] == [0, 1, 4, 5, 2, 3, 6, 7, -1, -1, -2, -2]
    assert all(torch.equal(a, b) for a, b in zip(rule.split(rule.join([query, key, value])),
                                                  (query, key, value)))


# --------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------


def _config(family: str, **changes) -> dict:
    import transformers

    config_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **fields}).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("changes,named", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                       "full_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types"),
    (dict(attention_bias=True), "attention_bias = True"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads = 3"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
])
def test_an_option_not_mapped_is_refused_by_name(tmp_path, capsys, changes, named):
    model = fake_model(tmp_path / "model", _config("qwen3_next", **changes))
    err = one_line_refusal(capsys, ["import", "--hf-dir", str(model),
                                    "--output", str(tmp_path / "out")])
    assert named in err, err


def _with_tensors(source: Path, changes: dict) -> None:
    from safetensors.torch import save_file

    tensors = tensors_of(source)
    tensors.update(changes)
    save_file(tensors, str(source / "model.safetensors"))


def test_a_tensor_not_mapped_is_refused_by_name(tmp_path, capsys):
    source = save_model("qwen3_next", tmp_path / "model", seed=0, families=FAMILIES)
    _with_tensors(source, {"model.layers.0.linear_attn.conv1d.bias": torch.zeros(112)})
    capsys.readouterr()  # the save's progress bar
    err = one_line_refusal(capsys, ["import", "--hf-dir", str(source), "--output", str(tmp_path / "out")])
    assert "'model.layers.0.linear_attn.conv1d.bias'" in err
    assert not (tmp_path / "out").exists()


def test_a_gated_norm_weight_that_w_minus_1_does_not_keep_is_refused(tmp_path, capsys):
    source = save_model("qwen3_next", tmp_path / "model", seed=0, families=FAMILIES)
    name = "model.layers.2.linear_attn.norm.weight"
    weight = tensors_of(source)[name].clone()
    weight[0] = 0.1  # fp32: 0.1 - 1 needs 27 significant bits
    _with_tensors(source, {name: weight})
    capsys.readouterr()  # the save's progress bar
    err = one_line_refusal(capsys, ["import", "--hf-dir", str(source),
                                    "--output", str(tmp_path / "out")])
    assert name in err and "w - 1" in err
    assert not (tmp_path / "out").exists()


def _import_with_mtp(rank, world_size, root):
    root, tool = Path(root), load_tool()
    source = save_model("qwen3_next", root / "model", seed=0, families=FAMILIES)
    _with_tensors(source, {"mtp.fc.weight": torch.ones(64, 128),
                           "mtp.layers.0.input_layernorm.weight": torch.ones(64)})
    assert tool.main(["import", "--hf-dir", str(source), "--output", str(root / "ckpt"),
                      "--dtype", "fp32"]) == 0
    assert tool.main(["export", "--load", str(root / "ckpt"), "--output",
                      str(root / "export")]) == 0
    return sorted(tensors_of(source)), sorted(tensors_of(root / "export"))


def test_multi_token_prediction_weights_are_skipped(tmp_path):
    original, exported = run_on_ranks(_import_with_mtp, 1, args=(str(tmp_path),),
                                      timeout_s=300)[0]
    assert [name for name in original if name not in exported] == [
        "mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"]
    assert set(exported) < set(original)


def test_qwen3_5_moe_is_refused_as_a_model_type_not_mapped(tmp_path, capsys):
    model = fake_model(tmp_path / "qwen3_5_moe", dict(model_type="qwen3_5_moe",
                                                      text_config=_config("qwen3_next")))
    err = one_line_refusal(capsys, ["import", "--hf-dir", str(model),
                                    "--output", str(tmp_path / "out")])
    assert "model_type 'qwen3_5_moe' is not supported" in err and "qwen3_next" in err
