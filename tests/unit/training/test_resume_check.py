"""pretrain_gpt.py's start-up checks of --save, --load and the checkpoint it resumes from
(megatron.bounded.training.resume_check). The checkpoints are real: megatron-core's torch_dist
save on one gloo rank, with the arguments of a validated command line in their common state as
upstream's save puts them, and the layout and writer of tools/convert_hf.py import for a
converted one. Each
refusal names the flag (every differing shape flag with both values), exits with status 2 and no
traceback, before the model is built; the checkpoint's files are left as they were."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.bounded.launch import arguments
from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.training import resume_check
from tests.conftest import MINIMAL_PRETRAIN_FLAGS
from tests.converted_finetune import write_stand_in_import
from tests.unit.distributed import run_on_ranks
from tests.unit.launch.test_bad_input import (  # noqa: F401 - the autouse fixture: one host, no TE
    assert_refused_once_on_rank_0, stack_without_te_and_resiliency,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
# --save needs --save-interval (refused otherwise before the checks of --save run)
FLAGS = [*MINIMAL_PRETRAIN_FLAGS, "--save-interval", "10"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]
ITERATION = "iter_0000005"
PADDED_VOCAB = 128  # --vocab-size 128 rounded up to a multiple of 128 × TP 1


def validated_args(flags, padded_vocab=PADDED_VOCAB):
    """``flags`` as pretrain_gpt.py has them when it checks the checkpoint: parsed, validated by
    upstream, and the padded vocabulary set (upstream's tokenizer build sets it there)."""
    from megatron.training.arguments import parse_args, validate_args

    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *FLAGS, *flags]
    try:
        args = parse_args(arguments.add_bounded_args)
        validate_args(args, {})
    finally:
        sys.argv = saved
    args.padded_vocab_size = padded_vocab
    return args


def _save_checkpoints(rank, world_size, root):
    """A dense and an MoE checkpoint as training saves them: the model's tensors (one here) and
    the common state with the run's arguments and iteration."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tests.unit.training.test_dist_checkpoint import cpu_checkpointing

    cpu_checkpointing()
    for name, flags in (("dense", []), ("moe", MOE)):
        checkpoint = os.path.join(root, name, ITERATION)
        os.makedirs(checkpoint)
        state = {"args": validated_args(flags), "iteration": 5, "checkpoint_version": 3.0,
                 "model": {"weight": ShardedTensor.from_rank_offsets("weight", torch.ones(4, 4))}}
        dist_checkpointing.save(state, checkpoint)
        with open(os.path.join(root, name, resume_check.TRACKER_FILE), "w") as tracker:
            tracker.write("5")
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run_on_ranks(_save_checkpoints, 1, args=(str(root),), timeout_s=300, daemon=False)
    return root


def hashes(directory: Path) -> dict:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def test_the_saved_arguments_are_read_from_the_common_state(saved):
    args = resume_check.saved_arguments(str(saved / "moe" / ITERATION))
    assert (args.hidden_size, args.num_experts, args.padded_vocab_size) == (64, 4, PADDED_VOCAB)


@pytest.mark.parametrize("name,flags", [("dense", []), ("moe", MOE),
                                        ("dense", ["--finetune", "--no-load-optim"])])
def test_the_same_shape_resumes(saved, name, flags):
    args = validated_args([*flags, "--load", str(saved / name)])
    assert resume_check.resume_of(args).checkpoint == str(saved / name / ITERATION)
    resume_check.check_model_shape(args)


# (checkpoint, flags of this run, each line the refusal must hold)
SHAPE_CASES = [
    pytest.param("dense", ["--hidden-size", "128", "--num-attention-heads", "4"],
                 ["--hidden-size: 64 in the checkpoint, 128 in this run",
                  "--ffn-hidden-size: 256 in the checkpoint, 512 in this run"], id="hidden-size"),
    pytest.param("dense", ["--num-layers", "4", "--kv-channels", "8"],
                 ["--num-layers: 2 in the checkpoint, 4 in this run",
                  "--kv-channels: 16 in the checkpoint, 8 in this run"], id="two-flags"),
    pytest.param("dense", ["--group-query-attention", "--num-query-groups", "2"],
                 ["--num-query-groups: 4 in the checkpoint, 2 in this run"], id="query-groups"),
    pytest.param("dense", ["--swiglu"], ["--swiglu: off in the checkpoint, on in this run"],
                 id="swiglu"),
    pytest.param("moe", [*MOE[:-2], "--moe-ffn-hidden-size", "32"],
                 ["--moe-ffn-hidden-size: 64 in the checkpoint, 32 in this run"],
                 id="moe-ffn-hidden-size"),
    pytest.param("moe", ["--num-experts", "8", *MOE[2:]],
                 ["--num-experts: 4 in the checkpoint, 8 in this run"], id="num-experts"),
    pytest.param("dense", MOE, ["--num-experts: none in the checkpoint, 4 in this run"],
                 id="dense-to-moe"),
]


@pytest.mark.parametrize("intent", [[], ["--finetune", "--no-load-optim", "--no-load-rng"]],
                         ids=["resume", "finetune"])
@pytest.mark.parametrize("name,flags,named", SHAPE_CASES)
def test_another_shape_is_refused_naming_each_flag_and_both_values(saved, name, flags, named,
                                                                   intent):
    before = hashes(saved)
    args = validated_args([*flags, *intent, "--load", str(saved / name)])
    with pytest.raises(BoundedArgumentError) as refused:
        resume_check.check_model_shape(args)
    message = str(refused.value)
    assert message.startswith(f"--load {saved / name}: the checkpoint "), message
    for line in named:
        assert f"  {line}\n" in message, message
    assert hashes(saved) == before


def test_another_padded_vocabulary_is_refused(saved):
    args = validated_args(["--load", str(saved / "dense")], padded_vocab=256)
    with pytest.raises(BoundedArgumentError, match="the padded vocabulary .*: 128 in the "
                                                   "checkpoint, 256 in this run"):
        resume_check.check_model_shape(args)


def test_a_converted_checkpoint_is_compared_with_its_pretrain_args(tmp_path):
    directory = write_stand_in_import(tmp_path / "converted", (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --normalization RMSNorm "
        "--swiglu").split())
    resume_check.check_model_shape(validated_args(["--load", str(directory), "--finetune",
                                                   "--swiglu"]))
    with pytest.raises(BoundedArgumentError) as refused:
        resume_check.check_model_shape(validated_args(["--load", str(directory), "--finetune",
                                                       "--hidden-size", "128"]))
    assert "--hidden-size: 64 in the checkpoint, 128 in this run" in str(refused.value)
    assert "--swiglu: on in the checkpoint, off in this run" in str(refused.value)
    assert "--normalization" not in str(refused.value)  # text values are not compared


def test_pretrain_gpt_exits_with_the_shape_refusal_before_building_anything(saved):
    """The whole entry point, as a job runs it: one message, status 2, no traceback."""
    before = hashes(saved)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *FLAGS, "--hidden-size", "128",
         "--load", str(saved / "dense"), "--finetune"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.count("[bounded] error:") == 1, done.stderr[-3000:]
    assert "--hidden-size: 64 in the checkpoint, 128 in this run" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert hashes(saved) == before


# --------------------------------------------------------------------------------------------
# --load and --save, before upstream's validation
# --------------------------------------------------------------------------------------------


def early(monkeypatch, capsys, flags, named) -> str:
    """``flags`` refused before upstream's validation: exit 2, one line on rank 0 naming
    ``named``; returns it."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *FLAGS, *flags])
    assert_refused_once_on_rank_0(monkeypatch, capsys, arguments.check_flags_before_upstream,
                                  named)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        arguments.check_flags_before_upstream()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def started(monkeypatch, capsys, flags) -> str:
    """What the start-up check prints for ``flags`` it accepts."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *FLAGS, *flags])
    monkeypatch.setenv("RANK", "0")
    arguments.check_flags_before_upstream()
    return capsys.readouterr().out


def test_a_load_that_does_not_exist_is_refused_unless_it_is_the_save(monkeypatch, capsys,
                                                                     tmp_path):
    missing = tmp_path / "runs" / "typo"
    err = early(monkeypatch, capsys, ["--load", str(missing), "--save", str(tmp_path / "run")],
                f"--load {missing} does not exist")
    assert "leave --load out" in err
    run = tmp_path / "run"  # a job that resumes itself, on its first start
    out = started(monkeypatch, capsys, ["--load", str(run), "--save", str(run)])
    assert f"[bounded] --load {run} does not exist yet: training starts from scratch" in out
    assert not run.exists()  # the check creates nothing


def test_a_load_without_a_checkpoint_starts_from_scratch_with_a_warning(monkeypatch, capsys,
                                                                       tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = started(monkeypatch, capsys, ["--load", str(empty)])
    assert f"[bounded] WARNING: --load {empty} holds no checkpoint" in out
    early(monkeypatch, capsys, ["--load", str(empty), "--finetune"],
          f"--finetune starts from the weights of --load, and --load {empty} holds no checkpoint")


def test_a_pretrained_checkpoint_is_loaded_when_load_holds_none(monkeypatch, capsys, saved,
                                                                tmp_path):
    """Upstream fine-tunes from --pretrained-checkpoint while --load (the run's own) holds no
    checkpoint: that one is checked, and the shapes are compared with it."""
    own = tmp_path / "finetune"
    flags = ["--load", str(own), "--save", str(own), "--save-interval", "10",
             "--pretrained-checkpoint"]
    assert started(monkeypatch, capsys, [*flags, str(saved / "dense")]) == ""
    resume = resume_check.resume_of(validated_args([*flags, str(saved / "dense")]))
    assert (resume.flag, resume.directory) == ("--pretrained-checkpoint", str(saved / "dense"))
    with pytest.raises(BoundedArgumentError, match="(?s)--pretrained-checkpoint .*--hidden-size: 64"):
        resume_check.check_model_shape(validated_args([*flags, str(saved / "dense"),
                                                       "--hidden-size", "128"]))
    early(monkeypatch, capsys, [*flags, str(tmp_path)],
          f"--pretrained-checkpoint {tmp_path} holds no checkpoint")
    assert started(monkeypatch, capsys, ["--finetune"]) == ""  # nothing to load: upstream's


def test_a_checkpoint_the_tracker_names_must_be_there(monkeypatch, capsys, saved, tmp_path):
    broken = tmp_path / "broken"
    (broken / ITERATION).mkdir(parents=True)
    (broken / resume_check.TRACKER_FILE).write_text("9")
    early(monkeypatch, capsys, ["--load", str(broken)],
          f"--load {broken}: its {resume_check.TRACKER_FILE} (9) names the checkpoint "
          f"{broken / 'iter_0000009'}, which does not exist")
    (broken / resume_check.TRACKER_FILE).write_text("5")  # an empty iter_0000005
    early(monkeypatch, capsys, ["--load", str(broken)], f"{broken / ITERATION} is not a checkpoint")
    before = hashes(saved)
    early(monkeypatch, capsys, ["--load", str(saved / "dense"), "--ckpt-step", "7"],
          "--ckpt-step 7 names the checkpoint")
    assert started(monkeypatch, capsys, ["--load", str(saved / "dense")]) == ""
    assert hashes(saved) == before


def test_a_save_that_cannot_be_written_is_refused(monkeypatch, capsys, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    early(monkeypatch, capsys, ["--save", str(a_file / "run")],
          f"--save {a_file / 'run'} cannot be created: {a_file} is a file")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes past the mode bits: judge by them as another user would
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode) and not (
            mode & os.W_OK and not os.stat(path).st_mode & 0o222))
    try:
        early(monkeypatch, capsys, ["--save", str(read_only / "runs" / "run")],
              f"--save {read_only / 'runs' / 'run'} does not exist and cannot be created: "
              f"{read_only}, the nearest directory above it that exists, is not writable")
        early(monkeypatch, capsys, ["--save", str(read_only)],
              f"--save {read_only} is not writable by this job")
    finally:
        read_only.chmod(0o755)
    assert started(monkeypatch, capsys, ["--save", str(tmp_path / "new" / "run")]) == ""
    assert not (tmp_path / "new").exists()


def test_a_directory_that_is_not_a_checkpoint_is_named_with_what_it_lacks(tmp_path, saved):
    (tmp_path / "notes.txt").write_text("x")
    why = resume_check.not_a_checkpoint(str(tmp_path))
    assert why.startswith(f"{tmp_path} is not a checkpoint: it has no .metadata or metadata.json")
    assert "mp_rank_*" in why
    assert resume_check.not_a_checkpoint(str(saved / "dense" / ITERATION)) is None
