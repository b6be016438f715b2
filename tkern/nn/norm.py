"""``tkern.nn.LayerNorm`` and ``tkern.nn.RMSNorm``: torch's norm modules on tkern's
norm kernels (fp32 statistics and parameters, 16-bit input and output)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.ops.norm import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


def _fp32_kept(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` for ``module._apply(fn)``, with the module's fp32 parameters kept fp32 where ``fn`` would
    make them 16-bit (``model.half()``, ``model.to(torch.bfloat16)``); a device move
    still applies. The mixed-precision rule: norm layers keep fp32 parameters."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if t.dtype == torch.float32 and out.dtype in HALF_DTYPES:
            return t.to(out.device)
        return out

    return keep


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in (*HALF_DTYPES, torch.float32):
        raise TypeError(f"dtype must be None, torch.float32, float16 or bfloat16, got {dtype}")


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose forward is :func:`tkern.layer_norm`: statistics and
    normalization in fp32 on the input as it comes (fp16, bf16 or fp32), the
    output in the input's dtype, backward saving the input and fp32 mean / rstd.

    Same arguments, parameters and state_dict keys as ``nn.LayerNorm``. The
    parameters are fp32 and stay fp32 when the model is cast to 16 bits
    (``model.half()``); a 16-bit ``dtype`` argument gives fp32 parameters too.
    ``convert_network(..., norm_dtype=dtype)`` stores them in 16 bits instead (FSDP2's one
    dtype per unit); the kernel then still computes in fp32 and sums their gradients in fp32.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _check_dtype(dtype)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=torch.float32)

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        return super()._apply(_fp32_kept(fn), recurse)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose forward is :func:`tkern.rms_norm` (``eps=None``: fp32's
    machine epsilon, as torch's); parameters as :class:`LayerNorm`'s."""

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _check_dtype(dtype)
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=torch.float32)

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        return super()._apply(_fp32_kept(fn), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)
