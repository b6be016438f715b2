"""The three loss scalers: static, dynamic (GradScaler's rule and DeepSpeed's / apex's
knobs) and log-normal (OpenSeq2Seq's "LogMax")."""

from __future__ import annotations

import math
from typing import Any

import torch

from tkern.amp.scaler import LossScaler
from tkern.amp.util import check_positive, check_scale, is_int, is_real
from tkern.kernels import scale as K
from tkern.kernels.overflow import FOUND_INF

__all__ = ["DynamicLossScaler", "LogNormalLossScaler", "StaticLossScaler"]


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
        check_scale("scale", scale)
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
        if not (is_real(growth_factor) and math.isfinite(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not (is_real(backoff_factor) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not is_int(value) or value < 1:
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
            if not (is_real(beta) and 0.0 <= beta < 1.0):
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        check_positive("log_max", log_max)
        if not (is_real(overflow_std_dev) and math.isfinite(overflow_std_dev) and overflow_std_dev >= 0):
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
