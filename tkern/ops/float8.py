"""The fp8 family: Float8Linear's autograd function, its custom ops and the weight cache.

The fp8 casts and GEMM are custom ops, so torch.compile treats them as opaque
ops with known output shapes; ``_Float8Linear`` wires them into forward and
backward. Granularity is spelled (bm, bk) for blocks, (0, 0) for a tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from tkern.kernels._common import HALF_DTYPES, check_same_device, check_tensor
from tkern.kernels.float8 import (
    check_fp8_device,
    roll_amax_history,
    to_float8,
    to_float8_delayed,
    to_float8_delayed_deferred,
)
from tkern.kernels.gemm import scaled_mm
from tkern.kernels.gemm_epilogue import check_bias
from tkern.ops import common
from tkern.ops.common import as_2d, check_in_features, is_compiling

__all__ = ["CACHED_SCALINGS", "Float8WeightCache", "float8_linear", "float8_weight_cache"]

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
    plain = type(t) is torch.Tensor and not t.is_meta and not is_compiling()
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
        x2d = as_2d(x, k)
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
        dy2d = as_2d(dy, n).contiguous()
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
            target = common.flat_wgrad(ctx, ctx.w_dtype) if ops is _EAGER_FP8 else None
            if target is None:
                dw = ops.scaled_mm(*operands)
            else:  # dW added into the fused optimizer's flat buffer (_flat_wgrad)
                _scaled_mm_impl(*operands, into=target[1], accumulate=target[2])
                dw = common.hand_over(target)
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
    check_in_features(x, weight)
    check_bias(bias, weight.shape[0], weight.dtype)
    check_same_device(x=x, weight=weight, bias=bias)
    check_fp8_device(x.device, "float8_linear (Float8Linear)")
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
