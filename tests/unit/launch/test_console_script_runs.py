"""The user commands run both ways: ``python tools/<name>.py`` from a clone with no PYTHONPATH
(the runner finds this checkout's package itself), and the function setup.py names for
``bounded-<name>`` called as the installed console script calls it, with only the package on the
path (not the clone's root: no pretrain_gpt.py, no tools/). Both give the same ``--help``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.launch.test_console_scripts import REPO_ROOT, SCRIPTS, runner_path

# what the installed console script runs: the entry point's function, with argv[0] its name
CONSOLE_SCRIPT = ("import sys; from {module} import {function}; sys.argv[0] = {script!r}; "
                  "sys.exit({function}())")


def environment(pythonpath=None) -> dict:
    """This process's environment without PYTHONPATH, or with ``pythonpath`` as the only one."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def installed_package(directory: Path) -> Path:
    """``directory`` holding megatron/bounded (a link to this checkout's) and nothing else of the
    clone: the package as an installation puts it on the path."""
    (directory / "megatron").mkdir(parents=True)
    (directory / "megatron" / "bounded").symlink_to(REPO_ROOT / "megatron" / "bounded")
    return directory


def run(argv, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def help_text(output: str, script: str) -> str:
    """``--help`` output with the command's names (``bounded-<name>``, ``<name>.py``) taken out
    where argparse puts them (not where a path such as tools/<name>.py names it) and whitespace
    normalized (argparse wraps the usage line by the name's length)."""
    for program in (script, runner_path(script).name):
        output = re.sub(rf"(?<![/\w]){re.escape(program)}", "PROGRAM", output)
    return " ".join(output.split())


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_runner_and_console_script_give_the_same_help(script, tmp_path):
    runner = runner_path(script)
    by_path = run([sys.executable, str(runner), "--help"], tmp_path, environment())
    assert by_path.returncode == 0, by_path.stderr[-2000:]
    module, function = SCRIPTS[script]
    package_dir = installed_package(tmp_path / "site")
    code = CONSOLE_SCRIPT.format(module=module, function=function, script=script)
    installed = run([sys.executable, "-c", code, "--help"], tmp_path, environment(package_dir))
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert script in installed.stdout  # its usage names the console script
    assert help_text(by_path.stdout, script) == help_text(installed.stdout, script)


def test_runner_runs_this_checkouts_package(tmp_path):
    """Run by path, the runner imports the package of the clone it is in, before any installed
    one (the Python path has no PYTHONPATH and the working directory is elsewhere)."""
    runner = runner_path("bounded-memory-budget")
    code = ("import runpy, sys\n"
            "try:\n"
            f"    runpy.run_path({str(runner)!r}, run_name='__main__')\n"
            "except SystemExit as done:\n"
            "    print('exit', done.code)\n"
            "print('package', sys.modules['megatron.bounded'].__file__)\n")
    done = run([sys.executable, "-c", code, "--help"], tmp_path, environment())
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "exit 0" in lines
    package = Path(lines[-1].removeprefix("package "))
    assert package.resolve() == (REPO_ROOT / "megatron" / "bounded" / "__init__.py").resolve()


def test_convert_hf_hides_the_gpus_before_torch_is_imported(tmp_path):
    """bounded-convert-hf runs on the CPU: its entry point's module imports no torch (nor
    megatron-core, which asks CUDA for its devices when imported), and its main hides the GPUs
    before it imports the converter."""
    code = ("import os, sys\n"
            "from megatron.bounded.launch.commands.convert_hf import main\n"
            "print('torch imported', 'torch' in sys.modules)\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit as done:\n"
            "    print('exit', done.code)\n"
            "print('devices', repr(os.environ['CUDA_VISIBLE_DEVICES']))\n")
    env = dict(environment(installed_package(tmp_path / "site")), CUDA_VISIBLE_DEVICES="0")
    done = run([sys.executable, "-c", code], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "torch imported False" in lines
    assert "exit 0" in lines and lines[-1] == "devices ''"
