"""Start from a Hugging Face model: import its checkpoint, export it back, verify the logits.

    bounded-convert-hf import --hf-dir DIR --output CKPT [--dtype bf16|fp32]
    bounded-convert-hf export --load CKPT --output DIR [--imported CKPT0] [--overwrite]
    bounded-convert-hf verify --hf-dir DIR --load CKPT [--imported CKPT0] [--tokens N]
        [--tolerance T]

(``python tools/convert_hf.py ...`` the same, from a clone without installing it.)

``import`` reads config.json and the safetensors files one tensor at a time and writes a
torch_dist checkpoint that ``pretrain_gpt.py --load CKPT --finetune`` starts from at any TP/EP/CP
layout, with CKPT/pretrain_args.txt: the flags that build this architecture. Block-FP8
(DeepSeek-V3, Kimi-K2) and MXFP4 (gpt-oss) weights are dequantized to --dtype. ``export`` writes a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``--imported``: the
directory the import wrote, when CKPT is a fine-tuning run's --save; ``verify`` takes it too).
``import`` and ``export`` write into no directory with files in it (``export --overwrite``
replaces it, once the export succeeded) and a failed run leaves no partial output.
``verify`` runs the same tokens through transformers' model and ours (both on CPU, fp32) and
exits 1 when the largest logit difference, relative to the largest logit, is above the
tolerance; when the import's dtype is coarser than the reference's weights it then says whether
their rounding explains the difference. Every command runs on the CPU, also on a machine with
GPUs: the entry point, :mod:`megatron.bounded.launch.commands.convert_hf`, hides them before
this module is imported (:func:`run` here runs a command in the calling process as it is).
Families: megatron/bounded/convert/. Exit status: 0 done, 1 verification failed, 2 refused (one
line: what, and the fix).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from typing import Optional

import torch

from megatron.bounded.convert import pipeline, torch_dist
from megatron.bounded.convert.core import ConversionError

# Flags pretrain_gpt.py's parser needs besides the architecture's, to build the model alone.
BUILD_FLAGS = ("--micro-batch-size", "1", "--train-iters", "1",
               "--lr", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--transformer-impl", "local", "--use-cpu-initialization")
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
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron.bounded.launch.arguments import add_bounded_args, validate_bounded_args
    from megatron.bounded.launch.model_config import build_model_config
    from megatron.bounded.upstream import patches

    patches.apply_patches()  # as pretrain_gpt.py, before upstream parses the flags
    precision = {torch.bfloat16: ["--bf16"], torch.float32: []}[dtype]
    # one micro-batch per data-parallel rank (of the parallel state the model is built in)
    batch = ["--global-batch-size", str(parallel_state.get_data_parallel_world_size())]
    argv = [*flags, *BUILD_FLAGS, *batch, *precision, "--seq-length", str(seq_length)]
    saved_argv, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    said = io.StringIO()  # what the parsers print when they refuse (then exit)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
            args = parse_args(add_bounded_args)  # upstream prints every argument
            validate_args(args, {})
            settings = validate_bounded_args(args)
    except (AssertionError, ValueError, SystemExit) as error:  # upstream refuses by assertions
        reason = (said.getvalue().strip().splitlines() or [""])[-1] \
            if isinstance(error, SystemExit) else f"{type(error).__name__}: {error}"
        raise ConversionError(f"megatron-core refuses the flags of this config.json ({reason}); "
                              "convert a model whose architecture it builds") from None
    finally:
        sys.argv = saved_argv
    sys.stderr.write(said.getvalue())
    model_config = build_model_config(args, settings)
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
    """Logits [1, n, vocab] of transformers' model of ``hf_dir`` (fp32; an aliased model_type as
    its family, quantized weights dequantized: ``pipeline.transformers_directory``)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConversionError("verify needs transformers, which is not installed; pip install "
                              "-e '.[convert]'") from None
    with pipeline.transformers_directory(hf_dir) as directory:
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        except (ImportError, OSError, ValueError, KeyError, RuntimeError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ConversionError(f"transformers does not load {hf_dir} ({type(error).__name__}: "
                                  f"{first_line}); check that transformers >= 5 is installed "
                                  "and knows this model_type") from None
    with torch.no_grad():
        return model(tokens).logits.float()


def verification_tokens(hf_dir: str, num_tokens: int) -> torch.Tensor:
    """``num_tokens`` random tokens of the model's vocabulary (the same for every call; a
    vision-language model's: its text decoder's)."""
    from megatron.bounded.convert.families import family_for
    from megatron.bounded.convert.hf_files import HFDirectory

    with HFDirectory(hf_dir) as hf:
        vocab = family_for(hf.config)[1]["vocab_size"]
    return torch.randint(0, vocab, (1, num_tokens), generator=torch.Generator().manual_seed(0))


def relative_difference(reference: torch.Tensor, other: torch.Tensor) -> float:
    """The largest difference of two models' logits divided by the largest logit of
    ``reference``."""
    return ((other - reference).abs().max() / reference.abs().max()).item()


def logit_difference(hf_dir: str, load: str, num_tokens: int,
                     imported: Optional[str] = None) -> float:
    """The largest difference of the two models' logits over ``num_tokens`` random tokens,
    divided by the largest logit of transformers' model."""
    tokens = verification_tokens(hf_dir, num_tokens)
    return relative_difference(hf_logits(hf_dir, tokens), our_logits(load, tokens, imported))


def rounding_explains(hf_dir: str, load: str, tokens: torch.Tensor, reference: torch.Tensor,
                      ours: torch.Tensor) -> Optional[str]:
    """When ``load`` (an import's own directory) was imported in a dtype coarser than the weights
    of ``hf_dir``: the line that says whether rounding the weights to it explains the difference
    of ``ours`` to ``reference``, found by running transformers' model of the checkpoint's own
    weights (its export) too; None otherwise."""
    if not os.path.isfile(os.path.join(load, pipeline.RECORD_FILE)):
        return None
    dtype = pipeline.read_record(load).get("dtype")
    if dtype not in pipeline.DTYPES:
        return None
    bits, ours_dtype = pipeline.SIGNIFICANT_BITS, pipeline.DTYPE_NAMES[pipeline.DTYPES[dtype]]
    reference_dtype = pipeline.weights_dtype(hf_dir)
    if bits[ours_dtype] >= bits[reference_dtype]:
        return None
    said = (f"[convert] verify: the checkpoint was imported with --dtype {dtype}, coarser than "
            f"the reference's {reference_dtype} weights")
    with tempfile.TemporaryDirectory(prefix="convert_hf_verify-") as directory:
        own = os.path.join(directory, "export")
        pipeline.export_model(load, own, log=lambda line: None)
        differing = pipeline.first_beyond_rounding(hf_dir, own, dtype)
        if differing:
            return (f"{said}, but its {differing} is not the reference's rounded to {dtype}: "
                    "the difference is not the rounding (another model?)")
        own_logits = hf_logits(own, tokens)
    rounding = relative_difference(reference, own_logits)
    mapping = relative_difference(own_logits, ours)
    said += (f"; transformers' model of the checkpoint's own {dtype} weights (the reference's, "
             f"rounded) differs from the reference by {rounding:.3e} and ours from it by "
             f"{mapping:.1e}")
    if mapping > DEFAULT_TOLERANCE:
        return f"{said}: more than the rounding, so the mapping differs too"
    return (f"{said}: the import's dtype explains the difference; to check in fp32, import with "
            f"--dtype fp32 and verify that checkpoint (tolerance {DEFAULT_TOLERANCE:.0e})")


def verify(hf_dir: str, load: str, num_tokens: int, tolerance: float,
           imported: Optional[str] = None) -> int:
    pipeline.require_directories(load=load, imported=imported)
    pipeline.read_args_file(imported or load)  # refused before any model is built
    tokens = verification_tokens(hf_dir, num_tokens)
    reference, ours = hf_logits(hf_dir, tokens), our_logits(load, tokens, imported)
    difference = relative_difference(reference, ours)
    verdict = "ok" if difference <= tolerance else "ABOVE the tolerance"
    print(f"[convert] verify: {num_tokens} tokens, largest logit difference relative to the "
          f"largest logit {difference:.3e} (tolerance {tolerance:.0e}): {verdict}")
    if difference <= tolerance:
        return 0
    # only the import's own directory: a fine-tuning save's weights differ by the training
    if imported is None or os.path.realpath(imported) == os.path.realpath(load):
        explanation = rounding_explains(hf_dir, load, tokens, reference, ours)
        if explanation:
            print(explanation)
    return 1


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals as one line (exit status 2), like the converter's."""

    def error(self, message):
        print(f"convert_hf: {self.prog}: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def parser() -> argparse.ArgumentParser:
    main_parser = OneLineParser(description=__doc__.split("\n\n")[0])
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
    verifying.add_argument("--tokens", type=positive_int, default=32)
    verifying.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    return main_parser


def run(argv=None) -> int:
    """The command of ``argv`` (default: the process's arguments), in this process as it is."""
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
        print(f"convert_hf: {' '.join(str(error).split())}", file=sys.stderr)  # one line
        return 2
