"""pretrain_gpt.py's cleanup after upstream's pretrain() (CUDA graphs released, the last
checkpoint's manifest joined, SCO figures printed) runs on every way out of pretrain(): a normal
return, the sys.exit() upstream uses for --exit-interval, --exit-duration-in-mins and
--exit-signal-handler, and an error; the exit status is kept."""

from __future__ import annotations

import sys

from tests.unit.distributed import run_on_ranks


SMALL_DENSE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "4", "--eval-interval", "4", "--eval-iters", "0",
    "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local",
]


def _exit_body(rank, world_size, how):
    """main() with upstream's pretrain replaced by one that leaves the way ``how`` says; returns
    how main() ended and the cleanup steps that ran."""
    import pretrain_gpt

    steps = []
    pretrain_gpt.checkpoint_integrity.wait = lambda: steps.append("manifest")
    pretrain_gpt.cuda_graphs.release_full_iteration_graphs = lambda: steps.append("graphs")
    pretrain_gpt.ActivationOffload.report_once = lambda self: steps.append("sco")

    def pretrain(*args, **kwargs):
        if how == "return":
            return None
        if how == "error":
            raise RuntimeError("pretrain failed")
        sys.exit(int(how))  # upstream's --exit-interval / --exit-signal-handler path

    pretrain_gpt.pretrain = pretrain
    sys.argv = ["pretrain_gpt.py", *SMALL_DENSE]
    try:
        pretrain_gpt.main()
        ended = "returned"
    except SystemExit as exit_:
        ended = f"SystemExit({exit_.code})"
    except RuntimeError as error:
        ended = f"RuntimeError({error})"
    return ended, steps


def test_cleanup_runs_on_every_exit_path_of_pretrain():
    cases = {"0": "SystemExit(0)", "3": "SystemExit(3)", "return": "returned",
             "error": "RuntimeError(pretrain failed)"}
    for how, expected in cases.items():
        ended, steps = run_on_ranks(_exit_body, 1, args=(how,), timeout_s=180)[0]
        assert ended == expected, (how, ended)
        assert steps == ["manifest", "graphs", "sco"], (how, steps)
