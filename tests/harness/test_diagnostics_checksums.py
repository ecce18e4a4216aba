"""tools/diagnostics/checksums.py: comparing two runs' checksum records."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.tool_modules import load_tool

checksums = load_tool("diagnostics/checksums.py")


def _record(grad_scale=1.0, first_param=1.0, tokens=(7, 9)):
    return {
        "iteration": 11,
        "params_before": {"a": [first_param, 1.0], "b": [2.0, 4.0]},
        "grads_after": {"a": [0.5 * grad_scale, 0.25 * grad_scale**2], "b": [0.0, 0.0]},
        "tokens": list(tokens),
    }


def test_identical_records_compare_equal():
    diff = checksums.compare(_record(), _record())
    assert diff == {"tokens_equal": True, "params_differing": [], "grads_equal": ["a", "b"], "grad_ratios": {}}


def test_a_scaled_gradient_shows_its_ratio_and_a_zero_gradient_stays_equal():
    diff = checksums.compare(_record(), _record(grad_scale=0.99))
    assert math.isclose(diff["grad_ratios"]["a"], 0.99) and diff["grads_equal"] == ["b"]


def test_parameters_and_tokens_are_reported():
    diff = checksums.compare(_record(), _record(first_param=1.5, tokens=(7, 8)))
    assert diff["params_differing"] == ["a"] and not diff["tokens_equal"]


def test_cli_exit_status(tmp_path, capsys):
    for prefix, scale in (("x", 1.0), ("y", 1.0), ("z", 1.1)):
        for rank in (0, 1):
            (tmp_path / f"{prefix}_rank{rank}.json").write_text(json.dumps(_record(grad_scale=scale)))
    assert checksums.main([str(tmp_path / "x"), str(tmp_path / "y")]) == 0
    assert checksums.main([str(tmp_path / "x"), str(tmp_path / "z")]) == 1
    out = capsys.readouterr().out
    assert "rank 1:" in out and "a: 1.1000000" in out


SITE = Path(checksums.__file__).parent / "checksum_site"
RECORDER_SCRIPT = r"""
import json, os, sys, torch, torch.distributed as dist
import sitecustomize
from megatron.training import training
assert training.train_step.__module__ == "sitecustomize"
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
model = torch.nn.Linear(2, 2)
for p in model.parameters():
    p.main_grad = torch.zeros_like(p)
def fake_step(*args, iteration=None):
    for p in model.parameters():
        p.main_grad.fill_(iteration)
    return "outputs"
sitecustomize._train_step = fake_step
assert training.train_step(None, None, [model], iteration=3) == "outputs"  # iteration 4: skipped
assert not os.path.exists(os.environ["BOUNDED_CHECKSUMS_OUT"] + "_rank0.json")
assert training.train_step(None, None, [model], iteration=4) == "outputs"  # iteration 5: recorded
record = json.load(open(os.environ["BOUNDED_CHECKSUMS_OUT"] + "_rank0.json"))
print(json.dumps(record))
"""


def test_recorder_writes_the_chosen_iteration_only(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
               BOUNDED_CHECKSUMS_AT="5", BOUNDED_CHECKSUMS_OUT=str(tmp_path / "run"))
    done = subprocess.run([sys.executable, "-c", RECORDER_SCRIPT, str(port)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["iteration"] == 5 and record["tokens"] == []
    assert set(record["grads_after"]) == {"weight", "bias"}
    assert record["grads_after"]["weight"] == [16.0, 64.0]  # four elements filled with 4
