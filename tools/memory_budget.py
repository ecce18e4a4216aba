#!/usr/bin/env python
"""``bounded-memory-budget``, run from a clone without installing it: its ``main``, in
megatron/bounded/launch/commands/memory_budget.py, with this checkout's package."""

import sys
from pathlib import Path

# run by path, the script's own directory is on sys.path, not the checkout's root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.bounded.launch.commands.memory_budget import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
