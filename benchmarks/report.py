"""The README's results (a summary of what tkern is faster at, the targets) and the
full list of targets, from ``benchmarks/results/<folder>/*.json`` alone.

    python benchmarks/report.py                  # print the README's block and the targets list
    python benchmarks/report.py --write          # README.md (between the markers), TARGETS.md, pictures
    python benchmarks/report.py --write-targets  # TARGETS.md only
    python benchmarks/report.py --results DIR    # read another results folder (the dry run's)

The summary ("what is tkern faster at, by how much, and where is it slower") is
``benchmarks/report_summary.py``'s.

Every target of the project is one :class:`Target` in :data:`TARGETS`: the file
and key its figure is read from and the bound. Each is reported as ``met``,
``missed`` or ``not measured`` (its file or key absent) per device folder; figures
without a bound (the ceilings, comparisons no target names) are shown as
``figure``. Every value names the run it came from (its file's date and commit).
GPU folders are those holding a file only a GPU run writes; ``results/host/`` holds
the CPU-measured ones (host time, activation memory).

A target names the rows its figure is computed from (``rows``). One of them
meant to run as a CUDA graph (``graphed``) that replayed nothing fell back to
eager: the target is then reported as ``fell back: <the row's graph_fallback>``,
never as a figure (graphed against eager would read about 1.0x and hide it), and
the table lists every such row.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (the names the tables and pictures give each implementation)
import report_summary as summary  # noqa: E402  (the summary; the cases and rows the targets read too)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: the full met / missed / not-measured list that the README links to
TARGETS_FILE = RESULTS / "TARGETS.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
#: files only a GPU run writes: a folder holding one is a device's
GPU_STEMS = frozenset({"ceilings", "gemm", "optimizer", "train", "norm", "loss"})
CPU_FOLDER = "host"
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt}
MET, MISSED, NOT_MEASURED, FIGURE = "met", "missed", "not measured", "figure"


@dataclass(frozen=True)
class Target:
    """One figure of a results file and what it should be.

    Args:
        stem: the results file (``<stem>.json`` in a results folder).
        key: the key in that file's top level; a tuple gives older names after
            the current one (the first present is read).
        label: what it is, as the tables print it.
        op, bound: the target (``value op bound``); ``op`` "" for a figure shown
            without one (a ceiling, a comparison no issue sets a bound on).
        headline: one of the few listed first in a device's table of TARGETS.md.
        where: ``"gpu"`` (read in each GPU folder), ``"cpu"`` (in ``results/host``) or both.
        rows: the ``(case, impl)`` rows of the file its figure is computed from:
            a graphed one that replayed nothing makes it ``fell back``.
    """

    stem: str
    key: str | tuple[str, ...]
    label: str
    op: str = ""
    bound: float | None = None
    headline: bool = False
    where: tuple[str, ...] = ("gpu",)
    rows: tuple[tuple[str, str], ...] = ()

    def names(self) -> tuple[str, ...]:
        return self.key if isinstance(self.key, tuple) else (self.key,)

    def goal(self) -> str:
        return "" if not self.op else f"{self.op} {self.bound:g}"

    def judge(self, value: float | None) -> str:
        if not self.op:
            return FIGURE if value is not None else NOT_MEASURED
        if value is None:
            return NOT_MEASURED
        return MET if OPS[self.op](value, self.bound) else MISSED


#: bench_optimizer's tkern row and torch's graphed peer (capturable fused AdamW +
#: GradScaler in a CUDA graph)
OPT_TKERN, OPT_GRAPHED_TORCH = "tkern", "(e) (a) capturable, CUDA graph"

#: a linear layer's three GEMM layouts as tkern.linear launches them (bench_gemm_layouts.LAYOUTS)
GEMM_LAYOUTS = ("fwd", "dgrad", "wgrad")
OPT_MODES = [(m, s) for m in ("fp32", "split", "none") for s in ("fp32", "bf16", "uint8")]

#: Every target (issue 30 item 4, and the earlier issues' that still stand), in one place.
TARGETS: list[Target] = [
    Target("ceilings", "copy_gbps", "device copy bandwidth, GB/s (read + write)", headline=True),
    Target("ceilings", "cublas_fp16_8192_tflops", "cuBLAS fp16 8192^3, TFLOP/s", headline=True),
    # GEMM
    Target(
        "gemm",
        "fp16_square_ge2048_vs_cublas",
        "GEMM fp16 / cuBLAS, squares >= 2048 (geomean)",
        ">=",
        0.95,
        True,
    ),
    Target(
        "gemm",
        "fp16_transformer_vs_cublas",
        "GEMM fp16 / cuBLAS, transformer shapes (geomean)",
        ">=",
        0.95,
        True,
    ),
    Target("gemm", "bf16_square_ge2048_vs_cublas", "GEMM bf16 / cuBLAS, squares >= 2048", ">=", 0.95),
    Target("gemm", "bf16_transformer_vs_cublas", "GEMM bf16 / cuBLAS, transformer shapes", ">=", 0.95),
    Target(
        "gemm", "fp16_tma_square_ge2048_vs_cublas", "the persistent TMA kernel alone, fp16 squares >= 2048"
    ),
    Target(
        "gemm", "fp16_tma_transformer_vs_cublas", "the persistent TMA kernel alone, fp16 transformer shapes"
    ),
    *[
        Target(
            "gemm",
            # like with like: torch with tkern's accumulation (gemm_checks.ACCUM); the key
            # before it ("_vs_torch") compared tkern's fast accumulation with torch's precise
            f"fp8_{fmt}_{scaling}_vs_torch_same_accum",
            f"fp8 scaled_mm {fmt} {scaling} / torch's fp8 GEMM, same accumulation "
            f"({summary.FP8_ACCUM[scaling]}), transformer shapes",
            ">=",
            0.95,
            headline=(fmt, scaling) == ("e4m3xe4m3", "tensorwise"),
        )
        for fmt in summary.FP8_FORMATS
        for scaling in summary.FP8_SCALINGS
    ],
    *[
        Target("gemm", f"fp8_{fmt}_{scaling}_vs_bf16", f"fp8 scaled_mm {fmt} {scaling} / bf16 cuBLAS")
        for fmt in summary.FP8_FORMATS
        for scaling in summary.FP8_SCALINGS
    ],
    # the training layouts (bench_gemm's layouts and fp8_layouts sections, issues 42.5 and 43.7)
    *[
        Target(
            "gemm",
            f"fp16_{layout}_{model}_vs_cublas",
            f"GEMM fp16 / cuBLAS, {layout} layout, {label} shapes",
            ">=",
            0.95,
        )
        for model, label in (("gpt2", "GPT-2 small"), ("llama", "Llama-2-7B"))
        for layout in GEMM_LAYOUTS
    ],
    *[
        Target(
            "gemm",
            f"fp8_{scaling}_{layout}_vs_bf16",
            f"fp8 scaled_mm {scaling} / bf16 cuBLAS, {layout} layout",
            ">=",
            1.3 if scaling == "blockwise" else 1.5,
        )
        for scaling in summary.FP8_SCALINGS
        for layout in GEMM_LAYOUTS
    ],
    Target(
        "gemm",
        "fused_bias_gelu_fwd_speedup",
        "linear + bias + GELU fused / torch unfused, forward",
        ">=",
        1.1,
        True,
    ),
    Target("gemm", "fused_bias_gelu_fwd_bwd_speedup", "the same, forward + backward"),
    Target(
        "gemm",
        "fused_bias_gelu_fwd_vs_addmm_activation",
        "linear + bias + GELU fused / torch._addmm_activation(use_gelu=True), forward",
    ),
    Target(
        "gemm",
        "fused_bias_gelu_fwd_vs_compiled",
        "linear + bias + GELU fused / the unfused recipe compiled, forward",
    ),
    Target(
        "gemm",
        "fused_bias_gelu_fwd_bwd_vs_compiled",
        "linear + bias + GELU fused / the unfused recipe compiled, forward + backward",
    ),
    # optimizer
    *[
        Target(
            "optimizer",
            f"{size}_vs_a",
            f"optimizer + scaler step at {size} / GradScaler + AdamW(fused=True)",
            ">=",
            1.5 if size in ("100M", "1B") else 1.0,
            headline=size in ("1M", "1B"),
            rows=((size, OPT_TKERN),),
        )
        for size in ("1M", "10M", "100M", "1B")
    ],
    Target(
        "optimizer",
        "many_small_vs_a",
        "1000 tensors of 10k / GradScaler + AdamW(fused=True)",
        ">=",
        1.0,
        rows=(("1000x10k", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "many_small_vs_b",
        "1000 tensors of 10k / GradScaler + AdamW(foreach=True)",
        ">=",
        3.0,
        rows=(("1000x10k", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "100M_pct_copy",
        "AdamW step at 100M, % of copy bandwidth (30 B/param)",
        ">=",
        85,
        rows=(("100M", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "1B_pct_copy",
        "AdamW step at 1B, % of copy bandwidth",
        ">=",
        85,
        rows=(("1B", OPT_TKERN),),
    ),
    Target(
        "optimizer",
        "100M_vs_d",
        "step at 100M / torch.compile'd master-weights recipe",
        ">",
        1.0,
        rows=(("100M", OPT_TKERN),),
    ),
    *[
        row
        for size in ("1M", "10M")
        for row in (
            Target(
                "optimizer",
                f"{size}_graph_vs_eager",
                f"graphed step / cuda_graph=False at {size}",
                rows=((size, OPT_TKERN),),
            ),
            Target(
                "optimizer",
                f"{size}_vs_e",
                f"tkern graphed / torch graphed capturable fused AdamW at {size} (both + their scaler)",
                rows=((size, OPT_TKERN),),
            ),
        )
    ],
    *[
        Target(
            "optimizer",
            f"{size}_{master}_{state}_vs_floor",
            f"master={master} state={state} at {size}: time / its byte floor",
            "<=",
            1.1,
        )
        for size in ("100M", "1B")
        for master, state in OPT_MODES
    ],
    *[
        Target(
            "optimizer",
            f"{size}_none_vs_torchao_{tag}",
            f"master=none state={state} at {size} / torchao {peer}",
        )
        for size in ("100M", "1B")
        for tag, state, peer in (
            ("adamw8bit", "uint8", "AdamW8bit"),
            ("adamw_sr", "bf16", "_AdamW(bf16_stochastic_round=True)"),
        )
    ],
    # mixed-precision health (issue 37 item 7): what it adds to the scaled step at 10M params
    Target(
        "optimizer",
        "health_10M_k100_vs_off",
        "health cost at 10M: step with overflow tracking + underflow sampling every 100 / tracking off",
        "<=",
        1.02,
        rows=(("health 10M", "tkern health off"), ("health 10M", "tkern underflow every 100")),
    ),
    Target("optimizer", "health_10M_tracking_vs_off", "health cost at 10M: overflow tracking alone / off"),
    Target("optimizer", "health_10M_k1_vs_off", "health cost at 10M: underflow sampling every step / off"),
    # host time (bench_host: on a GPU machine with CUDA tensors, on a CPU machine with CPU tensors)
    Target(
        "host",
        "step_us_per_tensor_1000",
        "FusedAdamW.step host time per tensor at 1000 tensors, us (launches stubbed)",
        "<=",
        0.35,  # issue 37 item 6 (issue 11's bound was 1.0)
        where=("gpu", "cpu"),
    ),
    Target(
        "host",
        "linear_fwd_own_us",
        "tkern.linear forward, own host time, us",
        "<=",
        10.0,
        where=("gpu", "cpu"),
    ),
    Target(
        "host",
        "linear_bwd_own_us",
        "tkern.linear backward, own host time, us",
        "<=",
        20.0,
        where=("gpu", "cpu"),
    ),
    # training step
    *[
        row
        for model, label in summary.TRAIN_MODELS
        for row in (
            Target(
                "train",
                # the key before bench_train named its recipes "torch ...": "vs autocast"
                (f"{model}: vs torch autocast", f"{model}: vs autocast"),
                f"training step, {label} / autocast + GradScaler",
                ">=",
                1.2,
                headline=True,
                rows=((model, "tkern"),),
            ),
            Target(
                "train",
                f"{model}: vs torch autocast compiled",
                f"training step, {label} / autocast under torch.compile",
                ">=",
                1.0,
                headline=label == "GPT-2 small",
                rows=((model, "tkern"),),
            ),
            Target(
                "train",
                f"{model}: peak vs autocast",
                f"peak memory, {label} / autocast's",
                "<=",
                0.9,
                True,
                rows=((model, "tkern"),),
            ),
            Target(
                "train",
                f"{model}: whole-step graph vs tkern",
                f"{label}: Trainer(cuda_graph=True) / tkern",
                rows=((model, "tkern whole-step graph"), (model, "tkern")),
            ),
        )
    ],
    *[
        Target(
            "train",
            f"gpt2-small, seq 1024, batch 16: fp8 {r} vs autocast bf16",
            f"fp8 {r} training step, GPT-2 small / bf16 autocast",
            ">=",
            1.4,
            headline=r == "tensorwise",
            rows=((summary.GPT2, f"tkern fp8 {r}"),),
        )
        for r in summary.FP8_RECIPES
    ],
    Target(
        "train",
        "gpt2-small, seq 1024, batch 16: fp8 tensorwise vs torchao float8",
        "fp8 tensorwise, GPT-2 small / torchao Float8Linear compiled",
        rows=((summary.GPT2, "tkern fp8 tensorwise"),),
    ),
    # norms and loss (issue 28): figures until an issue sets bounds
    Target("norm", "layer_norm_fwd_bwd_vs_torch", "layer_norm fwd + bwd / torch (autocast path)"),
    Target("norm", "rms_norm_fwd_bwd_vs_torch", "rms_norm fwd + bwd / torch (autocast path)"),
    Target("loss", "cross_entropy_fwd_bwd_vs_torch", "cross_entropy fwd + bwd / torch on logits.float()"),
    Target("loss", "linear_cross_entropy_fwd_bwd_vs_torch", "linear_cross_entropy fwd + bwd / torch unfused"),
    Target("loss", "linear_cross_entropy_peak_vs_torch", "linear_cross_entropy peak memory / torch unfused"),
    # activation memory, measured on a CPU (bench_activation_memory.py)
    Target(
        "activation_memory",
        "norms_saved_vs_autocast",
        "GPT-2 norm layers' saved bytes, tkern + norms / autocast",
        "<=",
        0.55,
        True,
        where=("cpu",),
    ),
    Target(
        "activation_memory",
        "loss_largest_vs_fp32_logits",
        "largest tensor of the fused loss / the fp32 logits",
        "<=",
        0.125,
        True,
        where=("cpu",),
    ),
]


def render_summary(results: Path = RESULTS) -> str:
    """The summary of the results in ``results`` (:func:`report_summary.render_summary`)."""
    return summary.render_summary(_folders(results))


def load(results: Path) -> dict[str, dict[str, dict]]:
    """{folder: {file stem: payload}} for every GPU folder and the CPU folder."""
    out: dict[str, dict[str, dict]] = {}
    if results.is_dir():
        for path in sorted(results.glob("*/*.json")):
            out.setdefault(path.parent.name, {})[path.stem] = json.loads(path.read_text())
    return {f: files for f, files in out.items() if f == CPU_FOLDER or GPU_STEMS & files.keys()}


def run_of(payload: dict) -> str:
    """Which run a figure came from: its file's date and commit."""
    return f"{payload.get('date', '?')}, commit {payload.get('commit', 'not recorded')}"


def evaluate(files: dict[str, dict], where: str) -> list[tuple[Target, float | None, str, str]]:
    """(target, value, status, run) of every target read in a folder of kind ``where``."""
    rows = []
    for t in TARGETS:
        if where not in t.where:
            continue
        payload = files.get(t.stem, {})
        value = next((payload[k] for k in t.names() if payload.get(k) is not None), None)
        status = t.judge(value)
        by_key = {(r.get("case"), r.get("impl")): r for r in payload.get("rows", [])}
        fallbacks = [summary.fell_back(by_key[key]) for key in t.rows if key in by_key]
        fallback = next((f for f in fallbacks if f is not None), None)
        if fallback is not None:  # an eager figure under a graphed name: no figure at all
            value, status = None, fallback
        rows.append((t, value, status, run_of(payload) if value is not None or fallback else ""))
    return rows


def _counts(rows) -> str:
    statuses = [
        summary.FELL_BACK if s.startswith(summary.FELL_BACK) else s for _, _, s, _ in rows if s != FIGURE
    ]
    kinds = (MET, MISSED, NOT_MEASURED) + ((summary.FELL_BACK,) if summary.FELL_BACK in statuses else ())
    return ", ".join(f"{statuses.count(s)} {s}" for s in kinds)


def fallback_lines(stem: str, payload: dict) -> list[str]:
    """One line per graphed row of a results file that replayed nothing."""
    return [
        f"`bench_{stem}.py` {r['case']}, {r['impl']}: {why}"
        for r in payload.get("rows", [])
        if (why := summary.fell_back(r)) is not None
    ]


def _folders(results: Path) -> list[tuple[str, str, dict]]:
    """(folder, "gpu" or "cpu", files), GPU folders first, the newest run first; an
    empty GPU entry when no GPU run has been recorded, so every GPU target shows as
    not measured."""
    data = load(results)
    gpu = [(f, "gpu", files) for f, files in data.items() if f != CPU_FOLDER]
    gpu.sort(key=lambda entry: summary.newest(entry[2]), reverse=True)
    if not gpu:
        gpu = [("(no GPU run)", "gpu", {})]
    return gpu + [(CPU_FOLDER, "cpu", data.get(CPU_FOLDER, {}))]


def _heading(folder: str, files: dict) -> str:
    if not files:
        return f"**{folder}**: nothing measured yet (a GPU session runs `benchmarks/gpu_check.sh`)."
    p = next(iter(files.values()))
    commits = sorted({f.get("commit", "not recorded") for f in files.values()})
    return (
        f"**{p.get('device', folder)}** (`benchmarks/results/{folder}/`; torch {p.get('torch')}, "
        f"triton {p.get('triton')}; commit{'s' if len(commits) > 1 else ''} {', '.join(commits)})"
    )


def _table(rows) -> list[str]:
    lines = ["| measure | value | target | status | run |", "| --- | --- | --- | --- | --- |"]
    for t, value, status, run in rows:
        lines.append(f"| {t.label} | {'' if value is None else value} | {t.goal()} | {status} | {run} |")
    return lines


def render(results: Path = RESULTS, targets_link: str = "benchmarks/results/TARGETS.md") -> str:
    """The README's results: the summary (:func:`render_summary`); per GPU folder,
    newest run first, one line counting its targets met / missed / not measured
    (the full list linked), with any failed or fallen-back rows; then the CPU
    folder's targets as a table and the activation memory of one GPT-2 step."""
    lines = [render_summary(results), "", f"**Targets** ([every one, per device]({targets_link})):", ""]
    cpu = []
    for folder, where, files in _folders(results):
        rows = evaluate(files, where)
        if where == "cpu":
            cpu = [f"{_heading(folder, files)} Targets: {_counts(rows)}.", ""]
            cpu += [*_table(rows), ""] if files else []
            cpu += summary.activation_memory_table(files.get("activation_memory", {}))
            continue
        lines.append(
            f"- {_heading(folder, files)}: {_counts(rows)}." if files else f"- {_heading(folder, files)}"
        )
        for stem, payload in files.items():
            for f in payload.get("failed", []):
                lines.append(f"  `bench_{stem}.py` failed on {f['case']}, {f['impl']}: `{f['error']}`")
            lines += [f"  {line}" for line in fallback_lines(stem, payload)]
    return "\n".join([*lines, "", *cpu]).rstrip()


def render_targets(results: Path = RESULTS) -> str:
    """Every target of every folder, newest GPU run first, met / missed / not
    measured, the headline ones first (TARGETS.md)."""
    lines = [
        "# Targets: met, missed, not measured",
        "",
        "Generated by `python benchmarks/report.py --write` from `benchmarks/results/*/*.json` alone;",
        "the targets are `TARGETS` in `benchmarks/report.py`. Ratios are speed (higher is better)",
        "unless the measure says time or memory; `figure` rows have no bound.",
        "",
    ]
    for folder, where, files in _folders(results):
        rows = evaluate(files, where)
        lines += [f"## {folder}", "", f"{_heading(folder, files)} Targets: {_counts(rows)}.", ""]
        lines += _table(sorted(rows, key=lambda r: not r[0].headline))  # the headline ones first
        lines.append("")
    return "\n".join(lines)


def write_readme(text: str, readme: Path = ROOT / "README.md") -> None:
    content = readme.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{readme} has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", content))


def redraw(results: Path) -> list[Path]:
    """Every results file's pictures drawn again from the file alone (benchmarks/plots.py);
    the pictures written."""
    drawn = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        for stem in plots.PICTURES:
            source = folder / f"{stem}.json"
            if source.is_file():
                drawn += plots.draw_all(json.loads(source.read_text()), folder, stem)
    return drawn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--write", action="store_true", help="replace the table in README.md and write TARGETS.md"
    )
    parser.add_argument("--write-targets", action="store_true", help="write TARGETS.md only")
    parser.add_argument(
        "--plots", action="store_true", help="redraw every results file's picture (--write does too)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder to read")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the README --write rewrites")
    parser.add_argument("--targets-file", type=Path, default=None, help="default: <results>/TARGETS.md")
    args = parser.parse_args(argv)
    table, targets = render(args.results), render_targets(args.results)
    targets_file = args.targets_file or args.results / TARGETS_FILE.name
    if args.write:
        write_readme(table, args.readme)
    if args.write or args.write_targets:
        targets_file.write_text(targets + "\n")
        print(f"wrote {targets_file}")
    if args.write or args.plots:
        for path in redraw(args.results):
            print(f"drew {path}")
    print(table)
    print()
    print(targets)


if __name__ == "__main__":
    main()
