"""tools/convert_hf.py on the gated-DeltaNet hybrid families, small models made with transformers'
own classes (random weights; 4 layers, 3 gated DeltaNet : 1 full attention, MoE with a gated
shared expert; Qwen3.5-MoE as released, a vision-language model with its experts in two tensors
per layer, and as transformers' text model saves it): the import gives transformers' logits
(fp32, within 1e-5 of the largest logit), the export gives back every tensor bitwise (fp32 and
bf16 models) but the vision tower's, and what does not map is refused by name."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from megatron.bounded.launch.commands import hf_conversion

from tests.unit.distributed import run_on_ranks
from tests.unit.convert.test_convert_hf import (
    COMMON, TOLERANCE, compare_export, fake_model, one_line_refusal, save_model,
    save_random_model, tensors_of,
)

GDN = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4)
SHARED_EXPERT_MOE = dict(num_experts=8, moe_intermediate_size=32,
                         shared_expert_intermediate_size=24)
FAMILIES = {
    # layer 1 dense (mlp_only_layers); layer_types from full_attention_interval 4: [1, 1, 1, 0]
    "qwen3_next": ("Qwen3NextConfig", dict(
        GDN, **SHARED_EXPERT_MOE, intermediate_size=48, mlp_only_layers=[1],
        rope_parameters=dict(rope_type="default", rope_theta=5000.0, partial_rotary_factor=0.25))),
    # every layer MoE; the multimodal rotary of the release (its sections of the 2 frequencies
    # that turn), which text positions make plain rotary
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(
        GDN, **SHARED_EXPERT_MOE, layer_types=["linear_attention", "full_attention",
                                               "linear_attention", "linear_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=5000.0, partial_rotary_factor=0.25,
                             mrope_interleaved=True, mrope_section=[1, 1, 0]))),
}
# the vision-language model: the text model's config as its text_config, a vision tower of one
# block (its output the text model's width)
VISION_LANGUAGE = "qwen3_5_moe"
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16)
MODELS = [*FAMILIES, VISION_LANGUAGE]
FLAGS = {
    "qwen3_next": ("--experimental-attention-variant gated_delta_net",
                   "--linear-attention-freq [1,1,1,0]", "--linear-conv-kernel-dim 4",
                   "--linear-key-head-dim 16", "--linear-value-head-dim 12",
                   "--linear-num-key-heads 2", "--linear-num-value-heads 4",
                   "--attention-output-gate", "--apply-layernorm-1p", "--qk-layernorm",
                   "--rotary-percent 0.25", "--rotary-base 5000",
                   "--moe-shared-expert-intermediate-size 24", "--moe-shared-expert-gate",
                   "--moe-layer-freq [1,0,1,1]", "--num-experts 8"),
    "qwen3_5_moe_text": ("--experimental-attention-variant gated_delta_net",
                         "--linear-attention-freq [1,0,1,1]", "--linear-conv-kernel-dim 4",
                         "--linear-key-head-dim 16", "--linear-value-head-dim 12",
                         "--linear-num-key-heads 2", "--linear-num-value-heads 4",
                         "--attention-output-gate", "--apply-layernorm-1p", "--qk-layernorm",
                         "--rotary-percent 0.25", "--rotary-base 5000",
                         "--moe-shared-expert-intermediate-size 24", "--moe-shared-expert-gate",
                         "--num-experts 8"),
}
FLAGS[VISION_LANGUAGE] = FLAGS["qwen3_5_moe_text"]


def vision_language_config(**text_changes):
    import transformers

    text = {**COMMON, **FAMILIES["qwen3_5_moe_text"][1], **text_changes}
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION)


def _fuse_experts(directory: Path) -> None:
    """The model's experts as the release stores them: per layer ``mlp.experts.gate_up_proj``
    (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``, stacked."""
    from safetensors.torch import save_file

    tensors, fused = tensors_of(directory), {}
    for name in sorted(tensors):
        prefix, found, rest = name.partition(".mlp.experts.")
        if not found:
            fused[name] = tensors[name]
            continue
        expert, projection = rest.split(".")[:2]
        if expert == "0" and projection == "gate_proj":
            each = range(SHARED_EXPERT_MOE["num_experts"])
            part = f"{prefix}.mlp.experts.{{}}.{{}}.weight"
            fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
                [tensors[part.format(e, "gate_proj")], tensors[part.format(e, "up_proj")]])
                for e in each])
            fused[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
                [tensors[part.format(e, "down_proj")] for e in each])
    save_file(fused, str(directory / "model.safetensors"))


def save_gdn_model(model: str, directory: Path, seed: int,
                   dtype: torch.dtype = torch.float32) -> Path:
    """A small model of ``model`` (one of ``MODELS``) with random weights; the vision-language
    one with its experts as the release stores them."""
    if model != VISION_LANGUAGE:
        return save_model(model, directory, seed, dtype, families=FAMILIES)
    save_random_model(vision_language_config(), directory, seed, dtype,
                      auto_class="AutoModelForImageTextToText")
    _fuse_experts(directory)
    return directory


def _round_trips(rank, world_size, root):
    tool, root, results = hf_conversion, Path(root), {}
    for family in MODELS:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            source = save_gdn_model(family, root / f"{family}-{name}", seed=1, dtype=dtype)
            checkpoint, exported = root / f"{family}-{name}-ckpt", root / f"{family}-{name}-export"
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                assert tool.run(["import", "--hf-dir", str(source), "--output",
                                  str(checkpoint), "--dtype", name]) == 0
            assert tool.run(["export", "--load", str(checkpoint), "--output", str(exported)]) == 0
            results[family, name] = {
                **compare_export(source, exported),
                "left_out": sorted(set(tensors_of(source)) - set(tensors_of(exported))),
                "added": sorted(set(tensors_of(exported)) - set(tensors_of(source))),
                "not_converted": [line for line in said.getvalue().splitlines()
                                  if line.startswith("[convert] not converted")],
                "args": (checkpoint / "pretrain_args.txt").read_text(),
            }
        source, checkpoint = root / f"{family}-fp32", root / f"{family}-fp32-ckpt"
        other = save_gdn_model(family, root / f"{family}-other", seed=2)
        results[family, "fp32"].update(
            difference=tool.logit_difference(str(source), str(checkpoint), 24),
            verify=tool.run(["verify", "--hf-dir", str(source), "--load", str(checkpoint),
                              "--tokens", "24"]),
            other_model=tool.run(["verify", "--hf-dir", str(other), "--load", str(checkpoint),
                                   "--tokens", "8"]))
    return results


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """{(family, fp32 / bf16): the export compared with the source (and the names it leaves out
    or adds), the import's lines on what it does not convert, the flags; for fp32 the logit
    difference, verify's exit status and verify's against another model}"""
    pytest.importorskip("transformers")
    return run_on_ranks(_round_trips, 1, args=(str(tmp_path_factory.mktemp("gdn")),),
                        timeout_s=900)[0]


@pytest.mark.parametrize("family", MODELS)
def test_imported_checkpoint_gives_the_logits_of_transformers(round_trips, family):
    result = round_trips[family, "fp32"]
    # verify's exit status 1 against a checkpoint of another model: the check can fail
    assert (result["verify"], result["other_model"]) == (0, 1)
    assert result["difference"] <= TOLERANCE


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", MODELS)
def test_export_of_the_import_gives_back_every_tensor_bitwise(round_trips, family, dtype):
    result = round_trips[family, dtype]
    assert result["bitwise"] == [] and result["config"] and result["added"] == []
    if family != VISION_LANGUAGE:
        assert result["names"] and result["left_out"] == [] and result["not_converted"] == []


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_vision_tower_is_left_out_and_said_so(round_trips, dtype):
    result = round_trips[VISION_LANGUAGE, dtype]
    assert result["left_out"] and all(name.startswith("model.visual.")
                                      for name in result["left_out"])
    assert result["not_converted"] == [
        f"[convert] not converted: the {len(result['left_out'])} tensors of the vision tower "
        "(model.visual.*: only the text decoder is converted)"]


@pytest.mark.parametrize("family", MODELS)
def test_flags_name_the_family_options(round_trips, family):
    args = round_trips[family, "fp32"]["args"]
    assert [flag for flag in FLAGS[family] if flag not in args] == []
    # the top-k probabilities renormalized (Qwen3-Next: norm_topk_prob true; Qwen3.5: always):
    # no softmax over all experts
    assert "--moe-router-pre-softmax" not in args
    # Qwen3.5-MoE: every layer a MoE layer
    assert ("--moe-layer-freq" in args) == (family == "qwen3_next")


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_a_config_without_partial_rotary_factor_rotates_a_quarter_as_transformers(family):
    """transformers' configs of both families default to a quarter of each head."""
    from megatron.bounded.convert.families import family_for

    config = _config(family, rope_parameters=dict(rope_type="default", rope_theta=5000.0))
    module, hf_config = family_for(config)
    assert "--rotary-percent 0.25" in " ".join(module.flags(hf_config))


def test_separate_in_proj_layout_is_the_four_projections_one_after_another():
    """Qwen3.5's in_proj_qkv (q, k, v), in_proj_z, in_proj_b (β), in_proj_a (α) are in_proj's
    sections in this order, each already head after head."""
    from megatron.bounded.convert.families import family_for
    from megatron.bounded.convert.qwen3_5_moe import separate_in_proj

    _, config = family_for(_config("qwen3_5_moe_text"))
    rule = separate_in_proj(config, 0)
    # 2 key heads of 16 (q, k), 4 value heads of 12 (v, z), 4 (β, α)
    rows = {"qkv": 2 * 2 * 16 + 4 * 12, "z": 4 * 12, "b": 4, "a": 4}
    parts, start = [], 0
    for part, count in rows.items():
        parts.append(torch.arange(start, start + count, dtype=torch.float32).reshape(-1, 1))
        start += count
    assert rule.hf_names == tuple(f"model.layers.0.linear_attn.in_proj_{part}.weight"
                                  for part in rows)
    joined = rule.join(parts)
    assert joined[:, 0].tolist() == list(range(start))
    assert all(torch.equal(a, b) for a, b in zip(rule.split(joined), parts))


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


@pytest.mark.parametrize("text_changes,changes,named", [
    ({}, dict(text_config=None), "has no text_config"),
    ({}, dict(tie_word_embeddings=True), "tie_word_embeddings = True and its text_config False"),
    (dict(attention_bias=True), {}, "config.json's text_config sets attention_bias = True"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=5000.0)), {},
     "config.json's text_config asks for rope scaling of kind 'yarn'"),
    (dict(linear_num_value_heads=3), {}, "linear_num_value_heads = 3"),
])
def test_a_qwen3_5_moe_config_not_mapped_is_refused_by_name(tmp_path, capsys, text_changes,
                                                             changes, named):
    config = vision_language_config().to_dict()
    config["text_config"].update(text_changes)
    config.update(changes)
    model = fake_model(tmp_path / "model", config)
    err = one_line_refusal(capsys, ["import", "--hf-dir", str(model),
                                    "--output", str(tmp_path / "out")])
    assert named in err, err


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


def _import_with_mtp(rank, world_size, root, family):
    root, tool = Path(root), hf_conversion
    source = save_gdn_model(family, root / "model", seed=0)
    _with_tensors(source, {"mtp.fc.weight": torch.ones(64, 128),
                           "mtp.layers.0.input_layernorm.weight": torch.ones(64)})
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert tool.run(["import", "--hf-dir", str(source), "--output", str(root / "ckpt"),
                          "--dtype", "fp32"]) == 0
    assert tool.run(["export", "--load", str(root / "ckpt"), "--output",
                      str(root / "export")]) == 0
    return (sorted(tensors_of(source)), sorted(tensors_of(root / "export")),
            [line for line in said.getvalue().splitlines() if "multi-token" in line])


@pytest.mark.parametrize("family", ["qwen3_next", VISION_LANGUAGE])
def test_multi_token_prediction_weights_are_skipped(tmp_path, family):
    original, exported, said = run_on_ranks(_import_with_mtp, 1, args=(str(tmp_path), family),
                                            timeout_s=300)[0]
    assert [name for name in original if name not in exported
            and not name.startswith("model.visual.")] == [
        "mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"]
    assert set(exported) < set(original)
    assert said == ["[convert] not converted: the 2 tensors of the multi-token-prediction module "
                    "(mtp.*, which transformers ignores)"]
