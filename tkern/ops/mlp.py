"""Two linears with an activation between them as one autograd function, for the MLP
blocks :mod:`tkern.nn.fusion` converts (GPT-2's ``c_proj(gelu_tanh(c_fc(x)))``):

``y = act(x @ W1^T + b1) @ W2^T + b2``, forward as two GEMMs (the first with the
activation in its epilogue, storing the pre-activation Z), backward with the second
layer's dgrad producing the first layer's gradient dZ directly:
``dZ = (dY @ W2) * act'(Z)`` in that GEMM's epilogue (``gemm.matmul_grad_act``: fp32
inside, one rounding), so no pass over dH applies act' and the first layer's dgrad and
wgrad read dZ as plain operands (no prologue). The same Parameters as two
:func:`tkern.linear` calls; a tracing, meta or subclass call runs those two calls.
"""

from __future__ import annotations

import math

import torch

from tkern.kernels._common import (
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
)
from tkern.kernels.activation import GRAD_FROM_OUTPUT, activation_grad_prechecked
from tkern.kernels.gemm import linear_prechecked, matmul_grad_act_prechecked
from tkern.kernels.gemm_epilogue import check_bias
from tkern.ops import common
from tkern.ops.common import as_2d
from tkern.ops.linear import (
    check_linear_args,
    differentiable_grads,
    linear,
    linear_grads,
    mm_backward_checked,
)

__all__ = ["linear_act_linear"]


class _LinearActLinear(torch.autograd.Function):
    """y = act(x @ W1^T + b1) @ W2^T + b2 as (M, N2); see the module's docstring."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation):
        x2d = x if x.dim() == 2 else as_2d(x, w1.shape[1])
        save_z = any(ctx.needs_input_grad[:3])
        from_output = activation in GRAD_FROM_OUTPUT  # ReLU: act'(Z) from H, the same mask
        preact = None
        if save_z and not from_output:
            preact = torch.empty(x2d.shape[0], w1.shape[0], dtype=x.dtype, device=x.device)
        h = linear_prechecked(x2d, w1, b1, activation, preact)
        y = linear_prechecked(h, w2, b2, None, None)
        ctx.activation = activation
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (b1, b2))
        ctx.x_shape = x.shape if x2d is not x else None
        ctx.save_for_backward(x2d, w1, b1, h if from_output else preact, h, w2, b2)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, w1, b1, z, h, w2, b2 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        bias1, bias2 = ctx.bias_dtypes
        if torch.is_grad_enabled():  # create_graph=True: the layers' differentiable gradients
            dh, dw2, db2 = differentiable_grads(dy, h, w2, b2, None, (any(needs[:3]), *needs[3:5]), bias2)
            dx = dw1 = db1 = None
            if dh is not None:
                dx, dw1, db1 = differentiable_grads(dh, x2d, w1, b1, ctx.activation, needs[:3], bias1)
        else:
            _, dw2, db2 = _layer_grads(ctx, dy, h, w2, (False, *needs[3:5]), bias2, 3)
            dx = dw1 = db1 = None
            if any(needs[:3]):  # dZ straight from the second layer's dgrad epilogue
                dz = matmul_grad_act_prechecked(dy, w2, z, ctx.activation)
                dx, dw1, db1 = _layer_grads(ctx, dz, x2d, w1, needs[:3], bias1, 1)
        if dx is not None and ctx.x_shape is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw1, db1, dw2, db2, None


def _layer_grads(ctx, dy, x2d, weight, needs, bias_dtype, index):
    """One layer's (dx, dw, db) from its output gradient (no activation of its own):
    ``linear_grads``, with dW put into a flat gradient buffer where it may (input ``index``)."""
    target = common.flat_wgrad(ctx, x2d.dtype, weight, index) if needs[1] else None
    mm, act_grad = mm_backward_checked, activation_grad_prechecked  # tensors autograd and forward made
    dx, dw, db = linear_grads(dy, x2d, weight, None, None, needs, bias_dtype, mm, act_grad, target)
    if target is not None:
        dw = common.hand_over(target)
    return dx, dw, db


def _check_second(x, w1, w2, b2) -> None:
    """Raise unless ``w2`` (N2, N1) and ``b2`` can follow ``w1`` (N1, K) on ``x``'s device."""
    check_tensor("w2", w2, ndim=2, dtypes=(w1.dtype,))
    if w2.shape[1] != w1.shape[0]:
        raise ValueError(f"w2 must have shape (N2, {w1.shape[0]}) to follow w1, got {tuple(w2.shape)}")
    check_bias(b2, w2.shape[0], w2.dtype)
    check_same_device(x=x, w2=w2, b2=b2)
    check_int32_addressable("w2", w2)
    check_int32_elements("output", (math.prod(x.shape[:-1]), w2.shape[0]))


def linear_act_linear(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    activation: str,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
) -> torch.Tensor:
    """``linear(linear(x, w1, b1, activation), w2, b2)`` with the activation's gradient
    in the second layer's dgrad epilogue (see the module's docstring).

    Args:
        x: (..., K), fp16 or bf16.
        w1: (N1, K), ``x``'s dtype; b1: optional (N1,), ``x``'s dtype or fp32.
        activation: an activation :func:`tkern.linear` takes, other than None.
        w2: (N2, N1), ``x``'s dtype, any strides; b2: optional (N2,).

    Returns:
        (..., N2) tensor of ``x``'s dtype.
    """
    if activation is None:
        raise ValueError("linear_act_linear needs an activation, got None")
    eager = check_linear_args(x, w1, b1, activation)
    _check_second(x, w1, w2, b2)
    if not eager or w1.shape[1] == 0 or w1.shape[0] == 0:  # traced, meta, subclass, empty: two calls
        return linear(linear(x, w1, b1, activation), w2, b2)
    y = _LinearActLinear.apply(x, w1, b1, w2, b2, activation)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w2.shape[0])
