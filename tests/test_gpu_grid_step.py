"""The grid-wide one-pass step on a GPU (``opt.one_pass = "grid"``; issue 45 item 3): one
launch of up to one program per SM, meeting at a spin barrier. The CPU's interpreter runs
it with one program only (tests/test_optim_one_pass.py), so what only a GPU can show is
here: that P > 1 co-resident programs meet, agree on the statistics and give bit for bit
the two-pass step, eager and replayed in the optimizer's CUDA graph, for many steps in a
row (a memory-ordering race would show as a different clip or a different skip).

A deadlocked barrier would hang the process: every launch here is awaited by
:func:`_finish`, which ends the process with a message after WAIT_S seconds instead
(benchmarks/gpu_check.sh runs this file as its own phase, with its own time cap)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from conftest import gpu_only

from tkern.kernels import _update, grid_sync
from tkern.optim import FusedAdamW, FusedSGD

pytestmark = gpu_only

#: Seconds a step may take before the barrier is taken for deadlocked (a 4M step takes
#: well under a millisecond; the first launch compiles, seconds).
WAIT_S = 20.0


def _finish(what: str) -> None:
    """Wait for the device, or end the process if it does not finish within WAIT_S (a
    kernel that spins forever cannot be stopped from Python; exiting frees the GPU)."""
    done = torch.cuda.Event()
    done.record()
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > WAIT_S:
            print(
                f"\nDEADLOCK: {what} did not finish in {WAIT_S:.0f} s (grid barrier)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)
        time.sleep(0.001)


def _params(sizes, dtype):
    torch.manual_seed(0)
    return [torch.randn(n, device="cuda").to(dtype).requires_grad_() for n in sizes]


def _run(cls, hyper, sizes, dtype, mode, cuda_graph, steps, overflow_at=(2,)):
    params = _params(sizes, dtype)
    opt = cls(params, lr=1e-3, max_grad_norm=0.5, cuda_graph=cuda_graph, **hyper)
    opt.one_pass = mode
    gen = torch.Generator(device="cuda").manual_seed(1)
    scale = torch.full((1,), 1 / 1024, device="cuda")
    stats = []
    for t in range(steps):
        for p in params:
            p.grad.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 1024)
        if t in overflow_at:
            params[0].grad[7] = float("inf")
        opt.step(inv_scale=scale)
        _finish(f"{cls.__name__} step {t} ({mode}, cuda_graph={cuda_graph})")
        stats.append(opt.grad_stats.clone())
    return params, opt, stats


def _assert_same(a, b):
    params_a, opt_a, stats_a = a
    params_b, opt_b, stats_b = b
    for p, q in zip(params_a, params_b, strict=True):
        assert torch.equal(p, q)
    for s, r in zip(stats_a, stats_b, strict=True):
        assert torch.equal(s, r)
    sd_a, sd_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for i, entry in sd_b.items():
        for k, v in entry.items():
            assert torch.equal(sd_a[i][k], v), (i, k)
    for fa, fb in zip(opt_a.flat_buffers[0], opt_b.flat_buffers[0], strict=True):
        assert torch.equal(fa.master, fb.master)


OPTIMIZERS = {"adamw": (FusedAdamW, {}), "sgd": (FusedSGD, {"momentum": 0.9, "nesterov": True})}
#: The sizes: 1M in one tensor (every SM, ~8 tiles each); 48
#: tiles over params of three sizes (fewer programs than SMs on an H100); the size bound
#: (every SM, ~30 tiles each)
SIZES = {
    "1M": [1 << 20],
    "48 tiles": [16 * 1024, 8 * 1024, 24 * 1024],
    "4M": [_update.GRID_MAX_ELEMENTS],
}


@pytest.mark.parametrize("cuda_graph", [False, None])
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_grid_step_is_the_two_pass_step_on_a_gpu(name, dtype, size, cuda_graph):
    cls, hyper = OPTIMIZERS[name]
    sizes = SIZES[size]
    sms = grid_sync.sm_count(torch.device("cuda"))
    steps = 6
    grid = _run(cls, hyper, sizes, dtype, "grid", cuda_graph, steps)
    two = _run(cls, hyper, sizes, dtype, "off", False, steps)
    _assert_same(grid, two)
    opt = grid[1]  # one flat buffer of one dtype: one range, up to one program per SM
    assert opt.step_path.path == "grid" and opt.step_path.programs == sms, opt.step_path
    assert _update.grid_programs(sum(sizes), 1024, opt.grid_barrier) == min(sms, sum(sizes) // 1024)
    assert opt.grad_stats is not None and grid[2][2][0] == 1.0  # step 2 skipped
    if cuda_graph is None:
        assert opt.graph_fallback is None, opt.graph_fallback
        assert opt.graph_counts == {"warmup": 1, "capture": 1, "replay": steps - 2}


def test_the_barrier_resets_itself_over_many_replays():
    """200 graphed steps of the grid path (a skipped one every 50) against the two-pass
    step: the same bits at the end, and the workspace's count and ticket back at 0 with
    the generation one on per step."""
    steps = 200
    skips = tuple(range(25, steps, 50))
    grid = _run(FusedAdamW, {}, [1 << 20], torch.float16, "grid", None, steps, skips)
    two = _run(FusedAdamW, {}, [1 << 20], torch.float16, "off", False, steps, skips)
    _assert_same(grid, two)
    assert grid[1].grid_barrier.word.tolist() == [steps << 16, 0]
    assert grid[1].state_dict()["state"][0]["step"] == steps - len(skips)
