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
backward are not timed (they are the same for every variant). Memory per rank
is what the variant allocates for params, grads, master and optimizer state
(tkern: ``memory_report()``; the others: their tensors), and on a GPU also the
peak of ``torch.cuda.max_memory_allocated`` during construction and steps.

Whole training steps (forward, backward, optimizer step) of a stack of bf16
Linear layers, where the gradient sync can overlap backward:

(tkern ZeRO-2, overlap / no overlap) DistributedFusedAdamW with
        ``overlap_grad_sync`` True / False (the row of the overlap says whether
        its params came out bit-identical to the other's);
(FSDP2 + tkern FusedAdamW) ``convert_network(bf16)`` then ``fully_shard`` each
        Linear and the root; tkern's fused AdamW on the DTensor shards (fp32 master);
(FSDP2 + torch AdamW) fp32 params under ``fully_shard`` with
        ``MixedPrecisionPolicy(bf16, reduce fp32)`` (torchtitan's default) and
        ``torch.optim.AdamW`` (fused on CUDA, foreach on the CPU).

Memory per rank there: the optimizer's and the params' and grads' bytes on this
rank (FSDP2: the local shards; the all-gathered layer is only in the GPU peak).

Each W runs as W processes on 127.0.0.1 (NCCL on GPUs, one per rank; gloo on
the CPU). Targets on GPUs: optimizer memory per
rank at W = 8 <= 0.35x FusedAdamW's; step time within 10% of (a) at W = 1..8.
"""

from __future__ import annotations

import functools
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
from harness import Results, setup  # noqa: E402

import tkern  # noqa: E402
from tkern.optim import DistributedFusedAdamW, FusedAdamW  # noqa: E402
from tkern.optim.distributed import run_local_processes  # noqa: E402

SIZES = {"100M": [1 << 20] * 100, "1B": [1 << 24] * 64}
SMOKE_SIZES = {"20x100+4k": [100] * 20 + [4096]}
#: the training-step model: (width, layers, rows per rank); 8 layers of 4096^2 = 134M params
STACK, SMOKE_STACK = (4096, 8, 4096), (64, 4, 16)
LR = 1e-3
TKERN, DDP, ZERO1 = "tkern ZeRO-2", "(a) all-reduce + FusedAdamW", "(b) all-reduce + ZeroRedundancyOptimizer"
ZERO2_OVERLAP, ZERO2_NO_OVERLAP = "tkern ZeRO-2, overlap", "tkern ZeRO-2, no overlap"
FSDP2_TKERN, FSDP2_TORCH = "FSDP2 + tkern FusedAdamW", "FSDP2 + torch AdamW"
TRAINING = (ZERO2_NO_OVERLAP, ZERO2_OVERLAP, FSDP2_TKERN, FSDP2_TORCH)  # no overlap first: the reference


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
    """(step, bytes the variant allocates on this rank, None)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if impl == ZERO1:
        params = [torch.randn(n, generator=g).to(device).requires_grad_() for n in sizes]
    else:
        params = [torch.randn(n, generator=g).to(device, torch.float16).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).mul_(1e-3).to(device, p.dtype)
    if impl == TKERN:
        opt = DistributedFusedAdamW(params, lr=LR)
        return opt.step, opt.memory_report()["total"], None
    if impl == DDP:
        opt = FusedAdamW(params, lr=LR)
        grads = [f.grad for flats in opt._flat for f in flats]

        def step():
            for buf in grads:
                dist.all_reduce(buf)
                buf.div_(world)
            opt.step()

        return step, _flat_bytes(opt), None
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)

    def step():
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()

    step()  # creates the state
    state = sum(t.nbytes for s in opt.optim.state.values() for t in s.values() if torch.is_tensor(t))
    return step, sum(p.nbytes + p.grad.nbytes for p in params) + state, None


def _local_bytes(tensors) -> int:
    """Bytes of ``tensors`` on this rank (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _make_training(impl: str, stack: tuple[int, int, int], device: torch.device, rank: int):
    """(one whole training step, bytes per rank, the params' values after it) for ``impl``."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tkern.train.demo import shard_fully

    width, layers, rows = stack
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rank)).to(device, torch.bfloat16)
    if impl == FSDP2_TORCH:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **fast)
    else:
        tkern.convert_network(model, torch.bfloat16)
        if impl == FSDP2_TKERN:
            opt = FusedAdamW(shard_fully(model, device).parameters(), lr=LR)
        else:
            opt = DistributedFusedAdamW(model.parameters(), lr=LR, overlap_grad_sync=impl == ZERO2_OVERLAP)

    def step(zero_grad: bool = True):
        model(x).float().square().mean().backward()
        opt.step()
        if zero_grad:
            opt.zero_grad()

    def values() -> torch.Tensor:
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten()
                          for p in model.parameters()])  # fmt: skip

    step(zero_grad=False)  # the optimizer's state exists from here; counted with the gradients
    params = list(model.parameters())
    if isinstance(opt, FusedAdamW):  # flat buffers: params (a copy under FSDP2), grads, master, state
        nbytes = opt.memory_report()["total"] + (_local_bytes(params) if impl == FSDP2_TKERN else 0)
    else:
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        nbytes = _local_bytes(params) + _local_bytes(p.grad for p in params if p.grad is not None)
        nbytes += _local_bytes(state)
    opt.zero_grad()
    return step, nbytes, values


def _measured(case: str, impl: str, make, device: torch.device, world: int, n: int, smoke: bool, iters: int):
    """Build a variant (``make()``: its step, its bytes per rank, anything else), time its steps;
    (its row, the anything else). On a GPU the row has the peak memory from construction on."""
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    step, nbytes, extra = make()
    ms = _time(step, device, iters=2 if smoke else iters, warmup=1 if smoke else 3)
    peak = torch.cuda.max_memory_allocated(device) - base if gpu else None
    row = {
        "case": case,
        "impl": impl,
        "ms": ms,
        "world": world,
        "params": n,
        "bytes_per_param": round(nbytes / n, 3),
        "peak_bytes_per_param": round(peak / n, 3) if peak is not None else None,
    }
    return row, extra


def _training_rows(world: int, smoke: bool, iters: int, device: torch.device, rank: int) -> list[dict]:
    stack = SMOKE_STACK if smoke else STACK
    n = stack[0] * stack[0] * stack[1]
    rows, reference = [], None
    for impl in TRAINING:
        case = f"W={world} train {stack[1]}x{stack[0]}^2 bf16"
        make = functools.partial(_make_training, impl, stack, device, rank)
        row, values = _measured(case, impl, make, device, world, n, smoke, iters)
        if impl == ZERO2_NO_OVERLAP:
            reference = values()
        elif impl == ZERO2_OVERLAP:
            row["bit_identical_to_no_overlap"] = bool(torch.equal(values(), reference))
        rows.append(row)
    return rows


def _rank_main(rank: int, world: int, smoke: bool, iters: int, out: str) -> None:
    gpu = torch.cuda.is_available() and not tkern.INTERPRET
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    rows = []
    try:
        for case, sizes in (SMOKE_SIZES if smoke else SIZES).items():
            n = sum(sizes)
            for impl in (TKERN, DDP, ZERO1):
                make = functools.partial(_make, impl, sizes, device, world)
                rows.append(_measured(f"W={world} {case}", impl, make, device, world, n, smoke, iters)[0])
        rows += _training_rows(world, smoke, iters, device, rank)
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
        if ZERO2_OVERLAP in by and ZERO2_NO_OVERLAP in by:
            on, off = by[ZERO2_OVERLAP], by[ZERO2_NO_OVERLAP]
            same = "bit-identical" if on["bit_identical_to_no_overlap"] else "NOT bit-identical"
            summary.append(f"{case}: overlap {on['ms'] / off['ms']:.2f}x the time without ({same})")
        if FSDP2_TKERN in by and FSDP2_TORCH in by:
            mine, theirs = by[FSDP2_TKERN], by[FSDP2_TORCH]
            summary.append(
                f"{case}: FSDP2 + tkern {mine['ms'] / theirs['ms']:.2f}x torch AdamW's time, "
                f"{mine['bytes_per_param']:.2f} vs {theirs['bytes_per_param']:.2f} B/param per rank"
            )
    res.save(plot=True)
    res.print_table(["ms", "bytes_per_param", "peak_bytes_per_param"], summary)
    return res


if __name__ == "__main__":
    main()
