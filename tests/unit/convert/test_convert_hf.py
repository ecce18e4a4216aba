"""tools/convert_hf.py on small models of each family, made with transformers' own classes
(random weights, saved locally): the imported checkpoint gives transformers' logits (fp32, within
1e-5 of the largest logit), the export gives back every tensor bitwise and the same config, and
unsupported models, options and tensors are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from megatron.bounded.launch.commands import hf_conversion

from tests.unit.distributed import run_on_ranks

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL = REPO_ROOT / "tools" / "convert_hf.py"
TOLERANCE = 1e-5
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128)
# Each family with the options its mapping converts switched on.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, moe_intermediate_size=32,
                                         intermediate_size=48, mlp_only_layers=[1],
                                         norm_topk_prob=False, rope_theta=5000.0)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=32)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        head_dim=16, n_routed_experts=8, moe_intermediate_size=32, intermediate_size=48,
        first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1,
        attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5,
        partial_rotary_factor=0.5, norm_topk_prob=True)),
    # YaRN as the release has it (factor 32 over 4096 positions); layers 0 and 2 windowed
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, num_local_experts=4, intermediate_size=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=131072, swiglu_limit=0.5)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=16,
        intermediate_size=48, first_k_dense_replace=1, n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.7,
            original_max_position_embeddings=4096, beta_fast=32, beta_slow=1))),
}


def save_model(family: str, directory: Path, seed: int, dtype: torch.dtype = torch.float32,
               families: Optional[dict] = None, **sizes) -> Path:
    """A small model of ``family`` (of ``families``, by default ``FAMILIES``) with random
    weights (biases and buffers too), saved in ``dtype``; ``sizes``: config fields that replace
    the family's."""
    import transformers

    config_class, fields = (families or FAMILIES)[family]
    config = getattr(transformers, config_class)(**{**COMMON, **fields, **sizes})
    return save_random_model(config, directory, seed, dtype)


def save_random_model(config, directory: Path, seed: int, dtype: torch.dtype = torch.float32,
                      auto_class: str = "AutoModelForCausalLM") -> Path:
    """transformers' model of ``config`` (the one ``auto_class`` makes) with random weights
    (biases and buffers too), saved in ``dtype``."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(config).float()
    with torch.no_grad():  # what initialization leaves at zero or one would hide a wrong mapping
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "embed" not in name:
                tensor.add_(torch.randn_like(tensor) * 0.05)
    model.to(dtype).save_pretrained(directory)
    return directory


def tensors_of(directory: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def _round_trips(rank, world_size, root):
    tool = hf_conversion
    results = {}
    for family in FAMILIES:
        source = save_model(family, Path(root) / family, seed=1)
        other = save_model(family, Path(root) / f"{family}-other", seed=2)
        checkpoint, exported = Path(root) / f"{family}-ckpt", Path(root) / f"{family}-export"
        assert tool.run(["import", "--hf-dir", str(source), "--output", str(checkpoint),
                          "--dtype", "fp32"]) == 0
        assert tool.run(["export", "--load", str(checkpoint), "--output", str(exported)]) == 0
        results[family] = {
            "difference": tool.logit_difference(str(source), str(checkpoint), 24),
            "other_model": tool.run(["verify", "--hf-dir", str(other), "--load", str(checkpoint),
                                      "--tokens", "8"]),
            **compare_export(source, exported),
            "args": (checkpoint / "pretrain_args.txt").read_text(),
            "checkpoint": str(checkpoint),
            "expert_chunks": _expert_chunks(checkpoint),
        }
    return results


def compare_export(source: Path, exported: Path) -> dict:
    """names: the export has the source's tensor names; bitwise: the tensors whose dtype or
    values differ; config: the export's config.json equals the source's."""
    original, back = tensors_of(source), tensors_of(exported)
    return {"names": sorted(original) == sorted(back),
            "bitwise": [n for n in original if n in back and not (
                original[n].dtype == back[n].dtype and torch.equal(original[n], back[n]))],
            "config": json.loads((exported / "config.json").read_text())
            == json.loads((source / "config.json").read_text())}


def _expert_chunks(checkpoint: Path) -> list:
    """How many pieces the import stored each layer's expert fc2 weights in."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(checkpoint / "release")).read_metadata().state_dict_metadata
    return sorted({len(entry.chunks) for key, entry in stored.items()
                   if key.endswith("experts.experts.linear_fc2.weight")})


def in_own_process(tmp_path_factory, body, name: str, timeout_s: int = 600):
    """``body(rank, world_size, root)``'s result, run in a process of its own with ``root`` a
    new temporary directory ``name`` (skipped without transformers)."""
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp(name))
    return run_on_ranks(body, 1, args=(root,), timeout_s=timeout_s)[0]


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    return in_own_process(tmp_path_factory, _round_trips, "convert_hf")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_imported_checkpoint_gives_the_logits_of_transformers(round_trips, family):
    assert round_trips[family]["difference"] <= TOLERANCE
    # the check can fail: a checkpoint of another model of the same shape is far off
    assert round_trips[family]["other_model"] == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_stores_one_piece_per_expert(round_trips, family):
    # megatron-core loads experts one at a time: a piece each keeps a load from reading a
    # layer's stacked experts once per expert
    fields = FAMILIES[family][1]
    experts = next(fields[name] for name in ("num_experts", "num_local_experts",
                                             "n_routed_experts") if name in fields)
    assert round_trips[family]["expert_chunks"] == [experts]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_of_the_import_gives_back_every_tensor_bitwise(round_trips, family):
    result = round_trips[family]
    assert result["names"] and result["bitwise"] == [] and result["config"]


FLAGS = {  # flags each family's options give
    "qwen3_moe": ("--moe-router-pre-softmax", "--moe-layer-freq [1,0,1]"),
    "glm4_moe": ("--rotary-percent 0.5", "--add-qkv-bias", "--qk-layernorm",
                 "--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-num-groups 2", "--moe-router-group-topk 1",
                 "--moe-router-topk-scaling-factor 2.5", "--moe-shared-expert-intermediate-size 32",
                 "--moe-layer-freq [0,1,1]"),
    "gpt_oss": ("--window-size 5,0", "--window-attn-skip-freq [1,0,1]", "--softmax-type learnable",
                "--position-embedding-type yarn", "--rotary-scaling-factor 32.0",
                "--no-yarn-correction-range-round-to-int", "--quick-geglu",
                "--glu-linear-offset 1.0", "--activation-func-clamp-value 0.5",
                "--bounded-moe-backend upstream"),
    "deepseek_v3": ("--multi-latent-attention", "--q-lora-rank 24", "--kv-lora-rank 16",
                    "--qk-head-dim 8", "--qk-pos-emb-head-dim 4", "--v-head-dim 12",
                    "--rope-type yarn", "--rotary-scaling-factor 40.0", "--mscale 1.0",
                    "--mscale-all-dim 0.7", "--moe-layer-freq [0,1,1]"),
}


@pytest.mark.parametrize("family", sorted(FLAGS))
def test_flags_name_the_family_options(round_trips, family):
    args = round_trips[family]["args"]
    assert [flag for flag in FLAGS[family] if flag not in args] == []
    # gpt-oss's linear layers have biases
    assert ("--disable-bias-linear" in args) == (family != "gpt_oss")


def _verify_a_saved_checkpoint(rank, world_size, checkpoint, saved):
    """verify of a directory like a fine-tuning run's --save (the tracker and the checkpoint, no
    pretrain_args.txt): with and without --imported."""
    import shutil

    saved = Path(saved)
    saved.mkdir()
    for name in ("latest_checkpointed_iteration.txt", "release"):
        copy = shutil.copytree if (Path(checkpoint) / name).is_dir() else shutil.copy
        copy(Path(checkpoint) / name, saved / name)
    tool, source = hf_conversion, Path(checkpoint).parent / "mixtral"
    verify = ["verify", "--hf-dir", str(source), "--load", str(saved), "--tokens", "8"]
    return tool.run(verify + ["--imported", checkpoint]), tool.run(verify)


def test_verify_of_a_finetuning_save_takes_the_flags_of_the_import(round_trips, tmp_path):
    with_imported, without = run_on_ranks(_verify_a_saved_checkpoint, 1, args=(
        round_trips["mixtral"]["checkpoint"], str(tmp_path / "saved")), timeout_s=300)[0]
    assert (with_imported, without) == (0, 2)  # without: refused, naming --imported


def save_as_training_does(checkpoint: str, saved: str) -> None:
    """The import loaded and saved again as pretrain_gpt.py's --save writes it (megatron-core's
    sharded state dict without the import's content metadata: identical layers stacked). Run as
    a process of its own: megatron-core's writer starts a manager process."""
    from megatron.core import dist_checkpointing

    from tests.unit.training.test_dist_checkpoint import cpu_checkpointing

    tool = hf_conversion
    with tool.one_process():
        cpu_checkpointing()
        model = tool.build_model(tool.pipeline.read_args_file(checkpoint), 8, torch.float32)
        tool.load_into(model, checkpoint)
        directory = Path(saved) / "iter_0000001"
        directory.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(directory))
    (Path(saved) / "latest_checkpointed_iteration.txt").write_text("1")


def _process(*argv: str) -> subprocess.CompletedProcess:
    """``python ARGV`` as a process of its own, in the repository, on the CPU."""
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


def test_export_of_a_training_save_runs_as_its_own_process(round_trips, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint, saved, exported = round_trips["mixtral"]["checkpoint"], tmp_path / "saved", \
        tmp_path / "exported"
    done = _process("-c", f"from tests.unit.convert.test_convert_hf import save_as_training_does; "
                          f"save_as_training_does({checkpoint!r}, {str(saved)!r})")
    assert done.returncode == 0, done.stderr[-3000:]
    keys = FileSystemReader(str(saved / "iter_0000001")).read_metadata().state_dict_metadata
    assert "decoder.layers.self_attention.linear_proj.weight" in keys  # layers stacked
    done = _process(str(TOOL), "export", "--load", str(saved), "--output", str(exported),
                    "--imported", checkpoint)
    assert done.returncode == 0, done.stderr[-3000:]
    original, back = tensors_of(Path(checkpoint).parent / "mixtral"), tensors_of(exported)
    assert sorted(original) == sorted(back)
    assert [n for n in original if not torch.equal(original[n], back[n])] == []


# --------------------------------------------------------------------------------------------
# an imported checkpoint at other parallel layouts
# --------------------------------------------------------------------------------------------

LAYOUTS = {  # name -> (flags, megatron-core's parallel sizes)
    "EP=2": (["--expert-model-parallel-size", "2"], dict(expert_model_parallel_size=2)),
    "CP=2": (["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
             dict(context_parallel_size=2)),
}
SEQ = 16


def _mean_loss(tool, checkpoint: str, batch: dict, layout: str) -> float:
    """The mean loss over ``batch`` of the imported model at ``layout`` (one rank's share of the
    sequence under context parallelism), loaded as pretrain_gpt.py --load does."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    extra, sizes = LAYOUTS.get(layout, ([], {}))
    parallel_state.initialize_model_parallel(**sizes)
    try:
        flags = tool.pipeline.read_args_file(checkpoint) + extra
        model = tool.build_model(flags, SEQ, torch.float32)
        tool.load_into(model, checkpoint)
        model.eval()
        group = parallel_state.get_context_parallel_group()
        local = get_batch_on_this_cp_rank(dict(batch), False, cp_group=group)
        with torch.no_grad():
            losses = model(local["tokens"], local["position_ids"], attention_mask=None,
                           labels=local["labels"])
        total = losses.sum()
        dist.all_reduce(total, group=group)
        return total.item() / batch["labels"].numel()
    finally:
        parallel_state.destroy_model_parallel()


def _losses_at_layouts(rank, world_size, checkpoint):
    import os

    from tests.conftest import keep_upstream_dispatcher_on_cpu, keep_upstream_rotary_on_cpu

    keep_upstream_rotary_on_cpu()
    keep_upstream_dispatcher_on_cpu()
    # what upstream checks the flags against
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    tool = hf_conversion
    tokens = torch.randint(0, COMMON["vocab_size"], (1, SEQ + 1),
                           generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "position_ids": torch.arange(SEQ).unsqueeze(0)}
    return {layout: _mean_loss(tool, checkpoint, batch, layout) for layout in ("1", *LAYOUTS)}


def test_imported_checkpoint_loads_at_expert_and_context_parallel_layouts(round_trips):
    losses = run_on_ranks(_losses_at_layouts, 2, args=(round_trips["mixtral"]["checkpoint"],),
                          timeout_s=300)
    for rank_losses in losses:
        for layout in LAYOUTS:
            assert rank_losses[layout] == pytest.approx(rank_losses["1"], rel=1e-6), layout
    assert losses[0] == losses[1]


# --------------------------------------------------------------------------------------------
# refusals (before any model is built)
# --------------------------------------------------------------------------------------------


def fake_model(directory: Path, config: dict, tensors=("model.embed_tokens.weight",)) -> Path:
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file({name: torch.zeros(2, 2) for name in tensors}, str(directory / "model.safetensors"))
    return directory


def refusal(capsys, argv) -> str:
    assert hf_conversion.run(argv) == 2
    return capsys.readouterr().err


def qwen3_config(**changes) -> dict:
    config = dict(model_type="qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"][1],
                  rms_norm_eps=1e-6, hidden_act="silu")
    config.update(changes)
    return config


def test_a_load_that_does_not_exist_is_named_before_any_model_is_read(tmp_path, capsys):
    missing = tmp_path / "no_such_checkpoint"
    err = refusal(capsys, ["verify", "--hf-dir", str(tmp_path), "--load", str(missing)])
    assert f"--load {missing} does not exist" in err and "pretrain_args.txt" not in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    err = refusal(capsys, ["export", "--load", str(missing), "--output", str(tmp_path / "out")])
    assert f"--load {missing} does not exist" in err and not (tmp_path / "out").exists()
    err = refusal(capsys, ["verify", "--hf-dir", str(tmp_path), "--load", str(tmp_path),
                           "--imported", str(missing)])
    assert f"--imported {missing} does not exist" in err


def test_unsupported_model_type_is_refused_by_name(tmp_path, capsys):
    model = fake_model(tmp_path / "llama", dict(model_type="llama"))
    err = refusal(capsys, ["import", "--hf-dir", str(model), "--output", str(tmp_path / "out")])
    assert "model_type 'llama' is not supported" in err and "qwen3_moe" in err
    assert "kimi_k2" in err and len(err.strip().splitlines()) == 1


def one_line_refusal(capsys, argv) -> str:
    """The tool's message for ``argv``: exit status 2, one line, no traceback."""
    err = refusal(capsys, argv)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def sharded_fake(directory: Path, config: dict, stored: dict, index: dict) -> Path:
    """A model directory whose files hold ``stored`` ({file: [tensor names]}) and whose index
    lists ``index`` ({tensor name: file}), which may disagree with them."""
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    for file_name, names in stored.items():
        save_file({n: torch.zeros(2, 2) for n in names}, str(directory / file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return directory


def qwen3_tensor_names() -> list:
    from megatron.bounded.convert.families import family_for

    family, config = family_for(qwen3_config())
    return sorted({name for rule in family.rules(config) for name in rule.hf_names})


FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
FP8_SETTINGS = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                "activation_scheme": "dynamic"}


def _directory(case: str, root: Path) -> Path:
    """A model directory that ``case`` names, each with one thing wrong."""
    names, model = qwen3_tensor_names(), root / case
    if case == "no config.json":
        model.mkdir()
        (model / "model.safetensors").write_bytes(b"")
        return model
    if case == "config.json not JSON":
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "qwen3_moe",')
        return model
    if case == "no model_type":
        return fake_model(model, {"hidden_size": 64})
    if case == "tensor not listed":
        return fake_model(model, qwen3_config(), tensors=names[1:])
    if case == "tensor not in its file":
        return sharded_fake(model, qwen3_config(), {FIRST: names[1:]},
                            {name: FIRST for name in names})
    if case == "file missing":
        return sharded_fake(model, qwen3_config(), {FIRST: names[:-1]},
                            {name: (SECOND if name == names[-1] else FIRST) for name in names})
    if case == "index without weight_map":
        model = fake_model(model, qwen3_config(), tensors=names)
        (model / "model.safetensors.index.json").write_text("{}")
        return model
    if case == "awq":
        return fake_model(model, qwen3_config(quantization_config=dict(quant_method="awq")))
    if case == "fp8 static activations":
        return fake_model(model, qwen3_config(quantization_config=dict(
            FP8_SETTINGS, activation_scheme="static")))
    if case == "fp8 scales without quantization_config":
        return fake_model(model, qwen3_config(), tensors=[
            *names, "model.layers.0.self_attn.o_proj.weight_scale_inv"])
    if case == "fp8 scales of the wrong grid":
        return _fp8_with_wrong_scales(model)
    if case == "kimi_k2 of another architecture":
        return fake_model(model, dict(qwen3_config(), model_type="kimi_k2",
                                      architectures=["KimiForCausalLM"]))
    raise AssertionError(case)


def _fp8_with_wrong_scales(model: Path) -> Path:
    from safetensors.torch import save_file

    model.mkdir()
    (model / "config.json").write_text(json.dumps(qwen3_config(quantization_config=FP8_SETTINGS)))
    weight = "model.layers.0.self_attn.o_proj.weight"
    save_file({weight: torch.zeros(300, 130).to(torch.float8_e4m3fn),
               weight + "_scale_inv": torch.ones(2, 2)}, str(model / "model.safetensors"))
    return model


@pytest.mark.parametrize("case,named", [
    ("no config.json", ["has no config.json", "pass the directory of a Hugging Face model"]),
    ("config.json not JSON", ["config.json is not valid JSON", "restore the model's own"]),
    ("no model_type", ["config.json has no model_type", "supported: deepseek_v3"]),
    ("tensor not listed", ["needs the tensor 'lm_head.weight'",
                           "model.safetensors does not list", "check that the files"]),
    ("tensor not in its file", [f"{FIRST} lacks the tensor 'lm_head.weight'",
                                "model.safetensors.index.json lists in it", "restore the file"]),
    ("file missing", [f"{SECOND}, which model.safetensors.index.json lists", "is missing",
                      "restore the file"]),
    ("index without weight_map", ["model.safetensors.index.json has no weight_map", "restore"]),
    ("awq", ["quantization_config.quant_method = 'awq'", "does not dequantize",
             "convert a bf16 copy of the model"]),
    ("fp8 static activations", ["activation_scheme = 'static'", "convert a bf16 copy"]),
    ("fp8 scales without quantization_config",
     ["o_proj.weight_scale_inv (in model.safetensors) is a quantization scale",
      "no quantization_config", "restore the model's own config.json"]),
    ("fp8 scales of the wrong grid", ["o_proj.weight_scale_inv (in model.safetensors) is [2, 2]",
                                      "[300, 130] in blocks of weight_block_size = [128, 128] "
                                      "has [3, 2] blocks"]),
    ("kimi_k2 of another architecture", ["model_type 'kimi_k2' with architectures "
                                         "['KimiForCausalLM']", "DeepseekV3ForCausalLM"]),
])
def test_each_refusal_is_one_line_naming_the_file_or_field_and_the_fix(tmp_path, capsys, case,
                                                                       named):
    model = _directory(case, tmp_path)
    err = one_line_refusal(capsys, ["import", "--hf-dir", str(model),
                                    "--output", str(tmp_path / "out")])
    assert [text for text in named if text not in err] == [], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,named", [
    (["import", "--hf-dir", "x", "--output", "y", "--dtype", "fp16"],
     ["argument --dtype: invalid choice: 'fp16'", "--help"]),
    (["verify", "--hf-dir", "x", "--load", "y", "--tokens", "0"],
     ["argument --tokens", "'0' is not a positive whole number"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
])
def test_a_wrong_command_line_is_refused_in_one_line(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_status:
        hf_conversion.run(argv)
    err = capsys.readouterr().err
    assert exit_status.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert [text for text in named if text not in err] == [], err


def test_verify_and_export_of_a_directory_that_is_no_checkpoint_are_refused(tmp_path, capsys):
    model = fake_model(tmp_path / "model", qwen3_config())
    empty = tmp_path / "empty"
    empty.mkdir()
    err = one_line_refusal(capsys, ["verify", "--hf-dir", str(model), "--load", str(empty)])
    assert "has no pretrain_args.txt" in err and "--imported" in err
    err = one_line_refusal(capsys, ["export", "--load", str(empty),
                                    "--output", str(tmp_path / "out")])
    assert "has no conversion.json" in err and "--imported" in err
    (empty / "latest_checkpointed_iteration.txt").write_text("not a number")
    (empty / "conversion.json").write_text('{"tensors": {}}')
    (empty / "hf").mkdir()
    (empty / "hf" / "config.json").write_text(json.dumps(qwen3_config()))
    err = one_line_refusal(capsys, ["export", "--load", str(empty),
                                    "--output", str(tmp_path / "out")])
    assert "latest_checkpointed_iteration.txt" in err


@pytest.mark.parametrize("changes,named", [
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)), "'yarn'"),
    (dict(attention_bias=True), "attention_bias = True"),
    (dict(use_sliding_window=True), "use_sliding_window = True"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
])
def test_an_option_not_mapped_is_refused_by_name(tmp_path, capsys, changes, named):
    model = fake_model(tmp_path / "model", qwen3_config(**changes))
    err = refusal(capsys, ["import", "--hf-dir", str(model), "--output", str(tmp_path / "out")])
    assert named in err


def test_a_tensor_not_mapped_is_refused_by_name(tmp_path, capsys):
    source = save_model("mixtral", tmp_path / "mixtral", seed=0)
    tensors = tensors_of(source)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    from safetensors.torch import save_file

    save_file(tensors, str(source / "model.safetensors"))
    err = refusal(capsys, ["import", "--hf-dir", str(source), "--output", str(tmp_path / "out")])
    assert "'model.layers.0.self_attn.o_proj.bias'" in err


def test_a_hub_name_is_refused_with_the_download_step(tmp_path, capsys):
    err = refusal(capsys, ["import", "--hf-dir", "Qwen/Qwen3-30B-A3B",
                           "--output", str(tmp_path / "out")])
    assert "hub name" in err and "--local-dir" in err


def test_glm_routing_that_megatron_core_ranks_differently_is_refused(tmp_path, capsys):
    config = dict(model_type="glm4_moe", **COMMON, **FAMILIES["glm4_moe"][1], hidden_act="silu",
                  rms_norm_eps=1e-5)
    config.update(n_group=4, topk_group=2, num_experts_per_tok=6)
    model = fake_model(tmp_path / "glm", config)
    err = refusal(capsys, ["import", "--hf-dir", str(model), "--output", str(tmp_path / "out")])
    assert "n_group = 4" in err and "topk_group" in err


@pytest.mark.parametrize("family,changes,named", [
    ("gpt_oss", dict(attention_bias=False), "attention_bias = False"),
    ("deepseek_v3", dict(q_lora_rank=None), "q_lora_rank = null"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave = False"),
    ("deepseek_v3", dict(rms_norm_eps=1e-5), "rms_norm_eps = 1e-05"),
])
def test_gpt_oss_and_deepseek_options_not_mapped_are_refused(tmp_path, capsys, family, changes,
                                                              named):
    config = dict(model_type=family, **{**COMMON, **FAMILIES[family][1]}, hidden_act="silu",
                  rms_norm_eps=1e-6)
    config.update(changes)
    model = fake_model(tmp_path / family, config)
    err = refusal(capsys, ["import", "--hf-dir", str(model), "--output", str(tmp_path / "out")])
    assert named in err


# --------------------------------------------------------------------------------------------
# the user's files: never written over, no partial output after a failure
# --------------------------------------------------------------------------------------------


def hashes(directory: Path) -> dict:
    """{relative path: sha256} of every file under ``directory``."""
    import hashlib

    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def layout_of_files(source: Path, wrong_key: str = ""):
    """``layout_of`` for ``pipeline.import_model`` from the files alone (each rule's joined
    shape), so that an import runs in this process without building our model; ``wrong_key``'s
    shape is made wrong: the write fails when it reaches that tensor."""
    from megatron.bounded.convert.families import family_for
    from megatron.bounded.convert.hf_files import HFDirectory
    from megatron.bounded.convert.pipeline import ModelLayout

    def layout_of(flags, dtype):
        with HFDirectory(str(source)) as hf:
            family, config = family_for(hf.config)
            shapes = {rule.key: tuple(rule.join([hf.tensor(n) for n in rule.hf_names]).shape)
                      for rule in family.rules(config)}
        return ModelLayout({key: ((shape[0] + 1, *shape[1:]) if key == wrong_key else shape,
                                  dtype) for key, shape in shapes.items()}, {})

    return layout_of


@pytest.fixture(scope="module")
def small_import(tmp_path_factory):
    """A small Mixtral model and its import, made in this process."""
    pytest.importorskip("transformers")
    from megatron.bounded.convert import pipeline

    root = tmp_path_factory.mktemp("small_import")
    source = save_model("mixtral", root / "mixtral", seed=3)
    checkpoint = root / "ckpt"
    pipeline.import_model(str(source), str(checkpoint), "fp32", layout_of_files(source),
                          log=lambda line: None)
    return source, checkpoint


def test_export_into_a_directory_with_files_is_refused(small_import, tmp_path, capsys):
    _, checkpoint = small_import
    other = tmp_path / "other_model"  # another model's export
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"weights of another model")
    before = hashes(other)
    err = refusal(capsys, ["export", "--load", str(checkpoint), "--output", str(other)])
    assert f"--output {other} is not empty" in err and "--overwrite" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert hashes(other) == before and sorted(os.listdir(tmp_path)) == ["other_model"]
    # --overwrite never replaces the checkpoint it reads
    before = hashes(checkpoint)
    err = refusal(capsys, ["export", "--load", str(checkpoint), "--output", str(checkpoint),
                           "--overwrite"])
    assert "--output" in err and "--load" in err and hashes(checkpoint) == before


def test_a_checkpoint_changed_after_the_import_is_refused_in_one_line(small_import, tmp_path,
                                                                     capsys):
    import shutil

    _, checkpoint = small_import
    changed = tmp_path / "changed"
    shutil.copytree(checkpoint, changed)
    data = sorted((changed / "release").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes() + b"appended")
    err = one_line_refusal(capsys, ["export", "--load", str(changed),
                                    "--output", str(tmp_path / "out")])
    assert "does not match its integrity manifest" in err and data.name in err
    assert "re-import" in err


def test_export_overwrite_over_a_sharded_export_leaves_only_the_new_files(small_import,
                                                                          tmp_path, monkeypatch):
    from megatron.bounded.convert import pipeline
    from megatron.bounded.convert.hf_files import INDEX_FILE, HFDirectory

    _, checkpoint = small_import
    tool, exported, fresh = hf_conversion, tmp_path / "exported", tmp_path / "fresh"
    with monkeypatch.context() as patch:  # an older export, in files of a tensor or so each
        patch.setattr(pipeline, "SHARD_BYTES", 1)
        assert tool.run(["export", "--load", str(checkpoint), "--output", str(exported)]) == 0
    assert (exported / INDEX_FILE).exists() and len(list(exported.glob("*.safetensors"))) > 2
    (exported / "README.md").write_text("the user's notes")  # replaced too: --overwrite says so
    assert tool.run(["export", "--load", str(checkpoint), "--output", str(exported),
                      "--overwrite"]) == 0
    assert tool.run(["export", "--load", str(checkpoint), "--output", str(fresh)]) == 0
    assert hashes(exported) == hashes(fresh) and "model.safetensors" in hashes(fresh)
    assert sorted(os.listdir(tmp_path)) == ["exported", "fresh"]  # no staging directory left
    with HFDirectory(str(exported)) as hf:  # the importer reads the new file alone
        assert set(hf.files.values()) == {"model.safetensors"}


def test_a_failed_export_with_overwrite_leaves_the_directory_as_it_was(small_import, tmp_path,
                                                                       monkeypatch):
    from megatron.bounded.convert import pipeline

    _, checkpoint = small_import
    exported = tmp_path / "exported"
    assert hf_conversion.run(["export", "--load", str(checkpoint), "--output", str(exported)]) == 0
    (exported / "README.md").write_text("the user's notes")
    before = hashes(exported)

    class FullDisk(pipeline.SafetensorsWriter):
        def write(self, name, tensor):
            if self.written == 2:
                raise OSError(28, "No space left on device")
            super().write(name, tensor)

    monkeypatch.setattr(pipeline, "SafetensorsWriter", FullDisk)
    with pytest.raises(OSError, match="No space left"):
        pipeline.export_model(str(checkpoint), str(exported), log=lambda line: None,
                              overwrite=True)
    assert hashes(exported) == before and sorted(os.listdir(tmp_path)) == ["exported"]


def test_a_failed_import_leaves_no_partial_output_and_the_rerun_works(small_import, tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.bounded.convert import pipeline

    source, _ = small_import
    output = tmp_path / "ckpt"
    wrong = "decoder.final_layernorm.weight"  # written after the layers' tensors
    with pytest.raises(CheckpointException, match="disagree"):  # torch's, around ours
        pipeline.import_model(str(source), str(output), "fp32", layout_of_files(source, wrong),
                              log=lambda line: None)
    assert os.listdir(tmp_path) == []  # neither the output nor its staging directory
    pipeline.import_model(str(source), str(output), "fp32", layout_of_files(source),
                          log=lambda line: None)
    assert (output / "pretrain_args.txt").exists() and (output / "release").is_dir()
