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
