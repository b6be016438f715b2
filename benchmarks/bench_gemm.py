"""tkern's GEMM against torch.matmul (cuBLAS), fp16 and bf16.

Cases: square sizes 512..8192; transformer shapes with M = 8192 tokens and
(N, K) in {(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)}; the
linear forward and forward+backward; the fused linear + bias + GELU against
torch's unfused ``F.gelu(F.linear(...))`` under autocast. Each case is checked
against torch before it is timed. Targets on H100/H200: geometric-mean ratio
to cuBLAS >= 0.95 over square sizes >= 2048 and over the transformer shapes;
fused bias+GELU >= 1.1x the unfused path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bar_plot, bench, geomean, setup  # noqa: E402

import tkern  # noqa: E402
from tkern.kernels.gemm import matmul_tma_persistent  # noqa: E402

SQUARE = (512, 1024, 2048, 4096, 8192)
TRANSFORMER = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
TOKENS = 8192
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# max relative error against torch before a case is timed: both accumulate in
# fp32 and round once, so they differ by about one output rounding
CHECK_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# tkern's two GEMM schedules: the default (one tile per program, pointer loads)
# and the persistent one with tensor-descriptor (TMA) loads, not yet the default
GEMMS = {"tkern": tkern.matmul, "tkern tma": matmul_tma_persistent}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_linear(record, mode, tokens: int, n: int, k: int) -> None:
    """tkern.linear (plain and with the fused bias + GELU) against torch's
    F.linear and unfused F.gelu(F.linear) under autocast, forward and forward + backward."""
    dev = mode.device
    x = torch.randn(tokens, k, device=dev, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(n, k, device=dev) / k**0.5).half().requires_grad_()
    b = torch.randn(n, device=dev, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.float16)
    flops = 2 * tokens * n * k
    shape = f"{tokens}x{n}x{k}"

    def fwd_bwd(f):
        return lambda: f().backward(dy)

    def unfused():
        with torch.autocast(dev.type, dtype=torch.float16, enabled=not mode.smoke):
            return F.gelu(F.linear(x, w, b))

    variants = {
        "tkern": (lambda: tkern.linear(x, w, b), lambda: tkern.linear(x, w, b, "gelu")),
        "torch": (lambda: F.linear(x, w, b), unfused),
    }
    if mode.smoke:
        variants.pop("torch")
    else:
        assert rel(tkern.linear(x, w, b, "gelu"), unfused()) < CHECK_TOL[torch.float16]
    for impl, (plain, gelu) in variants.items():
        record(f"linear fwd {shape}", impl, plain, flops)
        record(f"linear fwd+bwd {shape}", impl, fwd_bwd(plain), 3 * flops)
        record(f"bias+gelu fwd {shape}", impl, gelu, flops)
        record(f"bias+gelu fwd+bwd {shape}", impl, fwd_bwd(gelu), 3 * flops)


def main(argv: list[str] | None = None) -> Results:
    mode, _ = setup("gemm", __doc__, argv)
    dev = mode.device
    res = Results("gemm", mode, metric="tflops")
    square = (64, 96) if mode.smoke else SQUARE
    shapes = ((96, 64),) if mode.smoke else TRANSFORMER
    tokens = 32 if mode.smoke else TOKENS

    def record(case, impl, fn, flops):
        ms, lo, hi = bench(fn, mode)
        res.add(
            case,
            impl,
            ms,
            tflops=round(flops / (ms * 1e-3) / 1e12, 2),
            ms_p20=round(lo, 5),
            ms_p80=round(hi, 5),
        )

    def record_mm(case, a, b):
        """Every implementation of a @ b on one case, each checked against torch first."""
        ref = a.float() @ b.float()
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        for impl, fn in GEMMS.items():
            assert rel(fn(a, b), ref) < CHECK_TOL[a.dtype], (case, impl)
            record(case, impl, lambda fn=fn: fn(a, b), flops)
        if not mode.smoke:  # cuBLAS; the CPU has no fp16/bf16 matmul worth timing
            record(case, "torch", lambda: a @ b, flops)

    for tag, dtype in DTYPES.items():
        for n in square:
            record_mm(
                f"{tag} square {n}",
                torch.randn(n, n, device=dev).to(dtype),
                torch.randn(n, n, device=dev).to(dtype),
            )
        for n, k in shapes:
            x = torch.randn(tokens, k, device=dev).to(dtype)
            w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
            record_mm(f"{tag} mm {tokens}x{n}x{k}", x, w.t())  # x @ W^T, W read in place

    # linear forward / forward+backward and the fused bias+GELU epilogue, fp16
    for n, k in shapes:
        bench_linear(record, mode, tokens, n, k)

    summary = []
    if not mode.smoke:
        for tag in DTYPES:
            for impl in GEMMS:
                sq = geomean([res.ratio(f"{tag} square {n}", impl, "torch") for n in square if n >= 2048])
                tr = geomean([res.ratio(f"{tag} mm {tokens}x{n}x{k}", impl, "torch") for n, k in shapes])
                prefix = tag if impl == "tkern" else f"{tag}_tma"
                res.meta[f"{prefix}_square_ge2048_vs_cublas"] = round(sq, 3)
                res.meta[f"{prefix}_transformer_vs_cublas"] = round(tr, 3)
                summary.append(
                    f"{tag} {impl}: /cuBLAS geomean, square >= 2048: {sq:.3f}x; "
                    f"transformer shapes: {tr:.3f}x (target >= 0.95)"
                )
        gelu = geomean([res.ratio(f"bias+gelu fwd {tokens}x{n}x{k}", "tkern", "torch") for n, k in shapes])
        gelu_bwd = geomean(
            [res.ratio(f"bias+gelu fwd+bwd {tokens}x{n}x{k}", "tkern", "torch") for n, k in shapes]
        )
        res.meta["fused_bias_gelu_fwd_speedup"] = round(gelu, 3)
        res.meta["fused_bias_gelu_fwd_bwd_speedup"] = round(gelu_bwd, 3)
        summary.append(
            f"fused bias+GELU vs unfused autocast: forward {gelu:.3f}x, "
            f"forward+backward {gelu_bwd:.3f}x (target >= 1.1)"
        )
    res.save(lambda p, path: bar_plot(p, path, "tflops", "TFLOP/s", "tkern GEMM vs cuBLAS"))
    res.print_table(["ms", "tflops"], summary)
    return res


if __name__ == "__main__":
    main()
