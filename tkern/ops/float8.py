"""The fp8 family: Float8Linear's autograd function, its custom ops and the weight cache.

The fp8 casts and GEMM are custom ops, so torch.compile treats them as opaque
ops with known output shapes; ``_Float8Linear`` wires them into forward and
backward (eager calls the launchers under them directly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from tkern.kernels._common import HALF_DTYPES, check_same_device, check_tensor
from tkern.kernels.activation import activation_grad_prechecked
from tkern.kernels.float8 import (
    SCALE_TILE,
    block_scales,
    cast_2d_prechecked,
    cast_blocks,
    cast_tiles,
    cast_tiles_prechecked,
    check_fp8_device,
    native_formats,
    roll_amax_history,
    roll_amax_history_prechecked,
)
from tkern.kernels.gemm import scaled_mm
from tkern.kernels.gemm_epilogue import check_bias
from tkern.ops import common
from tkern.ops import linear as _linear  # noqa: F401 (registers tkern::activation_grad)
from tkern.ops.common import as_2d, check_in_features, launches_directly
from tkern.ops.float8_args import (
    CACHED_SCALINGS,
    E4M3,
    E5M2,
    WEIGHT_CACHE_SCALINGS,
    Float8Input,
    check_activation_args,
    check_delayed_args,
    check_gemm_reach,
    check_scaling,
    check_weight_fp8,
    check_x_fp8,
    recipe_formats,
)
from tkern.ops.float8_cache import Float8WeightCache, float8_weight_cache
from tkern.ops.float8_emit import Float8Emit, check_emit_args, emitted_pair, scaled_mm_emit
from tkern.ops.float8_mx import mx_float8_linear

__all__ = [
    "CACHED_SCALINGS",
    "WEIGHT_CACHE_SCALINGS",
    "Float8Input",
    "Float8WeightCache",
    "float8_linear",
    "float8_weight_cache",
]


def _cast_2d_impl(x, dtype, store, store_t, sum_dtype, history, counter, margin, update, roll2=None):
    """:func:`tkern.kernels.float8.cast_2d`: ``(data, data_t, scale, col_sum)``, the
    ones not asked for None (``sum_dtype`` None: no column sums; ``history`` None:
    current scaling)."""
    cast = cast_2d_prechecked(
        x, dtype, store, store_t, sum_dtype, history, margin, update, False, counter, roll2
    )
    return cast.data, cast.data_t, cast.scale, cast.col_sum


@torch.library.custom_op("tkern::float8_cast_2d", mutates_args=("history", "counter"))
def _cast_2d_op(
    x: torch.Tensor,
    dtype: torch.dtype,
    store: bool,
    store_t: bool,
    col_sum: bool,
    sum_dtype: torch.dtype,
    history: torch.Tensor | None,
    counter: torch.Tensor | None,
    margin: int,
    update: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.float8.cast_2d` (rolls ``history`` when given and ``update``);
    outputs not asked for come back empty."""
    out = _cast_2d_impl(
        x, dtype, store, store_t, sum_dtype if col_sum else None, history, counter, margin, update
    )
    # a new empty tensor for each output not asked for: a custom op's outputs may not alias
    return tuple(x.new_empty(0, dtype=dtype) if t is None else t for t in out)


@_cast_2d_op.register_fake
def _(x, dtype, store, store_t, col_sum, sum_dtype, history, counter, margin, update):
    m, k = x.shape
    return (
        x.new_empty((m, k) if store else (0,), dtype=dtype),
        x.new_empty((k, m) if store_t else (0,), dtype=dtype),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((k,) if col_sum else (0,), dtype=sum_dtype if col_sum else dtype),
    )


def _cast_2d_traced(x, dtype, store, store_t, sum_dtype, history, counter, margin, update, roll2=None):
    """:func:`_cast_2d_impl` through the custom op (None where nothing was asked for)."""
    if roll2 is not None:  # the weight's deferred update: its own op here (eager rides the cast)
        _roll_amax_history_op(*roll2)
    out = _cast_2d_op(
        x, dtype, store, store_t, sum_dtype is not None, sum_dtype or torch.float32, history,
        counter, margin, update,
    )  # fmt: skip
    wanted = (store, store_t, True, sum_dtype is not None)
    return tuple(t if w else None for t, w in zip(out, wanted, strict=True))


def _cast_blocks_impl(x, dtype, bm, bk, store_t):
    return cast_blocks(x, dtype, (bm, bk), store_t)


@torch.library.custom_op("tkern::float8_cast_blocks", mutates_args=())
def _cast_blocks_op(
    x: torch.Tensor, dtype: torch.dtype, bm: int, bk: int, store_t: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.float8.cast_blocks` (an empty third output without ``store_t``)."""
    data, scale, data_t = _cast_blocks_impl(x, dtype, bm, bk, store_t)
    return data, scale, x.new_empty(0, dtype=dtype) if data_t is None else data_t


@_cast_blocks_op.register_fake
def _(x, dtype, bm, bk, store_t):
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=dtype),
        x.new_empty((-(-m // bm), -(-k // bk)), dtype=torch.float32),
        x.new_empty((k, m) if store_t else (0,), dtype=dtype),
    )


def _cast_tiles_impl(x, dtype, store_t, sum_dtype):
    """:func:`tkern.kernels.float8.cast_tiles`: ``(data, scale, data_t, scale_t, col_sum)``."""
    return tuple(cast_tiles(x, dtype, store_t, sum_dtype))


@torch.library.custom_op("tkern::float8_cast_tiles", mutates_args=())
def _cast_tiles_op(
    x: torch.Tensor, dtype: torch.dtype, store_t: bool, col_sum: bool, sum_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tkern.kernels.float8.cast_tiles` (outputs not asked for come back empty)."""
    out = _cast_tiles_impl(x, dtype, store_t, sum_dtype if col_sum else None)
    return tuple(x.new_empty(0, dtype=dtype) if t is None else t for t in out)


@_cast_tiles_op.register_fake
def _(x, dtype, store_t, col_sum, sum_dtype):
    m, k = x.shape
    row_bands, col_bands = -(-m // SCALE_TILE), -(-k // SCALE_TILE)
    return (
        x.new_empty((m, k), dtype=dtype),
        block_scales((m, col_bands), True, x.device),
        x.new_empty((k, m) if store_t else (0,), dtype=dtype),
        block_scales((k, row_bands), True, x.device) if store_t else x.new_empty(0, dtype=dtype),
        x.new_empty((k,), dtype=sum_dtype) if col_sum else x.new_empty(0, dtype=dtype),
    )


def _cast_tiles_traced(x, dtype, store_t, sum_dtype):
    """:func:`_cast_tiles_impl` through the custom op (None where nothing was asked for)."""
    out = _cast_tiles_op(x, dtype, store_t, sum_dtype is not None, sum_dtype or torch.float32)
    wanted = (True, True, store_t, store_t, sum_dtype is not None)
    return tuple(t if w else None for t, w in zip(out, wanted, strict=True))


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
    use_fast_accum: bool,
    activation: str | None = None,
    store_preact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tkern.scaled_mm`: ``(result, pre-activation)``, the pre-activation empty unless
    ``store_preact``; an empty block list means "not block scales" (``activation`` and
    ``store_preact`` take per-tensor or per-row scales)."""
    if activation is None and not store_preact:
        y = _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum)
        return y, a.new_empty(0, dtype=out_dtype)
    y, preact = _scaled_mm_act_impl(
        a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, activation, store_preact
    )
    return y, a.new_empty(0, dtype=out_dtype) if preact is None else preact


@_scaled_mm_op.register_fake
def _(
    a,
    b,
    scale_a,
    scale_b,
    bias,
    out_dtype,
    block_a,
    block_b,
    use_fast_accum,
    activation=None,
    store_preact=False,
):
    shape = (a.shape[0], b.shape[1])
    return a.new_empty(shape, dtype=out_dtype), a.new_empty(shape if store_preact else (0,), dtype=out_dtype)


def _scaled_mm_impl(
    a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum, into=None, accumulate=True,
    prechecked=False,
):  # fmt: skip
    """:func:`scaled_mm` with the custom op's arguments (``into``: eager callers
    only; the result is added to it with ``accumulate``, else written into it)."""
    return scaled_mm(
        a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
        block_a=tuple(block_a) if block_a else None, block_b=tuple(block_b) if block_b else None,
        out=None if accumulate else into, accumulate_into=into if accumulate else None,
        use_fast_accum=use_fast_accum, prechecked=prechecked,
    )  # fmt: skip


def _scaled_mm_act_impl(
    a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, activation, store_preact, prechecked=False
):  # fmt: skip
    """:func:`scaled_mm` with ``activation`` in its epilogue: ``(y, pre-activation or None)``."""
    preact = None
    if store_preact:
        preact = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    y = scaled_mm(
        a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        activation=activation, preact=preact, prechecked=prechecked,
    )  # fmt: skip
    return y, preact


def _scaled_mm_eager(
    a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum, into=None, accumulate=True
):  # fmt: skip
    """:func:`_scaled_mm_impl` on the eager path: the operands are the forward's and
    backward's own casts, of the shapes and devices :func:`float8_linear` checked, so the
    GEMM checks nothing again (``scaled_mm(prechecked=True)``)."""
    args = (bias, out_dtype, block_a, block_b, use_fast_accum, into, accumulate)
    return _scaled_mm_impl(a, b, scale_a, scale_b, *args, prechecked=True)


def _scaled_mm_act_eager(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, activation, store_preact):
    """:func:`_scaled_mm_act_impl` on the eager path (:func:`_scaled_mm_eager`'s reason)."""
    args = (bias, out_dtype, use_fast_accum, activation, store_preact)
    return _scaled_mm_act_impl(a, b, scale_a, scale_b, *args, prechecked=True)


def _cast_tiles_eager(x, dtype, store_t, sum_dtype):
    """:func:`_cast_tiles_impl` on the eager path: x (M, K) is float8_linear's checked input
    (or dY of its output), so the cast's checks are not made again."""
    return tuple(cast_tiles_prechecked(x, dtype, store_t, sum_dtype))


def _scaled_mm_traced(a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum):
    """:func:`_scaled_mm_impl` through the custom op: the result."""
    return _scaled_mm_op(a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum)[0]


def _scaled_mm_act_traced(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, activation, store_preact):
    """:func:`_scaled_mm_act_impl` through the custom op (None for a pre-activation not stored)."""
    y, preact = _scaled_mm_op(
        a, b, scale_a, scale_b, bias, out_dtype, [], [], use_fast_accum, activation, store_preact
    )
    return y, preact if store_preact else None


def _activation_grad_traced(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`~tkern.kernels.activation.activation_grad` through its custom op (ops/linear.py's)."""
    return torch.ops.tkern.activation_grad(dy, z, activation)


#: DeepSeek-V3's tiles: activations and gradients in (1, 128), weights in (128, 128);
#: wgrad reads x with its tiles along M: (128, 1).
TILE, WEIGHT_BLOCK, TILE_T = (1, 128), (128, 128), (128, 1)
#: The forward keeps the fp8 tensor cores' fast accumulation; dgrad and wgrad sum over
#: many more products (K = the tokens for wgrad) and promote every K tile (<= 128).
FORWARD_FAST_ACCUM, GRADIENT_FAST_ACCUM = True, False


class _Fp8Ops(NamedTuple):
    """The fp8 launchers :class:`_Float8Linear` calls (the custom ops' signatures)."""

    cast_2d: Callable
    cast_blocks: Callable
    cast_tiles: Callable
    roll_amax_history: Callable
    scaled_mm: Callable
    scaled_mm_act: Callable
    activation_grad: Callable


#: The custom ops (torch.compile, meta and fake tensors: opaque ops with known shapes) and
#: the launchers under them (eager: the custom ops' Python dispatch costs tens of us of
#: host time per call, three to five calls per layer and step).
_TRACED_FP8 = _Fp8Ops(
    _cast_2d_traced, _cast_blocks_op, _cast_tiles_traced, _roll_amax_history_op, _scaled_mm_traced,
    _scaled_mm_act_traced, _activation_grad_traced,
)  # fmt: skip
_EAGER_FP8 = _Fp8Ops(
    _cast_2d_impl, _cast_blocks_impl, _cast_tiles_eager, roll_amax_history_prechecked, _scaled_mm_eager,
    _scaled_mm_act_eager, activation_grad_prechecked,
)  # fmt: skip


def _fp8_ops(t: torch.Tensor) -> _Fp8Ops:
    """The launchers for a pass over ``t``: the custom ops while tracing or for
    anything but a plain tensor on a device that runs, else the launchers."""
    return _EAGER_FP8 if launches_directly(t) else _TRACED_FP8


class _Float8Call(NamedTuple):
    """The configuration one :func:`float8_linear` call hands :class:`_Float8Linear` beside
    its tensors, in one frozen argument: the recipe and its knobs (none of them a tensor
    autograd tracks; ``emit``'s state is written by the launch, not differentiated)."""

    recipe: str  # "tensorwise", "delayed" or "blockwise"
    margin: int = 0  # delayed: the power of two kept below fp8_max
    update: bool = True  # delayed: roll this step's amaxes into the histories
    grad_enabled: bool = True  # grad mode at the call (forward itself runs without it)
    activation: str | None = None  # the forward GEMM's epilogue activation
    emit: Float8Emit | None = None  # the next fp8 layer's input cast, written by the epilogue
    e4m3: torch.dtype = E4M3  # x's and W's format: the device's native e4m3 (FNUZ on a gfx942)
    e5m2: torch.dtype = E5M2  # dY's (tensorwise, delayed): the device's native e5m2


class _WeightCast(NamedTuple):
    """The optimizer's cast of the weight (:class:`Float8WeightCache`), handed to the forward
    instead of casting it there: e4m3 ``data`` (N, K), its ``scale``, ``data_t`` (K, N) or
    None (one copy when dgrad needs it), and delayed's deferred ``amax`` or None."""

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None
    amax: torch.Tensor | None


def _per_tensor_casts(ops, x2d, weight, call, histories, counters, cached, given, dgrad, wgrad):
    """The tensorwise / delayed forward's fp8 operands: ``((xq, xq^T or None, sx), (wq, sw,
    wq^T or None), the grad cast's counter)``, each cast made here or taken from ``given``
    (x's producer's) / ``cached`` (the optimizer's); delayed's histories rolled in the casts'
    launches (the cached weight's deferred amax too)."""
    delayed = call.recipe == "delayed"
    h_x, h_w, _ = histories if delayed else (None, None, None)
    eager = ops is _EAGER_FP8
    ctr = (None,) * 3 if counters is None or not eager else tuple(counters[i : i + 1] for i in range(3))
    amax = None if cached is None else cached.amax
    roll2 = (h_w, amax) if delayed and call.update and amax is not None else None
    if given is None:
        xq, saved_x, sx, _ = ops.cast_2d(
            x2d, call.e4m3, True, wgrad, None, h_x, ctr[0], call.margin, call.update, roll2
        )
    else:  # x's producer cast it (and recorded its amax); the weight's update on its own
        xq, saved_x, sx = given
        if wgrad and saved_x is None:  # a cast without x^T: one copy
            saved_x = xq.t().contiguous()
        if roll2 is not None:
            ops.roll_amax_history(*roll2)
    if cached is not None:  # the optimizer's cast of this very weight (Float8WeightCache)
        wq, sw, wq_t = cached.data, cached.scale, cached.data_t
        if dgrad and wq_t is None:  # a cast without W^T (FSDP2's fp8 all-gather): one copy
            wq_t = wq.t().contiguous()
    else:
        wq, wq_t, sw, _ = ops.cast_2d(
            weight, call.e4m3, True, dgrad, None, h_w, ctr[1], call.margin, call.update
        )
    return (xq, saved_x, sx), (wq, sw, wq_t), ctr[2]


class _Float8Linear(torch.autograd.Function):
    """y = x @ W^T + b with fp8 GEMMs (Float8Linear's forward and backward).

    Every fp8 GEMM operand is K-major (what Hopper's fp8 wgmma reads from shared
    memory, loaded with cp.async, pipelined): each cast writes the layouts its
    GEMMs read in the same pass. Forward: x to e4m3 (and x^T, for wgrad), W to
    e4m3 (and W^T, for dgrad; or the optimizer's cast of both, Float8WeightCache),
    one scaled GEMM x @ W^T with the bias and the output cast in its epilogue; x^T
    and W^T are saved in fp8. Backward: dY to e5m2 as dY (dgrad) and dY^T (wgrad)
    with the bias gradient summed in the same pass, dgrad dY @ W and wgrad
    dY^T @ X promoting their accumulators every K tile. Delayed scaling records
    each amax in its history within the cast's own launch.

    Under "blockwise" (e4m3 everywhere) the wgrad operands need their tiles along
    M: x^T (in the forward) and dY^T are cast in 1x128 tiles in the same read as x's
    and dY's own tiles (dY's with the bias gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias, call: _Float8Call, histories, counters, cached, given):
        n, k = weight.shape
        x2d = as_2d(x, k)
        ops = _fp8_ops(x)
        # what backward will run (forward itself runs with grad mode off)
        dgrad = call.grad_enabled and ctx.needs_input_grad[0]
        wgrad = call.grad_enabled and ctx.needs_input_grad[1]
        h_g = None if histories is None else histories[2]
        preact = emitted = ctx.counter = None
        if call.recipe == "blockwise":
            # x in 1x128 tiles and, for wgrad (which reads x with its tiles along M), x^T in
            # 1x128 tiles along M: one read of x
            xq, sx, saved_x, saved_sx, _ = ops.cast_tiles(x2d, call.e4m3, wgrad, None)
            wq, sw, wq_t = ops.cast_blocks(weight, call.e4m3, *WEIGHT_BLOCK, dgrad)
            y = ops.scaled_mm(xq, wq.t(), sx, sw.t(), bias, x.dtype, list(TILE), list(WEIGHT_BLOCK), True)
        else:
            (xq, saved_x, sx), (wq, sw, wq_t), ctx.counter = _per_tensor_casts(
                ops, x2d, weight, call, histories, counters, cached, given, dgrad, wgrad
            )
            saved_sx = sx
            # the epilogue's activation keeps its input (bf16 / fp16) for act' in backward
            store = call.activation is not None and call.grad_enabled and any(ctx.needs_input_grad[:3])
            if call.emit is not None:  # the epilogue also writes the next layer's input (eager only)
                y, preact, emitted = scaled_mm_emit(
                    xq, wq.t(), sx, sw, bias, x.dtype, FORWARD_FAST_ACCUM, call.activation, store, call.emit
                )
            elif call.activation is None:
                y = ops.scaled_mm(xq, wq.t(), sx, sw, bias, x.dtype, [], [], FORWARD_FAST_ACCUM)
            else:
                y, preact = ops.scaled_mm_act(
                    xq, wq.t(), sx, sw, bias, x.dtype, FORWARD_FAST_ACCUM, call.activation, store
                )
        ctx.call = call
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_shape = x.shape
        ctx.save_for_backward(saved_x, saved_sx, wq_t if dgrad else None, sw, h_g, preact)
        y = y.reshape(*x.shape[:-1], n)
        if emitted is None:
            return y
        data_t = emitted.data_t if emitted.data_t is not None else emitted.data.new_empty(0)
        ctx.set_materialize_grads(False)  # no zero gradients made for the fp8 outputs (the norm's way)
        ctx.mark_non_differentiable(emitted.data, data_t, emitted.scale)
        return y, emitted.data, data_t, emitted.scale

    @staticmethod
    def backward(ctx, dy, *_emitted):
        x_saved, sx, wq_t, sw, h_g, preact = ctx.saved_tensors
        call = ctx.call
        recipe = call.recipe
        dy2d = as_2d(dy, dy.shape[-1])
        ops = _fp8_ops(dy)
        if call.activation is not None:  # dZ = dY * act'(Z) in fp32, rounded once: what the casts read
            dy2d = ops.activation_grad(dy2d, preact, call.activation)
        dgrad, wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        bias_grad = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        dx = dw = db = None
        if recipe == "blockwise":
            # dY and dY^T (wgrad's, tiles along M) in 1x128 tiles and the bias gradient: one read
            sum_dtype = ctx.bias_dtype if bias_grad else None
            gq, sg, gq_t, sg_t, db = ops.cast_tiles(dy2d, call.e4m3, wgrad, sum_dtype)
            blocks = (list(TILE), list(WEIGHT_BLOCK))
        else:
            delayed = recipe == "delayed"
            sum_dtype = ctx.bias_dtype if bias_grad else None
            gq, gq_t, sg, db = ops.cast_2d(
                dy2d,
                call.e5m2,
                dgrad,
                wgrad,
                sum_dtype,
                h_g if delayed else None,
                ctx.counter,
                call.margin,
                call.update,
            )
            blocks = ([], [])
        if dgrad:  # (M, N) @ (N, K): W^T's cast read K-major
            dx = ops.scaled_mm(gq, wq_t.t(), sg, sw, None, ctx.x_dtype, *blocks, GRADIENT_FAST_ACCUM)
            dx = dx.reshape(ctx.x_shape)
        if wgrad:  # (N, M) @ (M, K): dY^T and X^T's casts read K-major
            if recipe == "blockwise":
                operands = (gq_t, x_saved.t(), sg_t, sx.t(), None, ctx.w_dtype, list(TILE), list(TILE_T))
            else:
                operands = (gq_t, x_saved.t(), sg, sx, None, ctx.w_dtype, [], [])
            target = common.flat_wgrad(ctx, ctx.w_dtype) if ops is _EAGER_FP8 else None
            if target is None:
                dw = ops.scaled_mm(*operands, GRADIENT_FAST_ACCUM)
            else:  # dW added into the fused optimizer's flat buffer (_flat_wgrad)
                _scaled_mm_eager(*operands, GRADIENT_FAST_ACCUM, into=target[1], accumulate=target[2])
                dw = common.hand_over(target)
        return dx, dw, db, None, None, None, None, None


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
    weight_fp8_t: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    x_fp8: Float8Input | None = None,
    activation: str | None = None,
    emit_fp8: Float8Emit | None = None,
    grad_dtype: torch.dtype = E4M3,
) -> torch.Tensor | tuple[torch.Tensor, Float8Input]:
    """``act(x @ weight.T + bias)`` with fp8 GEMMs (see :class:`tkern.nn.Float8Linear`).

    Args:
        x: (..., K) bf16/fp16/fp32; weight: (N, K) of x's dtype; bias: optional (N,).
        scaling: ``"tensorwise"``, ``"delayed"``, ``"blockwise"`` or ``"mxfp8"`` (float8_mx.py),
            whose dY is cast to ``grad_dtype`` (e4m3 or e5m2; fixed in the other recipes).
        margin, update, histories: delayed scaling's margin, whether to roll this
            step's amaxes into the histories, and the (input, weight, grad_output)
            fp32 amax histories (required for ``"delayed"``).
        weight_fp8: ``weight``'s e4m3 cast, already made (a :class:`Float8WeightCache`'s);
            the forward then does not cast the weight. ``"tensorwise"``: ``(data,
            scale)``, the cast ``to_float8(weight)``; ``"delayed"``: ``(data, scale,
            amax)`` from ``to_float8_delayed_deferred(weight, histories[1], margin=margin)``
            with the weight history unchanged since, and with ``update`` the forward
            rolls ``amax`` into that history (in its input's cast launch); ``amax``
            None: that update was made already (by x's producer, in its launch). ``"mxfp8"``:
            ``(data, scale, scale_t)`` of ``to_mx_both(weight)``, ``weight_fp8_t`` its ``data_t``.
        weight_fp8_t: with ``weight_fp8``: its transpose, (K, N) contiguous (dgrad's operand); None: one copy.
        counters: ``"delayed"``: a (3,) int32 tensor of zeros the three casts count
            their programs on (and leave at zero), kept by the layer; None: each cast
            makes its own.
        x_fp8: x's e4m3 cast made by x's producer (:class:`Float8Input`), exactly the
            cast this function would make (``"tensorwise"``: ``to_float8(x)``;
            ``"delayed"``: with ``histories[0]``, into which the producer recorded x's
            amax when ``update``); the forward then does not cast x (x itself still
            flows through autograd, for dgrad). ``data_t`` None: wgrad makes x^T's
            cast with one copy.
        emit_fp8: a :class:`~tkern.kernels.gemm_emit.Float8Emit` (the next fp8 layer's
            recipe and scaling state): the forward GEMM's epilogue also writes that
            layer's input cast (:func:`tkern.scaled_mm`'s ``emit_fp8``) and the call
            returns ``(y, Float8Input)``, the cast to hand to that layer as its ``x_fp8``
            with ``y`` as its ``x``. Tensorwise / delayed, bf16 / fp16, eager only.
    """
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float32, *HALF_DTYPES))
    check_tensor("x", x, dtypes=(weight.dtype,))
    check_in_features(x, weight)
    check_bias(bias, weight.shape[0], weight.dtype)
    check_same_device(x=x, weight=weight, bias=bias)
    check_scaling(scaling)
    if scaling == "mxfp8":  # e8m0 blocks of 32 along each GEMM's K (its device check: native MX)
        return mx_float8_linear(x, weight, bias, grad_dtype=grad_dtype, weight_fp8=weight_fp8,
                                weight_fp8_t=weight_fp8_t, unused=(activation, emit_fp8, x_fp8))  # fmt: skip
    check_fp8_device(
        x.device, f"float8_linear (Float8Linear, {scaling!r})", recipe_formats(scaling, x.device)
    )
    check_activation_args(activation, scaling, weight.dtype)
    check_emit_args(emit_fp8, x, weight, scaling)
    if scaling == "delayed":  # all three histories before the first cast: the casts roll them as they go
        check_delayed_args(histories, margin, counters, weight)
    e4m3, e5m2 = native_formats(x.device, (E4M3, E5M2))  # FNUZ on a gfx942
    if x_fp8 is not None:
        check_x_fp8(x_fp8, x, weight, scaling, e4m3)
    cached = None
    if weight_fp8 is not None:
        check_weight_fp8(weight_fp8, weight, scaling, weight_fp8_t, e4m3)
        amax = weight_fp8[2] if scaling == "delayed" else None
        cached = _WeightCast(weight_fp8[0], weight_fp8[1], weight_fp8_t, amax)
    check_gemm_reach(x, weight)  # int32 offsets: once here for the three GEMMs (fwd, dgrad, wgrad)
    call = _Float8Call(scaling, margin, update, torch.is_grad_enabled(), activation, emit_fp8, e4m3, e5m2)
    out = _Float8Linear.apply(x, weight, bias, call, histories, counters, cached, x_fp8)
    return out if emit_fp8 is None else emitted_pair(out, emit_fp8)
