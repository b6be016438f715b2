"""The norm family: ``tkern.layer_norm``, ``tkern.rms_norm`` and their fused residual
forms ``tkern.add_layer_norm`` / ``tkern.add_rms_norm`` and
``tkern.layer_norm_and_residual`` / ``tkern.rms_norm_and_residual``, with autograd and
torch.library custom ops.

Statistics and normalization run in fp32 on the 16-bit input (kernels/norm.py);
the output is in the input's dtype. Backward saves the input (for the residual
forms, the 16-bit sum ``x + residual`` they return) and the fp32 mean / rstd per
row: never an fp32 copy of the input, which is what torch's norm on an upcast
input (``convert_network``'s old rule, autocast) saves.

Two doors lead to the same kernels, as for ``tkern.linear``:

* eager calls go through :class:`_Norm`, a plain ``torch.autograd.Function``;
* ``torch.compile`` tracing, meta tensors and tensor subclasses go through the
  custom ops ``tkern::norm_forward`` and ``tkern::norm_backward`` (each with a
  fake implementation; the forward's backward is registered in terms of the
  backward op). The ``*_and_residual`` forms return ``(norm(x), x)`` there, and
  autograd sums x's two gradients (a custom op cannot return an alias of its input).

Second-order gradients (``create_graph=True``): the eager door recomputes the
norm with torch operations in fp32 from the saved tensors and differentiates
that, so autograd can differentiate the gradients again. The traced door's
backward op has no derivative of its own (torch raises on a second backward
through it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from tkern.kernels._common import INTERPRET
from tkern.kernels.float8 import native_e4m3
from tkern.kernels.norm import (
    INPUT_DTYPES,
    norm_backward,
    norm_backward_prechecked,
    norm_forward,
    norm_forward_float8,
)
from tkern.ops import common
from tkern.ops.common import is_compiling
from tkern.ops.float8 import Float8Input

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "can_emit_float8",
    "layer_norm",
    "layer_norm_and_residual",
    "norm_float8",
    "rms_norm",
    "rms_norm_and_residual",
    "rms_norm_eps",
]

Tensor = torch.Tensor
#: (d input, dweight, dbias), None where not needed
Grads = tuple[Tensor | None, Tensor | None, Tensor | None]


def rms_norm_eps(eps: float | None) -> float:
    """The eps :func:`rms_norm` uses: ``eps``, or for None the machine epsilon of
    fp32, the type torch's ``F.rms_norm`` computes in for fp16, bf16 and fp32
    input alike (checked by the tests against ``F.rms_norm``)."""
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


# --------------------------------------------------------------------------- gradients


def _differentiable_grads(
    dy: Tensor,
    dh: Tensor | None,
    saved: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    needs: tuple[bool, bool, bool],
) -> Grads:
    """(d saved, dweight, dbias) as torch operations in fp32, differentiable again
    (``create_graph=True``); ``saved`` is the (M, N) input, or h, in autograd's graph."""
    n = saved.shape[-1]
    with torch.enable_grad():
        w = None if weight is None else weight.reshape(n).float()
        if rms:
            y = F.rms_norm(saved.float(), (n,), w, eps)
        else:
            y = F.layer_norm(saved.float(), (n,), w, None if bias is None else bias.reshape(n).float(), eps)
        asked = [need and t is not None for t, need in zip((saved, weight, bias), needs, strict=True)]
        wanted = [t for t, ask in zip((saved, weight, bias), asked, strict=True) if ask]
        grads = iter(torch.autograd.grad(y, wanted, dy.float(), create_graph=True, allow_unused=True))
    dx, dw, db = (next(grads) if ask else None for ask in asked)
    if dx is not None:
        dx = dx if dh is None else dx + dh.float()
        dx = dx.to(saved.dtype)
    return dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype)


def _norm_grads(
    dy: Tensor | None,
    dh: Tensor | None,
    saved: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    rms: bool,
    needs: tuple[bool, bool, bool],
    bias_dtype: torch.dtype | None,
    backward: Callable[..., Grads] | None = None,
    into: tuple = (None, None),
) -> Grads:
    """(d saved, dweight, dbias) from the kernels (None where not needed). ``dy``
    or ``dh`` may be None (an output not used in the loss); ``needs``: whether the
    input, weight and bias need gradients; ``weight`` is 1-D. ``backward``: the custom
    op's :func:`_traced_backward`, or None: the kernels' launcher, on the tensors forward
    checked and saved (``norm_backward_prechecked``: nothing checked again), which puts
    dweight / dbias into ``into``'s ``(out, accumulate)`` where given (:func:`_eager_grads`)."""
    need_x, need_w, need_b = needs
    if dy is None:  # y unused: its gradient is zero
        dx = dh if need_x else None
        if dx is None and need_x:
            dx = torch.zeros_like(saved)
        zero = saved.new_zeros(saved.shape[-1], dtype=torch.float32)
        return dx, zero.to(weight.dtype) if need_w else None, zero.to(bias_dtype) if need_b else None
    bias_dtype = bias_dtype if need_b else None
    if backward is None:
        return norm_backward_prechecked(dy, saved, weight, mean, rstd, rms, need_w, bias_dtype, dh, *into)
    return backward(dy, saved, weight, mean, rstd, rms, need_weight=need_w, bias_dtype=bias_dtype, dh=dh)


def _needs(ctx) -> tuple[bool, bool, bool]:
    """Whether d saved (x's, or the residual's: both are h's), dweight and dbias are
    needed, from a backward's ``ctx`` of inputs (x, residual, weight, bias, eps, rms)."""
    need = ctx.needs_input_grad
    return need[0] or need[1], need[2], need[3]


def _input_grads(ctx, dx: Tensor | None, dw: Tensor | None, db: Tensor | None) -> tuple:
    """A backward's return for inputs (x, residual, weight, bias, eps, rms): ``dx`` is
    also the residual's gradient (h = x + residual), each given where it is needed."""
    dres = dx if ctx.has_residual and ctx.needs_input_grad[1] else None
    return dx if ctx.needs_input_grad[0] else None, dres, dw, db, None, None


def _keep(ctx, saved: Tensor, inputs: tuple, mean: Tensor | None, rstd: Tensor) -> None:
    """What both eager forwards keep for :meth:`_Norm.backward` from their ``inputs`` (x,
    residual, weight, bias, eps, rms), ``saved`` (x, or h) and the statistics."""
    x, residual, weight, bias, eps, rms = inputs
    ctx.set_materialize_grads(False)
    ctx.eps, ctx.rms, ctx.has_residual = eps, rms, residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.slots = common.next_function_slots(x, residual, weight, bias)  # weight's, bias's in next_functions
    # bias: a reference, for its dtype, shape and the create_graph=True path
    ctx.save_for_backward(saved, weight, bias, mean, rstd)


def _eager_grads(ctx, dy, dh, saved, weight, bias, mean, rstd, needs) -> Grads:
    """:meth:`_Norm.backward`'s gradients from the kernels, dweight and dbias each written or
    added into its fused optimizer's flat gradient view where :func:`common.flat_wgrad`
    allows (then handed to autograd over that memory, :func:`common.hand_over`), else new
    tensors of its shape (and for an unused y, zeros as usual)."""
    tw = common.flat_wgrad(ctx, weight.dtype, weight, ctx.slots[2]) if needs[1] and dy is not None else None
    tb = common.flat_wgrad(ctx, bias.dtype, bias, ctx.slots[3]) if needs[2] and dy is not None else None
    into = tuple(None if t is None else (t[1].view(-1), t[2]) for t in (tw, tb))  # (view, accumulate)
    w = None if weight is None else weight.reshape(-1)
    dx, dw, db = _norm_grads(dy, dh, saved, w, mean, rstd, ctx.rms, needs, ctx.bias_dtype, None, into)
    dw = common.hand_over(tw) if tw is not None else None if dw is None else dw.reshape(weight.shape)
    db = common.hand_over(tb) if tb is not None else None if db is None else db.reshape(bias.shape)
    return dx, dw, db


class _Norm(torch.autograd.Function):
    """y = norm(x) (and, with a residual, h = x + residual) on (M, N) tensors.

    Outputs keep their 2-D shape here; the public functions give them the input's
    shape outside the Function (a view made inside one cannot be written in place)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        w = None if weight is None else weight.reshape(-1)
        b = None if bias is None else bias.reshape(-1)
        y, h, mean, rstd = norm_forward(x, w, b, eps, rms, residual)
        _keep(ctx, x if h is None else h, (x, residual, weight, bias, eps, rms), mean, rstd)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh=None):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        needs = _needs(ctx)
        if not torch.is_grad_enabled():
            return _input_grads(ctx, *_eager_grads(ctx, dy, dh, saved, weight, bias, mean, rstd, needs))
        dy = torch.zeros_like(saved) if dy is None else dy  # create_graph=True: differentiable again
        return _input_grads(ctx, *_differentiable_grads(dy, dh, saved, weight, bias, ctx.eps, ctx.rms, needs))


class _NormAndResidual(torch.autograd.Function):
    """``(y, x)`` with y = norm(x) on (M, N) ``x``: x itself passed on, which autograd
    returns as a view of x (no copy). Inputs and backward are :class:`_Norm`'s (residual
    None), with the passed x's gradient as ``dh``: the backward kernel adds it into dx,
    where autograd would sum x's two gradients with a torch add."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        return _Norm.forward(ctx, x, None, weight, bias, eps, rms), x

    @staticmethod
    def backward(ctx, dy, dx_passed):
        return _Norm.backward(ctx, dy, dx_passed)


class _NormFloat8(torch.autograd.Function):
    """y = norm(x) on (M, N) tensors, with y's e4m3 cast (the device's) for the next GEMM as three more
    outputs (data, data_t, scale; not differentiable). Backward is :class:`_Norm`'s (inputs as there)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, store_t, history, margin, update, counter, rolls):
        w = None if weight is None else weight.reshape(-1)
        b = None if bias is None else bias.reshape(-1)
        out = norm_forward_float8(
            x, w, b, eps, rms, native_e4m3(x.device), store_t=store_t, history=history, margin=margin,
            update=update, counter=counter, rolls=rolls,
        )  # fmt: skip
        _keep(ctx, x, (x, residual, weight, bias, eps, rms), out.mean, out.rstd)
        data_t = out.data_t if out.data_t is not None else out.data.new_empty(0)
        ctx.mark_non_differentiable(out.data, data_t, out.scale)
        return out.y, out.data, data_t, out.scale

    @staticmethod
    def backward(ctx, dy, *_fp8):
        return (*_Norm.backward(ctx, dy), *(None,) * 6)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("tkern::norm_forward", mutates_args=())
def _norm_forward_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.norm.norm_forward` on (M, N) ``x``: ``(y, h, mean, rstd)``,
    with ``h`` (no residual) and ``mean`` (RMSNorm) empty tensors when absent."""
    y, h, mean, rstd = norm_forward(x, weight, bias, eps, rms, residual)
    empty = rstd.new_empty(0)
    return y, x.new_empty(0) if h is None else h, empty if mean is None else mean, rstd


@_norm_forward_op.register_fake
def _(x, residual, weight, bias, eps, rms):
    m = x.shape[0]
    stat = x.new_empty(m, dtype=torch.float32)
    return (
        x.new_empty(x.shape),
        x.new_empty(0 if residual is None else x.shape),
        x.new_empty(0 if rms else m, dtype=torch.float32),
        stat,
    )


@torch.library.custom_op("tkern::norm_backward", mutates_args=())
def _norm_backward_op(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    rms: bool,
    need_weight: bool,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.norm.norm_backward`: ``(dx, dweight, dbias)``, the last
    two empty tensors where not asked for."""
    dx, dw, db = norm_backward(
        dy, saved, weight, mean, rstd, rms, need_weight=need_weight, bias_dtype=bias_dtype, dh=dh
    )
    empty = rstd.new_empty(0)
    return dx, empty if dw is None else dw, empty if db is None else db


@_norm_backward_op.register_fake
def _(dy, dh, saved, weight, mean, rstd, rms, need_weight, bias_dtype):
    n = saved.shape[1]
    dw = weight.new_empty(n) if need_weight else rstd.new_empty(0)
    db = rstd.new_empty(n, dtype=bias_dtype) if bias_dtype is not None else rstd.new_empty(0)
    return saved.new_empty(saved.shape), dw, db


def _traced_backward(
    dy: Tensor,
    saved: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    rms: bool,
    *,
    need_weight: bool,
    bias_dtype: torch.dtype | None,
    dh: Tensor | None,
) -> Grads:
    """:func:`norm_backward` through the custom op (which gives empty tensors for None)."""
    dx, dw, db = _norm_backward_op(dy, dh, saved, weight, mean, rstd, rms, need_weight, bias_dtype)
    return dx, dw if need_weight else None, db if bias_dtype is not None else None


def _norm_setup_context(ctx, inputs: tuple, output: tuple) -> None:
    x, residual, weight, bias, eps, rms = inputs
    y, h, mean, rstd = output
    ctx.rms, ctx.has_residual = rms, residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x if residual is None else h, weight, None if rms else mean, rstd)


def _norm_forward_backward(ctx, dy: Tensor | None, dh: Tensor | None, _dmean, _drstd) -> tuple:
    saved, weight, mean, rstd = ctx.saved_tensors
    dh = dh if ctx.has_residual else None
    dx, dw, db = _norm_grads(
        dy, dh, saved, weight, mean, rstd, ctx.rms, _needs(ctx), ctx.bias_dtype, _traced_backward
    )
    return _input_grads(ctx, dx, dw, db)


_norm_forward_op.register_autograd(_norm_forward_backward, setup_context=_norm_setup_context)


# --------------------------------------------------------------------------- public


def _check_norm_args(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> int:
    """Every check the public functions make, raising ``TypeError`` / ``ValueError``
    that names the argument; returns N, the product of ``normalized_shape``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"input must be a float16, bfloat16 or float32 tensor, got dtype {x.dtype}")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(not isinstance(s, int) for s in shape):
        raise ValueError(
            f"normalized_shape must be an int or a non-empty sequence of ints, got {normalized_shape!r}"
        )
    if tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"normalized_shape {shape} must match the trailing dimensions of input, "
            f"got input shape {tuple(x.shape)}"
        )
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
                f"got shape {tuple(residual.shape)}, dtype {residual.dtype}"
            )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
        if p.dtype not in (torch.float32, x.dtype):
            raise TypeError(f"{name} must be float32 or input's dtype {x.dtype}, got {p.dtype}")
    named = [(n, t) for n, t in (("residual", residual), ("weight", weight), ("bias", bias)) if t is not None]
    for name, t in named:
        if t.device != x.device:
            raise ValueError(
                f"{name} is on {t.device} but input is on {x.device}; all tensors must be on one device"
            )
    return math.prod(shape)


def can_emit_float8(x: torch.Tensor) -> bool:
    """Whether :func:`norm_float8` runs on ``x`` (eager only: a plain tensor on a device
    tkern's kernels run on, not while torch.compile traces)."""
    return _eager(x)


def _eager(x: torch.Tensor) -> bool:
    """Whether the eager Function applies (else the custom op: tracing, meta, subclasses)."""
    return type(x) is torch.Tensor and not x.is_meta and not is_compiling() and (INTERPRET or x.is_cuda)


def _norm(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    n = _check_norm_args(x, residual, normalized_shape, weight, bias)
    x2d = x.reshape(-1, n)
    r2d = None if residual is None else residual.reshape(-1, n)
    if _eager(x):
        out = _Norm.apply(x2d, r2d, weight, bias, eps, rms)
        y, h = out if residual is not None else (out, None)
    else:
        w = None if weight is None else weight.reshape(n)
        b = None if bias is None else bias.reshape(n)
        y, h, _, _ = _norm_forward_op(x2d, r2d, w, b, eps, rms)
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))


def _norm_and_residual(
    x: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
) -> tuple[Tensor, Tensor]:
    n = _check_norm_args(x, None, normalized_shape, weight, bias)
    if not _eager(x):  # the custom op: (norm(x), x), x's two gradients summed by autograd
        return _norm(x, None, normalized_shape, weight, bias, eps, rms), x
    y, passed = _NormAndResidual.apply(x.reshape(-1, n), None, weight, bias, eps, rms)
    return y.view(x.shape), passed.view(x.shape)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` with fp32 statistics on 16-bit input.

    Mean and variance (two-pass, exact for inputs with a large offset) and the
    normalization run in fp32; the output is rounded once to the input's dtype.
    Backward saves the input as it is and the fp32 mean and rstd per row.

    Args:
        input: (..., *normalized_shape), fp16, bf16 or fp32, any leading shape.
        normalized_shape: the trailing dimensions normalized over (an int or a sequence).
        weight, bias: optional, of shape ``normalized_shape``, fp32 (the mixed-precision
            rule) or the input's dtype; their gradients are summed in fp32.
        eps: added to the variance.

    Returns:
        A tensor of the input's shape and dtype.
    """
    return _norm(input, None, normalized_shape, weight, bias, float(eps), False)


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` with fp32 statistics on 16-bit input:
    ``x / sqrt(mean(x^2) + eps) * weight`` computed in fp32, rounded once to the
    input's dtype. ``eps=None`` is fp32's machine epsilon, as torch's
    (:func:`rms_norm_eps`). Arguments as :func:`layer_norm` (no bias)."""
    return _norm(input, None, normalized_shape, weight, None, rms_norm_eps(eps), True)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(h), h)`` with ``h = x + residual``, in one pass.

    ``h`` is added in fp32 and rounded once to the inputs' dtype (as ``x + residual``
    in that dtype); the norm is that of the rounded ``h``, so the pair is exactly
    ``(layer_norm(h), h)``. Both outputs are differentiable; backward saves ``h``
    (16-bit) and the fp32 statistics. ``x`` and ``residual``: same shape and dtype.
    Other arguments as :func:`layer_norm`."""
    return _norm(x, residual, normalized_shape, weight, bias, float(eps), False)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h), h)`` with ``h = x + residual``, in one pass; as
    :func:`add_layer_norm` for :func:`rms_norm`."""
    return _norm(x, residual, normalized_shape, weight, None, rms_norm_eps(eps), True)


def layer_norm_and_residual(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x), x)`` from one autograd node: the form of a pre-norm block's first
    norm, whose input is also the residual (``h = x + attn(norm(x))``).

    ``residual`` is a view of ``x`` (of its (M, N) rows, which is x's storage unless x's
    strides allow no such view: then of the copy the norm reads), never a copy of its own;
    pass it on as the residual (e.g. :func:`add_layer_norm`'s). Backward takes both
    gradients, the normed output's and ``residual``'s, and the norm's backward kernel adds
    the second into x's gradient (fp32, rounded once) where autograd would sum the two with
    a torch add over x's shape; either output may go unused. The normed output is exactly
    :func:`layer_norm`'s. Under ``torch.compile``, for meta tensors or tensor subclasses it
    returns ``(layer_norm(x), x)`` and autograd sums the gradients.

    Args:
        x: (..., *normalized_shape), fp16, bf16 or fp32. Other arguments as :func:`layer_norm`.

    Returns:
        ``(normed, residual)``, both of x's shape and dtype.
    """
    return _norm_and_residual(x, normalized_shape, weight, bias, float(eps), False)


def rms_norm_and_residual(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x), x)`` from one autograd node; as :func:`layer_norm_and_residual`
    for :func:`rms_norm` (no bias; ``eps=None``: :func:`rms_norm_eps`)."""
    return _norm_and_residual(x, normalized_shape, weight, None, rms_norm_eps(eps), True)


def norm_float8(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    rms: bool = False,
    store_t: bool = False,
    history: torch.Tensor | None = None,
    margin: int = 0,
    update: bool = True,
    counter: torch.Tensor | None = None,
    rolls: tuple = (),
) -> tuple[torch.Tensor, Float8Input]:
    """:func:`layer_norm` (``rms=False``) or :func:`rms_norm` whose output also comes
    cast to e4m3 for the next fp8 GEMM, by the norm's own kernel: the producer half of
    Transformer Engine's fused LayerNorm-Linear. Give the cast to
    :func:`tkern.ops.float8.float8_linear` as ``x_fp8`` with that output as ``x``.

    The output is bit for bit :func:`layer_norm`'s / :func:`rms_norm`'s (and so are its
    gradients), the cast bit for bit the one ``float8_linear`` would make of it:
    ``"tensorwise"`` (``history`` None): ``to_float8(y)``, two launches (the norm records
    y's amax as it goes, then one cast pass); ``"delayed"`` (``history``: the GEMM's
    input amax history): one launch, which with ``update`` records y's amax into the
    history and into ``rolls`` (see :func:`tkern.kernels.norm.norm_forward_float8`).

    Eager only: under ``torch.compile`` (or for meta tensors, tensor subclasses) it
    raises; there call the plain norm and let the GEMM layer cast.

    Args:
        input, normalized_shape, weight, bias: as :func:`layer_norm` (RMSNorm: no bias).
        eps: None for the norm's default (1e-5; RMSNorm: :func:`rms_norm_eps`).
        rms: RMSNorm when True.
        store_t: also cast y^T (the GEMM's wgrad operand; wanted in training).
        history, margin, update, counter, rolls: delayed scaling, as
            :func:`~tkern.kernels.norm.norm_forward_float8`'s.

    Returns:
        ``(y, Float8Input(data, data_t, scale))``: y of the input's shape and dtype;
        data (M, N) and data_t (N, M) (None without ``store_t``) e4m3 over y's rows.
    """
    n = _check_norm_args(input, None, normalized_shape, weight, bias)
    if rms and bias is not None:
        raise ValueError("RMSNorm takes no bias")
    if not _eager(input):
        raise RuntimeError(
            "norm_float8 runs eagerly only (its fp8 output is not traced): under torch.compile, for "
            "meta tensors or tensor subclasses call layer_norm / rms_norm and let the fp8 layer cast"
        )
    eps = rms_norm_eps(eps) if rms else (1e-5 if eps is None else float(eps))
    y, data, data_t, scale = _NormFloat8.apply(
        input.reshape(-1, n), None, weight, bias, eps, rms, store_t, history, margin, update, counter,
        tuple(rolls),
    )  # fmt: skip
    return y.view(input.shape), Float8Input(data, data_t if store_t else None, scale)
