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
  per program into a ``(num_programs, N)`` buffer, then reduced once on the host
  (``sum(0)``) and cast to the parameter's dtype.

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

from tkern.kernels._common import (
    INTERPRET,
    cast_rne,
    check_same_device,
    check_tensor,
    tl_dtype,
)

__all__ = ["MAX_BLOCK", "NormBackward", "NormForward", "norm_backward", "norm_forward"]

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


def block_size(n: int) -> int:
    """The kernels' BLOCK for rows of ``n`` elements: the next power of two, or
    :data:`MAX_BLOCK` (chunked rows) above it."""
    return min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK)


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
def _centered(x, mask, n):
    """(mean, x - mean) of the n unmasked values of fp32 ``x``, 0 where masked,
    by the corrected two-pass algorithm: the first mean's rounding error (up to
    ~n * 2^-24 * |mean|, 1e-4 of a unit deviation at an offset of 2000) is
    removed by adding the mean of the deviations from it, computed nearly exactly
    since x and the mean are close (Chan, Golub & LeVeque 1983)."""
    mean = tl.sum(x, axis=0) / n
    mean += tl.sum(tl.where(mask, x - mean, 0.0), axis=0) / n
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
):
    """One row per program: statistics in fp32, then the normalized row, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_x
    res_ptr += row * stride_res
    h_ptr += row * N
    y_ptr += row * N
    offs = tl.arange(0, BLOCK)
    if not CHUNKED:  # the whole row in registers: one read
        mask = offs < N
        x = _load_input(x_ptr, res_ptr, h_ptr, offs, mask, HAS_RESIDUAL, DTYPE)
        if IS_RMS:
            mean = 0.0
            var = tl.sum(x * x, axis=0) / N
        else:
            mean, xc = _centered(x, mask, N)
            var = tl.sum(xc * xc, axis=0) / N
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        _normalize_store(x, y_ptr, w_ptr, b_ptr, offs, mask, mean, rstd, HAS_WEIGHT, HAS_BIAS, DTYPE)
    else:  # chunks: Chan's combination of each chunk's (count, mean, M2), then a second pass
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
                chunk_mean, xc = _centered(x, mask, n_chunk)
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
    if not CHUNKED:
        mask = offs < N
        dw_acc = tl.zeros((BLOCK,), tl.float32)
        db_acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, row_end - row_start):
            r = first_row + i  # int64: r * stride may pass 2^31
            x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
            mean = 0.0 if IS_RMS else tl.load(mean_ptr + r)
            rstd = tl.load(rstd_ptr + r)
            xhat, wdy = _grad_terms(x, dy, w_ptr, offs, mask, mean, rstd, HAS_WEIGHT)
            c1 = tl.sum(xhat * wdy, axis=0) / N
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                dx = (wdy - (xhat * c1 + tl.sum(wdy, axis=0) / N)) * rstd
            if HAS_DH:
                dx += tl.load(dh_ptr + r * stride_dh + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + r * N + offs, cast_rne(dx, DTYPE), mask=mask)
            if HAS_DW:
                dw_acc += dy * xhat
            if HAS_DB:
                db_acc += dy
        if HAS_DW:
            tl.store(dw_ptr + offs, dw_acc, mask=mask)
        if HAS_DB:
            tl.store(db_ptr + offs, db_acc, mask=mask)
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


def _check_rows(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    check_tensor(name, t, ndim=2, dtypes=(x.dtype,))
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got shape {tuple(t.shape)}")


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
    check_tensor("x", x, ndim=2, dtypes=INPUT_DTYPES)
    M, N = x.shape
    _check_param("weight", weight, N, x)
    if bias is not None and rms:
        raise ValueError("RMSNorm takes no bias")
    _check_param("bias", bias, N, x)
    if residual is not None:
        _check_rows("residual", residual, x)
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    x = rows_view(x)
    residual = None if residual is None else rows_view(residual)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty_like(y)
    mean = None if rms else torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and N:
        block = block_size(N)
        _norm_fwd_kernel[(M,)](
            x, residual if residual is not None else x, h if h is not None else y, y,
            weight if weight is not None else x, bias if bias is not None else x,
            mean if mean is not None else rstd, rstd,
            N, x.stride(0), residual.stride(0) if residual is not None else 0, float(eps),
            IS_RMS=rms, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, DTYPE=tl_dtype(x.dtype), BLOCK=block, CHUNKED=block < N,
            num_warps=num_warps(block),
        )  # fmt: skip
    elif M:  # N == 0: nothing to normalize (torch gives an empty output too)
        rstd.zero_()
        if mean is not None:
            mean.zero_()
    return NormForward(y, h, mean, rstd)


def backward_programs(m: int, device: torch.device) -> int:
    """How many programs the backward launches for ``m`` rows (each one writes
    a row of dweight / dbias partial sums)."""
    if INTERPRET:
        target = _INTERPRET_PROGRAMS
    else:
        target = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
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

    Returns:
        :class:`NormBackward` ``(dx, dweight, dbias)``: dx (M, N) in x's dtype,
        rounded once from fp32; dweight in weight's dtype and dbias in
        ``bias_dtype``, each summed over rows in fp32 and cast once, or None
        where not asked for.
    """
    check_tensor("x", x, ndim=2, dtypes=INPUT_DTYPES)
    M, N = x.shape
    _check_rows("dy", dy, x)
    if dh is not None:
        _check_rows("dh", dh, x)
    _check_param("weight", weight, N, x)
    if need_weight and weight is None:
        raise ValueError("need_weight=True needs the weight")
    for name, stat, wanted in (("mean", mean, not rms), ("rstd", rstd, True)):
        if not wanted:
            continue
        check_tensor(name, stat, ndim=1, dtypes=(torch.float32,))
        if stat.shape[0] != M or not stat.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({M},) fp32 tensor, got shape {tuple(stat.shape)}")
    check_same_device(x=x, dy=dy, dh=dh, weight=weight, mean=mean, rstd=rstd)
    dy, x = rows_view(dy), rows_view(x)
    dh = None if dh is None else rows_view(dh)
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rows = triton.cdiv(M, backward_programs(M, x.device))  # per program
    programs = triton.cdiv(M, rows) if M else 1
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
            CHUNKED=block < N, num_warps=num_warps(block),
        )  # fmt: skip
    dweight = None if dw_part is None else dw_part.sum(0).to(weight.dtype)
    dbias = None if db_part is None else db_part.sum(0).to(bias_dtype)
    return NormBackward(dx, dweight, dbias)
