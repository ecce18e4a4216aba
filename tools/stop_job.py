"""Stop a launched training job and its workers: the one way the tools and tests do it.

    from stop_job import stop_job   # tools/ on sys.path, or load this file by path
    job = subprocess.Popen(command, start_new_session=True)   # its own process group
    ...
    stop_job(job)

or, for a job that runs to its end or to a time limit, its output in a log file::

    returncode = run_logged(command, log_path, timeout_s, cwd=..., env=...)  # None: timed out

``stop_job`` sends SIGTERM to the job's process group and SIGKILL if it lingers. torchrun starts
each worker in a session of its own, out of reach of the group's signals: only torchrun's SIGTERM
handling stops them, hence the long grace before SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Optional

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


def run_logged(command: list, log_path, timeout_s: float, **popen_kwargs) -> Optional[int]:
    """Run ``command`` in a process group of its own, its output (stdout and stderr) to
    ``log_path``; its exit status, or None when it outlasted ``timeout_s`` and was stopped. An
    interruption here (Ctrl-C, SIGTERM raised as SystemExit) stops the job before going on."""
    with open(log_path, "w") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, **popen_kwargs)
        try:
            return job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_job(job)
            return None
        except BaseException:
            stop_job(job)
            raise
