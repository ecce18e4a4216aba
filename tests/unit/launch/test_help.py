"""``python pretrain_gpt.py --help`` works (megatron-core 0.19.2's own help text broke it: see the
patch escaped-help-texts) and lists every flag of this project in its own group."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from megatron.bounded.launch.arguments import add_bounded_args

REPO_ROOT = Path(__file__).resolve().parents[3]


def _our_flags() -> list:
    parser = add_bounded_args(argparse.ArgumentParser(add_help=False))
    (group,) = [group for group in parser._action_groups if group.title == "megatron-bounded"]
    flags = [option for action in group._group_actions for option in action.option_strings]
    assert len(flags) == len(parser._actions)  # every flag we add is in that group
    return flags


def test_help_exits_0_and_lists_our_flags_in_their_group():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--help"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unsupported format character" not in done.stderr
    heading = "\nmegatron-bounded:\n"
    assert done.stdout.count(heading) == 1
    description, ours = done.stdout.split(heading, 1)[1].split("\n\n", 1)
    assert "--help-bounded" in description
    # the group ends where the next group's heading starts (after an empty line)
    ours = ours.split("\n\n", 1)[0] if "\n\n" in ours else ours
    flags = _our_flags()
    assert "--bounded-plan" in flags and "--bounded-moe-backend" in flags
    assert "--bounded-fast-path" not in flags and "--auto-bounds" not in flags  # the planner's now
    missing = [flag for flag in flags if f"  {flag}" not in ours]
    assert not missing, f"not listed under megatron-bounded: {missing}"
    # upstream's flags are listed too, outside our group
    assert "--num-layers" in done.stdout and "--num-layers" not in ours


def test_help_bounded_lists_only_our_flags_each_on_one_help_line():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--help-bounded"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    flags = _our_flags()
    missing = [flag for flag in flags if f"  {flag}" not in done.stdout]
    assert not missing, f"not listed: {missing}"
    assert "--num-layers" not in done.stdout
    assert len(done.stdout.splitlines()) < 12 * len(flags)  # a short help per flag
