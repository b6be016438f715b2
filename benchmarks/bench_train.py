"""Time per training step and peak memory, end to end:

(1) the seeds' 2-layer MLP on MNIST-sized input: 784 -> 4096 -> 10, batch 8192;
(2) a deep, wide MLP: 8 layers of 4096, batch 8192 tokens;

tkern (convert_network + FusedAdamW + DynamicLossScaler) vs torch fp32
(AdamW fused) vs torch autocast + GradScaler + AdamW fused. Targets on
H100/H200: tkern >= 2x fp32, >= 1.1x autocast, peak memory <= autocast's.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bar_plot, setup  # noqa: E402

from tkern import demo  # noqa: E402

STEPS, WARMUP = 30, 5
MODELS = {
    "mlp 784-4096-10, batch 8192": (784, [4096], 10, 8192),
    "mlp 8x4096, batch 8192": (4096, [4096] * 7, 4096, 8192),
}
SMOKE_MODELS = {"mlp 16-32-4, batch 8": (16, [32], 4, 8)}


# The three recipes of tkern's demo (tkern.demo.build), under this script's labels.
RECIPES = {"tkern": "tkern", "torch fp32": "fp32", "torch autocast": "autocast"}
CONFIG = demo.Config(optimizer="adamw", scaler="dynamic", lr=1e-4)


def time_steps(impl, base, batch, device, steps, warmup):
    model, opt, scaler, autocast = demo.build(RECIPES[impl], base, CONFIG, device)
    x = torch.randn(batch[0], batch[1], device=device)
    y = torch.randint(0, batch[2], (batch[0],), device=device)

    def step():
        opt.zero_grad()
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(steps):
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated()
    else:
        import time

        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t))
        peak = 0
    times.sort()
    return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5], peak


def main(argv: list[str] | None = None) -> Results:
    mode, _ = setup("train", __doc__, argv)
    res = Results("train", mode, metric=None)
    models = SMOKE_MODELS if mode.smoke else MODELS
    steps, warmup = (2, 1) if mode.smoke else (STEPS, WARMUP)
    for case, (d_in, hidden, d_out, batch) in models.items():
        torch.manual_seed(0)
        base = demo.make_mlp(d_in, tuple(hidden), d_out).to(mode.device)
        for impl in RECIPES:
            try:
                ms, lo, hi, peak = time_steps(impl, base, (batch, d_in, d_out), mode.device, steps, warmup)
            except torch.OutOfMemoryError:
                print(f"{case} {impl}: out of memory, skipped")
                continue
            finally:
                gc.collect()
                if mode.device.type == "cuda":
                    torch.cuda.empty_cache()
            res.add(case, impl, ms, peak_mib=round(peak / 2**20, 1), ms_p20=round(lo, 4), ms_p80=round(hi, 4))
    summary = []
    if not mode.smoke:
        for case in models:
            vs32 = res.ratio(case, "tkern", "torch fp32")
            vsac = res.ratio(case, "tkern", "torch autocast")
            mem = {r["impl"]: r["peak_mib"] for r in res.rows if r["case"] == case}
            res.meta[f"{case}: vs fp32"] = round(vs32, 3)
            res.meta[f"{case}: vs autocast"] = round(vsac, 3)
            summary.append(
                f"{case}: tkern {vs32:.2f}x fp32 (target >= 2), {vsac:.2f}x autocast (target >= 1.1), "
                f"peak {mem.get('tkern')} MiB vs autocast {mem.get('torch autocast')} MiB (target <=)"
            )
    res.save(
        lambda p, path: bar_plot(p, path, "ms", "ms per training step (lower is better)", "training step")
    )
    res.print_table(["ms", "peak_mib"], summary)
    return res


if __name__ == "__main__":
    main()
