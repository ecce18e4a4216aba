"""A test that replaces a signal handler (as a tool's main() run in-process does) leaves the
handler it found to the next test (the autouse fixture of tests/conftest.py restores it)."""

from __future__ import annotations

import signal


def _tool_handler(signum, frame):  # what a benchmark tool's main() may install
    raise SystemExit(128 + signum)


def test_a_tool_installs_its_sigterm_handler():
    signal.signal(signal.SIGTERM, _tool_handler)
    assert signal.getsignal(signal.SIGTERM) is _tool_handler


def test_the_next_test_finds_the_handler_as_it_was():
    assert signal.getsignal(signal.SIGTERM) is not _tool_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
