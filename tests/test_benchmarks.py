"""The benchmark scripts run (tiny sizes, --smoke) on any machine, so a GPU
session only has to run them; without a GPU and --smoke they exit cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import tkern

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


def _missing(names: list[str]) -> list[str]:
    import harness

    return harness.missing_api(tkern, names)


#: gpu_check.sh quick's phases in order (issue 44 item 1: the GPU tests, the GPT-2 profile,
#: GPT-2's unmeasured rows, the GEMMs in three layouts, then the rows already known)
QUICK_PHASES = (
    "pytest_gpu",
    "bench_train_profile",
    "bench_train_gpt2",
    "bench_gemm_fp8_layouts",
    "bench_gemm_gpt2_layouts",
    "bench_optimizer_sizes",
    "bench_train_mlp",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``gpu_check.sh --dry-run`` once for this module: every phase at smoke sizes,
    results into a temporary folder, the report read from them alone."""
    out = tmp_path_factory.mktemp("gpu-out")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,  # the phases have their own caps; this bounds a hang on a loaded 2-core machine
    )
    return proc, out


def _rows(out, stem):
    payload = json.loads((out / "results" / "cpu" / f"{stem}.json").read_text())
    return payload, payload["rows"]


@pytest.mark.skipif(DEVICE == "cuda", reason="the dry run is the CPU's rehearsal of a GPU session")
def test_dry_run_passes_every_phase_and_writes_what_the_report_reads(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = (out / "summary.txt").read_text()
    quick = QUICK_PHASES
    more = (
        "pytest_grid",
        "bench_optimizer_grid",
        "bench_train_fp8",
        "bench_gemm_rest",
        "bench_train_rest",
        "bench_gemm_linear",
        "bench_optimizer_modes",
        "bench_optimizer_health",
        "bench_norm",
    )
    rest = ("bench_loss", "ceilings", "bench_host", "gpt_job", "gpu_collection", "bench_activation_memory")
    for phase in (*quick, *more, *rest, "report"):
        assert f"{phase}: ok" in summary, summary
    # the language-model job's table (every run, bits per character against fp32's) and picture
    table = (out / "results" / "cpu" / "gpt_job.txt").read_text()
    assert all(f"\n{run} " in table for run in ("fp32", "autocast", "tkern", "tkern-bf16")), table
    assert (out / "results" / "cpu" / "gpt_job.png").is_file()
    # the GPT-2 profile: a CSV per recipe (its categories and total) and the picture
    profile = (out / "results" / "cpu" / "profile_tkern.csv").read_text()
    assert profile.startswith("kind,recipe,category") and "\ntotal,tkern," in profile
    assert (out / "results" / "cpu" / "profile.png").is_file()
    # the device brings back at most 8 files; the plan leaves at most 6 in $OUT
    assert len([f for f in out.iterdir() if f.is_file()]) <= 6, sorted(out.iterdir())
    for stem in ("ceilings", "host", "gemm", "optimizer", "train", "norm", "loss"):
        payload, rows = _rows(out, stem)
        assert payload["commit"] and payload["commit"] != "unknown" and payload["date"]
        if stem != "ceilings":
            assert rows and all(r["ms"] is None or r["ms"] > 0 for r in rows), stem
            assert all(r["ms"] is not None or r.get("skipped") for r in rows), stem  # untimed rows say why
    # the report regenerated the README table (between its markers) and the targets list
    readme = (out / "README.md").read_text()
    table = readme.split("<!-- results-table:start -->")[1].split("<!-- results-table:end -->")[0]
    assert "Targets:" in table and "waiting for a GPU measurement" in table
    targets = (out / "results" / "TARGETS.md").read_text()
    assert "| measure | value | target | status | run |" in targets and "## cpu" in targets


@pytest.mark.skipif(DEVICE == "cuda", reason="the dry run is the CPU's rehearsal of a GPU session")
def test_dry_run_collects_the_suite_as_a_gpu_machine_would_and_nothing_needs_the_cpu(dry_run):
    """The dry run's gpu_collection phase (the whole suite collected with CUDA faked,
    tests/gpu_collection.py): every test that needs the CPU skips there, the recorder's and
    the compile gate's among them (the suite's one collection of itself)."""
    import gpu_collection

    _, out = dry_run
    log = (out / "pytest_gpu.log").read_text().splitlines()
    gpu_collection.check_the_suite_on_a_gpu_machine(gpu_collection.classified(log))


@pytest.mark.skipif(DEVICE == "cuda", reason="the dry run is the CPU's rehearsal of a GPU session")
def test_dry_run_fp8_gemm_rows_cover_every_format_and_scaling(dry_run):
    import bench_gemm

    _, out = dry_run
    _, rows = _rows(out, "gemm")
    mine = {(r["fmt"], r["scaling"]) for r in rows if r["impl"] == "tkern" and "fmt" in r and r["ms"]}
    assert mine == {(f, s) for f in bench_gemm.FP8_FORMATS for s in bench_gemm.FP8_SCALINGS}
    # torch's tensorwise and rowwise fp8 GEMMs run on a CPU too; its blockwise one says why not
    theirs = {(r["fmt"], r["scaling"]): r for r in rows if r["impl"] == "torch" and "fmt" in r}
    assert all(theirs[(f, s)]["ms"] for f in bench_gemm.FP8_FORMATS for s in ("tensorwise", "rowwise"))
    assert all(r["ms"] or r["skipped"] for r in theirs.values())
    # every fp8 row says how it accumulates; torch's fast-accumulation peer of tkern's
    # tensorwise and rowwise rows (tl.dot's fp8 default on sm_90) runs beside its precise one
    fp8 = [r for r in rows if "fmt" in r]
    assert all(
        r["accum"] == ("precise" if r["scaling"] == "blockwise" else "fast")
        for r in fp8
        if r["impl"] == "tkern"
    )
    fast = {(r["fmt"], r["scaling"]) for r in fp8 if r["impl"] == "torch fast accum" and r["ms"]}
    assert fast == {(f, s) for f in bench_gemm.FP8_FORMATS for s in ("tensorwise", "rowwise")}
    assert all(r["accum"] == "precise" for r in theirs.values())


@pytest.mark.skipif(DEVICE == "cuda", reason="the dry run is the CPU's rehearsal of a GPU session")
def test_dry_run_optimizer_rows_cover_every_memory_mode_and_record_the_graph(dry_run):
    import bench_optimizer as bo

    _, out = dry_run
    _, rows = _rows(out, "optimizer")
    modes = {
        (r["master"], r["state_dtype"]): r for r in rows if r["case"].startswith("modes") and "master" in r
    }
    assert set(modes) == {(m, s) for m in bo.MASTER_MODES for s in bo.STATE_DTYPES}
    for (master, state), r in modes.items():
        assert r["bytes_per_param"] == bo.floor_bytes_per_param(master, state) and r["vs_floor"] > 0
    assert {r["impl"] for r in rows} >= {"torchao AdamW8bit", "torchao _AdamW bf16 stochastic round"}
    tkern_rows = [r for r in rows if r["impl"].startswith("tkern")]
    # every tkern row says whether its step was graphed and, here on a CPU, why not
    assert all("cuda_graph" in r and r["graph_fallback"] and r["graph_replays"] == 0 for r in tkern_rows)
    # the health rows (issue 37 item 7): every variant, ms per step
    health = {r["impl"]: r for r in rows if r["case"].startswith("health ")}
    assert set(health) == set(bo.HEALTH_VARIANTS) and all(r["ms"] > 0 for r in health.values())
    eager = [r for r in rows if r["impl"] == "tkern eager (cuda_graph=False)"]
    assert eager and all(
        r["cuda_graph"] is False and r["graph_fallback"] == "cuda_graph=False" for r in eager
    )


@pytest.mark.skipif(DEVICE == "cuda", reason="the dry run is the CPU's rehearsal of a GPU session")
def test_dry_run_train_rows_cover_every_recipe_and_record_the_graph(dry_run):
    import bench_train

    _, out = dry_run
    _, rows = _rows(out, "train")
    mlp = {r["impl"]: r for r in rows if r["case"].startswith("mlp")}
    assert set(mlp) == set(bench_train.RECIPES) - set(bench_train.SMOKE_SKIPS)
    assert all(r["ms"] and r["peak_mib"] is not None for r in mlp.values())
    whole = mlp["tkern whole-step graph"]
    assert whole["cuda_graph"] is True and "cpu" in whole["graph_fallback"]  # on a CPU: eager, and why
    assert mlp["tkern opt eager"]["opt_cuda_graph"] is False
    gpt2 = {r["impl"]: r for r in rows if r["case"].startswith("gpt2")}
    assert set(gpt2) == set(bench_train.SMOKE_GPT2_RECIPES)
    # both fp8 recipes reach GPT-2's GEMMs (tkern's Conv1D, torchao's through conv1d_as_linear)
    assert gpt2["tkern fp8 tensorwise"]["fp8_layers"] >= 8
    assert gpt2["torchao float8 tensorwise compiled"]["fp8_layers"] >= 8


def test_dry_run_forked_phases_end_as_their_own_processes_would(tmp_path):
    """The dry run forks its phases from one process that imported their modules once
    (benchmarks/dry_run_forks.py): a forked phase gets its argv and sys.path[0], its exit
    status, traceback, signal and ``timeout``'s cut reach gpu_check.sh as its own process's
    would, and a phase whose environment differs runs as its own process."""
    fork = [sys.executable, str(BENCH / "dry_run_forks.py")]
    sock = tmp_path / "sock"
    server = subprocess.Popen([*fork, "serve", str(sock), "json"])
    try:
        for _ in range(400):
            if sock.exists():
                break
            time.sleep(0.05)

        def run(*argv, env=None, cap=None):
            cmd = [*fork, "run", str(sock), "--", *argv]
            cmd = ["timeout", str(cap), *cmd] if cap else cmd
            return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

        script = tmp_path / "phase.py"
        script.write_text(
            "import os, sys\nprint(sys.argv[1:], os.getppid(), sys.path[0])\nsys.exit(int(sys.argv[1]))\n"
        )
        ok = run(str(script), "0")
        assert ok.returncode == 0 and ok.stdout.split() == ["['0']", str(server.pid), str(tmp_path)], ok
        assert run(str(script), "3").returncode == 3
        crash = run("-c", "1/0")
        assert crash.returncode == 1 and "ZeroDivisionError" in crash.stderr
        assert run("-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == 128 + 9
        pid_file = tmp_path / "pid"
        sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        cut = run("-c", sleeper, cap=2)
        assert cut.returncode == 124
        pid = int(pid_file.read_text())
        for _ in range(100):  # the cut phase is ended (and reaped by the server), not left running
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists()
        own = run("-c", "import os; print(os.getppid())", env={**os.environ, "TKERN_AUTOTUNE": "0"})
        assert own.returncode == 0 and own.stdout.split() != [str(server.pid)], own
        assert "process of its own" in own.stderr
        assert server.poll() is None  # one server for every phase
    finally:
        server.kill()
        server.wait()


def test_gpu_check_plan_puts_the_unknowns_first():
    """Issue 44 item 1: the first call's order is the GPU tests, the GPT-2 profile,
    GPT-2's compiled autocast and tkern bf16 rows, the GEMMs in three layouts, and only
    then the optimizer and MLP rows."""
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "plan", "quick"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    phases = [line.split()[0] for line in proc.stdout.splitlines() if " cap " in line]
    assert tuple(phases) == QUICK_PHASES
    gpt2 = next(line for line in proc.stdout.splitlines() if line.startswith("bench_train_gpt2"))
    assert "=torch autocast compiled" in gpt2 and "=tkern bf16" in gpt2
    caps = [int(line.split(" cap ")[1].split("s")[0]) for line in proc.stdout.splitlines() if " cap " in line]
    assert sum(caps[:5]) <= 420  # the unknowns fit the first call's budget
    profile = next(line for line in proc.stdout.splitlines() if line.startswith("bench_train_profile"))
    assert all(f"={r}" in profile for r in ("tkern", "torch autocast compiled", "tkern fp8 tensorwise"))
    assert all("--shapes gpt2" in line and "--layouts fwd,dgrad,wgrad" in line
               for line in proc.stdout.splitlines() if line.startswith("bench_gemm_"))  # fmt: skip
    # the second call has the rest: the fp8 step's peers, the GPT job, memory modes, norms, losses, health
    more = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "plan", "more"], capture_output=True, text=True, timeout=60
    ).stdout
    for phase in ("bench_train_fp8", "gpt_job", "bench_train_rest", "bench_optimizer_modes", "bench_norm",
                  "bench_loss", "bench_optimizer_health"):  # fmt: skip
        assert f"\n{phase} " in f"\n{more}", phase
    fp8 = next(line for line in more.splitlines() if line.startswith("bench_train_fp8"))
    assert "=torch autocast bf16 compiled" in fp8 and "torchao" in fp8


def test_conv1d_as_linear_computes_the_same_gpt2():
    """torchao's fp8 recipe converts only nn.Linear: GPT-2's Conv1D layers become
    Linears with the transposed weight, the same function exactly (the same
    products and sums: x @ W and x @ (W^T)^T)."""
    pytest.importorskip("transformers")
    import bench_train

    torch.manual_seed(0)
    model = bench_train.GPT2LM(bench_train.GPT2_SMOKE)
    ids = torch.randint(0, bench_train.GPT2_SMOKE["vocab_size"], (2, 16))
    ref = model(ids)
    converted = bench_train.conv1d_as_linear(model)
    assert not [m for m in converted.modules() if type(m).__name__ == "Conv1D"]
    torch.testing.assert_close(converted(ids), ref, rtol=0, atol=0)


@pytest.mark.parametrize("model", ["GPT2LM", "LlamaLM"])
def test_tkern_lm_recipes_train_on_the_fused_loss_the_quantity_of_lm_loss(model):
    """The tkern recipes call the converted LM in its fused_loss mode (the model's own loss by
    tkern.linear_cross_entropy, no logits): it is lm_loss's quantity, the mean next-token
    cross entropy over the seq - 1 predicted positions of each row, for the same fp16 weights
    (the two differ by the fp16 rounding of the logits lm_loss reads: a few 2^-11 relative of
    the loss, within 1e-3; the fp32 model's loss as near: its weights rounded to fp16); the
    torch recipes keep the logits and lm_loss."""
    pytest.importorskip("transformers")
    import bench_train

    cls = getattr(bench_train, model)
    config = bench_train.GPT2_SMOKE if model == "GPT2LM" else bench_train.LLAMA_SMOKE
    torch.manual_seed(0)
    base = cls(config).to(DEVICE)
    ids = torch.randint(0, config["vocab_size"], (2, 16), device=DEVICE)
    device, vocab = torch.device(DEVICE), config["vocab_size"]
    assert bench_train.RECIPES["torch autocast"](base, device, True).model(ids).shape == (2, 16, vocab)
    tk = bench_train.RECIPES["tkern"](base, device, True).model
    with torch.no_grad():
        fp32 = bench_train.lm_loss(base(ids), ids)
        fused = tk(ids)
        assert fused.shape == ()
        assert bench_train.lm_loss(fused, ids) is fused  # the Trainer's loss_fn passes it through
        tk.fused_loss = False
        logits = tk(ids)
        eager = bench_train.lm_loss(logits, ids)
        unshifted = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    torch.testing.assert_close(fused, eager, rtol=1e-3, atol=0)
    torch.testing.assert_close(fused, fp32, rtol=1e-3, atol=0)  # and the fp32 model's, fp16 weights aside
    assert abs(fused - unshifted) > 1e-2, (fused, unshifted)  # a loss without the shift fails
    # a Trainer step at the scaler's first 2^16 (the head's wgrad into the flat buffer, scaled in
    # fp32: 2^16 is no fp16 number) is clean, as the eager loss's step is
    built = bench_train.RECIPES["tkern"](base, device, True)
    bench_train.trainer_for(built, bench_train.lm_loss).train_step([(ids, ids)])
    assert built.scaler.get_scale() == 2.0**16 and built.scaler.skipped_steps == 0


@pytest.mark.skipif(DEVICE == "cuda", reason="the smoke path is the CPU's rehearsal of the GPU rows")
def test_gemm_layouts_smoke_times_every_layout_and_the_report_reads_them(tmp_path):
    """bench_gemm --layouts/--shapes (the flags gpu_check.sh calls): every training layout
    in 16 bits (with its plan) and in fp8 for every scaling; the odd vocabulary's rows, and
    the summary keys report.py's targets read."""
    import bench_gemm
    import bench_gemm_layouts
    import report

    res = bench_gemm.main(
        ["--smoke", "--layouts", "fwd,dgrad,wgrad", "--shapes", "gpt2", "--out", str(tmp_path)]
    )
    rows = [r for r in res.rows if r.get("model") == "gpt2"]
    half = {(r["layout"], r["layer"]) for r in rows if r["case"].startswith("fp16 ") and r["impl"] == "tkern"}
    layers = [name for name, *_ in bench_gemm_layouts.SMOKE_SHAPES[1]]
    assert half >= {(layout, layer) for layout in bench_gemm_layouts.LAYOUTS for layer in layers}
    assert all(
        r["ms"] and "plan" in r for r in rows if r["case"].startswith("fp16 ") and r["impl"] == "tkern"
    )
    fp8 = {
        (r["layout"], r["scaling"])
        for r in rows
        if r["case"].startswith("fp8 ") and r["impl"] == "tkern" and r["ms"]
    }
    assert fp8 == {(layout, s) for layout in bench_gemm_layouts.LAYOUTS for s in bench_gemm.FP8_SCALINGS}
    # the blockwise rows run on gemm_blockwise.py's kernel, except where K (101: dgrad over
    # the odd layer's outputs) leaves no tensor descriptor: the pointer kernel
    for r in rows:
        if r["case"].startswith("fp8 blockwise ") and r["impl"] == "tkern":
            k = int(r["case"].rsplit("x", 1)[1])
            assert r["kernel"] == ("blockwise" if k % 16 == 0 else "pointer"), r
    assert not res.meta["failed"]
    assert all(r["ms"] is not None or r.get("skipped") for r in rows)
    # issue 43: each fp8 GEMM with Float8Linear's accumulation (forward fast, gradients
    # promoted), its error against the float64 product of its own fp8 operands, its MFU
    from tkern.ops.float8 import FORWARD_FAST_ACCUM, GRADIENT_FAST_ACCUM

    fast = {"fwd": FORWARD_FAST_ACCUM, "dgrad": GRADIENT_FAST_ACCUM, "wgrad": GRADIENT_FAST_ACCUM}
    for r in rows:
        if r["case"].startswith("fp8 ") and r["impl"] == "tkern":
            assert r["use_fast_accum"] is fast[r["layout"]], r
            assert r["accum"] == ("fast" if fast[r["layout"]] and r["scaling"] != "blockwise" else "precise")
            assert 0 < r["rel_err"] < bench_gemm.FP8_TOL, r
            assert r["mfu"] is None  # a CPU has no peak to measure against
    keys = {t.names()[0] for t in report.TARGETS if t.stem == "gemm"}
    layout_keys = {f"fp16_{layout}_gpt2_vs_cublas" for layout in bench_gemm_layouts.LAYOUTS}
    layout_keys |= {
        f"fp8_{s}_{layout}_vs_bf16" for layout in bench_gemm_layouts.LAYOUTS for s in bench_gemm.FP8_SCALINGS
    }
    assert layout_keys <= keys & set(res.meta)  # the report's targets read what the run wrote
    saved = json.loads((tmp_path / "gemm.json").read_text())
    assert {r["case"] for r in saved["rows"]} >= {r["case"] for r in rows}


@pytest.mark.parametrize("name", ["norm", "loss"])
def test_norm_and_loss_smoke_time_tkern(name):
    """bench_norm / bench_loss run their tkern rows once tkern has the issue-28 API;
    until then the rows say which names are missing (and this test is skipped)."""
    needs = {
        "norm": ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"],
        "loss": ["cross_entropy", "linear_cross_entropy"],
    }[name]
    module = __import__(f"bench_{name}")
    missing = _missing(needs)
    if missing:
        pytest.skip(f"not in this tkern yet (issue 28): {', '.join(missing)}")
    res = module.main(["--smoke"])
    mine = [r for r in res.rows if r["impl"] == "tkern"]
    assert mine and all(r["ms"] and r["ms"] > 0 for r in mine)
    assert not [f for f in res.meta["failed"] if f["impl"] == "tkern"]


def test_activation_memory_smoke_counts_saved_bytes_and_the_largest_tensor(tmp_path):
    """Autocast's and tkern's GEMMs-only rows always run; the fused-loss and norms rows
    (and their targets) once convert_network takes fused_loss= and norms=. Stubbed
    launches (how the full-size run avoids an hour of interpreter) allocate and save
    exactly what real ones do: checked at --tiny (the smoke's code paths, a seventh of its
    rows through the interpreter), so the smoke's figures and targets come from stubbed
    launches as the full-size run's do."""
    pytest.importorskip("transformers")
    import bench_activation_memory as bam

    res = bam.main(["--smoke", "--launches", "stubbed", "--out", str(tmp_path)])
    rows = {r["impl"]: r for r in res.rows}
    auto = rows[bam.AUTOCAST]
    # the unfused loss makes the fp32 logits (HF's logits.float()): the largest tensor
    assert auto["largest / fp32 logits"] == 1.0 and auto["norms MiB"] > 0
    assert auto["saved MiB"] == pytest.approx(sum(auto[f"{c} MiB"] for c in bam.CATEGORIES), abs=0.01)
    assert (tmp_path / "activation_memory.md").read_text().count("| torch autocast |") == 1
    real = {r["impl"]: r for r in bam.main(["--tiny", "--launches", "real"]).rows}
    stubbed = {r["impl"]: r for r in bam.main(["--tiny", "--launches", "stubbed"]).rows}
    run_fields = ("loss", "date", "commit")  # what differs between two runs of the same code
    assert set(real) == set(stubbed) == set(rows)
    for recipe, row in real.items():
        assert {k: v for k, v in row.items() if k not in run_fields} == {
            k: v for k, v in stubbed[recipe].items() if k not in run_fields
        }, recipe
    if bam.missing_keywords({"fused_loss": True}):
        pytest.skip("convert_network has no fused_loss= yet (issue 28)")
    assert res.meta["loss_largest_vs_fp32_logits"] <= bam.TARGETS["loss_largest_vs_fp32_logits"]
    if bam.missing_keywords({"norms": True}):
        assert rows[bam.NORMS]["skipped"].startswith("not available")
        pytest.skip("convert_network has no norms= yet (issue 28)")
    assert res.meta["norms_saved_vs_autocast"] <= bam.TARGETS["norms_saved_vs_autocast"]


def test_the_largest_tensor_leaves_out_parameter_shapes_but_not_their_transposes():
    """A parameter's gradient or cast (its shape) is every recipe's and left out; a tensor
    shaped like its transpose is the step's own memory: a loss chunk of H rows makes (H, V)
    fp32 logits, the (V, H) head's transposed shape, which the mode once left out too."""
    import bench_activation_memory as bam

    head = torch.zeros(64, 8)  # (V, H)
    with bam.LargestTensor([head]) as mode:
        torch.zeros(64, 8, dtype=torch.float64)  # the head's shape: left out, whatever its bytes
        chunk = torch.zeros(8, 64)  # (H, V): counted
        chunk.t().contiguous()  # a new storage of the head's shape: left out
        chunk.add_(1)  # in place: no new tensor
    assert mode.nbytes == 8 * 64 * 4 and mode.what.startswith("zeros") and "(8, 64)" in mode.what


def test_floor_bytes_per_param_of_each_memory_mode():
    """The byte floors NOTES.md tabulates: DESIGN.md's 30 B/param for fp32 master and
    moments; 28 split; 8-bit moments 2 B each way plus an fp32 absmax per 256 values."""
    import bench_optimizer as bo

    absmax = 2 * 2 * 4 / 256  # two moments, read and written, 4 B per block of 256
    assert bo.floor_bytes_per_param("fp32", "fp32") == 30
    assert bo.floor_bytes_per_param("split", "fp32") == 28
    assert bo.floor_bytes_per_param("none", "bf16") == 16
    assert bo.floor_bytes_per_param("fp32", "uint8") == 18 + absmax
    assert bo.floor_bytes_per_param("none", "uint8") == 12 + absmax


class _StandInRunner:
    """A CUDA-graph seam (tkern.graphs.GraphCapture) that runs the step on warm-up,
    on capture and on every replay."""

    device_type = DEVICE

    def blocker(self, device):
        return None

    def warmup(self, fn):
        return fn()

    def capture(self, fn):
        return fn, fn()


def test_graph_count_counts_captures_and_replays_through_the_seam():
    import harness

    p = torch.zeros(64, dtype=torch.float16, device=DEVICE, requires_grad=True)
    opt = tkern.optim.FusedAdamW([p], lr=1e-3)
    opt.graph_runner = _StandInRunner()
    count = harness.GraphCount(opt)
    assert opt.graph_runner is count
    p.grad = torch.ones_like(p)
    for _ in range(8):  # warm-ups, then one capture, then replays
        opt.step()
    fields = harness.graph_fields(opt, count)
    assert fields["graph_fallback"] is None and fields["graph_captures"] == 1
    assert 1 <= fields["graph_replays"] == count.replays < 8


def test_commit_comes_from_the_env_then_git_then_the_stamp_file(tmp_path, monkeypatch):
    import harness

    monkeypatch.setenv("TKERN_COMMIT", "abc1234")
    assert harness.commit() == "abc1234"
    monkeypatch.delenv("TKERN_COMMIT")
    stamp = tmp_path / ".tkern-commit"
    stamp.write_text("def5678+dirty\n")
    monkeypatch.setattr(harness, "COMMIT_FILE", stamp)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, capture_output=True, text=True)
    assert harness.commit().startswith(head.stdout.strip())  # a checkout: git, not a stale stamp
    monkeypatch.setattr(harness, "ROOT", tmp_path)  # a copy of the tree without .git, as on the device
    assert harness.commit() == "def5678+dirty"
    stamp.unlink()
    assert harness.commit() == "unknown"


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the script measures")
def test_without_gpu_the_script_says_so_and_exits_zero():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_gemm.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0
    assert "no CUDA device" in proc.stdout


def _write(folder, stem, **meta):
    folder.mkdir(exist_ok=True)
    base = {"device": "NVIDIA H100 TEST", "torch": "2.11", "triton": "3.6", "date": "2026-11-21 00:00 UTC"}
    (folder / f"{stem}.json").write_text(json.dumps({**base, "rows": [], **meta}))


def test_report_judges_each_target_and_names_the_run(tmp_path):
    import report

    gpu = tmp_path / "nvidia-h100-test"
    _write(gpu, "gemm", commit="abc1234", fp16_square_ge2048_vs_cublas=0.97, fp16_transformer_vs_cublas=0.7)
    _write(
        gpu, "optimizer", commit="abc1234", **{"1B_none_uint8_vs_floor": 1.05, "1B_fp32_fp32_vs_floor": 1.2}
    )
    text = report.render(tmp_path)
    assert "NVIDIA H100 TEST" in text and "commit abc1234" in text
    full = report.render_targets(tmp_path)
    assert "| GEMM fp16 / cuBLAS, squares >= 2048 (geomean) | 0.97 | >= 0.95 | met | 2026-11-21" in full
    assert "| GEMM fp16 / cuBLAS, transformer shapes (geomean) | 0.7 | >= 0.95 | missed |" in full
    assert "master=none state=uint8 at 1B: time / its byte floor | 1.05 | <= 1.1 | met" in full
    assert "master=fp32 state=fp32 at 1B: time / its byte floor | 1.2 | <= 1.1 | missed" in full
    fp8 = (
        "fp8 scaled_mm e4m3xe4m3 tensorwise / torch's fp8 GEMM, same accumulation (fast), transformer shapes"
    )
    assert f"| {fp8} |  | >= 0.95 | waiting for a GPU measurement |" in full  # never a figure made up
    # every target is listed once per folder it applies to
    gpu_targets = [t for t in report.TARGETS if "gpu" in t.where]
    section = full.split("## nvidia-h100-test")[1].split("## host")[0]
    assert section.count("\n| ") == len(gpu_targets) + 2  # + the header and its rule
    empty = report.render(tmp_path / "empty")
    assert (
        "No GPU run has been recorded yet." in empty and "- **(no GPU run)**: nothing measured yet" in empty
    )


def test_report_lists_failures_skips_non_device_folders_and_writes_between_the_markers(tmp_path):
    import report

    gpu = tmp_path / "nvidia-h100-test"
    _write(gpu, "ceilings", copy_gbps=3020.0)
    failure = {"case": "10M", "impl": "(d) compiled (c)", "error": "IndexError: list index out of range"}
    _write(gpu, "optimizer", failed=[failure])
    _write(tmp_path / "static", "triton-3.9.0")  # compiler facts: not a device's table
    _write(tmp_path / "host", "activation_memory", device="cpu", norms_saved_vs_autocast=0.52)
    text = report.render(tmp_path)
    full = report.render_targets(tmp_path)
    assert "| device copy bandwidth, GB/s (read + write) | 3020.0 |  | figure |" in full
    assert "(d) compiled (c)" in text and "IndexError" in text
    assert "static" not in text
    assert "| GPT-2 norm layers' saved bytes, tkern + norms / autocast | 0.52 | <= 0.55 | met |" in text
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results-table:start -->\nold\n<!-- results-table:end -->\nrest\n")
    report.main(["--write", "--results", str(tmp_path), "--readme", str(readme)])
    content = readme.read_text()
    assert "old" not in content and content.endswith("<!-- results-table:end -->\nrest\n")
    assert (tmp_path / "TARGETS.md").read_text().startswith("# Targets: met, missed, not measured")


def test_report_shows_a_graphed_row_that_never_replayed_as_fell_back_never_as_a_figure(tmp_path):
    """A graphed step that fell back to eager times the eager step: its ratios (1M
    against torch, graphed against eager, about 1.0x) are reported as "fell back:
    <reason>", never as a figure; a row that replayed keeps its figure."""
    import report

    gpu = tmp_path / "nvidia-h100-test"
    reason = "capturing the step failed (RuntimeError: operation not permitted); running eager"
    rows = [
        {"case": "1M", "impl": "tkern", "ms": 0.3, "cuda_graph": None, "graphed": True,
         "graph_fallback": reason, "graph_captures": 0, "graph_replays": 0},
        {"case": "1M", "impl": "tkern eager (cuda_graph=False)", "ms": 0.3, "cuda_graph": False,
         "graphed": False, "graph_fallback": "cuda_graph=False", "graph_captures": 0, "graph_replays": 0},
        {"case": "10M", "impl": "tkern", "ms": 0.1, "cuda_graph": None, "graphed": True,
         "graph_fallback": None, "graph_captures": 1, "graph_replays": 40},
        # a file from before rows said "graphed": the tkern row is read as meant to replay
        {"case": "1B", "impl": "tkern", "ms": 7.0, "cuda_graph": None, "graph_fallback": "x",
         "graph_captures": 0, "graph_replays": 0},
    ]  # fmt: skip
    meta = {"1M_vs_a": 1.1, "1M_graph_vs_eager": 1.0, "1M_vs_e": 0.5, "10M_vs_a": 1.3, "1B_vs_a": 1.6}
    _write(gpu, "optimizer", commit="abc1234", rows=rows, **meta)
    full = report.render_targets(tmp_path)
    at_1m = "optimizer + scaler step at 1M / GradScaler + AdamW(fused=True)"
    assert f"| {at_1m} |  | >= 1 | fell back: {reason} |" in full
    assert f"| graphed step / cuda_graph=False at 1M |  |  | fell back: {reason} |" in full
    assert "| tkern graphed / torch graphed capturable fused AdamW at 1M (both + their scaler) |  |" in full
    assert "| optimizer + scaler step at 10M / GradScaler + AdamW(fused=True) | 1.3 | >= 1 | met |" in full
    assert (
        "| optimizer + scaler step at 1B / GradScaler + AdamW(fused=True) |  | >= 1.5 | fell back: x |"
        in full
    )
    text = report.render(tmp_path)
    assert f"`bench_optimizer.py` 1M, tkern: fell back: {reason}" in text
    assert "1M, tkern eager" not in text  # eager by design: no fallback
    device_line = next(line for line in text.splitlines() if line.startswith("- **NVIDIA H100 TEST**"))
    assert "5 fell back" in device_line  # 1M: vs (a), vs eager, vs (e); 1B: vs (a), % copy
    summary = report.render_summary(tmp_path)  # the summary names the fallback, never a figure
    assert f"AdamW + loss-scaler step, 1M params (fell back: {reason})" in summary


def test_report_shows_tkern_graphed_against_torch_graphed_capturable_adamw(tmp_path):
    import report

    gpu = tmp_path / "nvidia-h100-test"
    rows = [{"case": "10M", "impl": "tkern", "ms": 0.1, "graphed": True, "graph_replays": 40}]
    _write(gpu, "optimizer", commit="abc1234", rows=rows, **{"10M_vs_e": 1.345})
    label = "tkern graphed / torch graphed capturable fused AdamW at 10M (both + their scaler)"
    assert f"| {label} | 1.345 |  | figure |" in report.render_targets(tmp_path)


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
    # the targets are ratios of two rows of this run (issue 55 item 5), tkern's over torch's
    us = {(r["case"], r["impl"]): r["us"] for r in res.rows}
    fwd = (
        us[bench_host.linear_case("forward"), "tkern.linear"]
        / us[bench_host.linear_case("forward"), "F.linear"]
    )
    assert res.meta["linear_fwd_vs_torch"] == round(fwd, 3)
    loop = bench_host.loop_case(bench_host.SMOKE_TENSOR_COUNTS[-1])
    ratio = us[loop, bench_host.LOOP_TKERN] / us[loop, bench_host.LOOP_TORCH]
    assert res.meta[f"step_loop_{bench_host.SMOKE_TENSOR_COUNTS[-1]}_vs_torch"] == round(ratio, 3)
    # and report.py reads each target bench_host sets, with its bound
    from report_targets import TARGETS

    host = {t.names()[0]: t.bound for t in TARGETS if t.stem == "host" and t.op}
    assert host == bench_host.TARGETS


def test_stubbed_launches_run_no_kernel_and_are_restored():
    """Inside the stubs a step launches nothing (the params stay as they were, the
    launches are counted); after them a step updates the params again. (A stubbed
    optimizer's device state, e.g. its step count, is left garbage: timing only.)"""
    import bench_host
    import harness

    def param_and_opt():
        p = torch.zeros(40, dtype=torch.float16, device=DEVICE, requires_grad=True)
        opt = tkern.optim.FusedAdamW([p], lr=0.1)
        # the two-pass step bench_host times at its sizes (40 params would take the one-pass
        # step, one launch: tests/test_optim_one_pass.py)
        opt.one_pass_max_elements = 0
        p.grad = torch.ones_like(p)
        return p, opt

    p, opt = param_and_opt()
    with bench_host.stubbed_launches() as launches:
        opt.step()
    assert torch.equal(p.detach(), torch.zeros_like(p)) and sum(launches.values()) >= 2
    assert set(launches) <= set(harness.tkern_kernels())
    p, opt = param_and_opt()
    opt.step()
    assert (p.detach() < 0).all()  # AdamW's first step moves each param by ~ -lr


def test_patched_launches_name_each_launch_pass_the_real_one_and_restore_on_error():
    """harness.patched_launches (under bench_host's stubs and the step ledger's counting):
    a getitem that forwards to ``real`` computes what the kernel computes, each launch is
    named by harness.kernel_names, and the classes' own ``__getitem__`` is back after the
    body, also when it raises."""
    import harness
    from triton.runtime.jit import KernelInterface

    kernels = harness.tkern_kernels()
    classes = {KernelInterface} | {type(k) for k in kernels.values()}
    before = {cls: cls.__dict__.get("__getitem__") for cls in classes}
    names = harness.kernel_names()
    seen = []

    def getitem(kernel, grid, real):
        seen.append(names[id(kernel)])
        return real(kernel, grid)

    a = torch.randn(16, 32, dtype=torch.float16, device=DEVICE)
    b = torch.randn(32, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(RuntimeError, match="the body failed"), harness.patched_launches(getitem):
        c = tkern.matmul(a, b)
        raise RuntimeError("the body failed")
    # fp32 accumulation, one rounding to fp16 at the end: within one fp16 ulp of the float64 product
    ref = a.double() @ b.double()
    torch.testing.assert_close(c.double(), ref, rtol=2**-10, atol=2**-10 * ref.abs().max().item())
    assert seen and set(seen) <= set(kernels) and any(name.startswith("gemm") for name in seen)
    assert {cls: cls.__dict__.get("__getitem__") for cls in classes} == before
    launches = len(seen)
    tkern.matmul(a, b)
    assert len(seen) == launches  # the patch is gone


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


def test_pictures_are_drawn_from_the_results_files_alone_at_most_1600_px_wide(tmp_path):
    """report.py --plots redraws every picture without a GPU: one per file, one
    question (speed against the baseline), the width capped."""
    pytest.importorskip("matplotlib")
    import plots
    import report
    from PIL import Image

    payload = {
        "device": "test",
        "torch": "t",
        "triton": "t",
        "date": "d",
        "rows": [
            {"case": "a", "impl": "torch autocast", "ms": 2.0},
            {"case": "a", "impl": "tkern", "ms": 1.0},
            {"case": "a", "impl": "tkern whole-step graph", "ms": 4.0},
            {"case": "b", "impl": "tkern", "ms": 1.0},  # no timed baseline: left out
        ],
    }
    cases, ratios, used, left_out = plots.speed_rows(payload, ("torch autocast",))
    assert cases == ["a"] and used == ["torch autocast"] and left_out == 1
    assert ratios == {"tkern": [2.0], "tkern whole-step graph": [0.5]}  # baseline ms / ms
    folder = tmp_path / "dev"
    folder.mkdir()
    (folder / "train.json").write_text(json.dumps(payload))
    drawn = report.redraw(tmp_path)
    assert drawn == [folder / "train.png"]
    for results in (tmp_path, BENCH / "results"):
        for png in results.glob("*/*.png"):
            assert max(Image.open(png).size) <= plots.MAX_PX, png


def _legend_and_axis(fig):
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    labels = [ax.xaxis.get_major_formatter()(t, k) for k, t in enumerate(ticks)]
    return legend, ticks, labels, list(ax.xaxis.get_minorticklocs())


def test_committed_pictures_name_every_baseline_as_the_tables_do_and_label_every_gridline():
    """Every picture of the committed results: at most 1600 px each way, every series
    and the baseline named as the README's tables name them (no bare results-file impl
    names such as "(e) (a) capturable, CUDA graph"), the speed axis labelled at every
    gridline (no unlabelled minor gridlines, at least three labels), 1.0x among them."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import plots

    checked = 0
    for source in sorted((BENCH / "results").glob("*/*.json")):
        payload = json.loads(source.read_text())
        for picture in plots.PICTURES.get(source.stem, ()):
            fig = plots.figure(payload, source.stem, picture)
            if fig is None:
                continue
            width, height = fig.get_size_inches() * plots.DPI
            assert width <= plots.MAX_PX and height <= plots.MAX_PX, (source, picture.name)
            legend, ticks, labels, minor = _legend_and_axis(fig)
            names = set(plots.NAMES.get(source.stem, {}).values()) | set(picture.names.values())
            baseline = [t for t in legend if t.startswith("baseline = 1.0x: ")]
            assert len(baseline) == 1, legend
            assert all(n in names for n in baseline[0].removeprefix("baseline = 1.0x: ").split("; ")), legend
            assert all(t in names for t in legend if t not in baseline), (source, picture.name, legend)
            assert not minor and len(ticks) >= 3 and all(labels) and "1x" in labels, (source, labels)
            plt.close(fig)
            checked += 1
    assert checked >= 6  # gemm, gemm_fp8, optimizer, train of the H200; the H100's three


def test_the_fp8_picture_compares_every_fp8_gemm_with_the_bf16_gemm_of_its_shape():
    """gemm_fp8.png: tkern's and torch's fp8 GEMMs, each against the bf16 GEMM timed in
    the case of the same shape (the ratio the table's "/ bf16 cuBLAS" figures average)."""
    import plots

    payload = {"rows": [
        {"case": "fp8 bf16 baseline 8x16x32", "impl": "torch bf16", "ms": 3.0},
        {"case": "fp8 e4m3xe4m3 tensorwise 8x16x32", "impl": "tkern", "ms": 2.0},
        {"case": "fp8 e4m3xe4m3 tensorwise 8x16x32", "impl": "torch", "ms": 1.5},
        {"case": "fp16 mm 8x16x32", "impl": "tkern", "ms": 1.0},  # the 16-bit picture's
    ]}  # fmt: skip
    fp8 = next(p for p in plots.PICTURES["gemm"] if p.name == "gemm_fp8")
    cases, ratios, used, left_out = plots.speed_rows(payload, fp8.baselines, fp8)
    assert cases == ["fp8 e4m3xe4m3 tensorwise 8x16x32"] and used == ["torch bf16"] and left_out == 0
    assert ratios == {"tkern": [1.5], "torch": [2.0]}
    assert plots.name_of("gemm", "torch", fp8) == "torch's fp8 GEMM, precise accumulation"


def test_summary_says_where_tkern_is_ahead_and_behind_the_best_peer_newest_device_first(tmp_path):
    """The README's summary, from the results files alone: per device (the newest run
    first), each measure as the best peer's ms over tkern's, with that peer's name, the
    commit and the date; a file without commits says so; never-measured measures in one line."""
    import report

    old, new = tmp_path / "nvidia-h100-test", tmp_path / "nvidia-h200-test"
    _write(old, "optimizer", rows=[
        {"case": "1B", "impl": "tkern", "ms": 4.0},
        {"case": "1B", "impl": "(a) GradScaler+AdamW fused", "ms": 6.0},
    ])  # fmt: skip
    _write(new, "optimizer", device="NVIDIA H200 TEST", date="2026-11-25 00:00 UTC", commit="abc1234", rows=[
        {"case": "1M", "impl": "tkern", "ms": 0.2, "graphed": True, "graph_replays": 9, "commit": "abc1234",
         "date": "2026-11-25 01:00 UTC"},
        {"case": "1M", "impl": "(a) GradScaler+AdamW fused", "ms": 0.4},
        {"case": "1M", "impl": "(e) (a) capturable, CUDA graph", "ms": 0.3},  # the best peer
        {"case": "1M", "impl": "tkern eager (cuda_graph=False)", "ms": 0.1},  # tkern's own: no peer
    ])  # fmt: skip
    _write(new, "train", device="NVIDIA H200 TEST", date="2026-11-25 00:00 UTC", rows=[
        {"case": report.summary.GPT2, "impl": "tkern", "ms": 2.0, "peak_mib": 50.0},
        {"case": report.summary.GPT2, "impl": "torch autocast", "ms": 1.0, "peak_mib": 100.0},
        {"case": report.summary.GPT2, "impl": "torch fp32 (no tf32)", "ms": 0.5},  # not a 16-bit peer
    ])  # fmt: skip
    _write(new, "gemm", device="NVIDIA H200 TEST", rows=[
        {"case": f"fp16 mm 8x{n}x8", "impl": impl, "ms": ms}
        for n, (a, b) in ((1, (1.0, 2.0)), (2, (1.0, 0.5)))
        for impl, ms in (("tkern", a), ("torch", b))
    ])  # fmt: skip
    summary = report.render_summary(tmp_path)
    assert summary.index("**NVIDIA H200 TEST**, newest run 2026-11-25") < summary.index(
        "**NVIDIA H100 TEST**"
    )
    graphed_torch = "torch graphed: capturable AdamW(fused=True) + GradScaler"
    assert (
        f"| AdamW + loss-scaler step, 1M params | **ahead, 1.50x** | {graphed_torch} |  | abc1234 "
        "| 2026-11-25 01:00 UTC |" in summary  # no MFU for an optimizer step: an empty cell
    )
    assert "| training step, GPT-2 small | **behind, 0.50x** | autocast + GradScaler |" in summary
    assert "| peak memory of the training step, GPT-2 small | **ahead, 2.00x** |" in summary
    # geomean over shapes: 2.0x and 0.5x are on par
    assert "| fp16 GEMM, transformer shapes (geomean of 2 cases) | **on par, 1.00x** | cuBLAS" in summary
    at_1b = "| AdamW + loss-scaler step, 1B params | **ahead, 1.50x** | GradScaler + AdamW(fused=True) |"
    assert f"{at_1b}  | not recorded |" in summary  # no MFU cell, no commit in the file
    h200 = summary.split("**NVIDIA H100 TEST**")[0]
    assert h200.count("Not measured on this device:") == 1
    assert "; fp8 GEMM, blockwise scales (precise accumulation);" in h200
    assert "| AdamW + loss-scaler step, 10M params |" not in h200


def test_readme_results_block_is_what_report_renders_from_the_committed_results():
    """README.md's results are generated: rerun `python benchmarks/report.py --write`
    after the results change (the block between the markers must equal its output)."""
    import report

    text = (report.ROOT / "README.md").read_text()
    block = text.split(report.START + "\n")[1].split("\n" + report.END)[0]
    assert block == report.render(), "README.md's results are stale: run python benchmarks/report.py --write"


def test_train_rows_mfu_from_the_model_flops_at_the_device_peak():
    """bench_train's MFU column: the step's model FLOPs (6 x linear weights x tokens, plus
    attention for a transformer) over the step time at the device's dense 16-bit peak; no
    figure on a device without a spec."""
    import bench_train
    import harness
    from torch import nn

    mlp = nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 10))
    x = torch.zeros(8192, 784)
    flops = bench_train.step_flops(mlp, x, bench_train.classify_loss)
    assert flops == 6 * (784 * 4096 + 4096 * 10) * 8192
    peak = harness.DEVICES["h200"].bf16 * 1e12
    assert bench_train.mfu(flops, 2.0, "NVIDIA H200") == round(flops / 2e-3 / peak, 4)
    assert bench_train.mfu(flops, 2.0, "cpu") is None and bench_train.mfu(flops, None, "NVIDIA H100") is None
    assert bench_train.master_of("torchao float8 tensorwise compiled") == "none (bf16 params)"
    assert bench_train.master_of(bench_train.TORCHAO_FP32_MASTER) == "fp32 params"
    assert (
        bench_train.master_of("tkern bf16 master=split") == "split"
        and bench_train.master_of("tkern") == "fp32"
    )


def _gpt2_small_spec():
    import step_ledger

    return step_ledger.MODELS["gpt2-small"]


T, QKV = 16384, 2 * 16384 * 768 * 2304  # GPT-2 small's tokens per step; its c_attn GEMM's FLOPs


@pytest.mark.parametrize(
    "kernel,ancestors,shapes,expected",
    [
        # cuBLAS under autograd: the role from the op's shapes (16384 tokens, width 768)
        ("sm90_xmma_gemm_f16f16", ["aten::addmm"], [[768], [T, 768], [768, 2304]], ("gemm fwd", QKV)),
        ("nvjet_hsh_128x256", ["aten::mm", "autograd::engine::evaluate_function: AddmmBackward0"],
         [[T, 2304], [2304, 768]], ("gemm dgrad", QKV)),
        ("nvjet_hsh_128x256", ["aten::mm", "autograd::engine::evaluate_function: AddmmBackward0"],
         [[768, T], [T, 2304]], ("gemm wgrad", QKV)),
        ("sm90_xmma_gemm", ["aten::mm"], [[T, 768], [768, 50257]], ("gemm lm head", 2 * T * 768 * 50257)),
        ("flash_fwd_kernel", ["aten::_flash_attention_forward"], None, ("attention", 0)),
        ("triton_red_fused__log_softmax_0", ["CompiledFunction"], None, ("loss", 0)),
        ("triton_per_fused_native_layer_norm_1", ["CompiledFunctionBackward"], None, ("norm", 0)),
        ("Memset (Device)", [], None, ("copies and fills", 0)),
        ("triton_poi_fused_add_mul_tanh_pow_3", ["CompiledFunction"], None, ("elementwise", 0)),
        # phases win as in the ledger: the optimizer's everything, the loss's all but GEMMs
        ("multi_tensor_apply_kernel", ["aten::_fused_adamw_", "ledger:optimizer"], None, ("optimizer", 0)),
        ("_ce_kernel", ["ledger:loss|0|100|cross_entropy._ce_kernel", "ledger:loss"], None, ("loss", 0)),
        ("_matmul_kernel", ["ledger:gemm wgrad|1000|64|gemm._matmul_kernel", "ledger:loss"], None,
         ("gemm wgrad", 1000)),
    ],
)  # fmt: skip
def test_profile_kernels_fall_in_the_ledgers_categories(kernel, ancestors, shapes, expected):
    import step_ledger

    category, flops, _ = step_ledger.kernel_category(kernel, ancestors, shapes, _gpt2_small_spec())
    assert (category, flops) == expected
    assert category in step_ledger.CATEGORIES


def test_profiled_launches_name_tkern_launches_by_the_ledger_rule():
    """Under the profiler a tkern GEMM runs for real inside a ``ledger:`` range that names
    its role, FLOPs and bytes (here through the interpreter; the same ranges on a GPU)."""
    import step_ledger
    from torch.profiler import ProfilerActivity, profile

    spec = step_ledger.ModelSpec("gpt2", {"vocab_size": 1000, "n_layer": 1, "n_embd": 32}, 8, 2)
    x = torch.randn(16, 32, dtype=torch.float16, device=DEVICE)
    w = torch.randn(24, 32, dtype=torch.float16, device=DEVICE)
    with step_ledger.profiled_launches(spec), profile(activities=[ProfilerActivity.CPU]) as prof:
        y = tkern.linear(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2e-3, atol=2e-2)
    ranges = [e.name for e in prof.events() if e.name.startswith(step_ledger.RANGE)]
    m, n, k = 16, 24, 32
    assert ranges == [f"ledger:gemm fwd|{2 * m * n * k}|{2 * (m * k + n * k + m * n)}|gemm._matmul_kernel"]
    assert step_ledger.kernel_category("_matmul_kernel", ranges, None, spec)[:2] == (
        "gemm fwd",
        2 * m * n * k,
    )


class _Event:
    """A stand-in for torch.profiler's FunctionEvent: what bench_train.kernel_rows reads."""

    def __init__(self, id, name, device_type, parent=None, link=0, us=0.0, shapes=None):
        self.id, self.name, self.device_type, self.cpu_parent = id, name, device_type, parent
        self.linked_correlation_id, self.input_shapes = link, shapes
        self.time_range = type("R", (), {"elapsed_us": lambda _self: us})()


def test_profile_rows_csv_and_picture_from_synthetic_events(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_train
    import plots
    from PIL import Image
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    step = _Event(1, "ledger:optimizer", cpu)
    mm = _Event(2, "aten::mm", cpu, shapes=[[16384, 768], [768, 3072]])
    launch_mm, launch_opt = _Event(3, "cudaLaunchKernel", cpu, mm), _Event(4, "cudaLaunchKernel", cpu, step)
    events = [step, mm, launch_mm, launch_opt,
              _Event(10, "sm90_xmma_gemm", cuda, link=3, us=1000.0),
              _Event(11, "multi_tensor_apply_kernel", cuda, link=4, us=500.0),
              _Event(12, "Memset (Device)", cuda, us=100.0)]  # fmt: skip
    rows = bench_train.kernel_rows(events, _gpt2_small_spec())
    assert [r["category"] for r in rows] == ["gemm fwd", "optimizer", "copies and fills"]
    assert rows[0]["flops"] == 2 * 16384 * 768 * 3072 and "aten::mm" in rows[0]["shapes"]
    floors = {"gemm fwd": 0.4, "optimizer": 0.3}
    summary = bench_train.profile_summary("tkern", rows, 2, 1.0, floors)
    cats = {r["category"]: r for r in summary if r["kind"] == "category"}
    assert cats["gemm fwd"]["ms_per_step"] == 0.5 and cats["gemm fwd"]["floor_ms"] == 0.4
    assert cats["optimizer"]["ms_per_step"] == 0.25 and cats["copies and fills"]["floor_ms"] is None
    total = next(r for r in summary if r["kind"] == "total")
    assert total["busy_ms"] == 0.8 and total["wall_ms"] == 1.0 and total["share"] == 0.8
    top = [r for r in summary if r["kind"] == "kernel"]
    assert top[0]["kernel"] == "sm90_xmma_gemm" and top[0]["tflops"] == round(
        2 * 16384 * 768 * 3072 / 1e-3 / 1e12, 1
    )
    for recipe in ("tkern", "torch autocast compiled"):
        bench_train.write_profile_csv(tmp_path / f"profile_{recipe.replace(' ', '-')}.csv",
                                      bench_train.profile_summary(recipe, rows, 2, 1.0, floors))  # fmt: skip
    png = bench_train.draw_profile(tmp_path)
    assert png == tmp_path / "profile.png" and max(Image.open(png).size) <= plots.MAX_PX
