"""``LossScaler``: what every loss scaler shares (see :mod:`tkern.amp`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tkern.amp.state import ScalerStateDict
from tkern.amp.unscale import unscale_grads, unscaled_stats
from tkern.amp.util import (
    HostMirror,
    check_scaler_args,
    first_tensor,
    map_tensors,
    placed,
)
from tkern.graphs import HostCounters
from tkern.kernels import scale as K
from tkern.kernels.overflow import FOUND_INF, combine_stats
from tkern.optim import FusedOptimizer
from tkern.optim.report import OverflowReport

__all__ = ["LossScaler"]


class LossScaler(HostCounters, ScalerStateDict):
    """What every loss scaler shares; use a subclass.

    Args:
        init_scale: the first S.
        min_scale: S never backs off below this.
        max_scale: S never grows past this.
        max_overflows_at_min: consecutive overflowing steps at ``min_scale``
            after which ``update()`` raises. Default 1000: at the floor no
            scale can help any more, and a thousand skipped steps is far more
            than the transient overflows dynamic scaling recovers from in a few
            steps, yet under 1% of a typical run.
        enabled: False makes the scaler a no-op, as GradScaler's: ``scale``
            returns its argument, ``step`` calls ``optimizer.step()``,
            ``update`` does nothing, ``get_scale()`` is 1.0 and
            ``state_dict()`` is empty.
        process_group: a ``torch.distributed`` group over which the gradient
            statistics are all-reduced (max); None (default) never communicates.

    Every scale (init, min, max) must be a finite number > 0 whose fp32 value
    and fp32 reciprocal are finite: ``1/S`` is what the optimizer multiplies
    the gradients by.
    """

    _HOST_COUNTERS = {"updates": "_updates"}  # the updates made (HostCounters)

    _scheme = K.STATIC

    def __init__(
        self,
        init_scale: float,
        min_scale: float | None,
        max_scale: float,
        max_overflows_at_min: int = 1000,
        *,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        min_scale = check_scaler_args(init_scale, min_scale, max_scale, max_overflows_at_min, enabled)
        self.init_scale = float(init_scale)
        self.min_scale = min_scale
        self.max_scale = float(max_scale)
        self.max_overflows_at_min = int(max_overflows_at_min)
        self.process_group = process_group
        self._enabled = enabled
        self._state: torch.Tensor | None = None
        self._state_movable = False  # a loaded state, still on the CPU until its first use
        self._stats: list[torch.Tensor] = []
        self._last_stats: torch.Tensor | None = None
        self._unscaled: set[int] = set()
        self._found_by_optimizer: dict[int, dict[Any, torch.Tensor]] = {}  # by split_by_mesh key
        self._stepped: set[int] = set()
        self._updates = 0
        self._mirror: HostMirror | None = None
        #: the tkern fused optimizers this scaler has stepped (for :meth:`overflow_report`)
        self._fused: dict[int, weakref.ref] = {}

    def is_enabled(self) -> bool:
        """Whether the scaler scales (False for ``enabled=False``)."""
        return self._enabled

    # ------------------------------------------------------------- state

    def _initial_state(self, device: torch.device) -> torch.Tensor:
        state = torch.zeros(K.STATE_SIZE, dtype=torch.float32)
        state[K.SCALE] = self.init_scale
        state[K.INV_SCALE] = 1.0 / self.init_scale
        state[K.LAST_LOSS] = float("nan")
        return placed(state, device)

    def _lazy_state(self, device: torch.device) -> torch.Tensor:
        if self._state is None:
            self._state = self._initial_state(device)
            self._mirror = HostMirror(self._state)
        elif self._state.device != device:
            if not self._state_movable:
                raise ValueError(
                    f"the loss is on {device}, but this scaler's state is on {self._state.device}"
                )
            self._state = placed(self._state, device)
            self._mirror = HostMirror(self._state)
        self._state_movable = False
        return self._state

    def _update_kwargs(self) -> dict[str, Any]:
        return {}

    @property
    def state(self) -> torch.Tensor | None:
        """The raw state vector on the device (layout in :mod:`tkern.kernels.scale`)."""
        return self._state

    @property
    def inv_scale(self) -> torch.Tensor:
        """(1,) fp32 device tensor holding 1 / S."""
        if self._state is None:
            raise RuntimeError("the scaler has no state yet: call scale(loss) first")
        return self._state[K.INV_SCALE : K.INV_SCALE + 1]

    @property
    def found_inf(self) -> torch.Tensor | None:
        """(1,) fp32 device tensor, 1.0 if the last step overflowed: the
        current iteration's steps, or after ``update()`` the step it used
        (None before any step)."""
        stats = self.grad_stats
        return None if stats is None else stats[FOUND_INF : FOUND_INF + 1]

    @property
    def grad_stats(self) -> torch.Tensor | None:
        """(3,) fp32 device tensor ``[found_inf, sum of squares, max |g|]`` of
        the unscaled gradients of the current iteration's steps, or after
        ``update()`` of the steps it used (None before any step)."""
        return self._combined_stats() if self._stats else self._last_stats

    def scale_tensor(self) -> torch.Tensor | None:
        """The current S as a 0-dim fp32 device tensor (a copy, no host sync);
        None while disabled or before the first :meth:`scale`."""
        if not self._enabled or self._state is None:
            return None
        return self._state[K.SCALE].clone()

    def get_scale(self) -> float:
        """The current S as a Python float (waits for the device); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self.init_scale if self._state is None else float(self._state[K.SCALE].item())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (waits for the device)."""
        return 0 if self._state is None else int(self._state[K.SKIPPED].item())

    # ------------------------------------------------------------- the loop

    def scale(self, outputs):
        """``outputs * S`` in fp32: a tensor, or tuples/lists/dicts of them
        (nested), returned in the same structure. A one-element loss is also
        recorded, if finite, for error messages."""
        if not self._enabled:
            return outputs
        first = first_tensor(outputs)
        if first is None:
            raise TypeError(
                "loss must be a floating-point tensor (or tuples/lists/dicts of them), got "
                f"{type(outputs).__name__}"
            )
        state = self._lazy_state(first.device)
        scaled = map_tensors(outputs, lambda t: self._scale_one(t, state))
        return scaled

    def _scale_one(self, loss: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        if not loss.is_floating_point():
            raise TypeError(f"loss must be a floating-point tensor, got a {loss.dtype} tensor")
        if loss.device != state.device:
            raise ValueError(f"the loss is on {loss.device}, but this scaler's state is on {state.device}")
        loss = loss.float()
        if loss.numel() == 1:
            with torch.no_grad():
                last = state[K.LAST_LOSS : K.LAST_LOSS + 1]
                value = loss.detach().reshape(1)
                # (x - x) == 0 exactly where x is finite (inf - inf and nan - nan are nan): three
                # launches, where isfinite + where + copy_ takes six on a GPU
                torch.where((value - value) == 0, value, last, out=last)
        return loss * state[K.SCALE]

    def _check_iteration(self, optimizer: Any, what: str) -> None:
        if not (isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "param_groups")):
            raise TypeError(
                f"{what}(): optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if self._state is None or self._state_movable:
            raise RuntimeError(
                f"{what}() was called without scale(loss) first: "
                f"call scaler.scale(loss).backward() before scaler.{what}(optimizer)"
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by S in place and check them for inf/nan
        (for users who clip or inspect gradients by hand before ``step``).

        Half-precision gradients are divided in their own dtype, which can
        flush the smallest ones to zero: with tkern's fused optimizers, prefer
        their ``max_grad_norm``, which clips in fp32 inside the step. Sparse
        gradients are coalesced (replacing ``.grad``) and their values unscaled.
        """
        if not self._enabled:
            return
        self._check_iteration(optimizer, "unscale_")
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        if id(optimizer) in self._stepped:
            raise RuntimeError("unscale_() is being called after step()")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            raise ValueError("unscale_(): the optimizer has no gradients")
        state = self._lazy_state(params[0].grad.device)
        found = unscale_grads(params, self.inv_scale, state.device)
        self._unscaled.add(id(optimizer))
        self._found_by_optimizer[id(optimizer)] = found

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Take ``optimizer``'s step unless its gradients overflowed.

        A tkern fused optimizer gets ``inv_scale`` and decides on the device
        (its ``.grad`` tensors keep the scaled values); any other optimizer
        has its gradients unscaled and checked here, and its
        ``step(*args, **kwargs)`` is called only if they are finite (this
        waits for the device once). As GradScaler, a closure is refused, and
        ``scale(loss)`` must have been called first.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "Closure use is not supported with a loss scaler (as torch.amp.GradScaler): "
                "compute the loss, call scale(loss).backward(), then step(optimizer)"
            )
        self._check_iteration(optimizer, "step")
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        if isinstance(optimizer, FusedOptimizer):
            state = self._lazy_state(optimizer.device)
            inv_scale = None if id(optimizer) in self._unscaled else state[K.INV_SCALE : K.INV_SCALE + 1]
            result = optimizer.step(*args, inv_scale=inv_scale, **kwargs)
            ref = self._fused.get(id(optimizer))
            if ref is None or ref() is not optimizer:  # overflow_report's: made once per optimizer
                self._fused[id(optimizer)] = weakref.ref(optimizer)
            stats = optimizer.grad_stats
            if self.process_group is not None:
                stats = combine_stats(stats.clone(), self.process_group)
        else:
            if id(optimizer) not in self._unscaled:
                self.unscale_(optimizer)
            found = self._found_by_optimizer[id(optimizer)]
            stats = unscaled_stats(optimizer, found, self.process_group)
            result = None
            if stats[FOUND_INF].item() == 0.0:  # the fallback's one host sync
                result = optimizer.step(*args, **kwargs)
        self._stepped.add(id(optimizer))
        self._stats.append(stats)
        return result

    def __getstate__(self) -> dict[str, Any]:
        # pickle and deepcopy: the weak references to the optimizers stepped do not travel
        # (a copy's overflow_report() names the optimizers the copy steps, not the original's)
        state = self.__dict__.copy()
        state["_fused"] = {}
        return state

    def overflow_report(self, optimizer: FusedOptimizer | None = None) -> OverflowReport:
        """The overflow report of a tkern fused optimizer this scaler has stepped
        (:meth:`tkern.optim.FusedOptimizer.overflow_report`: which tensors overflowed,
        the sampled zero and subnormal fractions, whether the scale is likely too low):
        ``optimizer``'s, or, when None, that of the one optimizer it has stepped. One
        device-to-host copy, as the optimizer's.

        Raises:
            RuntimeError: no tkern fused optimizer stepped yet, or several and none named.
            ValueError: ``optimizer`` was not stepped by this scaler.
        """
        live = {k: o for k, r in self._fused.items() if (o := r()) is not None}
        if optimizer is None:
            if len(live) != 1:
                raise RuntimeError(
                    "overflow_report(): "
                    + (
                        f"this scaler has stepped {len(live)} tkern fused optimizers: name one"
                        if live
                        else "this scaler has stepped no tkern fused optimizer yet"
                    )
                )
            optimizer = next(iter(live.values()))
        elif live.get(id(optimizer)) is not optimizer:
            raise ValueError("overflow_report(): this scaler has not stepped that optimizer")
        return optimizer.overflow_report()

    def _combined_stats(self) -> torch.Tensor:
        if len(self._stats) == 1:
            return self._stats[0]
        return torch.stack(self._stats).amax(0)

    def update(self) -> None:
        """Update S from the statistics of this iteration's ``step`` calls
        (one tiny kernel, no host sync)."""
        if not self._enabled:
            return
        if not self._stats:
            raise RuntimeError("No inf checks were recorded prior to update(): call step() first")
        stats = self._combined_stats()
        K.update_scale(
            self._state,
            stats,
            scheme=self._scheme,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            **self._update_kwargs(),
        )
        self._after_update(stats)
        self._last_stats = stats
        self._stats.clear()
        self._unscaled.clear()
        self._found_by_optimizer.clear()
        self._stepped.clear()
        self._updates += 1
        streak, last_loss = self._mirror.poll(self.max_overflows_at_min)
        if streak >= self.max_overflows_at_min:
            raise RuntimeError(
                f"loss scaling gave up at update {self._updates}: {int(streak)} consecutive steps "
                f"overflowed at the minimum loss scale {self.min_scale:g} (last finite loss "
                f"{last_loss:.6g}). The gradients are inf/nan whatever the scale: lower the "
                "learning rate, check the data and the model, or lower min_scale."
            )

    def _after_update(self, stats: torch.Tensor) -> None:
        """A subclass's extra state change after the update kernel (none by default)."""
