"""bench_gemm's MX training-layout rows (section mx_layouts, issue 53 item 6): the operands
cast along each GEMM's K, tkern's row checked against the float64 product, torch's MX GEMM
timed or its refusal recorded, and the per-layout ratio over bf16 cuBLAS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_gemm_layouts as layouts  # noqa: E402
import bench_gemm_mx as mx  # noqa: E402
import gemm_checks as checks  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's rehearsal of the Blackwell rows")


def _operands(layout):
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((64, 64), (32, 64), (64, 32)))
    return layouts.layout_operands(layout, x, w, dy)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_mx_operands_are_k_major_with_a_scale_per_32_of_k(layout):
    a, b = _operands(layout)
    aq, bq, sa, sb = mx.mx_operands(a, b)
    (m, k), n = a.shape, b.shape[1]
    assert aq.stride(1) == 1 and bq.stride(0) == 1  # both K-major: no copy before the GEMM
    assert sa.shape == (m, k // 32) and sb.shape == (n, k // 32)
    assert checks.rel_err(a.double() @ b.double(), mx.mx_fp64_product(aq, bq, sa, sb)) < 0.1


def test_mx_case_times_tkern_records_torchs_refusal_and_the_ratio_over_bf16():
    """One case through _mx_case as a GPU run takes it (not smoke) with fixed times: tkern's
    row (interpreted) carries rel_err; torch's MX GEMM, refused on this CPU, a ``skipped``
    reason (or, where it runs, its own rel_err); mx_summary's ratio is bf16 ms / tkern ms."""
    import harness

    mode = harness.Mode(False, torch.device("cpu"), None)
    res = harness.Results("gemm", mode, metric="tflops")
    res.meta["failed"] = []
    times = {layouts.BF16_PEER: 3.0, "tkern": 1.5, mx.TORCH_MX: 2.0}

    def record(case, impl, fn, flops, **extra):
        fn()
        return res.add(case, impl, times[impl], **extra)

    a, b = _operands("wgrad")
    record("mx layout bf16 wgrad m l 32x64x64", layouts.BF16_PEER, lambda: a @ b, 1)
    mx._mx_case(res, record, mode, "mx wgrad m l 32x64x64", a, b, 1, {"layout": "wgrad"})
    rows = {r["impl"]: r for r in res.rows if r["case"] == "mx wgrad m l 32x64x64"}
    assert not res.meta["failed"]
    assert 0 < rows["tkern"]["rel_err"] < checks.FP8_TOL
    torch_row = rows[mx.TORCH_MX]
    assert torch_row["ms"] is None and torch_row["skipped"] or 0 < torch_row["rel_err"] < checks.FP8_TOL
    mx.mx_summary(res, ("wgrad", "fwd"), smoke=True)
    assert res.meta["mx_wgrad_vs_bf16"] == 2.0
    assert res.meta["mx_fwd_vs_bf16"] is None  # nothing measured: no figure made up
