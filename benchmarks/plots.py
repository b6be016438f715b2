"""The benchmark pictures: one per results file, one question each.

Every picture answers "how fast is each implementation against the baseline, case
by case": one row per case, one colour and marker per implementation, the speed
ratio (the baseline's ms over the implementation's ms, higher is better) on a log
axis, and the baseline drawn as the reference line at 1.0x. A case whose baseline
was not timed is left out (the picture says how many). Pictures are at most
:data:`MAX_WIDTH_PX` wide and drawn from the results files alone: ``report.py
--write`` redraws every one without a GPU, and :meth:`harness.Results.save` draws
its own after every case.
"""

from __future__ import annotations

from pathlib import Path

#: file stem -> (the baselines, first one timed in a case wins; the picture's title)
PLOTS: dict[str, tuple[tuple[str, ...], str]] = {
    "gemm": (("torch", "torch fast accum", "torch bf16"), "GEMMs against torch (cuBLAS)"),
    "optimizer": (
        ("(a) GradScaler+AdamW fused", "AdamW fused + GradScaler", "(b) GradScaler+AdamW foreach"),
        "optimizer step against GradScaler + torch's AdamW",
    ),
    "train": (("torch autocast",), "training step against torch autocast + GradScaler"),
    "norm": (("torch autocast",), "norm layers against torch under autocast"),
    "loss": (("torch unfused", "torch fp32 upcast"), "losses against torch"),
    "distributed": (
        ("(a) all-reduce + FusedAdamW", "FSDP2 + torch AdamW"),
        "data-parallel step against torch's",
    ),
}
MAX_WIDTH_PX = 1600
DPI = 120
MARKERS = "osD^vP*X<>hp"


def speed_rows(
    payload: dict, baselines: tuple[str, ...]
) -> tuple[list[str], dict[str, list], list[str], int]:
    """(cases drawn, impl -> [ratio or None per case], the baselines used, cases left out)."""
    ms = {(r["case"], r["impl"]): r.get("ms") for r in payload["rows"]}
    cases, used, left_out = [], [], 0
    ratios: dict[str, list] = {}
    for case in dict.fromkeys(r["case"] for r in payload["rows"]):
        base = next((b for b in baselines if ms.get((case, b))), None)
        others = [i for (c, i), v in ms.items() if c == case and i != base and v]
        if base is None or not others:
            left_out += 1
            continue
        used.append(base)
        cases.append(case)
        for impl in others:
            ratios.setdefault(impl, [None] * (len(cases) - 1))
        for impl, values in ratios.items():
            v = ms.get((case, impl))
            values.append(ms[(case, base)] / v if v else None)
    return cases, ratios, list(dict.fromkeys(used)), left_out


def draw(payload: dict, path: Path, stem: str) -> bool:
    """Draw ``path`` for the results file ``stem`` (False: no picture for it)."""
    if stem not in PLOTS:
        return False
    baselines, title = PLOTS[stem]
    cases, ratios, used, left_out = speed_rows(payload, baselines)
    if not cases:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = MAX_WIDTH_PX / DPI
    fig, ax = plt.subplots(figsize=(width, 1.8 + 0.32 * len(cases) + 0.2 * len(ratios)))
    colours = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    for k, (impl, values) in enumerate(ratios.items()):
        pts = [(v, j) for j, v in enumerate(values) if v is not None]
        ax.scatter(
            [v for v, _ in pts],
            [j for _, j in pts],
            color=colours[k % len(colours)],
            marker=MARKERS[k % len(MARKERS)],
            s=42,
            label=impl,
            zorder=3,
        )
    ax.axvline(1.0, color="black", linewidth=1.2, zorder=2, label=f"baseline = 1.0x: {', '.join(used)}")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.set_xlabel("speed relative to the baseline (its ms / this ms; higher is better)")
    note = f"; {left_out} case(s) without a timed baseline left out" if left_out else ""
    ax.set_title(
        f"{title}\n{payload['device']}, torch {payload['torch']}, triton {payload['triton']}, "
        f"{payload['date']}, commit {payload.get('commit', '?')}{note}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True
