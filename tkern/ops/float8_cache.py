"""The fp8 copy of a weight that a fused optimizer writes once per step
(:class:`Float8WeightCache`) and the registry that finds it by weight
(:func:`float8_weight_cache`); :func:`tkern.ops.float8.float8_linear` reads it."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from tkern.kernels.float8 import Float8Cast, cast_2d, native_e4m3
from tkern.kernels.mx import to_mx_both
from tkern.ops.float8_args import E4M3, WEIGHT_CACHE_SCALINGS
from tkern.ops.float8_mx import MX_SCALE_MODE


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

    The cast holds the weight in both layouts (``data`` and ``data_t``, one pass:
    :func:`~tkern.kernels.float8.cast_2d`), the forward's and dgrad's K-major operands.

    ``"tensorwise"``: the cast is ``to_float8(weight)``, which depends on the
    weight alone.

    ``"mxfp8"``: the weight's two MX casts from one read (``to_mx_both``, e4m3, the
    recipe's scale rule): along K (``data``, ``scale``: the forward's operand) and along
    N (``data_t``, ``scale_t``: dgrad's), as the recipe's forward would make them.

    ``"delayed"``: the forward's cast takes its scale from the weight's amax
    history *at the time of the forward* and, in training, rolls the weight's
    amax into that history. So :meth:`refresh` casts with the history as it is
    then, without updating it (:func:`~tkern.kernels.float8.to_float8_delayed_deferred`),
    keeping the cast's amax and a stamp of the history (the tensor, its version
    counter and storage). A forward that finds the weight *and* the history
    unchanged since uses the cast; a training forward then makes the update the
    cast would have made (inside the launch that casts its input, no host sync;
    :func:`~tkern.kernels.float8.roll_amax_history` where traced), which moves the
    history, so a second forward before the next step (gradient accumulation) casts as without the cache.
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
            scaling: ``"tensorwise"``, ``"delayed"`` or ``"mxfp8"``.
            history: ``"delayed"`` only: returns the weight's (H,) fp32 amax history
                as it is now (or None: no cast). It should hold the module only
                weakly (``weakref.ref``): the cache lives as long as the weight.
            margin: ``"delayed"``'s margin.
        """
        if scaling not in WEIGHT_CACHE_SCALINGS:
            raise ValueError(f"scaling must be one of {WEIGHT_CACHE_SCALINGS}, got {scaling!r}")
        if (scaling == "delayed") != (history is not None) or (history is not None and not callable(history)):
            raise ValueError(
                f'history must be a callable returning the amax history for scaling="delayed" '
                f"and None otherwise, got {history!r} with scaling={scaling!r}"
            )
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {margin!r}")
        self.scaling, self.margin, self._history = scaling, margin, history
        self.data: torch.Tensor | None = None  # e4m3, the weight's shape, contiguous
        self.data_t: torch.Tensor | None = None  # e4m3, its transpose, contiguous (the same values)
        self.scale: torch.Tensor | None = None  # 0-dim fp32 ("mxfp8": (N, K/32) e8m0)
        self.scale_t: torch.Tensor | None = None  # "mxfp8": data_t's (K, N/32) e8m0 scales
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
        e4m3 = native_e4m3(weight.device)  # FNUZ on a gfx942, as float8_linear casts x
        # cast into the held tensors where they are this weight's (_keep's reason), else new ones
        fits = self.data is not None and self.data.shape == weight.shape and self.data.device == weight.device
        delayed, mx = self.scaling == "delayed", self.scaling == "mxfp8"
        same = fits and (self.scale_t is not None if mx else self.scale_t is None and self.data.dtype == e4m3)
        into = None
        if same and not mx and (self.amax is not None or not delayed):
            into = Float8Cast(self.data, self.data_t, self.scale, None, self.amax)
        with torch.no_grad():
            if delayed:
                history = self._history()
                if history is None:  # the module is gone or holds no history
                    self._history_used = None
                    return
                # the weight in both layouts (each GEMM's K-major operand), the update put off
                cast = cast_2d(
                    weight.detach(), e4m3, store_t=True, history=history, margin=self.margin, defer=True,
                    out=into,
                )  # fmt: skip
                self._history_used = history
                self._history_stamp = (history._version, history.data_ptr())
            elif mx:
                held = (self.data, self.scale, self.data_t, self.scale_t)
                cast = to_mx_both(weight.detach(), E4M3, scale_mode=MX_SCALE_MODE, out=held if same else None)
                if not same:
                    self._keep(*cast[:3], None, cast[3])
            else:
                cast = cast_2d(weight.detach(), e4m3, store_t=True, out=into)
            if not mx and into is None:
                self._keep(cast.data, cast.scale, cast.data_t, cast.amax, None)
        self._stamp = (weight._version, weight.data_ptr())

    def _keep(self, *cast: torch.Tensor | None) -> None:
        """Hold ``cast`` (data, scale, data_t, amax or None, scale_t or None) in the same tensors step
        after step: copied into the previous step's when their shapes match, so a CUDA
        graph that captured a forward reading them (``Trainer(cuda_graph=True)``) reads
        each replay's cast, not a buffer freed after the capture."""
        held = (self.data, self.scale, self.data_t, self.amax, self.scale_t)
        pairs = [(h, c) for h, c in zip(held, cast, strict=True) if c is not None or h is not None]
        if all(
            h is not None and c is not None and h.shape == c.shape and h.dtype == c.dtype for h, c in pairs
        ):
            for h, c in pairs:
                h.copy_(c)
        else:
            self.data, self.scale, self.data_t, self.amax, self.scale_t = cast

    def lookup(
        self, weight: torch.Tensor, history: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """The cast, if it is the one a forward would make of ``weight`` now, else None.

        Args:
            weight: the weight the forward casts.
            history: its amax history under ``"delayed"`` (None under ``"tensorwise"``).

        Returns:
            ``(data, scale)`` (tensorwise; mxfp8, with ``data_t`` and ``scale_t`` beside) or
            ``(data, scale, amax)`` (delayed: a training forward rolls ``amax`` into
            ``history``), or None.
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
