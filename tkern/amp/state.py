"""A loss scaler's checkpoint format: its state_dict checked before anything changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tkern.amp.util import FP32_MAX, is_int
from tkern.kernels import scale as K

__all__ = ["parse_state"]


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
