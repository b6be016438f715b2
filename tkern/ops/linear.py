"""The linear family: ``tkern.linear``'s autograd function, its torch.library custom ops
and the functional entry point.

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

import torch
import torch.nn.functional as F

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
    activation_grad_prechecked,
    check_activation,
)
from tkern.kernels.gemm import (
    linear_prechecked,
    linear_residual_prechecked,
    matmul,
    matmul_backward,
    matmul_backward_prechecked,
    plan_for_shape,
    tma_aligned_rows,
)
from tkern.kernels.gemm_epilogue import check_bias
from tkern.kernels.gemm_plan import POINTER, TMA
from tkern.ops import common
from tkern.ops.common import as_2d, check_in_features, is_compiling

__all__ = ["check_linear_args", "linear", "linear_args_plainly_valid", "matmul"]

_NO_ACT = "none"  # how the custom ops spell activation=None (their schema takes a str)


# --------------------------------------------------------------------------- shared pieces


def differentiable_grads(dy, x2d, weight, bias, activation, needs, bias_dtype):
    """The three gradients of ``act(x @ W^T + b)`` with torch operations in fp32,
    each cast once to its input's dtype: what the kernels compute, but recorded
    by autograd (used when grad mode is on in backward)."""
    n, k = weight.shape
    dz = as_2d(dy, n).float()
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


def mm_backward_checked(
    a, b, z, activation, store_a, sum_dtype, transpose_a=False, into=None, accumulate=True, sums_into=None
):
    """The backward GEMM ``A' @ b`` (``A' = a * act'(z)`` with an ``activation``,
    else ``a``) on operands the caller made or checked, with ``A'`` (``store_a``)
    and its fp32 row sums in ``sum_dtype`` (when not None) written on the way:
    ``(A' @ b, A' or None, sums or None)`` (gemm.matmul_backward). With
    ``transpose_a`` the GEMM is ``A'^T @ b``: ``a`` and ``z`` are read transposed in
    place and ``A'`` is returned in ``a``'s layout. ``into``: a tensor the product
    is added to (``accumulate``) or written into, and returned, instead of a new one.
    ``sums_into``: ``(tensor, add)``, where the row sums go instead of a new tensor,
    added to it with ``add`` (only beside a product accumulated into ``into``)."""
    if sums_into is None:
        a_out, a_sum = _prologue_outputs(a, store_a, sum_dtype, transpose_a)
        add_sum = False
    else:
        (a_out, _), (a_sum, add_sum) = _prologue_outputs(a, store_a, None, transpose_a), sums_into
    c = matmul_backward_prechecked(a, b, activation, z, a_out, a_sum, transpose_a, into, accumulate, add_sum)
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
#: summed) on the shapes where, without one, they are planned on the TMA kernel
#: (gemm.plan_for_shape: Hopper, gemm_plan.TMA_MIN_WAVES waves of tiles or more).
#: False: there act' is its own pass and dbias a reduction, so the GEMMs run on the TMA
#: kernel. From the H100 run: the TMA kernel beat the pointer kernel by 1.05-1.49x on
#: the shapes it was measured on (~0.15 ms of a ~0.6 ms 8192 x 4096 x 4096 GEMM), and
#: the prologue configs are pruned to the smaller tiles besides
#: (gemm_configs.PROLOGUE_MAX_ACC); the pass reads dY and Z and writes dZ (~0.06 ms
#: there), the reduction reads dZ (~0.02 ms). A prediction, to be measured on a GPU
#: (the 8 x 4096 MLP's step). Split-K wgrads sum dbias in their K ranges either way.
PROLOGUE_ON_TMA_SHAPES = False


def linear_grads(
    dy, x2d, weight, preact, activation, needs, bias_dtype, mm, act_grad, dw_target=None, db_target=None
):
    """The gradients of ``act(x @ W^T + b)`` for both doors of :func:`linear`, from
    ``dy`` (M, N) and the saved pre-activation ``preact``: dX = dZ @ W, dW = dZ^T @ X
    (dZ^T read in place), db = dZ summed over M in fp32, where dZ = dY * act'(Z).

    At most two GEMM launches (three with a split-K wgrad's reduction): dgrad applies
    act' while loading dY (the operand prologue, for :data:`PROLOGUE_ACTIVATIONS`) and
    its first column of programs stores dZ; wgrad reads that dZ^T and sums dbias from
    its tiles (or its K ranges, split-K); without dgrad, wgrad applies act' to dY^T
    itself (Z^T read in place). Other activations get dZ from ``act_grad`` first. dbias
    alone (weight frozen) is a plain reduction. Where a GEMM is planned on the TMA
    kernel (gemm.plan_for_shape), which has no operand prologue, act' is its own pass
    and dbias a reduction: :data:`PROLOGUE_ON_TMA_SHAPES`. A dZ whose rows a tensor
    descriptor cannot describe (the LM head's dlogits over an odd vocabulary) is
    copied once with aligned rows on a GPU with TMA (gemm.tma_aligned_rows), so that
    neither GEMM falls to the pointer kernel's scalar loads.
    ``mm(a, b, z, activation, store_a, sum_dtype, transpose_a) -> (c, A', sums)`` and
    ``act_grad`` are the launchers (eager) or the custom ops (traced). ``dw_target``
    (eager only): where dW goes in place (:func:`common.flat_wgrad`); ``db_target``
    likewise for db, used where the wgrad GEMM sums it (db is then ``db_target``'s
    view: :func:`common.flat_grads` hands it over) and dW goes into ``dw_target``."""
    need_dx, need_dw = needs[0], needs[1]
    sum_dtype = bias_dtype if needs[2] else None  # None: no bias, or it needs no gradient
    (m, n), k = dy.shape, weight.shape[1]
    dgrad_kernel = plan_for_shape(dy.device, m, k, n).kernel  # dZ (M, N) @ W (N, K)
    wgrad_kernel = plan_for_shape(dy.device, n, k, m).kernel  # dZ^T (N, M) @ X (M, K)
    # act' in the prologue of the first GEMM that reads dY; dbias from wgrad's tiles
    act_kernel = dgrad_kernel if need_dx else wgrad_kernel
    act_in_gemm = PROLOGUE_ON_TMA_SHAPES or act_kernel == POINTER
    sum_in_gemm = sum_dtype if PROLOGUE_ON_TMA_SHAPES or wgrad_kernel != TMA else None
    dz, z, act = dy, None, None  # the GEMMs read dZ, or dY and Z with act' in their prologue
    if activation is not None:
        if activation in PROLOGUE_ACTIVATIONS and (need_dx or need_dw) and act_in_gemm:
            # the prologue reads Z with dY's strides: an expanded or strided dY (y.sum()) is made dense
            dz, z, act = dy if dy.stride() == preact.stride() else dy.contiguous(), preact, activation
        else:
            dz = act_grad(dy, preact, activation)
    if act is None and (need_dx or need_dw):
        dz = tma_aligned_rows(dz)
    dx = dw = db = None
    if need_dx:  # (M, N) @ (N, K); dZ stored for wgrad and dbias when act' was applied here
        store = act is not None and (need_dw or sum_dtype is not None)
        dx, dz_stored, _ = mm(dz, weight, z, act, store, None)
        if act is not None:
            dz, z, act = dz_stored, None, None
    if need_dw:  # (N, M) @ (M, K), dbias from the first column of programs (or the K ranges)
        into = () if dw_target is None else dw_target[1:]  # (view, accumulate)
        sums_target = common.sums_into(dw_target, db_target) if sum_in_gemm is not None else None
        extra = {} if sums_target is None else {"sums_into": sums_target}  # (the traced mm takes none)
        dw, _, sums = mm(dz, x2d, z, act, False, sum_in_gemm, True, *into, **extra)  # dZ^T, Z^T in place
        db = sums if sum_in_gemm is not None else None
    if sum_dtype is not None and db is None:  # dbias alone or beside a TMA wgrad: dZ reduced
        db = dz.sum(0, dtype=torch.float32).to(sum_dtype)
    return dx, dw, db


def layer_grads(ctx, dy, x2d, weight, needs, bias_dtype, index):
    """One layer's ``(dx, dw, db)`` inside a Function over several layers (tkern.ops.mlp's,
    tkern.ops.projections'): :func:`linear_grads` (no activation) on tensors that Function's
    forward made and autograd's gradient, dW and db put into a fused optimizer's flat gradient
    buffer where they may (:func:`common.flat_targets`; the weight is the Function's input ``index``
    and its bias the next, ``ctx.slots`` from :func:`common.next_function_slots`)."""
    targets = common.flat_targets(ctx, needs, weight, bias_dtype, ctx.slots[index], ctx.slots[index + 1])
    mm, act_grad = mm_backward_checked, activation_grad_prechecked  # tensors autograd and forward made
    dx, dw, db = linear_grads(dy, x2d, weight, None, None, needs, bias_dtype, mm, act_grad, *targets)
    return (dx, *common.flat_grads(dw, db, *targets))


def dgrad_into(dy: torch.Tensor, weight: torch.Tensor, dx: torch.Tensor | None) -> torch.Tensor:
    """``dy @ weight`` as a new dX, or with ``dx`` given ``dx += dy @ weight`` (fp32, one
    rounding): layers that read one input summing their input gradients in the dgrad GEMMs."""
    if dx is None:
        return matmul_backward_prechecked(dy, weight, None, None, None, None)
    return matmul_backward_prechecked(dy, weight, None, None, None, None, False, dx, True)


class _Linear(torch.autograd.Function):
    """y = act(x @ W^T + b) as (M, N); every product through :func:`tkern.matmul`.

    The output keeps its 2-D shape here: :func:`linear` gives it x's leading
    dimensions outside the Function, since a view made inside one cannot be
    written in place afterwards (``nn.ReLU(inplace=True)`` after the Linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        x2d = x if x.dim() == 2 else as_2d(x, weight.shape[1])
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
            dx, dw, db = differentiable_grads(dy, x2d, weight, bias, ctx.activation, needs, ctx.bias_dtype)
            return dx if dx is None or ctx.x_shape is None else dx.reshape(ctx.x_shape), dw, db, None
        targets = common.flat_targets(ctx, needs, weight, ctx.bias_dtype)
        dx, dw, db = linear_grads(
            dy,
            x2d,
            weight,
            preact,
            ctx.activation,
            needs,
            ctx.bias_dtype,
            mm_backward_checked,
            activation_grad_prechecked,  # dy from autograd, preact saved by forward
            *targets,
        )
        dw, db = common.flat_grads(dw, db, *targets)  # dW / db in .grad already: autograd adopts that memory
        return dx if dx is None or ctx.x_shape is None else dx.reshape(ctx.x_shape), dw, db, None


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
    """:func:`mm_backward_checked`'s contract through the custom op (traced backward)."""
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
    dx, dw, db = linear_grads(
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


@torch.library.custom_op("tkern::linear_residual", mutates_args=())
def _linear_residual_op(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """``residual + (x2d @ weight^T + bias)``, the add in the GEMM's epilogue (one rounding):
    the traced form of ``tkern.ops.mlp``'s ``residual=``, so a compiled block rounds as the
    eager one does."""
    return linear_residual_prechecked(x2d, weight, bias, residual.contiguous())


@_linear_residual_op.register_fake
def _(x2d, weight, bias, residual):
    return x2d.new_empty((x2d.shape[0], weight.shape[0]))


def _linear_residual_setup_context(ctx, inputs, output):
    x2d, weight, bias, _ = inputs
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x2d, weight)


def _linear_residual_backward(ctx, dy):
    x2d, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mm, act_grad = _mm_backward_traced, _activation_grad_op
    dx, dw, db = linear_grads(dy, x2d, weight, None, None, needs[:3], ctx.bias_dtype, mm, act_grad)
    return dx, dw, db, dy if needs[3] else None


_linear_residual_op.register_autograd(_linear_residual_backward, setup_context=_linear_residual_setup_context)


def linear_residual_traced(x, weight, bias, residual):
    """``residual + linear(x, weight, bias)`` through the custom op ``tkern::linear_residual``
    (tracing, meta tensors): the add in the GEMM's epilogue, as the eager fused blocks
    compute it. ``x`` (..., K), ``residual`` (..., N), both of ``weight``'s dtype (checked by
    the caller)."""
    n, k = weight.shape
    y = _linear_residual_op(as_2d(x, k), weight, bias, residual.reshape(-1, n))
    return y.reshape(*x.shape[:-1], n)


def _linear_op(x, weight, bias, activation):
    """:func:`linear` through the custom op (tracing, meta and subclass tensors)."""
    n, k = weight.shape
    save = (
        activation is not None
        and activation not in GRAD_FROM_OUTPUT  # its gradient reads the output
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    )
    y, _ = _linear_forward_op(as_2d(x, k), weight, bias, activation or _NO_ACT, save)
    return y.reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------- public


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
        or is_compiling()
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
    check_in_features(x, weight)
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
