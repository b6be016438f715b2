"""Local multi-process runs over ``torch.distributed``: :func:`run_local_processes`
spawns ranks of one default process group on this machine (tests, demos, benchmarks);
:func:`teardown_process_group` leaves the group cleanly."""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["run_local_processes", "teardown_process_group"]


def teardown_process_group() -> None:
    """Leave the default process group on every rank, cleanly.

    Garbage that still holds the group (an optimizer or DDP wrapper in a
    reference cycle) is collected first, the ranks wait for each other, the group
    is destroyed, and garbage is collected again. So gloo's C++ objects (its
    worker threads and the work they hold) are destroyed now, while the
    interpreter is alive: left to the interpreter's finalization, gloo can abort
    the process with "terminate called without an active exception", depending
    on when the collector happened to run (about one run in five on a 2-core
    machine). Call it once per process, after the last collective."""
    gc.collect()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def _local_process(
    rank: int, world: int, port: int, backend: str, pg_timeout_s: float, fn: Callable, args: tuple
) -> None:
    """One process of :func:`run_local_processes`: join the group through the
    parent's store, run ``fn``, leave the group cleanly."""
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if backend == "nccl":
        import torch.cuda

        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    del store  # the process group holds it
    try:
        fn(rank, world, *args)
    finally:
        teardown_process_group()


def run_local_processes(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout_s: float | None = None,
    pg_timeout_s: float = 600.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` spawned local processes,
    each a member of one default process group (``backend``: ``"gloo"``, or
    ``"nccl"`` with one GPU per rank).

    The parent hosts the group's TCPStore on a port the OS assigns when it
    binds (no free-port guess another process could take first) and keeps it
    until every process has exited, so no rank ever outlives the store it tears
    down through. Each process leaves the group with
    :func:`teardown_process_group`. ``fn`` must be picklable (a module-level
    function). Every process is joined; with ``timeout_s``, one still alive
    after it is killed by PID and :class:`TimeoutError` raised. ``pg_timeout_s``
    is the group's own timeout for a collective. A process that raised or
    died raises here (torch.multiprocessing's ``ProcessRaisedException`` /
    ``ProcessExitedException``) after the others are stopped."""
    import torch.multiprocessing as mp

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timeout)
    ctx = mp.start_processes(
        _local_process,
        args=(nprocs, store.port, backend, pg_timeout_s, fn, tuple(args)),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} local processes still running after {timeout_s:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        del store  # only now: every process has exited
