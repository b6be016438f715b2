"""MX (block-scaled) fp8 casts: one e8m0 scale per 32 consecutive elements along an axis.

OCP's microscaling formats (MX v1.0) give every block of ``block_size`` (32)
elements along one axis its own power-of-two scale, stored as an e8m0 byte
(``torch.float8_e8m0fnu``: 2^(byte - 127), 255 is NaN), and the elements in fp8
(e4m3fn or e5m2). The cast here is torchao 0.18's
``torchao.prototype.mx_formats.mx_tensor.to_mx`` bit for bit, in its two scale
rules:

* ``"floor"`` (``ScaleCalculationMode.FLOOR``, OCP's rule and torchao's default):
  scale = 2^(floor(log2(amax)) - emax), emax the exponent of the format's largest
  power of two (8 for e4m3, 15 for e5m2), read from amax's exponent bits; the
  biased exponent clamped to [0, 255] (an amax of inf gives 2^120 / 2^113 and its
  block saturates; 255, the NaN scale, only for a block holding a NaN, whose
  finite elements then become zeros as torchao's ``x / inf``); a scale below
  2^-126 is applied as 2^-126.
* ``"rceil"`` (``RCEIL``, cuBLAS's and Blackwell's ``cvt.rp.satfinite.ue8m0``):
  scale = 2^ceil(log2(amax / fp8_max)), clamped to [2^-127, 2^127]; a block
  with a NaN is all NaN, an amax of inf gives the scale 254, an exponent byte
  of 0 is applied as 1. The ceiling is read exactly from the bits of
  amax / fp8_max (correctly rounded), as the hardware instruction does; torchao's
  CPU fallback takes ``ceil(torch.log2(...))``, which can round down when
  amax / fp8_max lies within a few fp32 ulps above a power of two.

Elements are ``x / scale`` (a multiplication by the exact power-of-two
reciprocal: the same correctly rounded value) clamped to ±fp8_max, NaN kept, and
rounded to nearest even (tkern.kernels.float8.to_fp8_saturated, which also
rounds on the fp8 grid by hand under the interpreter). Every step is on the
device, nothing waits for it.

One kernel, :func:`_to_mx_kernel`, casts a (batch, R, C) strided view with
blocks along C; :func:`to_mx` maps any axis of a 2-D or 3-D tensor to that C by
permuting strides. With ``ALONG_R`` the same pass also casts with blocks along
R: :func:`to_mx_both` writes both casts of a 2-D x (M, K), along K and along M
(stored as x^T, the wgrad's K-major operand), from one read of x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, cdiv, check_int32_addressable, check_tensor, to_f32
from tkern.kernels.float8 import FP8_MAX, HIGH_DTYPES, OCP_FP8, check_fp8_dtype, to_fp8_saturated

#: Elements per scale (OCP MX: 32; the only block size MX tensor cores take).
BLOCK_SIZE = 32
#: The scale rules, as torchao's ``ScaleCalculationMode`` values.
SCALE_MODES = ("floor", "rceil")
_MODE_CODE = {"floor": 0, "rceil": 1}
#: e8m0's exponent bias (2^0 is the byte 127) and its NaN byte.
E8M0_BIAS = 127
E8M0_NAN = 255
#: log2 of each format's largest power of two (256 and 32768): FLOOR's emax.
MAX_POW2 = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
#: MX elements are OCP fp8 (the OCP MX spec; gfx942's FNUZ formats have no MX form).
FP8_DTYPES = OCP_FP8
#: An fp8 NaN's magnitude bits (0x7F in both formats; the sign comes from the value).
FP8_NAN_BITS = tl.constexpr(0x7F)
#: Tile of one program: TILE_R rows x TILE_C columns (multiples of the block).
#: Large under the interpreter, where each program costs milliseconds.
TILE_R, TILE_C = (64, 128) if INTERPRET else (32, 128)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _pow2_bits(biased):
    """2^(127 - biased) as fp32 bits (int32) for biased in [1, 254]: the exact
    reciprocal of an e8m0 scale (2^-127 at 254 is a subnormal, 0x00400000)."""
    return tl.where(biased == 254, 0x00400000, (254 - biased) << 23)


@triton.jit
def mx_scale(amax, MODE: tl.constexpr, FP8_MAX: tl.constexpr, MAX_POW2: tl.constexpr):
    """A block's e8m0 scale byte (int32, 0..255) and the fp32 factor its elements
    are multiplied by, from its fp32 ``amax`` (NaN where the block holds a NaN).
    MODE 0 is FLOOR, 1 is RCEIL (see the module docstring)."""
    is_nan = amax != amax
    if MODE == 0:
        bits = amax.to(tl.int32, bitcast=True)
        unbiased = ((bits >> 23) & 0xFF) - 127 - MAX_POW2
        biased = tl.minimum(tl.maximum(unbiased, -127), 128) + 127
        biased = tl.where(is_nan, 255, biased)
        # 1 / scale: a scale below 2^-126 is applied as 2^-126; 255 (inf) as x / inf
        rcp_bits = tl.where(biased == 0, 253 << 23, tl.where(biased == 255, 0, _pow2_bits(biased)))
        rcp = rcp_bits.to(tl.float32, bitcast=True)
    else:
        descale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
        bits = descale.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        ceil = field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        # zero or subnormal: ceil(log2) is -126 above 2^-127 (0x00400000), else at most -127
        ceil = tl.where(field == 0, tl.where(bits > 0x00400000, -126, -127), ceil)
        biased = tl.minimum(tl.maximum(ceil, -127), 127) + 127
        biased = tl.where(is_nan, 255, tl.where(descale == float("inf"), 254, biased))
        rcp = tl.where(biased == 0, 1.0, _pow2_bits(biased).to(tl.float32, bitcast=True))
        rcp = tl.where(is_nan, descale, rcp)
    return biased, rcp


@triton.jit
def mx_cast_bits(x, rcp, FP8_MAX: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 ``x * rcp`` saturated to ±FP8_MAX and rounded to ``DTYPE``, as uint8 bits;
    NaN stays NaN (0x7F with the product's sign bit), as torch's clamp and cast keep it
    (a NaN's sign is not specified: CPUs and GPUs make different default NaNs)."""
    y = x * rcp
    data = to_fp8_saturated(y, 1.0, FP8_MAX, DTYPE).to(tl.uint8, bitcast=True)
    sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return tl.where(y != y, sign | FP8_NAN_BITS, data)


@triton.jit
def _block_amax(x, has_nan, AXIS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, BLOCK: tl.constexpr):
    """max |x| over each BLOCK along AXIS (1: columns, (TR, TC // BLOCK); 0: rows,
    (TR // BLOCK, TC)), NaN where the block holds one (tracked apart: a compiled
    max drops NaNs)."""
    if AXIS == 1:
        amax = tl.max(tl.reshape(tl.abs(x), (TR, TC // BLOCK, BLOCK)), axis=2)
        nan = tl.max(tl.reshape(has_nan, (TR, TC // BLOCK, BLOCK)), axis=2)
    else:
        amax = tl.max(tl.reshape(tl.abs(x), (TR // BLOCK, BLOCK, TC)), axis=1)
        nan = tl.max(tl.reshape(has_nan, (TR // BLOCK, BLOCK, TC)), axis=1)
    return tl.where(nan > 0, float("nan"), amax)


@triton.jit
def _expand(v, AXIS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, BLOCK: tl.constexpr):
    """A per-block value of :func:`_block_amax`'s shape repeated over its block: (TR, TC)."""
    if AXIS == 1:
        return tl.reshape(tl.broadcast_to(v[:, :, None], (TR, TC // BLOCK, BLOCK)), (TR, TC))
    else:
        return tl.reshape(tl.broadcast_to(v[:, None, :], (TR // BLOCK, BLOCK, TC)), (TR, TC))


@triton.jit
def _to_mx_kernel(
    x_ptr,  # (batch, R, C) fp32/fp16/bf16, strides (sxb, sxr, sxc)
    data_ptr,  # (batch, R, C) uint8 (the fp8 bits), strides (sdb, sdr, sdc): blocks along C
    scale_ptr,  # (batch, R, C // BLOCK) uint8 (e8m0), strides (ssb, ssr, ssc)
    data_r_ptr,  # (batch, R, C) uint8, strides (sdb2, sdr2, sdc2): blocks along R; unused unless ALONG_R
    scale_r_ptr,  # (batch, R // BLOCK, C) uint8, strides (ssb2, ssr2, ssc2); unused unless ALONG_R
    partial_sum_ptr,  # (batch, cdiv(R, TR), C) fp32, contiguous: tiles' column sums; unused unless COL_SUM
    R,
    C,
    sxb, sxr, sxc, sdb, sdr, sdc, ssb, ssr, ssc,
    sdb2, sdr2, sdc2, ssb2, ssr2, ssc2,
    MODE: tl.constexpr,  # 0 FLOOR, 1 RCEIL
    FP8_MAX: tl.constexpr,
    MAX_POW2: tl.constexpr,
    DTYPE: tl.constexpr,  # tl.float8e4nv or tl.float8e5
    BLOCK: tl.constexpr,  # elements per scale (32)
    TR: tl.constexpr,  # tile rows (a multiple of BLOCK when ALONG_R)
    TC: tl.constexpr,  # tile columns, a multiple of BLOCK
    ALONG_R: tl.constexpr,  # also the cast with blocks along R (the one-pass pair)
    COL_SUM: tl.constexpr = False,  # also the tile's column sums in fp32 (a bias gradient's share)
):  # fmt: skip
    """One (TR, TC) tile of one batch entry: each BLOCK of columns' amax, its scale
    and cast, stored; with ALONG_R also each BLOCK of rows'; with COL_SUM the tile's
    column sums, its band of rows' share of x.sum(-2). C (and R with ALONG_R) is a
    multiple of BLOCK, so a block is either wholly inside or wholly past the edge."""
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * TR + tl.arange(0, TR)
    cols = tl.program_id(1) * TC + tl.arange(0, TC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + batch * sxb + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0)
    x = to_f32(x)  # exact (bf16 subnormals too)
    has_nan = (x != x).to(tl.int32)
    biased, rcp = mx_scale(_block_amax(x, has_nan, 1, TR, TC, BLOCK), MODE, FP8_MAX, MAX_POW2)
    bcols = tl.program_id(1) * (TC // BLOCK) + tl.arange(0, TC // BLOCK)
    smask = (rows < R)[:, None] & (bcols < C // BLOCK)[None, :]
    tl.store(
        scale_ptr + batch * ssb + rows[:, None] * ssr + bcols[None, :] * ssc, biased.to(tl.uint8), mask=smask
    )
    data = mx_cast_bits(x, _expand(rcp, 1, TR, TC, BLOCK), FP8_MAX, DTYPE)
    tl.store(data_ptr + batch * sdb + rows[:, None] * sdr + cols[None, :] * sdc, data, mask=mask)
    if ALONG_R:
        biased_r, rcp_r = mx_scale(_block_amax(x, has_nan, 0, TR, TC, BLOCK), MODE, FP8_MAX, MAX_POW2)
        brows = tl.program_id(0) * (TR // BLOCK) + tl.arange(0, TR // BLOCK)
        smask_r = (brows < R // BLOCK)[:, None] & (cols < C)[None, :]
        s_ptrs = scale_r_ptr + batch * ssb2 + brows[:, None] * ssr2 + cols[None, :] * ssc2
        tl.store(s_ptrs, biased_r.to(tl.uint8), mask=smask_r)
        data_r = mx_cast_bits(x, _expand(rcp_r, 0, TR, TC, BLOCK), FP8_MAX, DTYPE)
        tl.store(data_r_ptr + batch * sdb2 + rows[:, None] * sdr2 + cols[None, :] * sdc2, data_r, mask=mask)
    if COL_SUM:  # masked rows loaded as 0.0
        band = batch * tl.num_programs(0) + tl.program_id(0)
        tl.store(partial_sum_ptr + band * C + cols, tl.sum(x, axis=0), mask=cols < C)


# --------------------------------------------------------------------------- host side


def _check_args(x: object, dtype: torch.dtype, block_size: object, scale_mode: object) -> None:
    check_tensor("x", x, dtypes=HIGH_DTYPES)
    check_fp8_dtype(dtype, dtypes=FP8_DTYPES)
    if block_size != BLOCK_SIZE or isinstance(block_size, bool):
        raise ValueError(f"block_size must be {BLOCK_SIZE} (the MX block), got {block_size!r}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


def _check_axis(x: torch.Tensor, axis: object, block_size: int) -> int:
    """``axis`` of a 2-D or 3-D ``x`` as a non-negative int; its extent a multiple of the block."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D or 3-D, got shape {tuple(x.shape)}")
    if not isinstance(axis, int) or isinstance(axis, bool) or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be an int in [{-x.dim()}, {x.dim() - 1}] for x of shape "
                         f"{tuple(x.shape)}, got {axis!r}")  # fmt: skip
    axis %= x.dim()
    if x.shape[axis] % block_size:
        raise ValueError(
            f"x's axis {axis} has size {x.shape[axis]}, not a multiple of block_size {block_size} "
            f"(x of shape {tuple(x.shape)})"
        )
    return axis


def _as_brc(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` (2-D or 3-D) as a (batch, R, C) view with ``axis`` as C (no copy)."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
        axis += 1
    others = [d for d in range(3) if d != axis]
    return t.permute(*others, axis)


def _launch(x3, d3, s3, mode, dtype, along_r=None, partial_sums=None) -> None:
    """:func:`_to_mx_kernel` on (batch, R, C) views; ``along_r`` = (data, scales) views of the
    second cast (blocks along R), or None; ``partial_sums`` a contiguous (batch,
    :func:`row_bands` (R), C) fp32 tensor for each tile's column sums, or None."""
    batch, R, C = x3.shape
    if x3.numel() == 0:
        return
    d2, s2 = along_r if along_r is not None else (d3, s3)
    grid = (cdiv(R, TILE_R), cdiv(C, TILE_C), batch)
    _to_mx_kernel[grid](
        x3, d3, s3, d2, s2, s3 if partial_sums is None else partial_sums, R, C,
        *x3.stride(), *d3.stride(), *s3.stride(), *d2.stride(), *s2.stride(),
        MODE=_MODE_CODE[mode], FP8_MAX=FP8_MAX[dtype], MAX_POW2=MAX_POW2[dtype], DTYPE=_TL_FP8[dtype],
        BLOCK=BLOCK_SIZE, TR=TILE_R, TC=TILE_C, ALONG_R=along_r is not None, COL_SUM=partial_sums is not None,
    )  # fmt: skip


def row_bands(rows: int) -> int:
    """How many bands of rows :func:`_to_mx_kernel` sums columns in: one per row tile."""
    return cdiv(rows, TILE_R)


def check_to_mx_args(
    x: object, dtype: torch.dtype, block_size: object, axis: object, scale_mode: object
) -> int:
    """Raise unless :func:`to_mx` can cast ``x`` with these arguments; ``axis`` as a
    non-negative int."""
    _check_args(x, dtype, block_size, scale_mode)
    axis = _check_axis(x, axis, block_size)
    check_int32_addressable("x", x)
    return axis


def check_to_mx_both_args(
    x: object, dtype: torch.dtype, scale_mode: object, sum_dtype: object = None
) -> None:
    """Raise unless :func:`to_mx_both` can cast ``x``: 2-D, both extents multiples of 32;
    and :func:`to_mx_both_sum` sum it in ``sum_dtype`` where given."""
    _check_args(x, dtype, BLOCK_SIZE, scale_mode)
    if sum_dtype is not None and sum_dtype not in HIGH_DTYPES:
        raise ValueError(f"sum_dtype must be float32, float16 or bfloat16, got {sum_dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    for axis in (0, 1):
        _check_axis(x, axis, BLOCK_SIZE)
    check_int32_addressable("x", x)


def _bytes(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An empty contiguous uint8 tensor of ``shape`` on ``like``'s device (fp8 / e8m0 bits)."""
    return torch.empty(shape, dtype=torch.uint8, device=like.device)


def to_mx(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block_size: int = BLOCK_SIZE,
    axis: int = -1,
    scale_mode: str = "floor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to an MX format: one e8m0 scale per ``block_size`` elements along ``axis``.

    Bit for bit torchao's ``to_mx(x, dtype, block_size, scaling_mode)`` along the last
    axis (and that of ``x.movedim(axis, -1)`` along another), returned in torch's order
    ``(data, scales)`` (torchao returns ``(scales, data)``); ``x ≈ data * 2^(scales - 127)``
    block by block.

    Args:
        x: 2-D or 3-D fp32, bf16 or fp16, any strides; ``x.shape[axis]`` a multiple of
            ``block_size``.
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        block_size: 32 (the MX block).
        axis: the axis the blocks run along (default the last).
        scale_mode: ``"floor"`` (torchao's default, OCP's rule) or ``"rceil"`` (cuBLAS's).

    Returns:
        ``data``: contiguous, x's shape, ``dtype``. ``scales``: contiguous
        ``torch.float8_e8m0fnu``, x's shape with ``axis`` divided by ``block_size``.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    axis = check_to_mx_args(x, dtype, block_size, axis, scale_mode)
    data = _bytes(tuple(x.shape), x)
    scale_shape = list(x.shape)
    scale_shape[axis] //= block_size
    scales = _bytes(tuple(scale_shape), x)
    _launch(_as_brc(x, axis), _as_brc(data, axis), _as_brc(scales, axis), scale_mode, dtype)
    return data.view(dtype), scales.view(torch.float8_e8m0fnu)


def _pair(x: torch.Tensor, dtype: torch.dtype, scale_mode: str, sum_dtype: torch.dtype | None, out=None):
    """:func:`to_mx_both`'s four outputs (written into ``out``'s where given) and, with
    ``sum_dtype``, x.sum(0) (else None)."""
    M, K = x.shape
    if out is None:
        data, scales = _bytes((M, K), x), _bytes((M, K // BLOCK_SIZE), x)
        data_t, scales_t = _bytes((K, M), x), _bytes((K, M // BLOCK_SIZE), x)
    else:
        data, scales, data_t, scales_t = (t.view(torch.uint8) for t in out)
    partial = None
    if sum_dtype is not None:
        partial = torch.empty((1, row_bands(M), K), dtype=torch.float32, device=x.device)
    _launch(
        x.unsqueeze(0), data.unsqueeze(0), scales.unsqueeze(0), scale_mode, dtype,
        (data_t.t().unsqueeze(0), scales_t.t().unsqueeze(0)), partial,
    )  # fmt: skip
    e8m0 = torch.float8_e8m0fnu
    col_sum = None
    if partial is not None:  # the bands in order, in fp32, rounded once; zeros when M == 0
        col_sum = partial[0].sum(0).to(sum_dtype)
    if out is not None:
        return (*out, col_sum)
    return data.view(dtype), scales.view(e8m0), data_t.view(dtype), scales_t.view(e8m0), col_sum


def check_mx_pair(what: str, tensors: object, shape: tuple[int, int], dtype: torch.dtype, device) -> None:
    """Raise ``ValueError`` unless ``tensors`` are (data, scales, data_t, scales_t) as
    :func:`to_mx_both` makes them for an input of ``shape`` (M, K): contiguous, (M, K)
    ``dtype``, (M, K/32) e8m0, (K, M) ``dtype``, (K, M/32) e8m0, on ``device``; ``what``
    names them in the message."""
    M, K = shape
    e8m0 = torch.float8_e8m0fnu
    want = {"data": ((M, K), dtype), "scales": ((M, K // BLOCK_SIZE), e8m0),
            "data_t": ((K, M), dtype), "scales_t": ((K, M // BLOCK_SIZE), e8m0)}  # fmt: skip
    if not isinstance(tensors, (tuple, list)) or len(tensors) != 4:
        raise ValueError(f"{what} must be (data, scales, data_t, scales_t), got {type(tensors).__name__}")
    for (name, (want_shape, dt)), t in zip(want.items(), tensors, strict=True):
        ok = isinstance(t, torch.Tensor) and tuple(t.shape) == want_shape and t.dtype == dt
        if not (ok and t.is_contiguous() and t.device == device):
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(
                f"{what}'s {name} must be a contiguous {want_shape} {dt} tensor on {device}, got {got}"
            )


def to_mx_both(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: str = "floor",
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both MX casts of a 2-D ``x`` (M, K) from one read of it: ``(data, scales, data_t,
    scales_t)`` with ``data, scales = to_mx(x, axis=1)`` (blocks along K: (M, K) and
    (M, K / 32)) and ``data_t, scales_t = to_mx(x.t(), axis=1)`` (blocks along M, stored
    as x^T: (K, M) and (K, M / 32), each contiguous: the K-major operand of a GEMM that
    reduces over M, as the wgrad reduces over tokens). M and K multiples of 32. ``out``:
    those four tensors already allocated (contiguous, those shapes, ``dtype`` and e8m0),
    written in place and returned (a weight cache's buffers, kept step after step)."""
    check_to_mx_both_args(x, dtype, scale_mode)
    if out is not None:
        check_mx_pair("out", out, tuple(x.shape), dtype, x.device)
    return _pair(x, dtype, scale_mode, None, out)[:4]


def to_mx_both_sum(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: str = "floor",
    sum_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`to_mx_both` and ``x.sum(0)`` from the same read: ``(data, scales, data_t,
    scales_t, col_sum)``, ``col_sum`` (K,) of ``sum_dtype`` (fp32, fp16 or bf16) summed in
    fp32 (each row tile's column sums in the kernel, the bands added in order after it)
    and rounded once: the MX backward's dY, whose column sums are the bias gradient."""
    check_to_mx_both_args(x, dtype, scale_mode, sum_dtype)
    return _pair(x, dtype, scale_mode, sum_dtype)


__all__ = [
    "BLOCK_SIZE",
    "FP8_DTYPES",
    "SCALE_MODES",
    "check_mx_pair",
    "check_to_mx_args",
    "check_to_mx_both_args",
    "to_mx",
    "to_mx_both",
    "to_mx_both_sum",
]
