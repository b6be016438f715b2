"""CUDA graphs: a step captured once and replayed as one launch.

Two steps are captured, both through this room:

* the optimizer's device step (:class:`tkern.optim.FusedOptimizer`, ``cuda_graph=None``:
  on by default on CUDA): the statistics, every update and the step counts;
* the trainer's whole step (``Trainer(cuda_graph=True)``): zeroing, forward, loss,
  backward, the scaler's step and update, one graph per batch shape.

The pieces they share, and the one vocabulary they use:

* :class:`GraphCapture`, the seam between the bookkeeping and the device:
  :class:`CudaGraphCapture` on a GPU; tests pass one that records on a CPU.
  ``blocker(device)`` says why a step on that device cannot be captured.
* :class:`StepGraph`: one step's static inputs, its warm-ups, its capture and its
  replays. The inputs are copied into the static buffers before *every* run, warm-ups
  included, so a capture records exactly the launches the warm-ups ran, with the same
  tensors: the same Triton specialization (pointer alignment, divisibility), the same
  autotuner choice, so nothing is compiled, autotuned or allocated-and-initialised
  inside a capture. ``bytes``: what its capture took for its memory pool.
* :class:`StepGraphs`: a step's graphs keyed by a *stamp* (what the graphs bake in:
  a change drops them all) and a *shape* (one graph each, up to ``max_graphs``);
  ``pool_bytes``: the memory their captures hold.
* How a step ran, counted in ``graph_counts`` by both owners: ``"warmup"``,
  ``"capture"`` (captured, then replayed), ``"replay"`` and ``"eager"`` (not graphed);
  why the last step was not a replay: ``graph_fallback`` (None when it was graphed).
* :func:`key_value`: how a hyperparameter enters a stamp (a tensor by identity).
* :func:`trace_launches`: every launch of a tkern Triton kernel inside a block, with
  its arguments (on a GPU they never pass torch's dispatcher, so a dispatch mode
  alone does not see them); ``Trainer(cuda_graph="auto")`` compares two steps' launches.
* :func:`pool_usage`: the bytes a graph pool's segments hold in an allocator snapshot
  (:meth:`CudaGraphCapture.pool_usage` reads its own pool's).
* A failed capture: :func:`capture_failed` gives the one-line reason; with the
  environment variable ``TKERN_GRAPH_STRICT=1`` (the test suite sets it) it re-raises
  the error instead, so a capture that fails in a test fails the test.

This module sits below :mod:`tkern.optim` and :mod:`tkern.train.trainer` and imports neither.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from tkern.kernels import INTERPRET

__all__ = [
    "CAPTURE",
    "CaptureError",
    "HostCounters",
    "EAGER",
    "REPLAY",
    "STRICT_ENV",
    "WARMUP",
    "CudaGraphCapture",
    "GraphCapture",
    "PoolUsage",
    "StepGraph",
    "StepGraphs",
    "capture_failed",
    "device_blocker",
    "in_graph_step",
    "key_value",
    "pool_usage",
    "strict",
    "trace_launches",
]

T = TypeVar("T")

#: How a step ran (the keys of ``graph_counts``).
WARMUP, CAPTURE, REPLAY, EAGER = "warmup", "capture", "replay", "eager"

#: Set to 1 to re-raise a failed capture instead of warning and running eager.
STRICT_ENV = "TKERN_GRAPH_STRICT"


def strict() -> bool:
    """Whether a failed capture re-raises (``TKERN_GRAPH_STRICT`` set, and not to 0)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


class HostCounters:
    """Host-side counts (an optimizer's steps, a scaler's updates) that a caller must be
    able to put back when a step's Python ran once without the step counting (a failed
    CUDA graph capture: ``tkern.train.trainer_graph`` restores them so the step counts
    once). A subclass names its counts in ``_HOST_COUNTERS``: {key: attribute}."""

    _HOST_COUNTERS: dict[str, str] = {}

    def host_counters(self) -> dict[str, int]:
        """The host-side counts, for :meth:`restore_host_counters` to put back."""
        return {key: getattr(self, attr) for key, attr in self._HOST_COUNTERS.items()}

    def restore_host_counters(self, counters: dict[str, int]) -> None:
        """Put back what :meth:`host_counters` returned."""
        for key, attr in self._HOST_COUNTERS.items():
            setattr(self, attr, int(counters[key]))


class CaptureError(RuntimeError):
    """A seam's capture raised (the error is the ``__cause__``); the graph stays uncaptured."""


def capture_failed(what: str, error: BaseException) -> str:
    """The one-line reason capturing ``what`` failed with ``error`` (a
    :class:`CaptureError`: its cause); under ``TKERN_GRAPH_STRICT=1`` raises the
    cause instead. Call it in the ``except`` block that caught ``error``."""
    if isinstance(error, CaptureError) and error.__cause__ is not None:
        error = error.__cause__
    if strict():
        raise error
    text = str(error)
    first = text.splitlines()[0] if text else ""
    return f"capturing {what} failed ({type(error).__name__}: {first})"


# ---------------------------------------------------------------------- nesting

_local = threading.local()


def in_graph_step() -> bool:
    """Whether this thread is inside a :class:`StepGraph`'s warm-up or capture, or a
    CUDA stream capture: a graph nested in it (the optimizer's step inside the
    trainer's whole step) steps aside, in the warm-ups as in the capture, so the
    outer graph captures the launches its warm-ups ran."""
    if getattr(_local, "depth", 0) > 0:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def _graph_step() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


# ---------------------------------------------------------------------- launch traces


def _tkern_kernels() -> list[Any]:
    """The Triton functions of the imported ``tkern`` modules that launch (under any
    ``triton.autotune`` / ``triton.heuristics``), each once: those with ``pre_run_hooks``."""
    from triton.runtime.jit import KernelInterface

    found: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] != "tkern":
            continue
        for value in list(vars(module).values()):
            while isinstance(value, KernelInterface) and not hasattr(value, "pre_run_hooks"):
                value = getattr(value, "fn", None)  # an autotuner's or heuristics' function
            if isinstance(getattr(value, "pre_run_hooks", None), list):
                found[id(value)] = value
    return list(found.values())


@contextlib.contextmanager
def trace_launches(record: Callable[[str, tuple, dict], None]) -> Iterator[None]:
    """Call ``record(kernel name, args, kwargs)`` for every launch of a tkern Triton
    kernel that this thread makes inside the ``with`` block, compiled or interpreted
    (under the interpreter the tensors are its host views of the same memory).

    Through Triton's own pre-run hooks (``JITFunction.pre_run_hooks``), put on the
    kernels of the imported ``tkern`` modules for the block only: launches outside a
    trace pay nothing. A kernel's launch on a GPU never passes torch's dispatcher, so a
    ``TorchDispatchMode`` does not see it; this does."""
    thread = threading.get_ident()
    hooked: list[tuple[list, Callable]] = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(*args: Any, **kwargs: Any) -> None:
            if threading.get_ident() == thread:
                record(name, args, kwargs)

        return hook

    try:
        for fn in _tkern_kernels():
            hook = hook_for(getattr(fn, "__name__", type(fn).__name__))
            fn.pre_run_hooks.append(hook)
            hooked.append((fn.pre_run_hooks, hook))
        yield
    finally:
        for hooks, hook in hooked:
            hooks.remove(hook)


def device_blocker(
    device: torch.device | None,
    what: str,
    *,
    device_type: str = "cuda",
    interpreted: bool | None = None,
) -> str | None:
    """Why a step whose ``what`` (``"the params are"``, ``"the model is"``) on
    ``device`` cannot be captured by a seam for ``device_type``, or None.
    ``interpreted``: tkern's kernels run in Triton's interpreter (default: as imported)."""
    if device is None or device.type != device_type:
        return f"{what} on {device}, and only {device_type} work can be captured"
    if INTERPRET if interpreted is None else interpreted:
        return "tkern's kernels run in Triton's interpreter (TRITON_INTERPRET=1), on the host"
    if in_graph_step():
        return "the step is part of another graph's warm-up or capture (e.g. Trainer(cuda_graph=True))"
    return None


# ---------------------------------------------------------------------- the seam


class GraphCapture(Protocol):
    """The seam between the graphs' bookkeeping and the device:
    :class:`CudaGraphCapture` on a GPU; tests pass one that records on a CPU."""

    #: the device type whose work this seam can capture
    device_type: str

    def blocker(self, device: torch.device | None) -> str | None:
        """Why a step on ``device`` cannot be captured now (None if it can)."""
        ...

    def warmup(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` eagerly, as a warm-up for a later capture; return its result."""
        ...

    def capture(self, fn: Callable[[], T]) -> tuple[Callable[[], None], T]:
        """Record ``fn`` without running it: (replay, what ``fn`` returned, static
        tensors that every replay rewrites)."""
        ...

    def reserved_bytes(self) -> int:
        """The device memory the allocator holds now: a capture's pool is the growth
        across it (nothing else allocates while a capture runs)."""
        ...

    def pool_usage(self) -> PoolUsage:
        """What the pool of this seam's graphs holds now. Optional: without it a pool is
        the growth of :meth:`reserved_bytes` across each capture."""
        ...

    def collectives_blocker(self, groups: Sequence[Any]) -> str | None:
        """Why a step that runs collectives on the process ``groups`` cannot be
        captured (None if it can)."""
        ...

    def time(self, fn: Callable[[], T]) -> tuple[T, float, float]:
        """Run ``fn`` eagerly from an idle device: (its result, seconds until ``fn``
        returned on the host, seconds until the device finished its work)."""
        ...


class PoolUsage(NamedTuple):
    """The memory a graph pool holds, in bytes: ``reserved`` (its segments: what the
    allocator took from the device for it) and ``allocated`` (the blocks in use in them,
    as ``torch.cuda.memory_allocated`` counts them)."""

    reserved: int
    allocated: int


def pool_usage(segments: Iterable[dict[str, Any]], pool: Sequence[int]) -> PoolUsage:
    """What pool ``pool`` (a ``torch.cuda.graph_pool_handle()``) holds among ``segments``,
    an allocator snapshot's (``torch.cuda.memory_snapshot()``: each segment with its
    ``segment_pool_id``, ``total_size`` and ``allocated_size``). Unlike the growth of
    ``memory_reserved()`` across a capture, this stays true after graphs are dropped and
    captured again into the memory the pool already holds."""
    pool = tuple(pool)
    mine = [s for s in segments if tuple(s["segment_pool_id"]) == pool]
    return PoolUsage(sum(s["total_size"] for s in mine), sum(s["allocated_size"] for s in mine))


class CudaGraphCapture:
    """:class:`GraphCapture` with ``torch.cuda.CUDAGraph``, as torch's recipe for
    whole-network capture: warm-ups and capture on a side stream. Everything that
    waits for the device happens before the capture begins (one synchronize); the
    captured region frees nothing and runs in the "thread_local" error mode (a
    DataLoader's pin-memory thread may call the CUDA API meanwhile, which the default
    "global" mode forbids).

    Every graph this seam captures shares one memory pool (as
    ``torch.cuda.make_graphed_callables`` shares one across its callables): a graph's
    temporaries are rewritten by its own replay before they are read, and the graphs
    of one owner never replay at once, so a second graph (the epoch's last, smaller
    batch) reuses the first one's temporaries instead of holding its own."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None  # made on first use: none on a CPU
        self._pool: Any = None  # the shared pool's handle, made at the first capture

    def __getstate__(self) -> dict[str, Any]:
        return {"_stream": None, "_pool": None}  # a copy (a pickled optimizer) makes its own

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def blocker(self, device: torch.device | None) -> str | None:
        return device_blocker(device, "the params are", device_type=self.device_type)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved()

    def pool_usage(self) -> PoolUsage:
        """What the pool this seam's graphs share holds now (nothing before its first
        capture), from the allocator's snapshot (:func:`pool_usage`; it lists every
        segment: a few milliseconds, for a report, not for a step)."""
        if self._pool is None:
            return PoolUsage(0, 0)
        return pool_usage(torch.cuda.memory_snapshot(), self._pool)

    def collectives_blocker(self, groups: Sequence[Any]) -> str | None:
        # NCCL's collectives are captured into the graph (on the capturing stream) and
        # replay with it; gloo's run on the host and cannot be
        import torch.distributed as dist

        for group in groups:
            backend = str(dist.get_backend(group))
            if backend != "nccl":
                return (
                    f"the step's collectives run on {backend}, which CUDA graphs cannot capture (NCCL's can)"
                )
        return None

    def time(self, fn: Callable[[], T]) -> tuple[T, float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        return out, host, time.perf_counter() - start

    def warmup(self, fn: Callable[[], T]) -> T:
        # a side stream, as capture uses one: lazy per-stream state (autograd's
        # stream bookkeeping, cuBLAS handles) is made on a stream that is not the
        # legacy default one
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, fn: Callable[[], T]) -> tuple[Callable[[], None], T]:
        torch.cuda.synchronize()  # before the capture: nothing pending crosses into it
        graph = torch.cuda.CUDAGraph()
        stream = self._side_stream()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                with contextlib.suppress(Exception):  # the capture is void; fn's error is the news
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return graph.replay, out


# ---------------------------------------------------------------------- graphs


class StepGraph(Generic[T]):
    """One step as one graph: ``fn(*static_inputs)`` runs ``warmup_steps`` times
    through the seam's warm-up, is then captured, and replays from then on.

    ``inputs`` are copied into this graph's static buffers before every run (warm-ups
    included), and ``fn`` always gets the static buffers: the capture records the
    launches the warm-ups ran, with the same tensors. A capture that raises leaves
    the graph uncaptured and raises :class:`CaptureError`; its owner decides what
    follows (:func:`capture_failed`)."""

    def __init__(self, inputs: Sequence[torch.Tensor], seam: GraphCapture, warmup_steps: int) -> None:
        #: the static input buffers every run reads
        self.inputs = tuple(torch.empty_like(t) for t in inputs)
        self.seam = seam
        self.warmup_steps = warmup_steps
        self.warmups = 0
        self._replay: Callable[[], None] | None = None
        self._out: Any = None
        #: the bytes the capture added to the allocator's reserve (the graph's pool); 0 before
        self.bytes = 0

    @property
    def captured(self) -> bool:
        """Whether the step is captured (every later run replays it)."""
        return self._replay is not None

    def run(self, fn: Callable[..., T], inputs: Sequence[torch.Tensor]) -> tuple[T, str]:
        """``(fn's result, how the step ran)``: a warm-up, a capture (then a replay) or a
        replay. After a replay the result is the captured static output, which the
        next replay rewrites."""
        for static, value in zip(self.inputs, inputs, strict=True):
            static.copy_(value, non_blocking=True)
        if self._replay is None:
            if self.warmups < self.warmup_steps:
                self.warmups += 1
                with _graph_step():
                    return self.seam.warmup(lambda: fn(*self.inputs)), WARMUP
            reserved = getattr(self.seam, "reserved_bytes", None)  # optional for a seam
            before = 0 if reserved is None else reserved()
            try:
                with _graph_step():
                    replay, out = self.seam.capture(lambda: fn(*self.inputs))
            except Exception as e:
                raise CaptureError(f"capture failed: {e}") from e
            self.bytes = 0 if reserved is None else max(reserved() - before, 0)
            self._replay, self._out = replay, out
            how = CAPTURE
        else:
            how = REPLAY
        self._replay()
        return self._out, how


class StepGraphs:
    """A step's graphs: one :class:`StepGraph` per *shape* (up to ``max_graphs``),
    all dropped when the *stamp* (what they bake in) changes.

    The optimizer holds one (its stamp: the groups' hyperparameters and planned
    ranges; one shape; one warm-up), the trainer one per batch shape (its stamp: the
    groups' hyperparameters and the scaler's state; three warm-ups). ``counts`` says
    how each step ran (``warmup``, ``capture``, ``replay``, ``eager``)."""

    def __init__(self, seam: GraphCapture, *, warmup_steps: int, max_graphs: int) -> None:
        self.seam = seam
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self.counts: Counter[str] = Counter()
        self._graphs: dict[Hashable, StepGraph] = {}
        self._stamp: Hashable = None

    @property
    def pool_bytes(self) -> int:
        """The memory the graphs' pool holds (:meth:`pool_usage`'s ``reserved``)."""
        return self.pool_usage().reserved

    def pool_usage(self) -> PoolUsage:
        """The memory the graphs' pool holds: the seam's own measure where it has one
        (:meth:`CudaGraphCapture.pool_usage`), else what each graph's capture added to
        the seam's reserve (:attr:`StepGraph.bytes`, counted as allocated too)."""
        measure = getattr(self.seam, "pool_usage", None)  # optional for a seam
        if measure is not None:
            return measure()
        grown = sum(g.bytes for g in self._graphs.values())
        return PoolUsage(grown, grown)

    def captured(self, shape: Hashable = None) -> bool:
        """Whether the graph of ``shape`` is captured (its next run replays it, unless
        the stamp changed): where it is not, the next run may capture it."""
        graph = self._graphs.get(shape)
        return graph is not None and graph.captured

    def reset(self) -> None:
        """Drop every graph and static buffer (after a load changed the state they captured)."""
        self._graphs.clear()
        self._stamp = None

    def run(
        self,
        fn: Callable[..., T],
        inputs: Sequence[torch.Tensor],
        stamp: Callable[[], Hashable],
        shape: Hashable = None,
    ) -> tuple[T, str]:
        """One step: ``fn(*inputs)`` through the graph of ``shape`` (made if there is
        room; else run eagerly, reported as ``"eager"``). ``stamp()`` is read before
        the step and, after a step that ran Python (which may build what the stamp
        looks at, e.g. the scaler's state on the first step), again after it."""
        now = stamp()
        if now != self._stamp:
            self.reset()
            self._stamp = now
        graph = self._graphs.get(shape)
        if graph is None and len(self._graphs) >= self.max_graphs:
            out, how = fn(*inputs), EAGER
        else:
            if graph is None:
                graph = self._graphs[shape] = StepGraph(inputs, self.seam, self.warmup_steps)
            out, how = graph.run(fn, inputs)
        self.counts[how] += 1
        if how != REPLAY:
            self._stamp = stamp()
        return out, how


class _Same:
    """A key part equal only to the same object (``==`` on tensors is elementwise),
    holding it alive so that its ``id`` cannot be reused while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def key_value(value: Any) -> Hashable:
    """How a hyperparameter enters a stamp. A number as itself. A tensor by identity
    and address: a graph reads it where it was captured, so writes into it (a
    device lr moved in place by a schedule) are seen by every replay and keep the
    graph, while another tensor, or this one moved (``.data =``), makes another
    stamp. Anything unhashable by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", _Same(value), value.data_ptr())
    try:
        hash(value)
    except TypeError:
        return ("object", _Same(value))
    if isinstance(value, tuple):
        return tuple(key_value(v) for v in value)
    return value
