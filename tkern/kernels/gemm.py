"""GEMM with FP32 accumulation and a fused epilogue.

``C = act(A @ B + bias)`` for fp16 or bf16 ``A`` (M, K) and ``B`` (K, N) of any
strides. Products are accumulated in an FP32 tile; the epilogue (bias,
activation, one cast) runs on that FP32 tile, so the only rounding to half
precision is the final store.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    AUTOTUNE,
    HALF_DTYPES,
    INTERPRET,
    autotune,
    cast_rne,
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
    tl_dtype,
)

#: Activations the epilogue can apply; the integer is the kernel's constexpr code.
ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}
_RELU: tl.constexpr = tl.constexpr(1)
_GELU: tl.constexpr = tl.constexpr(2)
_INV_SQRT2: tl.constexpr = tl.constexpr(0.7071067811865476)

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: How an operand's fp8 scale is laid out (the kernel's constexpr SCALE_A/SCALE_B):
#: none (fp16/bf16 operands), one element for the whole tensor, one per row of a
#: (M, 1) / per column of b (1, N), or one per block of the operand.
SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR, SCALE_BLOCK = 0, 1, 2, 3
_SCALE_TENSOR: tl.constexpr = tl.constexpr(SCALE_TENSOR)
_SCALE_VECTOR: tl.constexpr = tl.constexpr(SCALE_VECTOR)
_SCALE_BLOCK: tl.constexpr = tl.constexpr(SCALE_BLOCK)


def epi_split(block_m: int, block_n: int, num_warps: int) -> int:
    """Column slices of a GELU epilogue: one per 32 accumulator values a thread
    holds, at most 4 (128x256 on 8 warps: 128 values, 4 slices of 32)."""
    return max(1, min(4, block_m * block_n // (32 * num_warps) // 32))


def gemm_configs() -> list[triton.Config]:
    """Tile configurations the autotuner chooses from, the one place they live.

    The first entry is the only one used under the interpreter, where big tiles
    matter most (each program costs milliseconds on the CPU, the tile size
    almost nothing). The rest are the tile shapes of Triton's matmul tutorial
    for fp16 on Ampere/Hopper plus 64-deep K tiles, which let Hopper's wgmma
    issue fewer, larger instructions; GROUP_M = 8 programs share a band of A
    rows so that band stays in L2.
    """

    def cfg(bm, bn, bk, stages, warps):
        meta = {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP_M": 8,
            "EPI_SPLIT": epi_split(bm, bn, warps),
        }
        return triton.Config(meta, num_stages=stages, num_warps=warps)

    return [
        cfg(128, 128, 64, 3, 8) if not INTERPRET else cfg(128, 128, 128, 1, 4),
        cfg(128, 256, 64, 3, 8),
        cfg(256, 128, 64, 3, 8),
        cfg(128, 256, 64, 4, 8),
        cfg(128, 128, 64, 4, 4),
        cfg(128, 128, 32, 4, 4),
        cfg(128, 64, 32, 4, 4),
        cfg(64, 128, 32, 4, 4),
        cfg(64, 64, 64, 4, 4),
        # 4 warps (one warpgroup): with 2 it could not use Hopper's wgmma
        cfg(64, 32, 32, 5, 4),
    ]


#: Largest shared memory one program may use, by compute capability (H100/H200
#: and B200: 227 KB; A100 and Orin: 163 KB; sm_86/89/120: 99 KB).
SMEM_LIMIT = {90: 232448, 100: 232448, 103: 232448, 80: 166912, 87: 166912}
_SMEM_DEFAULT = 101376


def smem_limit(cc: int) -> int:
    """:data:`SMEM_LIMIT` for compute capability ``cc`` (e.g. 90)."""
    return SMEM_LIMIT.get(cc, _SMEM_DEFAULT)


def smem_estimate(cfg: triton.Config, elem_bytes: int = 2) -> int:
    """Shared memory of a config's load pipeline: ``num_stages`` A and B tiles.
    The compiled kernel adds ~1 KB (pointer kernel) to ~34 KB (the TMA
    kernel's epilogue staging); tests/test_compiled.py checks every offered
    config's compiled size against the limit on sm_90 and sm_80."""
    kw = cfg.kwargs
    return cfg.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * elem_bytes


#: Largest output tile the pointer kernel is offered on ragged operands: without
#: 16-byte alignment it loads with scalar instructions and no cp.async, and the
#: 128x128 and larger tiles then spill (56 B to 4.3 KB on sm_80); 128x64,
#: 64x128, 64x64 and 64x32 do not (see benchmarks/results/static/).
RAGGED_MAX_TILE = 128 * 64


#: Accumulator values per thread above which the pointer kernel spills before
#: Hopper (mma.sync keeps its operand fragments in registers next to the
#: accumulator): 128x256 and 256x128 on 8 warps spill 40 B on sm_80 under
#: triton 3.6 with any epilogue, 16-40 B with GELU even in four column slices.
PRE_HOPPER_MAX_ACC = 64


def _acc_per_thread(c: triton.Config) -> int:
    return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps)


def prune_configs(
    configs: list[triton.Config], cc: int, *, tma: bool = False, ragged: bool = False
) -> list[triton.Config]:
    """The configs worth trying on compute capability ``cc`` (e.g. 90): those
    whose shared memory fits; on ``ragged`` operands (see :func:`_ragged`) only
    the tiles that do not spill there; before Hopper only the tiles whose
    accumulator leaves room for mma.sync's operands. Never empty: the smallest
    is kept."""
    limit = smem_limit(cc)
    fits = [c for c in configs if smem_estimate(c) <= limit]
    if ragged and not tma:
        fits = [c for c in fits if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= RAGGED_MAX_TILE]
    if cc < 90:
        fits = [c for c in fits if _acc_per_thread(c) <= PRE_HOPPER_MAX_ACC]
    return fits or [min(configs, key=smem_estimate)]


def _ragged_args(nargs: dict) -> bool:
    """:func:`_ragged` from the pointer kernel's arguments."""
    names = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn")
    return any(nargs[k] % 16 for k in names if nargs[k] != 1)


def _device_cc(nargs: dict) -> int:
    t = next(v for v in nargs.values() if isinstance(v, torch.Tensor))
    major, minor = torch.cuda.get_device_capability(t.device)
    return 10 * major + minor


def _autotune(configs: list[triton.Config], key: list[str], tma: bool = False):
    """:func:`autotune`, and on a GPU the configs are pruned to those whose
    shared memory fits the device (an autotuner never benchmarks, nor compiles,
    a config that cannot launch)."""
    if INTERPRET or not AUTOTUNE:
        return autotune(configs, key)

    def prune(configs, nargs, **kwargs):
        ragged = not tma and _ragged_args(nargs)
        return prune_configs(configs, _device_cc(nargs), tma=tma, ragged=ragged)

    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune})


@triton.jit
def _tile_coords(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
def _epilogue_part(
    acc,  # (BLOCK_M, WIDTH) fp32: columns col0 .. col0 + WIDTH of the tile
    rows,
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
):
    """Bias, optional pre-activation store, activation and one masked cast-and-store
    on WIDTH columns of the fp32 tile."""
    cols = col0 + tl.arange(0, WIDTH)
    mask_n = cols < N
    mask_c = (rows < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if STORE_PREACT:
        preact_ptrs = preact_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(preact_ptrs, cast_rne(acc, PREACT_DTYPE), mask=mask_c)
    if ACTIVATION == _RELU:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == _GELU:
        acc = 0.5 * acc * (1.0 + tl.erf(acc * _INV_SQRT2))
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, cast_rne(acc, OUT_DTYPE), mask=mask_c)


@triton.jit
def _epilogue(
    acc,  # (BLOCK_M, BLOCK_N) fp32 accumulator of tile (pid_m, pid_n)
    pid_m,
    pid_n,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
):
    """bias, activation and one cast, on the fp32 accumulator; masked stores.

    With GELU the epilogue runs on ``EPI_SPLIT`` (1, 2 or 4) column slices of
    the tile one after the other: erf's temporaries next to a whole 128x256
    (or 4-warp 128x128) accumulator spilled registers; on a slice they fit."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = pid_n * BLOCK_N
    if ACTIVATION != _GELU or EPI_SPLIT == 1:
        _epilogue_part(
            acc, rows, col0, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_N,
        )  # fmt: skip
    else:
        left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
        _epilogue_halves(
            left, rows, col0, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE,
            BLOCK_M, BLOCK_N // 2, EPI_SPLIT // 2,
        )  # fmt: skip
        _epilogue_halves(
            right, rows, col0 + BLOCK_N // 2, M, N, c_ptr, bias_ptr, preact_ptr,
            stride_cm, stride_cn, stride_bias, HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE,
            BLOCK_M, BLOCK_N // 2, EPI_SPLIT // 2,
        )  # fmt: skip


@triton.jit
def _column_halves(acc, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """The left and right column halves of a (BLOCK_M, WIDTH) tile."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _epilogue_halves(
    acc, rows, col0, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """:func:`_epilogue_part` on ``acc`` whole (PARTS == 1) or on its two column halves (PARTS == 2)."""
    if PARTS == 1:
        _epilogue_part(
            acc, rows, col0, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, WIDTH,
        )  # fmt: skip
    else:
        left, right = _column_halves(acc, BLOCK_M, WIDTH)
        _epilogue_part(
            left, rows, col0, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, WIDTH // 2,
        )  # fmt: skip
        _epilogue_part(
            right, rows, col0 + WIDTH // 2, M, N, c_ptr, bias_ptr, preact_ptr,
            stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, WIDTH // 2,
        )  # fmt: skip


@triton.jit
def _operand_scale(
    scale_ptr, offs, mask, k0, stride_s_outer, stride_s_k, block_outer, block_k, SCALE: tl.constexpr
):
    """The fp32 scale of each row of a (or column of b) at K offset ``k0``:
    (BLOCK,) values. SCALE_TENSOR: one element; SCALE_VECTOR: one per row
    (column); SCALE_BLOCK: the block holding (row, k0), i.e. element
    (row // block_outer, k0 // block_k) of the scale grid."""
    if SCALE == _SCALE_TENSOR:
        return tl.load(scale_ptr + offs * 0, mask=mask, other=0.0)
    elif SCALE == _SCALE_VECTOR:
        return tl.load(scale_ptr + offs * stride_s_outer, mask=mask, other=0.0)
    else:
        return tl.load(
            scale_ptr + (offs // block_outer) * stride_s_outer + (k0 // block_k) * stride_s_k,
            mask=mask,
            other=0.0,
        )


@_autotune(configs=gemm_configs(), key=["M", "N", "K", "OUT_DTYPE", "ACTIVATION", "SCALE_A", "SCALE_B"])
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _matmul_kernel(
    # pointers
    a_ptr,  # (M, K) fp16/bf16
    b_ptr,  # (K, N) same dtype as a
    c_ptr,  # (M, N) OUT_DTYPE
    bias_ptr,  # (N,) a's dtype or fp32; unused unless HAS_BIAS
    preact_ptr,  # (M, N) a's dtype: A @ B + bias before the activation; unused unless STORE_PREACT
    # dimensions
    M,
    N,
    K,
    # strides, in elements
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_bias,  # bias's stride: 1, 0 for an expanded bias, or any other
    # fp8 operand scales (scaled_mm); unused when SCALE_A == SCALE_B == SCALE_NONE
    scale_a_ptr,  # fp32: (1,), (M, 1), or (ceil(M / block_am), ceil(K / block_ak)) blocks
    scale_b_ptr,  # fp32: (1,), (1, N), or (ceil(K / block_bk), ceil(N / block_bn)) blocks
    stride_sam,
    stride_sak,
    stride_sbk,
    stride_sbn,
    block_am,
    block_ak,
    block_bk,
    block_bn,
    # meta-parameters; constexpr so the untaken branches are compiled out
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 relu, 2 gelu (erf form)
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (the interpreter cannot multiply bf16)
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no mask on the K loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,  # column slices of the GELU epilogue (see _epilogue)
    SCALE_A: tl.constexpr = 0,  # SCALE_NONE / _TENSOR / _VECTOR (per row) / _BLOCK
    SCALE_B: tl.constexpr = 0,  # SCALE_NONE / _TENSOR / _VECTOR (per column) / _BLOCK
):
    """C = act(A @ B + bias) for one (BLOCK_M, BLOCK_N) output tile per program, fp32
    accumulation; fp8 operands with their scales (scaled_mm) on the accumulator:
    per tensor/row/column after the K loop, per block inside it. Shapes above."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    # Accumulate in fp32: fp16 products are exact in fp32, and the running sum
    # keeps 24 bits where an fp16 sum would keep 11 (4096 ones sum to 2048 in fp16).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SCALE_A == _SCALE_BLOCK or SCALE_B == _SCALE_BLOCK:
            # Block scales change along K: each K tile (inside one K block: the
            # launcher checks BLOCK_K divides it) is summed on its own and promoted
            # into the fp32 accumulator times its scales, as DeepSeek-V3 does
            # every 128 of K (Hopper's fp8 tensor cores keep fewer accumulator bits).
            part = tl.dot(a, b)
            if SCALE_A == _SCALE_BLOCK:
                sa = _operand_scale(
                    scale_a_ptr,
                    offs_m,
                    mask_m,
                    k * BLOCK_K,
                    stride_sam,
                    stride_sak,
                    block_am,
                    block_ak,
                    SCALE_A,
                )
                part = part * sa[:, None]
            if SCALE_B == _SCALE_BLOCK:
                sb = _operand_scale(
                    scale_b_ptr,
                    offs_n,
                    mask_n,
                    k * BLOCK_K,
                    stride_sbn,
                    stride_sbk,
                    block_bn,
                    block_bk,
                    SCALE_B,
                )
                part = part * sb[None, :]
            acc += part
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Scales constant along K multiply the fp32 accumulator once, before the bias.
    if SCALE_A == _SCALE_TENSOR or SCALE_A == _SCALE_VECTOR:  # noqa: SIM109 (jit: no `in`)
        sa = _operand_scale(scale_a_ptr, offs_m, mask_m, 0, stride_sam, 0, 1, 1, SCALE_A)
        acc = acc * sa[:, None]
    if SCALE_B == _SCALE_TENSOR or SCALE_B == _SCALE_VECTOR:  # noqa: SIM109 (jit: no `in`)
        sb = _operand_scale(scale_b_ptr, offs_n, mask_n, 0, stride_sbn, 0, 1, 1, SCALE_B)
        acc = acc * sb[None, :]
    _epilogue(
        acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
        HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_M, BLOCK_N, EPI_SPLIT,
    )  # fmt: skip


def check_activation(activation: str | None) -> None:
    """Raise ``ValueError`` unless ``activation`` is one the epilogue knows."""
    if activation not in ACTIVATIONS:
        known = ", ".join(repr(a) for a in ACTIVATIONS)
        raise ValueError(f"activation must be one of {known}, got {activation!r}")


def check_bias(bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> None:
    """Raise unless ``bias`` is None or an (n,) tensor of ``dtype`` or fp32."""
    if bias is None:
        return
    check_tensor("bias", bias, ndim=1, dtypes=(dtype, torch.float32))
    if bias.shape[0] != n:
        raise ValueError(f"bias must have shape ({n},), got shape {tuple(bias.shape)}")


def _check_matmul_args(a, b, bias, activation, out_dtype, preact) -> tuple[int, int, int, torch.dtype]:
    """Validate :func:`matmul`'s arguments (see there); return M, N, K and the output dtype."""
    check_tensor("a", a, ndim=2, dtypes=HALF_DTYPES)
    check_tensor("b", b, ndim=2, dtypes=HALF_DTYPES)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    (M, K), (Kb, N) = a.shape, b.shape
    if Kb != K:
        raise ValueError(
            f"inner dimensions differ: a has shape {tuple(a.shape)} (M, K) and "
            f"b has shape {tuple(b.shape)} (K, N); expected b.shape[0] == {K}"
        )
    check_bias(bias, N, a.dtype)
    check_activation(activation)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if preact is not None:
        check_tensor("preact", preact, ndim=2, dtypes=(a.dtype,))
        if preact.shape != (M, N) or not preact.is_contiguous():
            raise ValueError(
                f"preact must be a contiguous ({M}, {N}) tensor, got shape {tuple(preact.shape)}"
            )
    check_same_device(a=a, b=b, bias=bias, preact=preact)
    # int32 tile offsets keep the inner loop lean; refuse what they cannot reach
    check_int32_addressable("a", a)
    check_int32_addressable("b", b)
    check_int32_elements("out", (M, N))

    return M, N, K, out_dtype


def _bias_stride(bias: torch.Tensor | None) -> int:
    """The bias's element stride as the epilogue reads it: a strided view or an
    expanded (stride-0) bias is read in place; 1 (contiguous) is the common case,
    which Triton specialises to a vectorised load."""
    return 1 if bias is None else bias.stride(0)


def _epilogue_meta(dtype, bias, activation, out_dtype, preact) -> dict:
    """The constexpr arguments both GEMM kernels take for their epilogue and operands."""
    return {
        "HAS_BIAS": bias is not None,
        "ACTIVATION": ACTIVATIONS[activation],
        "STORE_PREACT": preact is not None,
        "OUT_DTYPE": tl_dtype(out_dtype),
        # fp8 operands have no pre-activation output (scaled_mm): the field is unused
        "PREACT_DTYPE": tl_dtype(dtype if dtype in HALF_DTYPES else out_dtype),
        # the interpreter cannot multiply bf16, and fp8 products are exact in fp32 too
        "UPCAST": INTERPRET and dtype != torch.float16,
    }


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    preact: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(a @ b + bias)`` with fp32 accumulation, cast once to ``out_dtype``.

    Args:
        a: (M, K), fp16 or bf16, any strides (a transposed view is read in place).
        b: (K, N), same dtype as ``a``, any strides.
        bias: optional (N,), ``a``'s dtype or fp32, added to the fp32 accumulator.
        activation: None, ``"relu"`` or ``"gelu"`` (exact, erf form), applied in fp32.
        out_dtype: dtype of the result: fp16, bf16 or fp32; default ``a.dtype``.
        preact: optional (M, N) contiguous tensor of ``a``'s dtype that receives
            ``a @ b + bias`` before the activation (what its gradient needs).

    Returns:
        A new contiguous (M, N) tensor. K == 0 gives ``act(bias)`` (zeros without bias).

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    _, _, _, out_dtype = _check_matmul_args(a, b, bias, activation, out_dtype, preact)
    return matmul_prechecked(a, b, bias, activation, out_dtype, preact)


def matmul_prechecked(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    out_dtype: torch.dtype,
    preact: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`matmul` for a caller that has validated the arguments itself
    (:func:`tkern.linear` checks its inputs once; its backward feeds the GEMM
    tensors it made): the hot path, with no checks repeated per call."""
    (M, K), N = a.shape, b.shape[1]
    if _has_tma(a.device) and _ragged(a, b) and _tma_layouts(a, b) is not None:
        # The pointer kernel cannot prove 16-byte alignment here: every load is
        # a 16-bit scalar, without cp.async (255 registers and spills, see the
        # static report); descriptors zero-fill the edges and keep wgmma fed.
        return _launch_tma(a, b, M, N, K, bias, activation, out_dtype, preact, _tma_layouts(a, b))
    return _launch_matmul(a, b, M, N, K, bias, activation, out_dtype, preact)


def _ragged(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the pointer kernel loses its vector loads on ``a`` @ ``b``: a
    dimension or a non-unit stride that is not a multiple of 16 elements."""
    dims = (*a.shape, b.shape[1], *(s for s in (*a.stride(), *b.stride()) if s != 1))
    return any(d % 16 for d in dims)


def _has_tma(device: torch.device) -> bool:
    """Whether ``device`` has the tensor memory accelerator (Hopper, sm_90, or newer)."""
    return not INTERPRET and _major_cc(device) >= 9


@functools.cache
def _major_cc(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


class OperandScales(NamedTuple):
    """The fp8 scales of :func:`tkern.kernels.gemm.scaled_mm`'s operands, as the
    kernel reads them: a kind (``SCALE_*``) per operand, the scale tensors, and
    for block scales the block shape (in elements) of each operand."""

    kind_a: int = SCALE_NONE
    kind_b: int = SCALE_NONE
    scale_a: torch.Tensor | None = None
    scale_b: torch.Tensor | None = None
    block_a: tuple[int, int] = (1, 1)  # (rows of a, K) per scale
    block_b: tuple[int, int] = (1, 1)  # (K, columns of b) per scale

    def args(self, dummy: torch.Tensor) -> tuple:
        """The kernel's scale arguments, from ``scale_a_ptr`` to ``block_bn``."""
        sa = self.scale_a if self.scale_a is not None else dummy
        sb = self.scale_b if self.scale_b is not None else dummy
        sam, sak = (sa.stride(0), sa.stride(1)) if sa.dim() == 2 else (0, 0)
        sbk, sbn = (sb.stride(0), sb.stride(1)) if sb.dim() == 2 else (0, 0)
        return (sa, sb, sam, sak, sbk, sbn, *self.block_a, *self.block_b)


NO_SCALES = OperandScales()


def _launch_matmul(
    a, b, M, N, K, bias, activation, out_dtype, preact, scales: OperandScales = NO_SCALES
) -> torch.Tensor:
    """:func:`matmul` (and :func:`scaled_mm`) after its arguments were checked."""
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](
        a, b, c, bias if bias is not None else c, preact if preact is not None else c,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), _bias_stride(bias),
        *scales.args(c),
        **_epilogue_meta(a.dtype, bias, activation, out_dtype, preact),
        SCALE_A=scales.kind_a,
        SCALE_B=scales.kind_b,
    )  # fmt: skip
    return c


# --------------------------------------------------------------------------- persistent, TMA


def tma_configs() -> list[triton.Config]:
    """Tiles for the persistent tensor-descriptor kernel (Triton's persistent
    matmul tutorial's search space for Hopper, 128-row tiles); the pre-hook
    gives the descriptors each config's block shape."""

    def cfg(bm, bn, bk, stages, warps):
        meta = {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP_M": 8,
            "EPI_SPLIT": epi_split(bm, bn, warps),
        }
        return triton.Config(meta, num_stages=stages, num_warps=warps, pre_hook=_set_block_shapes)

    return [cfg(128, bn, bk, stages, 8) for bn in (128, 256) for bk in (64, 128) for stages in (3, 4)]


def _set_block_shapes(nargs: dict) -> None:
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]


@_autotune(configs=tma_configs(), key=["M", "N", "K", "OUT_DTYPE", "ACTIVATION", "A_T", "B_T"], tma=True)
@triton.jit
def _matmul_tma_kernel(
    a_desc,  # descriptor of A (M, K), or of A^T (K, M) when A_T
    b_desc,  # descriptor of B (K, N), or of B^T (N, K) when B_T
    c_ptr,  # (M, N) OUT_DTYPE
    bias_ptr,  # (N,) or unused
    preact_ptr,  # (M, N) or unused
    M,
    N,
    K,
    stride_cm,
    stride_cn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    NUM_SMS: tl.constexpr,  # programs launched: each walks tiles NUM_SMS apart
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
):
    """The same GEMM and epilogue, persistent (one program per SM walks the tiles) with
    A and B fetched by the tensor memory accelerator through descriptors."""
    # Persistent: one program per SM loops over output tiles, so tile start-up
    # overlaps the previous tile's epilogue. Tiles are fetched by the tensor
    # memory accelerator through descriptors, which zero-fill out-of-range
    # rows and columns: the ragged edges need no masks until the store.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if A_T:
                a = a_desc.load([k * BLOCK_K, pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            if B_T:
                b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        _epilogue(
            acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_M, BLOCK_N, EPI_SPLIT,
        )  # fmt: skip


#: Tensor descriptors need 16-byte aligned base addresses and strides.
TMA_ALIGN_BYTES = 16


def _tma_layout(t: torch.Tensor) -> str | None:
    """``"row"`` (unit stride along dim 1), ``"col"`` (unit stride along dim 0)
    or None when a tensor descriptor cannot describe ``t``."""
    size = t.element_size()
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return None
    if t.stride(1) == 1 and (t.stride(0) * size) % TMA_ALIGN_BYTES == 0:
        return "row"
    if t.stride(0) == 1 and (t.stride(1) * size) % TMA_ALIGN_BYTES == 0:
        return "col"
    return None


def _tma_layouts(a: torch.Tensor, b: torch.Tensor) -> tuple[str, str] | None:
    """Both operands' descriptor layouts, or None when :func:`matmul_tma_persistent`
    cannot run its own kernel on them (a layout missing, or an empty dimension)."""
    layouts = _tma_layout(a), _tma_layout(b)
    return None if None in layouts or min(*a.shape, *b.shape) == 0 else layouts


def tma_eligible(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`matmul_tma_persistent` runs its own kernel on ``a`` and ``b``."""
    return _tma_layouts(a, b) is not None


def _num_programs(device: torch.device) -> int:
    if INTERPRET:
        return 4  # few programs, each looping over tiles: exercises the persistent loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul_tma_persistent(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    preact: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`matmul` with a persistent schedule and tensor-descriptor (TMA)
    loads, the layout Hopper favours; same arguments, same result.

    Operands a descriptor cannot describe (no unit-stride dimension, or
    addresses and strides not 16-byte aligned), and GPUs before Hopper (no
    TMA), go to :func:`matmul`'s pointer kernel. :func:`matmul` itself routes
    here on Hopper the shapes its pointer kernel cannot vectorise. Not yet
    the default: which schedule wins on which shapes is for the GPU
    benchmark (benchmarks/bench_gemm.py) to measure.
    """
    M, N, K, out_dtype = _check_matmul_args(a, b, bias, activation, out_dtype, preact)
    layouts = _tma_layouts(a, b)
    if layouts is None or not (INTERPRET or _has_tma(a.device)):
        # before Hopper there is no TMA: the descriptor loads compile to scalar
        # loads without cp.async and the kernel spills (see the static report)
        return _launch_matmul(a, b, M, N, K, bias, activation, out_dtype, preact)
    return _launch_tma(a, b, M, N, K, bias, activation, out_dtype, preact, layouts)


def _launch_tma(a, b, M, N, K, bias, activation, out_dtype, preact, layouts) -> torch.Tensor:
    """:func:`matmul_tma_persistent` after its arguments were checked."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_t, b_t = layouts[0] == "col", layouts[1] == "col"
    # Descriptors over A (M, K) / B (K, N), or over their transposes; the block
    # shapes are placeholders that each config's pre-hook replaces.
    a_desc = TensorDescriptor(
        a, [K, M] if a_t else [M, K], [a.stride(1), 1] if a_t else [a.stride(0), 1], [16, 16]
    )
    b_desc = TensorDescriptor(
        b, [N, K] if b_t else [K, N], [b.stride(1), 1] if b_t else [b.stride(0), 1], [16, 16]
    )
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    num_sms = _num_programs(a.device)

    def grid(meta):
        return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    _matmul_tma_kernel[grid](
        a_desc, b_desc, c, bias if bias is not None else c, preact if preact is not None else c,
        M, N, K, c.stride(0), c.stride(1), _bias_stride(bias),
        **_epilogue_meta(a.dtype, bias, activation, out_dtype, preact),
        A_T=a_t,
        B_T=b_t,
        NUM_SMS=num_sms,
    )  # fmt: skip
    return c


# --------------------------------------------------------------------------- fp8 (scaled_mm)

#: fp8 operand pairs the tensor cores take (e5m2 x e5m2 is not one of them).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Block scales change along K at most once per this many elements: every K tile
#: of every config (BLOCK_K <= 128) then lies inside one scale block, and partial
#: sums are promoted to fp32 at least this often (DeepSeek-V3's interval).
SCALE_BLOCK_K = 128
#: fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) or newer.
FP8_MIN_CC = (8, 9)


def _infer_block(size: int, count: int) -> int:
    """The block length that gives ``count`` scales over ``size`` elements:
    ceil(size / count) rounded up to a power of two."""
    return triton.next_power_of_2(max(1, triton.cdiv(size, max(count, 1))))


def _check_scale(
    name: str, scale: torch.Tensor, rows: int, cols: int, vector_shape: tuple[int, int], block, k_dim: int
) -> tuple[int, tuple[int, int]]:
    """(kind, block shape) of an operand's scale over its (rows, cols) elements;
    ``k_dim`` is which of the two is K (1 for a, 0 for b)."""
    check_tensor(name, scale, dtypes=(torch.float32,))
    if scale.numel() == 1 and block is None:
        return SCALE_TENSOR, (1, 1)
    if tuple(scale.shape) == vector_shape and block is None:
        return SCALE_VECTOR, (1, 1)
    if scale.dim() != 2:
        raise ValueError(
            f"{name} must have one element, shape {vector_shape} or a 2-D block grid; "
            f"got shape {tuple(scale.shape)}"
        )
    grid = tuple(scale.shape)
    if block is None:
        block = (_infer_block(rows, grid[0]), _infer_block(cols, grid[1]))
    if not (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)
    ):
        raise ValueError(f"the block shape of {name} must be two positive ints, got {block!r}")
    block = (int(block[0]), int(block[1]))
    want = (triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1]))
    if grid != want:
        raise ValueError(
            f"{name} has shape {grid}, but blocks of {block} over ({rows}, {cols}) need {want} scales"
        )
    if block[k_dim] % SCALE_BLOCK_K:
        raise ValueError(
            f"{name}: block scales must span a multiple of {SCALE_BLOCK_K} along K, got blocks of {block}"
        )
    return SCALE_BLOCK, block


def _check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda" and not INTERPRET:
        cc = torch.cuda.get_device_capability(device)
        if cc < FP8_MIN_CC:
            raise RuntimeError(
                f"scaled_mm needs fp8 tensor cores (compute capability >= 8.9, Ada or Hopper); "
                f"{torch.cuda.get_device_name(device)} ({device}) has {cc[0]}.{cc[1]}"
            )


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_a: tuple[int, int] | None = None,
    block_b: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``(a.float() * scale_a) @ (b.float() * scale_b) + bias``, accumulated in
    fp32 and rounded once to ``out_dtype``, as ``torch._scaled_mm`` defines its
    scales. The same GEMM kernel as :func:`matmul` (tiles, ordering, epilogue,
    configs), with fp8 operands and the scales applied to the fp32 accumulator.

    Args:
        a: (M, K) ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, any strides.
        b: (K, N) fp8, any strides; e5m2 x e5m2 is refused (no such tensor-core op).
        scale_a: fp32: one element (per tensor), (M, 1) (per row of a), or block
            scales (ceil(M / bm), ceil(K / bk)).
        scale_b: fp32: one element, (1, N) (per column of b), or block scales
            (ceil(K / bk), ceil(N / bn)).
        bias: optional (N,) bf16, fp16 or fp32, added after the scales.
        out_dtype: bf16 (default), fp16 or fp32.
        block_a, block_b: the block shapes (bm, bk) / (bk, bn) of block scales;
            when omitted, inferred per dimension as ceil(size / number of scales)
            rounded up to a power of two (DeepSeek-V3's (1, 128) and (128, 128)
            blocks are found from their scales). A block's K extent must be a
            multiple of 128: partial sums are promoted to fp32 at least that often.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched;
        RuntimeError on a GPU without fp8 tensor cores (before Ada, sm_89).
    """
    check_tensor("a", a, ndim=2, dtypes=FP8_DTYPES)
    check_tensor("b", b, ndim=2, dtypes=FP8_DTYPES)
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError("a and b cannot both be torch.float8_e5m2: fp8 tensor cores take e4m3 x e4m3, "
                        "e4m3 x e5m2 and e5m2 x e4m3")  # fmt: skip
    (M, K), (Kb, N) = a.shape, b.shape
    if Kb != K:
        raise ValueError(
            f"inner dimensions differ: a has shape {tuple(a.shape)} (M, K) and "
            f"b has shape {tuple(b.shape)} (K, N); expected b.shape[0] == {K}"
        )
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=OUT_DTYPES)
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape ({N},), got shape {tuple(bias.shape)}")
    kind_a, blk_a = _check_scale("scale_a", scale_a, M, K, (M, 1), block_a, 1)
    kind_b, blk_b = _check_scale("scale_b", scale_b, K, N, (1, N), block_b, 0)
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    _check_fp8_device(a.device)
    check_int32_addressable("a", a)
    check_int32_addressable("b", b)
    check_int32_elements("out", (M, N))
    # one element as (1, 1); (M, 1), (1, N) and block grids as they are (2-D, any strides)
    sa = scale_a.reshape(1, 1) if kind_a == SCALE_TENSOR else scale_a
    sb = scale_b.reshape(1, 1) if kind_b == SCALE_TENSOR else scale_b
    scales = OperandScales(kind_a, kind_b, sa, sb, blk_a, blk_b)
    return _launch_matmul(a, b, M, N, K, bias, None, out_dtype, None, scales)
