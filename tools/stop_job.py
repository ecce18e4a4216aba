"""Stop a launched training job and its workers: the one way the tools and tests do it.

    from stop_job import stop_job   # tools/ on sys.path, or load this file by path
    job = subprocess.Popen(command, start_new_session=True)   # its own process group
    ...
    stop_job(job)

``stop_job`` sends SIGTERM to the job's process group and SIGKILL if it lingers. torchrun starts
each worker in a session of its own, out of reach of the group's signals: only torchrun's SIGTERM
handling stops them, hence the long grace before SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

# torchrun forwards SIGTERM to its workers and waits for them; this long before SIGKILL.
TERMINATE_GRACE_S = 60


def stop_job(job: subprocess.Popen, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM ``job``'s process group, SIGKILL after ``grace_s``; returns once it has exited."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGTERM)
    try:
        job.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
