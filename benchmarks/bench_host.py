"""Host-side cost per call: what tkern's own Python costs the CPU, with every
Triton kernel launch stubbed out, against torch's equivalents.

On a GPU this host time is on the critical path whenever the kernels are
short (many small tensors, small layers): the device waits for the host.
Measured, per call: the best of 7 timed loops of ~0.1 s (``time.perf_counter``;
as ``timeit`` advises, the minimum, since other processes only add time; the
median is recorded too), on one intra-op thread; the loops of a case's rows
are interleaved (loop i of each row back to back), so the rows compared with
each other see the same load:

* ``FusedAdamW.step()`` on 10, 100 and 1000 fp16 param tensors in the steady
  state (nothing changed since the last step), per call and per tensor; also
  ``DynamicLossScaler.step`` + ``update`` around it; against
  ``torch.optim.AdamW(foreach=True)`` (and ``fused=True`` where torch has it)
  on the same tensors in fp32;
* ``tkern.linear`` forward and backward (bias; bias + GELU) against
  ``F.linear`` (``F.gelu(F.linear)``); backward is ``torch.autograd.grad``
  with ``retain_graph``, so both include the autograd engine's own cost;
  ``tkern.nn.Float8Linear`` (tensorwise, bf16, same sizes) beside them; and
  ``tkern.linear`` whose weight and bias a ``FusedAdamW`` holds, backward by
  ``.backward()`` as training runs it: the wgrad then goes into the flat
  gradient buffer (``tkern.ops.common.flat_wgrad``) and autograd accumulates.
* the optimizer's part of a real training loop at 1000 tensors (and the smoke's
  sizes): ``zero_grad``, the loss scaled, the gradients written as backward leaves
  them (untimed: that is the model's cost, the same on both sides), the scaler's
  step and update; tkern's FusedAdamW + DynamicLossScaler against torch's
  ``AdamW(fused=True)`` + ``torch.amp.GradScaler``.

tkern's rows stub every launch (``kernel[grid](...)`` is a no-op that counts
launches), so they hold tkern's Python and the torch ops it issues (views,
allocations, small tensor ops), not Triton's launcher. ``tkern.linear`` runs
once for real before its stubbed rows, as a training loop's first step does:
its GEMMs' autotuners choose then, and every later launch calls the chosen
config directly (``_common.resolve_launch``). The tensors are tiny,
so torch's rows are host cost too (plus a negligible amount of arithmetic on
a CPU). On a CUDA device the tensors live there and tkern is also timed with
its real launches (``launches on``): then Triton's launcher is included.

Targets (issue 55 item 5), as ratios of torch's host time in the same run, since
absolute microseconds move 1.5x between machines: ``tkern.linear`` forward and
backward each <= 0.5x ``F.linear``'s (autograd included on both sides: tkern's
autograd.Function, torch's AddmmBackward); the loop's optimizer part <= 0.1x
torch's. The absolute microseconds stay in the rows, and tkern.linear's own time
(its time minus an autograd.Function that only saves its inputs and allocates its
outputs: the ``autograd.Function floor`` row, what torch charges any custom op)
beside them as figures.

    python benchmarks/bench_host.py            # writes benchmarks/results/host/ (CPU) or results/<device>/
    python benchmarks/bench_host.py --smoke    # fewer tensors and repeats, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    RESULTS,
    Mode,
    Results,
    device_name,
    device_slug,
    kernel_names,
    patched_launches,
    targets_markdown,
    tkern_kernels,
)

import tkern  # noqa: E402
import tkern.kernels  # noqa: E402

# isort: split
from triton.runtime.jit import KernelInterface  # noqa: E402

TENSOR_COUNTS = (10, 100, 1000)
SMOKE_TENSOR_COUNTS = (10, 30)
LINEAR = (8, 64, 32)  # M, K, N: tiny, so torch's arithmetic is negligible
#: Issue 55 item 5: tkern's host time over torch's, both measured in this run (ratios hold
#: across machines where absolute microseconds do not); what report_targets.py reads.
TARGETS = {"linear_fwd_vs_torch": 0.5, "linear_bwd_vs_torch": 0.5, "step_loop_1000_vs_torch": 0.1}
#: The loop case's two sides (:func:`loop_cases`).
LOOP_TKERN = "tkern FusedAdamW + DynamicLossScaler"
LOOP_TORCH = "torch AdamW(fused=True) + GradScaler"
FLOOR = "autograd.Function floor"
#: tkern.linear backward by .backward() with weight and bias in a FusedAdamW (the wgrad into its buffer)
INTO_FLAT = "tkern.linear (into FusedAdamW buffer, .backward())"


class _AllocOnly(torch.autograd.Function):
    """What any custom autograd op pays torch, with no work of its own: forward
    saves its three inputs and allocates the (M, N) output, backward allocates
    the three gradients. ``tkern.linear`` minus this is tkern's own host time."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return x.new_empty((x.shape[0], weight.shape[0]))

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


# --------------------------------------------------------------------------- stubs


@contextlib.contextmanager
def stubbed_launches() -> Iterator[Counter]:
    """Inside, ``kernel[grid](*args)`` of any Triton kernel is a no-op; the
    Counter yielded counts the launches by kernel name (``harness.patched_launches``).
    Kernel outputs stay unwritten, so what ran under the stubs (an optimizer's
    step count, say) is garbage afterwards: use those objects for timing only.
    The Counter is filled on exit: inside, a stubbed launch only notes its kernel
    (one list append), so the stub adds next to nothing to the time measured."""
    launches: Counter = Counter()
    launched: list[KernelInterface] = []
    names = kernel_names()

    def getitem(kernel, grid, real):
        launched.append(kernel)
        return _no_launch

    try:
        with patched_launches(getitem):
            yield launches
    finally:
        launches.update(names.get(id(k), type(k).__name__) for k in launched)


def _no_launch(*args, **kwargs) -> None:
    """A stubbed ``kernel[grid](...)``: takes the launch's arguments, does nothing."""


# --------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Loop(NamedTuple):
    """One iteration of a training loop's optimizer part, for :func:`host_us`: ``before``
    (zero_grad, the loss scaled) and ``after`` (the step) are timed; ``write`` between them
    (the gradients, as backward leaves them) is not: it is the model's cost, not the
    optimizer's, and it must happen for the step to see what a real loop gives it."""

    before: Callable[[], object]
    write: Callable[[], object]
    after: Callable[[], object]


def _timed(fn: Callable[[], object] | Loop, n: int, device: torch.device) -> float:
    """Seconds that ``n`` calls of ``fn`` take (a :class:`Loop`: its timed parts only)."""
    clock = time.perf_counter
    _sync(device)
    if not isinstance(fn, Loop):
        start = clock()
        for _ in range(n):
            fn()
        return clock() - start
    total = 0.0
    for _ in range(n):
        start = clock()
        fn.before()
        mid = clock()
        fn.write()
        resume = clock()
        fn.after()
        total += clock() - resume + mid - start
    return total


def _calibrated(fn: Callable[[], object] | Loop, device: torch.device, loop_s: float) -> int:
    """How many calls of ``fn`` take about ``loop_s`` seconds (after two warm-up calls)."""
    for _ in range(2):
        _timed(fn, 1, device)
    n = 1
    while True:
        elapsed = _timed(fn, n, device)
        if elapsed >= loop_s / 4 or n >= 1 << 20:
            return max(1, round(n * loop_s / max(elapsed, 1e-9)))
        n *= 2


def host_us(
    fns: dict[str, tuple[Callable[[], object] | Loop, bool]],
    device: torch.device,
    repeats: int,
    loop_s: float,
) -> dict[str, tuple[float, float]]:
    """(min, median) microseconds per call of each of ``fns`` (name: (fn or :class:`Loop`,
    whether it runs under the launch stubs)) over ``repeats`` timed loops of about ``loop_s``
    seconds each. The fns' loops are interleaved (loop i of each, back to back), so
    rows compared with each other (tkern's and torch's; tkern.linear and its floor)
    see the same load from other processes. On CUDA the device is drained before
    each loop but not waited for at its end: the time is the host's."""

    def stubs(stubbed: bool):
        return stubbed_launches() if stubbed else contextlib.nullcontext()

    loops = {}
    for name, (fn, stubbed) in fns.items():
        with stubs(stubbed):
            loops[name] = _calibrated(fn, device, loop_s)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, (fn, stubbed) in fns.items():
                with stubs(stubbed):
                    samples[name].append(1e6 * _timed(fn, loops[name], device) / loops[name])
    finally:
        if gc_was_enabled:
            gc.enable()
    _sync(device)
    return {name: (min(x), statistics.median(x)) for name, x in samples.items()}


# --------------------------------------------------------------------------- cases


def param_shapes(count: int) -> list[tuple[int, ...]]:
    """A layer's worth of tensors, alternating a (16, 16) weight and a (16,) bias."""
    return [(16, 16) if i % 2 == 0 else (16,) for i in range(count)]


def optimizer_cases(count: int, device: torch.device, launches_on: bool) -> dict[str, tuple[Callable, bool]]:
    """{impl: (step function, runs under the launch stubs)}"""
    cases = {}

    def tkern_params():
        shapes = param_shapes(count)
        params = [torch.zeros(s, device=device, dtype=torch.float16, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        return params

    params = tkern_params()
    opt = tkern.optim.FusedAdamW(params, lr=1e-3)
    cases["tkern FusedAdamW.step"] = (opt.step, True)

    params_s = tkern_params()
    opt_s = tkern.optim.FusedAdamW(params_s, lr=1e-3)
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.ones((), device=device))

    def scaled_step():
        scaler.step(opt_s)
        scaler.update()

    cases["tkern scaler.step + update"] = (scaled_step, True)
    if launches_on:
        params_l = tkern_params()
        opt_l = tkern.optim.FusedAdamW(params_l, lr=1e-3)
        cases["tkern FusedAdamW.step (launches on)"] = (opt_l.step, False)

    for flag in ("foreach", "fused"):
        fp32 = [torch.zeros(s, device=device, requires_grad=True) for s in param_shapes(count)]
        for p in fp32:
            p.grad = torch.zeros_like(p)
        try:
            torch_opt = torch.optim.AdamW(fp32, lr=1e-3, **{flag: True})
            torch_opt.step()
        except (RuntimeError, ValueError) as exc:  # fused=True where torch lacks it
            print(f"torch AdamW({flag}=True) on {device.type}: not available ({exc})")
            continue
        cases[f"torch AdamW({flag}=True).step"] = (torch_opt.step, False)
    return cases


def loop_cases(count: int, device: torch.device) -> dict[str, tuple[Loop, bool]]:
    """{impl: (the optimizer's part of a training loop, runs under the launch stubs)} over
    ``count`` tensors: tkern's FusedAdamW (fp16 params, fp32 master) under its
    DynamicLossScaler, and torch's AMP recipe, fp32 params under a GradScaler with
    AdamW(fused=True). Each iteration: ``zero_grad()`` and ``scaler.scale(loss)`` (timed),
    the gradients written as backward leaves them (untimed: tkern's into the ``.grad``
    views zero_grad put back, in place, as autograd accumulates into an existing
    ``.grad``; torch's assigned to the ``None`` its zero_grad left), then
    ``scaler.step(opt)`` and ``scaler.update()`` (timed)."""
    shapes = param_shapes(count)

    def side(dtype, make_opt, scaler):
        params = [torch.zeros(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]
        grads = [torch.full_like(p, 1e-3) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt = make_opt(params)
        loss = torch.ones((), device=device)
        if opt.__class__.__module__.startswith("tkern"):

            def write():
                for p, g in zip(params, grads, strict=True):
                    p.grad.copy_(g)

        else:

            def write():
                for p, g in zip(params, grads, strict=True):
                    p.grad = g

        def before():
            opt.zero_grad()
            scaler.scale(loss)

        def after():
            scaler.step(opt)
            scaler.update()

        return Loop(before, write, after)

    tkern_side = side(
        torch.float16, lambda ps: tkern.optim.FusedAdamW(ps, lr=1e-3), tkern.DynamicLossScaler()
    )
    torch_side = side(
        torch.float32,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        torch.amp.GradScaler(device.type),
    )
    return {LOOP_TKERN: (tkern_side, True), LOOP_TORCH: (torch_side, False)}


def linear_cases(device: torch.device, launches_on: bool) -> dict[str, tuple[Callable, Callable, bool]]:
    """{impl: (forward, backward, runs under the launch stubs)}"""
    m, k, n = LINEAR
    x = torch.randn(m, k, device=device, dtype=torch.float16, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(n, device=device, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.float16)
    fp8 = tkern.nn.Float8Linear(k, n, dtype=torch.bfloat16, device=device)
    x8 = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    fp8_io = ((x8, fp8.weight, fp8.bias), dy.bfloat16())
    # the training path: weight and bias in a fused optimizer's flat buffer, .backward()
    xt, wt, bt = (t.detach().clone().requires_grad_() for t in (x, w, b))
    opt = tkern.optim.FusedAdamW([wt, bt], lr=1e-3)
    # impl: (forward, runs under the stubs, (inputs, output gradient))
    fns = {
        "tkern.linear": (lambda: tkern.linear(x, w, b), True, None),
        "tkern.linear gelu": (lambda: tkern.linear(x, w, b, activation="gelu"), True, None),
        INTO_FLAT: (lambda: tkern.linear(xt, wt, bt), True, ((xt, wt, bt), dy)),
        "tkern Float8Linear (tensorwise)": (lambda: fp8(x8), True, fp8_io),
        FLOOR: (lambda: _AllocOnly.apply(x, w, b), False, None),
        "F.linear": (lambda: F.linear(x, w, b), False, None),
        "F.gelu(F.linear)": (lambda: F.gelu(F.linear(x, w, b)), False, None),
    }
    if launches_on:
        fns["tkern.linear (launches on)"] = (lambda: tkern.linear(x, w, b), False, None)
    cases = {}
    for impl, (fwd, stubbed, io) in fns.items():
        inputs, grad = io or ((x, w, b), dy)
        if stubbed:  # one real forward and backward first: the steady state of training,
            # where the autotuners have chosen and every later launch goes direct
            if impl == INTO_FLAT:
                fwd().backward(grad)  # (as training: into the optimizer's buffer)
            else:
                torch.autograd.grad(fwd(), inputs, grad)
        with stubbed_launches() if stubbed else contextlib.nullcontext():
            y = fwd()

        if impl == INTO_FLAT:

            def bwd(y=y, grad=grad, opt=opt):  # opt: kept alive with the case (its hooks)
                y.backward(grad, retain_graph=True)

        else:

            def bwd(y=y, inputs=inputs, grad=grad):
                return torch.autograd.grad(y, inputs, grad, retain_graph=True)

        cases[impl] = (fwd, bwd, stubbed)
    return cases


# --------------------------------------------------------------------------- main


def markdown(res: Results) -> str:
    meta = res.meta
    lines = [
        f"Host cost per call on **{meta['host_device']}** (torch {torch.__version__}); tkern rows with "
        "every Triton launch stubbed out unless marked `launches on`. Microseconds per call, best of "
        f"7 timed loops (median in host.csv); load average {meta['load_average']} on {meta['cpus']} CPUs.",
        "",
        "| case | impl | us/call | us/tensor | launches/call |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in res.rows:
        cells = [r["case"], r["impl"], r["us"], r.get("us_per_tensor", ""), r.get("launches", "")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    own = ", ".join(f"{way} {meta[f'linear_{way}_own_us']} us" for way in ("fwd", "bwd"))
    lines += [
        "",
        f"tkern.linear's own time (minus the `{FLOOR}` row, an autograd.Function that only saves its "
        f"inputs and allocates its outputs: what torch charges any custom op): {own}. The loop's rows "
        "time zero_grad, scaler.scale, scaler.step and scaler.update; the gradients written between "
        "them are not timed.",
        "",
        "Targets: tkern's host time over torch's, both rows of this run.",
        "",
        *targets_markdown(meta, TARGETS, "target (issue 55)"),
    ]
    return "\n".join(lines) + "\n"


def _print_table(res: Results, smoke: bool) -> None:
    """The rows as a table, and each target with whether it is met."""
    print()
    kind = "smoke, not a measurement" if smoke else "best of 7 loops, us per call"
    print(f"host cost per call on {res.meta['host_device']} ({kind})")
    header = ["case", "impl", "us", "us_median", "us_per_tensor", "launches"]
    table = [[str(r.get(c, "")) for c in header] for r in res.rows]
    widths = [max(len(x) for x in col) for col in zip(header, *table, strict=True)]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))
    for key, limit in TARGETS.items():
        value = res.meta.get(key)
        if value is not None:
            print(f"{key}: {value} (target <= {limit}: {'met' if value <= limit else 'NOT met'})")


def _once(fn: Callable[[], object] | Loop) -> None:
    """One call of ``fn`` (a :class:`Loop`: one whole iteration)."""
    for part in (fn.before, fn.write, fn.after) if isinstance(fn, Loop) else (fn,):
        part()


def measure(res: Results, case: str, fns: dict, timing: tuple, tensors: int | None = None) -> dict:
    """One row per impl of ``case`` (``fns``: impl: (fn or :class:`Loop`, runs under the
    stubs)), their timed loops interleaved (:func:`host_us` with ``timing``: (device,
    repeats, loop seconds)); returns the rows by impl."""
    counts = {}
    for impl, (fn, stubbed) in fns.items():
        with stubbed_launches() if stubbed else contextlib.nullcontext():
            _once(fn)  # first call: state, caches
        if stubbed:
            with stubbed_launches() as launches:
                _once(fn)
            counts[impl] = sum(launches.values())
    rows = {}
    for impl, (us, us_median) in host_us(fns, *timing).items():
        extra = {"us": round(us, 2), "us_median": round(us_median, 2)}
        if tensors:
            extra["us_per_tensor"] = round(us / tensors, 3)
        if impl in counts:
            extra["launches"] = counts[impl]
        rows[impl] = res.add(case, impl, us * 1e-3, **extra)
    return rows


def linear_case(label: str) -> str:
    return f"linear {label} " + "x".join(map(str, LINEAR))


def loop_case(count: int) -> str:
    return f"optimizer in a training loop, {count} tensors"


def ratios(res: Results, loop_tensors: int) -> None:
    """tkern's host time over torch's, per pair of rows of this run, into ``res.meta``
    (< 1: tkern takes less): the targets' (:data:`TARGETS`, the loop's at
    ``loop_tensors``) and the step alone against torch's foreach and fused AdamW."""
    pairs = {
        "linear_fwd_vs_torch": (linear_case("forward"), "tkern.linear", "F.linear"),
        "linear_bwd_vs_torch": (linear_case("backward"), "tkern.linear", "F.linear"),
        f"step_loop_{loop_tensors}_vs_torch": (loop_case(loop_tensors), LOOP_TKERN, LOOP_TORCH),
        "step_1000_vs_torch_foreach": (
            "optimizer step, 1000 tensors",
            "tkern FusedAdamW.step",
            "torch AdamW(foreach=True).step",
        ),
        "step_1000_vs_torch_fused": (
            "optimizer step, 1000 tensors",
            "tkern FusedAdamW.step",
            "torch AdamW(fused=True).step",
        ),
    }
    for key, (case, mine, theirs) in pairs.items():
        us = {r["impl"]: r["us"] for r in res.rows if r["case"] == case}
        if us.get(mine) and us.get(theirs):
            res.meta[key] = round(us[mine] / us[theirs], 3)


def main(argv: list[str] | None = None) -> Results:
    parser = argparse.ArgumentParser(prog="bench_host.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="fewer tensors and repeats; nothing written unless --out is given",
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: see the docstring)")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not tkern.INTERPRET
    device = torch.device("cuda" if gpu else "cpu")
    out_dir = args.out if args.smoke else (args.out or RESULTS / (device_slug() if gpu else "host"))
    timing = (device, *((3, 0.01) if args.smoke else (7, 0.1)))
    # One intra-op thread: the host cost of issuing work, not a CPU's parallel
    # arithmetic (and no OpenMP spinning against other processes on the cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res = Results("host", Mode(args.smoke, device, out_dir), metric=None)
    res.meta["host_device"] = f"{device.type} ({device_name()})" if gpu else "cpu"
    res.meta["kernels_stubbed"] = sorted(tkern_kernels())
    res.meta["cpus"] = os.cpu_count()
    counts = SMOKE_TENSOR_COUNTS if args.smoke else TENSOR_COUNTS
    for count in counts:
        rows = measure(
            res, f"optimizer step, {count} tensors", optimizer_cases(count, device, gpu), timing, count
        )
        if count == 1000:
            res.meta["step_us_per_tensor_1000"] = rows["tkern FusedAdamW.step"]["us_per_tensor"]
        gc.collect()
    rows = measure(res, loop_case(counts[-1]), loop_cases(counts[-1], device), timing, counts[-1])
    res.meta[f"step_loop_us_per_tensor_{counts[-1]}"] = rows[LOOP_TKERN]["us_per_tensor"]
    gc.collect()
    cases = linear_cases(device, launches_on=gpu)
    for way, index, label in (("fwd", 0, "forward"), ("bwd", 1, "backward")):
        fns = {impl: (fb[index], stubbed) for impl, (*fb, stubbed) in cases.items()}
        rows = measure(res, linear_case(label), fns, timing)
        mine, floor = rows["tkern.linear"]["us"], rows[FLOOR]["us"]
        res.meta[f"linear_{way}_us"], res.meta[f"floor_{way}_us"] = mine, floor
        res.meta[f"linear_{way}_own_us"] = round(mine - floor, 2)  # beyond what any autograd.Function costs
    torch.set_num_threads(threads)
    res.meta["load_average"] = [round(x, 2) for x in os.getloadavg()]  # other processes on the CPUs
    ratios(res, counts[-1])
    _print_table(res, args.smoke)
    res.save()
    if out_dir is not None:
        (out_dir / "host.md").write_text(markdown(res))
        print(f"wrote {out_dir}/host.md")
    return res


if __name__ == "__main__":
    main()
