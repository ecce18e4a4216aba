"""Fine-tuning a converted Hugging Face checkpoint on one GPU (marker ``gpu``), per family:
gpt-oss-20b's and Qwen3-30B-A3B's shapes (tests/converted_finetune.py: the released models'
per-layer dimensions, 2 layers, a vocabulary of 32,000), made with transformers' own classes
(its random initialization, saved in bf16), then

1. ``tools/convert_hf.py import --dtype bf16``;
2. 50 iterations of ``pretrain_gpt.py $(cat CKPT/pretrain_args.txt) --load CKPT --finetune`` on
   131,072-token sequences of packed 4,096-token documents (``--reset-attention-mask
   --eod-mask-loss``, NullTokenizer's end of document) with OffloadStreamAdamW, SCO, Ring-DTP and
   full recompute (Qwen3 also PipelinedLLEP and the recompute in chunks with the attention
   sublayer, which need this project's grouped experts: gpt-oss's experts have biases), saved at
   the end: the mean loss of the last five iterations at least 1 below the first five's;
3. ``export --imported CKPT`` of the saved checkpoint: its output layer is the fine-tuned one (not
   the original's), and ``verify --imported CKPT`` (transformers' ``AutoModelForCausalLM.from_pretrained`` of the
   export against our model with the saved checkpoint, both in fp32 on the CPU, 256 random tokens:
   past gpt-oss's 128-token window) within 1e-5 of the largest logit, the tool's tolerance for a
   checkpoint kept in the model's precision: both sides hold the same bf16 weights, only the
   order of fp32 sums differs.

The loss margin: the documents draw their ids uniformly from 1,024 of the 32,000, so the best
loss is ln 1024 = 6.9, while transformers' initialization (output weights of std 0.02 over
unit-RMS hidden states: logits of std 0.02·√hidden, about 1) starts near ln 32000 + 0.5 = 10.9;
weights that do not move repeat the first losses within about 0.01 (131,072 tokens each).

Time on one H200, estimated from the sizes: gpt-oss has 1.8e9 parameters, 3.4e8 active per
token: 131,072 tokens × 8 (forward, backward, full recompute) × 3.4e8 = 3.6e14 FLOP, about 1.5 s
an iteration, and OffloadStreamAdamW moves 22 GB of optimizer state each way, about 1 s: 2 min
for 50 iterations; Qwen3 (1.4e9 parameters, 1.8e8 active) about 1.5 s an iteration, 1.3 min.
Making the model, the import, start-up, load and save, the export and ``verify`` (two fp32 models
of 7 / 5.5 GB on the CPU) add about 2.5 minutes per family: about 8 minutes for the file.
Records (losses, time per iteration, peak memory, logit difference, each phase's seconds) go to
``RESULTS_DIR/convert_hf_finetune.json``.

``test_readme_block_fine_tunes_a_toy_model_as_written`` runs README.md's "Start from a Hugging
Face model" block itself (read from the README by tests/readme_finetune.py; bash runs it with
``torchrun`` launching for real, the convert commands with the GPU visible, as a user runs them)
with a toy Qwen3-MoE and its tokenizer, the README's own preprocessing command for ``DATA``,
``GPUS=1`` and ``TRAIN_ITERS=3``: the import, verify, 3 iterations of 8 sequences of 131,072
tokens saved at the end, the export; then ``verify --imported`` of the export against the saved
checkpoint. About 5 minutes; its log is ``RESULTS_DIR/readme_finetune.log``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import requires_cuda
from tests.converted_finetune import (
    DOCUMENT, DOCUMENT_IDS, MODELS, NUM_LAYERS, TOKENS, TRAIN_ITERS, VOCAB, finetune_flags,
    save_model,
)
from tests.functional.harness import (
    PORT_OFFSET, REPO_ROOT, RESULTS_DIR, assert_loss_falls, record_figures, run_pretrain,
    scratch_directory, write_documents,
)
from tests.readme_finetune import (
    LAUNCHING_TORCHRUN, TOY_GPUS, option, prepare_toy_run, run_script, script,
)

pytest.importorskip("transformers", reason="needs the convert extra: pip install '.[convert]'")
pytestmark = [pytest.mark.gpu, requires_cuda]

LOSS_FALL = 1.0  # of the 4 between the initial loss and the documents' best (module docstring)
VERIFY_TOKENS = 256
TOLERANCE = 1e-5
OUTPUT_LAYER = "lm_head.weight"
_DIFFERENCE = re.compile(r"largest logit difference relative to the largest logit ([-+.\de]+)")


def _convert(*argv, must_succeed: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    """``tools/convert_hf.py ARGV`` on the CPU, where its commands run (no GPU visible); (the
    finished process, its seconds)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tools/convert_hf.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0 or not must_succeed, (
        f"convert_hf.py {argv[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-3000:]}")
    return done, time.monotonic() - started


def _tensor(directory: Path, name: str):
    """The tensor ``name`` of the safetensors files of ``directory``."""
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as stream:
            if name in stream.keys():
                return stream.get_tensor(name)
    raise AssertionError(f"{name} is in no safetensors file of {directory}")


def _finetune(family: str, root: Path, imported: Path, saved: Path) -> dict:
    """Fine-tune the import into ``saved``; its figures (with the run's log and records)."""
    from megatron.bounded.convert import pipeline

    documents = root / "documents" / "documents"
    documents.parent.mkdir()
    # 8 sequences' worth: the 50 iterations go over them in several shuffled epochs
    write_documents(str(documents), count=8 * TOKENS // DOCUMENT, length=DOCUMENT, vocab=VOCAB,
                    ids=DOCUMENT_IDS)
    flags = finetune_flags(pipeline.read_args_file(str(imported)), str(imported), str(documents),
                           str(saved))
    started = time.monotonic()
    run = run_pretrain(f"convert_hf_finetune_{family}", 1, flags, port=29650, timeout_s=480)
    return {"flags": flags, "run": run, "seconds": time.monotonic() - started}


def _export_and_verify(source: Path, imported: Path, saved: Path, exported: Path) -> dict:
    _, export_seconds = _convert("export", "--load", saved, "--output", exported,
                                 "--imported", imported)
    verified, verify_seconds = _convert("verify", "--hf-dir", exported, "--load", saved,
                                        "--imported", imported, "--tokens", VERIFY_TOKENS,
                                        "--tolerance", TOLERANCE, must_succeed=False)
    found = _DIFFERENCE.search(verified.stdout)
    assert found and verified.returncode in (0, 1), (
        verified.stdout[-3000:] + verified.stderr[-3000:])
    return {"logit_difference": float(found.group(1)), "verify_exit": verified.returncode,
            "export_s": export_seconds, "verify_s": verify_seconds,
            "output_layer_changed": not _tensor(source, OUTPUT_LAYER).equal(
                _tensor(exported, OUTPUT_LAYER))}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_converted_model_fine_tunes_and_exports_with_the_trained_logits(tmp_path, monkeypatch,
                                                                        family):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with scratch_directory(tmp_path) as root:
        started = time.monotonic()
        source = save_model(family, root / "hf")
        make_seconds = time.monotonic() - started
        imported, saved = root / "imported", root / "finetuned"
        _, import_seconds = _convert("import", "--hf-dir", source, "--output", imported,
                                     "--dtype", "bf16")
        finetuned = _finetune(family, root, imported, saved)
        run = finetuned["run"]
        checked = _export_and_verify(source, imported, saved, root / "exported")
    records = run.records
    seconds = {"make_model": make_seconds, "import": import_seconds,
               "finetune": finetuned["seconds"], "export": checked.pop("export_s"),
               "verify": checked.pop("verify_s")}
    figures = {
        "layers": NUM_LAYERS, "vocab": VOCAB, "tokens": TOKENS,
        # the record names the run's scratch directory SCRATCH (machine-local paths stay out)
        "flags": [flag.replace(f"{root}/", "SCRATCH/") for flag in finetuned["flags"]],
        "lm_loss": [record["lm_loss"] for record in records],
        "iteration_s": [record["ms_per_iteration"] / 1e3 for record in records
                        if "ms_per_iteration" in record],
        "peak_allocated_gib": max(record["peak_allocated_gib"] for record in records),
        **checked, "tolerance": TOLERANCE, "seconds": seconds,
    }
    record_figures("convert_hf_finetune.json", family, figures)
    assert [record["iteration"] for record in records] == list(range(1, TRAIN_ITERS + 1))
    assert f"successfully loaded checkpoint from {imported}" in run.log
    assert "attention within documents" in run.log
    assert_loss_falls(records, family, by=LOSS_FALL)
    assert figures["output_layer_changed"], "the export holds the imported output layer"
    assert figures["logit_difference"] <= TOLERANCE and figures["verify_exit"] == 0, figures


README_TRAIN_ITERS = 3


def test_readme_block_fine_tunes_a_toy_model_as_written(tmp_path):
    with scratch_directory(tmp_path) as root:
        started = time.monotonic()
        block, directory, hf_dir = prepare_toy_run(root)
        values = {"HF_DIR": hf_dir, "GPUS": TOY_GPUS, "TRAIN_ITERS": README_TRAIN_ITERS}
        log = RESULTS_DIR / "readme_finetune.log"
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        # torchrun's rendezvous port (its --master-port), apart from the other tests' jobs
        run_script(script(block, values, block.commands, LAUNCHING_TORCHRUN), directory, log,
                   timeout_s=900, environment={"PET_MASTER_PORT": str(29670 + PORT_OFFSET),
                                               "NCCL_NVLS_ENABLE": "0"})
        block_seconds = time.monotonic() - started
        launch, export = block.launch(), block.converting("export")
        imported = directory / option(block.converting("import"), "--output")
        saved = directory / option(launch, "--save")
        exported = directory / option(export, "--output")
        tracker = (saved / "latest_checkpointed_iteration.txt").read_text().strip()
        verified, verify_seconds = _convert("verify", "--hf-dir", exported, "--load", saved,
                                            "--imported", imported, "--tokens", VERIFY_TOKENS,
                                            "--tolerance", TOLERANCE, must_succeed=False)
    text = log.read_text()
    found = _DIFFERENCE.search(verified.stdout)
    figures = {"saved_iteration": tracker, "block_s": block_seconds, "verify_s": verify_seconds,
               "logit_difference": float(found.group(1)) if found else None,
               "verify_exit": verified.returncode}
    record_figures("convert_hf_finetune.json", "readme_block", figures)
    assert tracker == str(README_TRAIN_ITERS), figures
    assert f"successfully loaded checkpoint from {option(launch, '--load')}" in text, text[-3000:]
    assert figures["verify_exit"] == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
