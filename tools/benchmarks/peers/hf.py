"""transformers' own ``Qwen3MoeForCausalLM`` trained by a plain PyTorch loop
(:mod:`peers.training`), at the settings a user would pick for each context length:

* ``hf`` (short context): SDPA attention, transformers' fastest experts backend that needs no
  extra package (``grouped_mm``: one ``torch._grouped_mm`` over the tokens sorted by expert; the
  ``deepgemm`` and ``sonicmoe`` backends of recent releases load their kernels from the Hub, which
  an offline machine cannot), bf16 weights with fp32 master weights,
  fused AdamW, each decoder layer under ``torch.compile`` (eager when compiling fails: the record
  says why);
* ``hf_long`` (long context, the long-context recipes of TRL and Arctic Long Sequence Training
  that run on one GPU): activation checkpointing of every decoder layer, Liger-Kernel's fused
  linear cross-entropy (no logits in memory) with its RMSNorm and rotary kernels, and the MoE
  block tiled along the sequence (Liger-Kernel's tiled MLP: each tile recomputed in backward);
* ``hf_offload``: ``hf_long`` with the tensors the forward saves (the checkpointed layers' inputs)
  held in pinned host memory (``torch.autograd.graph.save_on_cpu``).

Under ``autocast`` (fp32 weights) transformers' ``grouped_mm`` runs the experts in fp32: it casts
their input to the weights' dtype, being outside autocast's op list; hence bf16 weights with fp32
masters by default.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from peers.training import Update, model_dtype, train


@dataclass(frozen=True)
class Settings:
    attention: str = "sdpa"
    experts: str = "grouped_mm"
    precision: str = "bf16_master"
    compile: bool = False
    checkpointing: bool = False
    offload: bool = False
    liger: bool = False  # fused linear cross-entropy, RMSNorm and rotary kernels
    tiled_mlp: bool = False
    mlp_tiles: Optional[int] = None  # tiles per sequence; None: Liger's, tokens / hidden size
    max_micro_tokens: int = 32_768  # the largest micro-batch tried (tokens)


SYSTEMS = {
    "hf": Settings(compile=True),
    "hf_long": Settings(checkpointing=True, liger=True, tiled_mlp=True),
}
SYSTEMS["hf_offload"] = replace(SYSTEMS["hf_long"], offload=True)


def load_model(workload, settings: Settings, device):
    """transformers' model of the workload's directory, set up as ``settings`` say."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        workload.hf_dir, dtype=model_dtype(settings.precision),
        attn_implementation=settings.attention, experts_implementation=settings.experts)
    model.config.use_cache = False
    model.to(device).train()
    if settings.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

        # the experts stay transformers' (Liger's own fused MoE kernel replaces them when
        # swiglu=True): the same expert code as the short-context settings
        apply_liger_kernel_to_qwen3_moe(rope=True, rms_norm=True, swiglu=False,
                                        fused_linear_cross_entropy=True, model=model)
    if settings.tiled_mlp:
        tile_moe_blocks(model, settings.mlp_tiles)
    if settings.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if settings.compile:
        for layer in model.model.layers:
            layer.compile()
    return model


def tile_moe_blocks(model, tiles: Optional[int]) -> None:
    """Each decoder layer's MLP block through Liger-Kernel's tiled MLP: the sequence in ``tiles``
    tiles (None: tiles of hidden-size tokens, its default), each recomputed in backward, so that
    one tile's routed activations are in memory at a time (routing is per token: the tiles give
    the same result)."""
    from liger_kernel.ops import apply_tiled_mlp

    for layer in model.model.layers:
        block = layer.mlp
        block.forward = functools.partial(_tiled_forward, apply_tiled_mlp, block, block.forward,
                                          tiles)


def _tiled_forward(apply_tiled_mlp, block, forward, tiles, hidden_states):
    return apply_tiled_mlp(fn=functools.partial(_tile, forward), mlp_module=block,
                           x=hidden_states, num_shards=tiles,
                           compute_params=[p for p in block.parameters() if p.requires_grad])


def _tile(forward, module, tile):
    # the forward's tiles are [batch, tokens, hidden] slices (strided across the batch), the
    # backward's recompute hands them over flattened, [tokens, hidden]; the block views its
    # contiguous three-dimensional input
    if tile.dim() == 3:
        return forward(tile.contiguous())
    return forward(tile.unsqueeze(0)).squeeze(0)


def loss_function(model, settings: Settings):
    """A micro-batch's mean loss, through the model's own forward: transformers' causal-LM loss
    on the logits, or Liger's fused linear cross-entropy; the labels are the shifted tokens."""
    def loss_of(tokens, labels):
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=True) if settings.offload
                   else contextlib.nullcontext())
        with offload:
            return model(input_ids=tokens, labels=labels, shift_labels=labels).loss

    return loss_of


def run(system: str, workload, dataset, seq_length: int, global_batch: int, steps: int,
        device, settings: Settings = None) -> tuple:
    """Train ``system`` (or ``settings``); (settings as recorded, measurements). A compile that
    fails at its first step falls back to eager, and the settings say so."""
    settings = settings or SYSTEMS[system]
    recorded = asdict(settings)
    measured = None
    try:
        measured = _train(workload, dataset, seq_length, global_batch, steps, device, settings)
    except torch._dynamo.exc.TorchDynamoException as error:
        if not settings.compile:
            raise
        recorded["compile"] = f"failed ({type(error).__name__}), eager"
    if measured is None:  # out of the except block: the failed model's memory is free again
        torch._dynamo.reset()
        measured = _train(workload, dataset, seq_length, global_batch, steps, device,
                          replace(settings, compile=False))
    recorded["experts_backend"] = measured.pop("experts_backend")
    return recorded, measured


def _train(workload, dataset, seq_length, global_batch, steps, device, settings) -> dict:
    model = load_model(workload, settings, device)
    update = Update(model, settings.precision, device)
    measured = train(loss_function(model, settings), update, dataset, steps, global_batch,
                     seq_length, settings.max_micro_tokens, device)
    measured["experts_backend"] = getattr(model.config, "_experts_implementation", None)
    return measured
