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

SQUARE = (512, 1024, 2048, 4096, 8192)
TRANSFORMER = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
TOKENS = 8192
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# max relative error against torch before a case is timed: both accumulate in
# fp32 and round once, so they differ by about one output rounding
CHECK_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


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

    for tag, dtype in DTYPES.items():
        for n in square:
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            if not mode.smoke or dtype == torch.float16:
                assert rel(tkern.matmul(a, b), (a.float() @ b.float())) < CHECK_TOL[dtype]
            torch_mm = (
                (lambda a=a, b=b: a @ b) if not mode.smoke else (lambda a=a, b=b: a.float() @ b.float())
            )
            record(f"{tag} square {n}", "tkern", lambda a=a, b=b: tkern.matmul(a, b), 2 * n**3)
            record(f"{tag} square {n}", "torch", torch_mm, 2 * n**3)
        for n, k in shapes:
            x = torch.randn(tokens, k, device=dev).to(dtype)
            w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
            case = f"{tag} mm {tokens}x{n}x{k}"
            record(case, "tkern", lambda x=x, w=w: tkern.matmul(x, w.t()), 2 * tokens * n * k)
            if not mode.smoke:
                record(case, "torch", lambda x=x, w=w: x @ w.t(), 2 * tokens * n * k)

    # linear forward / forward+backward and the fused bias+GELU epilogue, fp16
    for n, k in shapes:
        bench_linear(record, mode, tokens, n, k)

    summary = []
    if not mode.smoke:
        for tag in DTYPES:
            sq = geomean(
                [res.ratio(f"{tag} square {n}", "torch", "tkern") ** -1 for n in square if n >= 2048]
            )
            tr = geomean([res.ratio(f"{tag} mm {tokens}x{n}x{k}", "torch", "tkern") ** -1 for n, k in shapes])
            res.meta[f"{tag}_square_ge2048_vs_cublas"] = round(sq, 3)
            res.meta[f"{tag}_transformer_vs_cublas"] = round(tr, 3)
            summary.append(
                f"{tag}: tkern/cuBLAS geomean, square >= 2048: {sq:.3f}x; "
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
