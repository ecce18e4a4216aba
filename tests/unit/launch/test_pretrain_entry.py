"""pretrain_gpt.py's main() up to upstream's pretrain(): flags -> checks -> budget -> model config,
with every operator switched on (CPU; pretrain itself is replaced by a recorder)."""

from __future__ import annotations

import os
import sys

from tests.unit.distributed import run_on_ranks
from tests.unit.launch.test_examples import recorded_flags
from megatron.bounded.units import GiB

OPERATORS = [
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--sco-host-budget-gb", "1", "--ring-dtp", "--offload-stream-optimizer",
    "--pipelined-llep", "--pipelined-llep-token-budget", "256", "--llep-imbalance-threshold", "1.5",
]


def _main_body(rank, world_size, flags):
    os.environ["WORLD_SIZE"] = "2"  # the example's job size, for upstream's validation
    import pretrain_gpt
    from megatron.core import optimizer as core_optimizer

    recorded = {}

    def record_pretrain(cfg, datasets_provider, model_type, forward_step, **kwargs):
        recorded["cfg"], recorded["forward_step"] = cfg, forward_step

    pretrain_gpt.pretrain = record_pretrain
    sys.argv = ["pretrain_gpt.py", *flags]
    pretrain_gpt.main()
    transformer = recorded["cfg"].model.transformer
    return {
        "config_class": type(transformer).__name__,
        "pipelined_llep": (transformer.pipelined_llep, transformer.pipelined_llep_token_budget,
                           transformer.llep_imbalance_threshold),
        "hooks": [hook.__name__ for hook in recorded["cfg"].model.pre_wrap_hooks],
        "optimizer": core_optimizer.HybridDeviceOptimizer.__name__,
        "optimizer_cfg": (recorded["cfg"].optimizer.optimizer_cpu_offload,
                          recorded["cfg"].optimizer.use_precision_aware_optimizer),
        "output_processor": type(recorded["forward_step"].output_processor).__name__,
        "sco_budget": recorded["forward_step"].activation_offload.offload.host_budget_bytes,
    }


def test_main_wires_every_operator_before_pretrain():
    flags = recorded_flags("examples/moe_small/train.sh", {"NUM_GPUS": "2"})
    result = run_on_ranks(_main_body, 1, args=(flags + OPERATORS,), timeout_s=180)[0]
    assert result["config_class"] == "BoundedTransformerConfig"
    assert result["pipelined_llep"] == (True, 256, 1.5)
    assert result["hooks"] == ["shard_output_layer"]
    assert result["optimizer"] == "OffloadStreamHybridOptimizer"
    assert result["optimizer_cfg"] == (True, True)
    assert result["output_processor"] == "RingDTPLoss"
    assert result["sco_budget"] == GiB


def _sco_report_body(rank, world_size):
    import contextlib
    import io

    import pretrain_gpt
    from megatron.bounded.activations.sco import SCOSettings

    sco = pretrain_gpt.ActivationOffload(SCOSettings(sco_host_budget_gb=0.001))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        sco.report_once()  # before any forward: nothing to report
        before = printed.getvalue()
        with sco.context():
            pass
        after_one_forward = printed.getvalue()
        sco.report_once()  # training ended after one micro-batch
        sco.report_once()
        with sco.context():  # a second forward no longer prints it
            pass
    return before, after_one_forward, printed.getvalue()


def test_sco_figures_are_printed_once_even_after_a_single_forward():
    before, after_one_forward, final = run_on_ranks(_sco_report_body, 1, timeout_s=120)[0]
    assert before == "" and after_one_forward == ""
    assert final.count("[bounded] SCO: 0 of 0 checkpoint boundaries") == 1, final
