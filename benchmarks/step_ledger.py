"""A ledger of one training step, counted on a CPU: every kernel launched, the bytes
it reads and writes, its FLOPs, grouped by category, and the roofline time of each
category at a GPU's spec (issue 42 item 1).

    python benchmarks/step_ledger.py --model gpt2-small --recipe tkern --device h200 --json ledger.json
    python benchmarks/step_ledger.py --model gpt2-small --recipe tkern --compare old.json

This is how a change is judged before a GPU sees it: fewer bytes, fewer launches,
the same FLOPs. The step is ``bench_train``'s (the recipe built by
``train_recipes.RECIPES``, one ``tkern.Trainer.train_step``: zero the gradients,
forward, loss, scaled backward, optimizer and scaler), at the real shapes, but
nothing is computed:

* every Triton launch is intercepted (``kernel[grid](...)`` records the launch and
  runs nothing); its bytes and FLOPs come from a rule per kernel family
  (:func:`triton_cost`): a GEMM reads A and B once and writes C once (plus bias,
  saved pre-activation, prologue operands, and C once more when it accumulates),
  2*M*N*K FLOPs; a streaming kernel touches each tensor argument once over its
  ``n`` elements, the optimizer's master and moments twice (read and written);
* every aten op goes through a ``TorchDispatchMode`` that computes nothing: its
  outputs' shapes come from the op's meta kernel and are allocated uninitialised
  (``torch.empty_strided``: untouched pages cost no memory), views and ``set_`` run
  as they are; an op on small tensors only (scalars, statistics, scales, flags: at
  most :data:`SMALL_BYTES`, integer ones and factories such as ``arange`` up to
  :data:`SMALL_INT_BYTES`) is computed, so that what decides anything (a skipped
  step, ``.item()``) is real and the same on every run; ``.item()`` of a large
  tensor answers 0 (``syncs`` counts them all). Bytes = every input tensor's footprint (a
  broadcast dimension counted once) + every output's + every tensor written in
  place; a tensor only overwritten (``copy_``, ``fill_``, ``out=``) is not read.
  FLOPs of matrix products from ``torch.utils.flop_counter``'s registry; attention
  4*B*H*Sq*Sk*D forward and twice that backward (no causal discount, no recompute:
  the model's FLOPs). Allocations (``empty*``) launch nothing and are not counted.

The step runs twice (the first allocates the optimizer's state) and the second is
the ledger. Categories (:data:`CATEGORIES`; names stable, compared across commits):

* ``gemm fwd`` / ``gemm dgrad`` / ``gemm wgrad``: the blocks' GEMMs by role, told
  apart by their dimensions (a reduction over the step's tokens is a wgrad; a GEMM
  in backward otherwise a dgrad), ``gemm lm head`` every GEMM with the vocabulary
  as a dimension (forward, dgrad and wgrad of the head);
* ``attention``: SDPA forward and backward; ``norm``: everything a LayerNorm /
  RMSNorm module runs, forward and backward (the autograd nodes it made), so that an
  unfused norm's elementwise ops count as the norm's;
  ``embedding``: the token and position lookups and their backward;
* ``loss``: everything from the model's output to the loss, in forward and backward
  (the fp32 upcast of the logits, the shift, log-softmax, NLL, their gradients), and
  tkern's cross-entropy kernels: under the fused loss of the tkern recipes (inside the
  model's forward) those, the chunked head GEMMs being the head's;
* ``fp8 cast/amax``: fp8 casts, amax and scale bookkeeping;
* ``optimizer``: everything in ``optimizer.step`` and the scaler's step and update;
* ``copies and fills``: copies, dtype casts, ``cat``, fills and zero-fills;
* ``elementwise``: the rest of the pointwise ops and small reductions (activations,
  residual adds, bias gradients); ``other``: anything unclassified (a test keeps
  it empty for the recipes here).

The floor of a launch is max(FLOPs / peak for its operand dtype, bytes / HBM
bandwidth), summed per category (:func:`device_peaks`: the named ``tkern.device.SPECS``
entry's peaks; ``--device`` takes any of them, and tkern's GEMMs are routed as that device's
plan routes them, :func:`device_routing`). The JSON also holds the analytic FLOPs (:func:`model_flops`,
``6 x linear params x tokens + 12 x layers x tokens x seq x width``) that the
ledger's FLOPs agree with within 3% (a test says so).

Autocast runs CUDA autocast's op lists (``ledger_autocast``: ``pow`` and the rest of its
fp32 list in fp32), not the CPU's. What it does not see: the GPU's own choices (a CPU runs
torch's CPU kernels: SDPA's CPU flash kernel and its dispatch, one launch for
a multi-tensor op), cache reuse inside a kernel (the bytes are compulsory
traffic), launch latency, and compiled recipes (torch.compile's fusion is not
modeled: those recipes are refused; their time is the profile's,
``bench_train.py --profile``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import (  # noqa: E402
    MODELS,
    ModelSpec,
    lm_loss,
)
from harness import (  # noqa: E402
    RESULTS,
    DeviceSpec,
    commit,
    model_flops,
    slug,
)
from ledger_autocast import cuda_autocast_lists  # noqa: E402
from ledger_costs import (  # noqa: E402
    CATEGORIES,
    GEMM_CATEGORIES,
    RANGE,
    attention_flops,
    footprint,
    gemm_role,
    kernel_category,
    triton_cost,
)
from ledger_record import Launch, NoCompute, _Recorder, profiled_launches, recorded_launches  # noqa: E402
from train_recipes import LR, RECIPES, Built, tf32, trainer_for  # noqa: E402

import tkern.device as tkdev  # noqa: E402
from tkern.kernels import gemm as tk_gemm  # noqa: E402

#: names moved to the modules above that tests and scripts still read from this one
__all__ = [
    "RANGE",
    "attention_flops",
    "footprint",
    "gemm_role",
    "kernel_category",
    "profiled_launches",
    "triton_cost",
]


# --------------------------------------------------------------------------- the device

#: the named GPUs a ledger can be counted for (``tkern.device.SPECS``)
DEVICES = tuple(tkdev.SPECS)


def device_peaks(name: str) -> DeviceSpec:
    """The peaks a ledger's floors use, from ``tkern.device.SPECS[name]`` (its datasheet
    16-bit and fp8 peaks and bandwidth): fp8 at the 16-bit peak where the device has no fp8
    tensor cores; TF32 at half the 16-bit peak and fp32 without TF32 at a sixteenth (the
    A100's and H100's datasheet ratios, 1/2 and 1/14.8-1/16: the spec holds no fp32 peak)."""
    spec = tkdev.SPECS[name]
    t16 = spec.tflops_16bit
    source = f"tkern.device.SPECS[{name!r}] (datasheet, dense); TF32 = 1/2 and fp32 = 1/16 of 16-bit"
    return DeviceSpec(name, spec.tflops_fp8 or t16, t16, t16 / 2, t16 / 16, spec.mem_tbps, source)


@contextlib.contextmanager
def device_routing(name: str) -> Iterator[None]:
    """tkern's GEMMs routed as on ``name`` (``plan_gemm`` with its SMs and TMA, through
    ``gemm.device_gemm_info``, the routing's one seam): split-K workspaces and reductions
    and the TMA kernel where that device's plan takes them, not the pointer kernel that a
    CPU's plan gives every GEMM."""
    spec = tkdev.SPECS[name]
    inner = tk_gemm.device_gemm_info
    tk_gemm.device_gemm_info = lambda device: (spec.sms, spec.tma)
    try:
        yield
    finally:
        tk_gemm.device_gemm_info = inner


# --------------------------------------------------------------------------- the step


def ledger_recipes() -> list[str]:
    """bench_train's recipes the ledger can count: every eager one."""
    return [r for r in RECIPES if "compiled" not in r]


@dataclass
class Ledger:
    model: str
    recipe: str
    device: DeviceSpec
    spec: ModelSpec
    launches: list[Launch]
    analytic: dict[str, float]
    syncs: int
    allow_tf32: bool = False
    extra: dict = field(default_factory=dict)

    def floor_s(self, launch: Launch) -> float:
        peak = self.device.peak_tflops(launch.dtype, self.allow_tf32) * 1e12
        return max(launch.flops / peak, launch.bytes / (self.device.hbm_tbps * 1e12))

    def categories(self) -> list[dict]:
        rows = []
        for cat in CATEGORIES:
            mine = [x for x in self.launches if x.category == cat]
            rows.append({
                "name": cat,
                "launches": len(mine),
                "bytes": sum(x.bytes for x in mine),
                "flops": sum(x.flops for x in mine),
                "floor_ms": round(1e3 * sum(self.floor_s(x) for x in mine), 4),
            })  # fmt: skip
        return rows

    def ops(self) -> list[dict]:
        """Launches summed by (category, kernel or op name), sorted: where the bytes are."""
        by: dict[tuple, dict] = {}
        for x in self.launches:
            row = by.setdefault((x.category, x.name), {"category": x.category, "name": x.name, "launches": 0,
                                                       "bytes": 0, "flops": 0, "floor_ms": 0.0})  # fmt: skip
            row["launches"] += 1
            row["bytes"] += x.bytes
            row["flops"] += x.flops
            row["floor_ms"] += 1e3 * self.floor_s(x)
        rows = sorted(by.values(), key=lambda r: (CATEGORIES.index(r["category"]), r["name"]))
        for r in rows:
            r["floor_ms"] = round(r["floor_ms"], 4)
        return rows

    def payload(self) -> dict:
        cats = self.categories()
        flops = sum(c["flops"] for c in cats)
        total_floor = sum(c["floor_ms"] for c in cats)
        gemm_flops = sum(c["flops"] for c in cats if c["name"] in GEMM_CATEGORIES + ("attention",))
        return {
            "model": self.model,
            "recipe": self.recipe,
            "shape": {
                "seq": self.spec.seq,
                "batch": self.spec.batch,
                "tokens": self.spec.tokens,
                "config": self.spec.config,
            },  # fmt: skip
            "device": self.device.name,
            "spec": {
                "fp8_tflops": self.device.fp8,
                "bf16_tflops": self.device.bf16,
                "tf32_tflops": self.device.tf32,
                "fp32_tflops": self.device.fp32,
                "hbm_tbps": self.device.hbm_tbps,
                "source": self.device.source,
            },  # fmt: skip
            "commit": commit(),
            "torch": torch.__version__,
            "categories": cats,
            "totals": {
                "launches": sum(c["launches"] for c in cats),
                "bytes": sum(c["bytes"] for c in cats),
                "bytes_outside_gemms": sum(c["bytes"] for c in cats if c["name"] not in GEMM_CATEGORIES),
                "flops": flops,
                "floor_ms": round(total_floor, 4),
                # the step at the 16-bit peak, its model FLOPs only: the MFU denominator's time
                "flops_floor_ms": round(1e3 * gemm_flops / (self.device.bf16 * 1e12), 4),
                "syncs": self.syncs,
            },
            "analytic_flops": self.analytic,
            "flops_vs_analytic": round(flops / self.analytic["total"], 5),
            "ops": self.ops(),
            **self.extra,
        }


def run(model: str, recipe: str, device: str = "h200") -> Ledger:
    """The ledger of one ``recipe`` step of ``model`` (keys of :data:`MODELS`,
    :func:`ledger_recipes`) at ``device``'s spec (a key of :data:`DEVICES`)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if recipe not in ledger_recipes():
        raise ValueError(
            f"recipe must be one of {ledger_recipes()} (the compiled ones are not modeled: torch.compile's "
            f"fusion is the profile's), got {recipe!r}"
        )
    if device not in DEVICES:
        raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
    spec = MODELS[model]
    cpu = torch.device("cpu")
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(0))
    rec = _Recorder(spec, allow_tf32=False)
    with recorded_launches(rec), NoCompute(rec):  # built without initialising anything: nothing is read
        base = spec.build()
        built = RECIPES[recipe](base, cpu, True)
    analytic = model_flops(base, spec.tokens, spec.seq)
    del base
    built = _fused_torch_adamw(built)
    rec.allow_tf32 = built.tf32
    model_obj = built.model

    def loss_fn(out, y):
        return lm_loss(out, y)

    def forward_pre(module, args):
        rec.phase = "forward"

    def forward_post(module, args, out):
        rec.phase = "loss"
        rec.loss_seq = _next_sequence_nr(rec)

    def norm_pre(module, args):
        rec.norms += 1
        if rec.norms == 1:
            rec.norm_nodes.append((_next_sequence_nr(rec), math.inf))

    def norm_post(module, args, out):
        rec.norms -= 1
        if rec.norms == 0:
            rec.norm_nodes[-1] = (rec.norm_nodes[-1][0], _next_sequence_nr(rec))

    body = getattr(model_obj, "logits_model", model_obj)  # the loss phase starts at its output
    body.register_forward_pre_hook(forward_pre)
    body.register_forward_hook(forward_post)
    for m in model_obj.modules():
        # nn.LayerNorm, HF's LlamaRMSNorm: their aten ops are the norm's. Not tkern's norm modules:
        # their kernels are the norm's by name, and a hook on one would make a converted decoder
        # layer run unfused (tkern.nn.residual calls norms it fuses only when nothing is on them)
        if "Norm" in type(m).__name__ and not type(m).__module__.startswith("tkern."):
            m.register_forward_pre_hook(norm_pre)
            m.register_forward_hook(norm_post)
    trainer = trainer_for(built, loss_fn)
    optimizer_phase(built.optimizer, built.scaler, lambda: _optimizer_phase(rec))
    routing = device_routing(device)
    with recorded_launches(rec), NoCompute(rec), tf32(built.tf32), routing, cuda_autocast_lists():
        trainer.train_step([(ids, ids)])  # the optimizer's state is made here: not counted
        rec.on = True
        rec.phase = "forward"
        trainer.train_step([(ids, ids)])
        rec.on = False
    return Ledger(model, recipe, device_peaks(device), spec, rec.launches, analytic, rec.syncs, built.tf32)


def _next_sequence_nr(rec: _Recorder) -> int:
    """The sequence number the next autograd node will get (the probe's ops not recorded)."""
    on, rec.on = rec.on, False
    try:
        with torch.enable_grad():
            return (torch.ones((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1
    finally:
        rec.on = on


@contextlib.contextmanager
def _optimizer_phase(rec: _Recorder) -> Iterator[None]:
    before, rec.phase = rec.phase, "optimizer"
    try:
        yield
    finally:
        rec.phase = before


def optimizer_phase(
    optimizer: object, scaler: object, context: Callable[[], contextlib.AbstractContextManager]
) -> None:
    """The optimizer's ``step`` and the scaler's ``step``, ``update`` and ``unscale_`` run
    inside ``context()`` (instance attributes wrapping them): the optimizer phase of the
    ledger and of a profile."""
    owners = [(optimizer, "step")] + [
        (scaler, m) for m in ("step", "update", "unscale_") if hasattr(scaler, m)
    ]
    for owner, method in owners:
        inner = getattr(owner, method)

        def wrapped(*args, _inner=inner, **kwargs):
            with context():
                return _inner(*args, **kwargs)

        setattr(owner, method, wrapped)


def _fused_torch_adamw(built: Built) -> Built:
    """torch's recipes take AdamW(fused=True) on a GPU (bench_train) and the foreach one
    on a CPU: the ledger counts the GPU's."""
    opt = built.optimizer
    if type(opt) is torch.optim.AdamW and not opt.defaults.get("fused"):
        opt = torch.optim.AdamW(built.model.parameters(), lr=LR, fused=True)
        return Built(built.model, opt, built.scaler, built.autocast, built.cuda_graph, built.tf32)
    return built


# --------------------------------------------------------------------------- output


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def table(payload: dict) -> str:
    """The categories as a readable table, with totals and the FLOPs check."""
    lines = [
        f"step ledger: {payload['model']} (seq {payload['shape']['seq']} x batch "
        f"{payload['shape']['batch']}), "
        f"recipe {payload['recipe']!r}, floors at {payload['device']} ({payload['spec']['bf16_tflops']} "
        f"TFLOP/s 16-bit, {payload['spec']['fp8_tflops']} fp8, {payload['spec']['hbm_tbps']} TB/s), "
        f"commit {payload['commit']}",
        f"{'category':<18}{'launches':>9}{'bytes':>12}{'FLOPs':>12}{'floor ms':>10}",
    ]
    for c in payload["categories"]:
        if c["launches"]:
            lines.append(
                f"{c['name']:<18}{c['launches']:>9}{_si(c['bytes'], 'B'):>12}{_si(c['flops'], 'F'):>12}"
                f"{c['floor_ms']:>10.3f}"
            )
    t = payload["totals"]
    lines += [
        f"{'total':<18}{t['launches']:>9}{_si(t['bytes'], 'B'):>12}{_si(t['flops'], 'F'):>12}"
        f"{t['floor_ms']:>10.3f}",
        f"bytes outside the GEMMs {_si(t['bytes_outside_gemms'], 'B')}; model FLOPs at the 16-bit peak "
        f"{t['flops_floor_ms']:.3f} ms; host syncs {t['syncs']}",
        f"FLOPs / analytic ({_si(payload['analytic_flops']['total'], 'F')}): {payload['flops_vs_analytic']}",
    ]
    return "\n".join(lines)


def compare(old: dict, new: dict) -> str:
    """Category by category, new minus old: launches, bytes, FLOPs, floor."""
    before = {c["name"]: c for c in old["categories"]}
    lines = [
        f"{new['model']} {new['recipe']!r}: commit {old.get('commit')} -> {new.get('commit')}",
        f"{'category':<18}{'launches':>14}{'bytes':>22}{'FLOPs':>12}{'floor ms':>18}",
    ]
    for c in new["categories"]:
        o = before.get(c["name"], {"launches": 0, "bytes": 0, "flops": 0, "floor_ms": 0.0})
        if not (c["launches"] or o["launches"]):
            continue
        lines.append(
            f"{c['name']:<18}{o['launches']:>6} -> {c['launches']:<5}"
            f"{_si(o['bytes'], 'B'):>10} -> {_si(c['bytes'], 'B'):<9}"
            f"{_si(c['flops'] - o['flops'], 'F'):>12}{o['floor_ms']:>8.3f} -> {c['floor_ms']:<7.3f}"
        )
    ot, nt = old["totals"], new["totals"]
    lines.append(
        f"{'total':<18}{ot['launches']:>6} -> {nt['launches']:<5}{_si(ot['bytes'], 'B'):>10} -> "
        f"{_si(nt['bytes'], 'B'):<9}{_si(nt['flops'] - ot['flops'], 'F'):>12}{ot['floor_ms']:>8.3f} -> "
        f"{nt['floor_ms']:<7.3f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="step_ledger.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    parser.add_argument("--recipe", default="tkern", help=f"one of {ledger_recipes()}")
    parser.add_argument("--device", default="h200", choices=DEVICES)
    parser.add_argument("--json", type=Path, default=None, help="write the ledger here")
    parser.add_argument(
        "--write",
        action="store_true",
        help="write it to results/host/ledger_<model>_<recipe>_<device>.json (overwriting a committed "
        "ledger dirties the tree: set TKERN_COMMIT to the code's commit)",
    )
    parser.add_argument(
        "--compare", type=Path, default=None, help="an earlier ledger JSON: print the difference"
    )
    parser.add_argument("--ops", action="store_true", help="also print every (category, op) line")
    args = parser.parse_args(argv)
    payload = run(args.model, args.recipe, args.device).payload()
    print(table(payload))
    if args.ops:
        for r in payload["ops"]:
            print(f"  {r['category']:<18}{r['name']:<48}{r['launches']:>6}{_si(r['bytes'], 'B'):>12}"
                  f"{_si(r['flops'], 'F'):>12}{r['floor_ms']:>10.3f}")  # fmt: skip
    if args.compare is not None:
        print()
        print(compare(json.loads(args.compare.read_text()), payload))
    for path in [args.json] + ([ledger_path(args.model, args.recipe, args.device)] if args.write else []):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(payload, indent=1) + "\n")
            print(f"wrote {path}")
    return payload


def ledger_path(model: str, recipe: str, device: str) -> Path:
    """Where ``--write`` puts a ledger: ``results/host/ledger_<model>_<recipe>_<device>.json``
    (the recipe's spaces as dashes)."""
    return RESULTS / "host" / f"ledger_{model}_{slug(recipe)}_{device}.json"


if __name__ == "__main__":
    main()
