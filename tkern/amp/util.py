"""What the loss scalers share that is not a scaler: argument checks, the device state's
placement, nested-tensor helpers and the host's view of the overflow counters."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from tkern.kernels import scale as K

__all__ = [
    "FP32_MAX",
    "FP32_TINY",
    "HostMirror",
    "check_positive",
    "check_scale",
    "check_scaler_args",
    "first_tensor",
    "is_int",
    "is_real",
    "map_tensors",
    "placed",
]

#: fp32's smallest normal number: the floor of a scaler built with min_scale=None.
FP32_TINY = 2.0**-126
FP32_MAX = float(torch.finfo(torch.float32).max)


def placed(state: torch.Tensor, device: torch.device | str) -> torch.Tensor:
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


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive(name: str, value: float) -> None:
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_scale(name: str, value: float) -> None:
    """A loss scale: finite and > 0, and so are its fp32 value and fp32 reciprocal."""
    check_positive(name, value)
    as_fp32 = torch.tensor(float(value), dtype=torch.float32)
    if not torch.isfinite(as_fp32):
        raise ValueError(f"{name}={value!r} overflows float32 (largest {FP32_MAX:.6g}): use a smaller scale")
    inv = as_fp32.reciprocal()
    if as_fp32.item() == 0.0 or not torch.isfinite(inv):
        raise ValueError(
            f"{name}={value!r}: its reciprocal 1/{name} is not finite in float32 (the optimizer "
            f"multiplies the gradients by it); use a scale >= {2.0**-126:g} (fp32's smallest normal number)"
        )


def first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def map_tensors(obj: Any, fn):
    """``fn`` applied to every tensor of nested tuples/lists/dicts, keeping their types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(v, fn) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    raise TypeError(f"scale() takes tensors in tuples/lists/dicts, got a {type(obj).__name__}")


class HostMirror:
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


def check_scaler_args(
    init_scale: float, min_scale: float | None, max_scale: float, max_overflows_at_min: int, enabled: bool
) -> float:
    """:class:`~tkern.amp.LossScaler`'s constructor checks (ValueError / TypeError naming the
    argument); returns the floor: ``min_scale``, or fp32's smallest normal number for None."""
    check_scale("init_scale", init_scale)
    if min_scale is not None:
        check_scale("min_scale", min_scale)
    check_scale("max_scale", max_scale)
    min_scale = FP32_TINY if min_scale is None else float(min_scale)
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(
            f"need min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, {max_scale}"
        )
    if not is_int(max_overflows_at_min) or max_overflows_at_min < 1:
        raise ValueError(f"max_overflows_at_min must be a positive int, got {max_overflows_at_min!r}")
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    return min_scale
