"""Units and small run-wide helpers every subpackage shares (imports nothing of the package).

``GiB``/``GB`` are the two byte units the project prints (binary for memory, decimal for the
``--*-gb`` flags that say so) and ``MiB`` the unit of buffer and workspace sizes; ``ceil_div`` is the one ceiling division; ``log_once`` logs a
message on one rank the first time its key is seen in this process.
"""

from __future__ import annotations

import logging
from typing import Hashable, Optional

GiB = 2**30
MiB = 2**20
GB = 10**9


def ceil_div(a: int, b: int) -> int:
    """The smallest integer not below ``a / b`` (integers, ``b > 0``)."""
    return -(-int(a) // int(b))


# keys already logged by log_once, in this process
_LOGGED: set = set()


def log_once(logger: logging.Logger, message: str, *fmt_args, key: Optional[Hashable] = None,
             level: int = logging.INFO) -> bool:
    """Log ``message % fmt_args`` on rank 0 (every rank before torch.distributed starts) the
    first time ``key`` (the message itself by default) is seen; True when it was logged."""
    key = message if key is None else key
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    from megatron.core._rank_utils import log_single_rank  # torch.distributed-aware, imported late

    log_single_rank(logger, level, message, *fmt_args)
    return True
