"""Cross-entropy in fp32 from 16-bit logits, and a linear + cross-entropy that
never materializes the (tokens x vocabulary) logits.

* :func:`cross_entropy`: ``F.cross_entropy(logits.float(), ...)``'s semantics
  (plus a z-loss and a softcap) on tkern's online-softmax kernel
  (kernels/cross_entropy.py). The kernel runs inside the custom ops
  ``tkern::cross_entropy_rows`` (per-row loss terms and logsumexp) and
  ``tkern::cross_entropy_backward`` (the gradient, one pass over the logits from
  the saved logsumexp), each with a fake implementation, so ``torch.compile``
  traces them as opaque ops; the reduction over rows is plain torch, so autograd
  hands the backward op each row's coefficients (the reduction's ``1 / count``
  times the upstream gradient, a z-loss's ``2 z lse``).
* :func:`linear_cross_entropy`: the chunked pass of ops/loss_chunks.py (per chunk
  tkern's GEMM for the fp32 logits, the kernel for the loss and the logit
  gradient, the chunk's dgrad and its fp32-accumulated wgrad) behind two doors:
  eager calls take :class:`_LinearCrossEntropy`, an ``autograd.Function`` whose
  backward may write the head's gradient into a fused optimizer's flat buffer;
  ``torch.compile`` (and meta tensors) take the custom ops
  ``tkern::linear_cross_entropy`` and ``tkern::linear_cross_entropy_backward``
  (fake implementations, autograd registered): no graph break; there the weight's
  gradient is a new tensor that autograd adds into ``.grad``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tkern.kernels._common import HALF_DTYPES, check_same_device, check_tensor
from tkern.kernels.cross_entropy import (
    LOGIT_DTYPES,
    cross_entropy_backward,
    cross_entropy_forward,
)
from tkern.ops import common
from tkern.ops.common import is_compiling
from tkern.ops.loss_chunks import (
    MIN_CHUNK_ROWS,
    NO_GRADS,
    ChunkedLoss,
    LossOptions,
    default_chunk_rows,
    denominators,
    fused_forward,
    recompute_grads,
)

__all__ = ["MIN_CHUNK_ROWS", "cross_entropy", "default_chunk_rows", "linear_cross_entropy"]

REDUCTIONS = ("none", "mean", "sum")
_NO_SOFTCAP = 0.0  # how the custom ops spell softcap=None (their schema takes a float)


def _softcap_arg(softcap: float) -> float | None:
    return None if softcap == _NO_SOFTCAP else softcap


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("tkern::cross_entropy_rows", mutates_args=())
def _rows_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss terms, logsumexp)`` per row, fp32 (kernels.cross_entropy.cross_entropy_forward;
    the targets are checked here, in the op's body, so compiled graphs check them too)."""
    return cross_entropy_forward(
        logits,
        target,
        weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=_softcap_arg(softcap),
    )


@_rows_op.register_fake
def _(logits, target, weight, ignore_index, label_smoothing, softcap):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return rows, torch.empty_like(rows)


@torch.library.custom_op("tkern::cross_entropy_backward", mutates_args=())
def _backward_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    grad_lse: torch.Tensor | None,
    weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
) -> torch.Tensor:
    """The logits' gradient (their dtype) from the rows' upstream gradients."""
    return cross_entropy_backward(
        logits,
        target,
        lse,
        grad_loss,
        grad_lse,
        weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=_softcap_arg(softcap),
    )


@_backward_op.register_fake
def _(logits, target, lse, grad_loss, grad_lse, weight, ignore_index, label_smoothing, softcap):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _rows_setup_context(ctx, inputs, output):
    logits, target, weight, ignore_index, label_smoothing, softcap = inputs
    ctx.options = (ignore_index, label_smoothing, softcap)
    ctx.save_for_backward(logits, target, weight, output[1])


def _rows_backward(ctx, grad_loss, grad_lse):
    logits, target, weight, lse = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    grad_loss = grad_loss.float().contiguous()
    grad_lse = None if grad_lse is None else grad_lse.float().contiguous()
    grad = _backward_op(logits, target, lse, grad_loss, grad_lse, weight, *ctx.options)
    return grad, None, None, None, None, None


_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup_context)


# --------------------------------------------------------------------------- shared pieces


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_options(label_smoothing: float, z_loss: float, ignore_index: int) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_softcap(softcap: float | None) -> None:
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be None or a number > 0, got {type(softcap).__name__}")
    if not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be None or > 0, got {softcap}")


def _class_weight(weight: torch.Tensor | None, n_classes: int, device: torch.device) -> torch.Tensor | None:
    """``weight`` as the kernel takes it: (V,) fp32 contiguous (a copy only where it is not)."""
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != n_classes:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 1-D tensor of {n_classes} class weights, got {shape}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device} but the logits are on {device}")
    return weight.detach().to(torch.float32).contiguous()


def _reduce(
    rows: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    z_loss: float,
    n_classes: int,
) -> torch.Tensor:
    """The loss from the per-row terms (lse is 0 on ignored rows, so the z-loss
    needs no mask): "none" per row, "sum", or "mean" (the terms over the mean's
    denominator, the z-loss over the non-ignored count; nan when every row is ignored)."""
    zrows = z_loss * lse * lse if z_loss else None
    if reduction == "none":
        return rows if zrows is None else rows + zrows
    if reduction == "sum":
        return rows.sum() if zrows is None else rows.sum() + zrows.sum()
    denom, count = denominators(target, weight, ignore_index, n_classes)
    loss = rows.sum() / denom
    return loss if zrows is None else loss + zrows.sum() / count


# --------------------------------------------------------------------------- cross_entropy


def _as_rows(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N', C)`` logits and ``(N',)`` targets from torch's class-index forms:
    (C,) with a 0-d target, (N, C) with (N,), (N, C, d1, ...) with (N, d1, ...)
    (the class dimension moved last: a copy unless the logits are laid out that way)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.is_floating_point():
        raise TypeError(
            "target must hold class indices (int64 or int32); class-probability targets "
            f"(a floating-point target, here {target.dtype}) are not supported by tkern.cross_entropy"
        )
    if logits.dim() == 0:
        raise ValueError("logits must have at least 1 dimension (the classes), got a 0-d tensor")
    expected = logits.shape[:1] + logits.shape[2:] if logits.dim() > 1 else torch.Size([])
    if target.shape != expected:
        raise ValueError(
            f"target must have shape {tuple(expected)} for logits of shape {tuple(logits.shape)} "
            f"(classes in dimension {0 if logits.dim() == 1 else 1}), got {tuple(target.shape)}"
        )
    if logits.dim() == 1:
        return logits.unsqueeze(0), target.reshape(1)
    if logits.dim() > 2:
        logits = logits.movedim(1, -1)
    return logits.reshape(-1, logits.shape[-1]), target.reshape(-1)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), target, ...)`` without the fp32 copy.

    The log-softmax runs in fp32 over vocabulary chunks (an online max and sum,
    any vocabulary size) reading the logits in place, whatever their strides; the
    loss is fp32 whatever the logits' dtype; the gradient is the logits' dtype,
    computed in fp32 (``p - 1`` from an fp32 ``p``) and rounded once, in a new
    tensor (the logits are never written). Backward reads the logits once more
    with the saved per-row logsumexp.

    Args:
        logits: (C,), (N, C) or (N, C, d1, ...), fp16/bf16/fp32 (torch's layouts:
            the classes in dimension 1, or 0 for a 1-D input).
        target: class indices, int64/int32, of shape (), (N,) or (N, d1, ...);
            each in ``[0, C)`` or ``ignore_index``, checked without a host sync: on
            the CPU a ``ValueError`` naming it before the launch, on a GPU a
            device-side assert (``torch._assert_async``) queued before the launch.
            Class-probability targets are not supported (``TypeError``).
        weight: optional (C,) class weights (any float dtype; used in fp32; no
            gradient flows to them).
        ignore_index: rows with this target contribute nothing and get a zero gradient.
        reduction: ``"none"`` (the target's shape), ``"mean"`` (over the non-ignored
            rows, or over their summed class weights when ``weight`` is given; nan
            when every row is ignored, as torch) or ``"sum"``.
        label_smoothing: torch's smoothing in [0, 1], with or without ``weight``.
        z_loss: adds ``z_loss * logsumexp^2`` per non-ignored row (averaged over
            the non-ignored count under "mean", not class-weighted; PaLM's z-loss).
        softcap: optional c > 0: the logits become ``c * tanh(logits / c)`` first (Gemma 2).

    Returns:
        fp32: a 0-d tensor, or the per-row losses for ``"none"``.
    """
    _check_reduction(reduction)
    _check_options(label_smoothing, z_loss, ignore_index)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must have dtype in {LOGIT_DTYPES}, got {logits.dtype}")
    _check_softcap(softcap)
    shape = target.shape if isinstance(target, torch.Tensor) else None
    rows_logits, rows_target = _as_rows(logits, target)
    w = _class_weight(weight, rows_logits.shape[1], logits.device)
    rows, lse = _rows_op(
        rows_logits, rows_target, w, ignore_index, float(label_smoothing), float(softcap or _NO_SOFTCAP)
    )
    loss = _reduce(rows, lse, rows_target, w, ignore_index, reduction, z_loss, rows_logits.shape[1])
    return loss.reshape(shape) if reduction == "none" else loss


# --------------------------------------------------------------------------- linear_cross_entropy


def _weight_grad(ctx, gw32: Tensor | None, scale: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The weight's gradient ``gw32 * scale`` (``gw32`` alone for None) from its fp32 sum, in
    ``dtype`` (the weight's), as backward returns it, in one launch rounding once from fp32:
    written (or added: ``view + gw32 * scale`` in fp32, then rounded) into the weight's view
    in a fused optimizer's flat gradient buffer where :func:`common.flat_wgrad` allows it
    (the view handed to autograd, no fresh tensor and no second add), else a new tensor.
    The product is in fp32: a loss scaler's 2^16 is no fp16 number (it rounds to inf)."""
    if gw32 is None:
        return None
    target = common.flat_wgrad(ctx, dtype)
    if target is None:
        return _scaled32(gw32, scale, dtype)
    _, view, accumulate = target
    if scale is None:
        view.add_(gw32) if accumulate else view.copy_(gw32)
    elif accumulate:
        view.addcmul_(gw32, scale)
    else:
        torch.mul(gw32, scale, out=view)
    return common.hand_over(target)


def _scaled32(t32: Tensor | None, scale: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t32 * scale`` (``t32`` for None) computed in fp32 and rounded once to ``dtype``:
    one launch into a new tensor."""
    if t32 is None:
        return None
    if scale is None:
        return t32.to(dtype)
    return torch.mul(t32, scale, out=torch.empty(t32.shape, dtype=dtype, device=t32.device))


def _scaled(t: Tensor | None, g: Tensor) -> Tensor | None:
    return None if t is None else (t * g).to(t.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked ``cross_entropy(x @ W^T + b, target)``, the eager door (the weight's
    gradient may go into a fused optimizer's flat buffer): for "mean"/"sum" the
    gradients are computed in forward and scaled by the (scalar) upstream gradient in
    backward; for "none" backward recomputes the chunks with the per-row upstream gradients."""

    @staticmethod
    def forward(ctx, x, w, b, target, weight, opts, grad_mode):
        # needs_input_grad says True under no_grad too: grad_mode (the caller's) decides
        needs = ctx.needs_input_grad[:3] if grad_mode else NO_GRADS
        ch = ChunkedLoss(x, w, b, target, weight, opts)
        ctx.opts, ctx.dtypes = opts, (w.dtype, None if b is None else b.dtype)
        # The weight's and the bias's gradients stay fp32 sums until backward, always (not
        # only where the flat-buffer path will apply: that is decided in backward, from the
        # graph then): 4 V H bytes held between forward and backward instead of the rounded
        # copy's 2 V H, but no 6 V H peak while forward rounds, and backward makes the
        # gradient in one launch rounding once from fp32 (not a round trip through fp16).
        loss, lse, gx, gw32, gb32 = fused_forward(ch, needs, round_grads=False)
        if opts.reduction == "none":
            ctx.save_for_backward(x, w, b, target, weight, lse)
        else:
            ctx.save_for_backward(gx, gw32, gb32)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        g = grad_out.to(torch.float32)
        w_dtype, b_dtype = ctx.dtypes
        if ctx.opts.reduction != "none":
            gx, gw32, gb32 = ctx.saved_tensors
            gw, gb = _weight_grad(ctx, gw32, g, w_dtype), _scaled32(gb32, g, b_dtype)
            return _scaled(gx, g), gw, gb, None, None, None, None
        x, w, b, target, weight, lse = ctx.saved_tensors
        ch = ChunkedLoss(x, w, b, target, weight, ctx.opts)
        gx, gw32, gb32 = recompute_grads(ch, lse, g, ctx.needs_input_grad[:3], round_grads=False)
        gw, gb = _weight_grad(ctx, gw32, None, w_dtype), _scaled32(gb32, None, b_dtype)
        return gx, gw, gb, None, None, None, None


# the traced door: custom ops with fake implementations (torch.compile, meta tensors)


def _opts(ignore_index, smoothing, softcap, z_loss, reduction, chunk) -> LossOptions:
    return LossOptions(ignore_index, smoothing, _softcap_arg(softcap), z_loss, reduction, chunk)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


@torch.library.custom_op("tkern::linear_cross_entropy", mutates_args=())
def _lce_op(
    x: Tensor,
    w: Tensor,
    b: Tensor | None,
    target: Tensor,
    weight: Tensor | None,
    ignore_index: int,
    smoothing: float,
    softcap: float,
    z_loss: float,
    reduction: str,
    chunk: int,
    needs_x: bool,
    needs_w: bool,
    needs_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`loss_chunks.fused_forward`: ``(loss, lse, gx, gW, gb)``, gW and gb their fp32
    sums (rounded in backward, as the eager door's), a gradient not asked
    for (or for "none") an empty tensor; the targets are checked here, in the op's body
    (fused_forward's first launch)."""
    ch = ChunkedLoss(
        x, w, b, target, weight, _opts(ignore_index, smoothing, softcap, z_loss, reduction, chunk)
    )
    loss, lse, gx, gw32, gb32 = fused_forward(ch, (needs_x, needs_w, needs_b), round_grads=False)
    return loss, lse, _or_empty(gx, x), _or_empty(gw32, w), _or_empty(gb32, x)


@_lce_op.register_fake
def _(x, w, b, target, weight, ignore_index, smoothing, softcap, z_loss, reduction, chunk, nx, nw, nb):
    n, grads = x.shape[0], reduction != "none"
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    gx = torch.empty_like(x) if grads and nx else x.new_empty(0)
    gw = torch.empty_like(w, dtype=torch.float32) if grads and nw else w.new_empty(0)
    gb = torch.empty_like(b, dtype=torch.float32) if grads and nb and b is not None else x.new_empty(0)
    return loss, x.new_empty(n, dtype=torch.float32), gx, gw, gb


@torch.library.custom_op("tkern::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(
    x: Tensor,
    w: Tensor,
    b: Tensor | None,
    target: Tensor,
    weight: Tensor | None,
    lse: Tensor,
    grad_out: Tensor,
    ignore_index: int,
    smoothing: float,
    softcap: float,
    z_loss: float,
    chunk: int,
    needs_x: bool,
    needs_w: bool,
    needs_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``reduction="none"``'s ``(gx, gW, gb)`` (:func:`loss_chunks.recompute_grads`)."""
    ch = ChunkedLoss(x, w, b, target, weight, _opts(ignore_index, smoothing, softcap, z_loss, "none", chunk))
    gx, gw, gb = recompute_grads(ch, lse, grad_out, (needs_x, needs_w, needs_b))
    return _or_empty(gx, x), _or_empty(gw, w), _or_empty(gb, x)


@_lce_backward_op.register_fake
def _(x, w, b, target, weight, lse, grad_out, ignore_index, smoothing, softcap, z_loss, chunk, nx, nw, nb):
    gx = torch.empty_like(x) if nx else x.new_empty(0)
    gw = torch.empty_like(w) if nw else w.new_empty(0)
    return gx, gw, torch.empty_like(b) if nb and b is not None else x.new_empty(0)


def _lce_setup_context(ctx, inputs, output):
    x, w, b, target, weight, *options = inputs
    ctx.options, ctx.has_bias = options, b is not None
    ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
    if options[4] == "none":
        ctx.save_for_backward(x, w, b, target, weight, output[1])
    else:
        ctx.save_for_backward(*output[2:])


def _lce_backward(ctx, grad_loss, _grad_lse, *_grads):
    needs = ctx.needs_input_grad[:3]
    ignore_index, smoothing, softcap, z_loss, reduction, chunk = ctx.options[:6]
    if reduction != "none":
        g = grad_loss.to(torch.float32)
        gx, gw32, gb32 = (t if need else None for t, need in zip(ctx.saved_tensors, needs, strict=True))
        grads = [_scaled(gx, g), _scaled32(gw32, g, ctx.dtypes[1])]
        grads.append(_scaled32(gb32, g, ctx.dtypes[2]) if ctx.has_bias else None)
    else:
        x, w, b, target, weight, lse = ctx.saved_tensors
        args = (ignore_index, smoothing, softcap, z_loss, chunk, *needs)
        grads = _lce_backward_op(x, w, b, target, weight, lse, grad_loss, *args)
        grads = [g if need else None for g, need in zip(grads, needs, strict=True)]
    if not ctx.has_bias:
        grads[2] = None
    return *grads, *(None,) * 11


_lce_op.register_autograd(_lce_backward, setup_context=_lce_setup_context)


def _check_linear_ce_args(
    x: Tensor, w: Tensor, b: Tensor | None, target: Tensor, chunk_size: int | None
) -> None:
    check_tensor("linear_weight", w, ndim=2, dtypes=(*HALF_DTYPES, torch.float32))
    check_tensor("input", x, dtypes=(w.dtype,))
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"input must have shape (..., {w.shape[1]}) to match linear_weight of shape "
            f"{tuple(w.shape)} (classes, features), got {tuple(x.shape)}"
        )
    if b is not None:
        check_tensor("linear_bias", b, ndim=1, dtypes=(w.dtype, torch.float32))
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"linear_bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    check_tensor("target", target, dtypes=(torch.int64, torch.int32))
    if target.shape != x.shape[:-1]:
        raise ValueError(
            f"target must have shape {tuple(x.shape[:-1])} (input's leading dimensions), "
            f"got {tuple(target.shape)}"
        )
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    check_same_device(input=x, linear_weight=w, linear_bias=b, target=target)


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)``
    without the (tokens x classes) logits: torch 2.13's ``F.linear_cross_entropy``
    plus tkern's ``z_loss``, ``softcap`` and ``chunk_size``.

    The rows go in chunks of ``chunk_size``; per chunk, tkern's GEMM computes the
    chunk's logits in fp32 (fp32 accumulation) in parts of a quarter of its rows
    (``loss_chunks.logits_rows``; a chunk of at most 16 rows in one), the
    cross-entropy kernel each part's loss terms and (when gradients are needed) its
    rows of the chunk's logit gradient, a buffer reused by every chunk, then the
    chunk's ``grad_input`` rows (``grad @ W``) and its weight gradient
    (``grad^T @ input``) accumulated in fp32 across the chunks and rounded once. No
    tensor larger than the chunk's fp32 logits (or than the input, the weight and
    their gradients) is created, and none with more rows than a chunk.

    For ``"mean"`` and ``"sum"`` the gradients are computed in forward (as torch's
    chunked option and Liger do) and multiplied by the upstream gradient in
    backward (exact for a power-of-two loss scale; a second rounding otherwise);
    for ``"none"`` backward recomputes the chunks with the per-row upstream gradients.
    Where a fused optimizer holds ``linear_weight``, its gradient goes into the
    optimizer's flat gradient buffer (as :func:`tkern.linear`'s). Under
    ``torch.compile`` it is the custom op ``tkern::linear_cross_entropy`` (no graph
    break; the same chunks and kernels; the weight's gradient a new tensor there,
    which autograd adds into ``.grad``).

    Args:
        input: (..., H), fp16/bf16 (tkern's GEMM) or fp32 (torch's GEMM).
        linear_weight: (V, H), ``input``'s dtype.
        target: (...) class indices, int64/int32, in ``[0, V)`` or ``ignore_index``
            (checked as :func:`cross_entropy`'s, without a host sync).
        linear_bias: optional (V,), ``input``'s dtype or fp32.
        weight, reduction, label_smoothing, z_loss: as :func:`cross_entropy`.
        softcap: optional c > 0: the logits become ``c * tanh(logits / c)`` before the
            loss (Gemma 2's ``final_logit_softcapping``), as :func:`cross_entropy`'s;
            applied to each chunk's fp32 logits in the kernel, never materialized.
        ignore_index: as :func:`cross_entropy`; None means -100 (torch's convention).
        chunk_size: rows per chunk; default :func:`default_chunk_rows` (4 times the
            power of two nearest H, at most a quarter of the rows, at least
            ``MIN_CHUNK_ROWS`` = 64 rows or all of them).

    Returns:
        fp32: a 0-d tensor, or the per-row losses in the target's shape for ``"none"``.
    """
    ignore_index = -100 if ignore_index is None else ignore_index
    _check_reduction(reduction)
    _check_options(label_smoothing, z_loss, ignore_index)
    _check_softcap(softcap)
    _check_linear_ce_args(input, linear_weight, linear_bias, target, chunk_size)
    v, h = linear_weight.shape
    x2d, t = input.reshape(-1, h), target.reshape(-1)
    w = _class_weight(weight, v, input.device)
    chunk = chunk_size or default_chunk_rows(x2d.shape[0], h, v)
    opts = LossOptions(
        ignore_index,
        float(label_smoothing),
        None if softcap is None else float(softcap),
        float(z_loss),
        reduction,
        chunk,
    )
    if type(input) is torch.Tensor and not input.is_meta and not is_compiling():  # targets checked in forward
        loss = _LinearCrossEntropy.apply(x2d, linear_weight, linear_bias, t, w, opts, torch.is_grad_enabled())
    else:
        loss = _linear_cross_entropy_op(x2d, linear_weight, linear_bias, t, w, opts)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _linear_cross_entropy_op(x, w, b, target, weight, opts: LossOptions) -> Tensor:
    """:func:`linear_cross_entropy` through the custom op ``tkern::linear_cross_entropy``."""
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, w, b)]
    cap = _NO_SOFTCAP if opts.softcap is None else opts.softcap
    args = (opts.ignore_index, opts.smoothing, cap, opts.z_loss, opts.reduction, opts.chunk)
    return _lce_op(x, w, b, target, weight, *args, *needs)[0]
