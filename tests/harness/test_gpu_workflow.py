"""``.github/workflows/gpu-functional.yml``: the GPU CI runs scripts that exist, on 1 and 2 GPUs of
self-hosted GPU runners."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = REPO_ROOT / ".github" / "workflows" / "gpu-functional.yml"
# repository paths a workflow can name: scripts, tools, examples, tests
PATH_PATTERN = re.compile(r"\b(?:scripts|tools|examples|tests)/[\w./-]*\w")


def named_paths(text: str) -> list[str]:
    return sorted(set(PATH_PATTERN.findall(text)))


def test_named_paths_are_found():
    text = "run: bash scripts/gpu_functional.sh && python tools/x.py; see tests/unit."
    assert named_paths(text) == ["scripts/gpu_functional.sh", "tests/unit", "tools/x.py"]


def test_every_path_the_workflow_names_exists():
    paths = named_paths(WORKFLOW.read_text(encoding="utf-8"))
    assert "scripts/gpu_functional.sh" in paths
    missing = [path for path in paths if not (REPO_ROOT / path).exists()]
    assert missing == [], f"the GPU workflow names paths that do not exist: {missing}"


def test_it_runs_the_functional_script_on_one_and_two_gpus_of_self_hosted_gpu_runners():
    text = WORKFLOW.read_text(encoding="utf-8")
    runs = re.findall(r"^\s*run:\s*(.+)$", text, flags=re.MULTILINE)
    assert any(run.strip().startswith("bash scripts/gpu_functional.sh") for run in runs), runs
    (gpus,) = re.findall(r"^\s*gpus:\s*\[([^\]]*)\]", text, flags=re.MULTILINE)
    assert sorted(int(n) for n in gpus.split(",")) == [1, 2]
    (labels,) = re.findall(r"^\s*runs-on:\s*\[([^\]]*)\]", text, flags=re.MULTILINE)
    assert {"self-hosted", "gpu"} <= {label.strip() for label in labels.split(",")}
    assert "CUDA_VISIBLE_DEVICES" in text and "matrix.gpus" in text
