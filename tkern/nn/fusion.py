"""Activation fusion: an ``nn.Sequential``'s Linear directly followed by ReLU, SiLU or
GELU runs that activation in the Linear's GEMM epilogue (see :func:`tkern.convert_network`)."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _torch_module

from tkern.nn.linear import Linear, linear_forward

__all__ = ["FusedSequentialForward", "route_fusion"]


#: ``nn.GELU.approximate`` -> the epilogue's name for that form.
_GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}


def _epilogue_activation(module: nn.Module) -> str | None:
    """The GEMM epilogue's name for the activation ``module`` computes, or None.

    Exact types only (a subclass may compute something else). ``ReLU(inplace=True)``
    and ``SiLU(inplace=True)`` too: the Linear's output they would overwrite is a
    fresh tensor nobody else holds. ``nn.GELU`` in either form (``approximate`` is
    "none" or "tanh"; anything else is refused by its forward, so left to it)."""
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.SiLU:
        return "silu"
    if type(module) is nn.GELU and isinstance(module.approximate, str):
        return _GELU_FORMS.get(module.approximate)
    return None


def _runs_more_than_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` would run more than its class's forward: the test
    ``nn.Module.__call__`` makes (the module's own hooks and the global ones), or a
    forward replaced on the instance."""
    hooked = (
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_forward_hooks
        or _torch_module._global_backward_pre_hooks
        or _torch_module._global_backward_hooks
    )
    return bool(hooked) or "forward" in module.__dict__


def _fusable(first: nn.Module, second: nn.Module) -> str | None:
    """The activation to run in ``first``'s GEMM epilogue in place of calling
    ``second`` on its output, or None: ``first`` a :class:`Linear` without an
    activation of its own, ``second`` an activation the epilogue computes, and
    neither with anything (a hook, a patched forward) that would see the difference."""
    if type(first) is not Linear or first.activation is not None:
        return None
    activation = _epilogue_activation(second)
    if activation is None or _runs_more_than_forward(first) or _runs_more_than_forward(second):
        return None
    return activation


class FusedSequentialForward:
    """The forward of an ``nn.Sequential`` converted with ``fuse_activations``.

    ``nn.Sequential.forward``, except that a :class:`Linear` directly followed by
    an activation module the GEMM epilogue computes runs as one GEMM with that
    activation in its epilogue (the same values: see :func:`convert_network`),
    and the activation module is not called. Decided on every call from the
    modules as they are then: a hook put on either module later, a global module
    hook, or a module replaced, gets the plain path for that pair, each module
    called in turn with every hook firing on the values it would see unfused.

    Stored as the container's instance ``forward``: names, ``state_dict`` and
    ``print(model)`` are unchanged. A module-level class, so the model pickles
    and deep-copies (the copy routes its own modules)."""

    def __init__(self, sequential: nn.Sequential) -> None:
        self.sequential = sequential

    def __call__(self, input):  # noqa: A002 (nn.Sequential.forward's argument name)
        modules = list(self.sequential)
        i = 0
        while i < len(modules):
            module = modules[i]
            activation = _fusable(module, modules[i + 1]) if i + 1 < len(modules) else None
            if activation is None:
                input = module(input)
                i += 1
            else:
                input = linear_forward(module, input, activation)
                i += 2
        return input

    def __repr__(self) -> str:
        return "tkern.nn.fusion.FusedSequentialForward()"


def route_fusion(module: nn.Module) -> None:
    """Give ``module`` the fused forward if it is an ``nn.Sequential`` (or a subclass
    that keeps its forward) holding a :class:`Linear` directly followed by an
    activation the epilogue computes. Hooks are looked at on every call, not here."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return  # another forward: which output feeds what is not provable from the structure
    if "forward" in module.__dict__:
        return  # the user's own replacement forward
    children = list(module)
    pairs = zip(children, children[1:], strict=False)
    if any(type(a) is Linear and a.activation is None and _epilogue_activation(b) for a, b in pairs):
        module.forward = FusedSequentialForward(module)
