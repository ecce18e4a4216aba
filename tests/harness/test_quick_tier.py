"""The quick tier: ``scripts/test.sh --quick`` leaves out the slow and GPU tests, and every file
that tests/conftest.py names slow exists."""

from __future__ import annotations

import pathlib

from tests.conftest import SLOW_FILES

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_flag_selects_neither_slow_nor_gpu_tests():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert '"--quick" ]; then' in script
    assert 'set -- -m "not slow and not gpu" "$@"' in script


def test_every_slow_file_exists():
    missing = [path for path in SLOW_FILES if not (ROOT / path).is_file()]
    assert not missing
    assert len(set(SLOW_FILES)) == len(SLOW_FILES)
