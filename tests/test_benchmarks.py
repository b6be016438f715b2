"""The benchmark scripts run (tiny sizes, --smoke) on any machine, so a GPU
session only has to run them; without a GPU and --smoke they exit cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


@pytest.mark.parametrize("name", ["gemm", "optimizer", "train"])
def test_smoke_run_fills_every_variant(name):
    module = __import__(f"bench_{name}")
    res = module.main(["--smoke"])
    impls = {r["impl"] for r in res.rows}
    assert "tkern" in impls and len(impls) >= 2
    assert all(r["ms"] > 0 for r in res.rows)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the script measures")
def test_without_gpu_the_script_says_so_and_exits_zero():
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gemm.py")], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "no CUDA device" in proc.stdout


def test_report_renders_a_table_from_results(tmp_path):
    import json

    import report

    folder = tmp_path / "nvidia-h100-test"
    folder.mkdir()
    base = {"device": "NVIDIA H100 TEST", "torch": "2.11", "triton": "3.6", "date": "2026-11-21 00:00 UTC"}
    (folder / "gemm.json").write_text(json.dumps({**base, "fp16_square_ge2048_vs_cublas": 0.9, "rows": []}))
    text = report.render(tmp_path)
    assert "NVIDIA H100 TEST" in text and "0.9" in text
    assert report.render(tmp_path / "empty").startswith("No GPU results")


def test_distributed_smoke_runs_every_variant_on_two_gloo_ranks():
    import bench_distributed

    res = bench_distributed.main(["--smoke"])
    by = {r["impl"]: r for r in res.rows}
    assert set(by) == {bench_distributed.TKERN, bench_distributed.DDP, bench_distributed.ZERO1}
    assert all(r["ms"] > 0 and r["world"] == 2 for r in res.rows)
    # AdamW on fp16 params: 2 + 2 + 12 / W B/param sharded, 16 unsharded (the same padding for both)
    assert by[bench_distributed.TKERN]["bytes_per_param"] / by[bench_distributed.DDP]["bytes_per_param"] == (
        pytest.approx(10 / 16, rel=1e-3)
    )
