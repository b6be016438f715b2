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
as a device tensor; ``update`` is a single one-program kernel. With any other
``torch.optim.Optimizer``, ``step`` unscales the gradients in place, checks
them, and calls ``optimizer.step()`` only when they are finite; that decision
waits for the device once per step (as GradScaler does).

Safety: if ``max_overflows_at_min`` consecutive steps overflow while S is
already at its minimum, ``update`` raises ``RuntimeError`` naming the step and
the last finite loss, rather than skipping steps forever. On a GPU the check
reads a copy of the counter made without waiting, so it may fire a step or two
late.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tkern.kernels import scale as K
from tkern.kernels.overflow import AMAX, FOUND_INF, N_STATS, SUMSQ
from tkern.optim import _FusedOptimizer

__all__ = ["DynamicLossScaler", "LogNormalLossScaler", "LossScaler", "StaticLossScaler"]

#: fp32's smallest normal number: the floor of a scaler built with min_scale=None.
FP32_TINY = 2.0**-126


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
    """

    _scheme = K.STATIC

    def __init__(
        self,
        init_scale: float,
        min_scale: float | None,
        max_scale: float,
        max_overflows_at_min: int = 1000,
    ) -> None:
        _check_positive("init_scale", init_scale)
        if min_scale is not None:
            _check_positive("min_scale", min_scale)
        _check_positive("max_scale", max_scale)
        min_scale = FP32_TINY if min_scale is None else float(min_scale)
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"need min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, {max_scale}"
            )
        if not isinstance(max_overflows_at_min, int) or max_overflows_at_min < 1:
            raise ValueError(f"max_overflows_at_min must be a positive int, got {max_overflows_at_min!r}")
        self.init_scale = float(init_scale)
        self.min_scale = min_scale
        self.max_scale = float(max_scale)
        self.max_overflows_at_min = max_overflows_at_min
        self._state: torch.Tensor | None = None
        self._stats: list[torch.Tensor] = []
        self._unscaled: set[int] = set()
        self._found_by_optimizer: dict[int, torch.Tensor] = {}
        self._stepped: set[int] = set()
        self._updates = 0
        self._mirror: _HostMirror | None = None

    # ------------------------------------------------------------- state

    def _initial_state(self, device: torch.device) -> torch.Tensor:
        state = torch.zeros(K.STATE_SIZE, dtype=torch.float32)
        state[K.SCALE] = self.init_scale
        state[K.INV_SCALE] = 1.0 / self.init_scale
        state[K.LAST_LOSS] = float("nan")
        return state.to(device)

    def _lazy_state(self, device: torch.device) -> torch.Tensor:
        if self._state is None:
            self._state = self._initial_state(device)
            self._mirror = _HostMirror(self._state)
        elif self._state.device != device:
            raise ValueError(f"the loss is on {device}, but this scaler's state is on {self._state.device}")
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
        """(1,) fp32 device tensor, 1.0 if the last step overflowed (None before any step)."""
        return None if not self._stats else self._combined_stats()[FOUND_INF : FOUND_INF + 1]

    @property
    def grad_stats(self) -> torch.Tensor | None:
        """(3,) fp32 device tensor ``[found_inf, sum of squares, max |g|]`` of the
        current step's unscaled gradients (None before any step)."""
        return None if not self._stats else self._combined_stats()

    def get_scale(self) -> float:
        """The current S as a Python float (waits for the device)."""
        return self.init_scale if self._state is None else float(self._state[K.SCALE].item())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (waits for the device)."""
        return 0 if self._state is None else int(self._state[K.SKIPPED].item())

    # ------------------------------------------------------------- the loop

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` in fp32 (also records the loss, if finite, for error messages)."""
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(f"loss must be a floating-point tensor, got {type(loss).__name__}")
        state = self._lazy_state(loss.device)
        loss = loss.float()
        if loss.numel() == 1:
            with torch.no_grad():
                last = state[K.LAST_LOSS : K.LAST_LOSS + 1]
                last.copy_(
                    torch.where(torch.isfinite(loss.detach()).reshape(1), loss.detach().reshape(1), last)
                )
        return loss * state[K.SCALE]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by S in place and check them for inf/nan
        (for users who clip or inspect gradients by hand before ``step``).

        Half-precision gradients are divided in their own dtype, which can
        flush the smallest ones to zero: with tkern's fused optimizers, prefer
        their ``max_grad_norm``, which clips in fp32 inside the step.
        """
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        if id(optimizer) in self._stepped:
            raise RuntimeError("unscale_() is being called after step()")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            raise ValueError("unscale_(): the optimizer has no gradients")
        state = self._lazy_state(grads[0].device)
        found = torch.zeros(1, dtype=torch.float32, device=state.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            if g.is_sparse:
                raise TypeError("unscale_(): sparse gradients are not supported")
            by_dtype.setdefault(g.dtype, []).append(g)
        with torch.no_grad():
            for group in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, self.inv_scale)
        self._unscaled.add(id(optimizer))
        self._found_by_optimizer[id(optimizer)] = found

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Take ``optimizer``'s step unless its gradients overflowed.

        A tkern fused optimizer gets ``inv_scale`` and decides on the device;
        any other optimizer has its gradients unscaled and checked here, and
        its ``step(*args, **kwargs)`` is called only if they are finite (this
        waits for the device once).
        """
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        if isinstance(optimizer, _FusedOptimizer):
            state = self._lazy_state(optimizer._device)
            inv_scale = None if id(optimizer) in self._unscaled else state[K.INV_SCALE : K.INV_SCALE + 1]
            result = optimizer.step(*args, inv_scale=inv_scale, **kwargs)
            stats = optimizer.grad_stats
        else:
            if id(optimizer) not in self._unscaled:
                self.unscale_(optimizer)
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            found = self._found_by_optimizer[id(optimizer)]
            with torch.no_grad():
                # max |g| and sum g^2 of the unscaled grads, accumulated in fp32
                # without copies (on an overflowing step they are inf/nan, but
                # that step is skipped and the scalers do not read them then)
                norm = torch.linalg.vector_norm
                amax = torch.stack([norm(g, float("inf"), dtype=torch.float32) for g in grads]).max()
                sumsq = torch.stack([norm(g, 2, dtype=torch.float32) ** 2 for g in grads]).sum()
                stats = torch.empty(N_STATS, dtype=torch.float32, device=found.device)
                stats[FOUND_INF], stats[SUMSQ], stats[AMAX] = found[0], sumsq, amax
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
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
        if not self._stats:
            raise RuntimeError("No inf checks were recorded prior to update(): call step() first")
        K.update_scale(
            self._state,
            self._combined_stats(),
            scheme=self._scheme,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            **self._update_kwargs(),
        )
        self._stats.clear()
        self._unscaled.clear()
        self._found_by_optimizer.clear()
        self._stepped.clear()
        self._updates += 1
        streak, last_loss = self._mirror.poll()
        if streak >= self.max_overflows_at_min:
            raise RuntimeError(
                f"loss scaling gave up at update {self._updates}: {int(streak)} consecutive steps "
                f"overflowed at the minimum loss scale {self.min_scale:g} (last finite loss "
                f"{last_loss:.6g}). The gradients are inf/nan whatever the scale: lower the "
                "learning rate, check the data and the model, or lower min_scale."
            )

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and the whole device state (scale, counters,
        statistics), enough to continue the same trajectory."""
        out = {"class": type(self).__name__, "scale": self.get_scale(), "updates": self._updates}
        out.update(self._config())
        out["state"] = None if self._state is None else self._state.detach().cpu().clone()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (from a scaler of the same class)."""
        if state_dict.get("class") != type(self).__name__:
            raise ValueError(f"state dict is for a {state_dict.get('class')}, not a {type(self).__name__}")
        for key in self._config():
            setattr(self, key, state_dict[key])
        self._updates = state_dict["updates"]
        saved = state_dict["state"]
        if saved is None:
            self._state = None
            return
        if saved.shape != (K.STATE_SIZE,):
            raise ValueError(f"state has shape {tuple(saved.shape)}, expected ({K.STATE_SIZE},)")
        device = self._state.device if self._state is not None else saved.device
        self._state = saved.to(device=device, dtype=torch.float32).clone()
        self._mirror = _HostMirror(self._state)

    def _config(self) -> dict[str, Any]:
        return {
            "init_scale": self.init_scale,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "max_overflows_at_min": self.max_overflows_at_min,
        }


class StaticLossScaler(LossScaler):
    """A fixed loss scale (fastai's default, 512). Overflowing steps are still skipped.

    Args:
        scale: S.
        max_overflows_at_min: see :class:`LossScaler` (every overflow is "at the minimum").
    """

    _scheme = K.STATIC

    def __init__(self, scale: float = 512.0, max_overflows_at_min: int = 1000) -> None:
        super().__init__(scale, scale, scale, max_overflows_at_min)


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
            since S last grew, and at every overflow after that until S grows
            again. The counter refills only when S grows (DeepSpeed's default,
            ``consecutive_hysteresis=False``), not on each clean step. Every
            overflow restarts the growth interval.
        min_scale: S never backs off below it (default: fp32's smallest normal number).
        max_scale: S never grows past it; growth that would leave fp32's range is skipped.
        max_overflows_at_min: see :class:`LossScaler`.
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
    ) -> None:
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        super().__init__(init_scale, min_scale, max_scale, max_overflows_at_min)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis

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

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), **self._update_kwargs()}


class LogNormalLossScaler(LossScaler):
    """OpenSeq2Seq's automatic loss scaling ("LogMax"), on the device.

    Models x = log2(max |g|) of the unscaled gradients as normal, with
    bias-corrected EMAs of x (mean mu, rate ``beta1``) and of x and x^2
    (variance sigma^2, rate ``beta2``), and sets
    ``S = clip(2 ** (log_max - (mu + overflow_std_dev * sigma)), scale_min, scale_max)``:
    the largest gradient times S stays under 2^log_max (fp16's range) except
    with probability 1 - Phi(3.09) = 0.001 while the statistics hold. max |g|
    comes out of the optimizer's check pass: no extra read of the gradients.

    One deliberate difference from OpenSeq2Seq: an overflowing step, whose
    max |g| is only known to be at least 2^log_max / S, is recorded as
    x = log_max - log2(S) + 1 (one bit above that bound). OpenSeq2Seq records
    x = 2 ** log_max (65536, as a log2 value), which after a single overflow
    holds S at ``scale_min`` for the ~10^4 steps the beta2 EMA of x^2 needs to
    forget it; and with a one-sample variance of zero at start-up, such an
    overflow comes within the first few steps.

    Args:
        scale_min, scale_max, log_max, beta1, beta2, overflow_std_dev: OpenSeq2Seq's, with its defaults.
        init_scale: S before the first update (OpenSeq2Seq starts at 1).
        max_overflows_at_min: see :class:`LossScaler`.
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
    ) -> None:
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        _check_positive("log_max", log_max)
        if not overflow_std_dev >= 0:
            raise ValueError(f"overflow_std_dev must be >= 0, got {overflow_std_dev}")
        super().__init__(init_scale, scale_min, scale_max, max_overflows_at_min)
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


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class _HostMirror:
    """Reads the overflow streak and the last finite loss without waiting for
    the device: on CUDA, each poll starts a non-blocking copy into pinned
    memory and a later poll reads it once its event has completed."""

    def __init__(self, state: torch.Tensor) -> None:
        assert K.LAST_LOSS == K.STREAK + 1  # read as one slice, no index tensor
        self._state = state
        self._cuda = state.device.type == "cuda"
        self._host = torch.zeros(2, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None
        self._pending = False
        self._last = (0.0, float("nan"))

    def poll(self) -> tuple[float, float]:
        """(streak, last finite loss), as of this update on the CPU, or a step
        or two earlier on CUDA."""
        picked = self._state[K.STREAK : K.LAST_LOSS + 1]
        if not self._cuda:
            streak, loss = picked.tolist()
            return streak, loss
        if self._pending and self._event.query():
            streak, loss = self._host.tolist()
            self._last = (streak, loss)
            self._pending = False
        if not self._pending:
            self._host.copy_(picked, non_blocking=True)
            self._event.record()
            self._pending = True
        return self._last
