"""The command line an example script hands to its Python interpreter, without running it.

    from example_argv import example_argv   # tools/ on sys.path, or load this file by path
    argv = example_argv(Path("examples/moe_small/train.sh"), dict(os.environ, NUM_GPUS="2"))

The script runs with ``PYTHON`` pointing at a stand-in that only writes its arguments down, so the
result is exactly what a real launch would pass (``-m torch.distributed.run ... pretrain_gpt.py
FLAGS``, or ``tools/memory_budget.py FLAGS`` with ``DRY_RUN=1``).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, List


def example_argv(script: Path, env: dict, args: Iterable[str] = ()) -> List[str]:
    """Run ``bash script args`` with a recording stand-in for ``PYTHON``; return its arguments."""
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "argv"
        stand_in = Path(scratch) / "python"
        stand_in.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$EXAMPLE_ARGV_RECORD"\n')
        stand_in.chmod(0o755)
        launch_env = dict(env, PYTHON=str(stand_in), EXAMPLE_ARGV_RECORD=str(record))
        subprocess.run(["bash", str(script), *args], env=launch_env, check=True)
        return record.read_text().splitlines()
