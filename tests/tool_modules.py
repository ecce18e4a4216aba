"""Load a script under tools/ as a module (tools/ is not a package), for the tests of the tools
(tests/harness, tests/unit/launch/test_examples.py) and the functional-test harness."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_tool(relative_path: str):
    """``tools/<relative_path>`` as a module, registered in sys.modules (dataclasses in it
    resolve their annotations through there)."""
    name = "tools_" + relative_path.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
