"""What :func:`tkern.scaled_mm` emits for the next fp8 GEMM (``emit_fp8``): the description
object, what comes back, and the checks made before anything is launched.

The GEMM's epilogue writes C (bf16 / fp16) and also the next GEMM's e4m3 input, exactly
the cast that GEMM would make of C (``cast_2d``, tkern/kernels/float8.py), as the norms
do for their consumers (``norm_forward_float8``, tkern/kernels/norm.py):

* ``"delayed"``: the multiplier comes from the consumer's amax history, known before the
  launch, so each program casts its tile into C's layout and C^T's as it stores C; with
  ``update`` the launch's last program rolls max |C| into the history (and a cached
  weight's deferred amax into the consumer's weight history: ``roll2``), counted on a
  (1,) int32 counter as ``cast_2d`` counts.
* ``"tensorwise"``: the multiplier needs max |C|: each program records its tile's, the last
  one reduces them into one value on the device (no host sync, no zero-filled buffer), and
  one cast pass over C follows (no amax pass).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tkern.kernels._common import HALF_DTYPES, check_same_device, check_tensor
from tkern.kernels.float8 import E4M3_DTYPES, check_amaxes

__all__ = ["EMIT_SCALINGS", "Float8Emit", "Float8Emitted", "check_emit", "emit_counter"]

#: The recipes whose cast a GEMM epilogue can write (per-tensor scales).
EMIT_SCALINGS = ("tensorwise", "delayed")


class Float8Emit(NamedTuple):
    """What :func:`tkern.scaled_mm`'s epilogue writes for the next fp8 GEMM (its ``emit_fp8``):
    the next GEMM's input cast, under that GEMM's recipe and with its scaling state.

    Args:
        scaling: the consumer's recipe, ``"tensorwise"`` or ``"delayed"``.
        dtype: the cast's format: ``torch.float8_e4m3fn`` (a forward GEMM's input), or
            ``torch.float8_e4m3fnuz`` on a gfx942.
        store_t: also write C^T's cast (the consumer's wgrad operand; wanted in training).
        history: ``"delayed"``: the consumer's (H,) fp32 input amax history.
        margin: ``"delayed"``: the consumer's margin.
        update: ``"delayed"``: roll max |C| into ``history`` in the launch (training).
        counter: optional (1,) int32 zeros the launch counts its programs on and leaves at
            zero (a Float8Linear's input-cast counter); None: one kept per device.
        roll2: ``"delayed"`` with ``update``: ``(history, amax)``, a cached weight's deferred
            update rolled in the same launch (``cast_2d``'s ``roll2``).
    """

    scaling: str = "tensorwise"
    dtype: torch.dtype = torch.float8_e4m3fn
    store_t: bool = True
    history: torch.Tensor | None = None
    margin: int = 0
    update: bool = True
    counter: torch.Tensor | None = None
    roll2: tuple[torch.Tensor, torch.Tensor] | None = None


class Float8Emitted(NamedTuple):
    """The cast :func:`tkern.scaled_mm` emitted: bit for bit ``cast_2d`` of its output."""

    data: torch.Tensor  # (M, N) e4m3, contiguous
    data_t: torch.Tensor | None  # (N, M) e4m3, contiguous (store_t), else None
    scale: torch.Tensor  # 0-dim fp32: C ~ data * scale


def _fail(what: str) -> None:
    raise ValueError(f"emit_fp8: {what}")


def check_emit(emit, out_dtype: torch.dtype, block_scales: bool, into: torch.Tensor | None, a) -> None:
    """Raise (naming ``emit_fp8`` and the field) unless ``emit`` is a :class:`Float8Emit`
    a launch of ``out_dtype`` output, with or without block scales, can honour."""
    if not isinstance(emit, Float8Emit):
        raise TypeError(f"emit_fp8 must be a tkern.Float8Emit, got {type(emit).__name__}")
    if emit.scaling not in EMIT_SCALINGS:
        _fail(f'scaling must be "tensorwise" or "delayed" (per-tensor scales), got {emit.scaling!r}')
    if emit.dtype not in E4M3_DTYPES:
        _fail(
            "dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz (the next GEMM's forward "
            f"input), got {emit.dtype}"
        )
    if block_scales:
        _fail("the emitting epilogue takes per-tensor or per-row scales, not block scales")
    if out_dtype not in HALF_DTYPES:
        _fail(f"out_dtype must be bf16 or fp16 (what the next layer reads), got {out_dtype}")
    if into is not None:
        _fail("cannot be combined with out or accumulate_into")
    for name in ("store_t", "update"):
        if not isinstance(getattr(emit, name), bool):
            _fail(f"{name} must be True or False, got {getattr(emit, name)!r}")
    if emit.counter is not None:
        check_tensor("emit_fp8.counter", emit.counter, ndim=1, dtypes=(torch.int32,))
        if emit.counter.numel() != 1:
            _fail(f"counter must be a (1,) int32 tensor, got shape {tuple(emit.counter.shape)}")
        check_same_device(a=a, emit_fp8_counter=emit.counter)
    if emit.scaling == "tensorwise":
        if emit.history is not None or emit.roll2 is not None:
            _fail('history and roll2 are "delayed" scaling\'s')
        return
    if emit.history is None:
        _fail('scaling "delayed" needs the consumer\'s input amax history')
    check_amaxes("emit_fp8.history", emit.history, a)
    if not isinstance(emit.margin, int) or isinstance(emit.margin, bool) or emit.margin < 0:
        _fail(f"margin must be an int >= 0, got {emit.margin!r}")
    if emit.roll2 is not None:
        if not emit.update:
            _fail("roll2 rides on the launch's own history update: it needs update=True")
        if not isinstance(emit.roll2, (tuple, list)) or len(emit.roll2) != 2:
            _fail(f"roll2 must be a (history, amax) pair, got {emit.roll2!r}")
        check_amaxes("emit_fp8.roll2 history", emit.roll2[0], a)
        check_amaxes("emit_fp8.roll2 amax", emit.roll2[1], a)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def emit_counter(device: torch.device) -> torch.Tensor:
    """A (1,) int32 counter of ``device`` for launches given none (every launch leaves it at
    zero; launches on one stream use it one after the other)."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter
