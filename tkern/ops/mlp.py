"""Two linears with an activation (or a gated unit) between them as one autograd function,
for the MLP blocks :mod:`tkern.nn.fusion` converts (GPT-2's ``c_proj(gelu_tanh(c_fc(x)))``,
Llama's ``down_proj(silu(gate_proj(x)) * up_proj(x))``):

``y = act(x @ W1^T + b1) @ W2^T + b2``, forward as two GEMMs (the first with the
activation in its epilogue, storing the pre-activation Z), backward with the second
layer's dgrad producing the first layer's gradient dZ directly:
``dZ = (dY @ W2) * act'(Z)`` in that GEMM's epilogue (``gemm.matmul_grad_act``: fp32
inside, one rounding), so no pass over dH applies act' and the first layer's dgrad and
wgrad read dZ as plain operands (no prologue). The same Parameters as two
:func:`tkern.linear` calls; a tracing, meta or subclass call runs those two calls.

:func:`linear_glu_linear` does the same for a gated MLP ``y = (act(x @ Wg^T + bg) *
(x @ Wu^T + bu)) @ Wd^T + bd``: gate and up are written side by side into one (M, 2N)
buffer (two GEMMs, or one over a packed ``gate_up`` weight); with two, up's GEMM computes
the gated unit ``h`` in its epilogue from the gate the first stored
(``gemm.matmul_glu_prechecked``: no pass over gate and up), with the packed weight a
gated-unit pass reads the halves; in backward down's dgrad epilogue (``gemm.matmul_grad_glu``) writes
``[d(gate) | d(up)]`` from the unrounded fp32 dH, so no gated-unit backward pass runs;
``dX = d(gate) @ Wg + d(up) @ Wu`` is the second GEMM adding into the first's output (one
rounding of the fp32 sum), not a torch add of two (M, K) gradients.
"""

from __future__ import annotations

import math

import torch

from tkern.kernels._common import (
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
)
from tkern.kernels.activation import GRAD_FROM_OUTPUT
from tkern.kernels.gemm import (
    linear_prechecked,
    linear_residual_prechecked,
    matmul_glu_prechecked,
    matmul_grad_act_prechecked,
    matmul_grad_glu_prechecked,
    matmul_prechecked,
)
from tkern.kernels.gemm_epilogue import check_bias
from tkern.kernels.swiglu import swiglu_forward_prechecked
from tkern.ops import common
from tkern.ops.common import as_2d
from tkern.ops.linear import (
    check_linear_args,
    dgrad_into,
    differentiable_grads,
    layer_grads,
    linear,
    linear_residual_traced,
)
from tkern.ops.swiglu import differentiable_glu_grads, swiglu, swiglu_packed

__all__ = ["linear_act_linear", "linear_glu_linear"]


def _second_layer(h, w2, b2, residual):
    """The second layer's forward GEMM, ``residual`` (when given) added in its epilogue."""
    if residual is None:
        return linear_prechecked(h, w2, b2, None, None)
    return linear_residual_prechecked(h, w2, b2, residual)


def _last_layer(h, w2, b2, residual):
    """The traced (or meta, subclass, empty) calls' last layer: ``linear(h, w2, b2)``, with
    ``residual`` added in its epilogue by the custom op (the eager path's rounding)."""
    if residual is None:
        return linear(h, w2, b2)
    if h.is_meta or h.numel() == 0 or w2.shape[0] == 0 or type(h) is not torch.Tensor:
        return residual + linear(h, w2, b2)
    return linear_residual_traced(h, w2, b2, residual)


def _residual_grad(ctx, dy, index):
    """The residual's gradient: the output's, as it is (no copy), where input ``index`` needs one."""
    return dy if ctx.needs_input_grad[index] else None


def _check_residual(residual, x, w2) -> None:
    """Raise unless ``residual`` is None or an (..., N2) tensor of ``x``'s leading shape,
    dtype and device (the residual stream the second layer's output is added to)."""
    if residual is None:
        return
    check_tensor("residual", residual, dtypes=(x.dtype,))
    shape = (*x.shape[:-1], w2.shape[0])
    if tuple(residual.shape) != shape:
        raise ValueError(
            f"residual must have shape {shape} (x's leading dims, w2's rows), got {tuple(residual.shape)}"
        )
    check_same_device(x=x, residual=residual)
    check_int32_addressable("residual", residual)


def _residual_rows(residual, x, w2):
    """``residual`` (..., N2) as the contiguous (M, N2) tensor the epilogue reads (a view
    where it is contiguous), or None."""
    if residual is None:
        return None
    return residual.reshape(-1, w2.shape[0]).contiguous()


class _LinearActLinear(torch.autograd.Function):
    """y = act(x @ W1^T + b1) @ W2^T + b2 as (M, N2); see the module's docstring."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation, residual):
        x2d = x if x.dim() == 2 else as_2d(x, w1.shape[1])
        save_z = any(ctx.needs_input_grad[:3])
        from_output = activation in GRAD_FROM_OUTPUT  # ReLU: act'(Z) from H, the same mask
        preact = None
        if save_z and not from_output:
            preact = torch.empty(x2d.shape[0], w1.shape[0], dtype=x.dtype, device=x.device)
        h = linear_prechecked(x2d, w1, b1, activation, preact)
        y = _second_layer(h, w2, b2, residual)
        ctx.activation = activation
        ctx.slots = common.next_function_slots(x, w1, b1, w2, b2)
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (b1, b2))
        ctx.x_shape = x.shape if x2d is not x else None
        ctx.save_for_backward(x2d, w1, b1, h if from_output else preact, h, w2, b2)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, w1, b1, z, h, w2, b2 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        bias1, bias2 = ctx.bias_dtypes
        if torch.is_grad_enabled():  # create_graph=True: the layers' differentiable gradients
            dh, dw2, db2 = differentiable_grads(dy, h, w2, b2, None, (any(needs[:3]), *needs[3:5]), bias2)
            dx = dw1 = db1 = None
            if dh is not None:
                dx, dw1, db1 = differentiable_grads(dh, x2d, w1, b1, ctx.activation, needs[:3], bias1)
        else:
            _, dw2, db2 = layer_grads(ctx, dy, h, w2, (False, *needs[3:5]), bias2, 3)
            dx = dw1 = db1 = None
            if any(needs[:3]):  # dZ straight from the second layer's dgrad epilogue
                dz = matmul_grad_act_prechecked(dy, w2, z, ctx.activation)
                dx, dw1, db1 = layer_grads(ctx, dz, x2d, w1, needs[:3], bias1, 1)
        if dx is not None and ctx.x_shape is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw1, db1, dw2, db2, None, _residual_grad(ctx, dy, 6)


def _check_second(x, width: int, dtype, w2, b2, name: str = "w2", after: str = "w1") -> None:
    """Raise unless ``w2`` (N2, ``width``) of ``dtype`` and ``b2`` can follow the first layer
    (``after``: what it is called in the message) on ``x``'s device; ``name``: w2's (its
    bias's: ``b`` for its ``w``, b2 / b_down)."""
    check_tensor(name, w2, ndim=2, dtypes=(dtype,))
    if w2.shape[1] != width:
        raise ValueError(f"{name} must have shape (N2, {width}) to follow {after}, got {tuple(w2.shape)}")
    check_bias(b2, w2.shape[0], w2.dtype)
    check_same_device(x=x, **{name: w2, f"b{name[1:]}": b2})
    check_int32_addressable(name, w2)
    check_int32_elements("output", (math.prod(x.shape[:-1]), w2.shape[0]))


def linear_act_linear(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    activation: str,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(linear(x, w1, b1, activation), w2, b2)`` (``+ residual``) with the
    activation's gradient in the second layer's dgrad epilogue (see the module's docstring).

    Args:
        x: (..., K), fp16 or bf16.
        w1: (N1, K), ``x``'s dtype; b1: optional (N1,), ``x``'s dtype or fp32.
        activation: an activation :func:`tkern.linear` takes, other than None.
        w2: (N2, N1), ``x``'s dtype, any strides; b2: optional (N2,).
        residual: optional (..., N2) tensor of ``x``'s dtype, added to the output in the
            second GEMM's epilogue (fp32, one rounding; the pre-norm block's ``h + mlp(x)``);
            its gradient is the output's, passed on as it is.

    Returns:
        (..., N2) tensor of ``x``'s dtype.
    """
    if activation is None:
        raise ValueError("linear_act_linear needs an activation, got None")
    eager = check_linear_args(x, w1, b1, activation)
    _check_second(x, w1.shape[0], w1.dtype, w2, b2)
    _check_residual(residual, x, w2)
    if not eager or w1.shape[1] == 0 or w1.shape[0] == 0:  # traced, meta, subclass, empty: two calls
        return _last_layer(linear(x, w1, b1, activation), w2, b2, residual)
    y = _LinearActLinear.apply(x, w1, b1, w2, b2, activation, _residual_rows(residual, x, w2))
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w2.shape[0])


class _LinearGLULinear(torch.autograd.Function):
    """y = (act(x @ Wg^T + bg) * (x @ Wu^T + bu)) @ Wd^T + bd as (M, N2); ``w_up`` None: ``w_gate``
    is the packed (2N, K) ``gate_up`` weight. See the module's docstring."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, residual):
        x2d = x if x.dim() == 2 else as_2d(x, w_gate.shape[1])
        n = w_down.shape[1]
        gate_up = torch.empty(x2d.shape[0], 2 * n, dtype=x.dtype, device=x.device)
        if w_up is None:  # one GEMM over the packed weight, then the gated unit's pass
            matmul_prechecked(x2d, w_gate.t(), b_gate, None, x.dtype, None, gate_up, False)
            h = swiglu_forward_prechecked(gate_up[:, :n], gate_up[:, n:], activation)
        else:  # gate's GEMM writes its half; up's writes the other and h in its epilogue
            matmul_prechecked(x2d, w_gate.t(), b_gate, None, x.dtype, None, gate_up[:, :n], False)
            h = matmul_glu_prechecked(x2d, w_up.t(), b_up, gate_up, activation)
        y = _second_layer(h, w_down, b_down, residual)
        ctx.activation = activation
        ctx.slots = common.next_function_slots(x, w_gate, b_gate, w_up, b_up, w_down, b_down)
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (b_gate, b_up, b_down))
        ctx.x_shape = x.shape if x2d is not x else None
        ctx.save_for_backward(x2d, w_gate, b_gate, w_up, b_up, gate_up, h, w_down, b_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, w_gate, b_gate, w_up, b_up, gate_up, h, w_down, b_down = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients
            grads = _differentiable_glu_linear(
                ctx, dy, x2d, w_gate, b_gate, w_up, b_up, gate_up, h, w_down, b_down
            )
        else:
            _, dwd, dbd = layer_grads(ctx, dy, h, w_down, (False, *needs[5:7]), ctx.bias_dtypes[2], 5)
            dx = dwg = dbg = dwu = dbu = None
            if any(needs[:5]):  # [d(gate) | d(up)] straight from down's dgrad epilogue
                d = matmul_grad_glu_prechecked(dy, w_down, gate_up, ctx.activation)
                dx, dwg, dbg, dwu, dbu = _first_grads(ctx, d, x2d, w_gate, w_up, needs)
            grads = (dx, dwg, dbg, dwu, dbu, dwd, dbd)
        dx = grads[0]
        if dx is not None and ctx.x_shape is not None:
            dx = dx.reshape(ctx.x_shape)
        return (dx, *grads[1:], None, _residual_grad(ctx, dy, 8))


def _first_grads(ctx, d, x2d, w_gate, w_up, needs):
    """``(dx, dWg, dbg, dWu, dbu)`` of the first layer(s) from ``d = [d(gate) | d(up)]``
    (M, 2N): with a packed weight one layer's gradients; else each half's dW and db, and
    ``dX = d(gate) @ Wg`` with ``d(up) @ Wu`` added into it by the second GEMM."""
    bias_gate, bias_up = ctx.bias_dtypes[:2]
    if w_up is None:
        dx, dwg, dbg = layer_grads(ctx, d, x2d, w_gate, needs[:3], bias_gate, 1)
        return dx, dwg, dbg, None, None
    n = d.shape[1] // 2
    dg, du = d[:, :n], d[:, n:]
    _, dwg, dbg = layer_grads(ctx, dg, x2d, w_gate, (False, *needs[1:3]), bias_gate, 1)
    _, dwu, dbu = layer_grads(ctx, du, x2d, w_up, (False, *needs[3:5]), bias_up, 3)
    dx = dgrad_into(du, w_up, dgrad_into(dg, w_gate, None)) if needs[0] else None
    return dx, dwg, dbg, dwu, dbu


def _differentiable_glu_linear(ctx, dy, x2d, w_gate, b_gate, w_up, b_up, gate_up, h, w_down, b_down):
    """The seven gradients with torch operations in fp32, each rounded once, recorded by
    autograd (backward with ``create_graph=True``)."""
    needs = ctx.needs_input_grad
    bias_gate, bias_up, bias_down = ctx.bias_dtypes
    dh, dwd, dbd = differentiable_grads(dy, h, w_down, b_down, None, (any(needs[:5]), *needs[5:7]), bias_down)
    dx = dwg = dbg = dwu = dbu = None
    if dh is not None:
        n = w_down.shape[1]
        dg, du = differentiable_glu_grads(dh, gate_up[:, :n], gate_up[:, n:], ctx.activation)
        if w_up is None:
            dx, dwg, dbg = differentiable_grads(
                torch.cat((dg, du), 1), x2d, w_gate, b_gate, None, needs[:3], bias_gate
            )
        else:
            dxg, dwg, dbg = differentiable_grads(dg, x2d, w_gate, b_gate, None, needs[:3], bias_gate)
            dxu, dwu, dbu = differentiable_grads(du, x2d, w_up, b_up, None, (needs[0], *needs[3:5]), bias_up)
            dx = None if dxg is None else dxg + dxu
    return dx, dwg, dbg, dwu, dbu, dwd, dbd


def _check_glu(x, w_gate, w_up, b_up, w_down, b_down) -> int:
    """Raise unless the gate, up and down weights (and up's and down's biases; gate's is
    :func:`check_linear_args`') fit one gated MLP on ``x``; returns N, the gated unit's width
    (``w_down``'s in-features)."""
    gated = w_gate.shape[0] if w_up is not None else w_gate.shape[0] // 2
    if w_up is None and w_gate.shape[0] % 2:
        raise ValueError(
            f"a packed gate_up weight must have an even first dimension, got {tuple(w_gate.shape)}"
        )
    if w_up is not None:
        check_tensor("w_up", w_up, ndim=2, dtypes=(w_gate.dtype,))
        if w_up.shape != w_gate.shape:
            raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
        check_bias(b_up, w_up.shape[0], w_up.dtype)
        check_same_device(x=x, w_up=w_up, b_up=b_up)
        check_int32_addressable("w_up", w_up)
    _check_second(x, gated, w_gate.dtype, w_down, b_down, "w_down", "the gated unit")
    check_int32_elements("gate_up", (math.prod(x.shape[:-1]), 2 * gated))
    return gated


def linear_glu_linear(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    activation: str,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(swiglu(linear(x, w_gate, b_gate), linear(x, w_up, b_up), activation), w_down,
    b_down)`` (a Llama MLP) with the gated unit's backward in down's dgrad epilogue and the
    two first layers' input gradients summed by their GEMMs (see the module's docstring).

    Args:
        x: (..., K), fp16 or bf16.
        w_gate: (N, K), ``x``'s dtype; or, with ``w_up`` None, the packed (2N, K) ``gate_up``
            weight (gate rows first, as Phi-3's ``gate_up_proj``). b_gate: optional, its rows'.
        w_up: (N, K) like ``w_gate``, or None (packed); b_up: optional (N,).
        activation: the gate's (``"silu"``: SwiGLU; ``"gelu_tanh"``, ``"gelu"``, ``"relu"``).
        w_down: (N2, N), ``x``'s dtype; b_down: optional (N2,).
        residual: optional (..., N2), as :func:`linear_act_linear`'s.

    Returns:
        (..., N2) tensor of ``x``'s dtype.
    """
    if activation is None:
        raise ValueError("linear_glu_linear needs the gate's activation, got None")
    eager = check_linear_args(x, w_gate, b_gate, activation)
    n = _check_glu(x, w_gate, w_up, b_up, w_down, b_down)
    _check_residual(residual, x, w_down)
    if not eager or n == 0 or w_gate.shape[1] == 0:  # traced, meta, subclass, empty: the calls one by one
        if w_up is None:
            h = swiglu_packed(linear(x, w_gate, b_gate), activation)
        else:
            h = swiglu(linear(x, w_gate, b_gate), linear(x, w_up, b_up), activation)
        return _last_layer(h, w_down, b_down, residual)
    y = _LinearGLULinear.apply(
        x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, _residual_rows(residual, x, w_down)
    )
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w_down.shape[0])
