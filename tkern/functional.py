"""Autograd functions and torch.library custom ops built on the kernels.

Two doors lead to the same kernels:

* eager calls go through :class:`_Linear`, a plain ``torch.autograd.Function``
  (the least host time per call);
* ``torch.compile``/``torch.export`` tracing, meta tensors and tensor subclasses
  (FakeTensor) go through the custom ops ``tkern::linear_forward``,
  ``tkern::mm_backward`` (the backward GEMMs with their operand prologue) and
  ``tkern::activation_grad``: each has a fake (meta)
  implementation, so Dynamo and AOTAutograd treat tkern's GEMMs as opaque ops
  with known output shapes (no graph break, nothing traced into Triton), and
  ``tkern::linear_forward`` has its backward registered in terms of
  ``tkern::mm_backward`` and ``tkern::activation_grad``.
  The op bodies run the same launchers (the interpreter on a CPU).

Second-order gradients (``create_graph=True``, gradient penalties) take a
differentiable path: when grad mode is on in backward, the gradients are
computed with torch operations in fp32 from the saved inputs, so autograd can
differentiate them again.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tkern.flat import has_grad_view, take_grad_view
from tkern.kernels._common import (
    HALF_DTYPES,
    INT32_MAX,
    INTERPRET,
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
)
from tkern.kernels.activation import (
    ACTIVATIONS,
    GELU_TANH_COEFF,
    GELU_TANH_SATURATED,
    GRAD_FROM_OUTPUT,
    activation_grad,
    check_activation,
)
from tkern.kernels.float8 import roll_amax_history, to_float8, to_float8_delayed, to_float8_delayed_deferred
from tkern.kernels.gemm import (
    large_on_tma,
    linear_prechecked,
    matmul,
    matmul_backward,
    matmul_backward_prechecked,
    scaled_mm,
)
from tkern.kernels.gemm_epilogue import check_bias

__all__ = ["Float8WeightCache", "float8_linear", "float8_weight_cache", "linear", "matmul"]

_is_compiling = torch.compiler.is_compiling  # bound once: the fast check runs on every call
_NO_ACT = "none"  # how the custom ops spell activation=None (their schema takes a str)
# Whether the running backward will execute an autograd node; raises for a leaf's
# AccumulateGrad under autograd.grad(), which captures that gradient instead.
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)
_increment_version = torch.autograd.graph.increment_version


# --------------------------------------------------------------------------- shared pieces


def _as_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (..., K) as (M, K); also for K == 0, where ``reshape(-1, 0)`` is ambiguous."""
    return x.reshape(-1, k) if k else x.reshape(math.prod(x.shape[:-1]), 0)


def _differentiable_grads(dy, x2d, weight, bias, activation, needs, bias_dtype):
    """The three gradients of ``act(x @ W^T + b)`` with torch operations in fp32,
    each cast once to its input's dtype: what the kernels compute, but recorded
    by autograd (used when grad mode is on in backward)."""
    n, k = weight.shape
    dz = _as_2d(dy, n).float()
    if activation is not None:
        z = F.linear(x2d.float(), weight.float(), None if bias is None else bias.float())
        # the formulas of activation.activation_grad_f32
        if activation == "relu":
            dz = dz * (z > 0)
        elif activation == "gelu":  # erf form: d/dz [z Phi(z)] = Phi(z) + z phi(z)
            cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
            pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
            dz = dz * (cdf + z * pdf)
        elif activation == "silu":  # d/dz [z s(z)] = s(z) (1 + z s(-z))
            dz = dz * (torch.sigmoid(z) * (1.0 + z * torch.sigmoid(-z)))
        else:  # gelu_tanh: d/dz [z s(2u)] = s(2u) (1 + z s(-2u) 2u'), 2u = c (z + k z^3)
            c, a = 2.0 * math.sqrt(2.0 / math.pi), GELU_TANH_COEFF
            zc = z.clamp(-GELU_TANH_SATURATED, GELU_TANH_SATURATED)  # act' is exactly 0 or 1 beyond
            z2 = zc * zc
            two_u = c * zc * (1.0 + a * z2)
            dz = dz * (torch.sigmoid(two_u) * (1.0 + zc * torch.sigmoid(-two_u) * c * (1.0 + 3.0 * a * z2)))
        # the kernels round dz to the activations' dtype before the two GEMMs
        dz = dz.to(dy.dtype).float()
    dx = (dz @ weight.float()).to(x2d.dtype).reshape(*dy.shape[:-1], k) if needs[0] else None
    dw = (dz.t() @ x2d.float()).to(weight.dtype) if needs[1] else None
    db = dz.sum(0).to(bias_dtype) if needs[2] and bias is not None else None
    return dx, dw, db


def _mm_backward_checked(
    a, b, z, activation, store_a, sum_dtype, transpose_a=False, into=None, accumulate=True
):
    """The backward GEMM ``A' @ b`` (``A' = a * act'(z)`` with an ``activation``,
    else ``a``) on operands the caller made or checked, with ``A'`` (``store_a``)
    and its fp32 row sums in ``sum_dtype`` (when not None) written on the way:
    ``(A' @ b, A' or None, sums or None)`` (gemm.matmul_backward). With
    ``transpose_a`` the GEMM is ``A'^T @ b``: ``a`` and ``z`` are read transposed in
    place and ``A'`` is returned in ``a``'s layout. ``into``: a tensor the product
    is added to (``accumulate``) or written into, and returned, instead of a new one."""
    a_out, a_sum = _prologue_outputs(a, store_a, sum_dtype, transpose_a)
    c = matmul_backward_prechecked(a, b, activation, z, a_out, a_sum, transpose_a, into, accumulate)
    return c, a_out, a_sum


def _prologue_outputs(a, store_a, sum_dtype, transpose_a=False):
    """The buffers the backward GEMM writes ``A'`` and its row sums into (None where
    not asked for): like ``a``, and one per row of the GEMM's A operand (``a``'s
    rows, or its columns with ``transpose_a``) of ``sum_dtype``."""
    a_out = torch.empty_like(a) if store_a else None
    a_sum = None if sum_dtype is None else a.new_empty(a.shape[transpose_a], dtype=sum_dtype)
    return a_out, a_sum


#: Activations whose gradient the backward GEMMs apply while loading dY (the operand
#: prologue, gemm.matmul_backward): ReLU's is a select, a few instructions per element
#: of dY beside the 2 * BLOCK_N multiply-adds each element feeds, hidden under the
#: tensor cores. Every other activation keeps its own elementwise pass
#: (activation.activation_grad), since a prologue evaluates act'(z) once per column
#: block of the output (N / BLOCK_N times per element): GELU's gradient compiles to
#: ~41 SASS instructions per element on sm_90 (392 for a thread's 8 elements in the
#: pass, ReLU's 64), so on an 8192 x 4096 x 4096 dgrad (32 column blocks) the prologue
#: would issue ~44e9 instructions, ~1.3 ms of an H100's CUDA cores beside a ~0.4 ms
#: GEMM, where the pass reads dY and Z once (~0.06 ms); its configs are also pruned to
#: 64-row tiles (gemm_configs.PROLOGUE_ACT_MAX_A). The prologue is bit-identical to the
#: pass for every activation: the choice is speed only, to be confirmed on a GPU.
PROLOGUE_ACTIVATIONS = frozenset({"relu"})
#: Whether the backward GEMMs keep their operand prologue (act', dZ stored, dbias
#: summed) on the shapes where, without one, they take the TMA kernel (Hopper, M, N
#: and K >= gemm.TMA_MIN_DIM). False: there act' is its own pass and dbias a
#: reduction, so the GEMMs run on the TMA kernel. From the H100 run: the TMA kernel
#: beat the pointer kernel by 1.05-1.49x on those shapes (~0.15 ms of a ~0.6 ms
#: 8192 x 4096 x 4096 GEMM), and the prologue configs are pruned to the smaller
#: tiles besides (gemm_configs.PROLOGUE_MAX_ACC); the pass reads dY and Z and writes
#: dZ (~0.06 ms there), the reduction reads dZ (~0.02 ms). A prediction, to be
#: measured on a GPU (the 8 x 4096 MLP's step).
PROLOGUE_ON_TMA_SHAPES = False


def _linear_grads(dy, x2d, weight, preact, activation, needs, bias_dtype, mm, act_grad, dw_target=None):
    """The gradients of ``act(x @ W^T + b)`` for both doors of :func:`linear`, from
    ``dy`` (M, N) and the saved pre-activation ``preact``: dX = dZ @ W, dW = dZ^T @ X
    (dZ^T read in place), db = dZ summed over M in fp32, where dZ = dY * act'(Z).

    At most two GEMM launches: dgrad applies act' while loading dY (the operand
    prologue, for :data:`PROLOGUE_ACTIVATIONS`) and its first column of programs
    stores dZ; wgrad reads that dZ^T and sums dbias from its tiles; without dgrad,
    wgrad applies act' to dY^T itself (Z^T read in place). Other activations get dZ
    from ``act_grad`` first. dbias alone (weight frozen) is a plain reduction. Where
    the GEMMs take the TMA kernel (Hopper, M, N and K >= gemm.TMA_MIN_DIM), which has
    no operand prologue, act' is its own pass and dbias a reduction:
    :data:`PROLOGUE_ON_TMA_SHAPES`.
    ``mm(a, b, z, activation, store_a, sum_dtype, transpose_a) -> (c, A', sums)`` and
    ``act_grad`` are the launchers (eager) or the custom ops (traced). ``dw_target``
    (eager only): where dW goes in place (:func:`_flat_wgrad`)."""
    need_dx, need_dw = needs[0], needs[1]
    sum_dtype = bias_dtype if needs[2] else None  # None: no bias, or it needs no gradient
    prologue = PROLOGUE_ON_TMA_SHAPES or not large_on_tma(dy.device, *dy.shape, weight.shape[1])
    sum_in_gemm = sum_dtype if prologue else None  # dbias from wgrad's tiles (a prologue output)
    dz, z, act = dy, None, None  # the GEMMs read dZ, or dY and Z with act' in their prologue
    if activation is not None:
        if activation in PROLOGUE_ACTIVATIONS and (need_dx or need_dw) and prologue:
            # the prologue reads Z with dY's strides: an expanded or strided dY (y.sum()) is made dense
            dz, z, act = dy if dy.stride() == preact.stride() else dy.contiguous(), preact, activation
        else:
            dz = act_grad(dy, preact, activation)
    dx = dw = db = None
    if need_dx:  # (M, N) @ (N, K); dZ stored for wgrad and dbias when act' was applied here
        store = act is not None and (need_dw or sum_dtype is not None)
        dx, dz_stored, _ = mm(dz, weight, z, act, store, None)
        if act is not None:
            dz, z, act = dz_stored, None, None
    if need_dw:  # (N, M) @ (M, K), dbias from the first column of programs
        into = () if dw_target is None else dw_target[1:]  # (view, accumulate)
        dw, _, sums = mm(dz, x2d, z, act, False, sum_in_gemm, True, *into)  # dZ^T and Z^T read in place
        db = sums if sum_in_gemm is not None else None
    if sum_dtype is not None and db is None:  # dbias alone or beside a TMA wgrad: dZ reduced
        db = dz.sum(0, dtype=torch.float32).to(sum_dtype)
    return dx, dw, db


class _Linear(torch.autograd.Function):
    """y = act(x @ W^T + b) as (M, N); every product through :func:`tkern.matmul`.

    The output keeps its 2-D shape here: :func:`linear` gives it x's leading
    dimensions outside the Function, since a view made inside one cannot be
    written in place afterwards (``nn.ReLU(inplace=True)`` after the Linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        x2d = x if x.dim() == 2 else _as_2d(x, weight.shape[1])
        preact = None
        save_z = activation is not None and any(ctx.needs_input_grad[:3])
        # the gradient's z: the pre-activation, or for ReLU the output (the same mask)
        from_output = save_z and activation in GRAD_FROM_OUTPUT
        if save_z and not from_output:
            preact = torch.empty(x2d.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        y = linear_prechecked(x2d, weight, bias, activation, preact)  # linear() checked them
        ctx.activation = activation
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_shape = x.shape if x2d is not x else None  # None: dx keeps its (M, K) shape
        ctx.save_for_backward(x2d, weight, bias, y if from_output else preact)
        return y

    @staticmethod
    def backward(ctx, dy):  # dy (M, N)
        x2d, weight, bias, preact = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: a graph autograd can differentiate again
            dx, dw, db = _differentiable_grads(dy, x2d, weight, bias, ctx.activation, needs, ctx.bias_dtype)
            return dx if dx is None or ctx.x_shape is None else dx.reshape(ctx.x_shape), dw, db, None
        target = _flat_wgrad(ctx, x2d.dtype, weight) if needs[1] else None
        dx, dw, db = _linear_grads(
            dy,
            x2d,
            weight,
            preact,
            ctx.activation,
            needs,
            ctx.bias_dtype,
            _mm_backward_checked,
            activation_grad,
            target,
        )
        if target is not None:  # dW is in .grad already: autograd adopts that memory
            dw = _hand_over(target)
        return dx if dx is None or ctx.x_shape is None else dx.reshape(ctx.x_shape), dw, db, None


def _flat_wgrad(ctx, dtype: torch.dtype, weight: torch.Tensor | None = None) -> tuple | None:
    """``(weight, view, accumulate)`` when this backward may put dW straight into
    the weight's gradient view in a fused optimizer's flat buffer (the wgrad
    GEMM adds into it, ``C +=``, when ``.grad`` is the view, or writes into it
    when ``.grad`` is None), else None. ``weight``: input 1 of the Function whose
    backward runs, if the caller has it (a cheap refusal first).

    Autograd's AccumulateGrad adds whatever backward returns into ``.grad``: a
    fresh (N, K) dW costs that allocation and one more pass over the gradient.
    Instead the GEMM puts dW into the view and :func:`_hand_over` gives autograd
    a tensor over the view's memory with ``.grad`` set to None: AccumulateGrad,
    finding no ``.grad``, adopts it as it is (no copy, no add: nothing else refers
    to it), its hooks (DDP's, ZeRO-2's, the flat buffer's, the user's
    post-accumulate ones) fire as before, and the flat buffer's hook puts the
    view back. A second use of the weight in the same graph (tied weights) finds
    the view taken (flat.take_grad_view) and returns its share as usual, which
    autograd sums with the first before accumulating. Only where that is exactly
    AccumulateGrad's result: a leaf weight of ``dtype`` with a flat view, no tensor
    hook that would rewrite the gradient before it is accumulated, and a backward
    that accumulates into ``.grad`` (not ``autograd.grad()``, which captures the
    gradient, nor one that does not reach this weight)."""
    if weight is not None and not (weight.is_leaf and has_grad_view(weight)):
        return None  # the common refusal first, before any autograd lookup (host time)
    node = ctx.next_functions[1][0]
    weight = getattr(node, "variable", None)  # AccumulateGrad's leaf; None: not a leaf
    if weight is None or weight.dtype != dtype or weight._backward_hooks or _will_engine_execute_node is None:
        return None
    if _is_compiling():
        return None
    try:
        if not _will_engine_execute_node(node):
            return None
    except RuntimeError:  # autograd.grad() captures the gradient: it must not land in .grad
        return None
    taken = take_grad_view(weight)
    return None if taken is None else (weight, *taken)


def _hand_over(target: tuple) -> torch.Tensor:
    """What backward returns for a weight whose dW the GEMM put into its flat
    view (:func:`_flat_wgrad`'s ``target``): the view's memory, for AccumulateGrad to adopt."""
    weight, view, _ = target
    _increment_version(view)  # the kernel wrote it: "has a gradient" (flat.FlatParams)
    weight.grad = None
    return view.detach()


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("tkern::mm", mutates_args=())
def _mm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 accumulation, in ``a``'s dtype (:func:`tkern.matmul`).

    No longer called by tkern.linear's backward (``tkern::mm_backward`` replaced it),
    but kept registered: torch's on-disk AOTAutograd cache keys a compiled graph on its
    forward, so a backward compiled by an earlier tkern still names this op and must
    find it after an upgrade."""
    return matmul(a, b)


@_mm_op.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("tkern::mm_backward", mutates_args=())
def _mm_backward_op(
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor | None,
    activation: str,
    store_a: bool,
    sum_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.gemm.matmul_backward`: ``(A' @ b, A', A'.sum(1))`` with
    ``A' = a * act'(z)`` (``a`` for ``activation="none"``); ``A'`` and the sums are
    empty tensors unless ``store_a`` / ``sum_dtype`` ask for them."""
    act = None if activation == _NO_ACT else activation
    a_out, a_sum = _prologue_outputs(a, store_a, sum_dtype)
    c = matmul_backward(a, b, activation=act, z=z, a_out=a_out, a_sum=a_sum)
    return c, a.new_empty(0) if a_out is None else a_out, a.new_empty(0) if a_sum is None else a_sum


@_mm_backward_op.register_fake
def _(a, b, z, activation, store_a, sum_dtype):
    a_out, a_sum = _prologue_outputs(a, store_a, sum_dtype)
    empty = a.new_empty(0)
    c = a.new_empty((a.shape[0], b.shape[1]))
    return c, empty if a_out is None else a_out, empty if a_sum is None else a_sum


def _mm_backward_traced(a, b, z, activation, store_a, sum_dtype, transpose_a=False):
    """:func:`_mm_backward_checked`'s contract through the custom op (traced backward)."""
    if transpose_a:  # views are free in a traced graph
        c, a_out, a_sum = _mm_backward_op(
            a.t(), b, None if z is None else z.t(), activation or _NO_ACT, store_a, sum_dtype
        )
        return c, a_out.t() if store_a else a_out, a_sum
    return _mm_backward_op(a, b, z, activation or _NO_ACT, store_a, sum_dtype)


@torch.library.custom_op("tkern::activation_grad", mutates_args=())
def _activation_grad_op(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """``dy * act'(z)`` in fp32, in ``dy``'s dtype."""
    return activation_grad(dy, z, activation)


@_activation_grad_op.register_fake
def _(dy, z, activation):
    return torch.empty_like(dy)


@torch.library.custom_op("tkern::linear_forward", mutates_args=())
def _linear_forward_op(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, save_preact: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(x2d @ weight^T + bias), pre-activation)``; the pre-activation is an
    empty tensor unless ``save_preact`` and there is an activation."""
    act = None if activation == _NO_ACT else activation
    preact = None
    if act is not None and save_preact:
        preact = torch.empty((x2d.shape[0], weight.shape[0]), dtype=x2d.dtype, device=x2d.device)
    y = matmul(x2d, weight.t(), bias=bias, activation=act, preact=preact)
    return y, x2d.new_empty(0) if preact is None else preact


@_linear_forward_op.register_fake
def _(x2d, weight, bias, activation, save_preact):
    y = x2d.new_empty((x2d.shape[0], weight.shape[0]))
    keep = activation != _NO_ACT and save_preact
    return y, x2d.new_empty((x2d.shape[0], weight.shape[0]) if keep else 0)


def _linear_setup_context(ctx, inputs, output):
    x2d, weight, bias, activation, save_preact = inputs
    ctx.activation = activation
    ctx.bias_dtype = None if bias is None else bias.dtype
    # the gradient's z: the pre-activation, or ReLU's output where the caller asked for
    # none (activation.GRAD_FROM_OUTPUT; graphs traced before that still ask and get it)
    from_output = not save_preact and activation in GRAD_FROM_OUTPUT
    ctx.save_for_backward(x2d, weight, output[0] if from_output else output[1])


def _linear_backward(ctx, dy, _dpreact):
    x2d, weight, preact = ctx.saved_tensors
    act = None if ctx.activation == _NO_ACT else ctx.activation
    dx, dw, db = _linear_grads(
        dy,
        x2d,
        weight,
        preact,
        act,
        ctx.needs_input_grad[:3],
        ctx.bias_dtype,
        _mm_backward_traced,
        _activation_grad_op,
    )
    return dx, dw, db, None, None


_linear_forward_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def _linear_op(x, weight, bias, activation):
    """:func:`linear` through the custom op (tracing, meta and subclass tensors)."""
    n, k = weight.shape
    save = (
        activation is not None
        and activation not in GRAD_FROM_OUTPUT  # its gradient reads the output
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    )
    y, _ = _linear_forward_op(_as_2d(x, k), weight, bias, activation or _NO_ACT, save)
    return y.reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------- public


def _check_in_features(x: torch.Tensor, weight: torch.Tensor) -> None:
    """x (..., K) against weight (N, K), as both linears take them."""
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must have shape (..., {weight.shape[1]}) to match weight of shape "
            f"{tuple(weight.shape)} (N, K), got shape {tuple(x.shape)}"
        )


def _check_meta(x: torch.Tensor, weight: torch.Tensor) -> None:
    """:func:`check_tensor`'s dtype and rank checks for meta tensors, which compiled
    mode would otherwise refuse for not being CUDA tensors."""
    if weight.dim() != 2 or weight.dtype not in HALF_DTYPES:
        raise TypeError(
            f"weight must be a 2-D fp16 or bf16 tensor, got shape {tuple(weight.shape)}, dtype {weight.dtype}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"x must have dtype in ({weight.dtype}), got dtype {x.dtype}")


def linear_args_plainly_valid(x, weight, bias, activation) -> bool:
    """Whether :func:`linear` may skip its checks: a sufficient condition, cheap to
    test, that every check it makes passes and that the eager path applies (dense
    contiguous plain tensors on one device the current mode runs on, matching
    dtypes and shapes, fewer than 2^31 elements each and in the output). Anything
    else (None of the fast answers) takes the full checks, which name what is wrong."""
    if (
        type(x) is not torch.Tensor
        or not (activation is None or type(activation) is str)
        or activation not in ACTIVATIONS
        or not isinstance(weight, torch.Tensor)
        or weight.dtype not in HALF_DTYPES
        or x.dtype is not weight.dtype
        or weight.dim() != 2
        or x.dim() == 0
        or x.shape[-1] != weight.shape[1]
        or x.layout != torch.strided
        or weight.layout != torch.strided
        or not x.is_contiguous()
        or not weight.is_contiguous()
        or x.device != weight.device
        or (not INTERPRET and not x.is_cuda)
        or x.is_meta
        or _is_compiling()
    ):
        return False
    n, k = weight.shape
    if k == 0:  # act(bias): the checked path
        return False
    m_k = x.numel()  # M * K elements; the weight's are n * k, the output's n * M
    if m_k > INT32_MAX or n * k > INT32_MAX or n * (m_k // k) > INT32_MAX:
        return False
    return bias is None or (
        isinstance(bias, torch.Tensor)
        and bias.dim() == 1
        and bias.shape[0] == n
        and (bias.dtype is weight.dtype or bias.dtype is torch.float32)
        and bias.layout == torch.strided
        and bias.device == x.device
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` like ``torch.nn.functional.linear``, differentiable.

    Forward and backward run on tkern's GEMM with fp32 accumulation: dgrad
    ``dZ @ W``, wgrad ``dZ^T @ X`` with dbias summed in fp32 inside it, the
    activation's gradient ``dZ = dY * act'(Z)`` applied in fp32 from the
    pre-activation saved by the forward pass (ReLU saves its output instead, the
    same mask, as torch's ReLU does; its gradient is applied while the backward
    GEMM loads its operand, the others' in a pass of its own). Under
    ``torch.compile`` the GEMMs are the custom ops ``tkern::linear_forward``
    and ``tkern::mm_backward`` (no graph break); meta tensors get the right output shape
    and dtype. With ``create_graph=True`` the backward is itself differentiable
    (computed with torch operations in fp32, so second-order gradients are exact
    to fp32 rounding).

    Args:
        x: (..., K), fp16 or bf16.
        weight: (N, K), same dtype as ``x``.
        bias: optional (N,), ``x``'s dtype or fp32.
        activation: None, ``"relu"``, ``"gelu"`` (erf form, ``F.gelu``), ``"silu"``
            (``F.silu``) or ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``).

    Returns:
        (..., N) tensor of ``x``'s dtype. ``K == 0`` gives ``act(bias)`` (zeros
        without a bias), as ``torch.nn.functional.linear``.
    """
    if linear_args_plainly_valid(x, weight, bias, activation):  # the common case: every check passes
        y = _Linear.apply(x, weight, bias, activation)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
    if not check_linear_args(x, weight, bias, activation):
        return _linear_op(x, weight, bias, activation)
    y = _Linear.apply(x, weight, bias, activation)  # (M, N)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


def check_linear_args(x, weight, bias, activation) -> bool:
    """Every check :func:`linear` makes, raising ``TypeError``/``ValueError`` that
    names the argument; returns whether the eager path applies (False: the custom
    op, for tracing, meta and tensor subclasses)."""
    if x.is_meta and weight.is_meta and (bias is None or bias.is_meta):
        _check_meta(x, weight)  # meta tensors run nowhere: shapes and dtypes only, in either mode
    else:
        check_tensor("weight", weight, ndim=2, dtypes=HALF_DTYPES)
        check_tensor("x", x, dtypes=(weight.dtype,))
    _check_in_features(x, weight)
    check_bias(bias, weight.shape[0], weight.dtype)
    check_activation(activation)
    check_same_device(x=x, weight=weight, bias=bias)
    if torch.compiler.is_compiling() or x.is_meta or type(x) is not torch.Tensor:
        return False
    # int32 offsets: checked here once for the three GEMMs (forward, dgrad, wgrad)
    check_int32_addressable("x", x)
    check_int32_addressable("weight", weight)
    check_int32_elements("output", (math.prod(x.shape[:-1]), weight.shape[0]))
    return True


# --------------------------------------------------------------------------- fp8 (Float8Linear)
#
# The fp8 casts and GEMM as custom ops, so torch.compile treats them as opaque
# ops with known output shapes; _Float8Linear wires them into forward and
# backward. Granularity is spelled (bm, bk) for blocks, (0, 0) for a tensor.

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _to_float8_impl(x, dtype, bm, bk):
    return to_float8(x, dtype, "tensor" if bm == 0 else (bm, bk))


@torch.library.custom_op("tkern::to_float8", mutates_args=())
def _to_float8_op(x: torch.Tensor, dtype: torch.dtype, bm: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tkern.to_float8` with ``granularity`` (bm, bk), or "tensor" for (0, 0)."""
    return _to_float8_impl(x, dtype, bm, bk)


@_to_float8_op.register_fake
def _(x, dtype, bm, bk):
    if bm == 0:
        return torch.empty_like(x, dtype=dtype), x.new_empty((), dtype=torch.float32)
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=dtype),
        x.new_empty((-(-m // bm), -(-k // bk)), dtype=torch.float32),
    )


@torch.library.custom_op("tkern::to_float8_delayed", mutates_args=("history",))
def _to_float8_delayed_op(
    x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, margin: int, update: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.float8.to_float8_delayed` (rolls ``history`` when ``update``)."""
    return _to_float8_delayed_impl(x, history, dtype, margin, update)


def _to_float8_delayed_impl(x, history, dtype, margin, update):
    return to_float8_delayed(x, history, dtype, margin, update=update)


@_to_float8_delayed_op.register_fake
def _(x, history, dtype, margin, update):
    return torch.empty_like(x, dtype=dtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("tkern::roll_amax_history", mutates_args=("history",))
def _roll_amax_history_op(history: torch.Tensor, amax: torch.Tensor) -> None:
    """:func:`tkern.kernels.float8.roll_amax_history` (max(amax) becomes history[0])."""
    roll_amax_history(history, amax)


@_roll_amax_history_op.register_fake
def _(history, amax):
    return None


@torch.library.custom_op("tkern::scaled_mm", mutates_args=())
def _scaled_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
) -> torch.Tensor:
    """:func:`tkern.scaled_mm`; an empty block list means "not block scales"."""
    return _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b)


def _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, into=None, accumulate=True):
    """:func:`scaled_mm` with the custom op's arguments (``into``: eager callers
    only; the result is added to it with ``accumulate``, else written into it)."""
    return scaled_mm(
        a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
        block_a=tuple(block_a) if block_a else None, block_b=tuple(block_b) if block_b else None,
        out=None if accumulate else into, accumulate_into=into if accumulate else None,
    )  # fmt: skip


@_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


#: DeepSeek-V3's tiles: activations and gradients in (1, 128), weights in (128, 128);
#: wgrad reads x with its tiles along M: (128, 1).
TILE, WEIGHT_BLOCK, TILE_T = (1, 128), (128, 128), (128, 1)


def _blocks(recipe: str) -> tuple[list[int], list[int]]:
    """scaled_mm's (block_a, block_b) for an activation/gradient times a weight."""
    return (list(TILE), list(WEIGHT_BLOCK)) if recipe == "blockwise" else ([], [])


class _Fp8Ops(NamedTuple):
    """The fp8 launchers :class:`_Float8Linear` calls (the custom ops' signatures)."""

    to_float8: Callable
    to_float8_delayed: Callable
    roll_amax_history: Callable
    scaled_mm: Callable


#: The custom ops (torch.compile, meta and fake tensors: opaque ops with known shapes) and
#: the launchers under them (eager: the custom ops' Python dispatch costs tens of us of
#: host time per call, three to five calls per layer and step).
_TRACED_FP8 = _Fp8Ops(_to_float8_op, _to_float8_delayed_op, _roll_amax_history_op, _scaled_mm_op)
_EAGER_FP8 = _Fp8Ops(_to_float8_impl, _to_float8_delayed_impl, roll_amax_history, _scaled_mm_impl)


def _fp8_ops(t: torch.Tensor) -> _Fp8Ops:
    """The launchers for a pass over ``t``: the custom ops while tracing or for
    anything but a plain tensor on a device that runs, else the launchers."""
    plain = type(t) is torch.Tensor and not t.is_meta and not _is_compiling()
    return _EAGER_FP8 if plain else _TRACED_FP8


def _cast(ops: _Fp8Ops, x, dtype, recipe: str, history, margin: int, update: bool, block=TILE):
    """``x`` to fp8 as ``recipe`` casts it: (data, scale)."""
    if recipe == "delayed":
        return ops.to_float8_delayed(x, history, dtype, margin, update)
    if recipe == "blockwise":
        return ops.to_float8(x, dtype, *block)
    return ops.to_float8(x, dtype, 0, 0)


def _dequantize_tiles(data: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """fp32 values of fp8 ``data`` (M, K) with (bm, bk) block ``scale``."""
    m, k = data.shape
    full = scale.repeat_interleave(tile[0], 0)[:m].repeat_interleave(tile[1], 1)[:, :k]
    return data.float() * full


#: The recipes whose weight cast a :class:`Float8WeightCache` holds.
CACHED_SCALINGS = ("tensorwise", "delayed")


class Float8WeightCache:
    """The e4m3 copy of a weight and its scale, written once per optimizer step
    instead of once per forward (issue 17).

    A tensorwise or delayed :class:`tkern.nn.Float8Linear` registers its weight
    (:func:`float8_weight_cache`); a fused optimizer holding that weight calls
    :meth:`refresh` at the end of every ``step()``, after it wrote the new weight,
    so the forward reads the cast instead of casting (with gradient accumulation,
    once per step instead of once per micro-batch; in evaluation, not at all).
    The copy is exactly the cast the forward would make, so results are
    identical to casting in the forward. It is used only while it is the cast of
    the weight as it is: a write from outside the optimizer (loading a
    checkpoint, an in-place edit: it moves the weight's version counter) or new
    storage (``.data =``) makes the forward cast again until the next step
    refreshes it.

    ``"tensorwise"``: the cast is ``to_float8(weight)``, which depends on the
    weight alone.

    ``"delayed"``: the forward's cast takes its scale from the weight's amax
    history *at the time of the forward* and, in training, rolls the weight's
    amax into that history. So :meth:`refresh` casts with the history as it is
    then, without updating it (:func:`~tkern.kernels.float8.to_float8_delayed_deferred`),
    keeping the cast's amax and a stamp of the history (the tensor, its version
    counter and storage). A forward that finds the weight *and* the history
    unchanged since uses the cast; a training forward then makes the update the
    cast would have made (:func:`~tkern.kernels.float8.roll_amax_history`, one
    tiny launch, no host sync), which moves the history, so a second forward
    before the next step (gradient accumulation) casts as without the cache.
    An eval or ``no_grad`` forward uses the cast too (it is bit-identical to
    the cast such a forward makes: the same weight and history, no update) and
    leaves the history, and so the cache, as they were.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        scaling: str = "tensorwise",
        history: Callable[[], torch.Tensor | None] | None = None,
        margin: int = 0,
    ) -> None:
        self._weight = weakref.ref(weight)
        self.configure(scaling, history, margin)

    def configure(
        self,
        scaling: str = "tensorwise",
        history: Callable[[], torch.Tensor | None] | None = None,
        margin: int = 0,
    ) -> None:
        """Set the recipe the cast follows, dropping any cast made before.

        Args:
            scaling: ``"tensorwise"`` or ``"delayed"``.
            history: ``"delayed"`` only: returns the weight's (H,) fp32 amax history
                as it is now (or None: no cast). It should hold the module only
                weakly (``weakref.ref``): the cache lives as long as the weight.
            margin: ``"delayed"``'s margin.
        """
        if scaling not in CACHED_SCALINGS:
            raise ValueError(f"scaling must be one of {CACHED_SCALINGS}, got {scaling!r}")
        if (scaling == "delayed") != (history is not None) or (history is not None and not callable(history)):
            raise ValueError(
                f'history must be a callable returning the amax history for scaling="delayed" '
                f"and None otherwise, got {history!r} with scaling={scaling!r}"
            )
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {margin!r}")
        self.scaling, self.margin, self._history = scaling, margin, history
        self.data: torch.Tensor | None = None  # (N, K) e4m3, the weight's shape
        self.scale: torch.Tensor | None = None  # 0-dim fp32
        self.amax: torch.Tensor | None = None  # "delayed": (P,) fp32, the update the cast put off
        self._stamp: tuple[int, int] | None = None
        self._history_used: torch.Tensor | None = None
        self._history_stamp: tuple[int, int] | None = None

    def recipe(self) -> tuple[str, Callable[[], torch.Tensor | None] | None, int]:
        """``(scaling, history, margin)`` as :meth:`configure` took them."""
        return self.scaling, self._history, self.margin

    def refresh(self) -> None:
        """Cast the weight as it is now (e4m3, one scale); no host sync."""
        weight = self._weight()
        if weight is None:
            return
        self._stamp = None
        with torch.no_grad():
            if self.scaling == "delayed":
                history = self._history()
                if history is None:  # the module is gone or holds no history
                    self._history_used = None
                    return
                cast = to_float8_delayed_deferred(weight.detach(), history, E4M3, self.margin)
                self._history_used = history
                self._history_stamp = (history._version, history.data_ptr())
            else:
                cast = to_float8(weight.detach(), E4M3, "tensor")
            self._keep(cast)
        self._stamp = (weight._version, weight.data_ptr())

    def _keep(self, cast: tuple[torch.Tensor, ...]) -> None:
        """Hold ``cast`` (data, scale[, amax]) in the same tensors step after step:
        copied into the previous step's when their shapes match, so a CUDA graph
        that captured a forward reading them (``Trainer(cuda_graph=True)``) reads
        each replay's cast, not a buffer freed after the capture."""
        pairs = list(zip((self.data, self.scale, self.amax)[: len(cast)], cast, strict=True))
        if all(h is not None and h.shape == c.shape and h.dtype == c.dtype for h, c in pairs):
            for h, c in pairs:
                h.copy_(c)
        else:
            self.data, self.scale = cast[0], cast[1]
            self.amax = cast[2] if len(cast) > 2 else None

    def lookup(
        self, weight: torch.Tensor, history: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """The cast, if it is the one a forward would make of ``weight`` now, else None.

        Args:
            weight: the weight the forward casts.
            history: its amax history under ``"delayed"`` (None under ``"tensorwise"``).

        Returns:
            ``(data, scale)`` (tensorwise) or ``(data, scale, amax)`` (delayed: a
            training forward rolls ``amax`` into ``history``), or None.
        """
        if self._stamp is None or self._stamp != (weight._version, weight.data_ptr()):
            return None
        if self.scaling != "delayed":
            return None if history is not None else (self.data, self.scale)
        if history is None or history is not self._history_used:
            return None
        if self._history_stamp != (history._version, history.data_ptr()):
            return None  # the history moved since the cast (a forward pushed an amax, a load)
        return self.data, self.scale, self.amax


#: id(weight) -> its cache, while the weight lives (tensors cannot key a WeakKeyDictionary:
#: their == is elementwise).
_FLOAT8_WEIGHTS: dict[int, Float8WeightCache] = {}


def float8_weight_cache(
    weight: torch.Tensor,
    *,
    register: bool | None = None,
    scaling: str = "tensorwise",
    history: Callable[[], torch.Tensor | None] | None = None,
    margin: int = 0,
) -> Float8WeightCache | None:
    """The :class:`Float8WeightCache` of ``weight`` (None if it has none). With
    ``register=True`` one is made if missing and set to the recipe given by
    ``scaling``, ``history`` and ``margin`` (see :meth:`Float8WeightCache.configure`;
    an existing cache keeps its identity, so an optimizer holding it still
    refreshes it); with ``register=False`` it is removed."""
    key = id(weight)
    cache = _FLOAT8_WEIGHTS.get(key)
    if cache is not None and cache._weight() is not weight:
        cache = None  # a dead weight's entry whose id was reused
    if register is True:
        if cache is None:
            cache = _FLOAT8_WEIGHTS[key] = Float8WeightCache(weight, scaling, history, margin)
            weakref.finalize(weight, _FLOAT8_WEIGHTS.pop, key, None)
        elif cache.recipe() != (scaling, history, margin):
            cache.configure(scaling, history, margin)
    elif register is False:
        if cache is not None:
            del _FLOAT8_WEIGHTS[key]
        return None
    return cache


class _Float8Linear(torch.autograd.Function):
    """y = x @ W^T + b with fp8 GEMMs (Float8Linear's forward and backward).

    Forward: x and W to e4m3, one scaled GEMM, bias and the output cast in its
    epilogue; x and W are saved in fp8 (with their scales). Backward: the output
    gradient to e5m2 (e4m3 under "blockwise"), dgrad and wgrad as fp8 GEMMs.
    Under "blockwise" the wgrad operands need their tiles along M: dy is cast
    again transposed, and the saved x is converted from 1x128 to 128x1 tiles
    (dequantized and cast again), as DeepSeek-V3 does."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, recipe, margin, update, h_x, h_w, h_g, cached_wq, cached_sw, cached_amax
    ):
        n, k = weight.shape
        x2d = _as_2d(x, k)
        ops = _fp8_ops(x)
        xq, sx = _cast(ops, x2d, E4M3, recipe, h_x, margin, update)
        if cached_wq is not None:  # the optimizer's cast of this very weight (Float8WeightCache)
            wq, sw = cached_wq, cached_sw
            if recipe == "delayed" and update:  # the history update the cast put off
                ops.roll_amax_history(h_w, cached_amax)
        else:
            wq, sw = _cast(ops, weight, E4M3, recipe, h_w, margin, update, WEIGHT_BLOCK)
        sw_b = sw.t() if recipe == "blockwise" else sw
        y = ops.scaled_mm(xq, wq.t(), sx, sw_b, bias, x.dtype, *_blocks(recipe))
        ctx.recipe, ctx.margin, ctx.update = recipe, margin, update
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_shape = x.shape
        ctx.save_for_backward(xq, sx, wq, sw, h_g)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        xq, sx, wq, sw, h_g = ctx.saved_tensors
        recipe = ctx.recipe
        n = wq.shape[0]
        dy2d = _as_2d(dy, n).contiguous()
        ops = _fp8_ops(dy)
        grad_dtype = E4M3 if recipe == "blockwise" else E5M2
        gq, sg = _cast(ops, dy2d, grad_dtype, recipe, h_g, ctx.margin, ctx.update)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K)
            dx = ops.scaled_mm(gq, wq, sg, sw, None, ctx.x_dtype, *_blocks(recipe)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K)
            if recipe == "blockwise":
                gtq, sgt = ops.to_float8(dy2d.t(), E4M3, *TILE)  # tiles along M
                xtq, sxt = ops.to_float8(_dequantize_tiles(xq, sx, TILE).t(), E4M3, *TILE)
                operands = (gtq, xtq.t(), sgt, sxt.t(), None, ctx.w_dtype, list(TILE), list(TILE_T))
            else:
                operands = (gq.t(), xq, sg, sx, None, ctx.w_dtype, [], [])
            target = _flat_wgrad(ctx, ctx.w_dtype) if ops is _EAGER_FP8 else None
            if target is None:
                dw = ops.scaled_mm(*operands)
            else:  # dW added into the fused optimizer's flat buffer (_flat_wgrad)
                _scaled_mm_impl(*operands, into=target[1], accumulate=target[2])
                dw = _hand_over(target)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scaling: str = "tensorwise",
    margin: int = 0,
    update: bool = True,
    histories: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    weight_fp8: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with fp8 GEMMs (see :class:`tkern.nn.Float8Linear`).

    Args:
        x: (..., K) bf16/fp16/fp32; weight: (N, K) of x's dtype; bias: optional (N,).
        scaling: ``"tensorwise"``, ``"delayed"`` or ``"blockwise"``.
        margin, update, histories: delayed scaling's margin, whether to roll this
            step's amaxes into the histories, and the (input, weight, grad_output)
            fp32 amax histories (required for ``"delayed"``).
        weight_fp8: ``weight``'s e4m3 cast, already made (a :class:`Float8WeightCache`'s);
            the forward then does not cast the weight. ``"tensorwise"``: ``(data,
            scale)``, the cast ``to_float8(weight)``; ``"delayed"``: ``(data, scale,
            amax)`` from ``to_float8_delayed_deferred(weight, histories[1], margin=margin)``
            with the weight history unchanged since, and with ``update`` the forward
            rolls ``amax`` into that history (as its own cast would have).
    """
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float32, *HALF_DTYPES))
    check_tensor("x", x, dtypes=(weight.dtype,))
    _check_in_features(x, weight)
    check_bias(bias, weight.shape[0], weight.dtype)
    check_same_device(x=x, weight=weight, bias=bias)
    if scaling not in ("tensorwise", "delayed", "blockwise"):
        raise ValueError(f'scaling must be "tensorwise", "delayed" or "blockwise", got {scaling!r}')
    if scaling == "delayed":
        # all three before the first cast: the casts roll the histories as they go
        if histories is None or len(histories) != 3:
            raise ValueError('scaling="delayed" needs histories=(input, weight, grad_output) amax histories')
        for name, h in zip(("input", "weight", "grad_output"), histories, strict=True):
            check_tensor(f"histories ({name})", h, ndim=1, dtypes=(torch.float32,))
            if h.numel() < 1 or not h.is_contiguous() or h.device != weight.device:
                raise ValueError(
                    f"histories ({name}) must be a contiguous (H,) fp32 tensor with H >= 1 on "
                    f"{weight.device}, got shape {tuple(h.shape)} on {h.device}"
                )
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    cached = (None, None, None)
    if weight_fp8 is not None:
        _check_weight_fp8(weight_fp8, weight, scaling)
        cached = (*weight_fp8, None) if scaling == "tensorwise" else tuple(weight_fp8)
    # three distinct placeholders: Dynamo refuses one tensor passed to several inputs
    h = (
        histories
        if histories is not None
        else tuple(weight.new_empty(0, dtype=torch.float32) for _ in range(3))
    )
    return _Float8Linear.apply(x, weight, bias, scaling, margin, update, *h, *cached)


def _check_weight_fp8(weight_fp8: tuple, weight: torch.Tensor, scaling: str) -> None:
    """float8_linear's ``weight_fp8`` against the weight and the scaling."""
    parts = {"tensorwise": ("data", "scale"), "delayed": ("data", "scale", "amax")}.get(scaling)
    if parts is None:
        raise ValueError(f'weight_fp8 is a tensorwise or delayed cast; scaling is "{scaling}"')
    if not isinstance(weight_fp8, (tuple, list)) or len(weight_fp8) != len(parts):
        raise ValueError(f'weight_fp8 must be ({", ".join(parts)}) under scaling="{scaling}"')
    wq, sw, *amax = weight_fp8
    check_tensor("weight_fp8 data", wq, dtypes=(E4M3,))
    check_tensor("weight_fp8 scale", sw, dtypes=(torch.float32,))
    if wq.shape != weight.shape or sw.numel() != 1 or wq.device != weight.device:
        raise ValueError(
            f"weight_fp8 must be the ({tuple(weight.shape)}) e4m3 weight and a one-element scale on "
            f"{weight.device}, got shapes {tuple(wq.shape)} and {tuple(sw.shape)} on {wq.device}"
        )
    if amax:
        check_tensor("weight_fp8 amax", amax[0], ndim=1, dtypes=(torch.float32,))
        if amax[0].numel() < 1 or not amax[0].is_contiguous() or amax[0].device != weight.device:
            raise ValueError(
                f"weight_fp8 amax must be a contiguous (P,) fp32 tensor with P >= 1 on {weight.device}, "
                f"got shape {tuple(amax[0].shape)} on {amax[0].device}"
            )
