"""What every system trains on: one Qwen3-MoE model made with transformers' own class (random
weights from a fixed seed, saved with ``save_pretrained``), its import for ``pretrain_gpt.py``
(``tools/convert_hf.py import``), one token stream written as megatron-core's indexed dataset,
and the training settings they share.

The tokens are the same for every system because they are drawn the way ``pretrain_gpt.py``
draws them: megatron-core's ``GPTDataset`` over the indexed dataset, built with the seed, sequence
length, split and sample count of the run (its shuffles depend on all four), read in order as
upstream's pretraining sampler reads it on one data-parallel rank (sample ``step · B + i`` is the
i-th sequence of step ``step`` of a global batch of ``B``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]

# The small example's dimensions (examples/moe_small/train.sh) and the per-layer dimensions of
# the released Qwen3-30B-A3B with 4 of its 48 layers; every layer is a MoE layer.
PRESETS = {
    "small": dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=1024, intermediate_size=4096, vocab_size=32_000),
    "qwen3_30b_a3b_4l": dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=768,
                             intermediate_size=6144, vocab_size=151_936),
}
# Qwen3's options, the same for both. The load-balancing loss is off: transformers computes it
# over every layer's tokens at once and megatron-core per layer, so with it the systems would
# not train the same function; what it costs is a few reductions per layer.
QWEN3 = dict(norm_topk_prob=True, rms_norm_eps=1e-6, router_aux_loss_coef=0.0,
             output_router_logits=False, tie_word_embeddings=False, attention_dropout=0.0,
             max_position_embeddings=262_144,
             rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0))
MODEL_SEED = 0
DATA_SEED = 1234  # --seed of pretrain_gpt.py: GPTDataset's shuffles
SPLIT = "100,0,0"  # every document in the training split
# The token stream: ids below the small preset's vocabulary (the last one ends each document; a
# smaller model's vocabulary, below its own), drawn from a Zipf-like law, so that the loss falls
# within a few steps.
STREAM_VOCAB = 32_000
STREAM_TOKENS = 16 * 2**20
DOCUMENT_TOKENS = (1_024, 16_384)
# Tokens per step below which several sequences make one step (examples/moe_small/train.sh's
# default global batch: 32,768 tokens, at least one sequence).
STEP_TOKENS = 32_768


@dataclass(frozen=True)
class Optimizer:
    """AdamW as pretrain_gpt.py runs it (megatron-core's Adam is torch's AdamW without Apex or
    Transformer Engine): no weight decay on 1-D parameters, the gradient norm clipped, a
    constant learning rate. ``flags`` gives the same to pretrain_gpt.py."""

    lr: float = 3e-4
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0

    def flags(self) -> list:
        return ["--lr", str(self.lr), "--min-lr", str(self.lr), "--lr-decay-style", "constant",
                "--lr-warmup-iters", "0", "--weight-decay", str(self.weight_decay),
                "--adam-beta1", str(self.betas[0]), "--adam-beta2", str(self.betas[1]),
                "--adam-eps", str(self.eps), "--clip-grad", str(self.clip_grad)]


OPTIMIZER = Optimizer()


def global_batch(seq_length: int) -> int:
    """Sequences per step at ``seq_length``."""
    return max(1, STEP_TOKENS // seq_length)


@dataclass(frozen=True)
class Workload:
    """The files of one preset under ``directory`` (:func:`make` writes them)."""

    directory: Path

    @property
    def hf_dir(self) -> Path:
        return self.directory / "hf"

    @property
    def checkpoint(self) -> Path:
        return self.directory / "imported"

    @property
    def data_prefix(self) -> Path:
        return self.directory / "data" / "tokens"

    @property
    def manifest(self) -> dict:
        return json.loads((self.directory / "manifest.json").read_text())

    @property
    def vocab_size(self) -> int:
        return self.manifest["config"]["vocab_size"]


def model_config(preset: str, **changes):
    """transformers' ``Qwen3MoeConfig`` of ``preset`` (``changes``: other fields)."""
    import transformers

    return transformers.Qwen3MoeConfig(**{**QWEN3, **PRESETS[preset], **changes})


def make(preset: str, directory: Path, dtype: str = "bf16", stream_tokens: int = STREAM_TOKENS,
         **changes) -> Workload:
    """The model (saved in ``dtype``), its import and the token stream of ``preset`` under
    ``directory``, with a manifest of their digests; kept as they are when the manifest is
    there (a digest says whether two machines made the same)."""
    workload = Workload(Path(directory))
    if (workload.directory / "manifest.json").exists():
        return workload
    workload.directory.mkdir(parents=True, exist_ok=True)
    config = model_config(preset, **changes)
    save_model(config, workload.hf_dir, getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]))
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_hf.py"), "import",
                    "--hf-dir", str(workload.hf_dir), "--output", str(workload.checkpoint),
                    "--dtype", dtype], check=True)
    write_stream(workload.data_prefix, stream_tokens, min(STREAM_VOCAB, config.vocab_size))
    manifest = {"preset": preset, "dtype": dtype, "config": config.to_dict(),
                "weights_sha256": digest(sorted(workload.hf_dir.glob("*.safetensors"))),
                "tokens_sha256": digest([workload.data_prefix.with_suffix(".bin"),
                                         workload.data_prefix.with_suffix(".idx")]),
                "stream_tokens": stream_tokens}
    (workload.directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return workload


def save_model(config, directory: Path, dtype: torch.dtype) -> None:
    """transformers' model of ``config``, its own initialization from :data:`MODEL_SEED`."""
    import transformers

    torch.manual_seed(MODEL_SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).save_pretrained(directory)


def write_stream(prefix: Path, total_tokens: int, vocab: int) -> None:
    """``prefix``.bin/.idx: documents of random lengths, ids from a Zipf-like law below
    ``vocab`` − 1, each ended by ``vocab`` − 1 (megatron-core's builder, what
    tools/preprocess_data.py writes with)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(DATA_SEED)
    ids = vocab - 1
    weights = 1.0 / numpy.arange(10, ids + 10) ** 1.1
    weights /= weights.sum()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=numpy.uint16)
    written = 0
    while written < total_tokens:
        length = int(rng.integers(*DOCUMENT_TOKENS))
        document = numpy.append(rng.choice(ids, size=length - 1, p=weights), ids)
        builder.add_item(torch.from_numpy(document.astype(numpy.int64)))
        builder.end_document()
        written += length
    builder.finalize(str(prefix.with_suffix(".idx")))


def digest(paths) -> str:
    """SHA-256 of the files' bytes, in order."""
    sha = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                sha.update(block)
    return sha.hexdigest()


def training_dataset(workload: Workload, seq_length: int, num_samples: int):
    """megatron-core's ``GPTDataset`` as pretrain_gpt.py builds it for ``num_samples`` training
    sequences of ``seq_length`` tokens (train iterations × global batch) with the run's flags
    (``--seed`` :data:`DATA_SEED`, ``--split`` :data:`SPLIT`, no document resets or masks)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"},
                                                  vocab_size=workload.vocab_size)
    config = GPTDatasetConfig(
        random_seed=DATA_SEED, sequence_length=seq_length,
        blend=([str(workload.data_prefix)], None), split=SPLIT, tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    return train


def micro_batch(dataset, first: int, size: int, device) -> tuple:
    """(tokens, labels) of sequences ``first`` .. ``first + size − 1``, on ``device``; labels
    the loss leaves out (upstream's loss mask) are -100, the index every peer's loss ignores."""
    samples = [dataset[i] for i in range(first, first + size)]
    tokens = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples]).masked_fill(
        torch.stack([s["loss_mask"] for s in samples]) == 0, -100)
    return tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)
