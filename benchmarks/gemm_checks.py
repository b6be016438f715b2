"""How ``bench_gemm.py`` and ``bench_gemm_layouts.py`` check a GEMM before timing it, and
torch's fp8 GEMM (the peer of ``tkern.scaled_mm``) with the accumulation each row names."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import error_line  # noqa: E402

# max relative error against torch before a case is timed: both accumulate in
# fp32 and round once, so they differ by about one output rounding
CHECK_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: how an fp8 GEMM accumulates (the module docstring): tkern's per scaling, and torch's impls
ACCUM = {"tensorwise": "fast", "rowwise": "fast", "blockwise": "precise"}
TORCH_FP8 = {"fast": "torch fast accum", "precise": "torch"}
#: (a's dtype, b's dtype) of the fp8 rows: forward (e4m3 x e4m3) and dgrad (e5m2 gradient x e4m3 weight)
FP8_FORMATS = {
    "e4m3xe4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "e5m2xe4m3": (torch.float8_e5m2, torch.float8_e4m3fn),
}
#: scale granularity -> (x's, W's) as tkern.to_float8 takes it
FP8_SCALINGS = {
    "tensorwise": ("tensor", "tensor"),
    "rowwise": ("row", "row"),
    "blockwise": ((1, 128), (128, 128)),
}
#: max relative error of an fp8 GEMM against the fp32 product of its dequantized
#: operands: both accumulate in fp32 and round once to bf16 (2^-8 relative), so
#: the norm-wise error is well under one bf16 rounding
FP8_TOL = 8e-3


def rounded(x: float) -> float | None:
    """``x`` to 3 decimals; None when it is not a number (a row not measured)."""
    return round(x, 3) if x == x and abs(x) != float("inf") else None


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rel_err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    """Norm-wise relative error of ``out`` against the float64 ``ref64``, in float64."""
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` in ``dtype`` with any of to_float8's scales (0-dim, per row,
    per block) expanded to data's shape (float64: exact, an fp8 value times an fp32
    scale has at most 28 significant bits)."""
    if scale.dim() == 0:
        return data.to(dtype) * scale.to(dtype)
    (m, k), (sm, sk) = data.shape, scale.shape
    bm, bk = -(-m // sm), -(-k // sk)
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    return data.to(dtype) * full.to(dtype)


def fp64_product(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """The float64 product of the fp8 operands ``a`` (M, K) and ``b`` (K, N) as
    ``tkern.scaled_mm`` reads them with their scales (per tensor, ``(M, 1)`` / ``(1, N)``
    rows, or block grids ``(M/bm, K/bk)`` / ``(K/bk, N/bn)``): every fp8 GEMM row's
    ``rel_err`` is against it."""
    sb_t = sb if sb.dim() == 0 else sb.t()
    return dequantize(a, sa, torch.float64) @ dequantize(b.t(), sb_t, torch.float64).t()


def torch_fp8_mm(
    scaling: str, a, b, sa, sb, accum: str = "precise", b_blocks: str = "BlockWise128x128"
) -> Callable[[], torch.Tensor]:
    """torch's fp8 GEMM for ``scaling`` as a callable: ``torch._scaled_mm`` for
    tensorwise and rowwise scales (``use_fast_accum`` when ``accum`` is "fast"); for
    blocks ``F.scaled_mm`` with BlockWise1x128 for ``a`` and ``b_blocks`` for ``b``
    (BlockWise128x128 for a weight, BlockWise1x128 for the wgrad's X: one scale per
    column and 128 of K; precise only), whose scale layouts are tried in the forms
    torch documents (as given, or outer-dimension-major). Raises what torch raises
    if none works."""
    if scaling != "blockwise":
        fast = accum == "fast"
        return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    if accum != "precise":
        raise ValueError("torch's blockwise fp8 GEMM is offered with precise accumulation only")
    from torch.nn.functional import ScalingType, scaled_mm

    def outer_major(t):
        return t.t().contiguous().t()

    errors = []
    for sa_, sb_ in ((sa, sb), (outer_major(sa), sb), (outer_major(sa), sb.t().contiguous())):
        fn = functools.partial(
            scaled_mm, a, b, sa_, ScalingType.BlockWise1x128, sb_, getattr(ScalingType, b_blocks)
        )
        try:
            fn(output_dtype=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - the next layout, then the row's recorded reason
            errors.append(error_line(exc, 120))
            continue
        return functools.partial(fn, output_dtype=torch.bfloat16)
    raise RuntimeError("torch's blockwise scaled_mm refused every scale layout: " + " | ".join(errors))


def checked_torch_fp8_mm(
    scaling: str, a, b, sa, sb, accum: str, ref, b_blocks: str = "BlockWise128x128"
) -> Callable[[], torch.Tensor]:
    """:func:`torch_fp8_mm`, checked against ``ref`` (the dequantized operands' product)
    within ``FP8_TOL``; raises what torch raises, or RuntimeError on a wrong result."""
    theirs = torch_fp8_mm(scaling, a, b, sa, sb, accum, b_blocks)
    err = rel(theirs(), ref)
    if not err < FP8_TOL:
        raise RuntimeError(f"torch's result differs from the reference: rel error {err:.3g}")
    return theirs
