"""One optimizer step (check + unscale + AdamW update + loss-scale update) for
1M to 1B parameters and for a model of 1000 tensors of 10k, against:

(a) PyTorch's standard AMP: fp32 params, GradScaler + AdamW(fused=True);
(b) the same with AdamW(foreach=True);
(c) master weights by hand in torch (apex O2 / fastai): fp16 model, fp32
    master; copy grads to fp32, unscale, check, AdamW on the master, copy back;
(d) (c) with its two pure parts torch.compile'd (unscale + check; the AdamW
    update + copy back), static shapes, the host sync between them outside.

GB/s counts the minimal bytes of the update every variant performs, Adam with
fp16 params: 30 B/param (../shared/DESIGN.md): pass 1 reads the fp16 grad
(2); pass 2 reads grad, master, m, v (2 + 4 + 8) and writes master, m, v and
the fp16 copy (4 + 8 + 2). It is compared with the measured copy bandwidth.
Also measured, at 10M params: what loss scaling adds to a step (check,
unscale, scale update: scaled step minus the bare optimizer step) and the
host synchronizations per step (torch.cuda.set_sync_debug_mode), for tkern's
scaler and for GradScaler with a fused and a foreach AdamW.
Targets on H100/H200: >= 1.0x (a) at every size and >= 1.5x (a) at >= 100M
params (a, fused AdamW, is the headline baseline; b beside it); >= 85% of copy
bandwidth at >= 100M params; ahead of (d); >= 3x (b) on the many-small-tensors
model. ``syncs_per_step`` is averaged over 20 steps (0 for tkern is the claim).

The CUDA-graphed step (issues 16, 31): ``tkern`` runs with the optimizer's
default ``cuda_graph=None`` (a graph wherever it can be); at 1M and 10M params
``tkern eager`` beside it has ``cuda_graph=False``. Every tkern row records
``cuda_graph``, ``graph_fallback`` (why its last step ran eager; None when it
replayed) and the captures and replays counted through the optimizer's
``graph_runner`` seam.

Memory modes (issue 18), section ``modes``: every ``master=`` ("fp32",
"split", "none") x ``state_dtype=`` (fp32, bf16, uint8) of FusedAdamW on bf16
params (``split`` needs them) at 100M and 1B params, a bare step (bf16 needs no
loss scale), each against its byte floor (:func:`floor_bytes_per_param` over
the measured copy bandwidth; ``vs_floor`` = ms / floor ms, target <= 1.1) and
against torchao's ``AdamW8bit`` and ``_AdamW(bf16_stochastic_round=True)`` on
the same bf16 params (torchao compiles its step per param tensor; in smoke
mode with Dynamo's ``eager`` backend, so no Inductor build on a CPU).

Mixed-precision health (issue 37 item 7), section ``health``: tkern's scaled step at
10M fp16 params with health tracking off (the default), with overflow tracking on
(``opt.track_overflows``), and with underflow sampling (``opt.track_underflows``)
every step (the worst case: every step also reads the gradients once more, in three
launches after its graph's replay) and every 100 steps. Each timed call runs HEALTH_BLOCK (100) steps, so it
holds exactly one sampled step at every=100 and the median call is the amortised
cost; rows record ms per step. Target: the step with overflow tracking and sampling
every 100 steps <= 1.02x the step with tracking off (``health_10M_k100_vs_off``);
tracking alone and every=1 are figures beside it.

The grid-wide one-pass step (issue 45 item 3), section ``grid``: the graphed 1M step with
``opt.one_pass = "grid"`` (statistics, update and step count in one launch of up to one
program per SM, meeting at a grid barrier) beside tkern's default graphed step (two passes
at 1M) and torch's graphed capturable fused AdamW + GradScaler (e), all three in this run on
this device. Target: >= 1.0x (e) (``grid_1M_vs_e``); ``grid_1M_vs_default`` says whether
``one_pass="auto"`` should take the grid path at 1M. The results are saved before the grid
row, so a barrier that hung would lose only that row.

A variant that raises is recorded under ``failed`` in optimizer.json (and
printed last) and the others are still measured and written; results are
saved after every case, so a timeout loses only the case in progress.
``--sections`` picks what runs (default: modes, sizes, overhead, in that
order: the never-measured rows first).
"""

from __future__ import annotations

import functools
import gc
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Mode,
    Results,
    bench,
    copy_bandwidth,
    error_line,
    setup,
)  # noqa: E402
from optimizer_steps import (  # noqa: E402
    BETAS,
    EPS,
    LR,
    SYNC_STEPS,
    WEIGHT_DECAY,
    TkernStep,
    adamw_update,
    count_syncs,
    health_step,
    make_grads,
    master_by_hand,
    tkern_step,
    torch_amp_graphed_step,
    torch_amp_step,
    torchao_step,
    unscale_and_check,
)

#: names moved to the modules above that tests and scripts still read from this one
__all__ = [
    "BETAS",
    "EPS",
    "LR",
    "SYNC_STEPS",
    "WEIGHT_DECAY",
    "adamw_update",
    "make_grads",
    "unscale_and_check",
]


BYTES_PER_PARAM = 30
SIZES = {
    "1M": [1 << 20],
    "10M": [10 << 20],
    "100M": [100 << 20],
    "1B": [1 << 30],
    "1000x10k": [10_000] * 1000,
}
SMOKE_SIZES = {"4k": [4096], "20x100": [100] * 20}
SECTIONS = ("modes", "sizes", "overhead", "health", "grid")
#: Where the graphed step is compared with ``cuda_graph=False`` (launch-bound sizes).
GRAPH_CASES = ("1M", "10M", "4k")
#: torch's own graphed step, tkern's graphed step's peer at GRAPH_CASES
GRAPHED_TORCH = "(e) (a) capturable, CUDA graph"
MASTER_MODES = ("fp32", "split", "none")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "uint8": torch.uint8}
MODE_SIZES = {"100M": 100 << 20, "1B": 1 << 30}
SMOKE_MODE_SIZES = {"8k": 8192}  # >= 4096 elements: the 8-bit state is used (MIN_8BIT_SIZE)
#: 8-bit state: one fp32 absmax per block of this many values (tkern and bitsandbytes)
QBLOCK = 256
#: "within 10% of its byte floor": measured ms <= FLOOR_MARGIN x floor ms
FLOOR_MARGIN = 1.1
#: The health section: its case (size), the variants (None: tracking off; 0: overflow
#: tracking only; k: underflow sampling every k steps, with overflow tracking), the steps
#: per timed call (a multiple of every k, so each call holds the same sampled steps) and
#: the bound on the amortised cost (issue 37 item 7: at most 2% of the step at 10M params).
HEALTH_CASE, SMOKE_HEALTH_CASE = "10M", "4k"
HEALTH_OFF = "tkern health off"
HEALTH_VARIANTS = {
    HEALTH_OFF: None,
    "tkern overflow tracking": 0,
    "tkern underflow every 1": 1,
    "tkern underflow every 100": 100,
}
HEALTH_BLOCK = 100
HEALTH_BOUND = 1.02
#: The grid section's size (SIZES / SMOKE_SIZES) and its tkern row with one_pass="grid".
GRID_CASE, SMOKE_GRID_CASE = "1M", "4k"
GRID_TKERN = "tkern one_pass=grid"


def floor_bytes_per_param(master: str, state_dtype: str) -> float:
    """The fewest bytes one AdamW step on bf16 params moves per param: pass 1
    reads the grad (2); pass 2 reads the grad (2) and reads and writes the
    master's part and the two moments, and writes the param. Master: "fp32"
    reads 4 and writes 4 + the param's 2; "split" reads and writes the bf16 param
    and its int16 remainder (2 + 2 each way); "none" reads and writes the param
    (2 each way). Moments: fp32 8 each way, bf16 4, uint8 2 plus one fp32 absmax
    per QBLOCK values of each moment (2 x 4 / 256 each way)."""
    master_rw = {"fp32": 4 + 4 + 2, "split": 4 + 4, "none": 2 + 2}[master]
    state_rw = {"fp32": 16.0, "bf16": 8.0, "uint8": 2 * (2 + 2 * 4 / QBLOCK)}[state_dtype]
    return 2 + 2 + master_rw + state_rw


def _record_failure(failed: list[dict], case: str, impl: str, exc: Exception) -> None:
    traceback.print_exc()
    error = error_line(exc)
    failed.append({"case": case, "impl": impl, "error": error})
    print(f"{case} {impl}: FAILED ({error}); the other variants go on")


def _finite_or_none(x: float, digits: int = 3) -> float | None:
    return round(x, digits) if x == x and abs(x) != float("inf") else None


def _measure(
    res: Results,
    mode: Mode,
    case: str,
    impl: str,
    make: Callable[[], Callable],
    *,
    rep_ms: int = 200,
    steps_per_call: int = 1,
) -> dict | None:
    """Build ``make()``'s step, time it and count its host syncs: the row's fields
    (``ms``, percentiles, syncs, and a tkern step's CUDA-graph fields; times per step,
    each timed call running ``steps_per_call`` steps), or None when it ran out of
    memory (printed) or raised (listed under ``failed``)."""
    step = None
    try:
        step = make()

        def call(step=step) -> None:
            for _ in range(steps_per_call):
                step()

        ms, lo, hi = bench(step if steps_per_call == 1 else call, mode, rep_ms=rep_ms)
        k = steps_per_call
        fields = {
            "ms": ms / k,
            "syncs_per_step": count_syncs(step, mode),
            "ms_p20": round(lo / k, 5),
            "ms_p80": round(hi / k, 5),
        }
        if isinstance(step, TkernStep):
            fields.update(step.fields())
        return fields
    except torch.OutOfMemoryError:
        print(f"{case} {impl}: out of memory, skipped")
    except Exception as exc:  # record it, keep the other variants' numbers
        _record_failure(res.meta["failed"], case, impl, exc)
    finally:
        step = None
        _release(mode)
    return None


def _release(mode: Mode) -> None:
    gc.collect()
    if mode.device.type == "cuda":
        torch.cuda.empty_cache()


def run_modes(res: Results, mode: Mode, copy_gbps: float) -> None:
    """Every master= x state_dtype= mode at 100M and 1B params against its byte
    floor, and torchao's 8-bit and stochastic-rounding AdamW beside them."""
    variants: dict[str, tuple[Callable, float, dict]] = {}
    for master in MASTER_MODES:
        for tag, state_dtype in STATE_DTYPES.items():
            options = {"master": master, "state_dtype": state_dtype}
            make = functools.partial(tkern_step, scaled=False, dtype=torch.bfloat16, **options)
            variants[f"tkern master={master} state={tag}"] = (
                make,
                floor_bytes_per_param(master, tag),
                {"master": master, "state_dtype": tag},
            )
    try:
        import torchao.optim  # noqa: F401
    except ImportError as exc:  # recorded, not silently missing
        res.meta["torchao_missing"] = f"{type(exc).__name__}: {exc}"
        print(f"torchao is not importable ({exc}): its AdamW8bit and _AdamW rows are skipped")
    else:
        for impl, eight_bit, peer in (
            ("torchao AdamW8bit", True, ("none", "uint8")),
            ("torchao _AdamW bf16 stochastic round", False, ("none", "bf16")),
        ):
            make = functools.partial(torchao_step, smoke=mode.smoke, eight_bit=eight_bit)
            variants[impl] = (
                make,
                floor_bytes_per_param(*peer),
                {"peer_of": "master={} state={}".format(*peer)},
            )
    for case, n in (SMOKE_MODE_SIZES if mode.smoke else MODE_SIZES).items():
        case = f"modes {case}"
        for impl, (make, floor_bpp, extra) in variants.items():
            row = _measure(res, mode, case, impl, functools.partial(make, [n], mode.device))
            if row is None:
                continue
            ms = row.pop("ms")
            floor_ms = n * floor_bpp / (copy_gbps * 1e9) * 1e3
            gbps = n * floor_bpp / (ms * 1e-3) / 1e9
            res.add(
                case,
                impl,
                ms,
                **extra,
                bytes_per_param=round(floor_bpp, 4),
                floor_ms=round(floor_ms, 5),
                vs_floor=round(ms / floor_ms, 3),
                gbps=round(gbps, 1),
                pct_copy=round(100 * gbps / copy_gbps, 1),
                **row,
            )
        res.save()


def run_sizes(res: Results, mode: Mode, copy_gbps: float) -> None:
    """The headline step (fp16 params, scaled) at 1M-1B params and 1000 x 10k
    against torch's (a)-(d); at 1M and 10M tkern with cuda_graph=False beside it."""
    # Real compiles on the GPU; in smoke mode Dynamo's tracing and guards alone
    # (where torch 2.11 crashed), without minutes of Inductor codegen on a CPU.
    backend = "eager" if mode.smoke else "inductor"
    variants = {  # baselines first: a run cut by its time limit keeps what tkern is compared with
        "(a) GradScaler+AdamW fused": lambda s, d: torch_amp_step(s, d, fused=True),
        GRAPHED_TORCH: torch_amp_graphed_step,
        "(b) GradScaler+AdamW foreach": lambda s, d: torch_amp_step(s, d, foreach=True),
        "(c) master by hand": master_by_hand,
        "(d) compiled (c)": lambda s, d: master_by_hand(s, d, compile_backend=backend),
        "tkern": tkern_step,
        "tkern eager (cuda_graph=False)": functools.partial(tkern_step, cuda_graph=False),
    }
    if mode.smoke:  # fused AdamW and CUDA graphs are CUDA-only here
        variants.pop("(a) GradScaler+AdamW fused")
        variants.pop(GRAPHED_TORCH)
    for case, sizes in (SMOKE_SIZES if mode.smoke else SIZES).items():
        n = sum(sizes)
        for impl, make in variants.items():
            if (impl.startswith("tkern eager") or impl == GRAPHED_TORCH) and case not in GRAPH_CASES:
                continue  # the graph pays where launches dominate; the big sizes are bandwidth
            if impl == "(d) compiled (c)" and len(sizes) > 100 and not mode.smoke:
                # Inductor takes minutes on a 1000-tensor graph; no target needs it.
                print(f"{case} {impl}: not timed (compile time of a {len(sizes)}-tensor graph)")
                continue
            row = _measure(res, mode, case, impl, functools.partial(make, sizes, mode.device))
            if row is None:
                continue
            ms = row.pop("ms")
            gbps = n * BYTES_PER_PARAM / (ms * 1e-3) / 1e9
            res.add(case, impl, ms, gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1), **row)
        res.save()  # after every case: a later crash or a timeout loses nothing measured


def run_overhead(res: Results, mode: Mode) -> None:
    """What loss scaling adds to a step (check + unscale + scale update), and its host syncs."""
    overhead_case = "4k" if mode.smoke else "10M"
    overhead = {
        "tkern": (lambda s, d: tkern_step(s, d, scaled=False), tkern_step),
        "AdamW foreach": (
            lambda s, d: torch_amp_step(s, d, scaled=False, foreach=True),
            lambda s, d: torch_amp_step(s, d, foreach=True),
        ),
    }
    if not mode.smoke:
        overhead["AdamW fused"] = (
            lambda s, d: torch_amp_step(s, d, scaled=False, fused=True),
            lambda s, d: torch_amp_step(s, d, fused=True),
        )
    sizes = (SMOKE_SIZES if mode.smoke else SIZES)[overhead_case]
    for impl, (bare, scaled) in overhead.items():
        case = f"scaler overhead {overhead_case}"
        label = f"{impl} + {'tkern scaler' if impl == 'tkern' else 'GradScaler'}"
        row_bare = _measure(
            res, mode, case, f"{impl} (no scaler)", functools.partial(bare, sizes, mode.device)
        )
        row = _measure(res, mode, case, label, functools.partial(scaled, sizes, mode.device))
        if row_bare is None or row is None:
            continue
        ms = row.pop("ms")
        res.add(case, label, ms, overhead_ms=round(ms - row_bare["ms"], 5), **row)
    res.save()


def run_health(res: Results, mode: Mode) -> None:
    """What overflow tracking and underflow sampling add to the scaled step (ms per step,
    HEALTH_BLOCK steps per timed call; in smoke mode 2, every=100 sampling every 2nd step
    so that its path runs)."""
    size = SMOKE_HEALTH_CASE if mode.smoke else HEALTH_CASE
    sizes = (SMOKE_SIZES if mode.smoke else SIZES)[size]
    block = 2 if mode.smoke else HEALTH_BLOCK
    case = f"health {size}"
    for impl, every in HEALTH_VARIANTS.items():
        every = min(every, block) if every else every
        make = functools.partial(health_step, sizes, mode.device, every)
        row = _measure(res, mode, case, impl, make, rep_ms=1000, steps_per_call=block)
        if row is not None:
            ms = row.pop("ms")
            res.add(
                case, impl, ms, steps_per_call=block, underflow_every=every,
                track_overflows=every is not None, **row,
            )  # fmt: skip
    res.save()


def run_grid(res: Results, mode: Mode, copy_gbps: float) -> None:
    """The graphed 1M step with one_pass="grid" against tkern's default graphed step and
    torch's graphed capturable fused AdamW + GradScaler, measured here together."""
    size = SMOKE_GRID_CASE if mode.smoke else GRID_CASE
    sizes = (SMOKE_SIZES if mode.smoke else SIZES)[size]
    n, case = sum(sizes), f"grid {size}"
    variants = {  # the baselines first; the grid row last (its barrier has never run on a GPU)
        GRAPHED_TORCH: torch_amp_graphed_step,
        "tkern": tkern_step,
        GRID_TKERN: functools.partial(tkern_step, one_pass="grid"),
    }
    if mode.smoke:  # torch's fused AdamW and CUDA graphs are CUDA-only here
        variants.pop(GRAPHED_TORCH)
    for impl, make in variants.items():
        res.save()  # what is measured is written before the next variant runs
        row = _measure(res, mode, case, impl, functools.partial(make, sizes, mode.device))
        if row is not None:
            ms = row.pop("ms")
            gbps = n * BYTES_PER_PARAM / (ms * 1e-3) / 1e9
            res.add(case, impl, ms, gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1), **row)
    res.save()


def summarize(res: Results, copy_gbps: float) -> list[str]:
    """The headline ratios into ``res.meta`` (what report.py reads), and their lines."""
    summary = [
        f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s; minimal bytes: {BYTES_PER_PARAM} B/param"
    ]
    # The headline baseline is torch's best: GradScaler + AdamW(fused=True);
    # foreach is printed beside it, never instead of it.
    for case in ("1M", "10M", "100M", "1B"):
        pct = next((r["pct_copy"] for r in res.rows if r["case"] == case and r["impl"] == "tkern"), None)
        vs_a = _finite_or_none(res.ratio(case, "tkern", "(a) GradScaler+AdamW fused"))
        vs_b = _finite_or_none(res.ratio(case, "tkern", "(b) GradScaler+AdamW foreach"))
        vs_d = _finite_or_none(res.ratio(case, "tkern", "(d) compiled (c)"))
        big = case in ("100M", "1B")
        summary.append(
            f"{case}: tkern {vs_a}x GradScaler + fused AdamW (target >= {1.5 if big else 1.0}), "
            f"{vs_b}x foreach, {vs_d}x compiled master recipe (target > 1)"
            + (f"; {pct}% of copy bandwidth (target >= 85%)" if big else "")
        )
        res.meta[f"{case}_pct_copy"] = pct
        res.meta[f"{case}_vs_a"] = vs_a
        res.meta[f"{case}_vs_b"] = vs_b
        res.meta[f"{case}_vs_d"] = vs_d
        if case in GRAPH_CASES:
            graphed = _finite_or_none(res.ratio(case, "tkern", "tkern eager (cuda_graph=False)"))
            res.meta[f"{case}_graph_vs_eager"] = graphed
            vs_e = _finite_or_none(res.ratio(case, "tkern", GRAPHED_TORCH))
            res.meta[f"{case}_vs_e"] = vs_e
            summary.append(
                f"{case}: the graphed step {graphed}x the eager one (cuda_graph=False); "
                f"{vs_e}x torch's graphed capturable fused AdamW + GradScaler"
            )
    small_a = _finite_or_none(res.ratio("1000x10k", "tkern", "(a) GradScaler+AdamW fused"))
    small_b = _finite_or_none(res.ratio("1000x10k", "tkern", "(b) GradScaler+AdamW foreach"))
    res.meta["many_small_vs_a"] = small_a
    res.meta["many_small_vs_b"] = small_b
    summary.append(
        f"1000 tensors of 10k: {small_a}x GradScaler + fused AdamW; {small_b}x foreach (target >= 3)"
    )
    for r in res.rows:
        if not r["case"].startswith("modes ") or "vs_floor" not in r:
            continue
        size = r["case"].split()[1]
        if r["impl"].startswith("tkern "):
            key = f"{size}_{r['master']}_{r['state_dtype']}_vs_floor"
            res.meta[key] = r["vs_floor"]
            summary.append(
                f"{size} {r['impl']}: {r['vs_floor']}x its floor of {r['bytes_per_param']} B/param "
                f"(target <= {FLOOR_MARGIN})"
            )
    grid = next((r["case"] for r in res.rows if r["case"].startswith("grid ")), None)
    if grid is not None:
        size = grid.split()[1]
        vs_e = _finite_or_none(res.ratio(grid, GRID_TKERN, GRAPHED_TORCH))
        vs_default = _finite_or_none(res.ratio(grid, GRID_TKERN, "tkern"))
        res.meta[f"grid_{size}_vs_e"] = vs_e
        res.meta[f"grid_{size}_vs_default"] = vs_default
        summary.append(
            f"grid {size}: the graphed grid-wide one-pass step {vs_e}x torch's graphed capturable "
            f"fused AdamW + GradScaler (target >= 1.0), {vs_default}x tkern's default graphed step"
        )
    size = next((r["case"].split()[1] for r in res.rows if r["case"].startswith("health ")), None)
    for impl, every in HEALTH_VARIANTS.items():
        if every is None or size is None:  # (no health rows: the section did not run)
            continue
        tag = "tracking" if every == 0 else f"k{every}"
        cost = _finite_or_none(res.ratio(f"health {size}", HEALTH_OFF, impl))
        res.meta[f"health_{size}_{tag}_vs_off"] = cost
        bound = f" (target <= {HEALTH_BOUND})" if every == 100 else ""
        summary.append(f"health {size}: {impl} {cost}x the step with tracking off{bound}")
    for size in MODE_SIZES:
        for impl, peer in (
            ("torchao AdamW8bit", "tkern master=none state=uint8"),
            ("torchao _AdamW bf16 stochastic round", "tkern master=none state=bf16"),
        ):
            ratio = _finite_or_none(res.ratio(f"modes {size}", peer, impl))
            tag = "adamw8bit" if "8bit" in impl else "adamw_sr"
            res.meta[f"{size}_none_vs_torchao_{tag}"] = ratio
            summary.append(f"{size}: {peer} {ratio}x {impl}")
    return summary


def main(argv: list[str] | None = None) -> Results:
    mode, args = setup("optimizer", __doc__, argv, sections=SECTIONS)
    # a subset of the sections adds its rows to the file (a GPU session splits them across calls)
    res = Results("optimizer", mode, metric="gbps", merge=tuple(args.sections) != SECTIONS)
    res.meta["failed"] = []  # (case, impl, error) of every variant that raised
    copy_gbps = copy_bandwidth(mode)
    res.meta["copy_gbps"] = round(copy_gbps, 1)
    res.meta["floor_margin"] = FLOOR_MARGIN
    for section in args.sections:
        if section == "modes":
            run_modes(res, mode, copy_gbps)
        elif section == "sizes":
            run_sizes(res, mode, copy_gbps)
        elif section == "overhead":
            run_overhead(res, mode)
        elif section == "health":
            run_health(res, mode)
        else:
            run_grid(res, mode, copy_gbps)
    summary = summarize(res, copy_gbps)  # in smoke mode too: the code path is checked
    for f in res.meta["failed"]:
        summary.append(f"FAILED {f['case']} {f['impl']}: {f['error']}")
    res.save(plot=True)
    res.print_table(
        [
            "ms",
            "gbps",
            "pct_copy",
            "vs_floor",
            "overhead_ms",
            "syncs_per_step",
            "cuda_graph",
            "graph_replays",
        ],
        summary,
    )
    return res


if __name__ == "__main__":
    main()
