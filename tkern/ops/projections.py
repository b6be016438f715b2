"""Linears that read one input as one autograd function (an attention's q, k and v
projections of the normed hidden states, converted by :mod:`tkern.nn.projections`):

``y_i = x @ W_i^T + b_i`` for each weight, forward as one GEMM per weight; backward with each
layer's dW and db as :func:`tkern.linear`'s (dW into a fused optimizer's flat gradient buffer
where it may) and ``dX = sum_i dY_i @ W_i`` by the first dgrad GEMM writing dX and each next one
adding its product into it (``gemm.matmul_backward``'s ``into``: fp32 inside, one rounding per
GEMM), where autograd, given separate linears, would sum their input gradients with a torch
add over (tokens, K) per extra layer. The same Parameters as separate :func:`tkern.linear`
calls; a tracing, meta or subclass call, or an empty one, runs those calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tkern.kernels.activation import activation_grad_prechecked
from tkern.kernels.gemm import linear_prechecked
from tkern.ops import common
from tkern.ops.common import as_2d
from tkern.ops.linear import (
    check_linear_args,
    dgrad_into,
    differentiable_grads,
    layer_grads,
    linear,
    linear_args_plainly_valid,
    linear_grads,
    mm_backward_checked,
)

__all__ = ["shared_input_linears", "split_linear"]


class _SharedInputLinears(torch.autograd.Function):
    """``(x @ W_i^T + b_i for each i)`` as (M, N_i) tensors; inputs ``x, W_0, b_0, W_1, b_1, ...``.
    See the module's docstring."""

    @staticmethod
    def forward(ctx, x, *params):
        x2d = x if x.dim() == 2 else as_2d(x, params[0].shape[1])
        ys = tuple(
            linear_prechecked(x2d, w, b, None, None) for w, b in zip(params[::2], params[1::2], strict=True)
        )
        ctx.set_materialize_grads(False)  # an output nobody reads: no GEMMs for its zeros
        ctx.slots = common.next_function_slots(x, *params)
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in params[1::2])
        ctx.x_shape = x.shape if x2d is not x else None
        ctx.save_for_backward(x2d, *params)
        return ys

    @staticmethod
    def backward(ctx, *dys):
        x2d, *params = ctx.saved_tensors
        weights, biases = params[::2], params[1::2]
        needs = ctx.needs_input_grad
        grads = []  # dW_0, db_0, dW_1, db_1, ...
        dx = None
        for i, (dy, w, b) in enumerate(zip(dys, weights, biases, strict=True)):
            layer_needs = (needs[0], needs[1 + 2 * i], needs[2 + 2 * i])
            if dy is None:  # this output took no part in the loss: no gradient from it
                grads += [None, None]
                continue
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients
                dxi, dw, db = differentiable_grads(dy, x2d, w, b, None, layer_needs, ctx.bias_dtypes[i])
                dx = dxi if dx is None or dxi is None else dx + dxi
            else:
                _, dw, db = layer_grads(
                    ctx, dy, x2d, w, (False, *layer_needs[1:]), ctx.bias_dtypes[i], 1 + 2 * i
                )
                if needs[0]:  # the first dgrad writes dX, the next ones add into it
                    dx = dgrad_into(dy, w, dx)
            grads += [dw, db]
        if dx is not None and ctx.x_shape is not None:
            dx = dx.reshape(ctx.x_shape)
        return (dx, *grads)


def _check(x, weights, biases) -> tuple[bool, list]:
    """Every check :func:`tkern.linear` makes, for each weight (before anything runs); returns
    whether the eager path applies and the biases (None for each where ``biases`` is None)."""
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence) or not weights:
        raise TypeError(f"weights must be a non-empty list or tuple of tensors, got {type(weights).__name__}")
    if biases is None:
        biases = [None] * len(weights)
    elif isinstance(biases, torch.Tensor) or not isinstance(biases, Sequence):
        raise TypeError(f"biases must be None or a list or tuple, got {type(biases).__name__}")
    if len(biases) != len(weights):
        raise ValueError(f"biases must have one entry per weight ({len(weights)}), got {len(biases)}")
    eager = True
    for w, b in zip(weights, biases, strict=True):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"each weight must be a tensor, got {type(w).__name__}")
        eager = check_linear_args(x, w, b, None) and eager
    return eager, list(biases)


def shared_input_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``tuple(tkern.linear(x, w, b) for w, b in zip(weights, biases))`` as one autograd node
    whose backward sums the layers' input gradients in their dgrad GEMMs (see the module's
    docstring): no torch add over (..., K).

    Args:
        x: (..., K), fp16 or bf16.
        weights: one or more (N_i, K) tensors of ``x``'s dtype (the N_i may differ: GQA's q, k, v).
        biases: None, or one entry per weight: None or an (N_i,) tensor of ``x``'s dtype or fp32.

    Returns:
        a tuple of (..., N_i) tensors of ``x``'s dtype, one per weight.
    """
    eager, biases = _check(x, weights, biases)
    if not eager or weights[0].shape[1] == 0 or any(w.shape[0] == 0 for w in weights):
        return tuple(linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    params = [t for pair in zip(weights, biases, strict=True) for t in pair]
    ys = _SharedInputLinears.apply(x, *params)
    if x.dim() == 2:
        return tuple(ys)
    return tuple(y.reshape(*x.shape[:-1], y.shape[1]) for y in ys)


# --------------------------------------------------------------------------- one linear, split


class _SplitLinear(torch.autograd.Function):
    """``(x @ W^T + b).split(sizes, -1)`` as (M, N_i) views of one (M, N) GEMM output; inputs
    ``x, W, b, sizes``. See :func:`split_linear`."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes):
        x2d = x if x.dim() == 2 else as_2d(x, weight.shape[1])
        y = linear_prechecked(x2d, weight, bias, None, None)
        ctx.set_materialize_grads(False)  # a part nobody reads: no GEMMs for its zeros
        ctx.sizes = sizes
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.slots = common.next_function_slots(x, weight, bias)
        ctx.x_shape = x.shape if x2d is not x else None
        ctx.save_for_backward(x2d, weight, bias)
        return y.split(sizes, 1)

    @staticmethod
    def backward(ctx, *dys):
        x2d, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients of the whole
            zero = x2d.new_zeros
            parts = [zero(x2d.shape[0], n) if d is None else d for d, n in zip(dys, ctx.sizes, strict=True)]
            dy = torch.cat(parts, 1)
            dx, dw, db = differentiable_grads(dy, x2d, weight, bias, None, needs, ctx.bias_dtype)
            return _shaped(ctx, dx), dw, db, None
        targets = _whole_targets(ctx, needs, weight, x2d)
        dx, start = None, 0
        for dy, n in zip(dys, ctx.sizes, strict=True):
            rows = slice(start, start + n)
            start += n
            if dy is None:  # this part took no part in the loss: its rows of dW and db are 0
                _zero_rows(targets, rows)
                continue
            part = weight[rows]  # (N_i, K): rows of W, columns of a Conv1D's (K, N)
            _part_grads(ctx, dy, x2d, part, needs, targets, rows)
            if needs[0]:  # the first dgrad writes dX, the next ones add into it
                dx = dgrad_into(dy, part, dx)
        dw, db = _handed_over(targets)
        return _shaped(ctx, dx), dw, db, None


def _shaped(ctx, dx):
    return dx if dx is None or ctx.x_shape is None else dx.reshape(ctx.x_shape)


def _whole_targets(ctx, needs, weight, x2d) -> list:
    """``[dw_target, db_target]``: where the whole dW (N, K) and db (N,) go, as
    ``(flat view or None, tensor, accumulate)``: a fused optimizer's flat gradient views where
    :func:`common.flat_targets` gives them (added into when ``.grad`` is the view), else one new
    tensor each, written part by part (None: not needed)."""
    dw_flat, db_flat = common.flat_targets(ctx, needs, weight, ctx.bias_dtype, ctx.slots[1], ctx.slots[2])
    n, k = weight.shape
    dw_target = db_target = None
    if needs[1]:
        dw_target = dw_flat or (None, weight.new_empty(n, k), False)
    if needs[2] and ctx.bias_dtype is not None:
        db_target = db_flat or (None, x2d.new_empty(n, dtype=ctx.bias_dtype), False)
    return [dw_target, db_target]


def _zero_rows(targets, rows) -> None:
    """A part without a gradient: its rows of a written (not added into) dW / db are zeros."""
    for target in targets:
        if target is not None and not target[2]:
            target[1][rows].zero_()


def _part_grads(ctx, dy, x2d, part, needs, targets, rows) -> None:
    """One part's dW rows (the wgrad GEMM into them, db summed in it where it sums) and db
    rows (a reduction added or written into them where the GEMM did not sum them)."""
    dw_target, db_target = targets
    part_dw = None if dw_target is None else (None, dw_target[1][rows], dw_target[2])
    part_db = None if db_target is None else (None, db_target[1][rows], db_target[2])
    part_needs = (False, dw_target is not None, db_target is not None)
    mm, act_grad, bias_dtype = mm_backward_checked, activation_grad_prechecked, ctx.bias_dtype
    _, _, db = linear_grads(dy, x2d, part, None, None, part_needs, bias_dtype, mm, act_grad, part_dw, part_db)
    if part_db is not None and db is not part_db[1] and db is not None:
        if part_db[2]:
            part_db[1].add_(db)
        else:
            part_db[1].copy_(db)


def _handed_over(targets) -> tuple:
    """``(dw, db)`` as backward returns them: a flat view handed over to autograd
    (:func:`common.hand_over`), else the tensor the parts were written into."""
    return tuple(None if t is None else (common.hand_over(t) if t[0] is not None else t[1]) for t in targets)


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """``tkern.linear(x, weight, bias).split(sizes, -1)`` as one autograd node: one GEMM
    forward, whose (..., N) output the parts are views of (GPT-2's packed q, k, v), and a
    backward that takes the parts' gradients apart where autograd's split would first
    concatenate them into one (M, N) tensor: ``dX = sum_i dY_i @ W_i`` by the first dgrad GEMM
    writing dX and each next adding into it (fp32 inside, one rounding per GEMM), each part's
    dW and db by its own wgrad GEMM straight into its rows of one (N, K) / (N,) gradient (a
    fused optimizer's flat gradient view where it may, else one new tensor). A tracing, meta
    or subclass call, or an empty one, runs ``tkern.linear(...).split(...)``.

    Args:
        x: (..., K), fp16 or bf16.
        weight: (N, K) of ``x``'s dtype (a GPT-2 ``Conv1D``'s (K, N) weight as ``W.t()``).
        bias: None or an (N,) tensor of ``x``'s dtype or fp32.
        sizes: the parts' widths, summing to N.

    Returns:
        a tuple of (..., N_i) views of one output, one per size (in-place writes into them
        are refused, as for ``Tensor.split``'s).
    """
    sizes = tuple(sizes)
    if sum(sizes) != weight.shape[0] or any(n <= 0 for n in sizes):
        raise ValueError(f"sizes must be positive and sum to weight's N ({weight.shape[0]}), got {sizes}")
    if not (linear_args_plainly_valid(x, weight, bias, None) or check_linear_args(x, weight, bias, None)):
        return linear(x, weight, bias).split(sizes, -1)
    if weight.shape[1] == 0:
        return linear(x, weight, bias).split(sizes, -1)
    ys = _SplitLinear.apply(x, weight, bias, sizes)
    if x.dim() == 2:
        return tuple(ys)
    return tuple(y.reshape(*x.shape[:-1], y.shape[1]) for y in ys)
