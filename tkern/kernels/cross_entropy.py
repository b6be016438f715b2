"""Cross-entropy over a vocabulary of any size, in fp32 from 16-bit logits.

Each program takes one row (a few under the interpreter) and walks the row's
vocabulary in chunks of ``BLOCK_V``:

* pass 1 (an online max and sum, in fp32) gives ``lse = logsumexp(x)`` and the
  row's loss terms: ``(1 - eps) * w[t] * (lse - x[t]) + eps / V * sum_c w[c] (lse - x[c])``,
  torch's label-smoothed, class-weighted negative log-likelihood (``w = 1``
  without class weights), before any reduction;
* pass 2 (optional, the same launch) writes the gradient of
  ``a_i * loss_i + (b_i + q_i * lse_i) * lse_i`` -- ``a``, ``b``, ``q`` per-row
  (or broadcast) fp32 coefficients that the caller derives from the reduction
  and the upstream gradient -- into a separate buffer, in the logits' dtype:
  ``p = exp(x - lse)`` stays fp32 and ``p - 1`` is taken from it (rounding ``p``
  to bf16 first is 20-100% wrong at p = 0.99..0.999, Liger PR 1329), and the
  logits are never overwritten (other ops may have saved them, Liger issue 272).

With ``LSE_FROM_STATS`` pass 1 reads no logit but the row's softmax statistics that the
GEMM which made the logits wrote beside them (gemm_epilogue's ``ROW_STATS``: per 32
columns the max ``m_j`` and ``s_j = sum exp(x - m_j)``), combined as the online pass
combines its chunks, ``lse = m + log(sum_j s_j exp(m_j - m))``: one pass over the logits
instead of two (the fused linear cross-entropy's, without label smoothing or softcap, whose
terms the statistics do not hold).

``softcap`` applies ``c * tanh(x / c)`` to the logits as they are loaded (Gemma 2);
the gradient is multiplied by ``1 - tanh(x / c)^2``; both from :func:`_tanh_parts`,
to a few ulp relative for every ``x / c`` (torch's own fp32 accuracy). A row whose target is
``ignore_index`` costs no logit reads: its loss and lse are 0 and its gradient
row is zeros. A target outside ``[0, V)`` gives a NaN loss (never an
out-of-bounds read); :func:`check_targets` reports it first.

Target check (:func:`target_stats`, :func:`check_targets`): one launch of
``_target_stats_kernel`` over the targets, which also gives the reduction's scalars (the
non-ignored count, the mean's denominator, the gradient's coefficients), and never a
device-to-host sync on a GPU: on the CPU (``HOST_CHECK_DEVICES``) a ``ValueError`` naming the
first bad target, raised before the loss's launches; on a GPU a device-side assert
(``torch._assert_async``) queued before them, which fails the stream (a
device-side assert error at the next sync) instead of letting a wrong target
train silently. The kernel's NaN is the backstop where the check is skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    INTERPRET,
    cast_rne,
    check_int32_addressable,
    check_same_device,
    check_tensor,
    tl_dtype,
)
from tkern.kernels.gemm_epilogue import row_stats_slots

#: dtypes the logits may have.
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: dtypes the targets may have.
TARGET_DTYPES = (torch.int64, torch.int32)
#: Largest vocabulary chunk one loop iteration reads. Compiled: 1024 elements, 4 per
#: thread at 8 warps. With class weights, label smoothing and softcap all on, the forward
#: spilled 8 B at 2048 and 4096 elements on 8 warps under triton 3.6 or 3.9 (the compile
#: gate runs both); 1024 compiles without spills under both. Under the interpreter, where
#: every loop iteration costs milliseconds, large chunks.
MAX_BLOCK_V = 32768 if INTERPRET else 1024
#: |y| below which tanh(y) is Cephes' tanhf odd polynomial (``_TANH_C1..C5``; relative
#: error < 2^-22 there); above it ``1 - 2 / (exp(2|y|) + 1)``, whose subtraction loses
#: at most a bit once exp(2|y|) >= e^1.25. Max relative error over |y| in [1e-4, 30],
#: measured in numpy fp32 against float64: tanh 1.7e-7 (< 3 ulp), sech^2 2.5e-7.
_TANH_POLY: tl.constexpr = tl.constexpr(0.625)
_TANH_C1: tl.constexpr = tl.constexpr(-3.33332819422e-1)
_TANH_C2: tl.constexpr = tl.constexpr(1.33314422036e-1)
_TANH_C3: tl.constexpr = tl.constexpr(-5.37397155531e-2)
_TANH_C4: tl.constexpr = tl.constexpr(2.06390887954e-2)
_TANH_C5: tl.constexpr = tl.constexpr(-5.70498872745e-3)


#: Elements of one interpreted tile (rows x chunk), see :func:`rows_per_program`.
INTERPRET_TILE = 65536


def block_v(n_cols: int) -> int:
    """The vocabulary chunk for rows of ``n_cols`` classes: a power of two, at least 16."""
    return max(16, min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK_V))


def rows_per_program(block: int) -> int:
    """Rows per program: one on a GPU (a row's chunk fills the program); under the
    interpreter, whose cost is per operation and program, as many as keep a tile
    near 64K elements (16 rows of a 123-class vocabulary: ~10x fewer programs)."""
    return max(1, min(16, INTERPRET_TILE // block)) if INTERPRET else 1


#: Software-pipelining stages of the vocabulary loops: 1 (none). The loops stream each
#: logit once and are bound by memory bandwidth, not load latency across iterations.
NUM_STAGES = 1


def num_warps(block: int) -> int:
    """Warps per program: 8 for full chunks of 1024 (4 elements per thread), else 4."""
    return 8 if block >= 1024 else 4


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _tanh_parts(y):
    """``(tanh(y), 1 - tanh(y)^2)`` of fp32 ``y``, both to a few ulp relative for every
    ``y`` (see ``_TANH_POLY``): a polynomial for small |y|; above it ``u = 2 / (exp(2|y|) + 1)``
    is ``1 - |tanh(y)|`` exactly as computed, so ``1 - tanh^2 = u (2 - u)`` keeps its
    relative precision where ``1 - t * t`` would round to 0 (exp overflows to inf: u = 0)."""
    ay = tl.abs(y)
    u = 2.0 / (tl.exp(2.0 * ay) + 1.0)
    y2 = y * y
    poly = ((((_TANH_C5 * y2 + _TANH_C4) * y2 + _TANH_C3) * y2 + _TANH_C2) * y2 + _TANH_C1) * y2 * y + y
    small = ay < _TANH_POLY
    t = tl.where(small, poly, tl.where(y < 0.0, u - 1.0, 1.0 - u))
    dt = tl.where(small, 1.0 - poly * poly, u * (2.0 - u))
    return t, dt


@triton.jit
def _capped(x, softcap, SOFTCAP: tl.constexpr):
    """``softcap * tanh(x / softcap)`` when SOFTCAP, else ``x`` (fp32)."""
    if SOFTCAP:
        t, _ = _tanh_parts(x / softcap)
        x = softcap * t
    return x


@triton.jit
def _load_logits(row_ptr, cols, stride_c, mask, softcap, SOFTCAP: tl.constexpr):
    """A chunk of one row's logits in fp32 (masked lanes -inf), softcapped if asked."""
    x = tl.load(row_ptr + cols * stride_c, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, _capped(x, softcap, SOFTCAP), float("-inf"))


@triton.jit
def _load_logits_and_slope(row_ptr, cols, stride_c, mask, softcap, SOFTCAP: tl.constexpr):
    """:func:`_load_logits`'s chunk and the softcap's derivative ``1 - tanh(x / c)^2``
    there (1 without SOFTCAP; 0 on masked lanes)."""
    x = tl.load(row_ptr + cols * stride_c, mask=mask, other=0.0).to(tl.float32)
    if SOFTCAP:
        t, slope = _tanh_parts(x / softcap)
        x = softcap * t
        slope = tl.where(mask, slope, 0.0)
    else:
        slope = 1.0
    return tl.where(mask, x, float("-inf")), slope


@triton.jit
def _combine_stats(stats_ptr, rows, live, n_slots, BLOCK_S: tl.constexpr):
    """``(m, s)`` of the live ``rows`` from their (m_j, s_j) slots: ``m = max m_j`` and
    ``s = sum_j s_j exp(m_j - m)``, online over BLOCK_S slots at a time (a neutral slot,
    ``(-inf, 0)``, adds nothing; ignored rows read no slot and give ``(-inf, 0)``)."""
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    s = tl.zeros(rows.shape, tl.float32)
    row_ptr = stats_ptr + rows * (n_slots * 2)
    n_work = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, n_slots, 0)
    for start in range(0, n_work, BLOCK_S):
        slots = start + tl.arange(0, BLOCK_S)
        mask = live[:, None] & (slots < n_slots)[None, :]
        ptrs = row_ptr[:, None] + slots[None, :] * 2
        pm = tl.load(ptrs, mask=mask, other=float("-inf"))
        ps = tl.load(ptrs + 1, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # ignored rows: no inf - inf
        s = s * tl.exp(m - m_safe) + tl.sum(ps * tl.exp(pm - m_safe[:, None]), axis=1)
        m = m_new
    return m, s


# --------------------------------------------------------------------------- kernel


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,  # (N, V) fp16/bf16/fp32, strides (stride_lr, stride_lc): read in place
    target_ptr,  # (N,) int32/int64, contiguous
    weight_ptr,  # (V,) fp32 class weights, contiguous (read when HAS_WEIGHT)
    wsum_ptr,  # (1,) fp32: sum of the class weights (read when HAS_WEIGHT and SMOOTHING)
    loss_ptr,  # (N,) fp32 out: the row's loss terms (written when WRITE_LOSS)
    lse_ptr,  # (N,) fp32: logsumexp of the (softcapped) row; written when COMPUTE_LSE, else read
    stats_ptr,  # (N, n_slots, 2) fp32, contiguous: the row's (m_j, s_j) slots (read when LSE_FROM_STATS)
    grad_ptr,  # (N, V) out, GRAD_DTYPE, strides (stride_gr, stride_gc) (written when WRITE_GRAD)
    a_ptr,  # (N,) or (1,) fp32: d(objective)/d(loss_i)          (WRITE_GRAD)
    b_ptr,  # (N,) or (1,) fp32: d(objective)/d(lse_i), constant  (WRITE_GRAD and HAS_B)
    q_ptr,  # (N,) or (1,) fp32: d(objective)/d(lse_i) per unit lse (WRITE_GRAD and HAS_Q)
    coef_stride,  # 1: a, b, q per row; 0: one value broadcast to every row
    n_rows,  # N
    n_cols,  # V
    n_slots,  # slots of stats_ptr per row (LSE_FROM_STATS)
    stride_lr,
    stride_lc,
    stride_gr,
    stride_gc,
    ignore_index,
    smoothing,  # label smoothing eps in [0, 1]
    softcap,  # c > 0 (read when SOFTCAP)
    HAS_WEIGHT: tl.constexpr,
    SMOOTHING: tl.constexpr,  # eps > 0: the smoothing sum is accumulated (else skipped)
    SOFTCAP: tl.constexpr,
    COMPUTE_LSE: tl.constexpr,  # pass 1 runs (else lse is read from lse_ptr)
    LSE_FROM_STATS: tl.constexpr,  # with COMPUTE_LSE: pass 1 reads stats_ptr, not the logits
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,  # pass 2 runs
    HAS_B: tl.constexpr,
    HAS_Q: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program: 1 compiled (rows_per_program), more under the interpreter
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,  # slots one LSE_FROM_STATS iteration reads per row
):
    """Rows ``[program_id(0) * ROWS, ...)``: their lse and loss terms, and optionally the
    gradient of ``a * loss + (b + q * lse) * lse`` with respect to their logits (see the
    module docstring); flags are constexpr so that the unused passes compile away."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols0 = tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    t = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    live = t != ignore_index  # rows past the end count as ignored
    in_range = (t >= 0) & (t < n_cols)
    t_safe = tl.where(in_range, t, 0)
    row_ptr = logits_ptr + rows * stride_lr  # (ROWS,)
    vocab = n_cols.to(tl.float32)
    # a tile whose rows are all ignored reads no logits: its loops run zero iterations
    n_work = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, n_cols, 0)

    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t_safe, mask=row_ok, other=0.0)
        if SMOOTHING:
            w_all = tl.load(wsum_ptr)
        else:
            w_all = vocab
    else:
        w_t = 1.0
        w_all = vocab

    if COMPUTE_LSE:
        m = tl.full([ROWS], float("-inf"), tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        wx = tl.zeros([ROWS], tl.float32)  # sum_c w[c] x[c], for label smoothing
        if LSE_FROM_STATS:
            m, s = _combine_stats(stats_ptr, rows, live, n_slots, BLOCK_S)
        else:
            for start in range(0, n_work, BLOCK_V):
                cols = start + cols0
                mask = live[:, None] & (cols < n_cols)[None, :]
                x = _load_logits(row_ptr[:, None], cols[None, :], stride_lc, mask, softcap, SOFTCAP)
                m_new = tl.maximum(m, tl.max(x, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # ignored rows: no inf - inf
                s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
                m = m_new
                if SMOOTHING:
                    xs = tl.where(mask, x, 0.0)
                    if HAS_WEIGHT:
                        xs = xs * tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
                    wx += tl.sum(xs, axis=1)
        lse = tl.where(live, m + tl.log(tl.where(live, s, 1.0)), 0.0)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        if WRITE_LOSS:
            x_t = tl.load(row_ptr + t_safe * stride_lc, mask=in_range & live, other=0.0).to(tl.float32)
            x_t = _capped(x_t, softcap, SOFTCAP)
            loss = (1.0 - smoothing) * w_t * (lse - x_t)
            if SMOOTHING:
                loss += smoothing / vocab * (w_all * lse - wx)
            loss = tl.where(in_range, loss, float("nan"))
            tl.store(loss_ptr + rows, tl.where(live, loss, 0.0), mask=row_ok)
    else:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)

    if WRITE_GRAD:
        # d/dx_c [a loss + (b + q lse) lse] = p_c * A - [c == t] * B - a eps / V * w_c, with
        # A = a ((1 - eps) w_t + eps W / V) + b + 2 q lse and B = a (1 - eps) w_t: p - 1
        # at the target from the fp32 p, one rounding to the gradient's dtype at the store.
        # ignored rows' coefficients may be inf (a mean over no rows): never multiplied
        a = tl.where(live, tl.load(a_ptr + rows * coef_stride, mask=row_ok, other=0.0), 0.0)
        big_b = a * (1.0 - smoothing) * w_t
        big_a = big_b + a * smoothing * w_all / vocab
        if HAS_B:
            big_a += tl.where(live, tl.load(b_ptr + rows * coef_stride, mask=row_ok, other=0.0), 0.0)
        if HAS_Q:
            big_a += (
                2.0 * tl.where(live, tl.load(q_ptr + rows * coef_stride, mask=row_ok, other=0.0), 0.0) * lse
            )
        smooth_c = a * smoothing / vocab  # times w_c: the smoothing term of every class
        grad_rows = grad_ptr + rows * stride_gr
        for start in range(0, n_cols, BLOCK_V):
            cols = start + cols0
            col_ok = cols < n_cols
            mask = live[:, None] & col_ok[None, :]
            x, slope = _load_logits_and_slope(
                row_ptr[:, None], cols[None, :], stride_lc, mask, softcap, SOFTCAP
            )
            p = tl.exp(x - lse[:, None])
            d = p * big_a[:, None] - tl.where(cols[None, :] == t[:, None], big_b[:, None], 0.0)
            if SMOOTHING:
                if HAS_WEIGHT:
                    d -= smooth_c[:, None] * tl.load(weight_ptr + cols, mask=col_ok, other=0.0)[None, :]
                else:
                    d -= smooth_c[:, None]
            if SOFTCAP:
                d *= slope
            d = tl.where(live[:, None], d, 0.0)
            tl.store(
                grad_rows[:, None] + cols[None, :] * stride_gc,
                cast_rne(d, GRAD_DTYPE),
                mask=row_ok[:, None] & col_ok[None, :],
            )


# --------------------------------------------------------------------------- launchers


# --------------------------------------------------------------------------- the targets' check and scalars


#: Targets one loop iteration of :func:`_target_stats_kernel` reads per lane block.
STATS_BLOCK = 1024
#: Warps of its one program (8 targets per thread per iteration).
STATS_WARPS = 4
#: Slots of the (5,) fp32 tensor :func:`target_stats` returns: 1 when every target is in
#: range (0 otherwise), the non-ignored count, the mean's denominator, and the gradient
#: coefficients ``a`` (of the loss terms) and ``q`` (of lse^2, a z-loss).
STAT_OK, STAT_COUNT, STAT_DENOM, STAT_A, STAT_Q = range(5)
N_STATS = 5


@triton.jit
def _reciprocal(x):
    """``1 / x`` of an fp32 scalar, +inf at 0 as IEEE division gives, without dividing by
    zero (the interpreter's numpy would warn)."""
    return tl.where(x == 0.0, float("inf"), 1.0 / tl.where(x == 0.0, 1.0, x))


@triton.jit
def _target_stats_kernel(
    target_ptr,  # (N,) int32/int64, contiguous
    weight_ptr,  # (V,) fp32 class weights, contiguous (read when HAS_WEIGHT)
    stats_ptr,  # (5,) fp32 out: ok flag, count, denominator, a, q (the STAT_* slots)
    n_rows,  # N
    n_cols,  # V
    ignore_index,
    z_loss,  # fp32: the z-loss's weight (0: q is 0)
    HAS_WEIGHT: tl.constexpr,
    MEAN: tl.constexpr,  # a = 1 / denominator, q = z_loss / count; else a = 1, q = z_loss
    BLOCK: tl.constexpr,
):
    """One program over all the targets, in a fixed order (each lane sums its targets in
    turn, then one tree over the lanes: the same result on every run): whether every
    target is in ``[0, V)`` or ``ignore_index``, the non-ignored count (exact, int32), the
    mean's denominator (the count, or the summed class weights of the non-ignored targets,
    torch's weighted mean) and the coefficients of the loss's gradient. A mean over no rows
    gives a = 1 / 0 = inf (and a nan loss, as torch)."""
    offs0 = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], tl.int32)
    count = tl.zeros([BLOCK], tl.int32)
    wsum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        offs = start + offs0
        t = tl.load(target_ptr + offs, mask=offs < n_rows, other=ignore_index).to(tl.int64)
        live = t != ignore_index
        in_range = (t >= 0) & (t < n_cols)
        bad += (live & ~in_range).to(tl.int32)
        count += live.to(tl.int32)
        if HAS_WEIGHT:
            take = live & in_range
            wsum += tl.load(weight_ptr + tl.where(take, t, 0), mask=take, other=0.0)
    n_live = tl.sum(count, axis=0).to(tl.float32)
    if HAS_WEIGHT:
        denom = tl.sum(wsum, axis=0)
    else:
        denom = n_live
    if MEAN:  # as torch's 1.0 / denom and z_loss / count: a reciprocal, then a product
        a = _reciprocal(denom)
        rc = _reciprocal(n_live)
        q = tl.where(n_live == 0.0, tl.where(z_loss == 0.0, float("nan"), float("inf")), rc * z_loss)
    else:
        a = 1.0
        q = z_loss
    tl.store(stats_ptr + 0, tl.where(tl.sum(bad, axis=0) == 0, 1.0, 0.0))
    tl.store(stats_ptr + 1, n_live)
    tl.store(stats_ptr + 2, denom)
    tl.store(stats_ptr + 3, a)
    tl.store(stats_ptr + 4, q)


#: Devices whose targets :func:`check_targets` reads on the host (no device to wait
#: for there); on any other device the check is a device-side assert (no sync).
HOST_CHECK_DEVICES = ("cpu",)


def _range_message(n_classes: int, ignore_index: int) -> str:
    return f"targets must be in [0, {n_classes}) or equal ignore_index ({ignore_index})"


def target_stats(
    target: torch.Tensor,
    n_classes: int,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    *,
    mean: bool = True,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The target check and the reduction's scalars in one launch, never a device-to-host
    sync on a GPU: a new (5,) fp32 tensor (slots ``STAT_*``: the ok flag, the non-ignored
    count, the mean's denominator, ``a`` = 1 / denominator for ``mean`` else 1, ``q`` =
    z_loss / count for ``mean`` else z_loss). Every target must be in ``[0, n_classes)``
    or ``ignore_index``: on a device of ``HOST_CHECK_DEVICES`` (the host's memory) a
    ``ValueError`` naming the first bad target, read there with numpy (no launch, nothing
    to wait for), elsewhere ``torch._assert_async`` on the flag
    (queued on the device: a failure surfaces as a device-side assert at the next sync,
    with this message where the backend keeps it).

    Args:
        target: (N,) int64/int32 class indices (any strides: a copy where not contiguous).
        n_classes: V, the classes (> 0).
        ignore_index: the target of rows that count for nothing.
        weight: optional (V,) fp32 class weights on the target's device (the denominator
            is then the non-ignored targets' summed weights).
        mean: the coefficients of a mean (else of a sum).
        z_loss: finite, >= 0.
    """
    check_tensor("target", target, ndim=1, dtypes=TARGET_DTYPES)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 1:
        raise ValueError(f"n_classes must be a positive int, got {n_classes!r}")
    if target.numel() >= 2**31:
        raise ValueError(f"target must have fewer than 2^31 elements, got {target.numel()}")
    if weight is not None:
        check_tensor("weight", weight, ndim=1, dtypes=(torch.float32,))
        if weight.shape[0] != n_classes or not weight.is_contiguous():
            raise ValueError(
                f"weight must be a contiguous ({n_classes},) fp32 tensor, got shape {tuple(weight.shape)}"
            )
        check_same_device(target=target, weight=weight)
    if not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    target = target.contiguous()
    stats = torch.empty(N_STATS, dtype=torch.float32, device=target.device)
    _target_stats_kernel[(1,)](
        target, stats if weight is None else weight, stats, target.shape[0], n_classes, ignore_index,
        float(z_loss), HAS_WEIGHT=weight is not None, MEAN=bool(mean), BLOCK=STATS_BLOCK,
        num_warps=STATS_WARPS,
    )  # fmt: skip
    if target.device.type not in HOST_CHECK_DEVICES:
        message = f"tkern cross-entropy: a target is out of range: {_range_message(n_classes, ignore_index)}"
        torch._assert_async(stats[STAT_OK], message)
    else:  # on the host, the targets read where they are (no launch; the flag is the device's)
        t = target.detach().numpy()
        bad = ((t < 0) | (t >= n_classes)) & (t != ignore_index)
        if bad.any():
            idx = int(bad.argmax())
            raise ValueError(
                f"target[{idx}] = {int(t[idx])} is out of range: {_range_message(n_classes, ignore_index)}"
            )
    return stats


def check_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Check that every target is in ``[0, n_classes)`` or ``ignore_index``, without a
    device-to-host sync on a GPU: :func:`target_stats`'s one launch (nothing for no targets)."""
    if target.numel():
        target_stats(target.reshape(-1), n_classes, ignore_index)


def _check_coef(name: str, c: torch.Tensor, n_rows: int) -> None:
    check_tensor(name, c, ndim=1, dtypes=(torch.float32,))
    if c.shape[0] not in (1, n_rows) or not c.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous (1,) or ({n_rows},) fp32 tensor, got shape {tuple(c.shape)}"
        )


def check_cross_entropy_args(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    label_smoothing: float,
    softcap: float | None,
) -> None:
    """Validate what both launchers take (names, shapes, dtypes, ranges), before any launch."""
    check_tensor("logits", logits, ndim=2, dtypes=LOGIT_DTYPES)
    check_tensor("target", target, ndim=1, dtypes=TARGET_DTYPES)
    n, v = logits.shape
    if target.shape[0] != n:
        raise ValueError(
            f"target must have shape ({n},) to match logits of shape {tuple(logits.shape)}, "
            f"got {tuple(target.shape)}"
        )
    if v == 0:
        raise ValueError(f"logits must have at least one class, got shape {tuple(logits.shape)}")
    if weight is not None:
        check_tensor("weight", weight, ndim=1, dtypes=(torch.float32,))
        if weight.shape[0] != v:
            raise ValueError(f"weight must have shape ({v},) (one per class), got {tuple(weight.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    check_same_device(logits=logits, target=target, weight=weight)
    _check_column_reach("logits", logits)


def _check_column_reach(name: str, t: torch.Tensor) -> None:
    """Rows are addressed with int64 offsets, a row's columns with int32 ones: refuse a
    column stride that would carry them past 2^31 elements (a transposed view of a huge
    tensor; ``.contiguous()`` fixes it)."""
    check_int32_addressable(f"a row of {name}", t[0] if t.shape[0] else t)


def _launch(
    logits, target, weight, lse, loss, grad, a, b, q, ignore_index, label_smoothing, softcap, compute_lse,
    stats=None,
) -> None:  # fmt: skip
    """One ``_cross_entropy_kernel`` launch over the (N, V) ``logits`` (arguments checked by
    the caller; tensors left None are not read or written, their pointer a dummy): ``ROWS``
    rows per program, ``lse`` (N,) fp32 read or (``compute_lse``) written, from ``stats``
    (N, slots, 2) where given, ``loss`` (N,) and ``grad`` (N, V) written when given,
    ``a`` / ``b`` / ``q`` the gradient's per-row coefficients (the backward's and the fused
    linear's)."""
    n, v = logits.shape
    if n == 0:
        return
    target = target.contiguous()
    wsum = weight.sum().reshape(1) if weight is not None and label_smoothing > 0 else None
    coef_stride = 1 if a is not None and a.shape[0] == n and n > 1 else 0
    dummy = lse
    block = block_v(v)
    rows = rows_per_program(block)
    n_slots = 1 if stats is None else stats.shape[1]
    _cross_entropy_kernel[(triton.cdiv(n, rows),)](
        logits, target, dummy if weight is None else weight, dummy if wsum is None else wsum,
        dummy if loss is None else loss, lse, dummy if stats is None else stats,
        dummy if grad is None else grad,
        dummy if a is None else a, dummy if b is None else b, dummy if q is None else q,
        coef_stride, n, v, n_slots, logits.stride(0), logits.stride(1),
        0 if grad is None else grad.stride(0), 1 if grad is None else grad.stride(1),
        ignore_index, float(label_smoothing), float(softcap or 1.0),
        HAS_WEIGHT=weight is not None, SMOOTHING=label_smoothing > 0, SOFTCAP=softcap is not None,
        COMPUTE_LSE=compute_lse, LSE_FROM_STATS=stats is not None,
        WRITE_LOSS=loss is not None, WRITE_GRAD=grad is not None,
        HAS_B=b is not None, HAS_Q=q is not None,
        GRAD_DTYPE=tl_dtype(logits.dtype if grad is None else grad.dtype),
        ROWS=rows, BLOCK_V=block, BLOCK_S=min(block_v(n_slots), block),
        num_warps=num_warps(block), num_stages=NUM_STAGES,
    )  # fmt: skip


def _check_grad_out(grad: torch.Tensor, logits: torch.Tensor) -> None:
    """Raise unless ``grad`` can receive the gradient of ``logits`` (their shape, a logit dtype)."""
    check_tensor("grad", grad, ndim=2, dtypes=LOGIT_DTYPES)
    if grad.shape != logits.shape:
        raise ValueError(f"grad must have the logits' shape {tuple(logits.shape)}, got {tuple(grad.shape)}")
    _check_column_reach("grad", grad)
    if grad.numel() and grad.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
        raise ValueError("grad must not share memory with logits: the gradient is never written in place")


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    grad: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    q: torch.Tensor | None = None,
    check_target: bool = True,
    loss_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    row_stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss terms and logsumexp, in fp32, in one launch; with ``grad``,
    the gradient in the same launch.

    Args:
        logits: (N, V) fp16/bf16/fp32, any strides (read in place, never written).
        target: (N,) int64/int32 class indices in ``[0, V)`` or ``ignore_index``.
        weight: optional (V,) fp32 class weights.
        ignore_index: rows with this target have loss 0, lse 0 and a zero gradient.
        label_smoothing: eps in [0, 1], torch's formula (see the module docstring).
        softcap: optional c > 0: the logits become ``c * tanh(x / c)`` first.
        grad: optional (N, V) fp16/bf16/fp32 tensor (the logits' dtype, or a 16-bit
            one for fp32 logits made from 16-bit operands), any strides, not sharing
            memory with ``logits``: receives the gradient of
            ``sum_i a_i * loss_i + q_i * lse_i^2``.
        a: (N,) or (1,) fp32, needed with ``grad``: the loss terms' coefficients
            (1 / the mean's denominator times the upstream gradient, say).
        q: optional (N,) or (1,) fp32: the coefficients of lse^2 (a z-loss).
        check_target: run :func:`check_targets` (False where the caller checked).
        loss_out, lse_out: optional (N,) contiguous fp32 tensors that receive the loss
            terms and the lse (slices of the caller's (rows,) buffers, say), else new ones.
        row_stats: optional contiguous fp32 (N, ceil(V / 32), 2): the logits' softmax
            statistics per 32 columns as the GEMM that made them wrote them
            (``gemm.matmul_row_stats_prechecked``); the lse is taken from them and the
            logits are read once (for the gradient and the target's logit), not twice.
            Without label smoothing and softcap only (their terms need every logit).

    Returns:
        ``(loss, lse)``: (N,) fp32 (``loss_out`` / ``lse_out`` where given; 0 on ignored
        rows; NaN loss for a target out of range, which the check reports first).
    """
    check_cross_entropy_args(logits, target, weight, label_smoothing, softcap)
    n = logits.shape[0]
    if grad is not None:
        _check_grad_out(grad, logits)
        if a is None:
            raise ValueError("a (the loss terms' gradient coefficients) is needed with grad")
        _check_coef("a", a, n)
        if q is not None:
            _check_coef("q", q, n)
            if q.shape != a.shape:
                raise ValueError(f"q must have a's shape {tuple(a.shape)}, got {tuple(q.shape)}")
        check_same_device(logits=logits, grad=grad, a=a, q=q)
    for name, out in (("loss_out", loss_out), ("lse_out", lse_out)):
        if out is not None:
            check_tensor(name, out, ndim=1, dtypes=(torch.float32,))
            if out.shape[0] != n or not out.is_contiguous():
                raise ValueError(
                    f"{name} must be a contiguous ({n},) fp32 tensor, got shape {tuple(out.shape)}"
                )
            check_same_device(logits=logits, **{name: out})
    if row_stats is not None:
        _check_row_stats(row_stats, logits, label_smoothing, softcap)
    if check_target:
        check_targets(target, logits.shape[1], ignore_index)
    loss = torch.empty(n, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    lse = torch.empty(n, dtype=torch.float32, device=logits.device) if lse_out is None else lse_out
    _launch(
        logits, target, weight, lse, loss, grad, a, None, q, ignore_index, label_smoothing, softcap, True,
        row_stats,
    )  # fmt: skip
    return loss, lse


def _check_row_stats(stats: torch.Tensor, logits: torch.Tensor, label_smoothing: float, softcap) -> None:
    """Raise unless ``stats`` can stand for a pass over ``logits`` (see cross_entropy_forward)."""
    n, v = logits.shape
    shape = (n, row_stats_slots(v), 2)
    check_tensor("row_stats", stats, ndim=3, dtypes=(torch.float32,))
    if tuple(stats.shape) != shape or not stats.is_contiguous():
        raise ValueError(
            f"row_stats must be a contiguous {shape} fp32 tensor, got shape {tuple(stats.shape)}"
        )
    if label_smoothing > 0 or softcap is not None:
        raise ValueError("row_stats cannot give label smoothing's or softcap's terms: pass neither with it")
    check_same_device(logits=logits, row_stats=stats)


def cross_entropy_backward(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of ``sum_i grad_loss_i * loss_i + grad_lse_i * lse_i`` with
    respect to the logits, from the lse :func:`cross_entropy_forward` returned
    (one pass over the logits), in the logits' dtype.

    Args:
        logits, target, weight, ignore_index, label_smoothing, softcap: as given to
            :func:`cross_entropy_forward` (targets already checked there).
        lse: (N,) fp32, from :func:`cross_entropy_forward`.
        grad_loss: (N,) or (1,) fp32: the upstream gradient of the loss terms.
        grad_lse: optional, same shape: the upstream gradient of lse.
        grad: optional output (N, V), fp16/bf16/fp32 (as in :func:`cross_entropy_forward`),
            else a new contiguous one of the logits' dtype.

    Returns:
        ``grad`` (zero rows where the target is ``ignore_index``).
    """
    check_cross_entropy_args(logits, target, weight, label_smoothing, softcap)
    n = logits.shape[0]
    check_tensor("lse", lse, ndim=1, dtypes=(torch.float32,))
    if lse.shape[0] != n or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous ({n},) fp32 tensor, got shape {tuple(lse.shape)}")
    _check_coef("grad_loss", grad_loss, n)
    if grad_lse is not None:
        _check_coef("grad_lse", grad_lse, n)
        if grad_lse.shape != grad_loss.shape:
            raise ValueError(
                f"grad_lse must have grad_loss's shape {tuple(grad_loss.shape)}, got {tuple(grad_lse.shape)}"
            )
    if grad is None:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    else:
        _check_grad_out(grad, logits)
    check_same_device(logits=logits, lse=lse, grad_loss=grad_loss, grad_lse=grad_lse, grad=grad)
    _launch(
        logits,
        target,
        weight,
        lse,
        None,
        grad,
        grad_loss,
        grad_lse,
        None,
        ignore_index,
        label_smoothing,
        softcap,
        False,
    )
    return grad
