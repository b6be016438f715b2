"""How the step ledger records a step without computing it: every aten op through a
``TorchDispatchMode`` that allocates its outputs from their meta shapes and records its
launch (:class:`NoCompute`), every tkern Triton launch intercepted and recorded
(:func:`recorded_launches`), or run inside a ``ledger:`` profiler range that carries its
category, FLOPs and bytes (:func:`profiled_launches`); each launch priced by
``ledger_costs``' rules.
"""

from __future__ import annotations

import bisect
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import (  # noqa: E402
    ModelSpec,
)
from harness import (  # noqa: E402
    kernel_names,
    patched_launches,
)
from ledger_costs import (  # noqa: E402
    _ALLOC,
    _GEMM_OPS,
    _METADATA,
    _OVERWRITE,
    GEMM_CATEGORIES,
    RANGE,
    _aten_category,
    _key,
    _mnk,
    _shapes,
    _tensor,
    aten_launch_bytes,
    attention_flops,
    triton_cost,
)

# --------------------------------------------------------------------------- launches


@dataclass
class Launch:
    """One kernel launch (an aten op or a Triton kernel)."""

    name: str
    category: str
    bytes: int
    flops: int
    dtype: torch.dtype
    shapes: str


class _Recorder:
    """The launches of the step and the phase each op runs in."""

    def __init__(self, spec: ModelSpec, allow_tf32: bool) -> None:
        self.spec, self.allow_tf32 = spec, allow_tf32
        self.launches: list[Launch] = []
        self.phase = "forward"  # forward, loss, optimizer
        self.loss_seq = math.inf  # autograd nodes from this sequence number on are the loss's
        self.syncs = 0
        self.on = False
        self.norms = 0  # norm modules running (forward)
        self.norm_nodes: list[tuple[int, int]] = []  # autograd sequence numbers the norm modules made

    def in_norm(self, seq: int) -> bool:
        i = bisect.bisect_right(self.norm_nodes, (seq, math.inf)) - 1
        return i >= 0 and self.norm_nodes[i][0] <= seq < self.norm_nodes[i][1]

    def backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def context(self) -> str:
        """The phase an op runs in: ``backward-loss`` for a backward node the loss made."""
        if self.backward():
            node = torch._C._current_autograd_node()
            # AccumulateGrad nodes (made when a param first joins a graph) are numbered last
            if node is None or node.name() == "torch::autograd::AccumulateGrad":
                return "backward"
            seq = node._sequence_nr()
            return "loss" if seq >= self.loss_seq else "backward norm" if self.in_norm(seq) else "backward"
        return "forward norm" if self.phase == "forward" and self.norms else self.phase

    def add(self, name, category, nbytes, flops, dtype, shapes) -> None:
        if self.on:
            self.launches.append(Launch(name, category, int(nbytes), int(flops), dtype, shapes))


#: a tensor whose storage is at most this many bytes is computed for real (scalars, statistics,
#: scales, flags): the values that decide anything (a skipped step, ``.item()``) are then real and
#: the same on every run; a larger output is allocated, never written, never read
SMALL_BYTES = 1 << 16
#: an integer or boolean tensor up to this many bytes is computed for real too: token ids,
#: position ids, cache positions and the packed-sequence check HF's masking runs on them
#: (``(batch, seq)`` int64: 128 KiB at 16 x 1024), so that no mask is built that a GPU would skip
SMALL_INT_BYTES = 1 << 21


def _small(m: torch.Tensor, nbytes: int | None = None) -> bool:
    """Whether ``m`` (its storage's ``nbytes``, else its elements) is one the ledger computes."""
    nbytes = m.numel() * m.element_size() if nbytes is None else nbytes
    return nbytes <= (SMALL_BYTES if m.dtype.is_floating_point or m.dtype.is_complex else SMALL_INT_BYTES)


def _allocate(m: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor like the meta tensor ``m`` on ``device``: zeros when small (deterministic
    values for the small ops computed from it), else uninitialised (no page touched)."""
    out = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
    return out.zero_() if _small(out, out.untyped_storage().nbytes()) else out


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class NoCompute(TorchDispatchMode):
    """Runs every aten op without computing it, and records its launch: outputs are
    allocated from the op's meta kernel's shapes, mutated arguments returned as they
    are, views and metadata changes run."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.is_view or name in _METADATA:
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        small = all(_small(t, t.untyped_storage().nbytes()) for t in tensors)
        if name == "_local_scalar_dense":  # .item(): real for a small tensor, else 0 (no value exists)
            self.rec.syncs += self.rec.on
            return func(*args, **kwargs) if small else (False if args[0].dtype == torch.bool else 0)
        schema = func._schema
        mutated = [
            (a.name, v)
            for a, v in zip(schema.arguments, _bound(schema, args, kwargs), strict=True)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        returns_alias = all(r.alias_info is not None for r in schema.returns)
        device = next(
            (t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
            kwargs.get("device") or torch.device("cpu"),
        )
        if tensors and small:  # scalars and small state: computed, so that their values are real
            out = func(*args, **kwargs)
        elif returns_alias:  # in place, out=, or nothing returned: the arguments are the outputs
            out = _aliased_returns(schema, args, kwargs)
        else:
            meta = func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
            if not tensors and all(
                _small(m) for m in pytree.tree_leaves(meta) if isinstance(m, torch.Tensor)
            ):
                out = func(*args, **kwargs)  # a small factory (arange: positions, cache positions): real
            else:
                out = pytree.tree_map_only(torch.Tensor, lambda m: _allocate(m, device), meta)
        if name in _ALLOC:
            return out
        self._record(func, name, args, kwargs, out, mutated)
        return out

    def _record(self, func, name, args, kwargs, out, mutated) -> None:
        rec = self.rec
        phase = rec.context()
        written = [t for _, v in mutated for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
        skip_read = {_key(t) for n, v in mutated if n == "out" or name in _OVERWRITE and n == "self"
                     for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)}  # fmt: skip
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        fresh = [] if all(r.alias_info is not None for r in func._schema.returns) else outs
        read = {_key(t): t for t in inputs if _key(t) not in skip_read}
        if name == "embedding":  # reads only the rows it gathers
            read = {_key(args[1]): args[1]}
        per_launch = aten_launch_bytes(name, args, read, {_key(t): t for t in fresh + written})
        flops, mnk = 0, None
        if name in _GEMM_OPS:
            mnk = _mnk(name, args)
        if "scaled_dot_product" in name or "attention_forward" in name or "attention_backward" in name:
            flops = attention_flops(name, args)
        elif func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        dtype = inputs[0].dtype if inputs else (outs[0].dtype if outs else torch.float32)
        category = _aten_category(name, outs + written, phase, rec, mnk)
        for i, nbytes in enumerate(per_launch):  # the FLOPs charged to the op's first launch
            rec.add(f"aten.{name}", category, nbytes, 0 if i else flops, dtype, _shapes(inputs))


def _bound(schema, args, kwargs) -> list:
    """The schema's arguments' values, positional and keyword (None where absent)."""
    values = list(args) + [None] * (len(schema.arguments) - len(args))
    for i, a in enumerate(schema.arguments):
        if a.name in kwargs:
            values[i] = kwargs[a.name]
    return values


def _aliased_returns(schema, args, kwargs):
    """The arguments an op that returns only aliases hands back (None, one, or a tuple)."""
    if not schema.returns:
        return None
    values = {a.name: v for a, v in zip(schema.arguments, _bound(schema, args, kwargs), strict=True)}
    by_set = {}
    for a in schema.arguments:
        if a.alias_info is not None:
            for s in a.alias_info.before_set:
                by_set[s] = values[a.name]
    outs = [by_set[next(iter(r.alias_info.before_set))] for r in schema.returns]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _jit_of(kernel):
    while not hasattr(kernel, "arg_names"):
        kernel = kernel.fn
    return kernel


def _patched_launches(launcher):
    """Inside, ``kernel[grid]`` of any tkern Triton kernel is ``launcher(kernel, grid,
    name, real)``, where ``name`` is ``module.name`` and ``real()`` gives the launch it
    replaces (``harness.patched_launches``)."""
    names = kernel_names()

    def getitem(kernel, grid, real):
        name = names.get(id(kernel), names.get(id(_jit_of(kernel)), type(kernel).__name__))
        return launcher(kernel, grid, name, lambda: real(kernel, grid))

    return patched_launches(getitem)


def _named_args(kernel, args: tuple, kwargs: dict) -> dict:
    """A launch's arguments by the kernel's parameter names (constexprs included)."""
    return dict(zip(_jit_of(kernel).arg_names, args, strict=False)) | kwargs


class _SplitK:
    """A split-K reduction's category is its GEMM's (the split-K launch just before it, whose
    partials it sums): the LM head's dgrad runs split-K and its reduction has no vocabulary
    dimension to be told by (:func:`triton_cost` alone would call it a block GEMM's)."""

    def __init__(self) -> None:
        self.gemm: str | None = None

    def category(self, name: str, named: dict, category: str, *rest) -> tuple:
        if name.startswith("gemm_split."):
            if "K" in named:
                self.gemm = category
            elif self.gemm is not None:
                category, self.gemm = self.gemm, None
        return (category, *rest)


def recorded_launches(rec: _Recorder):
    """Inside, ``kernel[grid](*args, **kwargs)`` of any tkern Triton kernel records the
    launch into ``rec`` and runs nothing."""

    split = _SplitK()

    def launcher(kernel, grid, name, real):
        def launch(*args, **kwargs):
            if not rec.on:
                return None
            named = _named_args(kernel, args, kwargs)
            cost = triton_cost(name, named, rec.spec, rec.backward())
            category, nbytes, flops, dtype = split.category(name, named, *cost)
            phase = rec.context()
            if phase == "optimizer" or (phase == "loss" and category not in GEMM_CATEGORIES):
                category = "optimizer" if phase == "optimizer" else "loss"
            rec.add(f"triton.{name}", category, nbytes, flops, dtype,
                    _shapes(_tensor(v) for v in named.values()))  # fmt: skip
            return None

        return launch

    return _patched_launches(launcher)


def profiled_launches(spec: ModelSpec):
    """Inside, every tkern Triton launch runs as usual inside a ``record_function``
    named ``ledger:<category>|<FLOPs>|<bytes>|<kernel>`` (the ledger's own rule,
    :func:`triton_cost`), so that a profile puts its kernel in the ledger's category
    (a GEMM by its role) and knows its FLOPs and bytes."""

    split = _SplitK()

    def launcher(kernel, grid, name, real):
        def launch(*args, **kwargs):
            backward = torch._C._current_graph_task_id() != -1
            named = _named_args(kernel, args, kwargs)
            cost = triton_cost(name, named, spec, backward)
            category, nbytes, flops, _ = split.category(name, named, *cost)
            with torch.profiler.record_function(f"{RANGE}{category}|{flops}|{nbytes}|{name}"):
                return real()(*args, **kwargs)

        return launch

    return _patched_launches(launcher)
