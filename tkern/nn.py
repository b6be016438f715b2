"""Modules built on tkern's kernels."""

from __future__ import annotations

import torch
from torch import nn

from tkern.functional import linear
from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.gemm import check_activation

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`tkern.linear` (fp32-accumulated GEMMs,
    bias and activation fused into the GEMM's epilogue).

    Parameters have the names and the initialisation of ``nn.Linear``: they are
    drawn in fp32 exactly as ``nn.Linear`` draws them, then cast to ``dtype``.
    A floating-point input of another dtype is cast to the weight's dtype first,
    as ``torch.autocast`` would.

    Args:
        in_features: K.
        out_features: N.
        bias: whether to learn an additive bias.
        activation: None, ``"relu"`` or ``"gelu"``, fused into the epilogue.
        dtype: fp16 (default) or bf16.
        device: where the parameters live.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        check_activation(activation)
        if dtype not in HALF_DTYPES:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self.to(dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}, dtype={self.weight.dtype}"
