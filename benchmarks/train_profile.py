"""bench_train.py ``--profile``: the language models' steps under torch.profiler, each GPU
kernel put in the step ledger's categories (with its FLOPs and bytes), summed per
category against the committed ledger's floors, written as ``profile_<recipe>.csv`` and
drawn as ``profile.png``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import _picked, cases, lm_loss  # noqa: E402
from harness import device_key as harness_device_key  # noqa: E402
from harness import (  # noqa: E402
    device_name,
    error_line,
    slug,
)
from train_recipes import RECIPES, SMOKE_SKIPS, WARMUP, release, tf32, trainer_for  # noqa: E402

# --------------------------------------------------------------------------- --profile

#: steps under torch.profiler per recipe (after WARMUP), and the recipes --profile takes by default
PROFILE_STEPS = 3
PROFILE_RECIPES = ("tkern", "torch autocast compiled", "tkern fp8 tensorwise")
#: top kernels by device time a profile CSV lists per recipe
TOP_KERNELS = 15
PROFILE_FIELDS = (
    "kind", "recipe", "category", "kernel", "shapes", "launches_per_step", "ms_per_step", "share",
    "floor_ms", "tflops", "gbps", "busy_ms", "wall_ms", "commit",
)  # fmt: skip


def kernel_rows(events, spec) -> list[dict]:
    """One row per GPU kernel (and memcpy / memset) of a profile's ``events``
    (``prof.events()``): its name, device time, the ledger's category with its FLOPs and
    bytes (``step_ledger.kernel_category``), the innermost aten op's input shapes. A
    kernel finds its CPU ranges through the runtime call that launched it (its
    ``linked_correlation_id``) and that call's parents."""
    import step_ledger
    from torch.autograd import DeviceType

    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    rows = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        node = cpu.get(getattr(e, "linked_correlation_id", 0))
        node = node.cpu_parent if node is not None else None
        ancestors, shapes = [], None
        while node is not None:
            ancestors.append(node.name)
            if shapes is None and node.name.startswith("aten::"):
                shapes = node.input_shapes
            node = node.cpu_parent
        category, flops, nbytes = step_ledger.kernel_category(e.name, ancestors, shapes, spec)
        op = next((a for a in ancestors if a.startswith("aten::")), "")
        rows.append(
            {
                "kernel": e.name,
                "category": category,
                "us": e.time_range.elapsed_us(),
                "flops": flops,
                "bytes": nbytes,
                "shapes": f"{op} {shapes}" if shapes else op,
            }
        )
    return rows


def profile_summary(
    recipe: str, rows: list[dict], steps: int, wall_ms: float, floors: dict | None
) -> list[dict]:
    """A recipe's profile as CSV rows: one per category (device ms per step, share of the
    busy time, the ledger's floor), a total (busy against wall), the top kernels (with
    achieved TFLOP/s, or GB/s where the bytes are known)."""
    import step_ledger

    busy = sum(r["us"] for r in rows) / 1e3 / steps
    out = []
    for cat in step_ledger.CATEGORIES:
        mine = [r for r in rows if r["category"] == cat]
        ms = sum(r["us"] for r in mine) / 1e3 / steps
        floor = (floors or {}).get(cat)
        if mine or floor:
            out.append(
                {
                    "kind": "category",
                    "recipe": recipe,
                    "category": cat,
                    "launches_per_step": len(mine) / steps,
                    "ms_per_step": round(ms, 4),
                    "share": round(ms / busy, 4) if busy else None,
                    "floor_ms": floor,
                }
            )
    out.append({
        "kind": "total", "recipe": recipe, "ms_per_step": round(busy, 4), "busy_ms": round(busy, 4),
        "wall_ms": round(wall_ms, 4), "share": round(busy / wall_ms, 4) if wall_ms else None,
        "floor_ms": sum((floors or {}).values()) or None, "launches_per_step": len(rows) / steps,
    })  # fmt: skip
    kernels: dict[tuple, dict] = {}
    for r in rows:
        k = kernels.setdefault(
            (r["kernel"], r["category"], r["shapes"]), {"us": 0.0, "n": 0, "flops": 0, "bytes": 0}
        )
        k["us"] += r["us"]
        k["n"] += 1
        k["flops"] += r["flops"]
        k["bytes"] = None if r["bytes"] is None or k["bytes"] is None else k["bytes"] + r["bytes"]
    top = sorted(kernels.items(), key=lambda kv: (-kv[1]["us"], kv[0]))[:TOP_KERNELS]
    for (kernel, cat, shapes), k in top:
        s = k["us"] * 1e-6
        out.append(
            {
                "kind": "kernel",
                "recipe": recipe,
                "category": cat,
                "kernel": kernel[:200],
                "shapes": shapes[:200],
                "launches_per_step": k["n"] / steps,
                "ms_per_step": round(k["us"] / 1e3 / steps, 4),
                "share": round(k["us"] / 1e3 / steps / busy, 4) if busy else None,
                "tflops": round(k["flops"] / s / 1e12, 1) if k["flops"] and s else None,
                "gbps": round(k["bytes"] / s / 1e9, 1) if k["bytes"] and s else None,
            }
        )
    return out


def write_profile_csv(path: Path, rows: list[dict]) -> None:
    """The rows of :func:`profile_summary` (every run's commit on each) as a CSV."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PROFILE_FIELDS)
        writer.writeheader()
        writer.writerows([{k: r.get(k) for k in PROFILE_FIELDS} for r in rows])


def draw_profile(folder: Path) -> Path | None:
    """``profile.png`` from every ``profile_*.csv`` in ``folder``: one stacked bar per
    recipe (device ms per step by category), its wall time and the ledger's floor as
    markers; at most :data:`plots.MAX_PX` wide. None when there is nothing to draw."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plots
    import step_ledger

    bars, totals = {}, {}
    for path in sorted(folder.glob("profile_*.csv")):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r["kind"] == "category":
                    bars.setdefault(r["recipe"], {})[r["category"]] = float(r["ms_per_step"] or 0)
                elif r["kind"] == "total":
                    totals[r["recipe"]] = r
                    bars.setdefault(r["recipe"], {})
    if not bars:
        return None
    recipes = list(bars)  # a recipe with no kernel (a CPU's profile) keeps its wall marker
    width_in = min(plots.MAX_PX / plots.DPI, 5.0 + 1.6 * len(recipes))
    fig, ax = plt.subplots(figsize=(width_in, 5.5), dpi=plots.DPI)
    xs = list(range(len(recipes)))
    bottom = [0.0] * len(recipes)
    colours = plt.get_cmap("tab20").colors
    for i, cat in enumerate(step_ledger.CATEGORIES):
        values = [bars[r].get(cat, 0.0) for r in recipes]
        if any(values):
            ax.bar(xs, values, 0.6, bottom=bottom, label=cat, color=colours[i % len(colours)])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(xs, recipes)
    ax.set_xlim(-0.6, len(recipes) - 0.4)
    for x, r in enumerate(recipes):
        t = totals.get(r, {})
        if t.get("wall_ms"):
            ax.plot(x, float(t["wall_ms"]), "k_", markersize=30, label="wall" if x == 0 else None)
        if t.get("floor_ms"):
            ax.plot(x, float(t["floor_ms"]), "r_", markersize=30, label="ledger floor" if x == 0 else None)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("device ms per step")
    ax.set_title("GPU time of a training step\nby the step ledger's categories", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    path = folder / "profile.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def ledger_floors(model: str | None, recipe: str, device: str) -> dict | None:
    """The committed step ledger's floor per category for this model, recipe and device
    (``results/host/ledger_*.json``), or None where none is committed."""
    import step_ledger

    key = harness_device_key(device)
    if model is None or key is None:
        return None
    path = step_ledger.ledger_path(model, recipe, key)
    if not path.is_file():
        return None
    return {c["name"]: c["floor_ms"] for c in json.loads(path.read_text())["categories"] if c["floor_ms"]}


def profile_recipe(
    recipe, base, x, y, loss_fn, device, spec, smoke, steps, warmup
) -> tuple[list[dict], float]:
    """(kernel rows, wall ms per step) of ``steps`` profiled steps of ``recipe`` after
    ``warmup``: torch.profiler over CPU and CUDA with the input shapes recorded, tkern's
    launches in their ledger ranges, the loss and the optimizer in theirs."""
    import step_ledger
    from torch.profiler import ProfilerActivity, profile, record_function

    built = RECIPES[recipe](base, device, smoke)
    step_ledger.optimizer_phase(built.optimizer, built.scaler, lambda: record_function("ledger:optimizer"))

    def ranged_loss(out, target):
        with record_function("ledger:loss"):
            return loss_fn(out, target)

    trainer = trainer_for(built, ranged_loss)
    batch = [(x, y)]
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tf32(built.tf32), step_ledger.profiled_launches(spec):
        for _ in range(warmup):
            trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - start) / steps
    return kernel_rows(prof.events(), spec), wall_ms


def run_profiles(mode, args, res_dir: Path | None) -> list[dict]:
    """``--profile``: each language-model case's recipes (default :data:`PROFILE_RECIPES`)
    profiled; ``profile_<recipe>.csv`` per recipe and ``profile.png`` into ``res_dir``."""
    import step_ledger
    from harness import commit

    recipes = [r for r in (RECIPES if args.recipes else PROFILE_RECIPES) if _picked(r, args.recipes)]
    if mode.smoke:  # the code path once: each profiled tiny step is seconds of interpreter
        recipes = [r for r in recipes if r not in SMOKE_SKIPS][:1]
    steps, warmup = (1, 1) if mode.smoke else (PROFILE_STEPS, WARMUP)
    everything = []
    for case, base, x, y, loss_fn in cases(mode.smoke, mode.device, args.gpt2_batch, args.models):
        if loss_fn is not lm_loss or not _picked(case, args.models):
            continue
        model = case.split(",")[0]
        config = base.lm.config.to_dict()
        family = "llama" if case.startswith("llama") else "gpt2"
        spec = step_ledger.ModelSpec(family, config, x.shape[1], x.shape[0])
        for recipe in recipes:
            try:
                rows, wall = profile_recipe(
                    recipe, base, x, y, loss_fn, mode.device, spec, mode.smoke, steps, warmup
                )
            except Exception as exc:  # record it, profile the others
                print(f"profile {case} {recipe}: FAILED ({error_line(exc)})")
                continue
            finally:
                release(mode.device)
            summary = profile_summary(recipe, rows, steps, wall, ledger_floors(model, recipe, device_name()))
            stamp = commit()
            for r in summary:
                r["commit"] = stamp
            everything += summary
            for r in summary:
                if r["kind"] != "kernel":
                    print(
                        f"profile {recipe:<28} {r.get('category') or 'busy / wall':<18} "
                        f"{r['ms_per_step']:>9} ms  floor {r.get('floor_ms')}  share {r.get('share')}"
                    )
            if res_dir is not None:
                write_profile_csv(res_dir / f"profile_{slug(recipe)}.csv", summary)
    if res_dir is not None:
        try:
            drawn = draw_profile(res_dir)
        except ImportError:
            drawn = None
            print("(matplotlib is missing: no profile picture)")
        print(f"wrote {res_dir}/profile_*.csv" + (f" and {drawn}" if drawn else ""))
    return everything
