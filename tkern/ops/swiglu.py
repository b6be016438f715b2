"""The gated activation of a GLU MLP, ``act(gate) * up`` (SwiGLU, GeGLU): ``tkern.swiglu``
and ``swiglu_packed``, differentiable, on kernels/swiglu.py (fp32 inside, one rounding).

Two doors to the same kernels, as ops/linear.py has: eager calls go through plain
``torch.autograd.Function``s; ``torch.compile`` tracing, meta tensors and tensor
subclasses go through the custom ops ``tkern::swiglu`` and ``tkern::swiglu_backward``
(fake implementations give the shapes; the forward's backward is registered in terms
of the backward op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tkern.kernels._common import check_int32_addressable
from tkern.kernels.swiglu import swiglu_backward, swiglu_backward_prechecked, swiglu_forward
from tkern.ops.common import is_compiling

__all__ = ["swiglu", "swiglu_packed"]


def _eager(*tensors: torch.Tensor) -> bool:
    """Whether the autograd Functions apply: plain tensors, not meta, not being traced."""
    return not is_compiling() and all(type(t) is torch.Tensor and not t.is_meta for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., N) as (M, N), a view where its strides allow."""
    return t.reshape(-1, t.shape[-1])


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit column stride (an expanded or transposed gradient made dense)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


#: The kernels' activations as torch functions (the differentiable backward).
_TORCH_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def differentiable_glu_grads(dh, gate, up, activation):
    """``(dgate, dup)`` with torch operations in fp32, each rounded once: what the kernel
    computes, recorded by autograd (backward with ``create_graph=True``)."""
    g, u = (t.float() if t.requires_grad else t.detach().float().requires_grad_() for t in (gate, up))
    h = _TORCH_ACTIVATIONS[activation](g) * u
    dgate, dup = torch.autograd.grad(h, (g, u), dh.float(), create_graph=True)
    return dgate.to(gate.dtype), dup.to(up.dtype)


def _backward_kernel(dh, gate, up, activation, dgate, dup):
    """The eager backward's launch: gate and up are what forward checked and saved, dgate and
    dup new buffers of their shape; of autograd's ``dh`` (the output's shape and dtype) only
    the int32 reach is checked (a gradient may be a view into a larger one: torch.cat's)."""
    dh = _unit_columns(dh)
    check_int32_addressable("dh", dh)
    return swiglu_backward_prechecked(dh, gate, up, activation, dgate, dup)


class _SwiGLU(torch.autograd.Function):
    """h = act(gate) * up on (M, N) tensors; gate and up saved for backward."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up, activation)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a graph autograd can differentiate again
            return (*differentiable_glu_grads(dh, gate, up, ctx.activation), None)
        new = (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
        dgate, dup = _backward_kernel(dh, gate, up, ctx.activation, *new)
        return dgate, dup, None


class _SwiGLUPacked(torch.autograd.Function):
    """h = act(gate) * up where gate and up are the halves of one (M, 2N) tensor; its
    gradient is written as one (M, 2N) tensor (no concatenation)."""

    @staticmethod
    def forward(ctx, gate_up, activation):
        n = gate_up.shape[1] // 2
        ctx.activation = activation
        ctx.save_for_backward(gate_up)
        return swiglu_forward(gate_up[:, :n], gate_up[:, n:], activation)

    @staticmethod
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        n = gate_up.shape[1] // 2
        if torch.is_grad_enabled():  # create_graph=True
            return torch.cat(
                differentiable_glu_grads(dh, gate_up[:, :n], gate_up[:, n:], ctx.activation), 1
            ), None
        d = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        _backward_kernel(dh, gate_up[:, :n], gate_up[:, n:], ctx.activation, d[:, :n], d[:, n:])
        return d, None


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("tkern::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` on (M, N) tensors (kernels.swiglu.swiglu_forward); a column-strided
    input (a transposed view, as the eager path accepts) is made dense first."""
    return swiglu_forward(_unit_columns(gate), _unit_columns(up), activation)


@_swiglu_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("tkern::swiglu_backward", mutates_args=())
def _swiglu_backward_op(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of ``act(gate) * up`` (kernels.swiglu.swiglu_backward)."""
    return swiglu_backward(_unit_columns(dh), _unit_columns(gate), _unit_columns(up), activation)


@_swiglu_backward_op.register_fake
def _(dh, gate, up, activation):
    return dh.new_empty(dh.shape), dh.new_empty(dh.shape)


def _setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(gate, up)


def _backward(ctx, dh):
    gate, up = ctx.saved_tensors
    dgate, dup = _swiglu_backward_op(dh, gate, up, ctx.activation)
    return dgate, dup, None


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError(f"gate and up must be tensors, got {type(gate).__name__} and {type(up).__name__}")
    if gate.dim() == 0 or gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have one shape (..., N), got {tuple(gate.shape)} and {tuple(up.shape)}"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` (Llama's MLP: ``down(silu(gate(x)) * up(x))``), differentiable.

    The activation, the product and their gradients are one kernel each way, computed in
    fp32 from the 16-bit inputs and rounded once (HF's eager fp16 rounds ``act(gate)`` and
    the product separately); backward reads ``gate`` and ``up`` (saved) and ``dh``.
    With ``create_graph=True`` the backward runs in torch operations in fp32 (second-order
    gradients, as :func:`tkern.linear`'s).

    Args:
        gate: (..., N), fp16 or bf16.
        up: the same shape and dtype.
        activation: ``"silu"`` (SwiGLU, the default), ``"gelu_tanh"`` (GeGLU, Gemma's
            ``gelu_pytorch_tanh``), ``"gelu"`` (erf form) or ``"relu"``.

    Returns:
        (..., N) tensor of ``gate``'s dtype.
    """
    _check(gate, up)
    if _eager(gate, up):
        h = _SwiGLU.apply(_unit_columns(_rows(gate)), _unit_columns(_rows(up)), activation)
    else:
        h = _swiglu_op(_rows(gate), _rows(up), activation)
    return h.reshape(gate.shape)


def swiglu_packed(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """:func:`swiglu` on the two halves of ``gate_up`` (..., 2N): gate first, as Phi-3's
    ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``; the gradient is written as one
    (..., 2N) tensor, in place of the two halves' gradients and their concatenation.

    Returns:
        (..., N) tensor of ``gate_up``'s dtype.
    """
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        shape = tuple(gate_up.shape) if isinstance(gate_up, torch.Tensor) else type(gate_up).__name__
        raise ValueError(f"gate_up must be a tensor (..., 2N) with an even last dimension, got {shape}")
    n = gate_up.shape[-1] // 2
    rows = _unit_columns(_rows(gate_up))
    if _eager(gate_up):
        h = _SwiGLUPacked.apply(rows, activation)
    else:  # traced: the halves' gradients are joined by the graph (views are free there)
        h = _swiglu_op(rows[:, :n], rows[:, n:], activation)
    return h.reshape(*gate_up.shape[:-1], n)
