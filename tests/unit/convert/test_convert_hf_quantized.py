"""tools/convert_hf.py on quantized releases and on Kimi-K2's model_type, with small models made
with transformers' own classes (random weights, saved locally):

* a DeepSeek-V3-shaped model whose linear weights are stored as the DeepSeek-V3 and Kimi-K2
  releases store them (float8_e4m3fn, fp32 ``weight_scale_inv`` per 128 x 128 block, the last
  blocks partial, two files and an index), imported to bf16: every weight within the rounding of
  e4m3 and bf16 of the original, and ``verify`` against the original within the quantization's
  own effect on transformers' logits (plus the fp32 tolerance of the mapping);
* the same model under ``model_type: kimi_k2``;
* a gpt-oss model whose experts are MXFP4 (``*_blocks`` / ``*_scales``), imported exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron.bounded.launch.commands import hf_conversion

from tests.unit.distributed import run_on_ranks
from tests.unit.convert.test_convert_hf import COMMON, save_model, tensors_of
from tests.unit.convert.test_dequantize import (
    fp8_error_bound, mxfp4_error_bound, quantize_fp8_blocks, quantize_mxfp4,
)

BLOCK = [128, 128]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK,
              "activation_scheme": "dynamic"}
# The linear layers the DeepSeek-V3 release stores in FP8: every projection of the decoder layers
# (not the embeddings, the output layer, the norms or the router).
FP8_LINEAR = re.compile(r"^model\.layers\.\d+\..*\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
                        r"o_proj|gate_proj|up_proj|down_proj)\.weight$")
# Sizes that are not multiples of 128, so that blocks of both axes are partial: hidden 160 =
# 128 + 32, expert fc1 [136, 160], dense fc1 [200, 160].
DEEPSEEK_SIZES = dict(hidden_size=160, intermediate_size=200, moe_intermediate_size=136)
TOKENS = 16
MAPPING_TOLERANCE = 1e-5  # verify's default: the same weights give the same logits


def write_fp8_release(source: Path, target: Path) -> Path:
    """``source``'s model with its linear weights in block FP8, in two files with an index."""
    from safetensors.torch import save_file

    stored = {}
    for name, tensor in tensors_of(source).items():
        if FP8_LINEAR.match(name):
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_blocks(tensor, BLOCK)
        else:
            stored[name] = tensor
    target.mkdir()
    names = sorted(stored)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file_name, part in halves.items():
        save_file({n: stored[n].contiguous() for n in part}, str(target / file_name),
                  metadata={"format": "pt"})
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (target / "config.json").write_text(json.dumps(config))
    return target


def write_dequantized(release: Path, target: Path) -> Path:
    """The FP8 release dequantized here (each weight times its block's scale, in fp32), saved as
    a plain fp32 model: the quantized model as transformers runs it, made without the
    converter."""
    from safetensors.torch import save_file

    stored, plain = tensors_of(release), {}
    for name, tensor in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in stored:
            scale = stored[name + "_scale_inv"]
            rows, cols = tensor.shape
            spread = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            tensor = tensor.float() * spread
        plain[name] = tensor
    target.mkdir()
    save_file(plain, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((release / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target


def relative_difference(tool, reference: Path, other: Path) -> float:
    """Largest logit difference of transformers' models of two directories, relative to the
    largest logit of ``reference`` (``verify``'s measure)."""
    tokens = torch.randint(0, COMMON["vocab_size"], (1, TOKENS),
                           generator=torch.Generator().manual_seed(0))
    first, second = tool.hf_logits(str(reference), tokens), tool.hf_logits(str(other), tokens)
    return ((second - first).abs().max() / first.abs().max()).item()


def run(tool, *argv) -> tuple:
    """(exit status, what it printed) of the commands' ``run``."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = tool.run([str(a) for a in argv])
    return status, printed.getvalue()


def _weights_against_the_original(original: dict, exported: dict, release: dict) -> dict:
    """Each exported weight (= the import's tensor, bitwise) against the original: the FP8 ones
    within the e4m3 bound plus bf16's rounding, and equal to the release's values times their
    scales rounded to bf16; the others the original or (the model keeps norms and the expert
    bias in fp32) the original rounded to bf16."""
    worst, largest_error, wrong = 0.0, 0.0, []
    for name, weight in original.items():
        ours = exported[name].float()
        if name + "_scale_inv" not in release:
            if not (torch.equal(ours, weight) or torch.equal(ours, weight.bfloat16().float())):
                wrong.append(name)
            continue
        scale = release[name + "_scale_inv"]
        dequantized = release[name].float() * scale.repeat_interleave(128, 0)[
            :weight.shape[0]].repeat_interleave(128, 1)[:, :weight.shape[1]]
        if not torch.equal(ours, dequantized.bfloat16().float()):
            wrong.append(name)
        # e4m3's rounding, then bf16's (2^-8 of the value)
        bound = fp8_error_bound(weight, scale, BLOCK) + dequantized.abs() * 2.0 ** -8
        error = (ours - weight).abs()
        worst = max(worst, (error / bound).max().item())
        largest_error = max(largest_error, error.max().item())
    return {"worst_of_bound": worst, "largest_error": largest_error, "not_as_expected": wrong}


def _fp8_release(rank, world_size, root):
    """The FP8 release's imports, exports and verifications, in one process."""
    tool, root = hf_conversion, Path(root)
    original = save_model("deepseek_v3", root / "original", seed=5, **DEEPSEEK_SIZES)
    release = write_fp8_release(original, root / "fp8")
    dequantized = write_dequantized(release, root / "dequantized")
    ckpt, ckpt32, exported, exported32 = (root / name for name in (
        "ckpt-bf16", "ckpt-fp32", "export-bf16", "export-fp32"))
    status, printed = run(tool, "import", "--hf-dir", release, "--output", ckpt, "--dtype", "bf16")
    assert status == 0, printed
    assert run(tool, "import", "--hf-dir", release, "--output", ckpt32, "--dtype", "fp32")[0] == 0
    assert run(tool, "export", "--load", ckpt, "--output", exported)[0] == 0
    assert run(tool, "export", "--load", ckpt32, "--output", exported32)[0] == 0
    # what the FP8 rounding (and then bf16's) of every weight does to transformers' own logits:
    # the exported weights are the import's, each within the rounding bound of the original
    quantization_effect = relative_difference(tool, original, exported)
    results = {
        "import_said": printed,
        "weights": _weights_against_the_original(tensors_of(original), tensors_of(exported),
                                                 tensors_of(release)),
        "export_config": json.loads((exported / "config.json").read_text()),
        "fp8_effect": relative_difference(tool, original, dequantized),
        "quantization_effect": quantization_effect,
        # our fp32 import against transformers' model of the release (dequantized by the
        # converter) and of the dequantization made here: the mapping, exact
        "fp32_vs_release": tool.logit_difference(str(release), str(ckpt32), TOKENS),
        "fp32_vs_dequantized": tool.logit_difference(str(dequantized), str(ckpt32), TOKENS),
        "bf16_vs_original": tool.logit_difference(str(original), str(ckpt), TOKENS),
        # the bf16 import against the original, at the quantization's own effect on the logits
        # plus the mapping's tolerance (the triangle inequality)
        "verify_original": run(tool, "verify", "--hf-dir", original, "--load", ckpt, "--tokens",
                               TOKENS, "--tolerance", quantization_effect + MAPPING_TOLERANCE),
        "verify_export": run(tool, "verify", "--hf-dir", exported, "--load", ckpt, "--tokens",
                             TOKENS),
        # against the dequantized model in fp32 the bf16 import fails the default tolerance,
        # and verify names the rounding
        "verify_default": run(tool, "verify", "--hf-dir", release, "--load", ckpt,
                              "--tokens", TOKENS),
        "verify_fp32": run(tool, "verify", "--hf-dir", release, "--load", ckpt32, "--tokens",
                           TOKENS),
        "verify_other": run(tool, "verify", "--hf-dir", save_model(
            "deepseek_v3", root / "other", seed=6, **DEEPSEEK_SIZES), "--load", ckpt,
            "--tokens", TOKENS),
    }
    results.update(_kimi_k2(tool, root, release, ckpt32, exported32))
    return results


def _kimi_k2(tool, root: Path, release: Path, ckpt: Path, exported: Path) -> dict:
    """The FP8 release under Kimi-K2's model_type, imported (fp32) and verified like
    DeepSeek-V3 (``ckpt``, ``exported``: its fp32 import and that import's export)."""
    kimi = root / "kimi_k2"
    shutil.copytree(release, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    (kimi / "config.json").write_text(json.dumps(config))
    kimi_ckpt, kimi_export = root / "kimi-ckpt", root / "kimi-export"
    status, printed = run(tool, "import", "--hf-dir", kimi, "--output", kimi_ckpt, "--dtype",
                          "fp32")
    assert status == 0, printed
    assert run(tool, "export", "--load", kimi_ckpt, "--output", kimi_export)[0] == 0
    ours, deepseek = tensors_of(kimi_export), tensors_of(exported)
    return {
        "kimi_said": printed,
        "kimi_same_flags": (kimi_ckpt / "pretrain_args.txt").read_text()
        == (ckpt / "pretrain_args.txt").read_text(),
        "kimi_same_tensors": sorted(ours) == sorted(deepseek)
        and all(torch.equal(ours[n], deepseek[n]) for n in ours),
        "kimi_export_model_type": json.loads((kimi_export / "config.json").read_text())[
            "model_type"],
        # transformers does not know kimi_k2: the reference is its DeepSeek-V3 class
        "kimi_verify": run(tool, "verify", "--hf-dir", kimi, "--load", kimi_ckpt, "--tokens",
                           TOKENS),
    }


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("convert_hf_fp8"))
    return run_on_ranks(_fp8_release, 1, args=(root,), timeout_s=900)[0]


def test_fp8_import_says_what_it_dequantized(fp8):
    # 5 attention projections in each of 3 layers, 3 of the dense MLP, 8 x 3 of the experts and
    # 3 of the shared expert in each of the 2 MoE layers
    assert "72 tensors stored as FP8 are dequantized to bf16" in fp8["import_said"]
    assert "quantization_config" not in fp8["export_config"]  # the export is the bf16 model


def test_fp8_weights_are_within_the_quantization_error_of_the_original(fp8):
    weights = fp8["weights"]
    assert weights["not_as_expected"] == []
    assert weights["worst_of_bound"] <= 1.0
    assert weights["largest_error"] > 0  # the check can fail: the rounding is there


def test_fp8_import_verifies_within_the_quantization_error(fp8):
    # the mapping: our fp32 import gives transformers' logits of the dequantized weights
    assert fp8["fp32_vs_release"] <= MAPPING_TOLERANCE
    assert fp8["fp32_vs_dequantized"] <= MAPPING_TOLERANCE
    assert fp8["verify_fp32"][0] == 0 and fp8["verify_export"][0] == 0
    # The bf16 import against the original: the tolerance is what FP8's and bf16's rounding of
    # the weights do to transformers' own logits, measured, plus the mapping's 1e-5. e4m3 keeps
    # 3 mantissa bits (about 2% of each weight), which moves the logits of this random 3-layer
    # model by about 0.6 of the largest; so the difference is also checked to be that effect.
    assert fp8["verify_original"][0] == 0, fp8["verify_original"][1]
    assert fp8["fp8_effect"] > 0 and fp8["quantization_effect"] > 0
    assert abs(fp8["bf16_vs_original"] - fp8["quantization_effect"]) <= MAPPING_TOLERANCE
    assert fp8["verify_other"][0] == 1  # the check can fail: another model is far off


def test_verify_of_a_bf16_import_names_the_rounding(fp8):
    status, printed = fp8["verify_default"]
    assert status == 1
    assert "imported with --dtype bf16, coarser than the reference's F32 weights" in printed
    assert "the import's dtype explains the difference" in printed
    assert "import with --dtype fp32 and verify" in printed
    # another model is not explained by rounding
    status, printed = fp8["verify_other"]
    assert status == 1 and "explains" not in printed
    assert "is not the reference's rounded to bf16" in printed


def _bf16_import_of_fp32_weights(rank, world_size, root):
    """GLM-4.5's sigmoid routing: bf16's rounding of the router flips some tokens' experts, so
    the difference is far above bf16's unit roundoff, and still the rounding's."""
    tool, root = hf_conversion, Path(root)
    source = save_model("glm4_moe", root / "glm", seed=1)
    assert run(tool, "import", "--hf-dir", source, "--output", root / "ckpt")[0] == 0
    return run(tool, "verify", "--hf-dir", source, "--load", root / "ckpt", "--tokens", 24)


def test_verify_names_the_rounding_of_fp32_weights_imported_as_bf16(tmp_path):
    pytest.importorskip("transformers")
    status, printed = run_on_ranks(_bf16_import_of_fp32_weights, 1, args=(str(tmp_path),),
                                   timeout_s=600)[0]
    assert status == 1
    difference = float(re.search(r"largest logit ([0-9.e+-]+) ", printed).group(1))
    assert difference > 2.0 ** -8
    assert "coarser than the reference's F32 weights" in printed
    assert "the import's dtype explains the difference" in printed


def test_kimi_k2_imports_through_the_deepseek_v3_mapping(fp8):
    assert "model_type 'kimi_k2' (DeepseekV3ForCausalLM) maps to DeepSeek-V3's layout" in \
        fp8["kimi_said"]
    assert fp8["kimi_same_flags"] and fp8["kimi_same_tensors"]
    assert fp8["kimi_export_model_type"] == "kimi_k2"
    assert fp8["kimi_verify"][0] == 0


def write_mxfp4_release(source: Path, target: Path) -> Path:
    """``source``'s gpt-oss model with its experts in MXFP4 (``*_blocks`` / ``*_scales``), as the
    gpt-oss release stores them: quantized along the input axis of [E, out, in]."""
    from safetensors.torch import save_file

    stored = {}
    for name, tensor in tensors_of(source).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"] = quantize_mxfp4(
                tensor.float().transpose(1, 2))
        else:
            stored[name] = tensor
    target.mkdir()
    save_file(stored, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    return target


def _mxfp4_release(rank, world_size, root):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tool, root = hf_conversion, Path(root)
    original = save_model("gpt_oss", root / "original", seed=7, dtype=torch.bfloat16)
    release = write_mxfp4_release(original, root / "mxfp4")
    ckpt, exported = root / "ckpt", root / "export"
    status, printed = run(tool, "import", "--hf-dir", release, "--output", ckpt)
    assert status == 0, printed
    assert run(tool, "export", "--load", ckpt, "--output", exported)[0] == 0
    stored, ours, before = tensors_of(release), tensors_of(exported), tensors_of(original)
    quantized = [n[:-len("_blocks")] for n in stored if n.endswith("_blocks")]
    experts, worst = [], 0.0
    for name in quantized:
        blocks, scales = stored[name + "_blocks"], stored[name + "_scales"]
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        experts.append(ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs))
        error = (ours[name].float() - before[name].float()).abs().transpose(1, 2)
        worst = max(worst, (error / mxfp4_error_bound(before[name].float().transpose(1, 2),
                                                      scales)).max().item())
    return {"said": printed, "experts_as_transformers": experts, "worst_of_bound": worst,
            "others_unchanged": all(torch.equal(ours[n], before[n]) for n in before
                                    if n not in quantized),
            "verify": run(tool, "verify", "--hf-dir", release, "--load", ckpt, "--tokens",
                          TOKENS)}


def test_mxfp4_experts_import_exactly(tmp_path):
    pytest.importorskip("transformers")
    result = run_on_ranks(_mxfp4_release, 1, args=(str(tmp_path),), timeout_s=600)[0]
    assert "6 tensors stored as MXFP4 are dequantized to bf16" in result["said"]
    # transformers' own decoding, bitwise; within e2m1's rounding of the original
    assert result["experts_as_transformers"] == [True] * 6
    assert 0 < result["worst_of_bound"] <= 1.0
    assert result["others_unchanged"]
    # MXFP4 values are exact in bf16: the bf16 import verifies at the default tolerance
    assert result["verify"][0] == 0, result["verify"][1]
