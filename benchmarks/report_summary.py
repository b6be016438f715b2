"""The README's summary tables for ``benchmarks/report.py``: what tkern is faster at, and
the activation memory of a training step (:func:`activation_memory_table`).

The summary (:func:`render_summary`) answers "what is tkern faster at, by how much,
and where is it slower": per GPU device, newest first, each :class:`Measure` of
:data:`MEASURES` as tkern's time (or peak memory) against the best peer measured in
the same run, with the ratio, the commit and the date; the measures a run never
measured in one line.

Also here, as the summary and report.py's targets both read them: the cases the
benchmarks name (:data:`TRAIN_MODELS`, the fp8 formats and scalings) and how a
results row tells that it fell back from its CUDA graph (:func:`fell_back`).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (the names the tables and pictures give each implementation)

#: the status of a target one of whose graphed rows replayed nothing (then ": <reason>")
FELL_BACK = "fell back"


# The models bench_train.py times: (case as it names it, label here).
TRAIN_MODELS = [
    ("gpt2-small, seq 1024, batch 16", "GPT-2 small"),
    ("mlp 8x4096, batch 8192", "8 x 4096 MLP"),
    ("mlp 784-4096-10, batch 8192", "2-layer MLP"),
]
FP8_FORMATS = ("e4m3xe4m3", "e5m2xe4m3")
FP8_SCALINGS = ("tensorwise", "rowwise", "blockwise")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")
#: how tkern's fp8 GEMM accumulates per scaling, and so its torch peer (gemm_checks.ACCUM)
FP8_ACCUM = {"tensorwise": "fast", "rowwise": "fast", "blockwise": "precise"}


def graphed(row: dict) -> bool:
    """Whether a results row was meant to run as a CUDA graph: its ``graphed`` field;
    in files written before it, a tkern row with a replay count that is not an
    eager one by name or setting."""
    if "graphed" in row:
        return bool(row["graphed"])
    impl = row.get("impl", "")
    return (
        "graph_replays" in row
        and impl.startswith("tkern")
        and "eager" not in impl
        and row.get("cuda_graph") is not False
        and row.get("opt_cuda_graph") is not False
    )


def fell_back(row: dict) -> str | None:
    """``fell back: <reason>`` for a graphed row that replayed nothing, else None."""
    if not graphed(row) or (row.get("graph_replays") or 0) > 0:
        return None
    return f"{FELL_BACK}: {row.get('graph_fallback') or 'no replay recorded'}"


def newest(files: dict) -> str:
    """The date of a folder's newest run: its files' and rows' newest ``date``."""
    dates = [p.get("date", "") for p in files.values()]
    dates += [r.get("date", "") for p in files.values() for r in p.get("rows", [])]
    return max(dates, default="")


#: a ratio within this factor of 1.0 is "on par" (the run-to-run noise of a step)
PAR = 1.03
SHAPES = r"\d+x\d+x\d+"
GPT2 = TRAIN_MODELS[0][0]
#: bench_train's Llama-like case (bench_models' issue 42 model; its name as bench_train writes it)
LLAMA = "llama-like, seq 2048, batch 8"
#: the 16-bit peers of a tkern training step (impl -> the tables' name)
AUTOCAST_PEERS = ("torch autocast", "torch autocast compiled", "torch autocast bf16")
FP8_TRAIN_PEERS = (
    "torch autocast bf16",
    "torch autocast bf16 compiled",
    "torchao float8 tensorwise compiled",
    "torchao float8 tensorwise compiled, fp32 master",
)
CUBLAS = {"torch": "cuBLAS (torch.matmul)"}
BIAS_GELU_PEERS = {
    "torch": "torch unfused",
    "torch addmm_activation": "torch._addmm_activation(use_gelu=True)",
    "torch compiled": "the unfused recipe compiled",
}
FP8_GEMM_PEERS = {
    "torch": "torch's fp8 GEMM, precise accumulation",
    "torch fast accum": "torch's fp8 GEMM, fast accumulation",
}
#: an fp8 training-layout GEMM's peers: torch's fp8 GEMM on the same case, bf16 cuBLAS in the
#: same layout on its own case (bench_gemm_layouts: ``fp8 layout bf16 <layout> <model> ...``)
FP8_LAYOUT_PEERS = {**FP8_GEMM_PEERS, "torch bf16": "bf16 cuBLAS (torch.mm)"}
FP8_LAYOUT_BF16_CASE = (r"^fp8 \w+ ", "fp8 layout bf16 ")
GEMM_LAYOUTS = ("fwd", "dgrad", "wgrad")


@dataclass(frozen=True)
class Measure:
    """One line of the summary: tkern against the best peer measured in the same run.

    Args:
        label: what it is, as the summary prints it.
        stem: the results file its rows are read from.
        cases: a regular expression the rows' ``case`` must match in full; over
            several cases the ratio is their geometric mean.
        tkern: tkern's impl.
        peers: impl -> the tables' name; empty: every impl not named ``tkern...``
            (named by :data:`plots.NAMES`).
        metric: the row field compared (lower is better: ``ms``, ``peak_mib``).
        peer_case: ``(pattern, replacement)``: ``re.sub`` of a case gives another case
            whose rows are peers too (a peer timed under its own case name).
    """

    label: str
    stem: str
    cases: str
    tkern: str = "tkern"
    peers: dict[str, str] | tuple[str, ...] = ()
    metric: str = "ms"
    peer_case: tuple[str, str] | None = None

    def peer_names(self, impls) -> dict[str, str]:
        if isinstance(self.peers, dict):
            return {i: n for i, n in self.peers.items() if i in impls}
        chosen = self.peers or [i for i in impls if not i.startswith("tkern")]
        return {i: plots.name_of(self.stem, i) for i in chosen if i in impls}


#: What the summary compares, per device: every question a user asks of tkern's speed.
MEASURES: list[Measure] = [
    *[Measure(f"AdamW + loss-scaler step, {n} params", "optimizer", n) for n in ("1M", "10M", "100M", "1B")],
    Measure("AdamW + loss-scaler step, 1000 tensors of 10k params", "optimizer", "1000x10k"),
    *[
        m
        for model, label in TRAIN_MODELS
        for m in (
            Measure(f"training step, {label}", "train", re.escape(model), peers=AUTOCAST_PEERS),
            Measure(
                f"training step, {label}, Trainer(cuda_graph=True)",
                "train",
                re.escape(model),
                "tkern whole-step graph",
                AUTOCAST_PEERS,
            ),
        )
    ],
    Measure(
        "peak memory of the training step, GPT-2 small",
        "train",
        re.escape(GPT2),
        peers=AUTOCAST_PEERS[:2],
        metric="peak_mib",
    ),
    *[
        Measure(
            f"fp8 {r} training step, GPT-2 small", "train", re.escape(GPT2), f"tkern fp8 {r}", FP8_TRAIN_PEERS
        )
        for r in FP8_RECIPES
    ],
    *[
        Measure(f"{dtype} GEMM, transformer shapes", "gemm", rf"{dtype} mm {SHAPES}", peers=CUBLAS)
        for dtype in ("fp16", "bf16")
    ],
    *[
        Measure(f"{dtype} GEMM, squares 2048-8192", "gemm", rf"{dtype} square (2048|4096|8192)", peers=CUBLAS)
        for dtype in ("fp16", "bf16")
    ],
    Measure("linear + bias + GELU, forward", "gemm", rf"bias\+gelu fwd {SHAPES}", peers=BIAS_GELU_PEERS),
    Measure(
        "linear + bias + GELU, forward + backward",
        "gemm",
        rf"bias\+gelu fwd\+bwd {SHAPES}",
        peers=BIAS_GELU_PEERS,
    ),
    *[
        Measure(
            f"fp8 GEMM, {scaling} scales ({FP8_ACCUM[scaling]} accumulation)",
            "gemm",
            rf"fp8 ({'|'.join(FP8_FORMATS)}) {scaling} {SHAPES}",
            peers=FP8_GEMM_PEERS,
        )
        for scaling in FP8_SCALINGS
    ],
    *[
        Measure(
            f"fp8 GEMM in training, {scaling} scales, {layout} (Float8Linear's operands and accumulation)",
            "gemm",
            rf"fp8 {scaling} {layout} (gpt2|llama) \S+ {SHAPES}",
            peers=FP8_LAYOUT_PEERS,
            peer_case=FP8_LAYOUT_BF16_CASE,
        )
        for scaling in FP8_SCALINGS
        for layout in GEMM_LAYOUTS
    ],
    Measure("layer_norm forward + backward", "norm", r"layer_norm fwd\+bwd \d+x\d+"),
    Measure("rms_norm forward + backward", "norm", r"rms_norm fwd\+bwd \d+x\d+"),
    Measure("cross_entropy forward + backward", "loss", r"cross_entropy fwd\+bwd \d+x\d+"),
    Measure("linear_cross_entropy forward + backward", "loss", rf"linear_cross_entropy fwd\+bwd {SHAPES}"),
]


@dataclass(frozen=True)
class Comparison:
    """A measure's result in one run: ``ratio`` = the best peer's metric / tkern's
    (above 1: tkern ahead), over ``cases`` cases, the best peer(s) by name, and tkern's
    ``mfu`` (its rows' model FLOPs utilisation, geomean; None where the rows have none)."""

    measure: Measure
    ratio: float
    cases: int
    peers: tuple[str, ...]
    commit: str
    date: str
    mfu: float | None = None

    def verdict(self) -> str:
        if self.ratio >= PAR:
            return "ahead"
        return "behind" if self.ratio <= 1 / PAR else "on par"


def compare(measure: Measure, payload: dict) -> Comparison | str | None:
    """The measure in one results file: a :class:`Comparison`; a string when tkern's
    row fell back from its CUDA graph (the reason); None when not measured."""
    pattern = re.compile(measure.cases)
    every: dict[str, dict[str, dict]] = {}
    for row in payload.get("rows", []):
        if row.get(measure.metric):
            every.setdefault(str(row.get("case", "")), {})[row["impl"]] = row
    logs, peers, used, mfus = [], [], [], []
    for case, impls in every.items():
        if not pattern.fullmatch(case):
            continue
        if measure.peer_case is not None:  # peers timed under a case of their own
            impls = {**every.get(re.sub(*measure.peer_case, case), {}), **impls}
        mine = impls.get(measure.tkern)
        if mine is not None and (why := fell_back(mine)) is not None:
            return why
        names = measure.peer_names(impls)
        if mine is None or not names:
            continue
        best = min(names, key=lambda i: impls[i][measure.metric])
        logs.append(math.log(impls[best][measure.metric] / mine[measure.metric]))
        mfus += [math.log(mine["mfu"])] if mine.get("mfu") else []
        peers.append(names[best])
        used += [mine, impls[best]]
    if not logs:
        return None
    commits = sorted({r.get("commit") or payload.get("commit") or "not recorded" for r in used})
    dates = sorted({r.get("date") or payload.get("date", "?") for r in used})
    return Comparison(
        measure,
        math.exp(sum(logs) / len(logs)),
        len(logs),
        tuple(dict.fromkeys(peers)),
        ", ".join(commits),
        dates[-1],
        round(math.exp(sum(mfus) / len(mfus)), 4) if mfus else None,
    )


def summary_lines(folder: str, files: dict) -> list[str]:
    """One device's part of the summary: a table of the measures, tkern ahead first,
    and the measures never measured in this run in one line."""
    found, missing = [], []
    for m in MEASURES:
        result = compare(m, files.get(m.stem, {}))
        if isinstance(result, Comparison):
            found.append(result)
        else:
            missing.append(m.label if result is None else f"{m.label} ({result})")
    device = next((p.get("device") for p in files.values() if p.get("device")), folder)
    lines = [f"**{device}**, newest run {newest(files)[:10] or '?'}:", ""]
    if found:
        lines += [
            "| measure | tkern | against the best peer measured | tkern's MFU | commit | date |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for c in sorted(found, key=lambda c: -c.ratio):
            over = f" (geomean of {c.cases} cases)" if c.cases > 1 else ""
            lines.append(
                f"| {c.measure.label}{over} | **{c.verdict()}, {c.ratio:.2f}x** | {' / '.join(c.peers)} "
                f"| {'' if c.mfu is None else f'{c.mfu:.1%}'} | {c.commit} | {c.date} |"
            )
        lines.append("")
    if missing:
        lines += [f"Not measured on this device: {'; '.join(missing)}.", ""]
    return lines


def render_summary(folders: list[tuple[str, str, dict]]) -> str:
    """ "What tkern is faster at": per GPU device, newest first, each measure of
    :data:`MEASURES` as tkern against the best peer of the same run, from the
    results files alone (``folders``: report.py's ``(folder, "gpu" or "cpu", files)``,
    newest first)."""
    lines = [
        "### What tkern is faster at",
        "",
        "Per device, newest first: tkern against the fastest other implementation measured in the same",
        "run (the best peer), as the peer's time over tkern's (for memory, the peer's peak over tkern's):",
        f"above 1 tkern is ahead; within {PAR:g}x of 1 is on par; over several cases, their geometric",
        "mean. Beside it tkern's MFU where its rows record one (model FLOPs over the device's dense",
        "peak: 16-bit for a training step, fp8 for an fp8 GEMM). Generated by `benchmarks/report.py`",
        "from `benchmarks/results/<device>/*.json` alone; a measure no run has made is listed as such.",
        "",
    ]
    gpu = [(f, files) for f, where, files in folders if where == "gpu" and files]
    if not gpu:
        return "\n".join([*lines, "No GPU run has been recorded yet."])
    for folder, files in gpu:
        lines += summary_lines(folder, files)
    return "\n".join(lines).rstrip()


#: activation_memory.json's impls, as the README's table names them
ACTIVATION_RECIPES = {
    "torch autocast": "torch autocast",
    "tkern GEMMs only": "tkern GEMMs",
    "tkern + norms": "tkern GEMMs + norms",
    "tkern + norms + fused loss": "tkern GEMMs + norms + fused loss",
}


def activation_memory_table(payload: dict) -> list[str]:
    """What one GPT-2 training step saves for backward, per recipe (results/host/activation_memory.json)."""
    rows = [r for r in payload.get("rows", []) if r.get("saved MiB") is not None]
    if not rows:
        return []
    config = payload.get("config", {})
    lines = [
        f"Activation memory of one training step of a small GPT-2 ({config.get('n_layer')} layers, "
        f"{config.get('n_embd')} wide, the full {config.get('vocab_size')}-token vocabulary), "
        "measured on a CPU "
        f"(`benchmarks/bench_activation_memory.py`, {payload.get('date')}, commit {payload.get('commit')}; "
        "[the whole table](benchmarks/results/host/activation_memory.md)):",
        "",
        "| recipe | saved for backward, MiB | of which norms | largest tensor, MiB |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        name = ACTIVATION_RECIPES.get(r["impl"], r["impl"])
        lines.append(f"| {name} | {r['saved MiB']:.1f} | {r['norms MiB']:.3g} | {r['largest MiB']:.3g} |")
    return [*lines, ""]
