"""Autograd functions built on the kernels."""

from __future__ import annotations

import torch

from tkern.kernels._common import HALF_DTYPES, check_same_device, check_tensor
from tkern.kernels.activation import activation_grad
from tkern.kernels.gemm import check_activation, check_bias, matmul

__all__ = ["linear", "matmul"]


class _Linear(torch.autograd.Function):
    """y = act(x @ W^T + b); every product through :func:`tkern.matmul`."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        n, k = weight.shape
        x2d = x.reshape(-1, k)
        needs_grad = any(ctx.needs_input_grad[:3])
        preact = None
        if activation is not None and needs_grad:
            preact = torch.empty((x2d.shape[0], n), dtype=x.dtype, device=x.device)
        y = matmul(x2d, weight.t(), bias=bias, activation=activation, preact=preact)
        ctx.activation = activation
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x2d, weight, preact)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, preact = ctx.saved_tensors
        n, k = weight.shape
        dz = dy.reshape(-1, n)
        if ctx.activation is not None:
            dz = activation_grad(dz, preact, ctx.activation)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = matmul(dz, weight).reshape(*dy.shape[:-1], k)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            dw = matmul(dz.t(), x2d)  # (N, M) @ (M, K), dz^T read in place
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dz.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` like ``torch.nn.functional.linear``, differentiable.

    Forward and backward run on :func:`tkern.matmul` with fp32 accumulation:
    dgrad ``dY @ W``, wgrad ``dY^T @ X``, dbias summed in fp32, the activation's
    gradient applied in fp32 from the pre-activation saved by the forward pass.

    Args:
        x: (..., K), fp16 or bf16.
        weight: (N, K), same dtype as ``x``.
        bias: optional (N,), ``x``'s dtype or fp32.
        activation: None, ``"relu"`` or ``"gelu"``.

    Returns:
        (..., N) tensor of ``x``'s dtype.
    """
    check_tensor("weight", weight, ndim=2, dtypes=HALF_DTYPES)
    check_tensor("x", x, dtypes=(weight.dtype,))
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must have shape (..., {weight.shape[1]}) to match weight of shape "
            f"{tuple(weight.shape)} (N, K), got shape {tuple(x.shape)}"
        )
    check_bias(bias, weight.shape[0], weight.dtype)
    check_activation(activation)
    check_same_device(x=x, weight=weight, bias=bias)
    return _Linear.apply(x, weight, bias, activation)
