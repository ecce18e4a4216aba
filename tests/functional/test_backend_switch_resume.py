"""Resume across ``--bounded-moe-backend`` on one GPU (marker ``gpu``): a ``torch_dist`` checkpoint
that the torch-native grouped experts saved loads into upstream's dispatcher and ``SequentialMLP``,
and the other way round, with the distributed optimizer's state (saved with
``--dist-ckpt-optim-fully-reshardable``: its bucket format is refused across expert classes), and
training goes on from the saved iteration where the run that did not switch went.

The two expert classes sum in different orders (one grouped GEMM against a loop over experts), so
the resumed losses are compared with a tolerance; a resume that lost the weights or the moments
would start again near the initial loss, far outside it.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import run_example, scratch_checkpoints

pytestmark = [pytest.mark.gpu, requires_cuda]

SAVED_AT, ITERATIONS = 10, 20
# two layers: the checkpoints stay small (the example's eight hold about 12 GB each)
FLAGS = ["--num-layers", "2", "--dist-ckpt-optim-fully-reshardable"]
LOSS_RTOL = 0.02
RUNS = {"torch": "[bounded] run: MoE torch-native all-to-all dispatcher",
        "upstream": "[bounded] run: MoE upstream "}


@pytest.mark.parametrize("saved_by,resumed_by,port", [("torch", "upstream", 29600),
                                                      ("upstream", "torch", 29602)])
def test_resume_across_moe_backends(tmp_path, saved_by, resumed_by, port):
    with scratch_checkpoints(tmp_path, save_interval=SAVED_AT) as env:
        steady = run_example(f"switch_{saved_by}_saves", 1,
                             FLAGS + ["--bounded-moe-backend", saved_by], port=port,
                             env_overrides={**env, "TRAIN_ITERS": str(ITERATIONS),
                                            "LOG_INTERVAL": "1"})
        resumed = run_example(
            f"switch_{saved_by}_to_{resumed_by}", 1,
            FLAGS + ["--bounded-moe-backend", resumed_by, "--load", env["CHECKPOINT_DIR"],
                     "--ckpt-format", "torch_dist", "--ckpt-step", str(SAVED_AT)],
            port=port + 1, env_overrides={**env, "CHECKPOINT_DIR": "", "LOG_INTERVAL": "1",
                                          "TRAIN_ITERS": str(ITERATIONS)})
    for run, backend in ((steady, saved_by), (resumed, resumed_by)):
        assert RUNS[backend] in run.log, f"{backend}: not what the run line names"
    expected = {r["iteration"]: r["lm_loss"] for r in steady.records}
    got = {r["iteration"]: r["lm_loss"] for r in resumed.records}
    assert sorted(got) == list(range(SAVED_AT + 1, ITERATIONS + 1)), sorted(got)
    far = {i: (got[i], expected[i]) for i in got
           if abs(got[i] - expected[i]) > LOSS_RTOL * abs(expected[i])}
    assert not far, f"{saved_by} -> {resumed_by}: losses off the unswitched run's: {far}"
    # the saved state was trained: a fresh start's first loss is far above the resumed one's
    first_loss = steady.records[0]["lm_loss"]
    assert got[SAVED_AT + 1] < first_loss - 10 * LOSS_RTOL * first_loss, (got, first_loss)
