"""A ledger of one training step, counted on a CPU: every kernel launched, the bytes
it reads and writes, its FLOPs, grouped by category, and the roofline time of each
category at a GPU's spec (issue 42 item 1).

    python benchmarks/step_ledger.py --model gpt2-small --recipe tkern --device h200 --json ledger.json
    python benchmarks/step_ledger.py --model gpt2-small --recipe tkern --compare old.json

This is how a change is judged before a GPU sees it: fewer bytes, fewer launches,
the same FLOPs. The step is ``bench_train``'s (the recipe built by
``bench_train.RECIPES``, one ``tkern.Trainer.train_step``: zero the gradients,
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
  most :data:`SMALL_BYTES`) is computed, so that what decides anything (a skipped
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
bandwidth), summed per category (``harness.DEVICES`` gives the numbers and where
they come from). The JSON also holds the analytic FLOPs (:func:`model_flops`,
``6 x linear params x tokens + 12 x layers x tokens x seq x width``) that the
ledger's FLOPs agree with within 3% (a test says so).

What it does not see: the GPU's own choices (a CPU runs torch's CPU kernels:
autocast's CPU op lists, SDPA's CPU flash kernel and its dispatch, one launch for
a multi-tensor op), cache reuse inside a kernel (the bytes are compulsory
traffic), launch latency, and compiled recipes (torch.compile's fusion is not
modeled: those recipes are refused; their time is the profile's,
``bench_train.py --profile``).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402
from harness import (  # noqa: E402
    DEVICES,
    RESULTS,
    DeviceSpec,
    commit,
    kernel_names,
    model_flops,
    patched_launches,
    slug,
)

CATEGORIES = (
    "gemm fwd", "gemm dgrad", "gemm wgrad", "gemm lm head", "attention", "norm", "embedding",
    "loss", "fp8 cast/amax", "optimizer", "copies and fills", "elementwise", "other"
)  # fmt: skip
GEMM_CATEGORIES = CATEGORIES[:4]


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A language model of the ledger: its family (``gpt2``/``llama``), its config,
    sequence length and batch."""

    family: str
    config: dict
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]

    @property
    def layers(self) -> int:
        return self.config.get("n_layer", self.config.get("num_hidden_layers"))

    @property
    def width(self) -> int:
        return self.config.get("n_embd", self.config.get("hidden_size"))

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return (bench_train.GPT2LM if self.family == "gpt2" else bench_train.LlamaLM)(self.config)


_GPT2_TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 64}
_GPT2_TINY.update(bos_token_id=0, eos_token_id=0)
#: gpt2-small is bench_train's case; llama-like is issue 42's (12 layers, width 1024, SwiGLU
#: 2816 = 8/3 x 1024 rounded up to 256, RMSNorm, 16 heads, Llama's 32000-token vocabulary), its
#: batch of 8 x 2048 the same 16384 tokens as GPT-2's. The tiny ones are the tests': every
#: dimension distinct from the token count (96), which tells a wgrad by its reduction.
MODELS = {
    "gpt2-small": ModelSpec("gpt2", bench_train.GPT2_SMALL, bench_train.SEQ, 16),
    "llama-like": ModelSpec("llama", bench_train.LLAMA_LIKE, bench_train.LLAMA_SEQ, bench_train.LLAMA_BATCH),
    "gpt2-tiny": ModelSpec("gpt2", _GPT2_TINY, 48, 2),
    "llama-tiny": ModelSpec("llama", {**bench_train.LLAMA_SMOKE, "vocab_size": 1000}, 48, 2),
}


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


def footprint(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading or writing all of ``t`` once: a broadcast
    (stride 0) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _shapes(tensors) -> str:
    return " ".join(
        f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


# aten ops that launch nothing: allocations and views run as they are
_ALLOC = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "resize_",
          "_record_function_enter_new", "_record_function_exit", "record_stream"}  # fmt: skip
_METADATA = {"set_", "_unsafe_view", "as_strided_", "detach_", "_reshape_alias", "alias", "_nested_tensor"}
_OVERWRITE = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addmv", "mv", "dot"}
_NORM_OPS = (
    "layer_norm", "rms_norm", "batch_norm", "group_norm"
)  # fmt: skip
_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy", "_softmax_backward", "mse_loss")
_COPY_OPS = {
    "copy_", "_to_copy", "clone", "contiguous", "cat", "stack", "fill_", "zero_", "zeros", "ones",
    "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "fill",
    "slice_scatter", "select_scatter", "as_strided_scatter", "_foreach_copy_", "_foreach_zero_",
    "scalar_tensor", "arange"
}  # fmt: skip


def gemm_role(m: int, n: int, k: int, spec: ModelSpec, backward: bool) -> str:
    """``gemm lm head`` when a dimension is the vocabulary (or a padded copy of it),
    ``gemm wgrad`` when the reduction runs over the step's tokens, else ``gemm dgrad``
    in backward and ``gemm fwd`` in forward."""
    if any(spec.vocab <= d < spec.vocab + 128 for d in (m, n, k)):
        return "gemm lm head"
    if k == spec.tokens:
        return "gemm wgrad"
    return "gemm dgrad" if backward else "gemm fwd"


def _mnk(name: str, args: tuple) -> tuple[int, int, int]:
    """(M, N, K) of an aten matrix product."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addmv") else (args[0], args[1])
    if name in ("mv", "addmv", "dot"):
        return a.shape[0], 1, a.shape[-1]
    return a.shape[-2], b.shape[-1], a.shape[-1]


def attention_flops(name: str, args: tuple) -> int:
    """Model FLOPs of an SDPA call: QK^T and AV, 2 per multiply-add (4*B*H*Sq*Sk*D
    for D = Dv), twice that for the backward (dQ, dK, dV, dP; flash's recompute of
    P not counted), no causal discount."""
    if "backward" in name:
        q, k, v = args[1], args[2], args[3]
        mult = 2
    else:
        q, k, v = args[0], args[1], args[2]
        mult = 1
    b_h = math.prod(q.shape[:-2])
    return mult * 2 * b_h * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


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


def _aten_category(name: str, outs: list[torch.Tensor], phase: str, rec: _Recorder, mnk) -> str:
    if name in _GEMM_OPS:
        return gemm_role(*mnk, rec.spec, phase.startswith("backward"))
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if phase == "optimizer":
        return "optimizer"
    if any(t.dtype.is_floating_point and t.dtype.itemsize == 1 for t in outs) or name in ("amax", "abs_max"):
        return "fp8 cast/amax"
    if phase == "loss" or name.startswith(_LOSS_OPS):
        return "loss"
    if phase.endswith("norm") or any(n in name for n in _NORM_OPS):
        return "norm"
    if name.startswith("embedding"):
        return "embedding"
    if name in _COPY_OPS:
        return "copies and fills"
    return "elementwise"


#: a tensor whose storage is at most this many bytes is computed for real (scalars, statistics,
#: scales, flags): the values that decide anything (a skipped step, ``.item()``) are then real and
#: the same on every run; a larger output is allocated, never written, never read
SMALL_BYTES = 1 << 16


def _allocate(m: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor like the meta tensor ``m`` on ``device``: zeros when small (deterministic
    values for the small ops computed from it), else uninitialised (no page touched)."""
    out = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
    return out.zero_() if out.untyped_storage().nbytes() <= SMALL_BYTES else out


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
        small = all(t.untyped_storage().nbytes() <= SMALL_BYTES for t in tensors)
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
        nbytes = sum(footprint(t) for t in read.values())
        nbytes += sum(footprint(t) for t in {_key(t): t for t in fresh + written}.values())
        flops, mnk = 0, None
        if name in _GEMM_OPS:
            mnk = _mnk(name, args)
        if "scaled_dot_product" in name or "attention_forward" in name or "attention_backward" in name:
            flops = attention_flops(name, args)
        elif func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        dtype = inputs[0].dtype if inputs else (outs[0].dtype if outs else torch.float32)
        rec.add(f"aten.{name}", _aten_category(name, outs + written, phase, rec, mnk), nbytes, flops, dtype,
                _shapes(inputs))  # fmt: skip


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


# --------------------------------------------------------------------------- Triton launches

#: kernel module -> category (GEMM kernels get their role from their dimensions)
_TRITON_CATEGORY = {
    "activation": "elementwise",
    "swiglu": "elementwise",  # silu(gate) * up and its gradient (gate and up from one GEMM)
    "norm": "norm",
    "cross_entropy": "loss",
    "float8": "fp8 cast/amax",
    "adam": "optimizer",
    "sgd": "optimizer",
    "overflow": "optimizer",
    "scale": "optimizer",
    "_update": "optimizer",
}
#: arguments an optimizer kernel reads and writes (each counted twice)
_READ_WRITE = {
    "master_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "max_exp_avg_sq_ptr", "momentum_ptr",
    "exp_avg_absmax_ptr", "exp_avg_sq_absmax_ptr", "max_exp_avg_sq_absmax_ptr",
    "momentum_absmax_ptr"
}  # fmt: skip


def _jit_of(kernel):
    while not hasattr(kernel, "arg_names"):
        kernel = kernel.fn
    return kernel


def _tensor(x) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    base = getattr(x, "base", None)  # a TMA tensor descriptor
    return base if isinstance(base, torch.Tensor) else None


def triton_cost(name: str, named: dict, spec: ModelSpec, backward: bool) -> tuple[str, int, int, torch.dtype]:
    """(category, bytes, FLOPs, the dtype that sets its peak) of one Triton launch,
    ``named`` its arguments by the kernel's parameter names (constexprs included)."""
    module = name.split(".")[0]
    if module == "gemm_split":  # split-K: partial products into a workspace, then their reduction
        nbytes = _streamed_bytes(named)[0]
        if "K" not in named:  # the reduction: split-K serves the GEMMs with few output tiles, the wgrads
            return ("gemm wgrad" if backward else "gemm fwd"), nbytes, 0, torch.float32
        m, n, k = int(named["M"]), int(named["N"]), int(named["K"])
        return gemm_role(m, n, k, spec, backward), nbytes, 2 * m * n * k, _tensor(named["a_ptr"]).dtype
    if module.startswith("gemm"):
        m, n, k = int(named["M"]), int(named["N"]), int(named["K"])
        a = _tensor(named.get("a_ptr", named.get("a_desc")))
        b = _tensor(named.get("b_ptr", named.get("b_desc")))
        c = named["c_ptr"]
        nbytes = (m * k * a.element_size() + k * n * b.element_size()
                  + m * n * c.element_size() * (2 if "accumulate" in name else 1))  # fmt: skip
        if named.get("HAS_BIAS"):
            nbytes += n * named["bias_ptr"].element_size()
        if named.get("STORE_PREACT"):
            nbytes += m * n * named["preact_ptr"].element_size()
        if named.get("A_ACT"):
            nbytes += m * k * named["z_ptr"].element_size()
        if named.get("STORE_A"):
            nbytes += m * k * named["a_out_ptr"].element_size()
        if named.get("SUM_A"):
            nbytes += m * named["a_sum_ptr"].element_size()
        if named.get("DELAYED") and "data_ptr" in named:  # the emitting epilogue's fp8 C (and C^T)
            nbytes += m * n * named["data_ptr"].element_size() * (2 if named.get("STORE_T") else 1)
        return gemm_role(m, n, k, spec, backward), nbytes, 2 * m * n * k, a.dtype
    nbytes, dtype = _streamed_bytes(named)
    return _TRITON_CATEGORY.get(module, "other"), nbytes, 0, dtype


def _streamed_bytes(named: dict) -> tuple[int, torch.dtype]:
    """(bytes, the data's dtype) of a streaming kernel: each tensor argument touched once
    (over ``n`` elements where the kernel has an ``n``), the read-and-written ones twice."""
    count = named.get("n")
    seen: dict[tuple, int] = {}
    dtype = torch.float32
    for arg, value in named.items():
        t = _tensor(value)
        if t is None or _key(t) in seen:
            continue
        size = footprint(t)
        if isinstance(count, int) and t.numel() >= count:  # a streaming range of n elements
            size = count * t.element_size()
        seen[_key(t)] = size * (2 if arg in _READ_WRITE else 1)
        if arg in ("x_ptr", "grad_ptr", "logits_ptr", "dy_ptr"):
            dtype = t.dtype
    return sum(seen.values()), dtype


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


def recorded_launches(rec: _Recorder):
    """Inside, ``kernel[grid](*args, **kwargs)`` of any tkern Triton kernel records the
    launch into ``rec`` and runs nothing."""

    def launcher(kernel, grid, name, real):
        def launch(*args, **kwargs):
            if not rec.on:
                return None
            named = _named_args(kernel, args, kwargs)
            category, nbytes, flops, dtype = triton_cost(name, named, rec.spec, rec.backward())
            phase = rec.context()
            if phase == "optimizer" or (phase == "loss" and category not in GEMM_CATEGORIES):
                category = "optimizer" if phase == "optimizer" else "loss"
            rec.add(f"triton.{name}", category, nbytes, flops, dtype,
                    _shapes(_tensor(v) for v in named.values()))  # fmt: skip
            return None

        return launch

    return _patched_launches(launcher)


# --------------------------------------------------------------------------- the profile's categories

#: record_function names that carry a category into a profile: ``ledger:<category>`` around
#: every tkern Triton launch (:func:`profiled_launches`, with its FLOPs and bytes) and around the
#: optimizer's and the loss's phases (bench_train --profile)
RANGE = "ledger:"
_GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|matmul|wgmma|s16816|s1688|_mm_|sm90_|sm80_", re.I)
_KERNEL_RULES = (  # (category, substrings of the kernel's, its op's or an ancestor's name), in order
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("fp8 cast/amax", ("float8", "fp8", "amax")),
    ("loss", ("nll_loss", "log_softmax", "logsoftmax", "cross_entropy", "crossentropy")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "norm_fwd", "norm_bwd")),
    ("embedding", ("embedding", "index_select", "indexselect")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill", "zero", "catarray", "cat_")),
)


def kernel_category(
    kernel: str, ancestors: list[str], shapes: list | None, spec: ModelSpec | None
) -> tuple[str, int, int | None]:
    """(category, FLOPs, bytes or None) of one GPU kernel of a profile, in the ledger's
    categories. ``ancestors``: the names of the CPU ranges around its launch, innermost
    first (aten ops, autograd's ``evaluate_function: XBackward0``, ``ledger:`` ranges);
    ``shapes``: the input shapes of the innermost aten op, where recorded. As in the
    ledger, the optimizer's phase (a ``ledger:optimizer`` range) takes everything in it
    and the loss's phase (``ledger:loss``) everything but GEMMs; a tkern launch carries its
    category, FLOPs and bytes in its own range (:func:`profiled_launches`); another GEMM
    kernel (by its name or its op's) takes its role from its op's shapes
    (:func:`gemm_role`); the rest go by substrings of its own, its op's and its ranges'
    names (:data:`_KERNEL_RULES`), elementwise otherwise."""
    ranges = [a[len(RANGE) :].split("|") for a in ancestors if a.startswith(RANGE)]
    phases = {r[0] for r in ranges if len(r) == 1}
    launch = next((r for r in ranges if len(r) > 1), None)
    if launch is not None:
        category, flops, nbytes = launch[0], int(launch[1]), int(launch[2])
    else:
        category, flops, nbytes = _aten_kernel(kernel, ancestors, shapes, spec), 0, None
        if category in GEMM_CATEGORIES:
            op = next((a for a in ancestors if a.startswith("aten::")), "")
            mnk = _shape_mnk(op.split("::")[-1], shapes or [])
            flops = 2 * math.prod(mnk) if mnk is not None else 0
    if "optimizer" in phases:
        return "optimizer", flops, nbytes
    if "loss" in phases and category not in GEMM_CATEGORIES:
        return "loss", flops, nbytes
    return category, flops, nbytes


def _aten_kernel(kernel: str, ancestors: list[str], shapes: list | None, spec: ModelSpec | None) -> str:
    """The category of a kernel torch launched (not tkern)."""
    op = next((a for a in ancestors if a.startswith("aten::")), "").split("::")[-1]
    backward = any("evaluate_function" in a or "Backward" in a for a in ancestors)
    if _GEMM_KERNEL.search(kernel) or op in _GEMM_OPS:
        mnk = _shape_mnk(op, shapes or [])
        if mnk is not None and spec is not None:
            return gemm_role(*mnk, spec, backward)
        return "gemm dgrad" if backward else "gemm fwd"
    text = " ".join([kernel, *ancestors]).lower()
    return next((c for c, words in _KERNEL_RULES if any(w in text for w in words)), "elementwise")


def _shape_mnk(op: str, shapes: list) -> tuple[int, int, int] | None:
    """(M, N, K) of a matrix product from its op's recorded input shapes."""
    dims = [s for s in shapes if isinstance(s, (list, tuple)) and len(s) >= 2]
    if op not in _GEMM_OPS or len(dims) < 2:
        return None
    a, b = dims[0], dims[1]
    return a[-2], b[-1], a[-1]


def profiled_launches(spec: ModelSpec):
    """Inside, every tkern Triton launch runs as usual inside a ``record_function``
    named ``ledger:<category>|<FLOPs>|<bytes>|<kernel>`` (the ledger's own rule,
    :func:`triton_cost`), so that a profile puts its kernel in the ledger's category
    (a GEMM by its role) and knows its FLOPs and bytes."""

    def launcher(kernel, grid, name, real):
        def launch(*args, **kwargs):
            backward = torch._C._current_graph_task_id() != -1
            category, nbytes, flops, _ = triton_cost(name, _named_args(kernel, args, kwargs), spec, backward)
            with torch.profiler.record_function(f"{RANGE}{category}|{flops}|{nbytes}|{name}"):
                return real()(*args, **kwargs)

        return launch

    return _patched_launches(launcher)


# --------------------------------------------------------------------------- the step


def ledger_recipes() -> list[str]:
    """bench_train's recipes the ledger can count: every eager one."""
    return [r for r in bench_train.RECIPES if "compiled" not in r]


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
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {device!r}")
    spec = MODELS[model]
    cpu = torch.device("cpu")
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(0))
    rec = _Recorder(spec, allow_tf32=False)
    with recorded_launches(rec), NoCompute(rec):  # built without initialising anything: nothing is read
        base = spec.build()
        built = bench_train.RECIPES[recipe](base, cpu, True)
    analytic = model_flops(base, spec.tokens, spec.seq)
    del base
    built = _fused_torch_adamw(built)
    rec.allow_tf32 = built.tf32
    model_obj = built.model

    def loss_fn(out, y):
        return bench_train.lm_loss(out, y)

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

    model_obj.register_forward_pre_hook(forward_pre)
    model_obj.register_forward_hook(forward_post)
    for m in model_obj.modules():
        if "Norm" in type(m).__name__:  # nn.LayerNorm, HF's LlamaRMSNorm, tkern's norm modules
            m.register_forward_pre_hook(norm_pre)
            m.register_forward_hook(norm_post)
    trainer = bench_train.trainer_for(built, loss_fn)
    optimizer_phase(built.optimizer, built.scaler, lambda: _optimizer_phase(rec))
    with recorded_launches(rec), NoCompute(rec), bench_train.tf32(built.tf32):
        trainer.train_step([(ids, ids)])  # the optimizer's state is made here: not counted
        rec.on = True
        rec.phase = "forward"
        trainer.train_step([(ids, ids)])
        rec.on = False
    return Ledger(model, recipe, DEVICES[device], spec, rec.launches, analytic, rec.syncs, built.tf32)


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


def _fused_torch_adamw(built: bench_train.Built) -> bench_train.Built:
    """torch's recipes take AdamW(fused=True) on a GPU (bench_train) and the foreach one
    on a CPU: the ledger counts the GPU's."""
    opt = built.optimizer
    if type(opt) is torch.optim.AdamW and not opt.defaults.get("fused"):
        opt = torch.optim.AdamW(built.model.parameters(), lr=bench_train.LR, fused=True)
        return bench_train.Built(built.model, opt, built.scaler, built.autocast, built.cuda_graph, built.tf32)
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
    parser.add_argument("--device", default="h200", choices=sorted(DEVICES))
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
