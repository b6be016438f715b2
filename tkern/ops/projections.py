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

from tkern.kernels.gemm import linear_prechecked
from tkern.ops import common
from tkern.ops.common import as_2d
from tkern.ops.linear import check_linear_args, dgrad_into, differentiable_grads, layer_grads, linear

__all__ = ["shared_input_linears"]


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
