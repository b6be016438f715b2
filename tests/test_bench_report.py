"""report.py / report_summary.py on issue 43's measures: the targets waiting for a GPU
measurement until a run writes them, and every speed figure a ratio against the best peer
of the same run with tkern's MFU beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402

GPT2 = report.summary.GPT2
LAYOUTS = report.summary.GEMM_LAYOUTS


def _write(folder: Path, stem: str, **payload) -> None:
    folder.mkdir(exist_ok=True)
    base = {"device": "NVIDIA H200 TEST", "torch": "2.13", "triton": "3.9", "date": "2026-11-28 00:00 UTC"}
    (folder / f"{stem}.json").write_text(json.dumps({**base, "rows": [], **payload}))


def _targets(text: str) -> dict[str, str]:
    """label -> the rest of its row in a TARGETS.md table."""
    return {
        line.split(" | ")[0][2:]: line
        for line in text.splitlines()
        if line.startswith("| ") and " | " in line
    }


def test_issue_43_targets_wait_for_a_gpu_measurement_and_are_judged_once_measured(tmp_path):
    gpu = tmp_path / "nvidia-h200-test"
    _write(gpu, "gemm", commit="abc1234")  # a GPU run that measured none of them
    rows = _targets(report.render_targets(tmp_path))
    bounds = {
        "fp8 tensorwise training step, GPT-2 small / torchao Float8Linear compiled": ">= 1.1",
        "fp8 tensorwise training step, GPT-2 small / bf16 autocast": ">= 1.6",
        **{f"fp8 scaled_mm {s} / bf16 cuBLAS, {lay} layout": ">= 1.5" for s in ("tensorwise", "rowwise")
           for lay in LAYOUTS},
        **{f"fp8 scaled_mm blockwise / bf16 cuBLAS, {lay} layout": ">= 1.3" for lay in LAYOUTS},
    }  # fmt: skip
    for label, bound in bounds.items():
        assert rows[label] == f"| {label} |  | {bound} | waiting for a GPU measurement |  |", label
    # measured: judged against the bound, with the run it came from
    _write(gpu, "train", commit="def5678", **{f"{GPT2}: fp8 tensorwise vs torchao float8": 1.05,
                                              f"{GPT2}: fp8 tensorwise vs autocast bf16": 1.7})  # fmt: skip
    rows = _targets(report.render_targets(tmp_path))
    torchao = "fp8 tensorwise training step, GPT-2 small / torchao Float8Linear compiled"
    assert rows[torchao].startswith(f"| {torchao} | 1.05 | >= 1.1 | missed | 2026-11-28")
    bf16 = "fp8 tensorwise training step, GPT-2 small / bf16 autocast"
    assert rows[bf16].startswith(f"| {bf16} | 1.7 | >= 1.6 | met |")
    # the CPU folder's targets are "not measured" there, not waiting for a GPU
    assert "waiting for a GPU measurement" not in report.render_targets(tmp_path).split("## host")[1]


def test_summary_compares_an_fp8_layout_gemm_with_its_best_peer_across_cases_with_its_mfu(tmp_path):
    gpu = tmp_path / "nvidia-h200-test"
    shape = "16384x2304x768"
    _write(gpu, "gemm", commit="abc1234", rows=[
        {"case": f"fp8 layout bf16 fwd gpt2 qkv {shape}", "impl": "torch bf16", "ms": 1.2, "mfu": 0.6},
        {"case": f"fp8 tensorwise fwd gpt2 qkv {shape}", "impl": "tkern", "ms": 0.5, "mfu": 0.72},
        {"case": f"fp8 tensorwise fwd gpt2 qkv {shape}", "impl": "torch fast accum", "ms": 0.6, "mfu": 0.6},
    ])  # fmt: skip
    _write(gpu, "train", commit="abc1234", rows=[
        {"case": GPT2, "impl": "tkern fp8 tensorwise", "ms": 100.0, "mfu": 0.45},
        {"case": GPT2, "impl": "torch autocast bf16", "ms": 180.0, "mfu": 0.25},
        {"case": GPT2, "impl": "torch autocast bf16 compiled", "ms": 150.0, "mfu": 0.3},
    ])  # fmt: skip
    text = report.render_summary(tmp_path)
    label = "fp8 GEMM in training, tensorwise scales, fwd (Float8Linear's operands and accumulation)"
    # the best peer is torch's fp8 GEMM (0.6 ms), not bf16 cuBLAS in its own case (1.2 ms)
    assert f"| {label} | **ahead, 1.20x** | torch's fp8 GEMM, fast accumulation | 72.0% |" in text
    # the fp8 step against its fastest peer, compiled bf16 autocast
    assert "| fp8 tensorwise training step, GPT-2 small | **ahead, 1.50x** |" in text
    assert "| 45.0% | abc1234 |" in text
    # a measure no run made is listed as such, never with a figure
    assert "Not measured on this device:" in text and "fp8 GEMM in training, blockwise scales, wgrad" in text


def test_mx_targets_wait_for_a_blackwell_measurement_and_name_bench_trains_llama_case(tmp_path):
    """Issue 53's targets: on a GPU folder that measured none of them (an H200, where the MX
    rows are refused) they wait for a Blackwell run, not any GPU; the Llama case they read is
    bench_train's own; once measured they are judged."""
    import bench_models

    assert report.summary.LLAMA in bench_models.case_names(smoke=False)
    gpu = tmp_path / "nvidia-h200-test"
    _write(gpu, "gemm", commit="abc1234")
    rows = _targets(report.render_targets(tmp_path))
    llama = "MXFP8 training step, Llama-like / torchao's MXFP8 recipe compiled"
    labels = [f"MXFP8 scaled_mm / bf16 cuBLAS, {lay} layout" for lay in LAYOUTS]
    for label, bound in [*((lab, ">= 1.8") for lab in labels), (llama, ">= 1.1")]:
        assert rows[label] == f"| {label} |  | {bound} | waiting for a Blackwell measurement |  |", label
    _write(gpu, "gemm", commit="abc1234", mx_fwd_vs_bf16=1.9)
    assert _targets(report.render_targets(tmp_path))[labels[0]].startswith(
        f"| {labels[0]} | 1.9 | >= 1.8 | met |"
    )
