"""bench_gemm's fp8 training-layout rows (issue 43): the operands K-major as Float8Linear's
casts write them, each GEMM's accumulation as Float8Linear launches it, the error against
the float64 product of the same fp8 operands, and the ratio against the best peer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_gemm_layouts as layouts  # noqa: E402
import gemm_checks as checks  # noqa: E402

from tkern.kernels.gemm import k_major_fp8_operands  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's rehearsal of the GPU rows")

M, N_OUT, K_IN = 128, 32, 128  # K and M multiples of 128: every blockwise operand has whole blocks


def _operands(layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K_IN, generator=g)
    w = torch.randn(N_OUT, K_IN, generator=g) / K_IN**0.5
    dy = torch.randn(M, N_OUT, generator=g)
    return layouts.layout_operands(layout, x, w, dy)


@pytest.mark.parametrize("scaling", checks.FP8_SCALINGS)
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_fp8_operands_are_k_major_and_the_float64_product_is_the_dequantized_one(layout, scaling):
    a, b = _operands(layout)
    aq, bq, sa, sb, *_ = layouts.quantize_operands(scaling, layout, a, b)
    assert aq.shape == a.shape and bq.shape == b.shape
    assert aq.stride(1) == 1 and bq.stride(0) == 1  # unit stride along K, both
    # scaled_mm launches on them as given: the timed GEMM pays no K-major copy
    a2, b2 = k_major_fp8_operands(aq, bq)
    assert a2 is aq and b2 is bq
    # the float64 product, against one written out element by element from the scales
    ref = checks.fp64_product(aq, bq, sa, sb)
    if scaling != "blockwise":  # one scale, or (M, 1) and (1, N): they broadcast as written
        want = (aq.double() * sa.double()) @ (bq.double() * sb.double())
        torch.testing.assert_close(ref, want, rtol=1e-12, atol=1e-12)
    # and the quantized product is within the fp8 rounding of the unquantized one
    assert checks.rel_err(a.double() @ b.double(), ref) < 0.1


def test_fp8_layout_case_times_tkern_and_torch_and_reports_the_best_peer():
    """One case through _fp8_layout_case with a recorder that gives fixed times: tkern's
    row names the faster of bf16 cuBLAS and torch._scaled_mm (CPU fp8 on this torch) and
    its ratio against it, and both fp8 rows carry rel_err against the float64 product."""
    import harness

    res = harness.Results("gemm", harness.Mode(True, torch.device("cpu"), None), metric="tflops")
    res.meta["failed"] = []
    times = {"torch bf16": 2.0, "tkern": 1.0, "torch": 1.6, "torch fast accum": 1.6}

    def record(case, impl, fn, flops, **extra):
        fn()
        return res.add(case, impl, times[impl], tflops=flops / times[impl] / 1e9, **extra)

    a, b = _operands("dgrad")
    bf16 = record("base", "torch bf16", lambda: a @ b, 1, layout="dgrad")
    layouts._fp8_layout_case(res, record, "case", "rowwise", "dgrad", a, b, 1, {}, None, bf16)
    rows = {r["impl"]: r for r in res.rows if r["case"] == "case"}
    assert not res.meta["failed"]
    assert set(rows) == {"tkern", "torch"}  # gradients are promoted: torch's precise GEMM is the peer
    assert rows["tkern"]["best_peer"] == "torch" and rows["tkern"]["vs_best_peer"] == 1.6
    assert rows["tkern"]["vs_bf16"] == 2.0
    assert all(0 < rows[i]["rel_err"] < checks.FP8_TOL for i in rows)
    assert rows["tkern"]["mfu"] is None  # no device spec: no figure


def test_fp8_accumulation_follows_float8_linear():
    from tkern.ops.float8 import FORWARD_FAST_ACCUM, GRADIENT_FAST_ACCUM

    assert layouts.FP8_LAYOUT_FAST_ACCUM == {
        "fwd": FORWARD_FAST_ACCUM,
        "dgrad": GRADIENT_FAST_ACCUM,
        "wgrad": GRADIENT_FAST_ACCUM,
    }
    assert layouts.fp8_accum("tensorwise", "fwd") == ("fast" if FORWARD_FAST_ACCUM else "precise")
    assert {layouts.fp8_accum("blockwise", lay) for lay in layouts.LAYOUTS} == {"precise"}
