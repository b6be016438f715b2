"""The MXFP8 recipe of Float8Linear: every GEMM on e8m0-scaled fp8 blocks of 32 along its K.

MX scales must run along each GEMM's reduction, so each tensor is cast along two axes
(torchao's MXFP8 training does the same):

* forward ``y = x W^T``: x and W scaled along in_features (K);
* dgrad ``dX = dY W``: dY and W scaled along out_features (N);
* wgrad ``dW = dY^T x``: dY and x scaled along the tokens (M).

Each tensor's two casts come from one read of it (tkern.kernels.mx.to_mx_both): x's in
the forward (along K, and along M stored as x^T for wgrad), W's in the forward (along K,
and along N stored as W^T for dgrad), dY's in the backward (along N, and along M stored
as dY^T). A step is then three Triton launches forward (two casts, one GEMM) and three
backward (one cast, which also sums dY's columns for the bias gradient, two GEMMs); only
the cast's per-tile partial sums (M / 32 rows) are added up by torch. The weight's two
casts are written by a fused optimizer's step (tkern.ops.float8_cache.Float8WeightCache,
given as ``weight_fp8``); without it the forward casts the weight. e4m3 everywhere by default;
``grad_dtype=torch.float8_e5m2`` casts dY to e5m2.
"""

from __future__ import annotations

import torch

from tkern.kernels.gemm_mx import check_mx_device, scaled_mm_mx
from tkern.kernels.mx import BLOCK_SIZE, SCALE_MODES, check_mx_pair, to_mx, to_mx_both, to_mx_both_sum
from tkern.ops import mx as _mx_ops  # noqa: F401 (registers tkern::to_mx, to_mx_both, to_mx_both_sum)
from tkern.ops.common import as_2d, launches_directly

__all__ = ["MX_GRAD_DTYPES", "MX_SCALE_MODE", "check_mx_linear", "check_mx_weight_fp8", "mx_float8_linear"]

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
#: What dY may be cast to.
MX_GRAD_DTYPES = (E4M3, E5M2)
#: the scale rule of Float8Linear's MX casts (tkern.kernels.mx: torchao's default)
MX_SCALE_MODE = "floor"


# The casts and GEMM: the launchers on plain tensors (tkern.kernels.mx's, gemm_mx's), the
# custom ops (tkern.ops.mx's, tkern.ops.float8's) while tracing or on any other tensor
# (common.launches_directly, decided once per forward and once per backward): inside an
# autograd.Function a compiled graph may not read a tensor's layout, which the launchers'
# checks do (the layer's arguments are checked once, before the Function).


def _scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, eager):
    """tkern.scaled_mm with MX scales."""
    if eager:
        return scaled_mm_mx(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    return torch.ops.tkern.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, [], [], False)[0]


def _both(t, dtype, scale_mode, eager):
    """tkern.kernels.mx.to_mx_both: (data, scales, data_t, scales_t)."""
    if eager:
        return to_mx_both(t, dtype, scale_mode=scale_mode)
    return torch.ops.tkern.to_mx_both(t, dtype, scale_mode)


def _both_sum(t, dtype, scale_mode, sum_dtype, eager):
    """tkern.kernels.mx.to_mx_both_sum: :func:`_both`'s four and t.sum(0) in ``sum_dtype``."""
    if eager:
        return to_mx_both_sum(t, dtype, scale_mode=scale_mode, sum_dtype=sum_dtype)
    return torch.ops.tkern.to_mx_both_sum(t, dtype, scale_mode, sum_dtype)


def _along_k(t, scale_mode, eager):
    """tkern.kernels.mx.to_mx along dim 1 in e4m3: (data, scales)."""
    if eager:
        return to_mx(t, E4M3, block_size=BLOCK_SIZE, axis=1, scale_mode=scale_mode)
    return torch.ops.tkern.to_mx(t, E4M3, BLOCK_SIZE, 1, scale_mode)


class _MxFloat8Linear(torch.autograd.Function):
    """y = x @ W^T + b with MX fp8 GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype, scale_mode, grad_enabled, cached):
        n, k = weight.shape
        x2d = as_2d(x, k)
        dgrad = grad_enabled and ctx.needs_input_grad[0]
        wgrad = grad_enabled and ctx.needs_input_grad[1]
        eager = launches_directly(x) and launches_directly(weight)
        if wgrad:  # x along K, and along the tokens (x^T, wgrad's K-major operand): one read
            xq, sx, xq_t, sx_t = _both(x2d, E4M3, scale_mode, eager)
        else:
            (xq, sx), xq_t, sx_t = _along_k(x2d, scale_mode, eager), None, None
        if cached is not None:  # the optimizer's step cast W both ways (Float8WeightCache)
            wq, sw, wq_t, sw_t = cached
        elif dgrad:  # W along K, and along out_features (W^T, dgrad's K-major operand)
            wq, sw, wq_t, sw_t = _both(weight, E4M3, scale_mode, eager)
        else:
            (wq, sw), wq_t, sw_t = _along_k(weight, scale_mode, eager), None, None
        y = _scaled_mm(xq, wq.t(), sx, sw, bias, x.dtype, eager)
        ctx.save_for_backward(xq_t, sx_t, wq_t, sw_t)
        ctx.grad_dtype, ctx.scale_mode, ctx.x_shape = grad_dtype, scale_mode, x.shape
        ctx.w_dtype, ctx.x_dtype = weight.dtype, x.dtype
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[2]
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        xq_t, sx_t, wq_t, sw_t = ctx.saved_tensors
        dy2d = as_2d(dy, dy.shape[-1])
        dgrad, wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        eager = all(launches_directly(t) for t in (dy, *ctx.saved_tensors) if t is not None)
        # dY along out_features (dgrad) and along the tokens (dY^T, wgrad), and with a bias
        # its column sums (the bias gradient): one read
        if ctx.bias_grad:
            gq, sg, gq_t, sg_t, db = _both_sum(dy2d, ctx.grad_dtype, ctx.scale_mode, ctx.w_dtype, eager)
        else:
            (gq, sg, gq_t, sg_t), db = _both(dy2d, ctx.grad_dtype, ctx.scale_mode, eager), None
        if dgrad:  # (M, N) @ (N, K), reduced over N
            dx = _scaled_mm(gq, wq_t.t(), sg, sw_t, None, ctx.x_dtype, eager).reshape(ctx.x_shape)
        if wgrad:  # (N, M) @ (M, K), reduced over the tokens
            dw = _scaled_mm(gq_t, xq_t.t(), sg_t, sx_t, None, ctx.w_dtype, eager)
        return dx, dw, db, None, None, None, None


def check_mx_linear(x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype, scale_mode: str) -> None:
    """Raise unless :func:`mx_float8_linear` runs on these: in and out features and the
    tokens multiples of 32 (each is some GEMM's K), a known grad dtype and scale mode, a
    device with native MX."""
    n, k = weight.shape
    tokens = x.numel() // max(k, 1)
    for name, size in (("in_features", k), ("out_features", n), ("tokens (x's leading dimensions)", tokens)):
        if size % BLOCK_SIZE:
            raise ValueError(
                f"the mxfp8 recipe needs {name} a multiple of {BLOCK_SIZE} (it is a GEMM's K), got {size} "
                f"(x of shape {tuple(x.shape)}, weight {tuple(weight.shape)})"
            )
    if grad_dtype not in MX_GRAD_DTYPES:
        raise TypeError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    check_mx_device(x.device)


def check_mx_weight_fp8(weight_fp8: object, weight: torch.Tensor, weight_fp8_t: object) -> None:
    """Raise unless ``weight_fp8`` = (data (N, K) e4m3, scale (N, K/32) e8m0, scale_t (K, N/32)
    e8m0) and ``weight_fp8_t`` (K, N) e4m3 contiguous are W's two MX casts' shapes
    (``to_mx_both(W)``: ``data, scale`` and ``data_t, scale_t``) on W's device."""
    if not isinstance(weight_fp8, (tuple, list)) or len(weight_fp8) != 3 or weight_fp8_t is None:
        raise ValueError('weight_fp8 must be (data, scale, scale_t) and weight_fp8_t data_t under "mxfp8"')
    pair = (weight_fp8[0], weight_fp8[1], weight_fp8_t, weight_fp8[2])
    check_mx_pair("weight_fp8", pair, tuple(weight.shape), E4M3, weight.device)


def mx_float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    grad_dtype: torch.dtype = E4M3,
    scale_mode: str = MX_SCALE_MODE,
    weight_fp8: tuple | None = None,
    weight_fp8_t: torch.Tensor | None = None,
    unused: tuple = (),
) -> torch.Tensor:
    """``x @ weight.T + bias`` with MXFP8 GEMMs forward and backward (the module docstring);
    the arguments checked by the caller (tkern.ops.float8.float8_linear) and
    :func:`check_mx_linear`. ``weight_fp8`` = (data, scale, scale_t) and ``weight_fp8_t``:
    W's two casts made already (``to_mx_both(W)`` with ``scale_mode``, a Float8WeightCache's;
    :func:`check_mx_weight_fp8`), so the forward casts x alone. ``unused``: float8_linear's
    activation, emit_fp8 and x_fp8, which this recipe does not take (all must be None)."""
    if any(arg is not None for arg in unused):
        raise ValueError("the mxfp8 recipe takes no activation, emit_fp8 or x_fp8")
    check_mx_linear(x, weight, grad_dtype, scale_mode)
    cached = None
    if weight_fp8 is not None:
        check_mx_weight_fp8(weight_fp8, weight, weight_fp8_t)
        cached = (weight_fp8[0], weight_fp8[1], weight_fp8_t, weight_fp8[2])
    return _MxFloat8Linear.apply(x, weight, bias, grad_dtype, scale_mode, torch.is_grad_enabled(), cached)
