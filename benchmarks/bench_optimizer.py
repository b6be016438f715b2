"""One optimizer step (check + unscale + AdamW update + loss-scale update) for
1M to 1B parameters and for a model of 1000 tensors of 10k, against:

(a) PyTorch's standard AMP: fp32 params, GradScaler + AdamW(fused=True);
(b) the same with AdamW(foreach=True);
(c) master weights by hand in torch (apex O2 / fastai): fp16 model, fp32
    master; copy grads to fp32, unscale, check, AdamW on the master, copy back;
(d) torch.compile of (c).

GB/s counts the minimal bytes of the update every variant performs, Adam with
fp16 params: 30 B/param (../shared/DESIGN.md): pass 1 reads the fp16 grad
(2); pass 2 reads grad, master, m, v (2 + 4 + 8) and writes master, m, v and
the fp16 copy (4 + 8 + 2). It is compared with the measured copy bandwidth.
Also measured, at 10M params: what loss scaling adds to a step (check,
unscale, scale update: scaled step minus the bare optimizer step) and the
host synchronizations per step (torch.cuda.set_sync_debug_mode), for tkern's
scaler and for GradScaler with a fused and a foreach AdamW.
Targets on H100/H200: >= 85% of copy bandwidth at >= 100M params; >= 1.5x (a);
ahead of (d); >= 3x (b) on the many-small-tensors model.
"""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bar_plot, bench, copy_bandwidth, setup  # noqa: E402

import tkern  # noqa: E402

BYTES_PER_PARAM = 30
SIZES = {
    "1M": [1 << 20],
    "10M": [10 << 20],
    "100M": [100 << 20],
    "1B": [1 << 30],
    "1000x10k": [10_000] * 1000,
}
SMOKE_SIZES = {"4k": [4096], "20x100": [100] * 20}
LR = 1e-3


def make_grads(params, scale):
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3 * scale).to(p.dtype)


def tkern_step(sizes, device, scaled=True):
    params = [torch.randn(n, device=device, dtype=torch.float16, requires_grad=True) for n in sizes]
    opt = tkern.optim.FusedAdamW(params, lr=LR)
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.ones((), device=device))  # state on the device
    make_grads(params, scaler.init_scale if scaled else 1.0)

    def step():
        scaler.step(opt)
        scaler.update()

    return step if scaled else opt.step


def torch_amp_step(sizes, device, scaled=True, **adamw_kwargs):
    """(a)/(b): fp32 params with fp32 grads (what autocast produces), GradScaler."""
    params = [torch.randn(n, device=device, requires_grad=True) for n in sizes]
    opt = torch.optim.AdamW(params, lr=LR, **adamw_kwargs)
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))
    make_grads(params, 2.0**16 if scaled else 1.0)

    def step():
        scaler.step(opt)
        scaler.update()

    return step if scaled else opt.step


def master_by_hand(sizes, device):
    """(c): fp16 model, fp32 master, the whole recipe in plain torch ops."""
    model = [torch.randn(n, device=device, dtype=torch.float16, requires_grad=True) for n in sizes]
    master = [p.detach().float() for p in model]
    opt = torch.optim.AdamW(master, lr=LR, foreach=True)
    make_grads(model, 2.0**16)
    scale = torch.full((), 2.0**16, device=device)

    def step():
        grads = torch._foreach_mul([p.grad.float() for p in model], 1.0 / scale)
        found = torch.stack([g.isinf().any() | g.isnan().any() for g in grads]).any()
        if not found.item():  # the host sync this recipe needs
            for m, g in zip(master, grads, strict=True):
                m.grad = g
            opt.step()
            torch._foreach_copy_([p.data for p in model], master)

    return step


def count_syncs(step, mode) -> int | None:
    """Host synchronizations in one call of ``step`` (CUDA only)."""
    if mode.device.type != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv: list[str] | None = None) -> Results:
    mode, _ = setup("optimizer", __doc__, argv)
    res = Results("optimizer", mode, metric="gbps")
    copy_gbps = copy_bandwidth(mode)
    res.meta["copy_gbps"] = round(copy_gbps, 1)
    variants = {
        "tkern": tkern_step,
        "(a) GradScaler+AdamW fused": lambda s, d: torch_amp_step(s, d, fused=True),
        "(b) GradScaler+AdamW foreach": lambda s, d: torch_amp_step(s, d, foreach=True),
        "(c) master by hand": master_by_hand,
        "(d) compiled (c)": lambda s, d: torch.compile(master_by_hand(s, d)),
    }
    if mode.smoke:
        variants.pop("(a) GradScaler+AdamW fused")  # fused AdamW is CUDA-only here
        variants.pop("(d) compiled (c)")  # minutes of compilation for nothing on a CPU
    for case, sizes in (SMOKE_SIZES if mode.smoke else SIZES).items():
        n = sum(sizes)
        for impl, make in variants.items():
            try:
                step = make(sizes, mode.device)
                ms, lo, hi = bench(step, mode, rep_ms=200)
                syncs = count_syncs(step, mode)
            except torch.OutOfMemoryError:
                print(f"{case} {impl}: out of memory, skipped")
                continue
            finally:
                step = None
                gc.collect()
                if mode.device.type == "cuda":
                    torch.cuda.empty_cache()
            gbps = n * BYTES_PER_PARAM / (ms * 1e-3) / 1e9
            res.add(
                case,
                impl,
                ms,
                gbps=round(gbps, 1),
                pct_copy=round(100 * gbps / copy_gbps, 1),
                syncs_per_step=syncs,
                ms_p20=round(lo, 5),
                ms_p80=round(hi, 5),
            )
    # What loss scaling adds to a step (check + unscale + scale update), and its host syncs.
    overhead_case = "4k" if mode.smoke else "10M"
    overhead = {
        "tkern": (lambda s, d: tkern_step(s, d, scaled=False), tkern_step),
        "AdamW foreach": (
            lambda s, d: torch_amp_step(s, d, scaled=False, foreach=True),
            lambda s, d: torch_amp_step(s, d, foreach=True),
        ),
    }
    if not mode.smoke:
        overhead["AdamW fused"] = (
            lambda s, d: torch_amp_step(s, d, scaled=False, fused=True),
            lambda s, d: torch_amp_step(s, d, fused=True),
        )
    sizes = (SMOKE_SIZES if mode.smoke else SIZES)[overhead_case]
    for impl, (bare, scaled) in overhead.items():
        ms_bare, _, _ = bench(bare(sizes, mode.device), mode)
        step = scaled(sizes, mode.device)
        ms_scaled, lo, hi = bench(step, mode)
        res.add(
            f"scaler overhead {overhead_case}",
            f"{impl} + {'tkern scaler' if impl == 'tkern' else 'GradScaler'}",
            ms_scaled,
            overhead_ms=round(ms_scaled - ms_bare, 5),
            syncs_per_step=count_syncs(step, mode),
            ms_p20=round(lo, 5),
            ms_p80=round(hi, 5),
        )
    summary = [
        f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s; minimal bytes: {BYTES_PER_PARAM} B/param"
    ]
    if not mode.smoke:
        for case in ("100M", "1B"):
            pct = next(
                (r["pct_copy"] for r in res.rows if r["case"] == case and r["impl"] == "tkern"), float("nan")
            )
            summary.append(
                f"{case}: tkern at {pct}% of copy bandwidth (target >= 85%); "
                f"{res.ratio(case, 'tkern', '(a) GradScaler+AdamW fused'):.2f}x (a) (target >= 1.5); "
                f"{res.ratio(case, 'tkern', '(d) compiled (c)'):.2f}x (d) (target > 1)"
            )
            res.meta[f"{case}_pct_copy"] = pct
            res.meta[f"{case}_vs_a"] = round(res.ratio(case, "tkern", "(a) GradScaler+AdamW fused"), 3)
            res.meta[f"{case}_vs_d"] = round(res.ratio(case, "tkern", "(d) compiled (c)"), 3)
        small = res.ratio("1000x10k", "tkern", "(b) GradScaler+AdamW foreach")
        res.meta["many_small_vs_b"] = round(small, 3)
        summary.append(f"1000 tensors of 10k: {small:.2f}x (b) (target >= 3)")
    res.save(
        lambda p, path: bar_plot(p, path, "gbps", "GB/s (30 B/param)", "optimizer step, AdamW + loss scaling")
    )
    res.print_table(["ms", "gbps", "pct_copy", "overhead_ms", "syncs_per_step"], summary)
    return res


if __name__ == "__main__":
    main()
