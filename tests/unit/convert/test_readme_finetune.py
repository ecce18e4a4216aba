"""README.md's "Start from a Hugging Face model" block runs as written (tests/readme_finetune.py
reads it from the README and runs it with bash), with a toy Qwen3-MoE in place of the released
model and one GPU:

1. the README's own preprocessing command makes ``DATA`` from a toy corpus with the model's
   tokenizer; ``import`` and ``verify`` run for real;
2. the torchrun line's flags, as bash expands them (``$(cat .../pretrain_args.txt)`` included),
   go through pretrain_gpt.py's parsing, validation and planning (``parse_flags``, then
   ``plan_memory``) with the environment the line sets;
3. ``export`` runs on the imported checkpoint, standing in for the fine-tuned one at the
   torchrun line's ``--save``: it gives back the toy model's tensors bit for bit.

With the README's own GPU count, the same line with the flags the import writes for the released
Qwen3-30B-A3B (a stand-in checkpoint: the model is too large to make here) must fit nodes of
H100 80 GB (``tools/memory_budget.py``). Every ``--flag`` of the README's command blocks must be
one that the program it is given to takes, and every one of its flags table one pretrain_gpt.py
takes.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.converted_finetune import TOY_WIDTHS
from tests.readme_finetune import (
    RECORDING_TORCHRUN, TOY_GPUS, VARIABLES, environment_of, option, prepare_toy_run,
    read_block, recorded_launch, run_script, script, words, working_directory,
)
from tests.unit.distributed import run_on_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# Qwen/Qwen3-30B-A3B's config.json besides tests/converted_finetune.py's per-layer dimensions
RELEASED_QWEN3_30B_A3B = dict(num_hidden_layers=48, vocab_size=151_936)
H100_HBM_GB = "85.0"  # what torch reports for one H100 80 GB, in decimal GB
H100_NODE_HOST_GB = "128"  # host memory per GPU: a node of 1 TB and 8 GPUs
# flags the fine-tuning line must give itself (upstream has no default for most, or a wrong one)
REQUIRED_FLAGS = (
    "--load", "--finetune", "--save", "--save-interval", "--data-path", "--seq-length",
    "--max-position-embeddings", "--expert-model-parallel-size", "--bf16",
    "--use-distributed-optimizer", "--global-batch-size", "--train-iters", "--lr", "--min-lr",
    "--lr-decay-style",
)
WARMUP_FLAGS = ("--lr-warmup-fraction", "--lr-warmup-iters", "--lr-warmup-samples")
# the tools and scripts that hand the flags they do not take to pretrain_gpt.py (and the example
# scripts, examples/*/train.sh)
PASSES_FLAGS_ON = ("tools/memory_budget.py", "scripts/train.sh")
REPO_ROOT = Path(__file__).resolve().parents[3]
COMMANDS = "megatron.bounded.launch.commands"  # the modules of the tools/ runners


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """The block's preprocessing, ``import``, ``verify`` and torchrun (recorded) commands with the
    toy model and one GPU; (block, working directory, toy model, GPUs, recorded flags)."""
    root = tmp_path_factory.mktemp("readme_finetune")
    block, directory, hf_dir = prepare_toy_run(root)
    record = root / "torchrun.args"
    commands = [block.converting("import"), block.converting("verify"), block.launch()]
    run_script(script(block, {"HF_DIR": hf_dir, "GPUS": TOY_GPUS}, commands, RECORDING_TORCHRUN),
               directory, root / "block.log", timeout_s=600,
               environment={"TORCHRUN_RECORD": str(record)})
    gpus, flags = recorded_launch(record)
    return block, directory, hf_dir, gpus, flags, (root / "block.log").read_text()


def _parse_and_plan(rank, world_size, directory, flags, environment, gpus):
    """pretrain_gpt.py's parse_flags and plan_memory on ``flags`` in ``directory`` (the block's
    relative paths); a refusal fails with its message."""
    os.chdir(directory)
    os.environ.update(environment, WORLD_SIZE=str(gpus), RANK="0", LOCAL_RANK="0")
    import pretrain_gpt

    sys.argv = ["pretrain_gpt.py", *flags]
    printed, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            args, settings = pretrain_gpt.parse_flags()
            pretrain_gpt.plan_memory(args, settings)
    except SystemExit as exit:
        raise AssertionError(f"refused (exit {exit.code}): {errors.getvalue()[-2000:]}") from None
    launch_lines = [line for line in printed.getvalue().splitlines()
                    if line.startswith(("[bounded] plan:", "[bounded] memory budget:"))]
    return {"load": args.load, "save": args.save, "save_interval": args.save_interval,
            "finetune": args.finetune, "data_path": args.data_path,
            "tokenizer": [args.tokenizer_type, args.tokenizer_model],
            "expert_parallel": args.expert_model_parallel_size,
            "seq_length": args.seq_length, "hidden": args.hidden_size,
            "schedule": [args.train_iters, args.lr, args.min_lr, args.global_batch_size],
            "launch_lines": launch_lines}


def _memory_budget(rank, world_size, directory, flags, environment, gpus):
    """tools/memory_budget.py for nodes of H100s: (exit status, what it printed)."""
    os.chdir(directory)
    os.environ.update(environment)
    from megatron.bounded.launch.commands import memory_budget as tool

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            status = tool.main(["--world-size", str(gpus), "--hbm-gb", H100_HBM_GB,
                                "--budget-host-gb", H100_NODE_HOST_GB, "--no-formulas", *flags])
    except SystemExit as exit:  # refused: the flags, or no plan that fits
        status = exit.code
    return status, printed.getvalue()


def test_the_block_starts_with_its_variables_and_its_commands_use_each_others_paths():
    block = read_block()
    assert tuple(block.variables) == VARIABLES
    imported = option(block.converting("import"), "--output")
    launch, export = block.launch(), block.converting("export")
    verify = block.converting("verify")
    assert option(verify, "--load") == imported and option(launch, "--load") == imported
    assert f"$(cat {imported}/pretrain_args.txt)" in launch
    assert option(export, "--imported") == imported
    assert option(export, "--load") == option(launch, "--save")
    assert option(launch, "--nproc-per-node") == "$GPUS"
    assert option(launch, "--train-iters") == "$TRAIN_ITERS"
    assert option(launch, "--data-path") == "$DATA"
    assert option(block.preprocess, "--tokenizer-model") == "$HF_DIR"
    # upstream asserts on it for tensor or context parallelism on Hopper and earlier
    assert environment_of(launch).get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    given = words(launch)
    assert [flag for flag in REQUIRED_FLAGS if flag not in given] == []
    assert any(flag in given for flag in WARMUP_FLAGS)


def test_the_block_imports_verifies_plans_and_exports_the_toy_model(toy_run, tmp_path):
    from safetensors.torch import load_file

    block, directory, hf_dir, gpus, flags, log = toy_run
    assert gpus == int(TOY_GPUS)
    assert "largest logit difference" in log and ": ok" in log, log[-3000:]
    imported = directory / option(block.converting("import"), "--output")
    arguments = (imported / "pretrain_args.txt").read_text()
    assert "--tokenizer-type HuggingFaceTokenizer" in arguments  # the model's own tokenizer
    launch = block.launch()
    parsed = run_on_ranks(_parse_and_plan, 1, args=(str(directory), flags,
                                                    environment_of(launch), gpus),
                          timeout_s=300)[0]
    assert parsed["load"] == str(imported.relative_to(directory)) and parsed["finetune"]
    assert parsed["save"] == option(launch, "--save") and parsed["save_interval"] > 0
    assert parsed["data_path"] == [block.value("DATA")]
    assert parsed["tokenizer"] == ["HuggingFaceTokenizer", str(imported.resolve() / "hf")]
    assert parsed["expert_parallel"] == gpus
    assert parsed["hidden"] == TOY_WIDTHS["qwen3_moe"]["hidden_size"]
    assert parsed["schedule"][0] == int(block.value("TRAIN_ITERS"))
    assert [line.split(":")[0] for line in parsed["launch_lines"]] == [
        "[bounded] plan", "[bounded] memory budget"], parsed["launch_lines"]
    assert "(fits;" in parsed["launch_lines"][1]
    # the fine-tuning run's --save, as the import wrote it: what the export reads
    shutil.copytree(imported, directory / option(launch, "--save"))
    export = block.converting("export")
    run_script(script(block, {"HF_DIR": hf_dir, "GPUS": TOY_GPUS}, [export], RECORDING_TORCHRUN),
               directory, tmp_path / "export.log", timeout_s=300)
    exported = load_file(directory / option(export, "--output") / "model.safetensors")
    source = load_file(hf_dir / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert [name for name in source if not exported[name].equal(source[name])] == []


def test_the_launch_line_fits_the_released_qwen3_30b_a3b_on_the_readmes_gpus(toy_run, tmp_path):
    from megatron.bounded.convert.families import family_for

    from tests.converted_finetune import hf_config, write_stand_in_import

    block, toy_directory, hf_dir, _, _, _ = toy_run
    directory = working_directory(tmp_path / "released")
    data = block.value("DATA").split("/")[0]
    (directory / data).symlink_to(toy_directory / data)  # the toy corpus: the budget is per token
    imported = directory / option(block.converting("import"), "--output")
    module, config = family_for(hf_config("qwen3_moe", **RELEASED_QWEN3_30B_A3B).to_dict())
    # what the import writes for a directory with tokenizer files
    tokenizer = imported / "hf"
    architecture = module.flags(config) + ["--tokenizer-type", "HuggingFaceTokenizer",
                                           "--tokenizer-model", str(tokenizer.resolve())]
    write_stand_in_import(imported, architecture)
    shutil.copytree(hf_dir, tokenizer, ignore=shutil.ignore_patterns("*.safetensors"))
    record = tmp_path / "torchrun.args"
    launch = block.launch()
    run_script(script(block, {"HF_DIR": hf_dir}, [launch], RECORDING_TORCHRUN), directory,
               tmp_path / "launch.log", timeout_s=60,
               environment={"TORCHRUN_RECORD": str(record)})
    gpus, flags = recorded_launch(record)
    assert gpus == int(block.value("GPUS"))
    status, printed = run_on_ranks(_memory_budget, 1, args=(str(directory), flags,
                                                            environment_of(launch), gpus),
                                   timeout_s=300)[0]
    assert status == 0 and "verdict: FITS" in printed, printed[-3000:]
    assert f", world {gpus}, " in printed, printed[-3000:]  # the budget of the README's GPUs


def _option_strings(parser) -> set:
    return set(parser._option_string_actions)


def _pretrain_flags() -> set:
    """Every option string of pretrain_gpt.py's parser (upstream's and this project's), and the
    help flag pretrain_gpt.py answers before it parses."""
    import argparse

    from megatron.bounded.launch.arguments import HELP_FLAG, add_bounded_args
    from megatron.training.arguments import add_megatron_arguments

    parser = add_bounded_args(add_megatron_arguments(argparse.ArgumentParser()))
    return _option_strings(parser) | {HELP_FLAG}


def _program_source(path: Path) -> str:
    """The source of ``path`` and of the modules of megatron.bounded.launch.commands it imports,
    transitively: a tools/ runner names no flag itself, its command's module does."""
    sources, pending, seen = [], [path], set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        sources.append(path.read_text(encoding="utf-8"))
        python = ast.parse(sources[-1]) if path.suffix == ".py" else ast.Module(body=[])
        for node in ast.walk(python):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(COMMANDS):
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                pending += [module for name in names
                            for module in [REPO_ROOT / (name.replace(".", "/") + ".py")]
                            if module.is_file()]
    return "\n".join(sources)


def _named_in(program: str, flag: str) -> bool:
    """Whether the source of ``program`` (a file of this repository, with the command modules it
    runs) names ``flag``."""
    source = _program_source(REPO_ROOT / program)
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", source) is not None


def unknown_flags(command: str, pretrain: set, torchrun: set) -> list:
    """The flags of one command line of a README block that its program does not take: those
    after ``pretrain_gpt.py`` (or of a line of flags alone) are pretrain_gpt.py's, those before it
    torchrun's; a tool or script of this repository takes the flags its source names, and those
    it hands to pretrain_gpt.py (:data:`PASSES_FLAGS_ON`)."""
    found = words(command)
    flags = [word for word in found if re.fullmatch(r"--[a-z][\w-]*", word)]
    programs = [word for word in found if (REPO_ROOT / word).is_file()]
    if "pretrain_gpt.py" in found:
        at = found.index("pretrain_gpt.py")
        return ([flag for flag in found[:at] if flag in flags and flag not in torchrun]
                + [flag for flag in found[at:] if flag in flags and flag not in pretrain])
    if not programs:
        return [flag for flag in flags if flag not in pretrain]
    program = programs[0]
    passes_on = program in PASSES_FLAGS_ON or program.startswith("examples/")
    return [f"{program} {flag}" for flag in flags
            if not _named_in(program, flag) and not (passes_on and flag in pretrain)]


def test_every_flag_of_the_readmes_command_blocks_is_taken_by_its_program():
    from torch.distributed.run import get_args_parser

    pretrain, torchrun = _pretrain_flags(), _option_strings(get_args_parser())
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    commands = [command for block in re.findall(r"^```bash\n(.*?)^```", readme,
                                                re.MULTILINE | re.DOTALL)
                for command in block.replace("\\\n", " ").splitlines()]
    # the flags table: a code span of flags is a line of pretrain_gpt.py's flags
    table_flags = [span for line in readme.splitlines() if line.startswith("|")
                   for span in re.findall(r"`([^`\n]+)`", line) if span.startswith("--")]
    assert any("--ring-dtp" in flags for flags in table_flags)
    commands += table_flags
    assert any("pretrain_gpt.py" in command for command in commands)
    assert [flag for command in commands
            for flag in unknown_flags(command, pretrain, torchrun)] == []


def test_unknown_flags_are_found_for_each_kind_of_program():
    pretrain, torchrun = {"--lr", "--bf16", "--ring-dtp"}, {"--nproc-per-node"}
    line = "torchrun --nproc-per-node 8 --nprocs 2 pretrain_gpt.py --lr 1 --lr-typo 2 --bf16"
    assert unknown_flags(line, pretrain, torchrun) == ["--nprocs", "--lr-typo"]
    assert unknown_flags("--lr 1 --bf17", pretrain, torchrun) == ["--bf17"]
    assert unknown_flags("python tools/convert_hf.py import --hf-dir D --ring-dtp", pretrain,
                         torchrun) == ["tools/convert_hf.py --ring-dtp"]
    assert unknown_flags("python tools/memory_budget.py --world-size 8 --lr 1 --lr-typo 2",
                         pretrain, torchrun) == ["tools/memory_budget.py --lr-typo"]
