"""Modules built on tkern's kernels, and convert_network."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tkern.functional import linear
from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.gemm import check_activation

__all__ = ["Linear", "convert_network"]


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


#: Normalization layers: kept in fp32 (parameters and running statistics), run
#: on their input cast to fp32, their output cast back (the apex/fastai rule).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

#: Modules with parameters or buffers that run correctly once cast to fp16/bf16.
CASTABLE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.modules.conv._ConvNd,
    nn.PReLU,
)


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (nested in tuples,
    lists and dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _run_in_fp32(module: nn.Module, dtype: torch.dtype) -> None:
    """Keep ``module`` in fp32: its inputs are cast to fp32 and its outputs to ``dtype``."""
    module.float()
    module.register_forward_pre_hook(
        lambda m, args, kwargs: (_cast_floats(args, torch.float32), kwargs), with_kwargs=True
    )
    module.register_forward_hook(lambda m, args, out: _cast_floats(out, dtype))


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def _linear_like(old: nn.Linear, dtype: torch.dtype) -> Linear:
    new = Linear(
        old.in_features, old.out_features, bias=old.bias is not None, dtype=dtype, device=old.weight.device
    )
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.weight.requires_grad_(old.weight.requires_grad)
        if old.bias is not None:
            new.bias.copy_(old.bias)
            new.bias.requires_grad_(old.bias.requires_grad)
    new.train(old.training)
    return new


def convert_network(model: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    """Convert ``model`` in place for mixed-precision training, and return it.

    * every ``nn.Linear`` becomes a :class:`tkern.nn.Linear` with the same
      weights, in ``dtype``;
    * normalization layers (:data:`NORM_TYPES`) keep fp32 parameters and
      statistics and run on their input cast to fp32, returning ``dtype``;
    * other modules that own parameters or buffers and are known to run in
      half precision (:data:`CASTABLE_TYPES`) are cast to ``dtype``; modules
      that own none (activations, dropout, containers) need nothing;
    * any other module that owns parameters or buffers is left in fp32, run
      like a normalization layer, with a warning.

    Args:
        model: the fp32 model.
        dtype: torch.float16 (default) or torch.bfloat16.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype not in HALF_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if type(model) is nn.Linear:
        raise TypeError("model is a bare nn.Linear, which cannot be replaced in place; wrap it in a module")

    def convert(module: nn.Module, path: str) -> nn.Module:
        if type(module) is nn.Linear:
            return _linear_like(module, dtype)
        if isinstance(module, (Linear, *CASTABLE_TYPES)):
            return module.to(dtype)
        if isinstance(module, NORM_TYPES):
            _run_in_fp32(module, dtype)
        elif _owns_tensors(module):
            warnings.warn(
                f"convert_network: {path or 'the model'} ({type(module).__name__}) is not a type tkern "
                f"knows to run in {dtype}; it is kept in fp32 with its inputs cast to fp32",
                stacklevel=3,
            )
            _run_in_fp32(module, dtype)
        else:
            for name, child in module.named_children():
                setattr(module, name, convert(child, f"{path}.{name}" if path else name))
        return module

    return convert(model, "")
