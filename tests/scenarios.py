"""Multi-process test scenarios on local gloo ranks, shared by the test modules that need them.

Processes are slow to start (each imports torch and triton), so a test module runs all its
scenarios in ONE spawn per world size and its tests check what each rank saved. A module
lists its scenarios in a module-level ``SCENARIOS`` dict, name -> ``fn(rank, world)`` (or
``fn(rank, world, out_dir)`` for one that writes files); a scenario that raises records
its traceback, which :func:`result` reports as that test's failure.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
import traceback
from typing import Any

import torch

from tkern.optim.distributed import run_local_processes


def _worker(rank: int, world: int, module: str, out_dir: str, names: list[str]) -> None:
    scenarios = importlib.import_module(module).SCENARIOS
    results: dict[str, Any] = {}
    try:
        for name in names:
            start = time.perf_counter()
            fn = scenarios[name]
            extra = (out_dir,) if "out_dir" in inspect.signature(fn).parameters else ()
            try:
                results[name] = fn(rank, world, *extra)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name + "_s"] = time.perf_counter() - start
    finally:
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))


def run_scenarios(
    module: str, world: int, names: list[str], out_dir: Any, *, timeout_s: float, pg_timeout_s: float = 60
) -> list[dict]:
    """Run the scenarios ``names`` of test module ``module`` (its import name) on ``world``
    gloo ranks (gloo's own timeout ``pg_timeout_s`` turns a hang into an error first; the
    whole spawn is bounded by ``timeout_s``); each rank's results, in rank order."""
    run_local_processes(
        _worker, world, (module, str(out_dir), names), timeout_s=timeout_s, pg_timeout_s=pg_timeout_s
    )
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


def result(ranks: list[dict], name: str) -> list[Any]:
    """Scenario ``name``'s result on every rank; fails with a rank's traceback if it raised."""
    for r, res in enumerate(ranks):
        assert "error" not in res[name], f"rank {r}: {res[name]['error']}"
    return [res[name] for res in ranks]
