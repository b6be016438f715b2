"""A capture seam for the CPU with a CUDA graph's contract (:class:`tkern.graphs.GraphCapture`).

A CPU has no CUDA graphs, so the tests capture through :class:`RecordingCapture`:

* ``capture(fn)`` runs ``fn`` while recording every launch it makes, Triton kernels
  and torch ops alike, with the very argument objects (tensors by identity, Python
  values as they were), then undoes every write those launches made to tensors that
  existed before, and fills what they allocated with NaN (a graph's memory holds
  nothing until its first replay): as a capture, it has no effect;
* ``replay()`` runs exactly the recorded launches again, on the recorded arguments,
  writing each op's fresh outputs into the tensors the capture returned. c10d's
  collectives are dispatcher ops too: a replay runs them again (and waits for them, as
  their callers did), so replays on every rank of a group meet in each collective.

So a replay reads only what the capture bound: a launch that took a tensor made
afresh for its step replays the stale one, and a Python value changed after the
capture is not seen; a graphed run then differs from an eager one.

The seam also records, for every Triton launch of a warm-up and of a capture, its
specialization: the argument properties Triton compiles a kernel for (each pointer's
dtype and 16-byte alignment, each int's divisibility by 16 and whether it is 1, the
constexprs, the launch options). On a GPU a capture whose launch has a key no warm-up
ran compiles (or autotunes) inside the capture, which CUDA refuses.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import _normalize_ty

_run = InterpretedFunction.run


def specialization(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> tuple:
    """``(kernel name, per-parameter key, options)`` as Triton keys its compile cache
    (``JITFunction.run`` -> ``native_specialize_impl`` per argument)."""
    fn = kernel.fn
    sig = inspect.signature(fn)
    names = list(sig.parameters)
    annotations = {n: _normalize_ty(t) for n, t in inspect.get_annotations(fn).items()}
    no_spec = set(kernel.kwargs.get("do_not_specialize") or ())
    no_align = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    bound = dict(zip(names, args, strict=False))
    bound.update((k, v) for k, v in kwargs.items() if k in sig.parameters)
    key = []
    for i, (name, param) in enumerate(sig.parameters.items()):
        value = bound.get(name, param.default)
        if annotations.get(name) == "constexpr":
            key.append((name, "constexpr", repr(value)))
            continue
        specialize = i not in no_spec and name not in no_spec
        align = i not in no_align and name not in no_align
        try:
            key.append((name, *native_specialize_impl(BaseBackend, value, False, specialize, align)))
        except (TypeError, ValueError, RuntimeError):  # a type Triton keys on by itself
            key.append((name, "value", repr(value)))
    options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in sig.parameters))
    return fn.__name__, tuple(key), options


class _Tape(TorchDispatchMode):
    """Records torch ops and Triton launches while they run (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its value before)
        self._fresh: list[torch.Tensor] = []
        self._busy = 0  # inside a recorded launch: its own torch ops are part of it

    def _save(self, tensors: list[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._saved.append((t, t.detach().clone()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._busy:
            return func(*args, **kwargs)
        schema = func._schema
        values = {a.name: v for a, v in zip(schema.arguments, args, strict=False)}
        values.update(kwargs)
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        self._save(tree_flatten([values.get(n) for n in written])[0])
        self._busy += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self._busy -= 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        aliased = [r.alias_info is not None for r in schema.returns]  # views and in-place results
        fresh = [
            o if isinstance(o, torch.Tensor) and not (i < len(aliased) and aliased[i]) else None
            for i, o in enumerate(outs)
        ]
        self._fresh += [o for o in fresh if o is not None]
        self.entries.append(("op", func, args, kwargs, fresh))
        return out

    def launch(self, kernel: InterpretedFunction, args: tuple, grid: Any, kwargs: dict) -> Any:
        if self._busy:
            return _run(kernel, *args, grid=grid, warmup=False, **kwargs)
        self._busy += 1
        try:
            self._save([*args, *kwargs.values()])  # a kernel may write any tensor it gets
            self.entries.append(("kernel", kernel, args, grid, kwargs))
            return _run(kernel, *args, grid=grid, warmup=False, **kwargs)
        finally:
            self._busy -= 1

    def fresh_bytes(self) -> int:
        """The bytes of the tensors the recorded launches allocated (each storage once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._fresh}
        return sum(storages.values())

    def undo(self) -> None:
        """Restore what the recorded launches overwrote; fill what they allocated with NaN."""
        with torch.no_grad():
            for t, before in reversed(self._saved):  # the earliest saved value wins
                t.copy_(before)
            for t in self._fresh:
                if t.is_floating_point():
                    t.fill_(math.nan)
                elif t.dtype != torch.bool:
                    t.fill_(-7)
        self._saved.clear()

    def play(self) -> None:
        """Run the recorded launches again, on the recorded arguments."""
        self._busy += 1
        try:
            with torch.no_grad():
                for entry in self.entries:
                    if entry[0] == "kernel":
                        _, kernel, args, grid, kwargs = entry
                        _run(kernel, *args, grid=grid, warmup=False, **kwargs)
                        continue
                    _, func, args, kwargs, fresh = entry
                    out = func(*args, **kwargs)
                    outs = out if isinstance(out, (tuple, list)) else (out,)
                    for static, new in zip(fresh, outs, strict=True):
                        if static is not None:
                            static.copy_(new)
                        elif isinstance(new, torch.ScriptObject) and hasattr(new, "wait"):
                            new.wait()  # a collective's Work: its caller waited at capture
        finally:
            self._busy -= 1


class RecordingCapture:
    """A :class:`tkern.graphs.GraphCapture` for the CPU (see the module docstring).

    ``log`` lists what happened (``warmup``, ``capture``, ``replay``, ``time``);
    ``launches["warmup"]`` / ``launches["capture"]`` the Triton specializations
    launched in each. ``fail=True`` makes every capture raise before the step runs, as
    CUDA does for an operation a capture forbids at its start; ``fail="after"`` after
    the step's Python ran (its host-side bookkeeping with it) and its launches were
    undone, as CUDA's ``capture_end`` does for a capture an operation invalidated.

    ``time(fn)`` runs ``fn`` and says how long the host and the "device" took: a CPU
    has no device running behind the host, so both are the host's time, unless
    ``timing=(host_ms, synced_ms)`` gives the figures a GPU would (a step the host or
    the device bounds). ``reserved_bytes()``: the bytes every capture so far allocated
    (the tensors a graph's pool would hold)."""

    device_type = "cpu"

    def __init__(self, fail: bool | str = False, timing: tuple[float, float] | None = None) -> None:
        if fail not in (False, True, "after"):
            raise ValueError(f"fail must be False, True or 'after', got {fail!r}")
        self.fail = fail
        self.timing = timing
        self.log: list[str] = []
        self.launches: dict[str, list[tuple]] = {"warmup": [], "capture": []}
        self._pool_bytes = 0

    def reserved_bytes(self) -> int:
        return self._pool_bytes

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        self.log.append("time")
        start = time.perf_counter()
        out = fn()
        host = time.perf_counter() - start
        if self.timing is None:
            return out, host, host
        return out, self.timing[0] / 1e3, self.timing[1] / 1e3

    def blocker(self, device: torch.device | None) -> str | None:
        return None

    def collectives_blocker(self, groups: list) -> str | None:
        return None  # c10d's collectives are dispatcher ops: recorded and replayed like any other

    @contextlib.contextmanager
    def _watching(self, phase: str, tape: _Tape | None) -> Iterator[None]:
        seen = self.launches[phase]

        def run(kernel, *args, grid, warmup, **kwargs):
            if not warmup:
                seen.append(specialization(kernel, args, kwargs))
            if tape is not None and not warmup:
                return tape.launch(kernel, args, grid, kwargs)
            return _run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = _run

    def warmup(self, fn: Callable[[], Any]) -> Any:
        self.log.append("warmup")
        with self._watching("warmup", None):
            return fn()

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        if self.fail is True:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        self.log.append("capture")
        tape = _Tape()
        with self._watching("capture", tape), tape:
            out = fn()
        tape.undo()
        if self.fail == "after":
            raise RuntimeError("operation failed due to a previous error during capture")
        self._pool_bytes += tape.fresh_bytes()

        def replay() -> None:
            self.log.append("replay")
            tape.play()

        return replay, out

    def unseen_launches(self) -> list[tuple]:
        """The captured launches whose specialization no warm-up ran."""
        warm = set(self.launches["warmup"])
        return [key for key in self.launches["capture"] if key not in warm]
