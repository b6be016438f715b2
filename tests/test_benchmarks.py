"""The benchmark scripts run (tiny sizes, --smoke) on any machine, so a GPU
session only has to run them; without a GPU and --smoke they exit cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import tkern

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
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_gemm.py")], capture_output=True, text=True, timeout=300
    )
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


def test_report_reads_the_ceilings_and_lists_failures_and_skips_non_device_folders(tmp_path):
    import json

    import report

    folder = tmp_path / "nvidia-h100-test"
    folder.mkdir()
    base = {"device": "NVIDIA H100 TEST", "torch": "2.11", "triton": "3.6", "date": "2026-11-21 00:00 UTC"}
    (folder / "ceilings.json").write_text(json.dumps({**base, "copy_gbps": 3020.0, "rows": []}))
    failure = {"case": "10M", "impl": "(d) compiled (c)", "error": "IndexError: list index out of range"}
    (folder / "optimizer.json").write_text(json.dumps({**base, "failed": [failure], "rows": []}))
    (tmp_path / "host").mkdir()  # CPU host-cost results: not a device's table
    (tmp_path / "host" / "host.json").write_text(json.dumps({**base, "device": "cpu", "rows": []}))
    text = report.render(tmp_path)
    assert "| device copy bandwidth, GB/s (read + write) | 3020.0 | ceiling |" in text
    assert "(d) compiled (c)" in text and "IndexError" in text
    assert "**cpu**" not in text


def test_master_recipe_matches_torch_adamw_and_skips_overflow():
    """The by-hand recipe (c)/(d) is AdamW: same master as torch.optim.AdamW over
    three steps (fp32; the two differ only in the order of a few roundings, so
    within a few ulps: rtol 1e-6), the fp16 model the master rounded, and a step
    with an inf gradient leaves everything untouched."""
    import bench_optimizer as bo

    torch.manual_seed(0)
    step = bo.master_by_hand([33, 7], torch.device("cpu"))
    cells = step.tensors
    model, master = cells["model"], cells["master"]
    ref = [m.clone().requires_grad_() for m in master]
    ref_opt = torch.optim.AdamW(ref, lr=bo.LR, betas=bo.BETAS, eps=bo.EPS, weight_decay=bo.WEIGHT_DECAY)
    for _ in range(3):
        step()
        for r, g in zip(ref, cells["grads16"], strict=True):
            r.grad = g.float() * 2.0**-16
        ref_opt.step()
    for m, r, p in zip(master, ref, model, strict=True):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=0)
        assert torch.equal(p, m.half())
    before = [m.clone() for m in master]
    cells["grads16"][1][3] = float("inf")
    step()
    assert all(torch.equal(m, b) for m, b in zip(master, before, strict=True))
    assert cells["count"].item() == 3


def test_host_smoke_times_tkern_with_stubs_and_torch():
    import bench_host

    res = bench_host.main(["--smoke"])
    impls = {r["impl"] for r in res.rows}
    assert {"tkern FusedAdamW.step", "torch AdamW(foreach=True).step", "tkern.linear", "F.linear"} <= impls
    assert bench_host.INTO_FLAT in impls  # the training path: .backward() into the flat buffer
    assert all(r["us"] > 0 for r in res.rows)
    # the stubbed rows count their launches (a GPU run adds "(launches on)" rows that do not)
    assert all(r["launches"] >= 1 for r in res.rows if "launches" in r)
    assert any("launches" in r for r in res.rows if r["impl"].startswith("tkern"))
    assert res.meta["linear_fwd_us"] > 0 and res.meta["linear_bwd_us"] > 0
    # tkern's own time is its time minus the floor row's, which is measured beside it
    floor = {r["case"].split()[1]: r["us"] for r in res.rows if r["impl"] == bench_host.FLOOR}
    assert res.meta["linear_fwd_own_us"] == round(res.meta["linear_fwd_us"] - floor["forward"], 2)
    assert res.meta["linear_bwd_own_us"] == round(res.meta["linear_bwd_us"] - floor["backward"], 2)


def test_stubbed_launches_run_no_kernel_and_are_restored():
    """Inside the stubs a step launches nothing (the params stay as they were, the
    launches are counted); after them a step updates the params again. (A stubbed
    optimizer's device state, e.g. its step count, is left garbage: timing only.)"""
    import bench_host

    def param_and_opt():
        p = torch.zeros(40, dtype=torch.float16, device=DEVICE, requires_grad=True)
        opt = tkern.optim.FusedAdamW([p], lr=0.1)
        p.grad = torch.ones_like(p)
        return p, opt

    p, opt = param_and_opt()
    with bench_host.stubbed_launches() as launches:
        opt.step()
    assert torch.equal(p.detach(), torch.zeros_like(p)) and sum(launches.values()) >= 2
    assert set(launches) <= set(bench_host.tkern_kernels())
    p, opt = param_and_opt()
    opt.step()
    assert (p.detach() < 0).all()  # AdamW's first step moves each param by ~ -lr


def test_host_cases_with_launches_on_run_for_real():
    """The rows a GPU run adds (tkern with its real launches) work: here through the
    interpreter, once each, checked against the stub-free result of torch."""
    import bench_host

    cpu = torch.device(DEVICE)  # the interpreter here, compiled kernels on a GPU
    step = bench_host.optimizer_cases(4, cpu, launches_on=True)["tkern FusedAdamW.step (launches on)"][0]
    step()
    torch.manual_seed(0)
    fwd, bwd, stubbed = bench_host.linear_cases(cpu, launches_on=True)["tkern.linear (launches on)"]
    torch.manual_seed(0)  # the same x, weight, bias, dy
    ref_fwd, ref_bwd, _ = bench_host.linear_cases(cpu, launches_on=False)["F.linear"]
    assert not stubbed
    # fp16 results of K <= 64 sums of O(1) terms: one fp16 rounding each (u = 2^-11) on values
    # up to ~30, so atol 2e-2 plus rtol 2e-3 covers both sides' roundings
    torch.testing.assert_close(fwd().float(), ref_fwd().float(), rtol=2e-3, atol=2e-2)
    for got, ref in zip(bwd(), ref_bwd(), strict=True):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-2)


def test_distributed_smoke_runs_every_variant_on_two_gloo_ranks():
    import bench_distributed

    res = bench_distributed.main(["--smoke"])
    by = {r["impl"]: r for r in res.rows}
    bd = bench_distributed
    assert set(by) == {bd.TKERN, bd.DDP, bd.ZERO1, *bd.TRAINING}
    assert all(r["ms"] > 0 and r["world"] == 2 for r in res.rows)
    # whole training steps: the overlap changes when the gradients are reduced, not their bits
    assert by[bd.ZERO2_OVERLAP]["bit_identical_to_no_overlap"] is True
    # per rank, bf16 params: ZeRO-2 2 + 2 + 12 / 2 = 10 B/param; FSDP2 + tkern (2 + 2 + 2 + 12) / 2 = 9
    # (FSDP2's shard, the flat buffer's copy, the grad, master and moments); FSDP2 + torch's AdamW on fp32
    # params (4 + 4 + 8) / 2 = 8. Padding (16 elements per param and per buffer) is < 1% at 64 x 64.
    assert by[bd.ZERO2_OVERLAP]["bytes_per_param"] == pytest.approx(10, rel=0.01)
    assert by[bd.FSDP2_TKERN]["bytes_per_param"] == pytest.approx(9, rel=0.01)
    assert by[bd.FSDP2_TORCH]["bytes_per_param"] == pytest.approx(8, rel=0.01)
    # AdamW on fp16 params: 2 + 2 + 12 / W B/param sharded, 16 unsharded (the same padding for both)
    assert by[bench_distributed.TKERN]["bytes_per_param"] / by[bench_distributed.DDP]["bytes_per_param"] == (
        pytest.approx(10 / 16, rel=1e-3)
    )


def test_memory_smoke_trains_every_tkern_mode():
    """bench_memory.py (issue 18): three steps of each tkern memory mode on its GPT-2, each
    reporting the bytes per param memory_report() gives and a finite held-out loss."""
    pytest.importorskip("transformers")
    import bench_memory

    result = bench_memory.main(["--smoke", "--only", "tkern"])
    rows = {r["run"]: r for r in result["rows"]}
    assert len(rows) == 7  # six modes and the noise-floor control
    assert rows["tkern AdamW, fp32 master"]["bytes_per_param"] == 16.0
    assert rows["tkern AdamW, split master"]["bytes_per_param"] == 14.0
    assert all(r["final_loss"] < r["first_loss"] + 1.0 for r in rows.values())
