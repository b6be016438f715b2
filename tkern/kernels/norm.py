"""LayerNorm and RMSNorm, forward and backward, with fp32 statistics.

One kernel per direction serves both norms (``IS_RMS`` picks the formula) and
the fused residual form (``HAS_RESIDUAL``: ``h = x + residual`` added in fp32,
rounded once to the input's dtype and stored, then normalized in the same pass).

Precision, the rules every path keeps:

* the input (fp16, bf16 or fp32) is upcast to fp32 on load; the weight and
  bias (fp32, or the input's dtype) likewise;
* LayerNorm's variance is a two-pass sum of squared deviations from the row
  mean (rows of one block), or Chan's pairwise combination of each chunk's
  two-pass statistics (longer rows): never ``E[x^2] - E[x]^2``, which loses
  every digit of the variance of unit-variance data offset by 2000 in fp32;
* the output is the fp32 result rounded once to the input's dtype
  (:func:`cast_rne`, also under the interpreter);
* the mean (LayerNorm) and ``rstd = 1 / sqrt(var + eps)`` are stored per row in
  fp32 for the backward, which recomputes ``xhat`` from the input;
* backward: dx computed in fp32 and rounded once; dweight / dbias summed in fp32
  per program into a ``(num_programs, N)`` buffer, then reduced over the programs in
  fp32 in a fixed order by one more launch for both (``_norm_param_grads_kernel``),
  which rounds each once to its parameter's dtype, into a new tensor or (gradient
  accumulation into a fused optimizer's flat buffer) added to the gradient there.

Rows of up to :data:`MAX_BLOCK` elements are held in registers whole (one
block, one read of the input); longer rows are walked in chunks of
:data:`MAX_BLOCK`, reading the input twice in forward and backward (the second
read mostly from L2).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkern import device as tkdev
from tkern.kernels._common import (
    INTERPRET,
    cast_rne,
    cdiv,
    check_same_device,
    check_tensor,
    next_power_of_2,
    tl_dtype,
    to_f32,
)
from tkern.kernels.float8 import (
    MAX_PROGRAMS,
    cast_2d_prechecked,
    cast_multiplier,
    check_amaxes,
    check_fp8_device,
    check_fp8_dtype,
    fp8_constants,
    last_to_finish,
    load_tile,
    release_counter,
    roll_amax_history,
    roll_if_last,
    store_fp8_tile,
)

__all__ = [
    "MAX_BLOCK",
    "NormBackward",
    "NormFloat8",
    "NormForward",
    "norm_backward",
    "norm_forward",
    "norm_forward_float8",
]

#: dtypes the norms take as input (and return).
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Longest row held in registers as one block: 8192 fp32 values over 16 warps
#: (512 threads) are 16 registers per thread per live row-sized tensor; the
#: backward keeps about six (x, dy, w, xhat, w * dy and the two accumulators), ~100
#: registers, below the 255 a thread may have (no spills, checked by the compile
#: gate). A longer row is processed in chunks of this size.
MAX_BLOCK = 8192
#: Elements of a row per warp (a block gets one more warp per this many, up to
#: :data:`MAX_WARPS`): 4 per thread. At 8 per thread (one 16-byte load of fp16 / bf16)
#: 1024-wide rows on 4 warps spilled 8 B on sm_80: the fp16 RMSNorm backward with dh
#: (triton 3.9) and the fp16 / bf16 LayerNorm forward (triton 3.6).
ELEMENTS_PER_WARP = 128
MAX_WARPS = 16
#: Backward programs per SM: each sums its rows' dweight / dbias in registers and
#: writes one (N,) partial row; two per SM keep every SM busy while the (P, N)
#: partial buffer stays small next to the (M, N) gradient.
PROGRAMS_PER_SM = 2
#: Backward programs under the interpreter (each costs milliseconds to start):
#: few, but more than one, so the partial sums are exercised.
_INTERPRET_PROGRAMS = 4
#: Columns of dweight / dbias one program of the partial sums' reduction
#: (``_norm_param_grads_kernel``) takes: about one program per SM (768 wide: 24 programs,
#: 4096 on 132 SMs: 128), at least a 128-byte line of fp32 of each partial row (32), at
#: most 256.
REDUCE_MIN_COLS = 32
REDUCE_MAX_COLS = 256
#: Elements of the (ROWS, COLS) tile of partials it sums per step: 16 fp32 registers a
#: thread over :data:`REDUCE_WARPS` warps, for each of dweight's and dbias's tiles.
REDUCE_TILE = 2048
REDUCE_WARPS = 4
#: Its columns per program under the interpreter: few programs, several for a ragged N
#: past it (masked).
_INTERPRET_REDUCE_COLS = 512
#: Elements of the (ROWS, BLOCK) tile one-block rows are taken in under the interpreter,
#: whose cost is per operation and program, not per element: many rows at once there.
#: On a GPU ROWS is 1 (a row per program, or per step of the backward's row loop).
_INTERPRET_TILE = 65536


def tile_rows(rows: int, block: int, interpret: bool = INTERPRET) -> int:
    """ROWS of the (ROWS, BLOCK) tile the kernels take one-block rows in: 1 on a GPU
    (``interpret=False``: a row per program), under the interpreter the next power of
    two of ``rows``, up to :data:`_INTERPRET_TILE` elements a tile."""
    if not interpret:
        return 1
    return max(1, min(next_power_of_2(max(rows, 1)), _INTERPRET_TILE // block))


def block_size(n: int) -> int:
    """The kernels' BLOCK for rows of ``n`` elements: the next power of two, or
    :data:`MAX_BLOCK` (chunked rows) above it."""
    return min(next_power_of_2(max(n, 1)), MAX_BLOCK)


def num_warps(block: int) -> int:
    """Warps for a BLOCK-wide row: one per :data:`ELEMENTS_PER_WARP`, 1 to :data:`MAX_WARPS`."""
    return min(max(block // ELEMENTS_PER_WARP, 1), MAX_WARPS)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _load_input(x_ptr, res_ptr, h_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
    """One chunk of the row to normalize, in fp32 (0 where masked): x, or with
    HAS_RESIDUAL ``h = x + residual`` added in fp32, stored rounded once to DTYPE,
    and returned as stored (so the norm is exactly that of the returned h)."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = cast_rne(x + r, DTYPE)
        tl.store(h_ptr + cols, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _centered(x, mask, n, AXIS: tl.constexpr):
    """(mean, x - mean) of the n unmasked values of fp32 ``x`` along AXIS, 0 where masked
    (AXIS 0: a chunk, the mean a scalar; 1: a (ROWS, BLOCK) tile, the means (ROWS, 1)),
    by the corrected two-pass algorithm: the first mean's rounding error (up to
    ~n * 2^-24 * |mean|, 1e-4 of a unit deviation at an offset of 2000) is
    removed by adding the mean of the deviations from it, computed nearly exactly
    since x and the mean are close (Chan, Golub & LeVeque 1983)."""
    mean = tl.sum(x, axis=AXIS, keep_dims=AXIS == 1) / n
    mean += tl.sum(tl.where(mask, x - mean, 0.0), axis=AXIS, keep_dims=AXIS == 1) / n
    return mean, tl.where(mask, x - mean, 0.0)


@triton.jit
def _normalize_store(
    x,
    y_ptr,
    w_ptr,
    b_ptr,
    cols,
    mask,
    mean,
    rstd,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """y = (x - mean) * rstd * w + b in fp32, stored rounded once to DTYPE."""
    y = (x - mean) * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, cast_rne(y, DTYPE), mask=mask)


@triton.jit
def _grad_terms(x, dy, w_ptr, cols, mask, mean, rstd, HAS_WEIGHT: tl.constexpr):
    """(xhat, w * dy) in fp32 for one chunk, both 0 where masked."""
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    wdy = dy
    if HAS_WEIGHT:
        wdy = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return xhat, wdy


# --------------------------------------------------------------------------- kernels


@triton.jit
def _norm_rows(
    row0,  # int64: the first of the ROWS rows of x (and of every (M, N) output) this call normalizes
    M,  # rows from M on are masked
    x_ptr, res_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,  # as _norm_fwd_kernel's
    N, stride_x, stride_res, eps,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """ROWS one-block rows (BLOCK >= N) held whole in registers as a (ROWS, BLOCK) tile, one
    read: statistics in fp32 per row, then the normalized rows, rounded once and stored."""
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)[None, :]
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)
    x = _load_input(
        x_ptr + rows[:, None] * stride_x, res_ptr + rows[:, None] * stride_res, h_ptr + rows[:, None] * N,
        cols, mask, HAS_RESIDUAL, DTYPE,
    )  # fmt: skip
    if IS_RMS:
        mean = 0.0
        var = tl.sum(x * x, axis=1, keep_dims=True) / N
    else:
        mean, xc = _centered(x, mask, N, 1)
        var = tl.sum(xc * xc, axis=1, keep_dims=True) / N
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    _normalize_store(
        x, y_ptr + rows[:, None] * N, w_ptr, b_ptr, cols, mask, mean, rstd, HAS_WEIGHT, HAS_BIAS, DTYPE
    )
    if not IS_RMS:
        tl.store(mean_ptr + rows[:, None], mean, mask=row_mask[:, None])
    tl.store(rstd_ptr + rows[:, None], rstd, mask=row_mask[:, None])


@triton.jit
def _norm_row_chunked(
    row,  # int64: the row of x (and of every (M, N) output) this call normalizes
    x_ptr, res_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,  # as _norm_fwd_kernel's
    N, stride_x, stride_res, eps,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row wider than BLOCK, walked in chunks: Chan's combination of each chunk's
    (count, mean, M2), then a second pass for the normalized row, rounded once and stored."""
    x_ptr += row * stride_x
    res_ptr += row * stride_res
    h_ptr += row * N
    y_ptr += row * N
    offs = tl.arange(0, BLOCK)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, N, BLOCK):
        cols = start + offs
        mask = cols < N
        x = _load_input(x_ptr, res_ptr, h_ptr, cols, mask, HAS_RESIDUAL, DTYPE)
        if IS_RMS:
            m2 += tl.sum(x * x, axis=0)
        else:
            n_chunk = tl.minimum(N - start, BLOCK).to(tl.float32)
            chunk_mean, xc = _centered(x, mask, n_chunk, 0)
            delta = chunk_mean - mean
            total = count + n_chunk
            mean += delta * (n_chunk / total)
            m2 += tl.sum(xc * xc, axis=0) + delta * delta * (count * n_chunk / total)
            count = total
    rstd = 1.0 / tl.sqrt_rn(m2 / N + eps)
    if HAS_RESIDUAL:
        tl.debug_barrier()  # h, stored above by other threads, is read back below
    for start in range(0, N, BLOCK):
        cols = start + offs
        mask = cols < N
        if HAS_RESIDUAL:
            x = tl.load(h_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        _normalize_store(x, y_ptr, w_ptr, b_ptr, cols, mask, mean, rstd, HAS_WEIGHT, HAS_BIAS, DTYPE)
    if not IS_RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_fwd_kernel(
    # pointers
    x_ptr,  # (M, N) input, fp16/bf16/fp32, row stride stride_x, unit column stride
    res_ptr,  # (M, N) residual, x's dtype, row stride stride_res (HAS_RESIDUAL only)
    h_ptr,  # (M, N) output x + residual, x's dtype, contiguous (HAS_RESIDUAL only)
    y_ptr,  # (M, N) output, x's dtype, contiguous
    w_ptr,  # (N,) weight, fp32 or x's dtype (HAS_WEIGHT only)
    b_ptr,  # (N,) bias, fp32 or x's dtype (HAS_BIAS only)
    mean_ptr,  # (M,) fp32 output: row means (LayerNorm only)
    rstd_ptr,  # (M,) fp32 output: 1 / sqrt(var + eps) (RMSNorm: 1 / sqrt(mean(x^2) + eps))
    # dimensions
    M,
    N,
    stride_x,
    stride_res,
    eps,
    # meta-parameters
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,  # x's Triton dtype
    BLOCK: tl.constexpr,  # a power of two: >= N (one-block rows), else the chunk
    CHUNKED: tl.constexpr,  # N > BLOCK: the row is walked in chunks of BLOCK
    ROWS: tl.constexpr,  # rows per program (tile_rows: 1 on a GPU; chunked rows: 1)
):
    """ROWS rows per program: statistics in fp32, then the normalized rows, rounded once."""
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    if CHUNKED:
        _norm_row_chunked(
            row0, x_ptr, res_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,
            N, stride_x, stride_res, eps, IS_RMS, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, DTYPE, BLOCK,
        )  # fmt: skip
    else:
        _norm_rows(
            row0, M, x_ptr, res_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,
            N, stride_x, stride_res, eps, IS_RMS, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, DTYPE, BLOCK, ROWS,
        )  # fmt: skip


@triton.jit
def _norm_fwd_fp8_kernel(
    # pointers: the norm's (no residual)
    x_ptr,  # (M, N) input, fp16/bf16/fp32, row stride stride_x, unit column stride
    y_ptr,  # (M, N) output, x's dtype, contiguous
    w_ptr,  # (N,) weight, fp32 or x's dtype (HAS_WEIGHT only)
    b_ptr,  # (N,) bias, fp32 or x's dtype (HAS_BIAS only)
    mean_ptr,  # (M,) fp32 output (LayerNorm only)
    rstd_ptr,  # (M,) fp32 output
    # pointers: y's fp8 cast
    data_ptr,  # (M, N) fp8 DTYPE8, contiguous: y's cast (DELAYED)
    data_t_ptr,  # (N, M) fp8 DTYPE8, contiguous: the same values transposed (DELAYED and STORE_T)
    scale_ptr,  # (1,) fp32: 1 / multiplier, written by program 0 (DELAYED)
    partials_ptr,  # (programs,) fp32 output: this program's max |y| (RECORD)
    history_ptr,  # (H,) fp32: the amax history the multiplier comes from, rolled with y's amax (ROLL)
    counter_ptr,  # (1,) int32, 0 between launches: programs finished (ROLL)
    # up to MAX_ROLLS more histories the last program rolls (ROLL): roll{i}_ptr (H{i},) fp32
    # receives max(amax{i}_ptr[:count{i}]) (partials_ptr for y's amax; H{i} = 0: none)
    roll0_ptr,
    amax0_ptr,
    roll1_ptr,
    amax1_ptr,
    roll2_ptr,
    amax2_ptr,
    roll3_ptr,
    amax3_ptr,
    roll4_ptr,
    amax4_ptr,
    # dimensions
    M,
    N,
    stride_x,
    eps,
    H,
    margin_factor,  # margin_factor: 2^-margin (DELAYED)
    H0,
    count0,
    H1,
    count1,
    H2,
    count2,
    H3,
    count3,
    H4,
    count4,
    # meta-parameters: the norm's
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,  # x's Triton dtype
    BLOCK: tl.constexpr,  # a power of two >= N: the row in registers (chunked rows take another path)
    # meta-parameters: the cast's
    DELAYED: tl.constexpr,  # cast y with the history's multiplier (else only RECORD its amax)
    STORE_T: tl.constexpr,
    RECORD: tl.constexpr,  # store each program's max |y| (tensorwise's amax; ROLL's)
    ROLL: tl.constexpr,  # the last program rolls y's amax into history_ptr, and the N_ROLLS
    N_ROLLS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MULT_AT_EPS: tl.constexpr,
    EPS_F32: tl.constexpr,
    DTYPE8: tl.constexpr,
    ROWS: tl.constexpr,  # rows per band (a power of two)
    NORM_ROWS: tl.constexpr,  # rows normalized at once (tile_rows: 1 on a GPU), a divisor of ROWS
    TK: tl.constexpr,  # tile columns of the cast
    PBLOCK: tl.constexpr,  # a power of two >= the programs, H and every count{i}
    HBLOCK: tl.constexpr,  # a power of two >= H and every H{i}
):
    """LayerNorm / RMSNorm of each row that also writes y's per-tensor fp8 cast, in
    both layouts, for the next GEMM (Transformer Engine's fused LayerNorm-Linear).

    Program p takes the bands of ROWS rows p, p + P, ...: each row normalized as
    ``_norm_fwd_kernel`` does it (the same code, ``_norm_rows``: y is bit for bit that kernel's), then
    the band's y read back in (ROWS, TK) tiles (from cache: this program just wrote
    it) and, under DELAYED, cast with the history's multiplier into y's layout and
    y^T's (the transposed stores ROWS bytes wide), exactly as ``cast_2d`` casts y.
    RECORD keeps each program's max |y|; ROLL counts the programs finished as
    ``cast_2d`` does and the last one rolls y's amax into the history and the extra
    histories (another consumer's input, a cached weight's deferred amax)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    mult = 1.0
    if DELAYED:
        mult = cast_multiplier(
            history_ptr, H, margin_factor, scale_ptr, pid, True, FP8_MAX, MULT_AT_EPS, EPS_F32, PBLOCK
        )
    rows_t = tl.arange(0, ROWS)
    cols_t = tl.arange(0, TK)
    best = 0.0  # max |y| so far: a scalar (a tile held across the rows' code spilled on sm_89)
    for band in range(pid.to(tl.int64), tl.cdiv(M, ROWS), nprog):  # int64: row * N may pass 2^31
        row0 = band * ROWS
        row_end = tl.minimum(row0 + ROWS, M)
        for r in range(row0, row_end, NORM_ROWS):
            _norm_rows(
                r, row_end, x_ptr, x_ptr, y_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, N, stride_x, 0, eps,
                IS_RMS, False, HAS_WEIGHT, HAS_BIAS, DTYPE, BLOCK, NORM_ROWS,
            )  # fmt: skip
        tl.debug_barrier()  # the band's y, stored above by other threads, is read back below
        rows = row0 + rows_t
        for c in range(0, N, TK):
            cols = (c + cols_t).to(tl.int64)  # int64: cols * M may pass 2^31
            y, _, _, mask = load_tile(y_ptr, rows, cols, row_end, N, N, 1)
            y = y.to(tl.float32)
            if RECORD:
                best = tl.maximum(best, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
            if DELAYED:
                store_fp8_tile(
                    y, rows, cols, mask, M, N, mult, data_ptr, data_t_ptr, True, STORE_T, FP8_MAX, DTYPE8
                )
    if RECORD:
        tl.store(partials_ptr + pid, best)
    if ROLL:
        last = last_to_finish(counter_ptr, nprog)
        roll_if_last(history_ptr, H, partials_ptr, nprog, last, PBLOCK, HBLOCK)
        if N_ROLLS > 0:
            roll_if_last(roll0_ptr, H0, amax0_ptr, count0, last, PBLOCK, HBLOCK)
        if N_ROLLS > 1:
            roll_if_last(roll1_ptr, H1, amax1_ptr, count1, last, PBLOCK, HBLOCK)
        if N_ROLLS > 2:
            roll_if_last(roll2_ptr, H2, amax2_ptr, count2, last, PBLOCK, HBLOCK)
        if N_ROLLS > 3:
            roll_if_last(roll3_ptr, H3, amax3_ptr, count3, last, PBLOCK, HBLOCK)
        if N_ROLLS > 4:
            roll_if_last(roll4_ptr, H4, amax4_ptr, count4, last, PBLOCK, HBLOCK)
        release_counter(counter_ptr, last, nprog)


@triton.jit
def _norm_bwd_kernel(
    # pointers
    dy_ptr,  # (M, N) upstream gradient of y, x's dtype, row stride stride_dy
    dh_ptr,  # (M, N) upstream gradient of h = x + residual, x's dtype, row stride stride_dh (HAS_DH)
    x_ptr,  # (M, N) the normalized input saved by forward (x, or h), row stride stride_x
    w_ptr,  # (N,) weight, fp32 or x's dtype (HAS_WEIGHT only)
    mean_ptr,  # (M,) fp32 row means (LayerNorm only)
    rstd_ptr,  # (M,) fp32 row 1 / std
    dx_ptr,  # (M, N) output, x's dtype, contiguous
    dw_ptr,  # (P, N) fp32 output: this program's row of dweight partial sums (HAS_DW)
    db_ptr,  # (P, N) fp32 output: this program's row of dbias partial sums (HAS_DB)
    # dimensions
    M,
    N,
    stride_dy,
    stride_dh,
    stride_x,
    rows_per_program,
    # meta-parameters
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    DTYPE: tl.constexpr,  # x's Triton dtype
    BLOCK: tl.constexpr,  # a power of two: >= N (one-block rows), else the chunk
    CHUNKED: tl.constexpr,  # N > BLOCK: the row is walked in chunks of BLOCK
    ROWS: tl.constexpr,  # one-block rows per step of the row loop (tile_rows: 1 on a GPU)
):
    """Rows ``[pid * rows_per_program, ...)`` of dx, and their dweight / dbias sums.

    With xhat = (x - mean) * rstd and g = w * dy (all fp32):
    dx = rstd * (g - xhat * mean(xhat * g) - mean(g)) (RMSNorm: no mean(g) term),
    plus dh when h = x + residual was an output too; dweight = sum over rows of
    dy * xhat, dbias = sum of dy. One-block rows keep the sums in registers and
    store them once; chunked rows add into this program's partial row (the host
    zeroes the buffer), which no other program touches."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    first_row = row_start.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    dw_ptr += pid.to(tl.int64) * N
    db_ptr += pid.to(tl.int64) * N
    if not CHUNKED:  # (ROWS, BLOCK) tiles of whole rows
        cols = offs[None, :]
        dw_acc = tl.zeros((BLOCK,), tl.float32)
        db_acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, row_end - row_start, ROWS):
            r = first_row + i + tl.arange(0, ROWS)  # int64: r * stride may pass 2^31
            row_mask = r < row_end
            mask = row_mask[:, None] & (cols < N)
            r = r[:, None]
            x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            mean = 0.0 if IS_RMS else tl.load(mean_ptr + r, mask=row_mask[:, None], other=0.0)
            rstd = tl.load(rstd_ptr + r, mask=row_mask[:, None], other=0.0)
            xhat, wdy = _grad_terms(x, dy, w_ptr, cols, mask, mean, rstd, HAS_WEIGHT)
            c1 = tl.sum(xhat * wdy, axis=1, keep_dims=True) / N
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                dx = (wdy - (xhat * c1 + tl.sum(wdy, axis=1, keep_dims=True) / N)) * rstd
            if HAS_DH:
                dx += tl.load(dh_ptr + r * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + r * N + cols, cast_rne(dx, DTYPE), mask=mask)
            if HAS_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if HAS_DB:
                db_acc += tl.sum(dy, axis=0)
        if HAS_DW:
            tl.store(dw_ptr + offs, dw_acc, mask=offs < N)
        if HAS_DB:
            tl.store(db_ptr + offs, db_acc, mask=offs < N)
    else:
        for i in range(0, row_end - row_start):
            r = first_row + i  # int64: r * stride may pass 2^31
            mean = 0.0 if IS_RMS else tl.load(mean_ptr + r)
            rstd = tl.load(rstd_ptr + r)
            sum_xg = 0.0
            sum_g = 0.0
            for start in range(0, N, BLOCK):
                cols = start + offs
                mask = cols < N
                x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                xhat, wdy = _grad_terms(x, dy, w_ptr, cols, mask, mean, rstd, HAS_WEIGHT)
                sum_xg += tl.sum(xhat * wdy, axis=0)
                sum_g += tl.sum(wdy, axis=0)
            c1 = sum_xg / N
            c2 = 0.0 if IS_RMS else sum_g / N
            for start in range(0, N, BLOCK):
                cols = start + offs
                mask = cols < N
                x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                xhat, wdy = _grad_terms(x, dy, w_ptr, cols, mask, mean, rstd, HAS_WEIGHT)
                dx = (wdy - (xhat * c1 + c2)) * rstd
                if HAS_DH:
                    dx += tl.load(dh_ptr + r * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + r * N + cols, cast_rne(dx, DTYPE), mask=mask)
                if HAS_DW:
                    tl.store(dw_ptr + cols, tl.load(dw_ptr + cols, mask=mask) + dy * xhat, mask=mask)
                if HAS_DB:
                    tl.store(db_ptr + cols, tl.load(db_ptr + cols, mask=mask) + dy, mask=mask)


@triton.jit
def _sum_partials(part_ptr, out_ptr, P, N, cols, col_mask, ACC: tl.constexpr, DTYPE: tl.constexpr,
                  ROWS: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    """Columns ``cols`` of the (P, N) fp32 partials summed over P in fp32, in a fixed order
    ((ROWS, COLS) tiles from row 0 down, each tile's rows summed by one tree), with ACC
    added to what ``out_ptr`` holds (fp32), and stored rounded once to DTYPE."""
    acc = tl.zeros((COLS,), tl.float32)
    rows = tl.arange(0, ROWS)
    for p in range(0, P, ROWS):
        r = p + rows
        mask = (r < P)[:, None] & col_mask[None, :]
        part = tl.load(part_ptr + r[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(part, axis=0)
    if ACC:
        acc += to_f32(tl.load(out_ptr + cols, mask=col_mask, other=0.0))
    tl.store(out_ptr + cols, cast_rne(acc, DTYPE), mask=col_mask)


@triton.jit
def _norm_param_grads_kernel(
    # pointers
    dw_part_ptr,  # (P, N) fp32: _norm_bwd_kernel's dweight partial sums, a row per program (HAS_DW)
    db_part_ptr,  # (P, N) fp32: its dbias partial sums (HAS_DB)
    dw_ptr,  # (N,) contiguous, DW_DTYPE: dweight, written (or with ACC_DW added into) (HAS_DW)
    db_ptr,  # (N,) contiguous, DB_DTYPE: dbias, likewise with ACC_DB (HAS_DB)
    # dimensions
    P,
    N,
    # meta-parameters
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    ACC_DW: tl.constexpr,  # add into dw_ptr's gradient (a flat buffer's .grad), else overwrite it
    ACC_DB: tl.constexpr,
    DW_DTYPE: tl.constexpr,  # dweight's Triton dtype (fp32, fp16 or bf16)
    DB_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,  # partial rows summed per step (a power of two)
    COLS: tl.constexpr,  # columns per program (a power of two)
):
    """dweight and dbias of one norm from the backward's per-program partial sums, one
    launch for both: program c sums columns ``[c * COLS, (c + 1) * COLS)`` of each (P, N)
    buffer over its P rows in fp32 in a fixed order (deterministic), adds the gradient
    already there where ACC (fp32), and stores the result rounded once. Columns past N
    are masked (ragged N)."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    col_mask = cols < N
    if HAS_DW:
        _sum_partials(dw_part_ptr, dw_ptr, P, N, cols, col_mask, ACC_DW, DW_DTYPE, ROWS, COLS)
    if HAS_DB:
        _sum_partials(db_part_ptr, db_ptr, P, N, cols, col_mask, ACC_DB, DB_DTYPE, ROWS, COLS)


# --------------------------------------------------------------------------- launchers


class NormForward(NamedTuple):
    """What :func:`norm_forward` returns."""

    y: torch.Tensor  # (M, N), x's dtype
    h: torch.Tensor | None  # (M, N) x + residual, x's dtype; None without a residual
    mean: torch.Tensor | None  # (M,) fp32; None for RMSNorm
    rstd: torch.Tensor  # (M,) fp32


class NormBackward(NamedTuple):
    """What :func:`norm_backward` returns (None where not asked for)."""

    dx: torch.Tensor  # (M, N), x's dtype
    dweight: torch.Tensor | None  # (N,), the weight's dtype
    dbias: torch.Tensor | None  # (N,), bias_dtype


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (M, N) with unit column stride, read in place where it has one
    (any row stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _check_param(name: str, p: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    if p is None:
        return
    check_tensor(name, p, ndim=1, dtypes=tuple(dict.fromkeys((torch.float32, x.dtype))))
    if p.shape[0] != n:
        raise ValueError(
            f"{name} must have shape ({n},) to match x's last dimension, got shape {tuple(p.shape)}"
        )


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    residual: torch.Tensor | None = None,
) -> NormForward:
    """LayerNorm (``rms=False``) or RMSNorm of each row of ``x``, statistics in fp32.

    Args:
        x: (M, N), fp16/bf16/fp32, any row stride (a column stride other than 1
            is copied first).
        weight, bias: optional (N,), fp32 or x's dtype (RMSNorm takes no bias).
        eps: added to the variance (RMSNorm: to the mean square), >= 0.
        rms: RMSNorm when True.
        residual: optional (M, N) of x's dtype: the row normalized is then
            ``h = x + residual``, added in fp32 and rounded once, also returned.

    Returns:
        :class:`NormForward` ``(y, h, mean, rstd)``: y (M, N) in x's dtype
        (contiguous); h (M, N) or None; mean (M,) fp32 or None (RMSNorm);
        rstd (M,) fp32.
    """
    check_norm_args(x, weight, bias, eps, rms, residual)
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    return norm_forward_prechecked(x, weight, bias, eps, rms, residual)


def check_norm_args(x, weight, bias, eps, rms: bool, residual=None) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument unless :func:`norm_forward`
    (and :func:`norm_forward_float8`) can normalize ``x``'s rows with these (devices apart)."""
    check_tensor("x", x, ndim=2, dtypes=INPUT_DTYPES)
    N = x.shape[1]
    _check_param("weight", weight, N, x)
    if bias is not None and rms:
        raise ValueError("RMSNorm takes no bias")
    _check_param("bias", bias, N, x)
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), shape=x.shape)
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def norm_forward_prechecked(x, weight, bias, eps, rms, residual=None) -> NormForward:
    """:func:`norm_forward` for arguments already checked (:func:`check_norm_args`, one
    device): the launch, nothing checked again."""
    M, N = x.shape
    x = rows_view(x)
    residual = None if residual is None else rows_view(residual)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty_like(y)
    mean = None if rms else torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and N:
        block = block_size(N)
        rows = tile_rows(M, block) if block >= N else 1
        _norm_fwd_kernel[(cdiv(M, rows),)](
            x, residual if residual is not None else x, h if h is not None else y, y,
            weight if weight is not None else x, bias if bias is not None else x,
            mean if mean is not None else rstd, rstd,
            M, N, x.stride(0), residual.stride(0) if residual is not None else 0, float(eps),
            IS_RMS=rms, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, DTYPE=tl_dtype(x.dtype), BLOCK=block, CHUNKED=block < N,
            ROWS=rows, num_warps=num_warps(block),
        )  # fmt: skip
    elif M:  # N == 0: nothing to normalize (torch gives an empty output too)
        rstd.zero_()
        if mean is not None:
            mean.zero_()
    return NormForward(y, h, mean, rstd)


#: Rows per band of the fp8-emitting forward (:func:`norm_forward_float8`): the transposed
#: fp8 store writes this many bytes of each column of y^T at once (a 32-byte sector on a GPU);
#: under the interpreter more, for fewer programs.
FP8_ROWS = 64 if INTERPRET else 32
#: Columns per tile of its cast (the (FP8_ROWS, FP8_TK) tile read back from y).
FP8_TK = 128
#: The widest row the fp8-emitting kernel takes (wider rows: the norm, then the cast). At
#: MAX_BLOCK (8192, 16 warps) its RMSNorm recording y's amax spilled 8 B on sm_89 (triton 3.9).
FP8_MAX_BLOCK = 4096
#: Extra histories one launch rolls (``rolls``): the other input histories and cached
#: weights' deferred amaxes of up to three GEMMs sharing the cast (Llama's q, k and v).
MAX_ROLLS = 5


class NormFloat8(NamedTuple):
    """What :func:`norm_forward_float8` returns."""

    y: torch.Tensor  # (M, N), x's dtype, contiguous: as norm_forward's
    mean: torch.Tensor | None  # (M,) fp32; None for RMSNorm
    rstd: torch.Tensor  # (M,) fp32
    data: torch.Tensor  # (M, N) fp8, contiguous: y's per-tensor cast
    data_t: torch.Tensor | None  # (N, M) fp8, contiguous: the same values transposed (store_t)
    scale: torch.Tensor  # 0-dim fp32: y ~ data * scale


def _check_rolls(rolls, x: torch.Tensor) -> None:
    if len(rolls) > MAX_ROLLS:
        raise ValueError(f"rolls holds at most {MAX_ROLLS} (history, amax) pairs, got {len(rolls)}")
    for i, pair in enumerate(rolls):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"rolls[{i}] must be a (history, amax or None) pair, got {pair!r}")
        check_amaxes(f"rolls[{i}] history", pair[0], x)
        if pair[1] is not None:
            check_amaxes(f"rolls[{i}] amax", pair[1], x)


def norm_forward_float8(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    store_t: bool = False,
    history: torch.Tensor | None = None,
    margin: int = 0,
    update: bool = True,
    counter: torch.Tensor | None = None,
    rolls: tuple = (),
) -> NormFloat8:
    """:func:`norm_forward` (no residual) that also casts y to fp8 per tensor for the
    next GEMM, in y's layout and (``store_t``) y^T's: the producer-side cast of
    Transformer Engine's fused LayerNorm-Linear. y, mean and rstd are bit for bit
    :func:`norm_forward`'s; the cast is bit for bit ``cast_2d(y, dtype, store_t=store_t,
    history=history, margin=margin, update=update, counter=counter)``'s.

    Delayed scaling (``history`` given): one launch. The multiplier comes from the
    history, known before the launch, so the norm writes y's cast as it writes y;
    with ``update`` the launch's last program rolls y's amax into ``history`` and each
    of ``rolls``: ``(history, None)`` receives y's amax too (another GEMM's input
    history, when several GEMMs read the one cast), ``(history, amax)`` the max of
    ``amax`` (a cached weight's deferred update, :func:`~tkern.kernels.float8.cast_2d`'s
    ``roll2``). Current scaling (``history`` None): two launches, the norm recording
    y's amax as it goes (no amax pass over y), then the cast with that amax.

    Args:
        x: (M, N), fp16/bf16/fp32, any row stride; N >= 1.
        weight, bias, eps, rms: as :func:`norm_forward`.
        dtype: the fp8 format.
        store_t: also write y^T's cast (the next GEMM's wgrad operand).
        history, margin, update, counter: delayed scaling, as ``cast_2d``'s.
        rolls: delayed with ``update`` only: at most :data:`MAX_ROLLS` pairs (above).

    Rows wider than :data:`FP8_MAX_BLOCK` (4096) take the norm and the cast as two launches
    (the histories rolled after, one launch each): the same results, no saving.

    Returns:
        :class:`NormFloat8`.
    """
    check_norm_args(x, weight, bias, eps, rms)
    if x.shape[1] < 1:
        raise ValueError(
            f"norm_forward_float8 needs rows of N >= 1 elements, got x of shape {tuple(x.shape)}"
        )
    check_cast_args(x, dtype, history, margin, update, counter, rolls)
    check_same_device(x=x, weight=weight, bias=bias, counter=counter)
    return norm_forward_float8_prechecked(
        x, weight, bias, eps, rms, dtype, store_t, history, margin, update, counter, rolls
    )


def check_cast_args(x, dtype, history, margin, update, counter, rolls) -> None:
    """Raise unless :func:`norm_forward_float8` can cast the norm of ``x`` to ``dtype``
    with this scaling state (``history`` and the rest; the names as there)."""
    check_fp8_dtype(dtype)
    check_fp8_device(x.device, "norm_forward_float8", (dtype,))
    if history is not None:
        check_amaxes("history", history, x)
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {margin!r}")
        if counter is not None:
            check_tensor("counter", counter, ndim=1, dtypes=(torch.int32,))
    elif counter is not None:
        raise ValueError("counter is delayed scaling's: give the history")
    if rolls and not (history is not None and update):
        raise ValueError("rolls ride on the launch's own history update: they need a history and update")
    _check_rolls(rolls, x)


def norm_forward_float8_prechecked(
    x, weight, bias, eps, rms, dtype, store_t, history, margin, update, counter, rolls
) -> NormFloat8:
    """:func:`norm_forward_float8` for arguments already checked (:func:`check_norm_args`,
    :func:`check_cast_args`, one device): one launch (delayed) or the norm recording y's
    amax and the cast after it (tensorwise); rows too wide for one block, two launches."""
    x = rows_view(x)
    block = block_size(x.shape[1])
    if block > FP8_MAX_BLOCK or block < x.shape[1]:
        return _norm_then_cast(x, weight, bias, eps, rms, dtype, store_t, history, margin, update, rolls)
    out, partials = _launch_norm_fp8(x, weight, bias, eps, rms, dtype, store_t, history, margin, update,
                                     counter, rolls, block)  # fmt: skip
    if history is None:  # tensorwise: the cast of y with the amax the norm recorded
        cast = cast_2d_prechecked(
            out.y, dtype, True, store_t, None, None, 0, False, False, None, None, partials
        )
        return out._replace(data=cast.data, data_t=cast.data_t, scale=cast.scale)
    if update:  # in-place writes, as torch's own would count them
        for h in (history, *(h for h, _ in rolls)):
            if not h.is_inference():
                torch.autograd.graph.increment_version(h)
    return out


def _launch_norm_fp8(
    x, weight, bias, eps, rms, dtype, store_t, history, margin, update, counter, rolls, block
) -> tuple[NormFloat8, torch.Tensor | None]:
    """One ``_norm_fwd_fp8_kernel`` launch (its docstring): y, the statistics and, delayed,
    the cast (tensorwise: ``data``, ``data_t`` None and ``scale`` unwritten, for the cast
    after); returns them and the per-program partial maxima of |y| (None: not recorded)."""
    (M, N), dev = x.shape, x.device
    delayed = history is not None
    roll = delayed and update
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    mean = None if rms else torch.empty(M, dtype=torch.float32, device=dev)
    rstd = torch.empty(M, dtype=torch.float32, device=dev)
    # tensorwise: the cast after the norm writes them (the kernel only records y's amax)
    data = torch.empty((M, N), dtype=dtype, device=dev) if delayed else None
    data_t = torch.empty((N, M), dtype=dtype, device=dev) if delayed and store_t else None
    scale = torch.empty((), dtype=torch.float32, device=dev)
    programs = max(1, min(cdiv(M, FP8_ROWS), MAX_PROGRAMS))
    partials = torch.empty(programs, dtype=torch.float32, device=dev) if roll or not delayed else None
    if roll and counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
    dummy = rstd
    slots = [(h, partials if a is None else a) for h, a in rolls]
    slots += [(dummy, dummy)] * (MAX_ROLLS - len(slots))
    lengths = [n for h, a in rolls for n in (h.numel(), programs if a is None else a.numel())]
    lengths += [0, 0] * (MAX_ROLLS - len(rolls))
    h_len = history.numel() if delayed else 0
    const8 = fp8_constants(dtype)
    const8["DTYPE8"] = const8.pop("DTYPE")  # DTYPE is x's
    _norm_fwd_fp8_kernel[(programs,)](
        x, y, weight if weight is not None else x, bias if bias is not None else x,
        mean if mean is not None else rstd, rstd, dummy if data is None else data,
        dummy if data_t is None else data_t, scale,
        partials if partials is not None else dummy, history if delayed else dummy,
        counter if roll else dummy, *(t for pair in slots for t in pair),
        M, N, x.stride(0), float(eps), h_len, 2.0**-margin, *lengths,
        IS_RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, DTYPE=tl_dtype(x.dtype),
        BLOCK=block, DELAYED=delayed, STORE_T=store_t, RECORD=partials is not None,
        ROLL=roll, N_ROLLS=len(rolls), **const8,
        ROWS=FP8_ROWS, NORM_ROWS=tile_rows(FP8_ROWS, block), TK=FP8_TK,
        PBLOCK=next_power_of_2(max(programs, h_len if delayed else 1, *lengths[1::2])),
        HBLOCK=next_power_of_2(max(h_len if delayed else 1, *lengths[0::2], 1)),
        num_warps=num_warps(block),
    )  # fmt: skip
    return NormFloat8(y, mean, rstd, data, data_t, scale), partials


def _norm_then_cast(x, weight, bias, eps, rms, dtype, store_t, history, margin, update, rolls) -> NormFloat8:
    """:func:`norm_forward_float8` for rows wider than :data:`FP8_MAX_BLOCK`: the norm, then
    ``cast_2d`` of y, the histories rolled after it (one launch each). The same results,
    without the saving: the wide row code beside the cast spilled registers (chunked rows
    on sm_89 and sm_90; 8192-wide RMSNorm on sm_89)."""
    norm = norm_forward_prechecked(x, weight, bias, eps, rms)
    roll = history is not None and update
    cast = cast_2d_prechecked(norm.y, dtype, True, store_t, None, history, margin, update, roll, None, None)
    if roll:
        for h, amax in ((history, None), *rolls):
            roll_amax_history(h, cast.amax if amax is None else amax)
    return NormFloat8(norm.y, norm.mean, norm.rstd, cast.data, cast.data_t, cast.scale)


def backward_programs(m: int, device: torch.device) -> int:
    """How many programs the backward launches for ``m`` rows (each one writes
    a row of dweight / dbias partial sums)."""
    if INTERPRET:
        target = _INTERPRET_PROGRAMS
    else:
        target = PROGRAMS_PER_SM * tkdev.device_spec(device).sms
    return max(min(m, target), 1)


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    rms: bool,
    *,
    need_weight: bool = True,
    bias_dtype: torch.dtype | None = None,
    dh: torch.Tensor | None = None,
    dweight_out: torch.Tensor | None = None,
    dbias_out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> NormBackward:
    """Gradients of :func:`norm_forward` from its saved input and statistics.

    Args:
        dy: (M, N) upstream gradient of y, x's dtype, any row stride.
        x: (M, N) the row normalized in forward (x, or h for the residual form).
        weight: optional (N,), fp32 or x's dtype.
        mean: (M,) fp32 (LayerNorm) or None (RMSNorm); rstd: (M,) fp32.
        rms: RMSNorm when True.
        need_weight: whether to return dweight (needs a weight).
        bias_dtype: the bias's dtype when dbias is wanted, else None.
        dh: optional (M, N) upstream gradient of h (the residual form), added to dx.
        dweight_out, dbias_out: optional (N,) contiguous tensors of the weight's dtype /
            ``bias_dtype`` that receive dweight / dbias (then returned) instead of new ones.
        accumulate: add dweight / dbias into the given outputs (in fp32, rounded once:
            gradient accumulation), instead of overwriting them.

    Returns:
        :class:`NormBackward` ``(dx, dweight, dbias)``: dx (M, N) in x's dtype,
        rounded once from fp32; dweight in weight's dtype and dbias in
        ``bias_dtype``, each summed over rows in fp32 (a fixed order: the same bits on
        every run) and cast once, or None where not asked for.
    """
    check_tensor("x", x, ndim=2, dtypes=INPUT_DTYPES)
    M, N = x.shape
    check_tensor("dy", dy, ndim=2, dtypes=(x.dtype,), shape=x.shape)
    if dh is not None:
        check_tensor("dh", dh, ndim=2, dtypes=(x.dtype,), shape=x.shape)
    _check_param("weight", weight, N, x)
    if need_weight and weight is None:
        raise ValueError("need_weight=True needs the weight")
    for name, stat, wanted in (("mean", mean, not rms), ("rstd", rstd, True)):
        if not wanted:
            continue
        check_tensor(name, stat, ndim=1, dtypes=(torch.float32,))
        if stat.shape[0] != M or not stat.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({M},) fp32 tensor, got shape {tuple(stat.shape)}")
    if bias_dtype is not None and bias_dtype not in (torch.float32, x.dtype):
        raise TypeError(f"bias_dtype must be float32 or x's dtype {x.dtype}, got {bias_dtype}")
    _check_out("dweight_out", dweight_out, need_weight, weight.dtype if need_weight else None, N)
    _check_out("dbias_out", dbias_out, bias_dtype is not None, bias_dtype, N)
    check_same_device(
        x=x, dy=dy, dh=dh, weight=weight, mean=mean, rstd=rstd, dweight_out=dweight_out, dbias_out=dbias_out
    )
    into = [None if out is None else (out, bool(accumulate)) for out in (dweight_out, dbias_out)]
    return norm_backward_prechecked(dy, x, weight, mean, rstd, rms, need_weight, bias_dtype, dh, *into)


def _check_out(name: str, out: torch.Tensor | None, wanted: bool, dtype, n: int) -> None:
    """Raise unless ``out`` is None or a contiguous (n,) tensor of ``dtype`` for a gradient
    that is ``wanted``."""
    if out is None:
        return
    if not wanted:
        raise ValueError(f"{name} is given but its gradient is not asked for")
    check_tensor(name, out, ndim=1, dtypes=(dtype,), shape=(n,))
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def norm_backward_prechecked(
    dy, x, weight, mean, rstd, rms, need_weight, bias_dtype, dh, dw_into=None, db_into=None
) -> NormBackward:
    """:func:`norm_backward` for a backward that trusts its tensors (``tkern.layer_norm``'s:
    what its forward checked and saved, and the gradients autograd gives of its outputs):
    two launches, nothing checked again. ``dw_into`` / ``db_into``: ``(out, accumulate)``
    where dweight / dbias go, (N,) contiguous of the weight's dtype / ``bias_dtype``, written
    or (``accumulate``) added into (a fused optimizer's flat gradient view); None: new tensors."""
    dx, dw_part, db_part = _backward_partials(dy, x, weight, mean, rstd, rms, need_weight, bias_dtype, dh)
    N = x.shape[1]
    dw_into = dw_into or (None if dw_part is None else (x.new_empty(N, dtype=weight.dtype), False))
    db_into = db_into or (None if db_part is None else (x.new_empty(N, dtype=bias_dtype), False))
    if dw_part is not None or db_part is not None:
        param_grads_prechecked(dw_part, db_part, dw_into, db_into)
    return NormBackward(dx, None if dw_into is None else dw_into[0], None if db_into is None else db_into[0])


def _backward_partials(dy, x, weight, mean, rstd, rms, need_weight, bias_dtype, dh) -> tuple:
    """``_norm_bwd_kernel``'s launch: dx and the (P, N) fp32 partial sums of dweight and
    dbias (None where not asked for)."""
    M, N = x.shape
    dy, x = rows_view(dy), rows_view(x)
    dh = None if dh is None else rows_view(dh)
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rows = cdiv(M, backward_programs(M, x.device))  # per program
    programs = cdiv(M, rows) if M else 1
    block = block_size(N)
    # one-block rows store their partial sums once; chunked rows add into them
    alloc = torch.empty if block >= N and M else torch.zeros
    dw_part = alloc((programs, N), dtype=torch.float32, device=x.device) if need_weight else None
    db_part = alloc((programs, N), dtype=torch.float32, device=x.device) if bias_dtype is not None else None
    if M and N:
        _norm_bwd_kernel[(programs,)](
            dy, dh if dh is not None else dy, x, weight if weight is not None else x,
            mean if mean is not None else rstd, rstd, dx,
            dw_part if dw_part is not None else rstd, db_part if db_part is not None else rstd,
            M, N, dy.stride(0), dh.stride(0) if dh is not None else 0, x.stride(0), rows,
            IS_RMS=rms, HAS_WEIGHT=weight is not None, HAS_DH=dh is not None,
            HAS_DW=need_weight, HAS_DB=bias_dtype is not None, DTYPE=tl_dtype(x.dtype), BLOCK=block,
            CHUNKED=block < N, ROWS=tile_rows(rows, block) if block >= N else 1, num_warps=num_warps(block),
        )  # fmt: skip
    return dx, dw_part, db_part


def reduce_layout(p: int, n: int, device: torch.device) -> tuple[int, int]:
    """``(ROWS, COLS)`` of ``_norm_param_grads_kernel`` over (p, n) partials on ``device``:
    COLS from the device's SMs (:data:`REDUCE_MIN_COLS` to :data:`REDUCE_MAX_COLS`), ROWS
    filling a :data:`REDUCE_TILE` tile, at most the next power of two of p."""
    if INTERPRET:
        cols = min(next_power_of_2(max(n, 1)), _INTERPRET_REDUCE_COLS)
    else:
        per_sm = next_power_of_2(cdiv(max(n, 1), tkdev.device_spec(device).sms))
        cols = min(max(per_sm, REDUCE_MIN_COLS), REDUCE_MAX_COLS)
    return min(next_power_of_2(max(p, 1)), max(REDUCE_TILE // cols, 1)), cols


def param_grads_prechecked(dw_part, db_part, dw_into, db_into) -> None:
    """dweight and dbias from the backward's (P, N) fp32 partial sums (``dw_part`` /
    ``db_part``, None: not wanted) in one launch: each summed over P in fp32 in a fixed
    order and stored rounded once into ``dw_into`` / ``db_into``'s ``out`` ((N,),
    contiguous), or with ``accumulate`` added to what it holds (fp32, one rounding)."""
    part = dw_part if dw_part is not None else db_part
    P, N = part.shape
    if not N:
        return
    rows, cols = reduce_layout(P, N, part.device)
    dw, acc_w = dw_into if dw_part is not None else (part, False)
    db, acc_b = db_into if db_part is not None else (part, False)
    _norm_param_grads_kernel[(cdiv(N, cols),)](
        part if dw_part is None else dw_part, part if db_part is None else db_part, dw, db, P, N,
        HAS_DW=dw_part is not None, HAS_DB=db_part is not None, ACC_DW=acc_w, ACC_DB=acc_b,
        DW_DTYPE=tl_dtype(dw.dtype), DB_DTYPE=tl_dtype(db.dtype), ROWS=rows, COLS=cols,
        num_warps=REDUCE_WARPS,
    )  # fmt: skip
