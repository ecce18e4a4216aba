"""The user commands of setup.py's ``console_scripts``: each ``bounded-<name>`` resolves to a
callable ``main`` of ``megatron.bounded.launch.commands``, and ``tools/<name>.py`` of a clone is a
thin runner of that same function (no logic of its own). Running them: test_console_script_runs.py.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
COMMANDS_PACKAGE = "megatron.bounded.launch.commands"
PREFIX = "bounded-"


def setup_keyword(name: str):
    """The literal value of the keyword ``name`` of setup.py's ``setup(...)`` call."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for keyword in node.keywords:
                if keyword.arg == name:
                    return ast.literal_eval(keyword.value)
    raise AssertionError(f"setup.py's setup() has no {name}=")


def console_scripts() -> dict[str, tuple[str, str]]:
    """Console script name -> (module, function), as setup.py declares them."""
    scripts = {}
    for line in setup_keyword("entry_points")["console_scripts"]:
        name, target = (part.strip() for part in line.split("="))
        module, function = target.split(":")
        scripts[name] = (module, function)
    return scripts


def runner_path(script: str) -> Path:
    """``tools/<name>.py`` of the console script ``bounded-<name>`` (dashes as underscores)."""
    return REPO_ROOT / "tools" / (script.removeprefix(PREFIX).replace("-", "_") + ".py")


SCRIPTS = console_scripts()


def test_setup_declares_the_user_commands():
    assert {"bounded-memory-budget", "bounded-convert-hf", "bounded-preprocess-data",
            "bounded-verify-checkpoint", "bounded-summarize-metrics"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_resolves_to_a_callable(script):
    module_name, function = SCRIPTS[script]
    assert script.startswith(PREFIX), script
    assert module_name.startswith(COMMANDS_PACKAGE + "."), module_name
    entry = getattr(importlib.import_module(module_name), function)
    assert callable(entry)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_runner_in_tools_imports_the_console_scripts_function(script):
    """tools/<name>.py imports the entry point's function and calls it only when run as a
    script: every definition the runner could hold beside it would be logic of its own."""
    module_name, function = SCRIPTS[script]
    runner = runner_path(script)
    tree = ast.parse(runner.read_text(encoding="utf-8"))
    imported = {(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert (module_name, function) in imported, f"{runner} does not import {module_name}.{function}"
    definitions = [node for node in tree.body
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not definitions, f"{runner} defines {[node.name for node in definitions]}"


def test_every_runner_of_a_command_is_a_console_script():
    """A tools/ script that runs a command of the package is declared in setup.py too."""
    runners = set()
    for path in sorted((REPO_ROOT / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(COMMANDS_PACKAGE):
                runners.add(path)
    assert runners == {runner_path(script) for script in SCRIPTS}


def test_no_module_of_the_package_imports_pretrain_gpt():
    """The console scripts run where only the package is installed: no pretrain_gpt.py there."""
    importers = []
    for path in sorted((REPO_ROOT / "megatron" / "bounded").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "pretrain_gpt" in names:
                importers.append(str(path.relative_to(REPO_ROOT)))
    assert not importers
