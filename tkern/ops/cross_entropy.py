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
* :func:`linear_cross_entropy`: rows in chunks; per chunk tkern's GEMM gives the
  chunk's fp32 logits, the kernel its loss and its logit gradient (one launch,
  into a reused buffer), then the chunk's dgrad and its wgrad, accumulated in an
  fp32 (V, H) buffer across chunks and rounded once at the end (Liger PR 1391).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tkern.kernels._common import HALF_DTYPES, check_same_device, check_tensor
from tkern.kernels.cross_entropy import (
    LOGIT_DTYPES,
    check_targets,
    cross_entropy_backward,
    cross_entropy_forward,
)
from tkern.kernels.gemm import matmul_prechecked
from tkern.ops import common

__all__ = ["cross_entropy", "linear_cross_entropy"]

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


def _denominators(
    target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the mean's denominator, the non-ignored count)`` as fp32 0-d device
    tensors (no host sync): the summed class weights of the non-ignored targets
    (torch's weighted mean) or their count, and the count (the z-loss's mean)."""
    valid = target != ignore_index
    count = valid.sum(dtype=torch.float32)
    if weight is None:
        return count, count
    safe = torch.where(valid, target, 0).long()
    return (weight[safe] * valid).sum(), count


def _reduce(
    rows: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    z_loss: float,
) -> torch.Tensor:
    """The loss from the per-row terms (lse is 0 on ignored rows, so the z-loss
    needs no mask): "none" per row, "sum", or "mean" (the terms over the mean's
    denominator, the z-loss over the non-ignored count; nan when every row is ignored)."""
    zrows = z_loss * lse * lse if z_loss else None
    if reduction == "none":
        return rows if zrows is None else rows + zrows
    if reduction == "sum":
        return rows.sum() if zrows is None else rows.sum() + zrows.sum()
    denom, count = _denominators(target, weight, ignore_index)
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
    loss = _reduce(rows, lse, rows_target, w, ignore_index, reduction, z_loss)
    return loss.reshape(shape) if reduction == "none" else loss


# --------------------------------------------------------------------------- linear_cross_entropy


#: The fewest rows a default chunk has (all the rows where there are fewer): each chunk
#: runs three GEMMs whose row count is the chunk's (the logits' and dgrad's M, the weight
#: gradient's K), plus a kernel launch; below ~128 rows they are launch-bound and the
#: weight gradient's K too short to fill a 128-wide tile (1-row chunks: one launch per token).
MIN_CHUNK_ROWS = 128


def default_chunk_rows(n_rows: int, in_features: int, n_classes: int) -> int:
    """Rows per chunk, a power of two: the bytes rule -- the chunk's logits (rows x
    classes) about as many elements as the input (rows x features), so that the
    chunk's fp32 logits cost no more memory than the activations -- raised to
    :data:`MIN_CHUNK_ROWS` (GEMMs large enough to keep a GPU busy) and capped at
    ``n_rows`` rounded up to a power of two (one chunk holds every row). The bytes
    rule decides for large vocabularies against the rows' width only above the floor
    (8192 x 4096 rows into 128256 classes: 256 rows; GPT-2's 8192 x 768 into 50257:
    128); below it the floor wins (at most 128 x V fp32 logits per chunk)."""
    target = max(1, n_rows * in_features // max(n_classes, 1))
    rows = max(1 << round(math.log2(target)), MIN_CHUNK_ROWS)
    return max(1, min(rows, 1 << max(n_rows - 1, 0).bit_length()))


def _mm_into(
    a: torch.Tensor, b: torch.Tensor, bias: Tensor | None, out: torch.Tensor, accumulate: bool
) -> None:
    """``out (+)= a @ b (+ bias)`` with fp32 accumulation: tkern's GEMM for fp16/bf16
    operands (out of any of fp16/bf16/fp32), torch's for fp32 operands (tkern's GEMM
    takes 16-bit operands only)."""
    if a.dtype in HALF_DTYPES:
        matmul_prechecked(a, b, bias, None, out.dtype, None, out, accumulate)
    elif accumulate:
        out.addmm_(a, b)
    elif bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias.to(out.dtype), a, b, out=out)


class _Chunks:
    """The chunked pass over the rows: per chunk the logits (fp32, reused buffer),
    the kernel, and the chunk's dgrad and wgrad from the kernel's gradient (reused
    buffer of the input's dtype)."""

    def __init__(
        self,
        x: Tensor,
        w: Tensor,
        b: Tensor | None,
        target: Tensor,
        weight: Tensor | None,
        ignore_index: int,
        smoothing: float,
        softcap: float | None,
        chunk: int,
    ) -> None:
        self.x, self.w, self.b, self.target, self.weight = x, w, b, target, weight
        self.ignore_index, self.smoothing, self.softcap, self.chunk = ignore_index, smoothing, softcap, chunk
        n, v = x.shape[0], w.shape[0]
        c = min(chunk, n)
        self.logits = torch.empty(c, v, dtype=torch.float32, device=x.device)
        self.grad = None

    def spans(self) -> list[tuple[int, int]]:
        n = self.x.shape[0]
        return [(s, min(s + self.chunk, n)) for s in range(0, n, self.chunk)]

    def logits_of(self, s: int, e: int) -> torch.Tensor:
        out = self.logits[: e - s]
        _mm_into(self.x[s:e], self.w.t(), self.b, out, False)
        return out

    def grad_buffer(self, rows: int) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.empty(self.logits.shape, dtype=self.x.dtype, device=self.x.device)
        return self.grad[:rows]

    def backprop(
        self,
        g: Tensor,
        s: int,
        e: int,
        gx: Tensor | None,
        gw32: Tensor | None,
        gb32: Tensor | None,
        first: bool,
    ) -> None:
        """The chunk's share: gx[s:e] = g @ W, gW += g^T @ x (fp32), gb += column sums (fp32)."""
        if gx is not None:
            _mm_into(g, self.w, None, gx[s:e], False)
        if gw32 is not None:
            _mm_into(g.t(), self.x[s:e], None, gw32, not first)
        if gb32 is not None:
            part = g.sum(0, dtype=torch.float32)
            if first:
                gb32.copy_(part)
            else:
                gb32.add_(part)


def _lce_forward(
    ch: _Chunks, a: Tensor | None, q: Tensor | None, needs: tuple[bool, ...]
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Loss terms and lse per row; with ``needs`` (x, W, b) the gradients of
    ``sum_i a * loss_i + q * lse_i^2`` (a, q: (1,) fp32 device tensors)."""
    x, w = ch.x, ch.w
    v = w.shape[0]
    want = any(needs)
    gx = torch.empty_like(x) if needs[0] else None
    gw32 = torch.empty(w.shape, dtype=torch.float32, device=x.device) if needs[1] else None
    gb32 = torch.empty(v, dtype=torch.float32, device=x.device) if needs[2] else None
    rows, lses = [], []
    for i, (s, e) in enumerate(ch.spans()):
        logits = ch.logits_of(s, e)
        grad = ch.grad_buffer(e - s) if want else None
        loss, lse = cross_entropy_forward(
            logits,
            ch.target[s:e],
            ch.weight,
            ignore_index=ch.ignore_index,
            label_smoothing=ch.smoothing,
            softcap=ch.softcap,
            grad=grad,
            a=a if want else None,
            q=q if want else None,
            check_target=False,
        )
        rows.append(loss)
        lses.append(lse)
        if want:
            ch.backprop(grad, s, e, gx, gw32, gb32, i == 0)
    empty = x.new_empty(0, dtype=torch.float32)
    rows = torch.cat(rows) if rows else empty
    lses = torch.cat(lses) if lses else empty
    return rows, lses, gx, gw32, gb32


def _lce_recompute(
    ch: _Chunks, lse: Tensor, grad_rows: Tensor, grad_lse: Tensor | None, needs: tuple[bool, ...]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``reduction="none"``'s backward: the chunks again, with per-row coefficients."""
    x, w = ch.x, ch.w
    gx = torch.empty_like(x) if needs[0] else None
    gw32 = torch.empty(w.shape, dtype=torch.float32, device=x.device) if needs[1] else None
    gb32 = torch.empty(w.shape[0], dtype=torch.float32, device=x.device) if needs[2] else None
    for i, (s, e) in enumerate(ch.spans()):
        logits = ch.logits_of(s, e)
        grad = cross_entropy_backward(
            logits,
            ch.target[s:e],
            lse[s:e],
            grad_rows[s:e],
            None if grad_lse is None else grad_lse[s:e],
            ch.weight,
            ignore_index=ch.ignore_index,
            label_smoothing=ch.smoothing,
            softcap=ch.softcap,
            grad=ch.grad_buffer(e - s),
        )
        ch.backprop(grad, s, e, gx, gw32, gb32, i == 0)
    return gx, gw32, gb32


def _cast(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or like is None else t.to(like.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked ``cross_entropy(x @ W^T + b, target)``: for "mean"/"sum" the gradients
    are computed in forward and scaled by the (scalar) upstream gradient in backward;
    for "none" backward recomputes the chunks with the per-row upstream gradients."""

    @staticmethod
    def forward(
        ctx, x, w, b, target, weight, ignore_index, smoothing, softcap, z_loss, reduction, chunk, grad_mode
    ):
        # needs_input_grad says True under no_grad too: grad_mode (the caller's) decides
        needs = ctx.needs_input_grad[:3] if grad_mode else (False, False, False)
        ch = _Chunks(x, w, b, target, weight, ignore_index, smoothing, softcap, chunk)
        ctx.reduction, ctx.z_loss = reduction, z_loss
        if reduction == "none":
            rows, lse, *_ = _lce_forward(ch, None, None, (False, False, False))
            ctx.save_for_backward(x, w, b, target, weight, lse)
            ctx.options = (ignore_index, smoothing, softcap, chunk)
            return rows + z_loss * lse * lse if z_loss else rows
        denom, count = _denominators(target, weight, ignore_index)
        if reduction == "mean":
            a, q = (1.0 / denom).reshape(1), (z_loss / count).reshape(1)
        else:
            a, q = torch.ones(1, device=x.device), torch.full((1,), z_loss, device=x.device)
        rows, lse, gx, gw32, gb32 = _lce_forward(ch, a, q if z_loss else None, needs)
        loss = (rows.sum() * a[0]).reshape(())
        if z_loss:
            loss = loss + (lse * lse).sum() * q[0]
        # the weight's gradient rounded once from its fp32 sum over the chunks
        ctx.save_for_backward(gx, _cast(gw32, w), _cast(gb32, b))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        g = grad_out.to(torch.float32)
        if ctx.reduction != "none":
            gx, gw, gb = ctx.saved_tensors
            gx, gb = (None if t is None else (t * g).to(t.dtype) for t in (gx, gb))
            return gx, _weight_grad(ctx, gw, g), gb, *(None,) * 9
        x, w, b, target, weight, lse = ctx.saved_tensors
        ignore_index, smoothing, softcap, chunk = ctx.options
        g = g.contiguous()
        glse = (2.0 * ctx.z_loss) * lse * g if ctx.z_loss else None
        ch = _Chunks(x, w, b, target, weight, ignore_index, smoothing, softcap, chunk)
        gx, gw32, gb32 = _lce_recompute(ch, lse, g, glse, ctx.needs_input_grad[:3])
        return gx, _weight_grad(ctx, _cast(gw32, w), None), _cast(gb32, b), *(None,) * 9


def _weight_grad(ctx, gw: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor | None:
    """The weight's gradient ``gw * scale`` (``gw`` alone for None) as backward returns
    it: written (or added) into the weight's view in a fused optimizer's flat gradient
    buffer where :func:`common.flat_wgrad` allows it (the view handed to autograd, no
    fresh tensor and no second add), else a new tensor."""
    if gw is None:
        return None
    target = common.flat_wgrad(ctx, gw.dtype)
    if target is None:
        return gw if scale is None else (gw * scale).to(gw.dtype)
    _, view, accumulate = target
    if scale is None:
        view.add_(gw) if accumulate else view.copy_(gw)
    elif accumulate:
        view.addcmul_(gw, scale.to(gw.dtype))
    else:
        torch.mul(gw, scale.to(gw.dtype), out=view)
    return common.hand_over(target)


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


@torch.compiler.disable  # eager launches (chunks, Triton, the target check): a graph break
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
    chunk's logits in fp32 (fp32 accumulation), the cross-entropy kernel its
    loss terms and (when gradients are needed) its logit gradient into a buffer
    reused by every chunk, then the chunk's ``grad_input`` rows (``grad @ W``)
    and its weight gradient (``grad^T @ input``) accumulated in fp32 across the
    chunks and rounded once. No tensor larger than the chunk's logits (or than
    the input, the weight and their gradients) is created.

    For ``"mean"`` and ``"sum"`` the gradients are computed in forward (as torch's
    chunked option and Liger do) and multiplied by the upstream gradient in
    backward (exact for a power-of-two loss scale; a second rounding otherwise);
    for ``"none"`` backward recomputes the chunks with the per-row upstream gradients.
    Where a fused optimizer holds ``linear_weight``, its gradient goes into the
    optimizer's flat gradient buffer (as :func:`tkern.linear`'s). Under
    ``torch.compile`` the call is a graph break (it runs eagerly).

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
        chunk_size: rows per chunk; default :func:`default_chunk_rows` (as many
            logits per chunk as the input has elements, a power of two, at least
            ``MIN_CHUNK_ROWS`` = 128 rows or all of them).

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
    check_targets(t, v, ignore_index)
    chunk = chunk_size or default_chunk_rows(x2d.shape[0], h, v)
    loss = _LinearCrossEntropy.apply(
        x2d,
        linear_weight,
        linear_bias,
        t,
        w,
        ignore_index,
        float(label_smoothing),
        None if softcap is None else float(softcap),
        float(z_loss),
        reduction,
        chunk,
        torch.is_grad_enabled(),
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
