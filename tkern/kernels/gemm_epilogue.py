"""What both GEMM kernels share: the grouped tile order and the fused epilogue.

The epilogue runs on a GEMM's fp32 accumulator tile: bias, optional
pre-activation store, activation, and one cast on the final store, so the only
rounding to half precision is that store. The jit helpers here are called by
``_matmul_kernel`` (gemm.py) and ``_matmul_tma_kernel`` (gemm_tma.py); the
host side (argument checks, the epilogue's constexpr arguments) is shared by
their launchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    HALF_DTYPES,
    INTERPRET,
    cast_rne,
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
    tl_dtype,
)
from tkern.kernels.activation import (
    ACTIVATIONS,
    TRANSCENDENTAL,
    TRANSCENDENTAL_BITS,
    activation_grad_f32,
    apply_activation,
    check_activation,
)
from tkern.kernels.float8 import E5M2_DTYPES, FNUZ_FP8, store_fp8_tile

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class EpilogueRead(NamedTuple):
    """A tensor ``z`` (M, N) the epilogue reads beside C, with C's strides: the pre-activation
    whose act'(z) multiplies the product (the kernels' ``GRAD_ACT``: ``activation``, a name);
    with ``glu``, ``z`` and C the left halves of (M, 2N) tensors (gate | up, d(gate) | d(up):
    ``GRAD_GLU``); with ``residual`` (``activation`` None) added to the result before its one
    rounding (``ADD_RESIDUAL``: the residual stream's add in the layer's GEMM). With
    ``glu_forward`` (``GLU_FWD``, ``activation`` the gate's) ``z`` is a contiguous (M, 2N)
    ``[gate | up]`` and C a contiguous (M, N) ``h``: the product is ``up``, stored into ``z``'s
    right half, and ``h = act(gate) * up`` into C (rows of ``z`` twice C's row stride apart).
    With ``row_stats`` (``activation`` None) ``z`` is written, not read: a contiguous fp32
    (M, :func:`row_stats_slots` (N), 2) tensor of each row's softmax statistics per
    :data:`STATS_COLS` columns of the stored C (``ROW_STATS``, see :func:`epilogue`)."""

    activation: str | None
    z: torch.Tensor
    glu: bool = False
    residual: bool = False
    glu_forward: bool = False
    row_stats: bool = False


#: Columns of C per slot of the ``ROW_STATS`` statistics: the narrowest epilogue slice any
#: config makes (gemm_configs: BLOCK_N 32), so that every slice starts on a slot.
STATS_COLS = 32
_STATS_COLS = tl.constexpr(STATS_COLS)


def row_stats_slots(n: int) -> int:
    """Slots of ``ROW_STATS`` statistics per row of an (M, ``n``) C."""
    return triton.cdiv(n, STATS_COLS)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _store_row_stats(y, rows, col0, M, N, stats_ptr, WIDTH: tl.constexpr):
    """The softmax statistics of WIDTH columns of C from ``col0`` (``y``: their stored values
    in fp32, (BLOCK_M, WIDTH)): per row the max ``m`` over the columns inside N and
    ``s = sum(exp(y - m))``, written as ``(m, s)`` into slot ``col0 // STATS_COLS`` of the
    contiguous (M, cdiv(N, STATS_COLS), 2) ``stats_ptr``, and the neutral ``(-inf, 0)``
    into the slice's other slots, so that every slot is written once by some tile and the
    slots combine as an online softmax does (``m = max m_j``, ``s = sum s_j exp(m_j - m)``)."""
    cols = col0 + tl.arange(0, WIDTH)
    x = tl.where((cols < N)[None, :], y, float("-inf"))
    m = tl.max(x, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a slice past the edge: no inf - inf
    s = tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
    SLOTS: tl.constexpr = WIDTH // _STATS_COLS
    j = tl.arange(0, SLOTS)
    first = (j == 0)[None, :]
    slot = col0 // _STATS_COLS + j
    n_slots = tl.cdiv(N, _STATS_COLS)
    mask = (rows < M)[:, None] & (slot < n_slots)[None, :]
    ptrs = stats_ptr + (rows.to(tl.int64)[:, None] * n_slots + slot[None, :]) * 2
    tl.store(ptrs, tl.where(first, m[:, None], float("-inf")), mask=mask)
    tl.store(ptrs + 1, tl.where(first, s[:, None], 0.0), mask=mask)


@triton.jit
def tile_coords(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row, column) of output tile ``tile_id`` in grouped order: consecutive
    tiles walk down GROUP_M rows of tiles before moving right, so the rows of A
    they share are still in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _column_halves(acc, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """The left and right column halves of a (BLOCK_M, WIDTH) tile."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _column_slices(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """A (BLOCK_M, BLOCK_N) tile as a tuple of PARTS (1, 2 or 4) column slices, left to right."""
    if PARTS == 1:
        return (acc,)
    elif PARTS == 2:
        return _column_halves(acc, BLOCK_M, BLOCK_N)
    else:
        left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
        ll, lr = _column_halves(left, BLOCK_M, BLOCK_N // 2)
        rl, rr = _column_halves(right, BLOCK_M, BLOCK_N // 2)
        return ll, lr, rl, rr


@triton.jit
def _epilogue_part(
    acc,  # (BLOCK_M, WIDTH) fp32: columns col0 .. col0 + WIDTH of the tile
    rows,  # (BLOCK_M,) int32: the tile's output rows
    col0,
    M,
    N,
    c_ptr,
    bias_ptr,
    preact_ptr,
    stride_cm,
    stride_cn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    WIDTH: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    GRAD_ACT: tl.constexpr = 0,
    GRAD_GLU: tl.constexpr = False,
    ADD_RESIDUAL: tl.constexpr = False,
    GLU_FWD: tl.constexpr = 0,
    ROW_STATS: tl.constexpr = False,
):
    """Bias, optional pre-activation store, the product with act'(Z) of the Z read at
    ``preact_ptr`` (GRAD_ACT; with GRAD_GLU the gated unit's two gradients, see
    :func:`epilogue`), the gated unit's forward (GLU_FWD: the product is ``up``, stored at
    ``preact_ptr``'s right half, and C gets ``act(gate) * up``), activation, C's old value
    (ACCUMULATE) or the residual read at ``preact_ptr`` (ADD_RESIDUAL) added, and one masked
    cast-and-store on WIDTH columns of the fp32 tile, then (ROW_STATS) the stored values'
    softmax statistics into ``preact_ptr`` (:func:`_store_row_stats`).
    Returns ``(stored, cols, mask)``: the values stored (OUT_DTYPE), their columns and
    mask (:func:`epilogue_emit` casts them to fp8; :func:`epilogue` drops them)."""
    cols = col0 + tl.arange(0, WIDTH)
    mask_n = cols < N
    mask_c = (rows < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    stride_zm = stride_cm
    if GLU_FWD != 0:  # [gate | up] (M, 2N) beside h (M, N): its rows twice h's apart
        stride_zm = 2 * stride_cm
    preact_ptrs = preact_ptr + rows[:, None] * stride_zm + cols[None, :] * stride_cn
    if STORE_PREACT:
        tl.store(preact_ptrs, cast_rne(acc, PREACT_DTYPE), mask=mask_c)
    if GRAD_GLU:  # dH = dY @ W of h = act(gate) * up: gate at preact_ptr, up N columns right of it
        g = tl.load(preact_ptrs, mask=mask_c, other=0.0).to(tl.float32)
        u = tl.load(preact_ptrs + N * stride_cn, mask=mask_c, other=0.0).to(tl.float32)
        d_up_ptrs = c_ptr + rows[:, None] * stride_cm + (cols + N)[None, :] * stride_cn
        tl.store(d_up_ptrs, cast_rne(acc * apply_activation(g, GRAD_ACT), OUT_DTYPE), mask=mask_c)
        acc = activation_grad_f32(acc * u, g, GRAD_ACT)  # d(gate), stored below
    elif GLU_FWD != 0:  # h = act(gate) * up of the stored gate and the rounded up: swiglu.py's formula
        up = cast_rne(acc, PREACT_DTYPE)
        tl.store(preact_ptrs + N * stride_cn, up, mask=mask_c)
        g = tl.load(preact_ptrs, mask=mask_c, other=0.0).to(tl.float32)
        acc = apply_activation(g, GLU_FWD) * up.to(tl.float32)  # h, stored below
    elif GRAD_ACT != 0:  # dZ = (dY @ W) * act'(Z) on the unrounded fp32 product: one rounding
        z = tl.load(preact_ptrs, mask=mask_c, other=0.0).to(tl.float32)
        acc = activation_grad_f32(acc, z, GRAD_ACT)
    acc = apply_activation(acc, ACTIVATION)
    # C's pointers made here, after the activation: made before it they held 16 B more than
    # sm_90's TMA GELU+preact ragged tiles had (the gate's spill check)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if ACCUMULATE:  # C += result: one rounding of the fp32 sum, as an fp32 accumulator would
        acc = acc + tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # y = residual + layer(x): one rounding of the fp32 sum
        acc = acc + tl.load(preact_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    out = cast_rne(acc, OUT_DTYPE)
    tl.store(c_ptrs, out, mask=mask_c)
    if ROW_STATS:
        _store_row_stats(out.to(tl.float32), rows, col0, M, N, preact_ptr, WIDTH)
    return out, cols, mask_c


@triton.jit
def epilogue(
    acc,  # (BLOCK_M, BLOCK_N) fp32 accumulator of tile (pid_m, pid_n)
    pid_m,
    pid_n,
    M,
    N,
    c_ptr,  # (M, N) OUT_DTYPE, strides (stride_cm, stride_cn)
    bias_ptr,  # (N,) with stride stride_bias; unused unless HAS_BIAS
    preact_ptr,  # (M, N) PREACT_DTYPE, c's strides: stored (STORE_PREACT) or Z read (GRAD_ACT)
    stride_cm,
    stride_cn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # an activation.ACTIVATIONS code (0 none)
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EPI_SPLIT: tl.constexpr,  # column slices of an exp/erf epilogue (gemm_configs.epi_split)
    ACCUMULATE: tl.constexpr = False,  # C's old value is added to the result (C += ...)
    GRAD_ACT: tl.constexpr = 0,  # an ACTIVATIONS code: the result times act'(Z), Z at preact_ptr
    GRAD_GLU: tl.constexpr = False,  # with GRAD_ACT: the gated unit's d(gate) and d(up) (see below)
    ADD_RESIDUAL: tl.constexpr = False,  # the (M, N) tensor at preact_ptr added to the result
    GLU_FWD: tl.constexpr = 0,  # an ACTIVATIONS code: C = act(gate) * up, up stored beside gate (below)
    ROW_STATS: tl.constexpr = False,  # C's softmax statistics written at preact_ptr (below)
):
    """Bias, activation and one cast, on the fp32 accumulator; masked stores.
    With ``ACCUMULATE`` the store adds the result to what C holds (the wgrad
    accumulated into a gradient buffer), read in fp32 and rounded once.

    With an activation computed with exp/erf (activation.TRANSCENDENTAL: GELU,
    SiLU, tanh-GELU) the epilogue runs on ``EPI_SPLIT`` (1, 2 or 4) column slices
    of the tile one after the other: erf's temporaries next to a whole 128x256
    (or 4-warp 128x128) accumulator spilled registers; on a slice they fit. So
    does ``ACCUMULATE``: C's old tile next to the whole accumulator spilled
    160-344 B on sm_90 for fp8 operands (the compile gate's scaled_mm C+= cases).

    With ``GRAD_ACT`` (the linear backward's dgrad of the layer after an activation:
    ``dZ = (dY @ W) * act'(Z)``) the pre-activation Z, (M, N) with C's strides, is read
    at ``preact_ptr`` and the fp32 tile multiplied by act'(Z) before the one cast; an
    exp/erf gradient is sliced as an exp/erf activation is.

    With ``GRAD_GLU`` too (the dgrad of the layer after a gated unit ``h = act(gate) * up``:
    the tile is dH = dY @ W), C and the pre-activations are the left halves of (M, 2N)
    tensors: ``gate`` is read at ``preact_ptr`` and ``up`` N columns to its right, and
    ``d(gate) = dH * up * act'(gate)`` is stored at C and ``d(up) = dH * act(gate)`` N
    columns to its right, each from the unrounded fp32 dH and rounded once (the formulas
    of kernels/swiglu.py's backward).

    With ``ADD_RESIDUAL`` the tensor at ``preact_ptr`` (C's strides: the residual stream) is
    added to the result in fp32 before the one rounding, the pre-norm block's ``y = h +
    layer(x)`` (as ACCUMULATE adds C's old value; sliced as it is).

    With ``GLU_FWD`` (an activation code: the up GEMM of a gated unit ``h = act(gate) * up``
    whose gate GEMM ran first) the tile (+ bias) is ``up``: ``preact_ptr`` is the contiguous
    (M, 2N) ``[gate | up]`` (rows ``2 * stride_cm`` apart) and C the contiguous (M, N) ``h``;
    ``up`` is rounded and stored N columns right of ``gate``, the stored 16-bit ``gate`` read,
    and ``h = act(gate) * up`` computed in fp32 from the two 16-bit values (kernels/swiglu.py's
    forward: bit for bit its ``h``) and rounded once into C; sliced as GRAD_GLU is.

    With ``ROW_STATS`` (no activation: a head's logits) ``preact_ptr`` is a contiguous fp32
    (M, cdiv(N, STATS_COLS), 2) tensor that receives, per row and per STATS_COLS columns,
    the max ``m`` and ``sum(exp(c - m))`` of the stored C (:func:`_store_row_stats`): a
    row's logsumexp from its slots is one read of N / 4 bytes where a pass over the row reads
    all of it (kernels/cross_entropy.py's ``LSE_FROM_STATS``); sliced as an exp activation is."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    BITS: tl.constexpr = TRANSCENDENTAL_BITS
    SLICED: tl.constexpr = ((BITS >> ACTIVATION) | (BITS >> GRAD_ACT) | (BITS >> GLU_FWD)) & 1
    SLICE: tl.constexpr = ACCUMULATE or SLICED or GRAD_GLU or ADD_RESIDUAL or GLU_FWD or ROW_STATS
    PARTS: tl.constexpr = EPI_SPLIT if SLICE else 1
    WIDTH: tl.constexpr = BLOCK_N // PARTS
    slices = _column_slices(acc, BLOCK_M, BLOCK_N, PARTS)
    for i in tl.static_range(PARTS):
        _epilogue_part(
            slices[i], rows, pid_n * BLOCK_N + i * WIDTH, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm,
            stride_cn, stride_bias, HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, WIDTH,
            ACCUMULATE, GRAD_ACT, GRAD_GLU, ADD_RESIDUAL, GLU_FWD, ROW_STATS,
        )  # fmt: skip


@triton.jit
def epilogue_emit(
    acc,  # (BLOCK_M, BLOCK_N) fp32 accumulator of tile (pid_m, pid_n)
    pid_m,
    pid_n,
    M,
    N,
    c_ptr,  # (M, N) OUT_DTYPE, contiguous
    bias_ptr,
    preact_ptr,
    stride_cm,
    stride_cn,
    stride_bias,
    mult,  # fp32 multiplier of the fp8 cast (CAST only)
    data_ptr,  # (M, N) fp8 DTYPE8, contiguous: C's cast (CAST only)
    data_t_ptr,  # (N, M) fp8 DTYPE8, contiguous: C^T's cast (CAST and STORE_T only)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    CAST: tl.constexpr,  # cast C with ``mult`` (the multiplier is known before the launch)
    STORE_T: tl.constexpr,
    FP8_MAX: tl.constexpr,
    DTYPE8: tl.constexpr,
):
    """:func:`epilogue` (no ``C +=``) that also hands the stored C to the next fp8 GEMM:
    the max |C| of the tile's valid elements is returned (C as rounded to OUT_DTYPE, what
    the next GEMM's own cast would read), and with CAST each slice is cast with ``mult``
    into C's layout and C^T's (float8.store_fp8_tile: the cast ``cast_2d`` makes of C)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    PARTS: tl.constexpr = EPI_SPLIT if (TRANSCENDENTAL_BITS >> ACTIVATION) & 1 else 1
    WIDTH: tl.constexpr = BLOCK_N // PARTS
    slices = _column_slices(acc, BLOCK_M, BLOCK_N, PARTS)
    best = 0.0
    for i in tl.static_range(PARTS):
        out, cols, mask = _epilogue_part(
            slices[i], rows, pid_n * BLOCK_N + i * WIDTH, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm,
            stride_cn, stride_bias, HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, WIDTH,
            False,
        )  # fmt: skip
        y = out.to(tl.float32)
        best = tl.maximum(best, tl.max(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), axis=0))
        if CAST:
            store_fp8_tile(
                y, rows.to(tl.int64), cols.to(tl.int64), mask, M, N, mult, data_ptr, data_t_ptr, True,
                STORE_T, FP8_MAX, DTYPE8,
            )  # fmt: skip
    return best


@triton.jit
def epilogue_tma(
    acc,  # (BLOCK_M, BLOCK_N) fp32 accumulator of tile (pid_m, pid_n)
    pid_m,
    pid_n,
    N,
    c_desc,  # descriptor of C (M, N) OUT_DTYPE, block (BLOCK_M, BLOCK_N // parts)
    bias_ptr,  # (N,) with stride stride_bias; unused unless HAS_BIAS
    stride_bias,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # an activation.ACTIVATIONS code (0 none)
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    ACCUMULATE: tl.constexpr = False,
):
    """:func:`epilogue` with C stored (and, with ``ACCUMULATE``, read) by the tensor
    memory accelerator: each column slice goes from registers to shared memory and
    out as one bulk copy, which clips the tile's rows and columns beyond (M, N), so
    no masks and no per-thread address arithmetic; the threads move on to the next
    tile's first loads while the copy drains. No pre-activation store (its launches
    keep :func:`epilogue`). The same slices as :func:`epilogue` (:func:`epilogue_parts`)."""
    PARTS: tl.constexpr = EPI_SPLIT if ACCUMULATE or (TRANSCENDENTAL_BITS >> ACTIVATION) & 1 else 1
    WIDTH: tl.constexpr = BLOCK_N // PARTS
    slices = _column_slices(acc, BLOCK_M, BLOCK_N, PARTS)
    row0 = pid_m * BLOCK_M
    for i in tl.static_range(PARTS):
        part = slices[i]
        col0 = pid_n * BLOCK_N + i * WIDTH
        if HAS_BIAS:
            cols = col0 + tl.arange(0, WIDTH)
            bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
            part = part + bias.to(tl.float32)[None, :]
        part = apply_activation(part, ACTIVATION)
        if ACCUMULATE:  # C += result, one rounding (the descriptor zero-fills beyond the edges)
            part = part + c_desc.load([row0, col0]).to(tl.float32)
        c_desc.store([row0, col0], cast_rne(part, OUT_DTYPE))


def epilogue_parts(epi_split: int, activation: int, accumulate: bool) -> int:
    """Column slices the epilogues cut a tile into (their ``PARTS``): ``epi_split`` with an
    exp/erf activation or ``C +=``, else 1. A TMA store's block is (BLOCK_M, BLOCK_N // parts)."""
    return epi_split if accumulate or activation in TRANSCENDENTAL else 1


# --------------------------------------------------------------------------- host side


def check_bias(bias: torch.Tensor | None, n: int, dtype: torch.dtype | None) -> None:
    """Raise unless ``bias`` is None or an (n,) tensor of ``dtype`` or fp32 (``dtype``
    None: of any of :data:`OUT_DTYPES`, the fp8 GEMMs' bias)."""
    if bias is None:
        return
    check_tensor("bias", bias, ndim=1, dtypes=OUT_DTYPES if dtype is None else (dtype, torch.float32))
    if bias.shape[0] != n:
        raise ValueError(f"bias must have shape ({n},), got shape {tuple(bias.shape)}")


def check_out_dtype(out_dtype: torch.dtype) -> None:
    """Raise ``TypeError`` unless a GEMM can store ``out_dtype`` (:data:`OUT_DTYPES`)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def check_operands(
    a: torch.Tensor, b: torch.Tensor, dtypes: tuple[torch.dtype, ...], refuse_pair=None
) -> tuple[int, int, int]:
    """Raise unless ``a`` (M, K) and ``b`` (K, N) are 2-D tensors of ``dtypes`` whose inner
    dimensions agree, and ``refuse_pair(a.dtype, b.dtype)`` (when given) returns no message
    (a ``TypeError`` with the message it returns); every GEMM's operand check. (M, N, K)."""
    check_tensor("a", a, ndim=2, dtypes=dtypes)
    check_tensor("b", b, ndim=2, dtypes=dtypes)
    if refuse_pair is not None and (message := refuse_pair(a.dtype, b.dtype)):
        raise TypeError(message)
    (M, K), (Kb, N) = a.shape, b.shape
    if Kb != K:
        raise ValueError(
            f"inner dimensions differ: a has shape {tuple(a.shape)} (M, K), so b must have shape "
            f"({K}, N), got {tuple(b.shape)}"
        )
    return M, N, K


def _same_dtype(da: torch.dtype, db: torch.dtype) -> str | None:
    return None if da == db else f"a and b must have the same dtype, got a {da} and b {db}"


def refuse_e5m2_pair(da: torch.dtype, db: torch.dtype) -> str | None:
    """Why fp8 operands of dtypes ``da`` x ``db`` have no tensor-core op, or None: both
    e5m2 (no e5m2 x e5m2 product, as torch._scaled_mm refuses), or an OCP format with an
    FNUZ one (no GPU multiplies the two families together)."""
    if da == db and da in E5M2_DTYPES:
        return f"a and b cannot both be {da}: fp8 tensor cores take e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3"
    if (da in FNUZ_FP8) != (db in FNUZ_FP8):
        return f"a and b must both be OCP fp8 or both FNUZ fp8, got a {da} and b {db}"
    return None


def check_preact(preact: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Raise unless ``preact`` is None or a contiguous ``shape`` tensor of ``dtype``: where
    an epilogue stores the pre-activation."""
    if preact is None:
        return
    check_tensor("preact", preact, ndim=2, dtypes=(dtype,))
    if tuple(preact.shape) != shape or not preact.is_contiguous():
        raise ValueError(f"preact must be a contiguous {shape} tensor, got shape {tuple(preact.shape)}")


def check_matmul_args(a, b, bias, activation, out_dtype, preact) -> tuple[int, int, int, torch.dtype]:
    """Validate :func:`tkern.matmul`'s arguments (see there); return M, N, K and the output dtype."""
    M, N, K = check_operands(a, b, HALF_DTYPES, _same_dtype)
    check_bias(bias, N, a.dtype)
    check_activation(activation)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    check_out_dtype(out_dtype)
    check_preact(preact, (M, N), a.dtype)
    check_same_device(a=a, b=b, bias=bias, preact=preact)
    # int32 tile offsets keep the inner loop lean; refuse what they cannot reach
    check_int32_addressable("a", a)
    check_int32_addressable("b", b)
    check_int32_elements("out", (M, N))
    return M, N, K, out_dtype


def bias_stride(bias: torch.Tensor | None) -> int:
    """The bias's element stride as the epilogue reads it: a strided view or an
    expanded (stride-0) bias is read in place; 1 (contiguous) is the common case,
    which Triton specialises to a vectorised load."""
    return 1 if bias is None else bias.stride(0)


def read_meta(read: EpilogueRead | None) -> dict:
    """The constexpr arguments both GEMM kernels take for what their epilogue reads (``read``,
    None: nothing): ``GRAD_ACT`` (an activation code), ``GRAD_GLU``, ``ADD_RESIDUAL``,
    ``GLU_FWD`` (the gate's activation code) and ``ROW_STATS`` (what it writes beside C);
    every one passed, off or not (autotune keys)."""
    if read is None:
        return {"GRAD_ACT": 0, "GRAD_GLU": False, "ADD_RESIDUAL": False, "GLU_FWD": 0, "ROW_STATS": False}
    code = ACTIVATIONS[read.activation]
    return {
        "GRAD_ACT": 0 if read.glu_forward else code,
        "GRAD_GLU": read.glu,
        "ADD_RESIDUAL": read.residual,
        "GLU_FWD": code if read.glu_forward else 0,
        "ROW_STATS": read.row_stats,
    }


def epilogue_meta(dtype, bias, activation, out_dtype, preact, accumulate=False) -> dict:
    """The constexpr arguments both GEMM kernels take for their epilogue and operands."""
    return {
        "ACCUMULATE": accumulate,
        "HAS_BIAS": bias is not None,
        "ACTIVATION": ACTIVATIONS[activation],
        "STORE_PREACT": preact is not None,
        "OUT_DTYPE": tl_dtype(out_dtype),
        # fp8 operands (scaled_mm) store their pre-activation in the output dtype
        "PREACT_DTYPE": tl_dtype(dtype if dtype in HALF_DTYPES else out_dtype),
        # the interpreter cannot multiply bf16, and fp8 products are exact in fp32 too
        "UPCAST": INTERPRET and dtype != torch.float16,
    }
