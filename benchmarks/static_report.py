"""Compiler facts about every tkern kernel, for NVIDIA and AMD targets, on any machine.

Triton's compiler runs without a GPU: each kernel is compiled ahead of time with
``triton.compile`` for a target of tkern.device.SPECS (``GPUTarget(*spec.target)``:
``("cuda", 90, 32)``, ``("hip", "gfx942", 64)``, ...), and its artifacts are read with
the ``cuobjdump`` and ``nvdisasm`` shipped in the triton wheel (AMD: the AMDGCN and its
hsaco metadata, aot_read.analyse_amdgcn): registers, local memory (spills),
shared memory, an occupancy estimate, wgmma / mma.sync / cp.async / TMA use,
layout conversions left in the TTGIR, and the width of every global access per
kernel argument (traced through the PTX). These are compiler facts, not
timings: they say what the GPU would run, not how fast.

The cases mirror what the launchers pass (the same block sizes, warps, configs
and constexpr flags, read from the kernel modules): the signatures Triton
would specialise for tkern's flat layout (every buffer 16-byte aligned, every
length a multiple of 16 elements, see tkern/flat/) and for the tails and
ragged GEMMs the launchers also produce. ``tests/test_compiled.py`` asserts on
the same records (the compile gate); this script writes them to
``benchmarks/results/static/`` as JSON and a Markdown table.

Usage (compiled mode: tkern must not switch on the interpreter)::

    TRITON_INTERPRET=0 python benchmarks/static_report.py [--targets 90 80] [--only adam] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from aot_cases import _stats_cases, all_cases, cross_entropy_cases, fp8_planned, rotary_cases
from aot_compile import _compile_star, compile_case, ordered_accesses, ordered_accesses_amdgcn, reduce_layouts
from aot_fp8_cases import (
    BLOCKWISE_LAUNCHES,
    FP8_EMIT_LAUNCHES,
    FP8_GEMM_LAUNCHES,
    FP8_HEAVIEST,
    _fp8_emit_cases,
    _fp8_gemm_cases,
    blockwise_cases,
    blockwise_configs_for,
    emit_configs_for,
    fp8_case_name,
    fp8_cast_cases,
    fp8_configs_for,
)
from aot_gemm_cases import (
    CONV1D_WGRAD_INTO,
    DGRAD_EPILOGUE_LAUNCHES,
    GLU_DGRAD_LAUNCHES,
    GLU_FWD_LAUNCHES,
    RESIDUAL_LAUNCHES,
    ROW_STATS_LAUNCHES,
    TMA_CONV1D_WGRAD_INTO,
    TMA_RAGGED_GATE_LAUNCHES,
    TMA_STORE_GATE_LAUNCHES,
    TMA_WGRAD_INTO,
    GemmLaunch,
    gate_launches,
    gemm_configs_for,
    linear_launches,
    pointer_case,
    split_k_cases,
    tma_case,
    transcendental,
)
from aot_gemm_sweep import offered, pointer_heaviest, pointer_others, tma_heaviest
from aot_read import analyse, ptx_accesses
from aot_targets import (
    EVERY_CONFIG,
    FIRST_CONFIG,
    Case,
    cfg_name,
    depth,
    every_variant,
    gate_targets,
    occupancy,
    smem_limit,
    spec_of,
)

#: names moved to the modules above that tests and scripts still read from this one
__all__ = [
    "BLOCKWISE_LAUNCHES",
    "Case",
    "DGRAD_EPILOGUE_LAUNCHES",
    "EVERY_CONFIG",
    "FIRST_CONFIG",
    "FP8_EMIT_LAUNCHES",
    "FP8_GEMM_LAUNCHES",
    "FP8_HEAVIEST",
    "GLU_DGRAD_LAUNCHES",
    "GLU_FWD_LAUNCHES",
    "GemmLaunch",
    "RESIDUAL_LAUNCHES",
    "ROW_STATS_LAUNCHES",
    "TMA_RAGGED_GATE_LAUNCHES",
    "TMA_STORE_GATE_LAUNCHES",
    "TMA_WGRAD_INTO",
    "CONV1D_WGRAD_INTO",
    "TMA_CONV1D_WGRAD_INTO",
    "_fp8_emit_cases",
    "_fp8_gemm_cases",
    "_stats_cases",
    "all_cases",
    "analyse",
    "blockwise_cases",
    "blockwise_configs_for",
    "cfg_name",
    "compile_all",
    "cross_entropy_cases",
    "depth",
    "emit_configs_for",
    "every_variant",
    "fp8_case_name",
    "fp8_cast_cases",
    "fp8_configs_for",
    "fp8_planned",
    "gate_launches",
    "gate_targets",
    "gemm_configs_for",
    "linear_launches",
    "occupancy",
    "offered",
    "ordered_accesses",
    "ordered_accesses_amdgcn",
    "pointer_case",
    "pointer_heaviest",
    "pointer_others",
    "ptx_accesses",
    "reduce_layouts",
    "rotary_cases",
    "smem_limit",
    "spec_of",
    "split_k_cases",
    "tma_case",
    "tma_heaviest",
    "transcendental",
]


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "static"


def run(
    targets=("sm_90", "sm_80"), only: str | None = None, workers: int = 0, full: bool = True
) -> list[dict]:
    """Compile every case for every target (``workers`` processes, 0: ``os.cpu_count()``);
    return the rows (in the same order, whatever the number of workers).
    The gate's set (``full=False``) skips the SASS counts, which it does not check."""
    cases = [(c, cc) for cc in targets for c in all_cases(cc, full) if not only or re.search(only, c.name)]
    return compile_all([(c, cc, full) for c, cc in cases], workers)


#: Kernels whose cases compile longest (the TMA and emitting GEMMs: 2-3x a pointer GEMM's)
_LONGEST = ("_matmul_tma_kernel", "_matmul_emit_kernel", "_scaled_mm_blockwise_kernel")


def compile_all(jobs: list[tuple], workers: int = 0) -> list[dict]:
    """:func:`compile_case` of each ``(case, target, sass)`` in ``jobs`` on ``workers``
    processes (0: ``os.cpu_count()``), the longest first and one at a time, so that no
    worker is left with a long compile while the other idles; the rows in ``jobs``' order."""

    def cost(job) -> int:
        case = job[0]
        return 2 if case.kernel.split(":")[1] in _LONGEST else 1 if case.family == "gemm" else 0

    order = sorted(range(len(jobs)), key=lambda i: -cost(jobs[i]))
    workers = workers or os.cpu_count() or 1
    if workers <= 1:
        rows = [compile_case(*jobs[i]) for i in order]
    else:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_compile_star, [jobs[i] for i in order], chunksize=1))
    out = [None] * len(jobs)
    for i, row in zip(order, rows, strict=True):
        out[i] = row
    return out


# --------------------------------------------------------------------------- output


def _widths(row: dict) -> str:
    acc = row.get("global_access_bits") or {}
    arrays = row.get("expected_bits") or {}
    if arrays:
        return " ".join(
            f"{a.removesuffix('_ptr')}:{'/'.join(map(str, sorted(set(acc.get(a, [])))))}" for a in arrays
        )
    return ""


def markdown(rows: list[dict], meta: dict) -> str:
    out = [
        "# Static report: what the compiler produces for each tkern kernel",
        "",
        "Compiler facts, not timings: registers per thread, local-memory spills, shared memory, an",
        "occupancy estimate from those (H100/H200 limits for sm_90, A100 for sm_80), tensor-core and",
        "copy instructions, layout conversions left in the TTGIR and the global access widths (bits) per",
        "array. Produced by `benchmarks/static_report.py` without a GPU.",
        "",
        f"triton {meta['triton']}, {meta['n_rows']} compiled variants, {meta['seconds']} s.",
        "",
        "| kernel case | target | warps | regs | spill B | smem B | occupancy | wgmma | cp.async 16B | TMA | "
        "convert_layout | access bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("compiled"):
            out.append(f"| {r['case']} | {r['target']} | FAILED: {r.get('error', '')[:80]} |||||||||")
            continue
        out.append(
            f"| {r['case']} | {r['target']} | {r['num_warps']} | {r['regs']} | {r['spill_bytes']} | "
            f"{r['smem']} | {r['occupancy_pct']}% ({r['limiter']}) | {r['wgmma']} | {r['cp_async_16']} | "
            f"{r['tma_loads']} | {r['convert_layout']} | {_widths(r)} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    targets = "of sm_80 ... sm_120, gfx942, gfx950"
    ap.add_argument("--targets", nargs="+", default=["sm_90", "sm_80"], help=targets)
    ap.add_argument("--only", help="regex on case names")
    ap.add_argument("--workers", type=int, default=0, help="0: os.cpu_count()")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for static.json and static.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--gate-set", action="store_true", help="only the compile gate's representative set")
    args = ap.parse_args(argv)
    import triton

    import tkern

    if tkern.INTERPRET:
        sys.exit("static_report compiles for GPUs: run it with TRITON_INTERPRET=0")
    t0 = time.perf_counter()
    rows = run(tuple(args.targets), args.only, args.workers, full=not args.gate_set)
    meta = dict(triton=triton.__version__, n_rows=len(rows), seconds=round(time.perf_counter() - t0, 1))
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "triton-" + triton.__version__
        (args.out / f"{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        (args.out / f"{tag}.md").write_text(markdown(rows, meta))
        print(f"wrote {args.out / tag}.json and .md")
    failed = [r for r in rows if not r.get("compiled")]
    print(f"{len(rows)} variants in {meta['seconds']} s, {len(failed)} failed to compile")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
