"""Time per training step and peak memory, end to end, on three models:

(1) a GPT-2-small-shaped transformer built from a transformers ``GPT2Config``
    (12 layers, 768 wide, 12 heads, vocabulary 50257; no download), SDPA
    attention, sequence 1024, batch ``--gpt2-batch`` (16 fills most of an H100's
    80 GB under fp32); then issue 42's Llama-like model (:data:`LLAMA_LIKE`: 12
    layers, width 1024, SwiGLU, RMSNorm, vocabulary 32000), sequence 2048, batch 8;
(2) a deep, wide MLP: 8 layers of 4096, batch 8192 tokens;
(3) the seeds' 2-layer MLP on MNIST-sized input: 784 -> 4096 -> 10, batch 8192.

(in this order: a time-boxed run that is cut short keeps the headline model).
Recipes (:data:`RECIPES`), each from the same initial weights and the same batch,
every step one ``tkern.Trainer.train_step`` (zero the gradients, forward, loss,
scaled backward, step), so every recipe pays the same loop. The language models' loss
is the mean next-token cross entropy: every tkern recipe trains them as a tkern user
does, ``convert_network(..., fused_loss=True)`` and the model called with labels
(:class:`HFLM`'s ``fused_loss`` mode: the loss by ``tkern.linear_cross_entropy``, no
tokens x vocabulary logits), the torch and torchao recipes from the logits in eager
fp32 (:func:`lm_loss`):

* ``tkern``: convert_network (fp16) + FusedAdamW + DynamicLossScaler with no option
  set: the Trainer's ``cuda_graph="auto"`` (the whole step captured where the host
  bounds it; ``graph_status`` says what it chose), else the optimizer's step a CUDA
  graph where it can be (its default ``cuda_graph=None``);
* ``tkern opt eager``: the same with ``Trainer(cuda_graph=False)`` and
  ``FusedAdamW(cuda_graph=False)``;
* ``tkern whole-step graph``: the same under ``Trainer(cuda_graph=True)``: the whole
  step (forward, backward, scaler, optimizer) captured once and replayed;
* ``tkern bf16``: ``convert_network(model, torch.bfloat16)`` + FusedAdamW, no loss scale;
* ``tkern compiled``: the converted fp16 model under ``torch.compile`` (default mode);
* ``tkern state bf16`` / ``tkern state 8-bit`` / ``tkern bf16 master=split`` /
  ``tkern bf16 split + 8-bit state``: the memory modes (:data:`MEMORY_MODES`:
  FusedAdamW's ``state_dtype`` and ``master="split"``, which needs bf16 params);
  each row's ``loss_vs_tkern`` is the loss it costs, relative, against ``tkern``
  (``tkern bf16`` for the bf16 and fp8 rows);
* ``tkern fp8 tensorwise`` / ``delayed`` / ``blockwise``: ``convert_network(model,
  torch.bfloat16, float8=recipe)`` (Float8Linear wherever in and out features are
  multiples of 16, the LM head aside: its GEMMs run in bf16 inside the fused loss,
  :func:`fp8_body_filter`), FusedAdamW, no loss scale (bf16);
* ``tkern fp8 mxfp8``: the same with ``float8="mxfp8"`` (MX blocks of 32: layers whose
  features are multiples of 32, :func:`train_recipes.mx_filter`); ``torchao mxfp8
  compiled``: torchao's MXFP8 training (``quantize_`` with ``MXFP8TrainingOpConfig``, the
  same layers) on bf16 params under ``torch.compile`` (smoke: eager, emulated). Both are
  skipped off Blackwell (sm_100) and MI355X with the refusal as the reason; target
  (Blackwell): tkern's >= 1.1x torchao's on the Llama-like model;
* ``torch autocast``: fp32 params, autocast fp16 + GradScaler + AdamW(fused=True);
* ``torch autocast compiled``: the same model under ``torch.compile`` (the best
  a torch user has without writing kernels);
* ``torch autocast bf16``: autocast bf16, no scaler, AdamW(fused=True): the fp8
  recipes' baseline; ``torch autocast bf16 compiled``: the same under ``torch.compile``;
* ``torchao float8 tensorwise compiled``: torchao's ``convert_to_float8_training``
  (tensorwise, the same module filter) on bf16 params, AdamW(fused=True), under
  ``torch.compile`` as torchao documents it (skipped, with the reason recorded,
  where torchao is not importable; in smoke mode eager with ``emulate=True``): bf16
  params and no master copy (its ``master`` says so); ``..., fp32 master``: the same
  on fp32 params under bf16 autocast, an fp32 master as tkern's;
* ``torch fp32 tf32``: fp32 with TF32 tensor cores allowed, AdamW(fused=True);
* ``torch fp32 (no tf32)``: strict fp32, labelled as such.

Each recipe's time is the mean over ``STEPS`` back-to-back steps between two CUDA
events (``ms``: what training sees, the host free to run ahead), beside the median
of the same steps each synchronised on its own (``ms_synced``) and their 90th
percentile (``ms_p90``, nearest rank). ``mfu``: the step's model FLOPs
(``flops_per_step``, :func:`harness.model_flops`, which the step ledger's count
agrees with) over ``ms`` at the device's dense 16-bit peak (:data:`harness.DEVICES`;
fp8 rows on the same scale; None off an H100/H200); ``master``: the master weights
the recipe keeps. Every row records
its peak memory (``peak_mib``), the loss after the timed steps (``loss``), and
the CUDA graph: ``cuda_graph`` (the Trainer's whole-step graph asked for),
``opt_cuda_graph`` (the fused optimizer's setting), ``graph_fallback`` (why the
trainer or the optimizer ran eager; None when it replayed) and the captures and
replays. The run checks that every recipe's loss agrees with the fp32 recipe's
within ``LOSS_MARGIN`` (relative): a faster recipe that trains differently is not
a faster recipe.

Targets on H100/H200 (issues 16, 30): tkern >= 1.2x torch autocast and >= 1.0x the
compiled autocast recipe on every model; tkern's peak memory <= 0.9x autocast's;
the fp8 recipes on GPT-2 small >= 1.6x bf16 autocast and >= 1.1x torchao's compiled
Float8Linear (issue 43), with a final loss within 1% of bf16 autocast's
(``loss_within_1pct_of_bf16``, every row's check column).
``--profile`` profiles the language models' steps instead (:func:`run_profiles`;
default recipes :data:`PROFILE_RECIPES`): each GPU kernel put in the step ledger's
categories (``step_ledger.kernel_category``), device time per category beside the
committed ledger's floor, busy against wall, the top kernels with their achieved
TFLOP/s or GB/s, into ``results/<device>/profile_<recipe>.csv`` and ``profile.png``.
``--models`` and ``--recipes`` (comma-separated prefixes; ``=NAME`` one exact
name) pick a subset; an item that selects nothing is refused, naming it and the valid
names, before anything runs (:func:`check_selection`). Within a case the baselines run
first, so a run cut by its time limit has what tkern's rows are compared with.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import (  # noqa: E402
    GPT2_SMALL,
    GPT2_SMOKE,
    GPT2LM,
    HFLM,
    LLAMA_LIKE,
    LLAMA_SEQ,
    LLAMA_SMOKE,
    LM_CASES,
    MLPS,
    SEQ,
    SMOKE_MLPS,
    LlamaLM,
    _picked,
    case_names,
    cases,
    check_selection,
    classify_loss,
    lm_loss,
)
from harness import (  # noqa: E402
    GraphCount,
    Results,
    device_name,
    device_spec,
    error_line,
    graph_fields,
    graph_possible,
    model_flops,
    setup,
)
from train_profile import (  # noqa: E402
    PROFILE_RECIPES,
    draw_profile,
    kernel_rows,
    ledger_floors,
    profile_summary,
    run_profiles,
    write_profile_csv,
)
from train_recipes import (  # noqa: E402
    BASELINE,
    BF16_COMPILED,
    FP8_RECIPES,
    LR,
    MASTERS,
    MEMORY_MODES,
    RECIPES,
    SMOKE_GPT2_RECIPES,
    SMOKE_SKIPS,
    STEPS,
    TORCHAO_FP32_MASTER,
    TORCHAO_MX,
    WARMUP,
    Built,
    RefusedError,
    conv1d_as_linear,
    master_of,
    release,
    tf32,
    trainer_for,
)

import tkern  # noqa: E402

#: names moved to the modules above that tests and scripts still read from this one
__all__ = [
    "Built",
    "GPT2LM",
    "GPT2_SMALL",
    "GPT2_SMOKE",
    "HFLM",
    "LLAMA_LIKE",
    "LLAMA_SEQ",
    "LLAMA_SMOKE",
    "LR",
    "LlamaLM",
    "MASTERS",
    "MLPS",
    "SEQ",
    "SMOKE_MLPS",
    "classify_loss",
    "conv1d_as_linear",
    "draw_profile",
    "kernel_rows",
    "ledger_floors",
    "profile_summary",
    "write_profile_csv",
]


#: The recipes train the same weights on the same batch for WARMUP + STEPS steps
#: at lr 1e-4; their losses differ by rounding (fp16 vs fp32 products, loss
#: scaling), which stays well under 2% of the loss over 35 steps.
LOSS_MARGIN = 0.02
#: the recipe whose final loss the ``loss_vs_bf16`` check column reads against, and its bound
BF16_REFERENCE, BF16_LOSS_MARGIN = "torch autocast bf16", 0.01


def _timed(step: Callable[[], torch.Tensor], steps: int, cuda: bool) -> tuple[float, list[float], int]:
    """(ms per step pipelined, each synchronised step's ms, peak bytes) of ``steps`` calls of
    ``step``: CUDA events on a GPU, the host clock (no peak) elsewhere."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / steps
        synced = []
        for _ in range(steps):
            start.record()
            step()
            end.record()
            end.synchronize()
            synced.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated()
    else:
        import time

        synced = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            synced.append(1e3 * (time.perf_counter() - t))
        ms, peak = sum(synced) / len(synced), 0
    return ms, synced, peak


def time_steps(
    recipe: str,
    base: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable,
    device: torch.device,
    steps: int,
    warmup: int,
    smoke: bool,
) -> dict:
    """Train a copy of ``base`` under ``recipe`` through ``Trainer.train_step``: ms
    per step (pipelined and synchronised), peak memory, the loss after the timed
    steps and how the CUDA graphs ran."""
    if device.type == "cuda":  # peak from the start: a CUDA graph's pool is allocated at capture
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    built = RECIPES[recipe](base, device, smoke)
    with tf32(built.tf32):
        count = GraphCount(built.optimizer)
        trainer = trainer_for(built, loss_fn)
        batch = [(x, y)]

        def step() -> torch.Tensor:
            return trainer.train_step(batch)

        for _ in range(warmup):
            step()
        ms, synced, peak = _timed(step, steps, device.type == "cuda")
        loss = float(step())  # one more step: the loss every recipe must agree on
    synced.sort()
    opt_graph = graph_fields(built.optimizer, count)
    fused = isinstance(built.optimizer, tkern.optim.FusedAdamW)
    graphs = trainer.graphs
    # the whole step's graph: asked for, or chosen by "auto" (else the optimizer's own graph's counts)
    whole = graphs is not None and (built.cuda_graph is True or graphs.counts["capture"] > 0)
    opt_fallback = opt_graph["graph_fallback"] if fused else None
    return {
        "ms": ms,
        "ms_synced": synced[len(synced) // 2],
        "ms_p90": synced[math.ceil(0.9 * len(synced)) - 1],  # nearest rank
        # layers running fp8 GEMMs (tkern's Float8Linear / Float8Conv1D, torchao's Float8Linear)
        "fp8_layers": sum("Float8" in type(m).__name__ for m in built.model.modules()),
        "peak_mib": round(peak / 2**20, 1),
        "loss": loss,
        "cuda_graph": built.cuda_graph,
        "opt_cuda_graph": opt_graph["cuda_graph"] if fused else None,
        # meant to replay: the whole step, or the fused optimizer's own graph
        "graphed": graph_possible() and (built.cuda_graph is True or (fused and opt_graph["graphed"])),
        "graph_status": trainer.graph_status,  # what cuda_graph="auto" chose, and why
        # under Trainer(cuda_graph=True) the trainer's reason alone: its graph holds the
        # optimizer's step, whose own graph then stands aside by design
        "graph_fallback": trainer.graph_fallback if whole or built.cuda_graph is True else opt_fallback,
        "graph_captures": graphs.counts["capture"] if whole else opt_graph["graph_captures"],
        "graph_replays": (
            graphs.counts["capture"] + graphs.counts["replay"] if whole else opt_graph["graph_replays"]
        ),
    }


def step_flops(base: nn.Module, x: torch.Tensor, loss_fn: Callable) -> int:
    """Model FLOPs of one step of a case (:func:`harness.model_flops`): an LM's batch is
    (sequences, seq) token ids, an MLP's (rows, features)."""
    if loss_fn is lm_loss:
        return model_flops(base, x.numel(), x.shape[1])["total"]
    return model_flops(base, x.shape[0])["total"]


def mfu(flops: int, ms: float | None, name: str) -> float | None:
    """Model FLOPs utilisation of a step of ``ms`` on the device ``name``: at its dense
    16-bit peak (:data:`harness.DEVICES`; every recipe, fp8 too, on the same scale);
    None for a device without a spec (a CPU)."""
    spec = device_spec(name)
    if spec is None or not ms:
        return None
    return round(flops / (ms * 1e-3) / (spec.bf16 * 1e12), 4)


def final_loss(res: Results, case: str, losses: dict[str, float], recipe: str) -> float | None:
    """``recipe``'s final loss on ``case`` in this run, else the one merged from an earlier
    run of the same file (a GPU session splits the recipes across calls); None if neither."""
    if recipe in losses:
        return losses[recipe]
    return next((r.get("loss") for r in res.rows if (r["case"], r["impl"]) == (case, recipe)), None)


def bf16_check(res: Results, case: str, losses: dict[str, float]) -> None:
    """Each row of ``case`` trained in this run gets ``loss_vs_bf16`` (its final loss over
    bf16 autocast's, less 1; that of an earlier run merged into the file when this run has
    none) and the check column ``loss_within_1pct_of_bf16``; the fp8 recipes' into ``res.meta``."""
    ref = final_loss(res, case, losses, BF16_REFERENCE)
    if not ref:
        return
    for row in res.rows:
        if row["case"] == case and row["impl"] in losses:
            off = losses[row["impl"]] / ref - 1
            row["loss_vs_bf16"] = round(off, 6)
            row["loss_within_1pct_of_bf16"] = abs(off) <= BF16_LOSS_MARGIN
            if row["impl"].startswith("tkern fp8"):
                res.meta[f"{case}: {row['impl'][6:]} loss within 1% of bf16"] = abs(off) <= BF16_LOSS_MARGIN


def summarize(res: Results, case: str, smoke: bool) -> str:
    """The case's target ratios into ``res.meta`` (what report.py reads), and its line."""

    def ratio(impl: str, baseline: str) -> float | None:
        value = res.ratio(case, impl, baseline)
        return round(value, 3) if value == value else None

    mem = {r["impl"]: r.get("peak_mib") for r in res.rows if r["case"] == case}  # a skipped row has none
    for b in ("torch autocast", "torch autocast compiled", "torch fp32 tf32"):
        res.meta[f"{case}: vs {b}"] = ratio("tkern", b)
    res.meta[f"{case}: whole-step graph vs tkern"] = ratio("tkern whole-step graph", "tkern")
    res.meta[f"{case}: opt graph vs opt eager"] = ratio("tkern", "tkern opt eager")
    for r in FP8_RECIPES:
        res.meta[f"{case}: fp8 {r} vs autocast bf16"] = ratio(f"tkern fp8 {r}", "torch autocast bf16")
        res.meta[f"{case}: fp8 {r} vs compiled autocast bf16"] = ratio(f"tkern fp8 {r}", BF16_COMPILED)
        res.meta[f"{case}: fp8 {r} vs torchao float8"] = ratio(
            f"tkern fp8 {r}", "torchao float8 tensorwise compiled"
        )
    peak = (
        mem.get("tkern") / mem["torch autocast"] if mem.get("tkern") and mem.get("torch autocast") else None
    )
    res.meta[f"{case}: peak vs autocast"] = None if peak is None else round(peak, 3)
    res.meta[f"{case}: tkern compiled vs torch autocast compiled"] = ratio(
        "tkern compiled", "torch autocast compiled"
    )
    res.meta[f"{case}: tkern bf16 vs torch autocast bf16"] = ratio("tkern bf16", "torch autocast bf16")
    for r in FP8_RECIPES:
        res.meta[f"{case}: fp8 {r} vs torchao float8, fp32 master"] = ratio(
            f"tkern fp8 {r}", TORCHAO_FP32_MASTER
        )
    res.meta[f"{case}: fp8 mxfp8 vs torchao mxfp8"] = ratio("tkern fp8 mxfp8", TORCHAO_MX)
    for mode in MEMORY_MODES:
        if mem.get(mode) and mem.get("torch autocast"):
            res.meta[f"{case}: peak {mode} vs autocast"] = round(mem[mode] / mem["torch autocast"], 3)
    res.meta[f"{case}: tkern mfu"] = next(
        (r.get("mfu") for r in res.rows if (r["case"], r["impl"]) == (case, "tkern")), None
    )
    if smoke:
        return ""
    m = res.meta
    return (
        f"{case}: tkern {m[f'{case}: vs torch autocast']}x autocast (target >= 1.2), "
        f"{m[f'{case}: vs torch autocast compiled']}x compiled autocast (target >= 1.0); "
        f"whole-step graph {m[f'{case}: whole-step graph vs tkern']}x tkern; "
        f"fp8 tensorwise {m[f'{case}: fp8 tensorwise vs autocast bf16']}x bf16 autocast (target >= 1.6), "
        f"{m[f'{case}: fp8 tensorwise vs torchao float8']}x torchao Float8Linear (target >= 1.1); "
        f"peak {mem.get('tkern')} MiB vs autocast {mem.get('torch autocast')} MiB (target <= 0.9x)"
    )


def _run_case(res: Results, mode, case: str, base, x, y, loss_fn, recipes, steps: int, warmup: int) -> dict:
    """Every recipe of ``recipes`` timed on ``case`` (:func:`time_steps`), a row each into
    ``res`` (saved after each); the final loss of each recipe that ran."""
    losses = {}
    flops = step_flops(base, x, loss_fn)
    for recipe in recipes:
        if mode.smoke and (
            recipe in SMOKE_SKIPS or (case.startswith(LM_CASES) and recipe not in SMOKE_GPT2_RECIPES)
        ):
            continue
        try:
            r = time_steps(recipe, base, x, y, loss_fn, mode.device, steps, warmup, mode.smoke)
        except torch.OutOfMemoryError:
            print(f"{case} {recipe}: out of memory, skipped")
            res.add(case, recipe, None, skipped="out of memory")
            continue
        except (ImportError, RefusedError) as exc:  # an optional peer not installed, MXFP8 off Blackwell
            res.add(case, recipe, None, skipped=error_line(exc))
            continue
        except Exception as exc:  # record it, keep the other recipes' numbers
            error = error_line(exc)
            res.meta["failed"].append({"case": case, "impl": recipe, "error": error})
            print(f"{case} {recipe}: FAILED ({error}); the other recipes go on")
            continue
        finally:
            release(mode.device)
        losses[recipe] = r["loss"]
        ms = r.pop("ms")
        res.add(
            case,
            recipe,
            ms,
            ms_synced=round(r.pop("ms_synced"), 4),
            ms_p90=round(r.pop("ms_p90"), 4),
            flops_per_step=flops,
            mfu=mfu(flops, ms, device_name()),
            master=master_of(recipe),
            **r,
        )
        res.save()  # after every recipe: a timeout loses only the one in progress
    return losses


def _check_losses(res: Results, case: str, losses: dict[str, float]) -> list[str]:
    """The loss checks of ``case``'s rows: each recipe against :data:`BASELINE` (the
    disagreements returned), against bf16 autocast and each tkern variant against tkern."""
    disagree = []
    ref = final_loss(res, case, losses, BASELINE)
    for recipe, loss in losses.items():
        if ref is not None and not abs(loss - ref) <= LOSS_MARGIN * abs(ref):
            disagree.append(f"{case}: {recipe} loss {loss:.5g} vs {BASELINE} {ref:.5g}")
    # what a memory mode (or any tkern variant) costs in loss against tkern's recipe of
    # the same param dtype (bf16 rows against ``tkern bf16``)
    bf16_check(res, case, losses)
    for row in res.rows:
        bf16 = row["impl"].startswith(("tkern bf16", "tkern fp8"))
        ref_name = "tkern bf16" if bf16 else "tkern"
        mine = row["case"] == case and row["impl"].startswith("tkern") and row["impl"] in losses
        if mine and ref_name in losses:
            row["loss_vs_tkern"] = round(losses[row["impl"]] / losses[ref_name] - 1, 6)
    return disagree


def main(argv: list[str] | None = None) -> Results:
    def add_arguments(parser):
        parser.add_argument("--gpt2-batch", type=int, default=16, help="GPT-2 batch (sequences of 1024)")
        parser.add_argument("--models", default=None, help="comma-separated case prefixes (default: all)")
        parser.add_argument("--recipes", default=None, help="comma-separated recipe prefixes (default: all)")
        parser.add_argument(
            "--profile",
            action="store_true",
            help="profile the language models' steps instead (default recipes "
            f"{', '.join(PROFILE_RECIPES)}): device time by the step ledger's categories "
            "into results/<device>/profile_<recipe>.csv and profile.png",
        )

    mode, args = setup("train", __doc__, argv, add_arguments)
    check_selection(args.models, case_names(mode.smoke, args.gpt2_batch), "--models")
    check_selection(args.recipes, list(RECIPES), "--recipes")
    if args.profile:
        run_profiles(mode, args, mode.out_dir)
        return Results("train", mode, metric=None)
    # a subset adds its rows to the file (a GPU session splits the recipes across calls)
    res = Results("train", mode, metric=None, merge=bool(args.models or args.recipes))
    res.meta["failed"] = []
    steps, warmup = (1, 1) if mode.smoke else (STEPS, WARMUP)
    summary, disagree = [], []
    recipes = [r for r in RECIPES if _picked(r, args.recipes)]
    for case, base, x, y, loss_fn in cases(mode.smoke, mode.device, args.gpt2_batch, args.models):
        if not _picked(case, args.models):
            continue
        losses = _run_case(res, mode, case, base, x, y, loss_fn, recipes, steps, warmup)
        disagree += _check_losses(res, case, losses)
        res.save()
        line = summarize(res, case, mode.smoke)
        if line:
            summary.append(line)
    res.meta["loss_margin"] = LOSS_MARGIN
    res.meta["losses_agree"] = not disagree
    summary += [f"LOSS DISAGREES: {d}" for d in disagree]
    summary += [f"FAILED {f['case']} {f['impl']}: {f['error']}" for f in res.meta["failed"]]
    res.save(plot=True)
    res.print_table(
        [
            "ms",
            "ms_synced",
            "ms_p90",
            "mfu",
            "peak_mib",
            "loss",
            "loss_within_1pct_of_bf16",
            "master",
            "graph_replays",
        ],
        summary,
    )
    if disagree and not mode.smoke:
        raise SystemExit(f"bench_train: recipes disagree on the loss beyond {LOSS_MARGIN:.0%}: {disagree}")
    return res


if __name__ == "__main__":
    main()
