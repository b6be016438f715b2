"""A loss scaler's checkpoint format: its state_dict checked before anything changes
(:func:`parse_state`), and :class:`ScalerStateDict`, the part of
:class:`~tkern.amp.LossScaler` that saves and loads it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tkern.amp.util import FP32_MAX, HostMirror, is_int, placed
from tkern.kernels import scale as K

__all__ = ["ScalerStateDict", "parse_state"]


def parse_state(
    state_dict: Any,
    class_name: str,
    config: Mapping[str, Any],
    optional: Mapping[str, Any],
    build: Callable[[dict[str, Any]], Any],
) -> tuple[Any, int, torch.Tensor | None]:
    """Validate a scaler's state dict, changing nothing: ``(build(config), the update count,
    the state on the CPU or None)``. ``class_name``: the scaler's class, which the dict must
    name; ``config``: the scaler's config keys (their values unused); ``optional``: keys older
    state dicts may lack, with the value they implied; ``build(config)`` makes a scaler of
    the saved config (its constructor's checks raise ValueError)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if not state_dict:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled scaler."
        )
    if state_dict.get("class") != class_name:
        raise ValueError(f"state dict is for a {state_dict.get('class')}, not a {class_name}")
    missing = [k for k in (*config, "updates", "state") if k not in state_dict and k not in optional]
    if missing:
        raise ValueError(f"state dict of a {class_name} lacks {', '.join(missing)}")
    probe = build({k: state_dict.get(k, optional.get(k)) for k in config})
    updates = state_dict["updates"]
    if not is_int(updates) or updates < 0:
        raise ValueError(f"state dict: updates must be an int >= 0, got {updates!r}")
    saved = state_dict["state"]
    if saved is not None:
        if not isinstance(saved, torch.Tensor) or not saved.is_floating_point():
            raise ValueError(f"state dict: state must be a float tensor or None, got {type(saved).__name__}")
        if saved.shape != (K.STATE_SIZE,):
            raise ValueError(f"state has shape {tuple(saved.shape)}, expected ({K.STATE_SIZE},)")
        saved = saved.detach().to(device="cpu", dtype=torch.float32).clone()
        scale, inv = saved[K.SCALE].item(), saved[K.INV_SCALE].item()
        if not (0 < scale <= FP32_MAX and 0 < inv <= FP32_MAX):
            raise ValueError(f"state dict: the scale in state must be finite and > 0, got {scale}")
    return probe, int(updates), saved


class ScalerStateDict:
    """A loss scaler's ``state_dict`` / ``load_state_dict`` (torch's GradScaler's protocol):
    its config (:meth:`_config`, which a subclass extends), the update count and the device
    state. Uses the scaler's ``_enabled``, ``get_scale``, ``_updates``, ``_state``,
    ``_mirror``, ``_state_movable``, ``_stats`` and ``_last_stats``."""

    def validate_state_dict(self, state_dict: Any) -> None:
        """Check ``state_dict`` as :meth:`load_state_dict` would, changing
        nothing: ``TypeError``/``ValueError``/``RuntimeError`` if it would be
        refused (the wrong class, missing entries, a bad config or state)."""
        self._parse_state_dict(state_dict)

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
            self._state = placed(saved, self._state.device)
            self._state_movable = False
        else:
            self._state = placed(saved, saved.device)
            self._state_movable = True
        self._mirror = HostMirror(self._state)

    def _parse_state_dict(self, state_dict: Any) -> tuple[Any, int, torch.Tensor | None]:
        """Validate a state dict (changing nothing): (a scaler built from its
        config, the update count, the state on the CPU or None)."""

        def build(config: dict[str, Any]) -> Any:
            return type(self)(**self._ctor_kwargs(config))

        return parse_state(state_dict, type(self).__name__, self._config(), self._optional_config(), build)

    def _config(self) -> dict[str, Any]:
        """The scaler's hyperparameters by name: what :meth:`state_dict` saves beside the state."""
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
