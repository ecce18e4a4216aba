"""Run a function on several ranks (CPU over gloo, or GPUs over NCCL), for multi-rank tests.

Usage::

    def _body(rank, world_size, shape):
        ...  # torch.distributed is initialized (gloo) here; assert freely
        return some_picklable_value

    results = run_on_ranks(_body, world_size=2, args=((4, 8),))  # list indexed by rank

The body must be a module-level function (it is pickled into spawned processes). An exception
on any rank fails the test with that rank's traceback; a hang fails after ``timeout_s``.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# A spawned rank would import torch and megatron-core again (about 9 s of CPU each); ranks forked
# from a server that imported them once start at once. The server starts on first use.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.training"]


def _context(fresh_process: bool):
    if fresh_process:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, backend, environ):
    os.environ.clear()  # the caller's environment, not the fork server's
    os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn, world_size: int, args: tuple = (), timeout_s: float = 120.0, backend: str = "gloo",
    daemon: bool = True, fresh_process: bool = False,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo on CPU; ``nccl`` puts
    rank r on GPU r); return results by rank. ``daemon=False`` lets the ranks start processes of
    their own (megatron-core's checkpoint writer does); they are killed here all the same if they
    outlive the test. The ranks run with the caller's environment; ``fresh_process=True`` starts
    each as a new interpreter, for settings read when a module is imported (``TRITON_INTERPRET``:
    a forked rank has the server's modules, imported at its first use)."""
    ctx = _context(fresh_process)
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker,
                    args=(rank, world_size, port, fn, args, queue, backend, dict(os.environ)),
                    daemon=daemon)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: list = [None] * world_size
    failures = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout_s)
            if ok:
                results[rank] = payload
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks may now wait forever in a collective
    except Exception as exc:  # queue.Empty: some rank hung
        failures.append(f"timed out after {timeout_s}s waiting for ranks ({exc!r})")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return results


def two_and_four_rank_fixtures(body, timeout_s: float = 120.0):
    """Module-scoped fixtures that run ``body`` once on 2 and once on 4 gloo ranks, and a
    ``ranks`` fixture parametrized over both. Bind them at module level::

        two_rank, four_rank, ranks = two_and_four_rank_fixtures(_multi_rank_body)
    """
    import pytest

    @pytest.fixture(scope="module")
    def two_rank():
        return run_on_ranks(body, world_size=2, timeout_s=timeout_s)

    @pytest.fixture(scope="module")
    def four_rank():
        return run_on_ranks(body, world_size=4, timeout_s=timeout_s)

    @pytest.fixture(params=["two_rank", "four_rank"])
    def ranks(request):
        return request.getfixturevalue(request.param)

    return two_rank, four_rank, ranks
