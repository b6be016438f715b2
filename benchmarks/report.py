"""Render the README's GPU results table from benchmarks/results/<device>/*.json.

    python benchmarks/report.py           # print the table
    python benchmarks/report.py --write   # replace it in README.md, between the markers

Only recorded figures appear; a device folder without a file leaves its cells empty.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"

# (file, key in its JSON, what it is, target). The ceilings come from
# ceilings.json (benchmarks/harness.py), the one file that measures them.
# The models bench_train.py times: (case as it names it, label here).
TRAIN_MODELS = [
    ("mlp 784-4096-10, batch 8192", "2-layer MLP"),
    ("mlp 8x4096, batch 8192", "8 x 4096 MLP"),
    ("gpt2-small, seq 1024, batch 16", "GPT-2 small"),
]

HEADLINES = [
    (
        "gemm",
        "fp16_square_ge2048_vs_cublas",
        "GEMM fp16 / cuBLAS, geomean of square sizes >= 2048",
        ">= 0.95x",
    ),
    (
        "gemm",
        "fp16_transformer_vs_cublas",
        "GEMM fp16 / cuBLAS, geomean of the transformer shapes (M = 8192)",
        ">= 0.95x",
    ),
    (
        "gemm",
        "bf16_square_ge2048_vs_cublas",
        "GEMM bf16 / cuBLAS, geomean of square sizes >= 2048",
        ">= 0.95x",
    ),
    (
        "gemm",
        "bf16_transformer_vs_cublas",
        "GEMM bf16 / cuBLAS, geomean of the transformer shapes",
        ">= 0.95x",
    ),
    (
        "gemm",
        "fp16_tma_square_ge2048_vs_cublas",
        "the same, persistent TMA schedule (matmul_tma_persistent: every shape)",
        ">= 0.95x",
    ),
    ("gemm", "fp16_tma_transformer_vs_cublas", "transformer shapes, persistent TMA schedule", ">= 0.95x"),
    (
        "gemm",
        "fused_bias_gelu_fwd_speedup",
        "linear + bias + GELU fused vs torch unfused (autocast), forward",
        ">= 1.1x",
    ),
    ("gemm", "fused_bias_gelu_fwd_bwd_speedup", "the same, forward + backward", ""),
    ("ceilings", "copy_gbps", "device copy bandwidth, GB/s (read + write)", "ceiling"),
    ("ceilings", "cublas_fp16_8192_tflops", "cuBLAS fp16 8192^3, TFLOP/s", "ceiling"),
    ("optimizer", "100M_pct_copy", "AdamW step at 100M params, % of copy bandwidth (30 B/param)", ">= 85%"),
    ("optimizer", "1B_pct_copy", "AdamW step at 1B params, % of copy bandwidth", ">= 85%"),
    ("optimizer", "1M_vs_a", "optimizer + scaler step at 1M vs GradScaler + AdamW(fused=True)", ">= 1.0x"),
    ("optimizer", "10M_vs_a", "the same at 10M", ">= 1.0x"),
    ("optimizer", "100M_vs_a", "the same at 100M", ">= 1.5x"),
    ("optimizer", "1B_vs_a", "the same at 1B", ">= 1.5x"),
    ("optimizer", "100M_vs_d", "step at 100M vs torch.compile'd master-weights recipe", "> 1x"),
    ("optimizer", "many_small_vs_a", "1000 tensors of 10k vs GradScaler + AdamW(fused=True)", ""),
    ("optimizer", "many_small_vs_b", "1000 tensors of 10k vs GradScaler + AdamW(foreach=True)", ">= 3x"),
    (
        "host",
        "step_us_per_tensor_1000",
        "FusedAdamW.step host time per param tensor at 1000 tensors, us (launches stubbed)",
        "<= 1",
    ),
    (
        "host",
        "linear_fwd_own_us",
        "tkern.linear forward: its own host time, us (launches stubbed; beyond an autograd.Function's)",
        "<= 10",
    ),
    (
        "host",
        "linear_bwd_own_us",
        "tkern.linear backward: its own host time, us (launches stubbed; beyond an autograd.Function's)",
        "<= 20",
    ),
    *[
        row
        for model, label in TRAIN_MODELS
        for row in (
            (
                "train",
                # the key before bench_train named its recipes "torch ...": "vs autocast"
                (f"{model}: vs torch autocast", f"{model}: vs autocast"),
                f"training step, {label}, vs autocast + GradScaler",
                ">= 1.2x",
            ),
            (
                "train",
                f"{model}: vs torch autocast compiled",
                "the same vs autocast under torch.compile",
                ">= 1.0x",
            ),
            ("train", f"{model}: peak vs autocast", "peak memory vs autocast's", "<= 0.9x"),
        )
    ],
]


def load(results: Path) -> dict[str, dict[str, dict]]:
    """{device folder: {file stem: payload}}; a folder is a device's when it holds
    a file that only a GPU run writes (``results/host/`` and ``results/static/`` do not)."""
    stems = {"ceilings", "gemm", "optimizer", "train"}  # what only a GPU run writes
    out: dict[str, dict[str, dict]] = {}
    if results.is_dir():
        for path in sorted(results.glob("*/*.json")):
            out.setdefault(path.parent.name, {})[path.stem] = json.loads(path.read_text())
    return {folder: files for folder, files in out.items() if stems & files.keys()}


def run_of(payload: dict, value) -> str:
    """Which run a row's figure came from: its file's date and commit."""
    if value is None:
        return ""
    return f"{payload.get('date', '?')}, commit {payload.get('commit', 'not recorded')}"


def render(results: Path = RESULTS) -> str:
    data = load(results)
    if not data:
        return (
            "No GPU results have been measured yet: `benchmarks/results/` holds none. A session with an\n"
            "H100 or H200 runs `benchmarks/gpu_check.sh`, commits what it writes, and regenerates this\n"
            "table with `python benchmarks/report.py --write`."
        )
    lines = []
    for folder, files in data.items():
        any_payload = next(iter(files.values()))
        lines.append(
            f"**{any_payload['device']}** (torch {any_payload['torch']}, triton {any_payload['triton']}, "
            f"{any_payload['date']}; `benchmarks/results/{folder}/`). fp16 unless named; "
            "ratios are speed (higher is better)."
        )
        lines.append("")
        lines.append("| measure | value | target | run |")
        lines.append("| --- | --- | --- | --- |")
        for stem, key, label, target in HEADLINES:
            payload = files.get(stem, {})
            keys = key if isinstance(key, tuple) else (key,)
            value = next((payload[k] for k in keys if payload.get(k) is not None), None)
            lines.append(
                f"| {label} | {'' if value is None else value} | {target} | {run_of(payload, value)} |"
            )
        for stem, payload in files.items():
            for f in payload.get("failed", []):
                lines.append("")
                lines.append(f"`bench_{stem}.py` failed on {f['case']}, {f['impl']}: `{f['error']}`")
        lines.append("")
    return "\n".join(lines).rstrip()


def write_readme(text: str, readme: Path = ROOT / "README.md") -> None:
    content = readme.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{readme} has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", content))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args()
    text = render()
    if args.write:
        write_readme(text)
    print(text)


if __name__ == "__main__":
    main()
