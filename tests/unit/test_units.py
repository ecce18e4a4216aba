"""megatron.bounded.units: the byte units, ceil_div (exact on integers of any size, where a float
quotient is not) and log_once (once per key and process)."""

from __future__ import annotations

import logging
import math
from fractions import Fraction

import pytest

from megatron.bounded.units import GB, GiB, MiB, ceil_div, log_once


def test_units():
    assert (GiB, MiB, GB) == (1024 * 1024 * 1024, 1024 * 1024, 1000 * 1000 * 1000)


@pytest.mark.parametrize("a,b", [(0, 3), (1, 3), (3, 3), (4, 3), (7, 1), (-7, 2), (2**70 + 1, 2**20),
                                 (10**30 + 1, 10**15)])
def test_ceil_div_is_the_exact_ceiling(a, b):
    assert ceil_div(a, b) == math.ceil(Fraction(a, b))


def test_ceil_div_where_a_float_quotient_rounds_down():
    a, b = 2**60 + 1, 2**3  # a / b rounds to 2**57 exactly: math.ceil on the float loses the 1
    assert math.ceil(a / b) == 2**57
    assert ceil_div(a, b) == 2**57 + 1


def test_log_once_logs_each_key_once(caplog):
    logger = logging.getLogger("megatron.bounded.test_units")
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert log_once(logger, "kernel %s chosen", "flash", key=("test_units", "flash"))
        assert not log_once(logger, "kernel %s chosen", "flash", key=("test_units", "flash"))
        assert log_once(logger, "kernel %s chosen", "cudnn", key=("test_units", "cudnn"))
        assert log_once(logger, "test_units: message as its own key")
        assert not log_once(logger, "test_units: message as its own key")
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [
        "kernel flash chosen", "kernel cudnn chosen", "test_units: message as its own key"]
