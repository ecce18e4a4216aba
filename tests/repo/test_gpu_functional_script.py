"""scripts/gpu_functional.sh installs the wheelhouse into a fresh private directory (mktemp -d,
removed on exit) unless SCRATCH_SITE names one: never into a fixed shared /tmp path."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Stands in for python: records where pip was told to install, answers the version probe.
STAND_IN = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    while [ $# -gt 0 ]; do
        if [ "$1" = "--target" ]; then echo "$2" >> "$TARGETS"; test -d "$2" || exit 9; fi
        shift
    done
fi
exit 0
"""


def run_script(tmp_path: Path, **env) -> list[str]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "scripts" / "gpu_functional.sh", root / "scripts")
    (root / ".whl").mkdir(exist_ok=True)
    (root / ".whl" / "megatron_core-0.19.2-py3-none-any.whl").write_bytes(b"")
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    targets = tmp_path / "targets"
    scratch_tmp = tmp_path / "tmp"
    scratch_tmp.mkdir(exist_ok=True)
    result = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_functional.sh")],
        env={**os.environ, "PYTHON": str(python), "TARGETS": str(targets), "TMPDIR": str(scratch_tmp),
             "RUN_TESTS": "0", "RUN_BENCHMARKS": "0", "RESULTS_DIR": str(tmp_path / "results"),
             **env},
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return targets.read_text().splitlines()


def test_each_run_installs_into_its_own_temporary_directory(tmp_path):
    first = run_script(tmp_path)
    second = run_script(tmp_path)
    assert len(first) == 1 and len(second) == 2
    assert second[0] != second[1]
    for target in second:
        assert Path(target).parent == tmp_path / "tmp"
        assert Path(target).name.startswith("megatron-bounded-site.")
        assert not Path(target).exists()  # removed when the script ended


def test_an_explicit_scratch_site_is_used_and_kept(tmp_path):
    site = tmp_path / "my-site"
    assert run_script(tmp_path, SCRATCH_SITE=str(site)) == [str(site)]
    assert site.is_dir()
