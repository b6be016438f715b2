"""Scaled casts to FP8 (e4m3 / e5m2): amax, scale and saturated cast on the device.

FP8 has too little range for raw activations, weights or gradients, so every
tensor is multiplied by its own scale before the cast (loss scaling's heir).
The convention is torchao's tensorwise cast, applied per tensor, per row or per
block:

* ``amax`` = max |x| over the block, clamped below at :data:`EPS` (1e-12);
* ``multiplier`` = fp8_max / amax (fp32, correctly rounded);
* ``data`` = saturate(x * multiplier) to ±fp8_max, rounded to nearest even;
* ``scale`` = the fp32 reciprocal of the multiplier, so ``x ≈ data * scale``.

The three steps are separate jit helpers (:func:`amax_to_multiplier`,
:func:`to_fp8_saturated`), as torchao's ``float8_utils`` names them, so every
kernel that casts (this file's, and later the optimizer's copy-back) casts the
same way. Nothing here waits for the device: a per-tensor cast is two launches
(partial maxima, then the cast that reduces them), a row or block cast one.

Delayed scaling (Transformer Engine's ``DelayedScaling``) takes the multiplier
from an amax history instead of the tensor itself: :func:`to_float8_delayed`
casts with fp8_max / max(history) x 2^-margin and rolls this tensor's amax into
the history in the same pass, so a spike saturates that step and the scale
adapts on the next.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, IS_INTERPRETER, check_same_device, check_tensor

#: The two fp8 formats and their largest finite values.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {dt: float(torch.finfo(dt).max) for dt in FP8_DTYPES}  # 448 and 57344
_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
#: What may be cast.
HIGH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: amax is clamped below at this value (torchao's EPS): an all-zero block gets a
#: finite multiplier and stays zeros.
EPS = 1e-12
#: The largest fp32 value not above EPS: amax at or below it is clamped.
_EPS_F32 = float(torch.tensor(EPS, dtype=torch.float32))
if _EPS_F32 > EPS:
    _EPS_F32 = math.nextafter(_EPS_F32, 0.0)


@functools.cache
def _multiplier_at_eps(fp8_max: float) -> float:
    """fp8_max / EPS rounded once to fp32, as torchao computes it (in float64)."""
    return float(torch.tensor(fp8_max / EPS, dtype=torch.float64).to(torch.float32))


#: Elements per program per loop iteration of the per-tensor kernels, and the
#: most programs a per-tensor cast launches (each loops over its share).
BLOCK = 4096 if INTERPRET else 1024
MAX_PROGRAMS = 4 if INTERPRET else 1024
#: Tile of the row/block kernel: at most this many rows and columns at a time.
TILE_M, TILE_K = 16, 256


@triton.jit
def amax_to_multiplier(amax, FP8_MAX: tl.constexpr, MULT_AT_EPS: tl.constexpr, EPS_F32: tl.constexpr):
    """fp8_max / max(amax, EPS) in fp32, correctly rounded (torchao's
    ``amax_to_scale``); the reciprocal of the returned value is the scale."""
    clamped = amax <= EPS_F32
    quotient = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), tl.where(clamped, 1.0, amax))
    return tl.where(clamped, MULT_AT_EPS, quotient)


@triton.jit
def reciprocal(x):
    """1 / x in fp32, correctly rounded (a scale from its multiplier)."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _round_to_fp8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``y`` (|y| <= fp8 max) rounded to nearest even on the fp8 grid, in
    fp32 arithmetic: the spacing there is 2^(max(exponent, MIN_EXP) - MANT_BITS)
    (subnormals below MIN_EXP), and adding then subtracting 1.5 x 2^23 times the
    spacing rounds to a multiple of it. The sign of a zero is kept."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    spacing_bits = (tl.maximum(exponent, MIN_EXP) - MANT_BITS + 127) << 23
    magic = spacing_bits.to(tl.float32, bitcast=True) * 12582912.0
    r = (y + magic) - magic
    return tl.where(r == 0.0, y * 0.0, r)


@triton.jit
def to_fp8_saturated(x, multiplier, FP8_MAX: tl.constexpr, DTYPE: tl.constexpr):
    """``x * multiplier`` (fp32) clamped to ±FP8_MAX and rounded to nearest
    even in ``DTYPE`` (torchao's ``to_fp8_saturated``): never inf, never NaN
    from overflow.

    Compiled Triton rounds fp32 -> fp8 to nearest even in hardware. The
    interpreter (triton 3.9) drops the carry when rounding up crosses a power
    of two (0.1236 -> 0.0625 in e4m3), so there the value is first rounded on
    the fp8 grid in fp32 (then the cast is exact)."""
    y = x.to(tl.float32) * multiplier
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if IS_INTERPRETER:
        if tl.float8e4nv == DTYPE:
            y = _round_to_fp8_grid(y, 3, -6)
        else:
            y = _round_to_fp8_grid(y, 2, -14)
    return y.to(DTYPE)


@triton.jit
def _amax_partials_kernel(
    x_ptr,  # (n,) fp32/fp16/bf16
    n,
    partials_ptr,  # (num_programs,) fp32: this program's max |x|
    BLOCK: tl.constexpr,
):
    """Pass 1 of a per-tensor cast: each program's max |x| over its share."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    best = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.abs(x))
    tl.store(partials_ptr + pid, tl.max(best, axis=0))


@triton.jit
def _max_of(vec_ptr, count, PBLOCK: tl.constexpr):
    """The max of ``count`` (<= PBLOCK) fp32 values at ``vec_ptr`` (partial maxima
    or an amax history), 0 for none."""
    offs = tl.arange(0, PBLOCK)
    return tl.max(tl.load(vec_ptr + offs, mask=offs < count, other=0.0), axis=0)


@triton.jit
def _cast_tensorwise_kernel(
    x_ptr,  # (n,) fp32/fp16/bf16
    n,
    amax_ptr,  # (count,) fp32: the partial maxima (current scaling) or the amax history (delayed)
    count,
    data_ptr,  # (n,) DTYPE: the fp8 result
    scale_ptr,  # (1,) fp32: written by program 0, 1 / multiplier
    partials_ptr,  # (num_programs,) fp32: this program's max |x| (delayed scaling only)
    margin_factor,  # 2^-margin (delayed scaling), 1.0 otherwise
    DELAYED: tl.constexpr,  # multiplier from a history (1.0 while it holds no amax yet)
    FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    PBLOCK: tl.constexpr,  # a power of two >= count
):
    """Pass 2 of a per-tensor cast: every program reduces the (few) maxima to
    the multiplier, program 0 writes the scale, each casts its share."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    amax = _max_of(amax_ptr, count, PBLOCK)
    mult = amax_to_multiplier(amax, FP8_MAX, MULT_AT_EPS, EPS_F32)
    if DELAYED:
        # Transformer Engine starts a tensor's scale at 1 until its history holds an amax
        mult = tl.where(amax > 0.0, mult * margin_factor, 1.0)
    if pid == 0:
        tl.store(scale_ptr, reciprocal(mult))
    best = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(data_ptr + offs, to_fp8_saturated(x, mult, FP8_MAX, DTYPE), mask=mask)
        if DELAYED:
            best = tl.maximum(best, tl.abs(x))
    if DELAYED:
        tl.store(partials_ptr + pid, tl.max(best, axis=0))


@triton.jit
def _roll_history_kernel(
    history_ptr,  # (H,) fp32 amax history, newest first
    H,
    partials_ptr,  # (count,) fp32: this step's partial maxima
    count,
    HBLOCK: tl.constexpr,
    PBLOCK: tl.constexpr,
):
    """Delayed scaling's bookkeeping: this step's amax becomes history[0], the
    rest moves one place back (the oldest drops out). One program."""
    amax = _max_of(partials_ptr, count, PBLOCK)
    offs = tl.arange(0, HBLOCK)
    older = tl.load(history_ptr + offs - 1, mask=(offs > 0) & (offs < H), other=0.0)
    tl.store(history_ptr + offs, tl.where(offs == 0, amax, older), mask=offs < H)


@triton.jit
def _load_tile(x_ptr, rows, cols, row_end, col_end, stride_xm, stride_xk):
    """The (rows, cols) tile of x, masked to the block's end: (x, rows, cols, mask)."""
    mask = (rows < row_end)[:, None] & (cols < col_end)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    return x, rows, cols, mask


@triton.jit
def _cast_blocks_kernel(
    x_ptr,  # (M, K) fp32/fp16/bf16, any strides
    M,
    K,
    stride_xm,
    stride_xk,
    data_ptr,  # (M, K) DTYPE, contiguous
    scale_ptr,  # (ceil(M / bm), ceil(K / bk)) fp32, contiguous
    bm,  # block rows
    bk,  # block columns
    FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr,
    DTYPE: tl.constexpr,
    TM: tl.constexpr,  # tile rows: a power of two, at most bm rounded up
    TK: tl.constexpr,  # tile columns
):
    """One program per (bm, bk) block of x (a row is the block (1, K)): its
    amax over the block, then the cast of the block with its own multiplier."""
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    row0 = bi.to(tl.int64) * bm
    col0 = bj.to(tl.int64) * bk
    row_end = tl.minimum(row0 + bm, M)
    col_end = tl.minimum(col0 + bk, K)
    rows_t = tl.arange(0, TM)
    cols_t = tl.arange(0, TK)
    best = tl.zeros((TM, TK), dtype=tl.float32)
    for r in range(row0, row_end, TM):
        for c in range(col0, col_end, TK):
            x, _, _, _ = _load_tile(x_ptr, r + rows_t, c + cols_t, row_end, col_end, stride_xm, stride_xk)
            best = tl.maximum(best, tl.abs(x.to(tl.float32)))
    amax = tl.max(tl.max(best, axis=1), axis=0)
    mult = amax_to_multiplier(amax, FP8_MAX, MULT_AT_EPS, EPS_F32)
    tl.store(scale_ptr + bi * tl.cdiv(K, bk) + bj, reciprocal(mult))
    for r in range(row0, row_end, TM):
        for c in range(col0, col_end, TK):
            x, rows, cols, mask = _load_tile(
                x_ptr, r + rows_t, c + cols_t, row_end, col_end, stride_xm, stride_xk
            )
            y = to_fp8_saturated(x, mult, FP8_MAX, DTYPE)
            tl.store(data_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)


# --------------------------------------------------------------------------- launchers


#: fp8 tensor cores, and Triton's e4m3 type (``fp8e4nv``): Ada (sm_89), Hopper (sm_90) or newer.
FP8_MIN_CC = (8, 9)


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The compute capability of ``device`` where tkern's kernels run compiled on it
    (a CUDA device), else None (the CPU under Triton's interpreter, the meta device):
    the one place the fp8 code asks, so a test can answer for a GPU it does not have."""
    device = torch.device(device)
    if device.type != "cuda" or INTERPRET:
        return None
    return tuple(torch.cuda.get_device_capability(device))


def check_fp8_device(device: torch.device | str, what: str = "tkern's fp8 kernels") -> None:
    """Raise ``RuntimeError`` unless ``device`` has fp8 tensor cores (compute
    capability >= 8.9: Ada, Hopper or newer), naming the device, its capability
    and what needs them. Called before any fp8 kernel is compiled: on an older GPU
    Triton itself would stop inside its compiler ("type fp8e4nv not supported")."""
    cc = device_capability(device)
    if cc is not None and cc < FP8_MIN_CC:
        device = torch.device(device)
        raise RuntimeError(
            f"{what} needs fp8 tensor cores (compute capability >= {FP8_MIN_CC[0]}.{FP8_MIN_CC[1]}: "
            f"Ada, Hopper or newer); {torch.cuda.get_device_name(device)} ({device}) has compute "
            f"capability {cc[0]}.{cc[1]}"
        )


def check_fp8_dtype(dtype: torch.dtype, name: str = "dtype") -> None:
    """Raise ``TypeError`` unless ``dtype`` is torch.float8_e4m3fn or torch.float8_e5m2."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def _constants(dtype: torch.dtype) -> dict:
    fp8_max = FP8_MAX[dtype]
    return {
        "FP8_MAX": fp8_max,
        "MULT_AT_EPS": _multiplier_at_eps(fp8_max),
        "EPS_F32": _EPS_F32,
        "DTYPE": _TL_FP8[dtype],
    }


def parse_granularity(granularity, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """None for ``"tensor"``; else the block shape (bm, bk) of a 2-D ``shape``:
    ``"row"`` is (1, K), a pair of positive ints is itself."""
    if isinstance(granularity, str):
        if granularity == "tensor":
            return None
        if granularity == "row":
            if len(shape) != 2:
                raise ValueError(f'granularity "row" needs a 2-D x, got shape {tuple(shape)}')
            return 1, max(shape[1], 1)
    elif (
        isinstance(granularity, (tuple, list))
        and len(granularity) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in granularity)
    ):
        if len(shape) != 2:
            raise ValueError(
                f"block granularity {tuple(granularity)} needs a 2-D x, got shape {tuple(shape)}"
            )
        return int(granularity[0]), int(granularity[1])
    raise ValueError(
        f'granularity must be "tensor", "row" or a block shape (bm, bk) of positive ints, got {granularity!r}'
    )


def _check_x(x: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=HIGH_DTYPES)
    check_fp8_device(x.device, "to_float8")


def to_float8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity="tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to fp8 with its own scale(s), on the device, without a host sync.

    Args:
        x: fp32, fp16 or bf16, any shape for ``"tensor"``; 2-D (M, K) otherwise.
        dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        granularity: ``"tensor"`` (one scale), ``"row"`` (one per row: scales
            (M, 1)) or a block shape ``(bm, bk)`` (scales (ceil(M/bm), ceil(K/bk));
            DeepSeek-V3 uses (1, 128) for activations and (128, 128) for weights).

    Returns:
        ``(data, scale)``: ``data`` of ``dtype`` and x's shape (contiguous),
        ``scale`` fp32 (0-dim for ``"tensor"``), with ``x ≈ data.float() * scale``
        (scale expanded to x's shape). Exactly torchao's tensorwise cast per
        block: values beyond the range saturate to ±max (never inf or NaN), an
        all-zero block stays zeros.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    _check_x(x)
    check_fp8_dtype(dtype)
    block = parse_granularity(granularity, tuple(x.shape))
    if block is None:
        return _cast_tensorwise(x, dtype)
    return _cast_blocks(x, dtype, block)


def _programs(n: int) -> int:
    return max(1, min(MAX_PROGRAMS, triton.cdiv(n, BLOCK)))


def _tensorwise_buffers(x: torch.Tensor, dtype: torch.dtype):
    """What a per-tensor cast launches on: x flat, the fp8 result (x's shape), the
    0-dim scale, the number of programs and their (programs,) partial maxima."""
    flat = x.reshape(-1)
    programs = _programs(flat.numel())
    return (
        flat,
        torch.empty(x.shape, dtype=dtype, device=x.device),
        torch.empty((), dtype=torch.float32, device=x.device),
        programs,
        torch.zeros(programs, dtype=torch.float32, device=x.device),
    )


def _cast_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    flat, data, scale, programs, partials = _tensorwise_buffers(x, dtype)
    n = flat.numel()
    _amax_partials_kernel[(programs,)](flat, n, partials, BLOCK=BLOCK)
    _cast_tensorwise_kernel[(programs,)](
        flat, n, partials, programs, data.view(-1), scale, partials, 1.0,
        DELAYED=False, **_constants(dtype), BLOCK=BLOCK, PBLOCK=triton.next_power_of_2(programs),
    )  # fmt: skip
    return data, scale


def to_float8_with_amax(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to fp8 per tensor with the scale of an amax found elsewhere.

    The multiplier is ``fp8_max / max(amax)`` exactly as :func:`to_float8` derives
    it from x's own amax (the same kernel, fed ``amax`` instead of x's partial
    maxima), so when ``max(amax)`` is the amax of a whole tensor that ``x`` is a
    piece of (a shard: the max over the shards' amaxes), the result is, element
    for element, that whole tensor's :func:`to_float8` cast. FSDP2's fp8
    all-gather (:mod:`tkern.nn.float8_fsdp`) casts each shard this way.

    Args:
        x: fp32, fp16 or bf16, any shape (empty allowed).
        amax: (P,) fp32 contiguous, P >= 1, on x's device: values whose max is the amax.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        ``(data, scale)`` as :func:`to_float8` with ``"tensor"`` granularity.
    """
    _check_x(x)
    check_fp8_dtype(dtype)
    _check_amaxes("amax", amax, x)
    flat, data, scale, programs, _ = _tensorwise_buffers(x, dtype)
    count = amax.numel()
    _cast_tensorwise_kernel[(programs,)](
        flat, flat.numel(), amax, count, data.view(-1), scale, amax, 1.0,
        DELAYED=False, **_constants(dtype), BLOCK=BLOCK, PBLOCK=triton.next_power_of_2(count),
    )  # fmt: skip
    return data, scale


def _cast_blocks(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    bm, bk = block
    data = torch.empty((M, K), dtype=dtype, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(K, bk))
    scale = torch.empty(grid, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return data, scale
    tm = min(triton.next_power_of_2(bm), TILE_M)
    tk = min(triton.next_power_of_2(bk), TILE_K)
    _cast_blocks_kernel[grid](
        x, M, K, x.stride(0), x.stride(1), data, scale, bm, bk, **_constants(dtype), TM=tm, TK=tk
    )
    return data, scale


def _check_amaxes(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """``t`` (an amax history, or amaxes to take the max of) is (H,) fp32, contiguous,
    H >= 1, on ``x``'s device."""
    check_tensor(name, t, ndim=1, dtypes=(torch.float32,))
    check_same_device(**{"x": x, name: t})
    if t.numel() < 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous (H,) tensor with H >= 1, got shape {tuple(t.shape)}")


def _check_delayed(x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, margin: int) -> None:
    _check_x(x)
    check_fp8_dtype(dtype)
    _check_amaxes("history", history, x)
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")


def _cast_delayed(
    x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat, data, scale, programs, partials = _tensorwise_buffers(x, dtype)
    n, h = flat.numel(), history.numel()
    _cast_tensorwise_kernel[(programs,)](
        flat, n, history, h, data.view(-1), scale, partials, 2.0**-margin,
        DELAYED=True, **_constants(dtype), BLOCK=BLOCK, PBLOCK=triton.next_power_of_2(max(h, programs)),
    )  # fmt: skip
    return data, scale, partials


def _roll(history: torch.Tensor, amax: torch.Tensor) -> None:
    h, count = history.numel(), amax.numel()
    _roll_history_kernel[(1,)](
        history, h, amax, count,
        HBLOCK=triton.next_power_of_2(h), PBLOCK=triton.next_power_of_2(count),
    )  # fmt: skip
    if not history.is_inference():  # an in-place write, as torch's own would count it
        torch.autograd.graph.increment_version(history)


def to_float8_delayed(
    x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, margin: int = 0,
    *, update: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Cast ``x`` to fp8 per tensor with Transformer Engine's delayed scaling.

    The multiplier is ``fp8_max / max(history) x 2^-margin`` (1.0 while the
    history holds no amax yet, as TE starts its scales); ``x``'s own amax is
    rolled into ``history`` (newest first) in the same pass when ``update``, so
    a value beyond the history saturates this step and the scale adapts the next.

    Args:
        x: fp32, fp16 or bf16, any shape.
        history: (H,) fp32 amax history on x's device, updated in place.
        dtype, margin: the fp8 format; the margin (power of two) kept below fp8_max.
        update: roll this step's amax into the history (training); False casts only.

    Returns:
        ``(data, scale)`` as :func:`to_float8` with ``"tensor"`` granularity.
    """
    _check_delayed(x, history, dtype, margin)
    data, scale, amax = _cast_delayed(x, history, dtype, margin)
    if update:
        _roll(history, amax)
    return data, scale


def to_float8_delayed_deferred(
    x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`to_float8_delayed`'s cast with the history's update put off: the
    history is left as it is, and the update comes back as ``amax``.

    ``roll_amax_history(history, amax)`` later (with the history unchanged in
    between) leaves it exactly as ``to_float8_delayed(x, history, update=True)``
    would have; the data and scale are that call's. This is how the optimizer's
    step casts a delayed-scaling weight once for the next training forward
    (:class:`tkern.functional.Float8WeightCache`), which then makes the update.

    Returns:
        ``(data, scale, amax)``: ``amax`` a (P,) fp32 tensor of partial maxima of
        |x| (its max is x's amax, 0 for an empty x).
    """
    _check_delayed(x, history, dtype, margin)
    return _cast_delayed(x, history, dtype, margin)


def roll_amax_history(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Delayed scaling's history update on the device, no host sync: ``max(amax)``
    becomes ``history[0]``, the rest moves one place back (the oldest drops out).

    Args:
        history: (H,) fp32 contiguous amax history, newest first, updated in place.
        amax: (P,) fp32 contiguous partial maxima (:func:`to_float8_delayed_deferred`'s),
            P >= 1, on history's device.
    """
    check_tensor("history", history, ndim=1, dtypes=(torch.float32,))
    check_tensor("amax", amax, ndim=1, dtypes=(torch.float32,))
    check_same_device(history=history, amax=amax)
    for name, t in (("history", history), ("amax", amax)):
        if t.numel() < 1 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-D tensor with >= 1 element, got shape {tuple(t.shape)}"
            )
    _roll(history, amax)
