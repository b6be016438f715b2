"""What :func:`tkern.ops.float8.float8_linear` checks of its fp8 arguments before anything
is launched: delayed scaling's histories, margin and counters, and the casts made elsewhere
(the weight's, by the optimizer's step; the input's, by its producer: :class:`Float8Input`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from tkern.device import DeviceSpec
from tkern.kernels._common import (
    HALF_DTYPES,
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
)
from tkern.kernels.activation import check_activation
from tkern.kernels.float8 import native_formats, native_formats_of

__all__ = [
    "CACHED_SCALINGS",
    "WEIGHT_CACHE_SCALINGS",
    "Float8Input",
    "check_activation_args",
    "check_delayed_args",
    "check_gemm_reach",
    "check_weight_fp8",
    "check_x_fp8",
    "recipe_formats",
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

#: The recipes whose weight cast a :class:`~tkern.ops.float8.Float8WeightCache` holds (and
#: whose input a producer may cast: :class:`Float8Input`).
CACHED_SCALINGS = ("tensorwise", "delayed")
#: the recipes whose weight cast a fused optimizer's step writes (Float8WeightCache): the
#: per-tensor ones and "mxfp8" (its two casts, along K and along N, depend on the weight alone)
WEIGHT_CACHE_SCALINGS = (*CACHED_SCALINGS, "mxfp8")

#: The fp8 formats each recipe casts to: e4m3 for x and W, e5m2 for dY (tensorwise,
#: delayed); e4m3 everywhere (blockwise). What the device check holds the GPU to.
RECIPE_FORMATS = {
    "tensorwise": (E4M3, E5M2),
    "delayed": (E4M3, E5M2),
    "blockwise": (E4M3,),
    "mxfp8": (E4M3,),  # e5m2 too with Float8Recipe(grad_dtype=torch.float8_e5m2)
}


def recipe_formats(
    scaling: str, where: DeviceSpec | torch.device | str | None = None
) -> tuple[torch.dtype, ...]:
    """The fp8 dtypes recipe ``scaling`` casts to on ``where``, a device or a GPU's
    :class:`~tkern.DeviceSpec` (:data:`RECIPE_FORMATS` in that GPU's native formats: FNUZ on
    a gfx942; as named for None and the CPU; MX elements stay OCP, the MX spec's); none
    for a name it does not know, which the recipe's own check refuses."""
    formats = RECIPE_FORMATS.get(scaling, ())
    if scaling == "mxfp8" or where is None:
        return formats
    if isinstance(where, DeviceSpec):
        return native_formats_of(where, formats)
    return native_formats(where, formats)


class Float8Input(NamedTuple):
    """An fp8 GEMM input already cast by the op that produced it (a norm's fp8 output,
    :func:`tkern.ops.norm.norm_float8`): :func:`float8_linear`'s ``x_fp8``. Per tensor,
    e4m3, exactly the cast the layer would make of x (``cast_2d`` under the layer's recipe)."""

    data: torch.Tensor  # (M, K) e4m3, contiguous: x's cast (x as (M, K) rows)
    data_t: torch.Tensor | None  # (K, M) e4m3, contiguous: the same values transposed (wgrad's operand)
    scale: torch.Tensor  # 0-dim (or one-element) fp32: x ~ data * scale


#: Every scaling float8_linear takes ("mxfp8": tkern.ops.float8_mx).
SCALINGS = ("tensorwise", "delayed", "blockwise", "mxfp8")


def check_scaling(scaling: object) -> None:
    """Raise ``ValueError`` unless ``scaling`` is one of :data:`SCALINGS`."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")


def check_activation_args(activation: str | None, scaling: str, dtype: torch.dtype) -> None:
    """Raise unless ``activation`` is None or one the fp8 GEMM's epilogue computes for a
    layer of ``dtype`` under ``scaling``: per-tensor recipes (the blockwise kernel has no
    activation epilogue), bf16 / fp16 (the pre-activation's gradient kernel takes those)."""
    check_activation(activation)
    if activation is None:
        return
    if scaling not in CACHED_SCALINGS:
        raise ValueError(
            f'activation runs in the fp8 GEMM\'s epilogue under "tensorwise" or "delayed", not "{scaling}"'
        )
    if dtype not in HALF_DTYPES:
        raise TypeError(f"activation needs a bf16 or fp16 layer (its pre-activation's dtype), got {dtype}")


def check_delayed_args(histories, margin, counters, weight: torch.Tensor) -> None:
    """``"delayed"``'s (input, weight, grad_output) amax histories, margin and (3,) counters."""
    if histories is None or len(histories) != 3:
        raise ValueError('scaling="delayed" needs histories=(input, weight, grad_output) amax histories')
    for name, h in zip(("input", "weight", "grad_output"), histories, strict=True):
        check_tensor(f"histories ({name})", h, ndim=1, dtypes=(torch.float32,))
        if h.numel() < 1 or not h.is_contiguous() or h.device != weight.device:
            raise ValueError(
                f"histories ({name}) must be a contiguous (H,) fp32 tensor with H >= 1 on "
                f"{weight.device}, got shape {tuple(h.shape)} on {h.device}"
            )
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    if counters is not None:
        check_tensor("counters", counters, ndim=1, dtypes=(torch.int32,))
        if counters.shape != (3,) or counters.device != weight.device:
            raise ValueError(f"counters must be a (3,) int32 tensor on {weight.device}")


def check_gemm_reach(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the int32 offsets of a layer's three fp8 GEMMs (forward,
    dgrad, wgrad) reach every element they read and write: x as its (M, K) rows, the
    weight (N, K) and the output (M, N), each as the contiguous casts the GEMMs take."""
    n, k = weight.shape
    m = math.prod(x.shape[:-1])
    check_int32_elements("x", (m, k))
    check_int32_elements("weight", (n, k))
    check_int32_elements("output", (m, n))


def check_x_fp8(x_fp8, x: torch.Tensor, weight: torch.Tensor, scaling: str, e4m3: torch.dtype = E4M3) -> None:
    """float8_linear's ``x_fp8`` against x (as (M, K) rows), the scaling and the device's
    e4m3 format ``e4m3``."""
    if scaling not in CACHED_SCALINGS:
        raise ValueError(f'x_fp8 is a tensorwise or delayed cast; scaling is "{scaling}"')
    if not isinstance(x_fp8, Float8Input):
        raise TypeError(f"x_fp8 must be a Float8Input, got {type(x_fp8).__name__}")
    k = weight.shape[1]
    m = x.numel() // k if k else 0
    data, data_t, scale = x_fp8
    check_tensor("x_fp8 data", data, ndim=2, dtypes=(e4m3,))
    check_tensor("x_fp8 scale", scale, dtypes=(torch.float32,))
    if data.shape != (m, k) or not data.is_contiguous() or scale.numel() != 1:
        raise ValueError(
            f"x_fp8 must hold x's ({m}, {k}) e4m3 cast, contiguous, and a one-element scale, got "
            f"shapes {tuple(data.shape)} (contiguous: {data.is_contiguous()}) and {tuple(scale.shape)}"
        )
    if data_t is not None:
        check_tensor("x_fp8 data_t", data_t, ndim=2, dtypes=(e4m3,))
        if data_t.shape != (k, m) or not data_t.is_contiguous():
            raise ValueError(
                f"x_fp8 data_t must be the ({k}, {m}) e4m3 transpose, contiguous, got shape "
                f"{tuple(data_t.shape)} (contiguous: {data_t.is_contiguous()})"
            )
    check_same_device(x=x, x_fp8=data, x_fp8_scale=scale, x_fp8_t=data_t)


def check_weight_fp8(
    weight_fp8: tuple, weight: torch.Tensor, scaling: str, weight_fp8_t, e4m3: torch.dtype = E4M3
) -> None:
    """float8_linear's ``weight_fp8`` against the weight, the scaling and the device's e4m3
    format ``e4m3``."""
    parts = {"tensorwise": ("data", "scale"), "delayed": ("data", "scale", "amax")}.get(scaling)
    if parts is None:
        raise ValueError(f'weight_fp8 is a tensorwise or delayed cast; scaling is "{scaling}"')
    if not isinstance(weight_fp8, (tuple, list)) or len(weight_fp8) != len(parts):
        raise ValueError(f'weight_fp8 must be ({", ".join(parts)}) under scaling="{scaling}"')
    wq, sw, *amax = weight_fp8
    check_tensor("weight_fp8 data", wq, dtypes=(e4m3,))
    check_int32_addressable("weight_fp8 data", wq)  # the GEMMs read it with int32 offsets
    check_tensor("weight_fp8 scale", sw, dtypes=(torch.float32,))
    if wq.shape != weight.shape or sw.numel() != 1 or wq.device != weight.device:
        raise ValueError(
            f"weight_fp8 must be the ({tuple(weight.shape)}) e4m3 weight and a one-element scale on "
            f"{weight.device}, got shapes {tuple(wq.shape)} and {tuple(sw.shape)} on {wq.device}"
        )
    if weight_fp8_t is not None:
        check_tensor("weight_fp8_t", weight_fp8_t, ndim=2, dtypes=(e4m3,))
        check_int32_addressable("weight_fp8_t", weight_fp8_t)
        if weight_fp8_t.shape != weight.shape[::-1] or weight_fp8_t.stride(1) != 1:
            raise ValueError(
                f"weight_fp8_t must be the ({weight.shape[1]}, {weight.shape[0]}) e4m3 transpose, "
                f"contiguous, got shape {tuple(weight_fp8_t.shape)}, strides {weight_fp8_t.stride()}"
            )
    if amax and amax[0] is not None:
        check_tensor("weight_fp8 amax", amax[0], ndim=1, dtypes=(torch.float32,))
        if amax[0].numel() < 1 or not amax[0].is_contiguous() or amax[0].device != weight.device:
            raise ValueError(
                f"weight_fp8 amax must be a contiguous (P,) fp32 tensor with P >= 1 on {weight.device}, "
                f"got shape {tuple(amax[0].shape)} on {amax[0].device}"
            )
