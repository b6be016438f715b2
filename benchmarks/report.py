"""The README's results (a summary of what tkern is faster at, the targets) and the
full list of targets, from ``benchmarks/results/<folder>/*.json`` alone.

    python benchmarks/report.py                  # print the README's block and the targets list
    python benchmarks/report.py --write          # README.md (between the markers), TARGETS.md, pictures
    python benchmarks/report.py --write-targets  # TARGETS.md only
    python benchmarks/report.py --results DIR    # read another results folder (the dry run's)

The summary ("what is tkern faster at, by how much, and where is it slower") is
``benchmarks/report_summary.py``'s.

Every target of the project is one :class:`Target` in :data:`TARGETS`: the file
and key its figure is read from and the bound (``benchmarks/report_targets.py``). Each is
reported as ``met``, ``missed`` or, its file or key absent, ``waiting for a GPU
measurement`` (a GPU target; ``not measured`` for a CPU one) per device folder; figures
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
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (the names the tables and pictures give each implementation)
import report_summary as summary  # noqa: E402  (the summary; the cases and rows the targets read too)
from report_targets import FIGURE, MET, MISSED, NOT_MEASURED, TARGETS, WAITING, Target  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: the full met / missed / not-measured list that the README links to
TARGETS_FILE = RESULTS / "TARGETS.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
#: files only a GPU run writes: a folder holding one is a device's
GPU_STEMS = frozenset({"ceilings", "gemm", "optimizer", "train", "norm", "loss"})
CPU_FOLDER = "host"


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
        if status == NOT_MEASURED and where == "gpu":
            status = t.waiting  # no GPU run has measured it: said so, never a figure made up
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
    waiting = tuple(dict.fromkeys(s for s in statuses if s.startswith("waiting for a")))
    kinds = (MET, MISSED, *(waiting or (NOT_MEASURED,)))
    kinds += (summary.FELL_BACK,) if summary.FELL_BACK in statuses else ()
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
