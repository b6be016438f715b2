"""``tkern.nn.Linear`` and transformers' GPT-2 ``Conv1D`` on tkern's GEMM."""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.activation import check_activation
from tkern.ops.linear import linear

__all__ = ["Linear", "conv1d_class", "hf_conv1d", "linear_forward"]


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`tkern.linear` (fp32-accumulated GEMMs,
    bias and activation fused into the GEMM's epilogue).

    Parameters have the names and the initialisation of ``nn.Linear``: they are
    drawn in fp32 exactly as ``nn.Linear`` draws them, then cast to ``dtype``.
    A floating-point input of another dtype is cast to the weight's dtype first,
    as ``torch.autocast`` would. ``in_features=0`` gives ``act(bias)``, as
    ``nn.Linear``; on the meta device the forward returns a meta tensor of the
    right shape and dtype.

    Args:
        in_features: K.
        out_features: N.
        bias: whether to learn an additive bias.
        activation: None, ``"relu"``, ``"gelu"`` (erf form), ``"silu"`` or
            ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``), fused into the epilogue.
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
        with warnings.catch_warnings():
            # nn.Linear(0, n) warns that initialising its empty weight does nothing; so does ours
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self.to(dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}, dtype={self.weight.dtype}"


def linear_forward(module: Linear, x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``module``'s forward with ``activation`` in the GEMM's epilogue (its own, or
    the one a fused activation module after it computes: see
    :class:`tkern.nn.fusion.FusedSequentialForward`)."""
    weight = module.weight
    if x.is_floating_point() and x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    return linear(x, weight, module.bias, activation)


def _conv1d_forward(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``Conv1D`` (``x @ weight + bias``, weight stored (in, out))
    on :func:`tkern.linear`: the transposed weight is read in place."""
    weight = self.weight
    if x.is_floating_point() and x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    return linear(x, weight.t(), self.bias)


def hf_conv1d() -> type | None:
    """transformers' ``Conv1D`` class when transformers is imported, else None
    (tkern never imports transformers itself)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


_CONV1D: type | None = None


def conv1d_class(create: bool = True) -> type | None:
    """``tkern.nn.Conv1D``: a subclass of transformers' ``Conv1D`` whose forward runs
    on :func:`tkern.linear`, made on first use (it exists only where transformers
    is importable) and found by pickle as ``tkern.nn.Conv1D``. ``create=False``:
    None until then."""
    global _CONV1D
    if _CONV1D is None and create:
        from transformers.pytorch_utils import Conv1D as HFConv1D

        _CONV1D = type(
            "Conv1D",
            (HFConv1D,),
            {
                "__module__": "tkern.nn",
                "__qualname__": "Conv1D",
                "__doc__": "transformers' GPT-2 ``Conv1D`` (a Linear with a transposed weight) "
                "whose forward runs on :func:`tkern.linear`; same parameters, names and shapes.",
                "forward": _conv1d_forward,
            },
        )
    return _CONV1D
