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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkern import device as tkdev
from tkern.device import DeviceSpec
from tkern.kernels._common import (
    INTERPRET,
    IS_INTERPRETER,
    cast_rne,
    cdiv,
    check_same_device,
    check_tensor,
    next_power_of_2,
)

#: The OCP fp8 formats (NVIDIA Ada / Hopper / Blackwell, AMD gfx950) and the FNUZ ones
#: AMD's gfx942 (MI300X) multiplies natively: no negative zero, one NaN (0x80), no inf,
#: exponent bias one more than OCP's (e4m3fnuz's largest value 240, not 448).
OCP_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FNUZ_FP8 = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: Every fp8 format tkern's per-tensor, per-row and blockwise casts and GEMMs take, and
#: their largest finite values (448, 57344, 240, 57344).
FP8_DTYPES = OCP_FP8 + FNUZ_FP8
FP8_MAX = {dt: float(torch.finfo(dt).max) for dt in FP8_DTYPES}
#: The e4m3 formats (the forward's) and the e5m2 ones (the gradients').
E4M3_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
E5M2_DTYPES = (torch.float8_e5m2, torch.float8_e5m2fnuz)
_TL_FP8 = {
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
    torch.float8_e4m3fnuz: tl.float8e4b8,
    torch.float8_e5m2fnuz: tl.float8e5b16,
}
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


#: Tile of the per-tensor cast (``_cast_2d_kernel``), and the most programs it
#: launches (each loops over its share of the tiles).
CAST_TM, CAST_TK = (128, 128) if INTERPRET else (64, 64)
MAX_PROGRAMS = 4 if INTERPRET else 1024
#: Tile of the row/block kernel: at most this many rows and columns at a time.
TILE_M, TILE_K = 16, 256
#: Warps of the (128, 128) tile cast (``_cast_tiles_kernel``): 64 elements a thread.
CAST_TILES_WARPS = 8


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
    from overflow; a NaN stays NaN, as torch's clamp keeps it (an inf or NaN in a
    gradient must reach the loss scaler's overflow check through the fp8 GEMMs:
    a plain min / max would return the bound for it, a finite value).

    Compiled Triton rounds fp32 -> fp8 to nearest even in hardware. The
    interpreter (triton 3.9) drops the carry when rounding up crosses a power
    of two (0.1236 -> 0.0625 in e4m3), so there the value is first rounded on
    the fp8 grid in fp32 (then the cast is exact), and a NaN is given the
    format's NaN bits (its cast makes 0x7C, a finite 256)."""
    y = x.to(tl.float32) * multiplier
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if IS_INTERPRETER:
        if tl.float8e4nv == DTYPE:
            y = _round_to_fp8_grid(y, 3, -6)
        elif tl.float8e5 == DTYPE:
            y = _round_to_fp8_grid(y, 2, -14)
        elif tl.float8e4b8 == DTYPE:
            y = _round_to_fp8_grid(y, 3, -7)
        else:
            y = _round_to_fp8_grid(y, 2, -15)
    if tl.float8e4b8 == DTYPE or tl.float8e5b16 == DTYPE:
        y8 = tl.where(y == 0.0, 0.0, y).to(DTYPE)  # FNUZ has no -0 (its 0x80 is the NaN)
        nan_bits = 0x80
    else:
        y8 = y.to(DTYPE)
        nan_bits = 0x7F  # OCP's NaN magnitude in both formats (the sign kept below)
    if IS_INTERPRETER:
        sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80) if nan_bits == 0x7F else 0
        bits = tl.where(y != y, sign | nan_bits, y8.to(tl.uint8, bitcast=True).to(tl.int32))
        y8 = bits.to(tl.uint8).to(DTYPE, bitcast=True)
    return y8


@triton.jit
def _max_of(vec_ptr, count, PBLOCK: tl.constexpr):
    """The max of ``count`` (<= PBLOCK) fp32 values at ``vec_ptr`` (partial maxima
    or an amax history), 0 for none."""
    offs = tl.arange(0, PBLOCK)
    return tl.max(tl.load(vec_ptr + offs, mask=offs < count, other=0.0), axis=0)


@triton.jit
def _roll(history_ptr, H, amax, HBLOCK: tl.constexpr):
    """Delayed scaling's bookkeeping: ``amax`` becomes history[0], the rest moves
    one place back (the oldest drops out); nothing for H == 0."""
    offs = tl.arange(0, HBLOCK)
    older = tl.load(history_ptr + offs - 1, mask=(offs > 0) & (offs < H), other=0.0)
    tl.store(history_ptr + offs, tl.where(offs == 0, amax, older), mask=offs < H)


@triton.jit
def delayed_multiplier(
    history_ptr, H, margin_factor, FP8_MAX: tl.constexpr, MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr, PBLOCK: tl.constexpr,
):  # fmt: skip
    """Delayed scaling's multiplier: fp8_max / max(history) x ``margin_factor``
    (2^-margin), or 1.0 while the (H,) history holds no amax (Transformer Engine
    starts a tensor's scale at 1)."""
    amax = _max_of(history_ptr, H, PBLOCK)
    mult = amax_to_multiplier(amax, FP8_MAX, MULT_AT_EPS, EPS_F32)
    return tl.where(amax > 0.0, mult * margin_factor, 1.0)


@triton.jit
def cast_multiplier(
    amax_ptr, count, margin_factor, scale_ptr, pid, DELAYED: tl.constexpr, FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr, EPS_F32: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The preamble of every per-tensor fp8 cast (``_cast_2d_kernel``'s, the GEMM's emitting
    epilogue's, the norm's): the multiplier each program scales by, program ``pid`` 0 storing
    the scale 1 / multiplier at ``scale_ptr`` ((1,) fp32). DELAYED: from the (count,) amax
    history at ``amax_ptr`` (:func:`delayed_multiplier`, ``margin_factor`` = 2^-margin);
    else from the max of the ``count`` partial maxima there (current scaling). ``BLOCK``:
    a power of two >= count."""
    if DELAYED:
        mult = delayed_multiplier(amax_ptr, count, margin_factor, FP8_MAX, MULT_AT_EPS, EPS_F32, BLOCK)
    else:
        mult = amax_to_multiplier(_max_of(amax_ptr, count, BLOCK), FP8_MAX, MULT_AT_EPS, EPS_F32)
    if pid == 0:
        tl.store(scale_ptr, reciprocal(mult))
    return mult


@triton.jit
def load_tile(x_ptr, rows, cols, row_end, col_end, stride_xm, stride_xk):
    """The (rows, cols) tile of x, masked to the block's end: (x, rows, cols, mask)."""
    mask = (rows < row_end)[:, None] & (cols < col_end)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    return x, rows, cols, mask


@triton.jit
def store_fp8_tile(
    x, rows, cols, mask, M, K, mult, data_ptr, data_t_ptr, STORE: tl.constexpr, STORE_T: tl.constexpr,
    FP8_MAX: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """The (rows, cols) tile ``x`` of an (M, K) matrix cast with ``mult``
    (:func:`to_fp8_saturated`) and stored into ``data`` (M, K) (STORE) and its
    transpose ``data_t`` (K, M) (STORE_T), both contiguous: every GEMM's K-major
    operand from one read. ``rows`` and ``cols`` int64 (rows * K may pass 2^31)."""
    y = to_fp8_saturated(x, mult, FP8_MAX, DTYPE)
    if STORE:
        tl.store(data_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
    if STORE_T:
        tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(y), mask=tl.trans(mask))


@triton.jit
def last_to_finish(counter_ptr, nprog):
    """Whether this program is the launch's last to finish, counted on ``counter_ptr``
    ((1,) int32, 0 between launches; acq_rel: what every other program stored before
    counting itself, its partial maximum, is visible to the last, and each had read
    what the last will write). Every program calls it once, then :func:`release_counter`."""
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel") == nprog - 1


@triton.jit
def release_counter(counter_ptr, last, nprog):
    """The last program puts the counter back to 0 (the others add 0: a store could undo a count)."""
    tl.atomic_add(counter_ptr, tl.where(last, -nprog, 0), sem="relaxed")


@triton.jit
def roll_if_last(
    history_ptr, H, amax_ptr, count, last, PBLOCK: tl.constexpr, HBLOCK: tl.constexpr
):  # fmt: skip
    """The last program (``last``, :func:`last_to_finish`) rolls max(amax[:count])
    into the (H,) history (:func:`roll_amax_history`'s update); the others read and
    write nothing (their counts and lengths are 0)."""
    _roll(history_ptr, tl.where(last, H, 0), _max_of(amax_ptr, tl.where(last, count, 0), PBLOCK), HBLOCK)


@triton.jit
def max_of_chunks(vec_ptr, count, CHUNK: tl.constexpr):
    """The max of ``count`` fp32 values at ``vec_ptr`` (any number: read CHUNK at a
    time), 0 for none: partial maxima whose number the launch learns at run time
    (an autotuned GEMM's tiles)."""
    offs = tl.arange(0, CHUNK)
    best = tl.zeros((CHUNK,), dtype=tl.float32)
    for i in range(0, count, CHUNK):
        best = tl.maximum(best, tl.load(vec_ptr + i + offs, mask=i + offs < count, other=0.0))
    return tl.max(best, axis=0)


@triton.jit
def roll_value_if_last(history_ptr, H, amax, last, HBLOCK: tl.constexpr):
    """:func:`roll_if_last` of a value already reduced: the last program (``last``) rolls
    ``amax`` into the (H,) history; the others write nothing (their length is 0)."""
    _roll(history_ptr, tl.where(last, H, 0), amax, HBLOCK)


@triton.jit
def _cast_2d_kernel(
    # pointers
    x_ptr,  # (M, K) fp32/fp16/bf16, any strides
    amax_ptr,  # (count,) fp32: maxima whose max is the amax (current) or the amax history (DELAYED)
    data_ptr,  # (M, K) DTYPE, contiguous: the cast; unused unless STORE
    data_t_ptr,  # (K, M) DTYPE, contiguous: the cast of x^T (the same values); unused unless STORE_T
    scale_ptr,  # (1,) fp32: written by program 0, 1 / multiplier; unused under AMAX_ONLY
    partials_ptr,  # (programs,) fp32: this program's max |x|; unused unless RECORD
    colsum_ptr,  # (K,) fp32/fp16/bf16: x.sum(0) summed in fp32 (a bias gradient); unused unless COL_SUM
    counter_ptr,  # (1,) int32, 0 between launches: programs finished; unused unless ROLL
    roll2_ptr,  # (H2,) fp32: a second history rolled by the last program; unused unless ROLL2
    roll2_amax_ptr,  # (count2,) fp32: maxima whose max roll2 receives; unused unless ROLL2
    # dimensions and strides
    M,
    K,
    stride_xm,
    stride_xk,
    count,
    count2,
    H2,
    margin_factor,  # 2^-margin (DELAYED), 1.0 otherwise
    # meta-parameters; constexpr so the untaken branches are compiled out
    AMAX_ONLY: tl.constexpr,  # pass 1 of a current-scaling cast: partial maxima only
    DELAYED: tl.constexpr,  # multiplier from the history at amax_ptr (1.0 while it holds no amax)
    STORE: tl.constexpr,
    STORE_T: tl.constexpr,
    RECORD: tl.constexpr,  # store this program's max |x| (AMAX_ONLY, and DELAYED's amax for its history)
    ROLL: tl.constexpr,  # the last program rolls max(partials) into the history at amax_ptr
    ROLL2: tl.constexpr,  # ... and max(roll2_amax) into roll2 (a weight's deferred cast, Float8WeightCache)
    COL_SUM: tl.constexpr,  # the launcher gives each program whole columns (one row group)
    FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr,
    DTYPE: tl.constexpr,
    TM: tl.constexpr,  # tile rows
    TK: tl.constexpr,  # tile columns
    PBLOCK: tl.constexpr,  # a power of two >= count, count2 and the number of programs
    HBLOCK: tl.constexpr,  # a power of two >= count (DELAYED's history length) and H2
):
    """A per-tensor fp8 cast of a 2-D x in one pass over (TM, TK) tiles: program
    (i, j) of a (GI, GJ) grid takes the column bands j, j + GJ, ... and in each the
    row tiles i, i + GI, .... Every program derives the multiplier from the few
    values at amax_ptr, program 0 stores the scale; each tile is cast once and
    stored in x's layout and (STORE_T) transposed, so that every GEMM reads its
    fp8 operands K-major; COL_SUM adds the columns up in fp32 on the way (dY's
    bias gradient, no other pass over dY).

    ROLL (delayed scaling in one launch): every program stores its max |x| and
    counts itself finished on ``counter_ptr`` (acq_rel atomics); the program that
    finishes last, after every other has read the history, reduces the maxima,
    rolls the history (and ROLL2's), and puts the counter back to 0."""
    pid_i = tl.program_id(0)
    pid_j = tl.program_id(1)
    gi = tl.num_programs(0)
    gj = tl.num_programs(1)
    pid = pid_j * gi + pid_i
    nprog = gi * gj
    mult = 1.0
    if not AMAX_ONLY:
        mult = cast_multiplier(
            amax_ptr, count, margin_factor, scale_ptr, pid, DELAYED, FP8_MAX, MULT_AT_EPS, EPS_F32, PBLOCK
        )
    rows_t = tl.arange(0, TM)
    cols_t = tl.arange(0, TK)
    best = tl.zeros((TM, TK), dtype=tl.float32)
    for cb in range(pid_j, tl.cdiv(K, TK), gj):
        cols = (cb * TK + cols_t).to(tl.int64)  # int64: cols * M may pass 2^31
        col_sum = tl.zeros((TK,), dtype=tl.float32)
        for rt in range(pid_i, tl.cdiv(M, TM), gi):
            rows = (rt * TM + rows_t).to(tl.int64)  # int64: rows * K may pass 2^31
            x, _, _, mask = load_tile(x_ptr, rows, cols, M, K, stride_xm, stride_xk)
            x = x.to(tl.float32)
            if RECORD:
                best = tl.maximum(best, tl.abs(x))
            if COL_SUM:
                col_sum += tl.sum(x, axis=0)
            if not AMAX_ONLY:
                store_fp8_tile(
                    x, rows, cols, mask, M, K, mult, data_ptr, data_t_ptr, STORE, STORE_T, FP8_MAX, DTYPE
                )
        if COL_SUM:
            sum_dtype: tl.constexpr = colsum_ptr.dtype.element_ty
            tl.store(colsum_ptr + cols, cast_rne(col_sum, sum_dtype), mask=cols < K)
    if RECORD:
        tl.store(partials_ptr + pid, tl.max(tl.max(best, axis=1), axis=0))
    if ROLL:
        # every program read the history above, before it counts itself finished; the last
        # one sees every partial maximum and is the only one to write
        last = last_to_finish(counter_ptr, nprog)
        roll_if_last(amax_ptr, count, partials_ptr, nprog, last, PBLOCK, HBLOCK)
        if ROLL2:
            roll_if_last(roll2_ptr, H2, roll2_amax_ptr, count2, last, PBLOCK, HBLOCK)
        release_counter(counter_ptr, last, nprog)


@triton.jit
def _roll_history_kernel(
    history_ptr,  # (H,) fp32 amax history, newest first
    H,
    partials_ptr,  # (count,) fp32: this step's partial maxima
    count,
    HBLOCK: tl.constexpr,
    PBLOCK: tl.constexpr,
):
    """Delayed scaling's history update on its own (roll_amax_history): this
    step's amax becomes history[0], the rest moves one place back. One program."""
    _roll(history_ptr, H, _max_of(partials_ptr, count, PBLOCK), HBLOCK)


@triton.jit
def _cast_blocks_kernel(
    x_ptr,  # (M, K) fp32/fp16/bf16, any strides
    M,
    K,
    stride_xm,
    stride_xk,
    data_ptr,  # (M, K) DTYPE, contiguous
    data_t_ptr,  # (K, M) DTYPE, contiguous: the same values transposed; unused unless STORE_T
    scale_ptr,  # (ceil(M / bm), ceil(K / bk)) fp32, strides (stride_sm, stride_sk)
    bm,  # block rows
    bk,  # block columns
    stride_sm,
    stride_sk,
    FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr,
    DTYPE: tl.constexpr,
    TM: tl.constexpr,  # tile rows: a power of two, at most bm rounded up
    TK: tl.constexpr,  # tile columns
    STORE_T: tl.constexpr = False,  # also store x^T's cast (a weight's dgrad operand, K-major)
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
            x, _, _, _ = load_tile(x_ptr, r + rows_t, c + cols_t, row_end, col_end, stride_xm, stride_xk)
            best = tl.maximum(best, tl.abs(x.to(tl.float32)))
    amax = tl.max(tl.max(best, axis=1), axis=0)
    mult = amax_to_multiplier(amax, FP8_MAX, MULT_AT_EPS, EPS_F32)
    tl.store(scale_ptr + bi * stride_sm + bj * stride_sk, reciprocal(mult))
    for r in range(row0, row_end, TM):
        for c in range(col0, col_end, TK):
            x, rows, cols, mask = load_tile(
                x_ptr, r + rows_t, c + cols_t, row_end, col_end, stride_xm, stride_xk
            )
            store_fp8_tile(
                x, rows, cols, mask, M, K, mult, data_ptr, data_t_ptr, True, STORE_T, FP8_MAX, DTYPE
            )


@triton.jit
def _cast_tiles_kernel(
    x_ptr,  # (M, K) fp32/fp16/bf16, any strides
    M,
    K,
    stride_xm,
    stride_xk,
    data_ptr,  # (M, K) DTYPE, contiguous: x cast in 1 x TILE tiles (along K)
    scale_ptr,  # (M, ceil(K / TILE)) fp32, strides (stride_sm, stride_sk)
    data_t_ptr,  # (K, M) DTYPE, contiguous: x^T cast in 1 x TILE tiles (along M); unused unless STORE_T
    scale_t_ptr,  # (K, ceil(M / TILE)) fp32, strides (stride_tk, stride_tm); unused unless STORE_T
    partial_sum_ptr,  # (ceil(M / TILE), K) fp32: each band of TILE rows summed; unused unless COL_SUM
    stride_sm,
    stride_sk,
    stride_tk,
    stride_tm,
    FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr,
    DTYPE: tl.constexpr,
    TILE: tl.constexpr,  # the scale tile's length (DeepSeek-V3's 128)
    STORE_T: tl.constexpr = False,
    COL_SUM: tl.constexpr = False,
):
    """One program per (TILE, TILE) square of x, read once: each row's amax over
    the square scales x's 1 x TILE tile of that row, each column's amax the tile of
    x^T along M (wgrad's operand, K-major), and the column sums of the square are
    its band's share of x.sum(0) (a bias gradient). Bit for bit two launches of
    ``_cast_blocks_kernel`` (x and x^T in (1, TILE) blocks), and no third read for
    the sum."""
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    offs = tl.arange(0, TILE)
    rows = bi.to(tl.int64) * TILE + offs
    cols = bj.to(tl.int64) * TILE + offs
    x, rows, cols, mask = load_tile(x_ptr, rows, cols, M, K, stride_xm, stride_xk)
    magnitude = tl.abs(x.to(tl.float32))
    row_mult = amax_to_multiplier(tl.max(magnitude, axis=1), FP8_MAX, MULT_AT_EPS, EPS_F32)
    tl.store(scale_ptr + rows * stride_sm + bj * stride_sk, reciprocal(row_mult), mask=rows < M)
    y = to_fp8_saturated(x, row_mult[:, None], FP8_MAX, DTYPE)
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
    if STORE_T:
        col_mult = amax_to_multiplier(tl.max(magnitude, axis=0), FP8_MAX, MULT_AT_EPS, EPS_F32)
        tl.store(scale_t_ptr + cols * stride_tk + bi * stride_tm, reciprocal(col_mult), mask=cols < K)
        y_t = to_fp8_saturated(x, col_mult[None, :], FP8_MAX, DTYPE)
        tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(y_t), mask=tl.trans(mask))
    if COL_SUM:
        tl.store(partial_sum_ptr + bi * K + cols, tl.sum(x.to(tl.float32), axis=0), mask=cols < K)


# --------------------------------------------------------------------------- launchers


def compiled_spec(device: torch.device | str) -> DeviceSpec | None:
    """The :class:`tkern.DeviceSpec` of ``device`` where tkern's kernels run compiled on
    it (a GPU), else None (the CPU under Triton's interpreter, the meta device): the one
    place the fp8 code asks (through ``tkern.device.device_spec``, a dict lookup per
    device), so a test can answer for a GPU it does not have."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return None
    spec = tkdev.device_spec(device)
    return None if spec.vendor == "cpu" else spec


def format_names(dtypes) -> str:
    """``"float8_e4m3fn, float8_e5m2"`` for those dtypes (``"none"`` for none)."""
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes) or "none"


def fp8_refusal(spec: DeviceSpec, what: str, dtypes=()) -> str | None:
    """Why ``what`` cannot run on a GPU of ``spec`` with fp8 ``dtypes``, or None where it
    can: no fp8 tensor cores at all, or a format its tensor cores do not take (OCP
    ``float8_e4m3fn`` on an MI300X, whose native formats are FNUZ; FNUZ on an H100).
    Pure: ``tkern info --device`` and the checks below ask it."""
    where = f"{spec.name} ({spec.vendor} {spec.arch}, capability {spec.capability[0]}.{spec.capability[1]})"
    if not spec.fp8:
        return (
            f"{what} needs fp8 tensor cores (NVIDIA compute capability >= 8.9: Ada, Hopper or newer; "
            f"AMD gfx942 / gfx950); {where} has none"
        )
    missing = [d for d in dict.fromkeys(dtypes) if d not in spec.fp8_dtypes]
    if not missing:
        return None
    return (
        f"{what} uses {format_names(dtypes)}; {where} multiplies {format_names(spec.fp8_dtypes)} natively, "
        f"not {format_names(missing)} (Triton would emulate it at 16-bit speed)"
    )


def native_formats_of(spec: DeviceSpec | None, dtypes) -> tuple[torch.dtype, ...]:
    """``dtypes`` (fp8 formats named the OCP way, as the recipes name them) in the formats
    a GPU of ``spec`` multiplies natively: e4m3fn -> e4m3fnuz and e5m2 -> e5m2fnuz on a
    gfx942, unchanged on every other GPU, on one without fp8 (refused elsewhere) and for
    None (the CPU: the interpreter takes either family). Pure: ``tkern info --device``."""
    if spec is None or not spec.fp8:
        return tuple(dtypes)
    native = {E4M3_DTYPES[0]: spec.fp8_e4m3, E5M2_DTYPES[0]: spec.fp8_e5m2}
    return tuple(native.get(d, d) for d in dtypes)


def native_formats(device: torch.device | str, dtypes) -> tuple[torch.dtype, ...]:
    """:func:`native_formats_of` for the GPU ``device`` is (one dict lookup): how a recipe,
    a producer and the weight cache pick their fp8 formats."""
    return native_formats_of(compiled_spec(device), dtypes)


def native_e4m3(device: torch.device | str) -> torch.dtype:
    """The e4m3 format ``device`` multiplies natively (``float8_e4m3fnuz`` on a gfx942,
    else ``float8_e4m3fn``): what every fp8 recipe casts x and W to."""
    return native_formats(device, E4M3_DTYPES[:1])[0]


def check_fp8_device(device: torch.device | str, what: str = "tkern's fp8 kernels", dtypes=()) -> None:
    """Raise ``RuntimeError`` unless ``device`` has fp8 tensor cores that take every fp8
    ``dtypes`` natively (:func:`fp8_refusal`: the message names the device, its formats
    and those asked for). Called before any fp8 kernel is compiled: on a GPU without
    fp8 Triton itself would stop inside its compiler ("type fp8e4nv not supported")."""
    spec = compiled_spec(device)
    if spec is not None:
        reason = fp8_refusal(spec, what, dtypes)
        if reason is not None:
            raise RuntimeError(f"{reason} (device {device})")


def check_fp8_dtype(dtype: torch.dtype, name: str = "dtype", dtypes=FP8_DTYPES) -> None:
    """Raise ``TypeError`` unless ``dtype`` is one of ``dtypes`` (by default the OCP
    formats ``torch.float8_e4m3fn`` / ``float8_e5m2`` and the FNUZ ones, ``float8_e4m3fnuz``
    / ``float8_e5m2fnuz``)."""
    if dtype not in dtypes:
        raise TypeError(f"{name} must be {_either(dtypes)}, got {dtype}")


def _either(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _fp8_constants(dtype: torch.dtype) -> dict:
    fp8_max = FP8_MAX[dtype]
    return {
        "FP8_MAX": fp8_max,
        "MULT_AT_EPS": _multiplier_at_eps(fp8_max),
        "EPS_F32": _EPS_F32,
        "DTYPE": _TL_FP8[dtype],
    }


#: :func:`fp8_constants` of each fp8 dtype, made once (the cast launchers unpack them).
_FP8_CONSTANTS = {dt: _fp8_constants(dt) for dt in FP8_DTYPES}


def fp8_constants(dtype: torch.dtype) -> dict:
    """The constexpr arguments every fp8 cast kernel takes for ``dtype``: FP8_MAX,
    MULT_AT_EPS, EPS_F32 and DTYPE (Triton's type); a new dict the caller may change."""
    return dict(_FP8_CONSTANTS[dtype])


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


def _check_x(x: torch.Tensor, dtype: torch.dtype) -> None:
    """x's dtype, the fp8 ``dtype`` and x's device's fp8 (that format natively)."""
    check_tensor("x", x, dtypes=HIGH_DTYPES)
    check_fp8_dtype(dtype)
    check_fp8_device(x.device, "to_float8", (dtype,))


def to_float8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity="tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to fp8 with its own scale(s), on the device, without a host sync.

    Args:
        x: fp32, fp16 or bf16, any shape for ``"tensor"``; 2-D (M, K) otherwise.
        dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344), or
            their FNUZ forms ``float8_e4m3fnuz`` (max 240) / ``float8_e5m2fnuz`` (gfx942's).
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
    _check_x(x, dtype)
    block = parse_granularity(granularity, tuple(x.shape))
    if block is None:
        return _cast_tensorwise(x, dtype)
    return _cast_blocks(x, dtype, block)


class Float8Cast(NamedTuple):
    """What :func:`cast_2d` wrote (None: not asked for)."""

    data: torch.Tensor | None  # (M, K) fp8, contiguous
    data_t: torch.Tensor | None  # (K, M) fp8, contiguous: the same values transposed
    scale: torch.Tensor  # 0-dim fp32: x ~ data * scale
    col_sum: torch.Tensor | None  # (K,): x.sum(0) summed in fp32, rounded once
    amax: torch.Tensor | None  # (P,) fp32 partial maxima of |x| (a deferred history update)


def _grid(m: int, k: int, whole_columns: bool) -> tuple[int, int]:
    """(row groups, column groups) of a :func:`cast_2d` launch: at most
    :data:`MAX_PROGRAMS` programs; one row group when each program must see whole
    columns (the column sums)."""
    bands = max(1, cdiv(k, CAST_TK))
    gj = min(bands, MAX_PROGRAMS)
    gi = 1 if whole_columns else min(max(1, cdiv(m, CAST_TM)), max(1, MAX_PROGRAMS // gj))
    return gi, gj


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the (M, K) matrix the cast walks: itself when 2-D (any strides),
    else its rows of the last dimension (one row for a 0-dim x)."""
    if x.dim() == 2:
        return x
    return x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])


def _launch_cast(
    x2d, dtype, amax, scale, *, data=None, data_t=None, partials=None, col_sum=None,
    counter=None, roll2=None, delayed=False, amax_only=False, margin=0, grid=None,
) -> None:  # fmt: skip
    """One launch of ``_cast_2d_kernel`` on the (M, K) ``x2d`` (see its docstring);
    tensors left None are not written (their pointer is a dummy)."""
    m, k = x2d.shape
    gi, gj = grid if grid is not None else _grid(m, k, col_sum is not None)
    h2, amax2 = roll2 if roll2 is not None else (amax, amax)
    dummy = amax
    n_amax, n_amax2, n_h2 = amax.numel(), amax2.numel(), h2.numel()
    _cast_2d_kernel[(gi, gj)](
        x2d, amax, dummy if data is None else data, dummy if data_t is None else data_t,
        scale, dummy if partials is None else partials, dummy if col_sum is None else col_sum,
        dummy if counter is None else counter, h2, amax2,
        m, k, *x2d.stride(), n_amax, n_amax2, n_h2, 2.0**-margin,
        AMAX_ONLY=amax_only, DELAYED=delayed, STORE=data is not None, STORE_T=data_t is not None,
        RECORD=partials is not None, ROLL=counter is not None, ROLL2=roll2 is not None,
        COL_SUM=col_sum is not None, **_FP8_CONSTANTS[dtype], TM=CAST_TM, TK=CAST_TK,
        PBLOCK=next_power_of_2(max(n_amax, n_amax2, gi * gj)),
        HBLOCK=next_power_of_2(max(n_amax if delayed else 1, n_h2)),
    )  # fmt: skip


def cast_2d(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    store: bool = True,
    store_t: bool = False,
    sum_dtype: torch.dtype | None = None,
    history: torch.Tensor | None = None,
    margin: int = 0,
    update: bool = True,
    defer: bool = False,
    counter: torch.Tensor | None = None,
    roll2: tuple[torch.Tensor, torch.Tensor] | None = None,
    amax: torch.Tensor | None = None,
    out: Float8Cast | None = None,
) -> Float8Cast:
    """A per-tensor fp8 cast of a 2-D ``x`` that writes what each GEMM needs, in one
    pass: ``x``'s layout (``store``), its transpose (``store_t``, both K-major
    operands of a GEMM from one read), and the column sums (``sum_dtype``: the bias
    gradient of dY). The values are :func:`to_float8`'s (``history`` None) or
    :func:`to_float8_delayed`'s, bit for bit.

    Current scaling (``history`` None): two launches, an amax pass and the cast;
    one, the cast, with ``amax`` ((P,) fp32 values whose max is x's amax, found by
    x's producer: :func:`tkern.kernels.norm.norm_forward_float8`).
    Delayed scaling: one launch; with ``update`` it records x's amax into
    ``history`` in the same launch (its last program rolls the history, counted
    on ``counter``: a (1,) int32 zero tensor the layer keeps, a new one if None),
    and ``roll2`` ((history, amax): a weight's deferred update,
    :func:`to_float8_delayed_deferred`'s amax) is rolled in it too. ``defer``:
    the history is left alone and the update comes back as ``amax``.

    Args:
        x: (M, K) fp32, fp16 or bf16, any strides.
        dtype: the fp8 format.
        store, store_t: write ``data`` (M, K) and ``data_t`` (K, M), both contiguous.
        sum_dtype: write ``col_sum`` (K,) of this dtype (fp32, fp16 or bf16).
        history, margin, update, defer, counter, roll2: delayed scaling (above).
        amax: current scaling's amax, found elsewhere (above).
        out: a :class:`Float8Cast` whose tensors receive the cast instead of new ones (a
            weight cache's, held step after step): ``data`` / ``data_t`` where stored, the
            0-dim fp32 ``scale`` and, with ``defer``, the (P,) ``amax`` a previous call
            returned; ``col_sum`` is never taken from it.

    Returns:
        :class:`Float8Cast` (``out``'s tensors where given).
    """
    check_tensor("x", x, ndim=2, dtypes=HIGH_DTYPES)
    check_fp8_dtype(dtype)
    check_fp8_device(x.device, "cast_2d", (dtype,))
    if sum_dtype is not None and sum_dtype not in HIGH_DTYPES:
        raise TypeError(f"sum_dtype must be None or one of {HIGH_DTYPES}, got {sum_dtype}")
    if history is not None:
        _check_delayed(x, history, dtype, margin)
        roll = update and not defer
        if roll and counter is not None:
            check_tensor("counter", counter, ndim=1, dtypes=(torch.int32,))
            check_same_device(x=x, counter=counter)
        if roll2 is not None:
            if not roll:
                raise ValueError(
                    "roll2 rides on this cast's own history update: it needs update and not defer"
                )
            check_amaxes("roll2 history", roll2[0], x)
            check_amaxes("roll2 amax", roll2[1], x)
    elif defer or roll2 is not None or counter is not None:
        raise ValueError("defer, counter and roll2 are delayed scaling's: give the history")
    if amax is not None:
        if history is not None:
            raise ValueError("amax is current scaling's (the amax found elsewhere): give no history")
        check_amaxes("amax", amax, x)
    if out is not None:
        _check_cast_out(out, x, dtype, store, store_t, defer, sum_dtype is not None)
    return cast_2d_prechecked(
        x, dtype, store, store_t, sum_dtype, history, margin, update, defer, counter, roll2, amax, out
    )


def _check_cast_out(out: object, x: torch.Tensor, dtype, store, store_t, defer, whole_columns) -> None:
    """Raise unless ``out`` holds the tensors :func:`cast_2d` would make for these arguments."""
    if not isinstance(out, Float8Cast):
        raise TypeError(f"out must be a Float8Cast (a previous cast_2d's result), got {type(out).__name__}")
    m, k = x.shape
    grid = _grid(m, k, whole_columns)
    want = {
        "data": ((m, k), dtype, store),
        "data_t": ((k, m), dtype, store_t),
        "scale": ((), torch.float32, True),
        "amax": ((grid[0] * grid[1],), torch.float32, defer),
    }
    for name, (shape, want_dtype, needed) in want.items():
        t = getattr(out, name)
        if not needed:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != want_dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"out.{name} must be a contiguous {shape} {want_dtype} tensor, got {got}")
        if not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"out.{name} must be contiguous and on {x.device}")


def cast_2d_prechecked(
    x, dtype, store, store_t, sum_dtype, history, margin, update, defer, counter, roll2, amax=None, out=None
):
    """:func:`cast_2d` for a caller whose arguments are valid (:func:`cast_2d`'s checks passed,
    or the caller made them so: Float8Linear's forward and backward on the inputs
    ``float8_linear`` checked, the GEMM's emitting epilogue, the norm's cast), with
    :func:`cast_2d`'s arguments in its order: the buffers, then one launch (delayed) or
    two (current scaling: the amax pass unless ``amax`` is given, then the cast).

    Returns:
        :class:`Float8Cast`; ``amax`` holds the (P,) partial maxima only with ``defer``."""
    m, k = x.shape
    dev = x.device
    if out is None:
        data = torch.empty((m, k), dtype=dtype, device=dev) if store else None
        data_t = torch.empty((k, m), dtype=dtype, device=dev) if store_t else None
        scale = torch.empty((), dtype=torch.float32, device=dev)
    else:
        data, data_t, scale = out.data if store else None, out.data_t if store_t else None, out.scale
    col_sum = torch.empty(k, dtype=sum_dtype, device=dev) if sum_dtype is not None else None
    grid = _grid(m, k, col_sum is not None)
    if history is None:
        partials = amax
        if partials is None:
            partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dev)
            _launch_cast(x, dtype, partials, scale, partials=partials, amax_only=True, grid=grid)
        _launch_cast(x, dtype, partials, scale, data=data, data_t=data_t, col_sum=col_sum, grid=grid)
        return Float8Cast(data, data_t, scale, col_sum, None)
    roll = update and not defer
    partials = None
    if defer and out is not None:
        partials = out.amax
    elif roll or defer:
        partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dev)
    if roll and counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
    _launch_cast(
        x, dtype, history, scale, data=data, data_t=data_t, partials=partials, col_sum=col_sum,
        counter=counter if roll else None, roll2=roll2, delayed=True, margin=margin, grid=grid,
    )  # fmt: skip
    if roll and not history.is_inference():  # an in-place write, as torch's own would count it
        torch.autograd.graph.increment_version(history)
        if roll2 is not None and not roll2[0].is_inference():
            torch.autograd.graph.increment_version(roll2[0])
    return Float8Cast(data, data_t, scale, col_sum, partials if defer else None)


def _cast_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_float8`'s ``"tensor"`` granularity on a checked ``x`` of any shape: ``(data of
    x's shape, 0-dim scale)`` from :func:`cast_2d_prechecked` over x's rows."""
    cast = cast_2d_prechecked(_as_2d(x), dtype, True, False, None, None, 0, False, False, None, None)
    return cast.data.view(x.shape), cast.scale


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
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or their FNUZ forms).

    Returns:
        ``(data, scale)`` as :func:`to_float8` with ``"tensor"`` granularity.
    """
    _check_x(x, dtype)
    check_amaxes("amax", amax, x)
    x2d = _as_2d(x)
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    _launch_cast(x2d, dtype, amax, scale, data=data.view(x2d.shape))
    return data, scale


def _cast_blocks(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_float8` with (bm, bk) block scales on a checked 2-D ``x``: :func:`cast_blocks`'s
    ``(data, scale)``."""
    data, scale, _ = cast_blocks(x, dtype, block)
    return data, scale


def block_scales(grid: tuple[int, int], row_tiles: bool, device: torch.device) -> torch.Tensor:
    """The (rows, K blocks) fp32 scales of a block cast: K-block-major (strides (1, rows))
    for per-row tiles over more than one K block, as the scaled GEMM reads them; else
    row-major (one K block: rowwise scales, (M, 1) with unit strides, the same order)."""
    if row_tiles and grid[1] > 1:
        return torch.empty(grid[::-1], dtype=torch.float32, device=device).t()
    return torch.empty(grid, dtype=torch.float32, device=device)


def cast_blocks(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], store_t: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`to_float8` of a 2-D ``x`` (M, K) with (bm, bk) block scales, and with
    ``store_t`` the same values transposed, (K, M) contiguous, from the same pass
    (a weight's dgrad operand, K-major; its scales are ``scale.t()``).

    Per-row tiles (bm == 1, DeepSeek-V3's 1x128 activations) store their scales
    K-block-major (strides (1, M)): the scaled GEMM reads the scales of its rows for one
    K block per K step, adjacent in memory; other blocks, and a single K block (rowwise
    scales, (M, 1) with unit strides as ``torch._scaled_mm`` wants them), row-major.

    Returns:
        ``(data, scale, data_t)`` (``data_t`` None without ``store_t``).
    """
    M, K = x.shape
    bm, bk = block
    data = torch.empty((M, K), dtype=dtype, device=x.device)
    data_t = torch.empty((K, M), dtype=dtype, device=x.device) if store_t else None
    grid = (cdiv(M, bm), cdiv(K, bk))
    scale = block_scales(grid, bm == 1, x.device)
    if M == 0 or K == 0:
        return data, scale, data_t
    tm = min(next_power_of_2(bm), TILE_M)
    tk = min(next_power_of_2(bk), TILE_K)
    _cast_blocks_kernel[grid](
        x, M, K, x.stride(0), x.stride(1), data, data if data_t is None else data_t, scale, bm, bk,
        scale.stride(0), scale.stride(1), **_FP8_CONSTANTS[dtype], TM=tm, TK=tk, STORE_T=store_t,
    )  # fmt: skip
    return data, scale, data_t


class TileCast(NamedTuple):
    """:func:`cast_tiles`'s outputs (None where not asked for)."""

    data: torch.Tensor  # (M, K) fp8: x in 1 x 128 tiles
    scale: torch.Tensor  # (M, ceil(K / 128)) fp32, K-block-major
    data_t: torch.Tensor | None  # (K, M) fp8: x^T in 1 x 128 tiles (along M)
    scale_t: torch.Tensor | None  # (K, ceil(M / 128)) fp32, M-block-major
    col_sum: torch.Tensor | None  # (K,) x.sum(0) in fp32, rounded once to sum_dtype


#: The tile of :func:`cast_tiles` (DeepSeek-V3's activation and gradient tiles).
SCALE_TILE = 128


def cast_tiles(
    x: torch.Tensor, dtype: torch.dtype, store_t: bool = False, sum_dtype: torch.dtype | None = None
) -> TileCast:
    """The blockwise recipe's activation / gradient cast in one read of a 2-D ``x`` (M, K):
    x in (1, 128) tiles (``cast_blocks(x, dtype, (1, 128))``), with ``store_t`` x^T in
    (1, 128) tiles along M (``cast_blocks(x.t(), dtype, (1, 128))``, wgrad's operand), and
    with ``sum_dtype`` x.sum(0) summed in fp32 (the bias gradient; per band of 128 rows in
    the kernel, the bands summed in order after it). The casts are bit for bit those two
    ``cast_blocks`` calls."""
    check_tensor("x", x, ndim=2, dtypes=HIGH_DTYPES)
    check_fp8_dtype(dtype)
    if sum_dtype is not None and sum_dtype not in HIGH_DTYPES:
        raise ValueError(f"sum_dtype must be float32, float16 or bfloat16, got {sum_dtype}")
    return cast_tiles_prechecked(x, dtype, store_t, sum_dtype)


def cast_tiles_prechecked(
    x: torch.Tensor, dtype: torch.dtype, store_t: bool, sum_dtype: torch.dtype | None
) -> TileCast:
    """:func:`cast_tiles` for a caller whose arguments are valid (Float8Linear's blockwise
    forward and backward, on the input :func:`tkern.ops.float8.float8_linear` checked and
    on dY): the cast and nothing checked again."""
    M, K = x.shape
    grid = (cdiv(M, SCALE_TILE), cdiv(K, SCALE_TILE))
    data = torch.empty((M, K), dtype=dtype, device=x.device)
    scale = block_scales((M, grid[1]), True, x.device)
    data_t = scale_t = col_sum = partial = None
    if store_t:
        data_t = torch.empty((K, M), dtype=dtype, device=x.device)
        scale_t = block_scales((K, grid[0]), True, x.device)
    if sum_dtype is not None:
        partial = torch.empty(grid[0], K, dtype=torch.float32, device=x.device)
    if M > 0 and K > 0:
        _cast_tiles_kernel[grid](
            x, M, K, x.stride(0), x.stride(1), data, scale,
            data if data_t is None else data_t, scale if scale_t is None else scale_t,
            scale if partial is None else partial, scale.stride(0), scale.stride(1),
            *(scale if scale_t is None else scale_t).stride(), **_FP8_CONSTANTS[dtype], TILE=SCALE_TILE,
            STORE_T=store_t, COL_SUM=sum_dtype is not None, num_warps=CAST_TILES_WARPS,
        )  # fmt: skip
    if sum_dtype is not None:
        col_sum = partial.sum(0).to(sum_dtype)  # (0, K) partials when M == 0: zeros
    return TileCast(data, scale, data_t, scale_t, col_sum)


def check_amaxes(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """``t`` (an amax history, or amaxes to take the max of) is (H,) fp32, contiguous,
    H >= 1, on ``x``'s device."""
    check_tensor(name, t, ndim=1, dtypes=(torch.float32,))
    check_same_device(**{"x": x, name: t})
    if t.numel() < 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous (H,) tensor with H >= 1, got shape {tuple(t.shape)}")


def _check_delayed(x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, margin: int) -> None:
    """Raise unless ``x`` can be cast to ``dtype`` with delayed scaling from ``history``."""
    _check_x(x, dtype)
    check_amaxes("history", history, x)
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")


def to_float8_delayed(
    x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, margin: int = 0,
    *, update: bool = True, counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Cast ``x`` to fp8 per tensor with Transformer Engine's delayed scaling.

    The multiplier is ``fp8_max / max(history) x 2^-margin`` (1.0 while the
    history holds no amax yet, as TE starts its scales); ``x``'s own amax is
    rolled into ``history`` (newest first) in the same launch when ``update``,
    so a value beyond the history saturates this step and the scale adapts the next.

    Args:
        x: fp32, fp16 or bf16, any shape.
        history: (H,) fp32 amax history on x's device, updated in place.
        dtype, margin: the fp8 format; the margin (power of two) kept below fp8_max.
        update: roll this step's amax into the history (training); False casts only.
        counter: (1,) int32 zeros the launch counts its finished programs on (and
            leaves zero); a new one when None. A layer keeps its own.

    Returns:
        ``(data, scale)`` as :func:`to_float8` with ``"tensor"`` granularity.
    """
    _check_delayed(x, history, dtype, margin)
    cast = cast_2d_prechecked(
        _as_2d(x), dtype, True, False, None, history, margin, update, False, counter, None
    )
    return cast.data.view(x.shape), cast.scale


def to_float8_delayed_deferred(
    x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`to_float8_delayed`'s cast with the history's update put off: the
    history is left as it is, and the update comes back as ``amax``.

    ``roll_amax_history(history, amax)`` later (with the history unchanged in
    between) leaves it exactly as ``to_float8_delayed(x, history, update=True)``
    would have; the data and scale are that call's. This is how the optimizer's
    step casts a delayed-scaling weight once for the next training forward
    (:class:`tkern.functional.Float8WeightCache`), which then makes the update
    (in its input's cast: :func:`cast_2d`'s ``roll2``).

    Returns:
        ``(data, scale, amax)``: ``amax`` a (P,) fp32 tensor of partial maxima of
        |x| (its max is x's amax, 0 for an empty x).
    """
    _check_delayed(x, history, dtype, margin)
    cast = cast_2d_prechecked(_as_2d(x), dtype, True, False, None, history, margin, True, True, None, None)
    return cast.data.view(x.shape), cast.scale, cast.amax


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
    roll_amax_history_prechecked(history, amax)


def roll_amax_history_prechecked(history: torch.Tensor, amax: torch.Tensor) -> None:
    """:func:`roll_amax_history` for a caller that checked both (Float8Linear's forward: the
    layer's weight history and its cached cast's amax, float8_linear's checks)."""
    h, count = history.numel(), amax.numel()
    _roll_history_kernel[(1,)](
        history, h, amax, count,
        HBLOCK=next_power_of_2(h), PBLOCK=next_power_of_2(count),
    )  # fmt: skip
    if not history.is_inference():  # an in-place write, as torch's own would count it
        torch.autograd.graph.increment_version(history)
