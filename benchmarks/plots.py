"""The benchmark pictures: drawn from the results files alone, one question each.

Every picture answers "how fast is each implementation against one baseline, case
by case": one row per case, one colour and marker per implementation, the speed
ratio (the baseline's ms over the implementation's ms, higher is better) on a log
axis labelled at every gridline, and the baseline drawn as the reference line at
1.0x. Every series and the baseline are named in the legend as the README's table
and ``benchmarks/results/TARGETS.md`` name them (:data:`NAMES`), never by a results
file's short impl name. A case whose baseline was not timed is left out (the
picture says how many). Pictures are at most :data:`MAX_PX` wide and tall:
``report.py --write`` redraws every one without a GPU, and
:meth:`harness.Results.save` draws its file's after every case.

A results file may give several pictures (:data:`PICTURES`): ``gemm.json`` gives
``gemm.png`` (the 16-bit GEMMs and linear layers against torch) and
``gemm_fp8.png`` (every fp8 GEMM, tkern's and torch's, against a bf16 GEMM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

#: the most pixels a picture is wide and tall
MAX_PX = 1600
MAX_WIDTH_PX = MAX_PX  # the name the harness and older tests use
DPI = 120
MARKERS = "osD^vP*X<>hp"

#: results file stem -> short impl name -> the name the tables use (report.py's labels)
NAMES: dict[str, dict[str, str]] = {
    "optimizer": {
        "(a) GradScaler+AdamW fused": "GradScaler + AdamW(fused=True)",
        "AdamW fused + GradScaler": "GradScaler + AdamW(fused=True)",
        "(b) GradScaler+AdamW foreach": "GradScaler + AdamW(foreach=True)",
        "AdamW foreach + GradScaler": "GradScaler + AdamW(foreach=True)",
        "(c) master by hand": "fp32 master weights by hand in torch",
        "(d) compiled (c)": "torch.compile'd master-weights recipe",
        "(e) (a) capturable, CUDA graph": "torch graphed: capturable AdamW(fused=True) + GradScaler",
        "tkern": "tkern FusedAdamW + loss scaler",
        "tkern eager (cuda_graph=False)": "tkern, cuda_graph=False",
        "tkern + tkern scaler": "tkern FusedAdamW + loss scaler",
    },
    "train": {
        "torch autocast": "autocast + GradScaler",
        "torch autocast compiled": "autocast under torch.compile",
        "torch autocast bf16": "bf16 autocast",
        "torch fp32 (no tf32)": "torch fp32 (TF32 off)",
        "torch fp32": "torch fp32",
        "torchao float8 tensorwise compiled": "torchao Float8Linear compiled",
        "tkern": "tkern",
        "tkern opt eager": "tkern, optimizer cuda_graph=False",
        "tkern whole-step graph": "tkern, Trainer(cuda_graph=True)",
        "tkern fp8 tensorwise": "tkern fp8 tensorwise",
        "tkern fp8 delayed": "tkern fp8 delayed",
        "tkern fp8 blockwise": "tkern fp8 blockwise",
    },
    "gemm": {
        "torch": "cuBLAS through torch (bias + GELU: torch unfused)",
        "tkern": "tkern",
        "tkern tma": "tkern, the persistent TMA kernel alone",
        "torch addmm_activation": "torch._addmm_activation(use_gelu=True)",
        "torch compiled": "the unfused recipe compiled",
        "torch bf16": "bf16 cuBLAS",
        "torch fast accum": "torch's fp8 GEMM, fast accumulation",
    },
    "norm": {"torch autocast": "torch (autocast path)", "torch fp32 upcast": "torch on an fp32 copy"},
    "loss": {"torch unfused": "torch unfused", "torch fp32 upcast": "torch on logits.float()"},
    "distributed": {
        "(a) all-reduce + FusedAdamW": "DDP all-reduce + tkern FusedAdamW",
        "FSDP2 + torch AdamW": "FSDP2 + torch AdamW",
    },
}


@dataclass(frozen=True)
class Picture:
    """One picture of a results file: one question.

    Args:
        name: the picture's file stem (``<name>.png`` beside the results file).
        question: its title.
        baselines: the impls one case is compared with; the first timed in a case wins.
        cases: a regular expression a case's name must match (``re.search``) to be drawn.
        baseline_case: ``(pattern, replacement)``: the baseline is timed in the case
            ``re.sub(pattern, replacement, case)`` (its impl one of ``baselines``).
        names: impl -> name, over :data:`NAMES` of the file.
    """

    name: str
    question: str
    baselines: tuple[str, ...]
    cases: str = ""
    baseline_case: tuple[str, str] | None = None
    names: dict[str, str] = field(default_factory=dict)


#: file stem -> its pictures, the first one named after the file
PICTURES: dict[str, tuple[Picture, ...]] = {
    "gemm": (
        Picture(
            "gemm",
            "How fast is each 16-bit GEMM and linear layer of tkern against torch's (cuBLAS)?",
            ("torch",),
            cases=r"^(fp16|bf16|linear|bias\+gelu) ",
        ),
        Picture(
            "gemm_fp8",
            "How much faster than a bf16 GEMM is each fp8 GEMM, tkern's and torch's (torch._scaled_mm)?",
            ("torch bf16",),
            cases=r"^fp8 (?!bf16 baseline)",
            baseline_case=(r"^fp8 \S+ \S+ (\S+)$", r"fp8 bf16 baseline \1"),
            names={
                "tkern": "tkern.scaled_mm",
                "torch": "torch's fp8 GEMM, precise accumulation",
            },
        ),
    ),
    "optimizer": (
        Picture(
            "optimizer",
            "How fast is tkern's AdamW + loss-scaler step against torch's, by model size?",
            ("(a) GradScaler+AdamW fused", "AdamW fused + GradScaler", "(b) GradScaler+AdamW foreach"),
            cases=r"^(?!scaler overhead|health)",
        ),
    ),
    "train": (
        Picture(
            "train",
            "How fast is one training step of each recipe against autocast + GradScaler?",
            ("torch autocast",),
        ),
    ),
    "norm": (Picture("norm", "How fast are tkern's norm layers against torch's?", ("torch autocast",)),),
    "loss": (
        Picture(
            "loss", "How fast are tkern's losses against torch's?", ("torch unfused", "torch fp32 upcast")
        ),
    ),
    "distributed": (
        Picture(
            "distributed",
            "How fast is a data-parallel step of tkern against torch's?",
            ("(a) all-reduce + FusedAdamW", "FSDP2 + torch AdamW"),
        ),
    ),
}
#: file stem -> its pictures' baselines and the first picture's question (kept for callers)
PLOTS = {stem: (pics[0].baselines, pics[0].question) for stem, pics in PICTURES.items()}


def name_of(stem: str, impl: str, picture: Picture | None = None) -> str:
    """The name the tables use for ``impl`` of results file ``stem``."""
    if picture is not None and impl in picture.names:
        return picture.names[impl]
    return NAMES.get(stem, {}).get(impl, impl)


def speed_rows(
    payload: dict, baselines: tuple[str, ...], picture: Picture | None = None
) -> tuple[list[str], dict[str, list], list[str], int]:
    """(cases drawn, impl -> [ratio or None per case], the baselines used, cases left out)."""
    ms = {(r["case"], r["impl"]): r.get("ms") for r in payload["rows"]}
    pattern = re.compile(picture.cases) if picture is not None and picture.cases else None
    cases, used, left_out = [], [], 0
    ratios: dict[str, list] = {}
    for case in dict.fromkeys(r["case"] for r in payload["rows"]):
        if pattern is not None and not pattern.search(case):
            continue
        where = case
        if picture is not None and picture.baseline_case is not None:
            where = re.sub(*picture.baseline_case, case)
        base = next((b for b in baselines if ms.get((where, b))), None)
        others = [i for (c, i), v in ms.items() if c == case and (c, i) != (where, base) and v]
        if base is None or not others:
            left_out += 1
            continue
        used.append(base)
        cases.append(case)
        for impl in others:
            ratios.setdefault(impl, [None] * (len(cases) - 1))
        for impl, values in ratios.items():
            v = ms.get((case, impl))
            values.append(ms[(where, base)] / v if v else None)
    return cases, ratios, list(dict.fromkeys(used)), left_out


#: the gridlines a speed axis may have: every one is labelled
NICE_TICKS = (
    0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0,
)  # fmt: skip
#: at most this many gridlines: beyond it a coarser set is taken
MAX_TICKS = 12
MEDIUM_TICKS = (
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.7,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.0,
    10.0,
    20.0,
    50.0,
    100.0,
)
COARSE_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def speed_ticks(lo: float, hi: float) -> list[float]:
    """The labelled gridlines of an axis from ``lo`` to ``hi`` (1.0 always among them)."""
    for choice in (NICE_TICKS, MEDIUM_TICKS, COARSE_TICKS):
        ticks = [t for t in choice if lo <= t <= hi]
        if len(ticks) <= MAX_TICKS:
            return ticks
    return ticks


def figure(payload: dict, stem: str, picture: Picture):
    """The matplotlib Figure of one picture of a results file, or None (nothing to draw)."""
    cases, ratios, used, left_out = speed_rows(payload, picture.baselines, picture)
    if not cases:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    height = min(MAX_PX / DPI, 1.6 + 0.3 * len(cases) + 0.22 * len(ratios))
    fig, ax = plt.subplots(figsize=(MAX_PX / DPI, height))
    colours = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    values = [1.0]
    for k, (impl, series) in enumerate(ratios.items()):
        pts = [(v, j) for j, v in enumerate(series) if v is not None]
        values += [v for v, _ in pts]
        ax.scatter(
            [v for v, _ in pts],
            [j for _, j in pts],
            color=colours[k % len(colours)],
            marker=MARKERS[k % len(MARKERS)],
            s=42,
            label=name_of(stem, impl, picture),
            zorder=3,
        )
    baseline = "; ".join(name_of(stem, b, picture) for b in used)
    ax.axvline(1.0, color="black", linewidth=1.2, zorder=2, label=f"baseline = 1.0x: {baseline}")
    ax.set_xscale("log")
    lo, hi = min(values) / 1.15, max(values) * 1.15
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(FixedLocator(speed_ticks(lo, hi)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", which="major", alpha=0.35)
    ax.set_xlabel("speed against the baseline (its ms / this ms; higher is better)")
    note = f"; {left_out} case(s) without a timed baseline left out" if left_out else ""
    ax.set_title(
        f"{picture.question}\n{payload['device']}, torch {payload['torch']}, triton {payload['triton']}, "
        f"{payload['date']}, commit {payload.get('commit', 'not recorded')}{note}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def draw_all(payload: dict, folder: Path, stem: str) -> list[Path]:
    """Every picture of results file ``stem`` into ``folder``; the files written."""
    drawn = []
    for picture in PICTURES.get(stem, ()):
        fig = figure(payload, stem, picture)
        if fig is None:
            continue
        import matplotlib.pyplot as plt

        path = Path(folder) / f"{picture.name}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        drawn.append(path)
    return drawn


def draw(payload: dict, path: Path, stem: str) -> bool:
    """Draw the pictures of results file ``stem`` beside ``path`` (``<stem>.png`` and any
    other picture of the file); False: nothing to draw."""
    return bool(draw_all(payload, Path(path).parent, stem))
