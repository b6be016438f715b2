"""Losses on tkern's cross-entropy kernel: ``CrossEntropyLoss`` (a drop-in for
torch's) and ``LinearCrossEntropy`` (an output layer and its loss in one module,
never materializing the logits)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.ops.cross_entropy import cross_entropy, linear_cross_entropy

__all__ = ["CrossEntropyLoss", "LinearCrossEntropy"]


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss`` on :func:`tkern.cross_entropy`: the loss in fp32 from
    fp16/bf16/fp32 logits without an fp32 copy of them, the gradient in the logits'
    dtype. Same arguments, buffers and state_dict as torch's, plus ``z_loss`` and
    ``softcap`` (see :func:`tkern.cross_entropy`). Class-index targets only."""

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
    ) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss = z_loss
        self.softcap = softcap

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(
            input,
            target,
            self.weight,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
        )

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, z_loss={self.z_loss}, softcap={self.softcap}"


class LinearCrossEntropy(nn.Module):
    """An output layer and its cross-entropy: ``forward(input, target)`` is
    ``cross_entropy(input @ weight.T + bias, target)`` by :func:`tkern.linear_cross_entropy`
    (chunked rows; no (tokens x classes) tensor in forward or backward).

    ``weight`` (num_classes, in_features) and ``bias`` are named, shaped and
    initialised as ``nn.Linear``'s (drawn in fp32, then cast to ``dtype``), so the
    state_dict of a model's head loads into it. ``convert_network`` casts them to its
    dtype like a Linear's.

    Args:
        in_features: H.
        num_classes: V.
        bias: whether to learn an additive bias.
        class_weight: optional (V,) class weights (a buffer; ``weight`` of ``F.cross_entropy``).
        ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_size: as
            :func:`tkern.linear_cross_entropy` (``softcap``: Gemma 2's final-logit
            softcapping, ``c * tanh(logits / c)`` before the loss).
        dtype: fp16, bf16 (tkern's GEMM) or fp32 (torch's); default fp32, as ``nn.Linear``.
        device: where the parameters live.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        class_weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        chunk_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in (*HALF_DTYPES, torch.float32):
            raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            head = nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=torch.float32)
        self.in_features, self.num_classes = in_features, num_classes
        self.weight = nn.Parameter(head.weight.detach().to(dtype))
        self.bias = nn.Parameter(head.bias.detach().to(dtype)) if bias else None
        if class_weight is not None:
            class_weight = class_weight.detach().to(device=self.weight.device, dtype=torch.float32)
        self.register_buffer("class_weight", class_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.chunk_size = z_loss, softcap, chunk_size

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.is_floating_point() and input.dtype != self.weight.dtype:
            input = input.to(self.weight.dtype)  # as tkern.nn.Linear (and autocast) do
        return linear_cross_entropy(
            input,
            self.weight,
            target,
            linear_bias=self.bias,
            weight=self.class_weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}, "
            f"reduction={self.reduction!r}, dtype={self.weight.dtype}"
            + ("" if self.softcap is None else f", softcap={self.softcap}")
        )
