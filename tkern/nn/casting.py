"""The casts :func:`tkern.convert_network` puts on a model: forward hooks that cast a
module's inputs or outputs (module-level classes, so converted models pickle and
deep-copy) and in-place casts of a module's own tensors that keep each Parameter the
same object (tied weights stay tied)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CastInputs", "CastOutput", "cast_own", "cast_tree", "float_tensors", "run_in_fp32"]


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (nested in tuples,
    lists and dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class CastInputs:
    """Forward pre-hook: cast the floating-point positional and keyword inputs to
    ``dtype``. A module-level class, so converted models pickle and deepcopy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)

    def __repr__(self) -> str:
        return f"tkern.nn.CastInputs({self.dtype})"


class CastOutput:
    """Forward hook: cast the floating-point outputs to ``dtype`` (picklable)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, output):
        return _cast_floats(output, self.dtype)

    def __repr__(self) -> str:
        return f"tkern.nn.CastOutput({self.dtype})"


def remove_cast_hooks(module: nn.Module) -> None:
    """Remove the :class:`CastInputs` / :class:`CastOutput` hooks on ``module`` (only those)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, (CastInputs, CastOutput))]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
                getattr(module, extra, {}).pop(key, None)


def cast_own(
    module: nn.Module, dtype: torch.dtype, buffers: bool = True, only: set[int] | None = None
) -> None:
    """Cast ``module``'s own floating-point parameters and (with ``buffers``) buffers
    (not its children's; with ``only``, those whose ``id`` is in it) to ``dtype`` in place:
    each Parameter stays the same object, so parameters shared with other modules (tied
    weights) stay shared."""
    for p in module._parameters.values():
        if only is not None and id(p) not in only:
            continue
        if p is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in module._buffers.items() if buffers else ():
        if only is not None and id(b) not in only:
            continue
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            module._buffers[name] = b.to(dtype)


def cast_tree(module: nn.Module, dtype: torch.dtype) -> None:
    """:func:`cast_own` on ``module`` and every module below it."""
    for m in module.modules():
        cast_own(m, dtype)


def run_in_fp32(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Keep ``module`` in fp32: its inputs are cast to fp32 and its outputs to ``dtype``
    (None: left as the module returns them)."""
    cast_tree(module, torch.float32)
    module.register_forward_pre_hook(CastInputs(torch.float32), with_kwargs=True)
    if dtype is not None:
        module.register_forward_hook(CastOutput(dtype))


def float_tensors(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s own floating-point parameters and buffers (integer buffers, such as
    BERT's ``position_ids``, need no precision and are not counted)."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return [t for t in own if t.is_floating_point()]
