"""The MX family's custom ops: the casts of tkern.kernels.mx as ``torch.library`` ops.

torch.compile treats each as an opaque op with known output shapes (their fake
implementations below); eager calls on plain tensors run the launchers directly. ``tkern.to_mx``
is :func:`to_mx` here: the op while compiling and on a meta tensor or a subclass
(``ops.common.launches_directly``: a FakeTensor, a DTensor), the launcher otherwise.
"""

from __future__ import annotations

import torch

from tkern.kernels import mx
from tkern.ops.common import launches_directly

__all__ = ["to_mx", "to_mx_both"]

_E8M0 = torch.float8_e8m0fnu


@torch.library.custom_op("tkern::to_mx", mutates_args=())
def _to_mx_op(
    x: torch.Tensor, dtype: torch.dtype, block_size: int, axis: int, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.mx.to_mx`."""
    return mx.to_mx(x, dtype, block_size=block_size, axis=axis, scale_mode=scale_mode)


@_to_mx_op.register_fake
def _(x, dtype, block_size, axis, scale_mode):
    shape = list(x.shape)
    shape[axis] //= block_size
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(shape, dtype=_E8M0)


@torch.library.custom_op("tkern::to_mx_both", mutates_args=())
def _to_mx_both_op(
    x: torch.Tensor, dtype: torch.dtype, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.mx.to_mx_both`."""
    return mx.to_mx_both(x, dtype, scale_mode=scale_mode)


@_to_mx_both_op.register_fake
def _to_mx_both_fake(x, dtype, scale_mode):
    m, k = x.shape
    b = mx.BLOCK_SIZE
    return (
        x.new_empty((m, k), dtype=dtype),
        x.new_empty((m, k // b), dtype=_E8M0),
        x.new_empty((k, m), dtype=dtype),
        x.new_empty((k, m // b), dtype=_E8M0),
    )


@torch.library.custom_op("tkern::to_mx_both_sum", mutates_args=())
def _to_mx_both_sum_op(
    x: torch.Tensor, dtype: torch.dtype, scale_mode: str, sum_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.mx.to_mx_both_sum`."""
    return mx.to_mx_both_sum(x, dtype, scale_mode=scale_mode, sum_dtype=sum_dtype)


@_to_mx_both_sum_op.register_fake
def _(x, dtype, scale_mode, sum_dtype):
    return (*_to_mx_both_fake(x, dtype, scale_mode), x.new_empty((x.shape[1],), dtype=sum_dtype))


def to_mx(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block_size: int = mx.BLOCK_SIZE,
    axis: int = -1,
    scale_mode: str = "floor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.mx.to_mx` (see there), traceable by torch.compile; a meta ``x``
    gives meta outputs of the cast's shapes and dtypes."""
    if not launches_directly(x):
        mx.check_to_mx_args(x, dtype, block_size, axis, scale_mode)
        return _to_mx_op(x, dtype, block_size, axis % x.dim(), scale_mode)
    return mx.to_mx(x, dtype, block_size=block_size, axis=axis, scale_mode=scale_mode)


def to_mx_both(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, scale_mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.mx.to_mx_both` (see there), traceable by torch.compile; a meta
    ``x`` gives meta outputs of the casts' shapes and dtypes."""
    if not launches_directly(x):
        mx.check_to_mx_both_args(x, dtype, scale_mode)
        return _to_mx_both_op(x, dtype, scale_mode)
    return mx.to_mx_both(x, dtype, scale_mode=scale_mode)
