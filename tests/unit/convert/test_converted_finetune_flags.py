"""The fine-tuning command line of tests/functional/test_convert_hf_finetune.py goes through
pretrain_gpt.py's parsing and validation (tests/unit/model/test_families.py's ``_parse``) for both
families: with the pretrain_args.txt that ``tools/convert_hf.py import`` writes for a toy model of
the family, and with the flags the same import writes for the GPU test's shapes (the family's
``flags`` of that config.json; the model itself is too large to make here)."""

from __future__ import annotations

import os

import pytest

from megatron.bounded.launch.commands import hf_conversion

from tests.converted_finetune import (
    DOCUMENT, MODELS, TOY_WIDTHS, VOCAB, finetune_flags, hf_config, save_model,
    write_stand_in_import,
)
from tests.functional.harness import write_documents
from tests.unit.distributed import run_on_ranks
from tests.unit.model.test_families import _parse
from megatron.bounded.units import GiB

pytest.importorskip("transformers")
GPU_HOST_GIB = 128  # the host memory of the one-H200 machine the GPU test runs on


def _architecture(family: str, shape: str, checkpoint) -> list:
    """The architecture's flags: the toy model's pretrain_args.txt (imported here) or what the
    import writes for the released shape."""
    from megatron.bounded.convert import pipeline
    from megatron.bounded.convert.families import family_for

    if shape == "released":
        module, config = family_for(hf_config(family).to_dict())
        return module.flags(config)
    toy = save_model(family, checkpoint.parent / "hf", **TOY_WIDTHS[family])
    assert hf_conversion.run(["import", "--hf-dir", str(toy), "--output", str(checkpoint)]) == 0
    return pipeline.read_args_file(str(checkpoint))


def _parsed(rank, world_size, family, shape, root):
    from megatron.bounded.activations.host_memory import plan_for_host

    os.environ["WORLD_SIZE"] = "1"
    # the pinned host memory (optimizer state, SCO) is checked against the GPU test's machine
    plan_for_host(GPU_HOST_GIB * GiB)
    write_documents(str(root / "documents"), count=2, length=DOCUMENT, vocab=VOCAB)
    checkpoint = root / "imported"
    architecture = _architecture(family, shape, checkpoint)
    if shape == "released":  # not imported here: what pretrain_gpt.py's checks of --load read
        write_stand_in_import(checkpoint, architecture)
    flags = finetune_flags(architecture, str(checkpoint), str(root / "documents"),
                           str(root / "saved"))
    args, _ = _parse(flags)
    return {"hidden": args.hidden_size, "finetune": args.finetune,
            "documents": [args.reset_attention_mask, args.eod_mask_loss],
            "operators": [args.offload_stream_optimizer, args.ring_dtp, args.sco_host_budget_gb,
                          args.recompute_granularity],
            "grouped_experts_operators": [args.pipelined_llep, args.chunked_recompute_tokens,
                                          args.chunked_recompute_attention]}


@pytest.mark.parametrize("shape", ["toy", "released"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_finetuning_flags_of_the_imported_model_pass_pretrain_validation(tmp_path, family,
                                                                         shape):
    parsed = run_on_ranks(_parsed, 1, args=(family, shape, tmp_path), timeout_s=300)[0]
    widths = TOY_WIDTHS[family] if shape == "toy" else MODELS[family][1]
    assert parsed["hidden"] == widths["hidden_size"]
    assert parsed["finetune"] and all(parsed["documents"]) and all(parsed["operators"]), parsed
    # gpt-oss's experts have biases: upstream's experts, without PipelinedLLEP and chunks
    expected = [False, 0, False] if family == "gpt_oss" else [True, 16384, True]
    assert parsed["grouped_experts_operators"] == expected, parsed
