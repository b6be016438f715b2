"""Loss scalers whose state lives on the device.

Loss scaling multiplies the loss by S before backward so that small fp16
gradients do not flush to zero; the optimizer divides them by S in fp32.
Three ways to choose S, with one interface (``torch.amp.GradScaler``'s):

* :class:`StaticLossScaler` — a fixed S (fastai's default 512);
* :class:`DynamicLossScaler` — GradScaler's backoff/growth, plus DeepSpeed's
  hysteresis and apex's ceiling;
* :class:`LogNormalLossScaler` — OpenSeq2Seq's "LogMax": S from running
  statistics of log2(max |g|), keeping the chance of overflow near 0.001.

Usage, as with GradScaler::

    scaler = tkern.DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)     # a tkern fused optimizer: no host sync
    scaler.update()            # one tiny kernel: no host sync

With a tkern fused optimizer, ``step`` hands ``1/S`` to the optimizer as a
device tensor and receives its statistics (found_inf, sum of squares, max |g|)
as a device tensor; ``update`` is a single one-program kernel. The optimizer
unscales inside its update kernel and never writes the gradients: after
``scaler.step(fused_optimizer)`` the ``.grad`` tensors still hold the scaled
gradients (S times the true ones; torch's fused Adam writes them back
unscaled, tkern saves those 2 bytes per parameter). Call
``scaler.unscale_(optimizer)`` before ``step`` to get unscaled gradients.

With any other ``torch.optim.Optimizer``, ``step`` unscales the gradients in
place (sparse ones too), checks them, and calls ``optimizer.step()`` only when
they are finite; that decision waits for the device once per step (as
GradScaler does).

Distributed training: a scaler never communicates by default, so a rank-local
scaler cannot hang when ``torch.distributed`` is initialized (under DDP the
gradients, hence the decisions, are already identical on every rank). Pass
``process_group=`` to share the statistics (max over the group) when the
ranks' gradients differ: with a plain torch optimizer every rank then skips
the same steps, and with any optimizer every rank updates S from the same
statistics. A tkern fused optimizer decides the skip inside its own ``step``.
Gradients that are FSDP2 DTensors (``fully_shard``) are checked on their local
shards (empty ones included) and their statistics summed over their mesh by
every rank (found_inf and max |g| by max, as GradScaler reduces found_inf for
DTensors), whatever ``process_group`` says.

Safety: if ``max_overflows_at_min`` consecutive steps overflow while S is
already at its minimum, ``update`` raises ``RuntimeError`` naming the step and
the last finite loss, rather than skipping steps forever. On a GPU the check
reads a copy of the counter made without waiting; once that copy shows an
overflow streak that could have reached the limit, ``update`` reads the
counter itself, so the error comes at the step that reaches the limit (for a
limit of 1 or 2, up to two steps later).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from tkern.kernels import scale as K
from tkern.kernels.overflow import AMAX, FOUND_INF, N_STATS, SUMSQ, combine_stats, reduce_stats
from tkern.optim import FusedOptimizer
from tkern.optim.fsdp import split_by_mesh

__all__ = ["DynamicLossScaler", "LogNormalLossScaler", "LossScaler", "StaticLossScaler"]

#: fp32's smallest normal number: the floor of a scaler built with min_scale=None.
FP32_TINY = 2.0**-126
_FP32_MAX = float(torch.finfo(torch.float32).max)


class LossScaler:
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
        _check_scale("init_scale", init_scale)
        if min_scale is not None:
            _check_scale("min_scale", min_scale)
        _check_scale("max_scale", max_scale)
        min_scale = FP32_TINY if min_scale is None else float(min_scale)
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"need min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, {max_scale}"
            )
        if not _is_int(max_overflows_at_min) or max_overflows_at_min < 1:
            raise ValueError(f"max_overflows_at_min must be a positive int, got {max_overflows_at_min!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
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
        self._mirror: _HostMirror | None = None

    def is_enabled(self) -> bool:
        """Whether the scaler scales (False for ``enabled=False``)."""
        return self._enabled

    # ------------------------------------------------------------- state

    def _initial_state(self, device: torch.device) -> torch.Tensor:
        state = torch.zeros(K.STATE_SIZE, dtype=torch.float32)
        state[K.SCALE] = self.init_scale
        state[K.INV_SCALE] = 1.0 / self.init_scale
        state[K.LAST_LOSS] = float("nan")
        return _placed(state, device)

    def _lazy_state(self, device: torch.device) -> torch.Tensor:
        if self._state is None:
            self._state = self._initial_state(device)
            self._mirror = _HostMirror(self._state)
        elif self._state.device != device:
            if not self._state_movable:
                raise ValueError(
                    f"the loss is on {device}, but this scaler's state is on {self._state.device}"
                )
            self._state = _placed(self._state, device)
            self._mirror = _HostMirror(self._state)
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

    def validate_state_dict(self, state_dict: Any) -> None:
        """Check ``state_dict`` as :meth:`load_state_dict` would, changing
        nothing: ``TypeError``/``ValueError``/``RuntimeError`` if it would be
        refused (the wrong class, missing entries, a bad config or state)."""
        self._parse_state_dict(state_dict)

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
        first = _first_tensor(outputs)
        if first is None:
            raise TypeError(
                "loss must be a floating-point tensor (or tuples/lists/dicts of them), got "
                f"{type(outputs).__name__}"
            )
        state = self._lazy_state(first.device)
        scaled = _map_tensors(outputs, lambda t: self._scale_one(t, state))
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
                last.copy_(
                    torch.where(torch.isfinite(loss.detach()).reshape(1), loss.detach().reshape(1), last)
                )
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
        found: dict[Any, torch.Tensor] = {}  # the group a found_inf is combined over -> found_inf
        with torch.no_grad():
            grads = []
            for p in params:
                g = p.grad
                if g.is_sparse:
                    # coalesce: duplicate indices summed, so that the check and
                    # the statistics see the gradient's true values
                    if not g.is_coalesced():
                        p.grad = g = g.coalesce()
                    g = g._values()
                grads.append(g)
            for key, local in split_by_mesh(grads).items():  # FSDP2's DTensors: their local shards
                found[key] = torch.zeros(1, dtype=torch.float32, device=state.device)
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
                for g in local:
                    by_dtype.setdefault(g.dtype, []).append(g)
                for group in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found[key], self.inv_scale)
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
            stats = optimizer.grad_stats
            if self.process_group is not None:
                stats = combine_stats(stats.clone(), self.process_group)
        else:
            if id(optimizer) not in self._unscaled:
                self.unscale_(optimizer)
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            values = [g._values() if g.is_sparse else g for g in grads]
            found = self._found_by_optimizer[id(optimizer)]
            with torch.no_grad():
                # whole gradients combined over process_group (max); FSDP2's shards
                # summed over their mesh, by every rank, empty shards included
                parts = [
                    combine_stats(_local_stats(local, found[key]), self.process_group)
                    if key is None
                    else combine_stats(_local_stats(local, found[key]), key, sharded=True)
                    for key, local in split_by_mesh(values).items()
                ]
                stats = parts[0] if len(parts) == 1 else reduce_stats(torch.stack(parts))
            result = None
            if stats[FOUND_INF].item() == 0.0:  # the fallback's one host sync
                result = optimizer.step(*args, **kwargs)
        self._stepped.add(id(optimizer))
        self._stats.append(stats)
        return result

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

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and the whole device state (scale, counters,
        statistics), enough to continue the same trajectory; empty when
        disabled (as GradScaler's)."""
        if not self._enabled:
            return {}
        out = {"class": type(self).__name__, "scale": self.get_scale(), "updates": self._updates}
        out.update(self._config())
        out["state"] = None if self._state is None else self._state.detach().cpu().clone()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (from a scaler of the same class).

        Everything is validated before anything changes (``ValueError``
        naming the entry). The state moves to the device of the scaler's
        current state, or, for a scaler not used yet, to the device of its
        first loss. A disabled scaler ignores the call, as GradScaler does.
        """
        if not self._enabled:
            return
        probe, updates, saved = self._parse_state_dict(state_dict)
        # validated: change nothing before this line
        for key in self._config():
            setattr(self, key, getattr(probe, key))
        self._updates = int(updates)
        self._stats.clear()
        self._last_stats = None
        if saved is None:
            self._state, self._mirror, self._state_movable = None, None, False
            return
        if self._state is not None:
            self._state = _placed(saved, self._state.device)
            self._state_movable = False
        else:
            self._state = _placed(saved, saved.device)
            self._state_movable = True
        self._mirror = _HostMirror(self._state)

    def _parse_state_dict(self, state_dict: Any) -> tuple[LossScaler, int, torch.Tensor | None]:
        """Validate a state dict (changing nothing): (a scaler built from its
        config, the update count, the state on the CPU or None)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled scaler."
            )
        if state_dict.get("class") != type(self).__name__:
            raise ValueError(f"state dict is for a {state_dict.get('class')}, not a {type(self).__name__}")
        optional = self._optional_config()
        missing = [
            k for k in (*self._config(), "updates", "state") if k not in state_dict and k not in optional
        ]
        if missing:
            raise ValueError(f"state dict of a {type(self).__name__} lacks {', '.join(missing)}")
        config = {k: state_dict.get(k, optional.get(k)) for k in self._config()}
        probe = type(self)(**self._ctor_kwargs(config))  # the constructor's checks: ValueError
        updates = state_dict["updates"]
        if not _is_int(updates) or updates < 0:
            raise ValueError(f"state dict: updates must be an int >= 0, got {updates!r}")
        saved = state_dict["state"]
        if saved is not None:
            if not isinstance(saved, torch.Tensor) or not saved.is_floating_point():
                raise ValueError(
                    f"state dict: state must be a float tensor or None, got {type(saved).__name__}"
                )
            if saved.shape != (K.STATE_SIZE,):
                raise ValueError(f"state has shape {tuple(saved.shape)}, expected ({K.STATE_SIZE},)")
            saved = saved.detach().to(device="cpu", dtype=torch.float32).clone()
            scale, inv = saved[K.SCALE].item(), saved[K.INV_SCALE].item()
            if not (0 < scale <= _FP32_MAX and 0 < inv <= _FP32_MAX):
                raise ValueError(f"state dict: the scale in state must be finite and > 0, got {scale}")
        return probe, int(updates), saved

    def _config(self) -> dict[str, Any]:
        return {
            "init_scale": self.init_scale,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "max_overflows_at_min": self.max_overflows_at_min,
        }

    def _optional_config(self) -> dict[str, Any]:
        """Config keys older state dicts may lack, with the value they implied."""
        return {}

    def _ctor_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments that rebuild a scaler with ``config``."""
        return dict(config)


class StaticLossScaler(LossScaler):
    """A fixed loss scale (fastai's default, 512). Overflowing steps are still skipped.

    Args:
        scale: S; its fp32 value and fp32 reciprocal must be finite.
        max_overflows_at_min: see :class:`LossScaler` (every overflow is "at the minimum").
        enabled, process_group: see :class:`LossScaler`.
    """

    _scheme = K.STATIC

    def __init__(
        self,
        scale: float = 512.0,
        max_overflows_at_min: int = 1000,
        *,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        _check_scale("scale", scale)
        super().__init__(
            scale, scale, scale, max_overflows_at_min, enabled=enabled, process_group=process_group
        )

    def _ctor_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        if not config["init_scale"] == config["min_scale"] == config["max_scale"]:
            raise ValueError(
                "state dict of a StaticLossScaler needs init_scale == min_scale == max_scale, got "
                f"{config['init_scale']}, {config['min_scale']}, {config['max_scale']}"
            )
        return {"scale": config["init_scale"], "max_overflows_at_min": config["max_overflows_at_min"]}


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling: back off on overflow, grow after clean intervals.

    With the defaults (hysteresis=1) S follows exactly the sequence of
    ``torch.amp.GradScaler`` for the same overflowing and clean steps, as long
    as S stays at or below ``max_scale`` (2^24, apex's ceiling; GradScaler has
    none).

    Args:
        init_scale: the first S (2^16, as GradScaler).
        growth_factor: S is multiplied by it after ``growth_interval`` clean steps in a row.
        backoff_factor: S is multiplied by it on a backoff.
        growth_interval: clean steps between growths.
        hysteresis: overflows tolerated before a backoff (DeepSpeed's
            ``delayed_shift``): S is lowered at the ``hysteresis``-th overflow
            since the counter was last refilled, and at every overflow after
            that until it is refilled. Every overflow restarts the growth interval.
        consecutive_hysteresis: when the counter refills (DeepSpeed's option
            of that name). False (default, DeepSpeed's default): only when S
            grows, so isolated overflows spread over a growth interval add up.
            True: on every clean step, so only ``hysteresis`` overflows in a
            row lower S.
        min_scale: S never backs off below it (default: fp32's smallest normal number).
        max_scale: S never grows past it; growth that would leave fp32's range is skipped.
        max_overflows_at_min, enabled, process_group: see :class:`LossScaler`.
    """

    _scheme = K.DYNAMIC

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float = 2.0**24,
        max_overflows_at_min: int = 1000,
        *,
        consecutive_hysteresis: bool = False,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        if not (_is_real(growth_factor) and math.isfinite(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not (_is_real(backoff_factor) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(consecutive_hysteresis, bool):
            raise ValueError(f"consecutive_hysteresis must be a bool, got {consecutive_hysteresis!r}")
        super().__init__(
            init_scale,
            min_scale,
            max_scale,
            max_overflows_at_min,
            enabled=enabled,
            process_group=process_group,
        )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = consecutive_hysteresis

    def _initial_state(self, device: torch.device) -> torch.Tensor:
        state = super()._initial_state(device)
        state[K.HYSTERESIS_LEFT] = float(self.hysteresis)
        return state

    def _update_kwargs(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
        }

    def _after_update(self, stats: torch.Tensor) -> None:
        if self.consecutive_hysteresis and self.hysteresis > 1:
            # DeepSpeed: every clean step refills the counter (two tiny launches)
            left = self._state[K.HYSTERESIS_LEFT : K.HYSTERESIS_LEFT + 1]
            left.masked_fill_(stats[FOUND_INF : FOUND_INF + 1] == 0.0, float(self.hysteresis))

    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            **self._update_kwargs(),
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def _optional_config(self) -> dict[str, Any]:
        return {"consecutive_hysteresis": False}


class LogNormalLossScaler(LossScaler):
    """OpenSeq2Seq's automatic loss scaling ("LogMax"), on the device.

    Models x = log2(max |g|) of the unscaled gradients as normal, with
    bias-corrected EMAs of x (mean mu, rate ``beta1``) and of x and x^2
    (variance sigma^2, rate ``beta2``), and sets
    ``S = clip(2 ** (log_max - (mu + overflow_std_dev * sigma)), scale_min, scale_max)``:
    the largest gradient times S stays under 2^log_max (fp16's range) except
    with probability 1 - Phi(3.09) = 0.001 while the statistics hold. max |g|
    comes out of the optimizer's check pass: no extra read of the gradients.

    Two deliberate differences from OpenSeq2Seq:

    * a censored record of overflows: an overflowing step, whose max |g| is
      only known to be at least 2^log_max / S, is recorded as
      x = log_max - log2(S) + 1 (one bit above that bound). OpenSeq2Seq
      records x = 2 ** log_max (65536, as a log2 value), which after a single
      overflow holds S at ``scale_min`` for the ~10^4 steps the beta2 EMA of
      x^2 needs to forget it; and with a one-sample variance of zero at
      start-up, such an overflow comes within the first few steps.
    * all-zero gradient steps are not recorded: max |g| = 0 carries no
      information about the gradients' scale (log2 0 = -inf would poison the
      EMAs), so such a step leaves S and the statistics unchanged (it is not
      skipped: the optimizer still steps). OpenSeq2Seq would record -inf.

    Args:
        scale_min: S never falls below it. Default 1.0 (OpenSeq2Seq's).
        scale_max: S never rises above it. Default 2**24 (OpenSeq2Seq's
            LogMaxScaler default, also apex's ceiling).
        log_max: log2 of the largest gradient*S allowed. Default 16.0
            (OpenSeq2Seq's; fp16's largest value is just under 2^16).
        beta1: EMA rate of mu. Default 0.99 (OpenSeq2Seq's).
        beta2: EMA rate of the variance's moments. Default 0.999 (OpenSeq2Seq's).
        overflow_std_dev: how many sigmas of headroom. Default 3.09
            (OpenSeq2Seq's: an overflow chance of 0.001).
        init_scale: S before the first update. Default 1.0 (OpenSeq2Seq starts at 1).
        max_overflows_at_min, enabled, process_group: see :class:`LossScaler`.
    """

    _scheme = K.LOGNORMAL

    def __init__(
        self,
        scale_min: float = 1.0,
        scale_max: float = 2.0**24,
        log_max: float = 16.0,
        beta1: float = 0.99,
        beta2: float = 0.999,
        overflow_std_dev: float = 3.09,
        init_scale: float = 1.0,
        max_overflows_at_min: int = 1000,
        *,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not (_is_real(beta) and 0.0 <= beta < 1.0):
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        _check_positive("log_max", log_max)
        if not (_is_real(overflow_std_dev) and math.isfinite(overflow_std_dev) and overflow_std_dev >= 0):
            raise ValueError(f"overflow_std_dev must be >= 0, got {overflow_std_dev}")
        super().__init__(
            init_scale,
            scale_min,
            scale_max,
            max_overflows_at_min,
            enabled=enabled,
            process_group=process_group,
        )
        self.log_max = float(log_max)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.overflow_std_dev = float(overflow_std_dev)

    def _update_kwargs(self) -> dict[str, Any]:
        return {
            "beta1": self.beta1,
            "beta2": self.beta2,
            "log_max": self.log_max,
            "overflow_std_dev": self.overflow_std_dev,
        }

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), **self._update_kwargs()}

    def _ctor_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(config)
        kwargs["scale_min"], kwargs["scale_max"] = kwargs.pop("min_scale"), kwargs.pop("max_scale")
        return kwargs


# ----------------------------------------------------------------- helpers


def _placed(state: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of the (STATE_SIZE,) state vector on ``device``, placed in its allocation
    so that ``inv_scale`` (the state at ``INV_SCALE``, which the optimizer's kernels
    read) starts 16 bytes aligned: Triton specializes a pointer on 16-byte
    alignment, and a CUDA graph of the step must launch what its eager warm-up
    compiled (:mod:`tkern.graphs`), whether it reads the scale or a static copy."""
    floats_per_16_bytes = 4
    buf = torch.empty(K.STATE_SIZE + floats_per_16_bytes - 1, dtype=torch.float32, device=device)
    pad = -(buf.data_ptr() // buf.element_size() + K.INV_SCALE) % floats_per_16_bytes
    out = buf[pad : pad + K.STATE_SIZE]
    out.copy_(state)
    return out


def _local_stats(values: list[torch.Tensor], found: torch.Tensor) -> torch.Tensor:
    """(N_STATS,) fp32 ``[found, sum of squares, max |g|]`` of unscaled gradients, accumulated
    in fp32 without copies (on an overflowing step they are inf/nan, but that step is skipped
    and the scalers do not read them then); empty tensors count for nothing."""
    stats = torch.zeros(N_STATS, dtype=torch.float32, device=found.device)
    stats[FOUND_INF] = found[0]
    values = [v for v in values if v.numel() > 0]
    if values:
        norm = torch.linalg.vector_norm
        stats[AMAX] = torch.stack([norm(v, float("inf"), dtype=torch.float32) for v in values]).max()
        stats[SUMSQ] = torch.stack([norm(v, 2, dtype=torch.float32) ** 2 for v in values]).sum()
    return stats


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_positive(name: str, value: float) -> None:
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_scale(name: str, value: float) -> None:
    """A loss scale: finite and > 0, and so are its fp32 value and fp32 reciprocal."""
    _check_positive(name, value)
    as_fp32 = torch.tensor(float(value), dtype=torch.float32)
    if not torch.isfinite(as_fp32):
        raise ValueError(f"{name}={value!r} overflows float32 (largest {_FP32_MAX:.6g}): use a smaller scale")
    inv = as_fp32.reciprocal()
    if as_fp32.item() == 0.0 or not torch.isfinite(inv):
        raise ValueError(
            f"{name}={value!r}: its reciprocal 1/{name} is not finite in float32 (the optimizer "
            f"multiplies the gradients by it); use a scale >= {2.0**-126:g} (fp32's smallest normal number)"
        )


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _map_tensors(obj: Any, fn):
    """``fn`` applied to every tensor of nested tuples/lists/dicts, keeping their types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    raise TypeError(f"scale() takes tensors in tuples/lists/dicts, got a {type(obj).__name__}")


class _HostMirror:
    """Reads the overflow streak and the last finite loss without waiting for
    the device: on CUDA, each poll starts a non-blocking copy into pinned
    memory and a later poll reads it once its event has completed. The streak
    grows by at most one per update, so when the copy read shows a nonzero
    streak that could have reached the limit since, the poll reads the
    counter itself (waiting, which only happens while steps keep overflowing
    at the floor)."""

    def __init__(self, state: torch.Tensor) -> None:
        assert K.LAST_LOSS == K.STREAK + 1  # read as one slice, no index tensor
        self._state = state
        self._cuda = state.device.type == "cuda"
        self._host = torch.zeros(2, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None
        self._pending = False
        self._polls = 0
        self._copied_at = 0  # the poll whose state the pending copy holds
        self._last_at = 0  # the poll whose state self._last describes
        self._last = (0.0, float("nan"))

    def poll(self, limit: int) -> tuple[float, float]:
        """(streak, last finite loss), as of this update on the CPU; on CUDA
        a step or two earlier, or exactly when the streak may have reached ``limit``."""
        picked = self._state[K.STREAK : K.LAST_LOSS + 1]
        if not self._cuda:
            streak, loss = picked.tolist()
            return streak, loss
        if torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph capture nothing may read the device from the host: the
            # give-up check (a host-side safety net) is left to the eager steps around it.
            return self._last
        self._polls += 1
        if self._pending and self._event.query():
            streak, loss = self._host.tolist()
            self._last, self._last_at = (streak, loss), self._copied_at
            self._pending = False
        streak = self._last[0]
        if streak > 0 and streak + (self._polls - self._last_at) >= limit:
            streak, loss = picked.tolist()  # waits for the device
            self._last, self._last_at = (streak, loss), self._polls
            return self._last
        if not self._pending:
            self._host.copy_(picked, non_blocking=True)
            self._event.record()
            self._pending, self._copied_at = True, self._polls
        return self._last
