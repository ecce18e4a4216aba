"""``bounded-convert-hf``: import a Hugging Face checkpoint, export it back, verify the logits
(the commands: :mod:`megatron.bounded.launch.commands.hf_conversion`)."""

from __future__ import annotations

import os


def main(argv=None) -> int:
    """The command's process, on the CPU. On a machine with GPUs, upstream's router and rotary
    embedding would move their weights to the current CUDA device at their first forward, away
    from the rest of the model built on the CPU; megatron-core asks CUDA for its devices when it
    is imported, so the GPUs are hidden before the commands' module (and megatron-core) is."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron.bounded.launch.commands import hf_conversion

    return hf_conversion.run(argv)
