#!/usr/bin/env python
"""Start from a Hugging Face model: import its checkpoint, export it back, verify the logits.

    python tools/convert_hf.py import --hf-dir DIR --output CKPT [--dtype bf16|fp32]
    python tools/convert_hf.py export --load CKPT --output DIR [--imported CKPT0] [--overwrite]
    python tools/convert_hf.py verify --hf-dir DIR --load CKPT [--imported CKPT0] [--tokens N]
        [--tolerance T]

``import`` reads config.json and the safetensors files one tensor at a time and writes a
torch_dist checkpoint that ``pretrain_gpt.py --load CKPT --finetune`` starts from at any TP/EP/CP
layout, with CKPT/pretrain_args.txt: the flags that build this architecture. ``export`` writes a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``--imported``: the
directory the import wrote, when CKPT is a fine-tuning run's --save; ``verify`` takes it too).
``import`` and ``export`` write into no directory with files in it (``export --overwrite``
replaces it, once the export succeeded) and a failed run leaves no partial output.
``verify`` runs the same tokens through transformers' model and ours (both on CPU, fp32) and
exits 1 when the largest logit difference, relative to the largest logit, is above the tolerance. Families:
megatron/bounded/convert/. Exit status: 0 done, 1 verification failed, 2 refused (the message
says why).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from megatron.bounded.convert import pipeline, torch_dist  # noqa: E402
from megatron.bounded.convert.core import ConversionError  # noqa: E402

# Flags pretrain_gpt.py's parser needs besides the architecture's, to build the model alone.
BUILD_FLAGS = ["--micro-batch-size", "1", "--train-iters", "1",
               "--lr", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--transformer-impl", "local", "--use-cpu-initialization"]
DEFAULT_TOLERANCE = 1e-5


@contextlib.contextmanager
def one_process():
    """torch.distributed and megatron-core's parallel state for one CPU process (TP = EP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    # upstream's router puts its buffers on torch.cuda.current_device(): keep them on the CPU
    current_device = torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = current_device
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def build_model(flags: list, seq_length: int, dtype: torch.dtype):
    """Our GPT model of ``flags``, built like pretrain_gpt.py builds it (inside one_process())."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron.bounded.launch.arguments import add_bounded_args, validate_bounded_args

    precision = {torch.bfloat16: ["--bf16"], torch.float32: []}[dtype]
    # one micro-batch per data-parallel rank (of the parallel state the model is built in)
    batch = ["--global-batch-size", str(parallel_state.get_data_parallel_world_size())]
    argv = [*flags, *BUILD_FLAGS, *batch, *precision, "--seq-length", str(seq_length)]
    saved_argv, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # upstream prints every argument
            args = parse_args(add_bounded_args)
            validate_args(args, {})
            settings = validate_bounded_args(args)
    finally:
        sys.argv = saved_argv
    model_config = pretrain_gpt.build_model_config(args, settings)
    return GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())


def model_layout(flags: list, dtype: torch.dtype) -> pipeline.ModelLayout:
    """Keys, global shapes and dtypes of the model of ``flags``, built on the meta device."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject, ShardedTensor, apply_factories,
    )

    with one_process(), torch.device("meta"):
        model = build_model(flags, seq_length=1, dtype=dtype)
        sharded = model.sharded_state_dict(metadata=dict(torch_dist.CONTENT_METADATA))
        apply_factories(sharded)
    tensors, objects, pieces = {}, {}, {}
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor):
            tensors[item.key] = (tuple(item.global_shape), item.data.dtype)
            # the prepended axes (the expert's) are 1 wide in the piece
            shape = (1,) * item.prepend_axis_num + tuple(item.local_shape)
            pieces.setdefault(item.key, []).append((tuple(item.global_offset), shape))
        elif isinstance(item, ShardedObject):
            objects[item.unique_key] = item.data
    chunks = {key: found for key, found in pieces.items() if len(found) > 1}
    return pipeline.ModelLayout(tensors, objects, chunks)


def load_into(model, load: str) -> None:
    """Load the checkpoint of the directory ``load`` into ``model`` as megatron's
    load_checkpoint does: the model's sharded state dict, at the parallel layout it was built
    for, under "model"."""
    from megatron.core import dist_checkpointing

    checkpoint = pipeline.checkpoint_to_read(load)
    metadata = dist_checkpointing.load_content_metadata(checkpoint)
    request = {"model": model.sharded_state_dict(metadata=metadata)}
    model.load_state_dict(dist_checkpointing.load(request, checkpoint)["model"])


def our_logits(load: str, tokens: torch.Tensor, imported: Optional[str] = None) -> torch.Tensor:
    """Logits [1, n, vocab] of our model of pretrain_args.txt (of ``imported``, the directory the
    import wrote, when ``load`` is another) with the checkpoint of ``load`` loaded."""
    with one_process():
        model = build_model(pipeline.read_args_file(imported or load), tokens.shape[1],
                            torch.float32)
        load_into(model, load)
        model.eval()
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            return model(tokens, positions, attention_mask=None).float()


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def logit_difference(hf_dir: str, load: str, num_tokens: int,
                     imported: Optional[str] = None) -> float:
    """The largest difference of the two models' logits over ``num_tokens`` random tokens,
    divided by the largest logit of transformers' model."""
    from megatron.bounded.convert.hf_files import HFDirectory

    with HFDirectory(hf_dir) as hf:
        vocab = hf.config["vocab_size"]
    tokens = torch.randint(0, vocab, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    reference, ours = hf_logits(hf_dir, tokens), our_logits(load, tokens, imported)
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def verify(hf_dir: str, load: str, num_tokens: int, tolerance: float,
           imported: Optional[str] = None) -> int:
    pipeline.require_directories(load=load, imported=imported)
    difference = logit_difference(hf_dir, load, num_tokens, imported)
    verdict = "ok" if difference <= tolerance else "ABOVE the tolerance"
    print(f"[convert] verify: {num_tokens} tokens, largest logit difference relative to the "
          f"largest logit {difference:.3e} (tolerance {tolerance:.0e}): {verdict}")
    return 0 if difference <= tolerance else 1


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = main_parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="Hugging Face directory -> checkpoint")
    importing.add_argument("--hf-dir", required=True)
    importing.add_argument("--output", required=True)
    importing.add_argument("--dtype", choices=sorted(pipeline.DTYPES), default="bf16")
    exporting = commands.add_parser("export", help="checkpoint -> Hugging Face directory")
    exporting.add_argument("--load", required=True)
    exporting.add_argument("--output", required=True)
    exporting.add_argument("--imported", default=None,
                           help="the directory `import` wrote, when --load is another")
    exporting.add_argument("--overwrite", action="store_true",
                           help="replace --output when it has files in it (after the export)")
    verifying = commands.add_parser("verify", help="compare the logits of both models")
    verifying.add_argument("--hf-dir", required=True)
    verifying.add_argument("--load", required=True)
    verifying.add_argument("--imported", default=None,
                           help="the directory `import` wrote, when --load is another")
    verifying.add_argument("--tokens", type=int, default=32)
    verifying.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    return main_parser


def main(argv=None) -> int:
    options = parser().parse_args(argv)
    try:
        if options.command == "import":
            flags = pipeline.import_model(options.hf_dir, options.output, options.dtype,
                                          model_layout)
            print(f"[convert] wrote {options.output}; its architecture's flags "
                  f"({os.path.join(options.output, pipeline.ARGS_FILE)}):\n{' '.join(flags)}")
            return 0
        if options.command == "export":
            pipeline.export_model(options.load, options.output, options.imported,
                                  overwrite=options.overwrite)
            print(f"[convert] wrote {options.output}")
            return 0
        return verify(options.hf_dir, options.load, options.tokens, options.tolerance,
                      options.imported)
    except ConversionError as error:
        print(f"convert_hf: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
