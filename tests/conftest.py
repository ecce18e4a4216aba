"""Fixtures shared by every test directory."""

from __future__ import annotations

import signal

import pytest


# Signals whose handlers a test may replace (a tool's main() called in-process installs its own
# SIGTERM handler, pretrain code its exit-signal handler); restored after every test, so one
# test's handler never decides how a later test, or pytest itself, reacts to a signal.
_RESTORED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
    if hasattr(signal, name)
)


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """Put back every handler of :data:`_RESTORED_SIGNALS` that the test changed."""
    saved = {number: signal.getsignal(number) for number in _RESTORED_SIGNALS}
    yield
    for number, handler in saved.items():
        if handler is not None and signal.getsignal(number) is not handler:
            signal.signal(number, handler)
