"""Data-parallel optimizer step on W processes: per-rank memory and step time of

(tkern) DistributedFusedAdamW (ZeRO-2): reduce-scatter of the gradients,
        update of this rank's shard, all-gather of the params;
(a) DDP's gradient sync + FusedAdamW: an all-reduce of the flat fp16 gradient
    buffer (what DDP's buckets do), then the unsharded fused step;
(b) the same sync + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    (ZeRO-1) on fp32 params and grads (torch's optimizers hold no fp32 master
    for fp16 params, so a torch ZeRO user keeps fp32 params; AMP's default).

The step is what the optimizer owns: gradients are filled once, then each
timed iteration runs sync + update (+ param sync) on every rank; forward and
backward are not timed (they are the same for every variant). FSDP2 is not
measured here. Memory per rank is what the variant allocates for params,
grads, master and optimizer state (tkern: ``memory_report()``; the others:
their tensors), and on a GPU also the peak of ``torch.cuda.max_memory_allocated``
during construction and steps. Each W runs as W processes on 127.0.0.1 (NCCL on
GPUs, one per rank; gloo on the CPU). Targets on GPUs: optimizer memory per
rank at W = 8 <= 0.35x FusedAdamW's; step time within 10% of (a) at W = 1..8.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bar_plot, setup  # noqa: E402

import tkern  # noqa: E402
from tkern.optim import DistributedFusedAdamW, FusedAdamW  # noqa: E402
from tkern.optim.distributed import run_local_processes  # noqa: E402

SIZES = {"100M": [1 << 20] * 100, "1B": [1 << 24] * 64}
SMOKE_SIZES = {"20x100+4k": [100] * 20 + [4096]}
LR = 1e-3
TKERN, DDP, ZERO1 = "tkern ZeRO-2", "(a) all-reduce + FusedAdamW", "(b) all-reduce + ZeroRedundancyOptimizer"


def _add_arguments(parser) -> None:
    parser.add_argument(
        "--worlds",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="world sizes to run, e.g. 1,2,4,8 (default: powers of 2 up to the GPU count; --smoke: 2)",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed steps per variant (GPU)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step, device: torch.device, iters: int, warmup: int) -> float:
    """Median ms per step, the max over the ranks (every rank runs the same count)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _flat_bytes(opt) -> int:
    total = 0
    for flats in opt._flat:
        for f in flats:
            total += f.param.nbytes + f.grad.nbytes + sum(b.nbytes for b in f.state.values())
            if f.dtype != torch.float32:
                total += f.master.nbytes
    return total


def _make(impl: str, sizes: list[int], device: torch.device, world: int):
    """(step, bytes the variant allocates on this rank)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if impl == ZERO1:
        params = [torch.randn(n, generator=g).to(device).requires_grad_() for n in sizes]
    else:
        params = [torch.randn(n, generator=g).to(device, torch.float16).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).mul_(1e-3).to(device, p.dtype)
    if impl == TKERN:
        opt = DistributedFusedAdamW(params, lr=LR)
        return opt.step, opt.memory_report()["total"]
    if impl == DDP:
        opt = FusedAdamW(params, lr=LR)
        grads = [f.grad for flats in opt._flat for f in flats]

        def step():
            for buf in grads:
                dist.all_reduce(buf)
                buf.div_(world)
            opt.step()

        return step, _flat_bytes(opt)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)

    def step():
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()

    step()  # creates the state
    state = sum(t.nbytes for s in opt.optim.state.values() for t in s.values() if torch.is_tensor(t))
    return step, sum(p.nbytes + p.grad.nbytes for p in params) + state


def _rank_main(rank: int, world: int, smoke: bool, iters: int, out: str) -> None:
    gpu = torch.cuda.is_available() and not tkern.INTERPRET
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    rows = []
    try:
        for case, sizes in (SMOKE_SIZES if smoke else SIZES).items():
            n = sum(sizes)
            for impl in (TKERN, DDP, ZERO1):
                if gpu:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                step, nbytes = _make(impl, sizes, device, world)
                ms = _time(step, device, iters=2 if smoke else iters, warmup=1 if smoke else 3)
                peak = torch.cuda.max_memory_allocated(device) - base if gpu else None
                rows.append(
                    {
                        "case": f"W={world} {case}",
                        "impl": impl,
                        "ms": ms,
                        "world": world,
                        "params": n,
                        "bytes_per_param": round(nbytes / n, 3),
                        "peak_bytes_per_param": round(peak / n, 3) if peak is not None else None,
                    }
                )
                step = None
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> Results:
    mode, args = setup("distributed", __doc__, argv, _add_arguments)
    gpus = torch.cuda.device_count() if mode.device.type == "cuda" else 0
    worlds = args.worlds or ([2] if mode.smoke else [w for w in (1, 2, 4, 8) if w <= max(gpus, 1)])
    if gpus and max(worlds) > gpus:
        raise SystemExit(
            f"bench_distributed: world size {max(worlds)} needs {max(worlds)} GPUs, found {gpus}"
        )
    res = Results("distributed", mode, metric=None)
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            run_local_processes(
                _rank_main, world, (mode.smoke, args.iters, out), backend="nccl" if gpus else "gloo"
            )
            for row in json.loads(Path(out).read_text()):
                res.add(**row)
    summary = []
    for case in dict.fromkeys(r["case"] for r in res.rows):
        by = {r["impl"]: r for r in res.rows if r["case"] == case}
        if TKERN in by and DDP in by:
            mem = by[TKERN]["bytes_per_param"] / by[DDP]["bytes_per_param"]
            speed = by[TKERN]["ms"] / by[DDP]["ms"]
            summary.append(
                f"{case}: memory {mem:.2f}x FusedAdamW's (target at W=8 <= 0.35), time {speed:.2f}x (a)"
            )
            res.meta[f"{case} memory_vs_a"] = round(mem, 3)
            res.meta[f"{case} time_vs_a"] = round(speed, 3)
    res.save(lambda p, path: bar_plot(p, path, "ms", "ms per step", "data-parallel optimizer step"))
    res.print_table(["ms", "bytes_per_param", "peak_bytes_per_param"], summary)
    return res


if __name__ == "__main__":
    main()
