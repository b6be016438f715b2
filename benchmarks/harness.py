"""The harness every benchmark script shares.

* :func:`setup` parses the common flags and decides the mode: on a CUDA device
  the real sizes are timed and written under ``benchmarks/results/<device>/``;
  with ``--smoke`` tiny sizes run anywhere (through Triton's interpreter on a
  CPU) to check the code paths, and nothing is written unless ``--out`` names a
  folder (``gpu_check.sh --dry-run`` writes its smoke results to a temporary
  one); on a CPU without ``--smoke`` the script says so and exits cleanly.
* :func:`commit` names the code measured: ``$TKERN_COMMIT``, else git, else
  (the device's copy of the tree has no ``.git``) the file ``.tkern-commit``
  that ``gpu_check.sh stamp`` writes at the repository root before the call.
* :class:`GraphCount` counts a fused optimizer's CUDA-graph captures and
  replays through its public ``graph_runner`` seam; :func:`graph_fields` is
  what a row records of it (``cuda_graph``, ``graph_fallback``, the counts).
* :func:`bench` times a callable: median (and 20th/80th percentiles) of
  ``triton.testing.do_bench`` on the GPU.
* :class:`Results` collects rows, writes ``<name>.json`` (``{"device",
  "torch", "triton", "date", "rows": [...]}``), ``<name>.csv`` and
  ``<name>.png``, and prints a table last.
* :func:`copy_bandwidth` and :func:`cublas_tflops` measure the device's two
  ceilings once.
* :func:`patched_launches` puts a function of the caller's in place of
  ``kernel[grid]`` for every tkern Triton kernel (the launch stubs of bench_host,
  the step ledger's counting); :func:`tkern_kernels` and :func:`kernel_names` name them.
* :data:`DEVICES` holds the datasheet peaks and bandwidth of the GPUs the results
  are read against (:func:`device_spec` finds a device's), :func:`model_flops` a
  training step's model FLOPs (the MFU column's numerator, the step ledger's check).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import importlib
import json
import math
import pkgutil
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import tkern  # before triton: on a CPU it must switch Triton's interpreter on first
import tkern.kernels

# isort: split
import triton
from triton.runtime.jit import KernelInterface

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (benchmarks/plots.py: the pictures, also drawn by report.py)

RESULTS = Path(__file__).resolve().parent / "results"
QUANTILES = (0.5, 0.2, 0.8)


@dataclass
class Mode:
    smoke: bool
    device: torch.device
    out_dir: Path | None  # where results go; None in smoke mode


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_slug(name: str | None = None) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: the results folder."""
    return re.sub(r"[^a-z0-9]+", "-", (name or device_name()).lower()).strip("-")


def setup(
    name: str,
    description: str,
    argv: list[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    sections: tuple[str, ...] = (),
) -> tuple[Mode, argparse.Namespace]:
    """Parse the common flags (and the script's own, from ``add_arguments``; with
    ``sections``, ``--sections``: which to run, in order, as a list in
    ``args.sections``); exit cleanly on a CPU without ``--smoke``."""
    parser = argparse.ArgumentParser(prog=f"bench_{name}.py", description=description)
    if add_arguments is not None:
        add_arguments(parser)
    if sections:
        parser.add_argument(
            "--sections",
            default=",".join(sections),
            help=f"comma-separated, run in this order (default {','.join(sections)})",
        )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, any device; nothing written unless --out is given"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default benchmarks/results/<device>)"
    )
    args = parser.parse_args(argv)
    if sections:
        args.sections = [x for x in args.sections.split(",") if x]
        unknown = sorted(set(args.sections) - set(sections))
        if unknown:
            parser.error(f"unknown sections {unknown}; choose from {list(sections)}")
    gpu = torch.cuda.is_available() and not tkern.INTERPRET
    if not gpu and not args.smoke:
        print(
            f"bench_{name}: no CUDA device (tkern runs interpreted on the CPU); nothing to measure. "
            "Use --smoke to check the code paths."
        )
        sys.exit(0)
    device = torch.device("cuda" if gpu else "cpu")
    out_dir = args.out if args.smoke else (args.out or RESULTS / device_slug())
    return Mode(args.smoke, device, out_dir), args


def bench(fn: Callable[[], object], mode: Mode, rep_ms: int = 100) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds per call of ``fn``."""
    if mode.smoke:
        fn()
        start = time.perf_counter()
        fn()
        ms = 1e3 * (time.perf_counter() - start)
        return ms, ms, ms
    return tuple(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=list(QUANTILES)))


def peak_mib(fn: Callable[[], object], mode: Mode) -> float | None:
    """MiB that one call of ``fn`` allocates at its peak beyond what was allocated
    before it (CUDA's caching-allocator statistics); None on a CPU."""
    if mode.device.type != "cuda":
        return None
    fn()  # warm: workspaces, autotuning and caches are not the call's own memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def targets_markdown(meta: dict, targets: dict[str, float], title: str = "target") -> list[str]:
    """Markdown rows of ``value <= bound`` targets read from ``meta``: met, missed
    or not measured."""
    lines = [f"| {title} | value | bound | status |", "| --- | --- | --- | --- |"]
    for key, bound in targets.items():
        value = meta.get(key)
        status = "not measured" if value is None else ("met" if value <= bound else "missed")
        lines.append(f"| {key} | {'' if value is None else value} | <= {bound:g} | {status} |")
    return lines


def error_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` of ``exc``, at most ``limit`` characters:
    how a row or a ``failed`` entry names what went wrong."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


def missing_api(module: object, names: list[str]) -> list[str]:
    """The ``names`` that ``module`` lacks (public API a benchmark needs that has
    not landed), spelled as ``tkern.<name>``."""
    prefix = getattr(module, "__name__", "?")
    missing = []
    for name in names:
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"{prefix}.{name}")
    return missing


def copy_bandwidth(mode: Mode, n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy in GB/s, counting the bytes read and written."""
    n = (n_bytes // 4) if not mode.smoke else 1 << 16
    src = torch.empty(n, dtype=torch.float32, device=mode.device)
    dst = torch.empty_like(src)
    ms, _, _ = bench(lambda: dst.copy_(src), mode)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def cublas_tflops(mode: Mode, n: int = 8192) -> float:
    """A large fp16 torch.matmul (cuBLAS) in TFLOP/s."""
    n = n if not mode.smoke else 64
    a = torch.randn(n, n, device=mode.device, dtype=torch.float16 if not mode.smoke else torch.float32)
    b = torch.randn_like(a)
    ms, _, _ = bench(lambda: a @ b, mode)
    return 2 * n**3 / (ms * 1e-3) / 1e12


#: The checkout whose commit :func:`commit` names.
ROOT = Path(__file__).resolve().parents[1]
#: Where ``gpu_check.sh stamp`` writes the commit for a device call (whose copy
#: of the tree has no ``.git``); untracked and not ignored, so it travels.
COMMIT_FILE = ROOT / ".tkern-commit"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def commit() -> str:
    """The commit measured (short hash, ``+dirty`` with uncommitted changes):
    ``$TKERN_COMMIT`` if set, else git's answer for :data:`ROOT`, else (no git or
    no ``.git``: the device's copy of the tree) :data:`COMMIT_FILE`'s, else
    ``unknown``. Git comes before the file, so a stamp left behind never names
    a later checkout. Every results file names the code it measured."""
    import os
    import subprocess

    if os.environ.get("TKERN_COMMIT"):
        return os.environ["TKERN_COMMIT"].strip()
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        stamp = COMMIT_FILE.read_text().strip() if COMMIT_FILE.is_file() else ""
        return stamp or "unknown"
    return head + ("+dirty" if dirty else "")


class GraphCount:
    """Wraps a fused optimizer's ``graph_runner`` (its documented seam for CUDA
    graphs, a :class:`tkern.graphs.GraphCapture`) to count the captures and replays
    of its step: whether a row's step really ran as a graph, beside ``cuda_graph``
    and ``graph_fallback``. Everything else is the wrapped seam's."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.captures = self.replays = 0
        self._inner = getattr(opt, "graph_runner", None)
        if self._inner is not None:
            opt.graph_runner = self

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def capture(self, fn):
        """The seam's capture, its replay counted: ``(replay, result)``."""
        replay, out = self._inner.capture(fn)
        self.captures += 1

        def counted() -> None:
            self.replays += 1
            replay()

        return counted, out


def graph_possible() -> bool:
    """Whether this machine can capture a CUDA graph of tkern's kernels (a GPU,
    compiled Triton): where a graphed row is meant to replay."""
    return torch.cuda.is_available() and not tkern.INTERPRET


def graph_fields(owner: object, count: GraphCount | None = None) -> dict:
    """What a row records of a step's CUDA graph: the ``cuda_graph`` setting of
    ``owner`` (a fused optimizer or a Trainer; None for torch's), why its last
    step ran eager (``graph_fallback``, None when it replayed; after a failed
    capture, that failure), whether it is meant to run graphed (``graphed``: on
    a GPU, its graph not turned off), and with a :class:`GraphCount` the
    captures and replays so far."""
    setting = getattr(owner, "cuda_graph", None)
    fields = {
        "cuda_graph": setting,
        "graph_fallback": getattr(owner, "graph_fallback", None),
        # whether the row is meant to run as a CUDA graph (report.py reports such a
        # row with no replay as "fell back", never as a figure)
        "graphed": graph_possible() and hasattr(owner, "graph_fallback") and setting is not False,
    }
    if count is not None:
        fields.update(graph_captures=count.captures, graph_replays=count.replays)
    return fields


# --------------------------------------------------------------------------- tkern's launches


def tkern_kernels() -> dict[str, KernelInterface]:
    """Every Triton kernel object defined in ``tkern.kernels``'s modules, by ``module.name``."""
    found = {}
    for info in pkgutil.iter_modules(tkern.kernels.__path__):
        module = importlib.import_module(f"tkern.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, KernelInterface):
                found[f"{info.name}.{name}"] = obj
    return found


def kernel_names() -> dict[int, str]:
    """id -> ``module.name`` of every tkern Triton kernel object and of the kernel
    objects it wraps (an autotuner's heuristics and jit function: the same kernel)."""
    names: dict[int, str] = {}
    for name, obj in tkern_kernels().items():
        while isinstance(obj, KernelInterface):
            names.setdefault(id(obj), name)
            obj = getattr(obj, "fn", None)
    return names


@contextlib.contextmanager
def patched_launches(getitem: Callable[[KernelInterface, object, Callable], Callable]) -> Iterator[None]:
    """Inside, ``kernel[grid]`` of any tkern Triton kernel is ``getitem(kernel, grid,
    real)``, where ``real(kernel, grid)`` is the launch it replaces (call ``real(kernel,
    grid)(*args)`` to launch for real). Patched on the kernel classes (``__getitem__`` is
    looked up on the type: an autotuner, its heuristics, its jit function and their base
    ``KernelInterface``), restored on exit, also when the body raises. The patch costs
    one dict lookup and one call per launch beyond ``getitem`` itself."""
    classes = {KernelInterface}
    for obj in tkern_kernels().values():
        while isinstance(obj, KernelInterface):
            classes.add(type(obj))
            obj = getattr(obj, "fn", None)
    saved = {cls: cls.__dict__.get("__getitem__") for cls in classes}
    resolved = {cls: cls.__getitem__ for cls in classes}

    def patched(kernel, grid):
        return getitem(kernel, grid, resolved.get(type(kernel)) or resolved[KernelInterface])

    for cls in classes:
        cls.__getitem__ = patched
    try:
        yield
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__getitem__
            else:
                cls.__getitem__ = original


# --------------------------------------------------------------------------- peaks and model FLOPs


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's dense peaks (TFLOP/s) and HBM bandwidth (TB/s), and where they come from."""

    name: str
    fp8: float
    bf16: float  # fp16 and bf16 tensor cores
    tf32: float
    fp32: float  # no tensor cores
    hbm_tbps: float
    source: str

    def peak_tflops(self, dtype: torch.dtype, allow_tf32: bool = False) -> float:
        if dtype.is_floating_point and dtype.itemsize == 1:
            return self.fp8
        if dtype in (torch.float16, torch.bfloat16):
            return self.bf16
        return self.tf32 if allow_tf32 else self.fp32


_SPEC_SOURCE = (
    "NVIDIA {gpu} Tensor Core GPU datasheet, SXM form factor, dense (the datasheet's sparse figures halved)"
)
DEVICES = {
    "h100": DeviceSpec("NVIDIA H100 SXM", 1978.9, 989.4, 494.7, 66.9, 3.35, _SPEC_SOURCE.format(gpu="H100")),
    "h200": DeviceSpec("NVIDIA H200 SXM", 1978.9, 989.4, 494.7, 66.9, 4.8, _SPEC_SOURCE.format(gpu="H200")),
}


def slug(name: str) -> str:
    """A file-name part for ``name``: its words joined by dashes, brackets and commas dropped
    (``torch fp32 (no tf32)`` -> ``torch-fp32-no-tf32``)."""
    return "-".join(re.sub(r"[(),]", "", name).split())


def device_key(name: str) -> str | None:
    """The :data:`DEVICES` key of a device named like ``torch.cuda.get_device_name()``
    (``NVIDIA H200`` -> ``h200``); None for a device not in it."""
    low = name.lower()
    return next((key for key in DEVICES if key in low), None)


def device_spec(name: str) -> DeviceSpec | None:
    """The spec of a device named like ``torch.cuda.get_device_name()``; None for a
    device not in :data:`DEVICES`."""
    key = device_key(name)
    return None if key is None else DEVICES[key]


def linear_params(model: nn.Module) -> int:
    """Weights of every GEMM layer (``nn.Linear``, GPT-2's ``Conv1D`` and what
    convert_network makes of them), the LM head included (tied or not)."""
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and not isinstance(m, nn.Embedding):
            total += w.numel()
    return total


def attention_config(model: nn.Module) -> tuple[int, int] | None:
    """(layers, width) of the transformers model inside ``model``; None for a model
    without attention."""
    cfg = next(
        (m.config for m in model.modules() if hasattr(getattr(m, "config", None), "num_hidden_layers")), None
    )
    return None if cfg is None else (cfg.num_hidden_layers, cfg.hidden_size)


def model_flops(model: nn.Module, tokens: int, seq: int | None = None) -> dict[str, int]:
    """The model FLOPs of one training step of ``model`` over ``tokens`` tokens (sequences
    of ``seq``): 6 x linear params x tokens (forward, dgrad, wgrad: 2 each) + attention
    12 x layers x tokens x seq x width (QK^T and AV, 2 FLOPs per multiply-add, forward and
    twice that backward, no causal discount). ``lm head``: the part of the linear params
    in the head (an ``lm_head`` module). The count bench_train's MFU column divides by,
    and the ledger's FLOPs agree with (a test)."""
    p = linear_params(model)
    head = next((m.weight.numel() for name, m in model.named_modules() if name.endswith("lm_head")), 0)
    att = attention_config(model)
    attention = 12 * att[0] * tokens * seq * att[1] if att is not None and seq else 0
    return {
        "blocks": 6 * (p - head) * tokens,
        "lm head": 6 * head * tokens,
        "attention": attention,
        "total": 6 * p * tokens + attention,
    }


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


class Results:
    """Rows of one benchmark, written as JSON, CSV and a PNG plot.

    Args:
        name: file stem (``gemm``, ``optimizer``, ``train``).
        mode: from :func:`setup`.
        metric: the throughput column, ``"tflops"`` or ``"gbps"`` (or None).
        merge: keep the rows already in the results folder's ``<name>.json`` (same
            device) that this run does not measure again: a run of a subset
            (``--models``, ``--sections``) adds to the file instead of replacing it.
            Every row names its run (``commit``, ``date``), so a merged file says
            which run each figure came from.
    """

    def __init__(self, name: str, mode: Mode, metric: str | None, merge: bool = False) -> None:
        self.name, self.mode, self.metric = name, mode, metric
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.stamp = {"commit": commit(), "date": _now()}
        if merge and mode.out_dir is not None and (mode.out_dir / f"{name}.json").is_file():
            old = json.loads((mode.out_dir / f"{name}.json").read_text())
            if old.get("device") == device_name():
                run = {"commit": old.get("commit", "not recorded"), "date": old.get("date", "?")}
                self.rows = [{**row, **{k: v for k, v in run.items() if k not in row}} for row in old["rows"]]
                self.meta = {k: v for k, v in old.items() if k not in (*self.payload_keys, "rows")}

    payload_keys = ("device", "torch", "triton", "date", "commit")

    def add(self, case: str, impl: str, ms: float | None, **extra) -> dict:
        """One row; ``ms`` None for a row that was not timed (its ``skipped`` says why).
        It replaces a merged row of the same case and impl."""
        row = {"case": case, "impl": impl, "ms": None if ms is None else round(ms, 5), **extra, **self.stamp}
        self.rows = [r for r in self.rows if (r["case"], r["impl"]) != (case, impl)]
        self.rows.append(row)
        return row

    def payload(self) -> dict:
        runs = sorted({r["commit"] for r in self.rows if "commit" in r} | {self.stamp["commit"]})
        return {
            "device": device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": self.stamp["date"],
            # one commit, or the runs merged into this file (each row names its own)
            "commit": self.stamp["commit"] if len(runs) == 1 else " + ".join(runs) + " (rows name theirs)",
            **self.meta,
            "rows": self.rows,
        }

    def ms_of(self, case: str, impl: str) -> float:
        """The ms of ``impl`` on ``case``; nan when it was not timed."""
        ms = next((r["ms"] for r in self.rows if r["case"] == case and r["impl"] == impl), None)
        return float("nan") if ms is None else ms

    def ratio(self, case: str, impl: str, baseline: str, baseline_case: str | None = None) -> float:
        """Speed of ``impl`` relative to ``baseline`` on ``case`` (baseline ms / impl ms;
        the baseline's row from ``baseline_case`` if given); nan if either is missing."""
        return self.ms_of(baseline_case or case, baseline) / self.ms_of(case, impl)

    def save(self, plot: bool = False) -> None:
        """Write ``<name>.json`` and ``.csv`` (and with ``plot`` its picture, drawn by
        :func:`plots.draw` from the same payload ``report.py --write`` redraws from)."""
        if self.mode.out_dir is None:
            return
        self.mode.out_dir.mkdir(parents=True, exist_ok=True)
        payload = self.payload()
        (self.mode.out_dir / f"{self.name}.json").write_text(json.dumps(payload, indent=1) + "\n")
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(self.mode.out_dir / f"{self.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
        written = ".json, .csv"
        if plot:
            try:
                if plots.draw(payload, self.mode.out_dir / f"{self.name}.png", self.name):
                    written += ", .png"
            except ImportError:
                print("(matplotlib is missing: no plot; pip install 'tkern[bench]')")
        print(f"wrote {self.mode.out_dir}/{self.name}{written}")

    def print_table(self, columns: list[str], summary: list[str] = ()) -> None:
        header = ["case", "impl", *columns]
        lines = [[str(r.get(c, "")) for c in header] for r in self.rows]
        widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
        print()
        print(
            f"{self.name} on {device_name()} "
            f"({'smoke, not a measurement' if self.mode.smoke else 'median of do_bench'})"
        )
        for row in [header, ["-" * w for w in widths], *lines]:
            print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))
        for line in summary:
            print(line)


def main(argv: list[str] | None = None) -> None:
    """Measure the two ceilings once; write ceilings.json."""
    mode, _ = setup("ceilings", "The device's copy bandwidth and cuBLAS fp16 matmul rate.", argv)
    res = Results("ceilings", mode, metric=None)
    gbps, tflops = copy_bandwidth(mode), cublas_tflops(mode)
    res.meta.update({"copy_gbps": round(gbps, 1), "cublas_fp16_8192_tflops": round(tflops, 1)})
    res.save()
    print(f"copy bandwidth (read + write): {gbps:.0f} GB/s; cuBLAS fp16 8192^3: {tflops:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
