"""``tkern.nn.Linear`` and transformers' GPT-2 ``Conv1D`` on tkern's GEMM."""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.activation import check_activation
from tkern.ops.linear import linear

__all__ = ["Linear", "compute_operands", "conv1d_class", "conv1d_forward", "hf_conv1d", "linear_forward"]


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`tkern.linear` (fp32-accumulated GEMMs,
    bias and activation fused into the GEMM's epilogue).

    Parameters have the names and the initialisation of ``nn.Linear``: they are
    drawn in fp32 exactly as ``nn.Linear`` draws them, then cast to ``dtype``.
    A floating-point input of another dtype is cast to the compute dtype first,
    as ``torch.autocast`` would. The compute dtype is the weight's when it is
    fp16/bf16; an fp32 weight (``dtype=torch.float32``, e.g. under FSDP2's
    ``MixedPrecisionPolicy``, which hands the forward the weight in its
    ``param_dtype``) is cast to ``compute_dtype`` per forward, as autocast would,
    and its gradient arrives in fp32. The bias is used as it is (fp32 or the
    compute dtype). ``in_features=0`` gives ``act(bias)``, as
    ``nn.Linear``; on the meta device the forward returns a meta tensor of the
    right shape and dtype.

    Args:
        in_features: K.
        out_features: N.
        bias: whether to learn an additive bias.
        activation: None, ``"relu"``, ``"gelu"`` (erf form), ``"silu"`` or
            ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``), fused into the epilogue.
        dtype: the parameters' dtype: fp16 (default), bf16, or fp32 with a ``compute_dtype``.
        device: where the parameters live.
        compute_dtype: fp16 or bf16: what an fp32 weight is cast to per forward
            (required for fp32 parameters; default None: the weight's dtype).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        check_activation(activation)
        if dtype not in (*HALF_DTYPES, torch.float32):
            raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
        if compute_dtype is not None and compute_dtype not in HALF_DTYPES:
            raise TypeError(
                f"compute_dtype must be torch.float16, torch.bfloat16 or None, got {compute_dtype}"
            )
        if dtype == torch.float32 and compute_dtype is None:
            raise TypeError("fp32 parameters need a compute_dtype (torch.float16 or torch.bfloat16)")
        with warnings.catch_warnings():
            # nn.Linear(0, n) warns that initialising its empty weight does nothing; so does ours
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self.to(dtype)
        self.activation = activation
        #: What an fp32 weight is cast to per forward (None: the weight's own dtype).
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x, self.activation)

    def extra_repr(self) -> str:
        extra = f", compute_dtype={self.compute_dtype}" if getattr(self, "compute_dtype", None) else ""
        return f"{super().extra_repr()}, activation={self.activation}, dtype={self.weight.dtype}{extra}"


def linear_forward(module: Linear, x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``module``'s forward with ``activation`` in the GEMM's epilogue (its own, or
    the one a fused activation module after it computes: see
    :class:`tkern.nn.fusion.FusedSequentialForward`)."""
    x, weight = compute_operands(module, x, module.weight)
    return linear(x, weight, module.bias, activation)


def compute_operands(
    module: nn.Module, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, weight)`` in the dtype ``module`` computes in: the weight's when it is fp16/bf16
    (FSDP2's ``param_dtype`` all-gather included), else the module's ``compute_dtype``, the
    fp32 weight cast per forward as autocast would (``convert_network(...,
    keep_fp32_params=True)``); a floating-point ``x`` is cast to it."""
    dtype = weight.dtype
    if dtype not in HALF_DTYPES and getattr(module, "compute_dtype", None) is not None:
        dtype = module.compute_dtype
        weight = weight.to(dtype)
    if x.is_floating_point() and x.dtype != dtype:
        x = x.to(dtype)
    return x, weight


def conv1d_forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """transformers' ``Conv1D`` (``x @ weight + bias``, weight stored (in, out))
    on :func:`tkern.linear`: the transposed weight is read in place; ``activation``
    in the epilogue (GPT-2's MLP: :mod:`tkern.nn.fusion`)."""
    x, weight = compute_operands(self, x, self.weight)
    return linear(x, weight.t(), self.bias, activation)


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
                "forward": conv1d_forward,
            },
        )
    return _CONV1D
