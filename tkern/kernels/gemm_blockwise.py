"""The blockwise-scaled fp8 GEMM (DeepSeek-V3's 1x128 / 128x128 scales) on the TMA persistent schedule.

``C = (A * sa) @ (B * sb) + bias`` for fp8 ``A`` (M, K) with one scale per
(``SCALE_BM``, 128) block (1x128 tiles of activations, or 128x128 blocks) and fp8
``B`` (K, N) with one scale per (128, ``SCALE_BN``) block (128x128 blocks of a
weight, or 128x1 columns: X in the blockwise wgrad). The scales change along K
once per 128 elements, so the kernel's K step is one scale block: per step
``part = A_k @ B_k`` is a fresh tensor-core product over the 128-wide block (four
chained k32 ``wgmma`` on Hopper) and ``acc = part * (sa_k * sb_k) + acc`` promotes it
into the fp32 accumulator with one fused multiply-add per element, as DeepGEMM
does. Each step's scales are loaded before its dot, and Triton's software pipeliner
issues those loads num_stages - 1 steps ahead with the operand tiles (the prefetch;
a second copy by hand only held more registers: 1080 B of spills at 128x128). A's
scales are read K-block-major (tkern.kernels.float8.cast_blocks stores 1x128 tiles'
scales with strides (1, M)), so a tile's row scales for one K block are contiguous.
Triton keeps no ``wgmma`` in flight across the FMA (docs/fp8.md says why).

One program per SM walks the output tiles in grouped order (gemm_epilogue.tile_coords,
as gemm_tma.py), and both operands come K-major through tensor descriptors (what an
fp8 ``wgmma`` reads from shared memory), zero-filled past M, N and K: a K that is
not a multiple of 128 is ragged only in its last block. The epilogue is the other
GEMMs' (gemm_epilogue.py: bias, one cast, ``C +=``), C stored through a descriptor
where one describes it.

``tkern.kernels.gemm.scaled_mm`` runs its block-scaled calls here where
:func:`blockwise_eligible` says so (Hopper or the interpreter, K-major 16-byte
aligned operands, 128-wide K blocks); the others take the pointer kernel
(gemm.py's ``SCALE_BLOCK`` path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, check_same_device, check_tensor
from tkern.kernels.float8 import FP8_DTYPES
from tkern.kernels.gemm_configs import blockwise_configs, gemm_autotune
from tkern.kernels.gemm_epilogue import (
    bias_stride,
    check_bias,
    check_operands,
    check_out_dtype,
    epilogue,
    epilogue_meta,
    epilogue_tma,
    refuse_e5m2_pair,
    tile_coords,
)
from tkern.kernels.gemm_tma import has_tma, persistent_programs, tma_layout, tma_layouts

#: The K extent of a scale block, and the kernel's K step: one per block.
SCALE_BLOCK_K = 128
#: Scale blocks along M (A) and N (B) the kernel takes: one row/column (1x128 tiles,
#: 128x1 columns) or 128 (128x128 blocks).
SCALE_BLOCK_MN = (1, 128)

#: What the autotuners choose a config by.
_AUTOTUNE_KEY = ["M", "N", "K", "OUT_DTYPE", "SCALE_BM", "SCALE_BN", "C_TMA"]


@triton.jit
def _block_scales(scale_ptr, offs, mask, first, k, stride_outer, stride_k, SCALE_B: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """The scales of a tile's rows of A (columns of B) at K block ``k``: (BLOCK,) fp32.
    A block of SCALE_B >= BLOCK rows (columns; the launcher checks that it divides them)
    is one value, loaded once and broadcast; smaller blocks are a vector (0 past the edge)."""
    if SCALE_B >= BLOCK:
        one = tl.load(scale_ptr + (first // SCALE_B) * stride_outer + k * stride_k)
        return tl.full((BLOCK,), 0.0, tl.float32) + one
    else:
        return tl.load(scale_ptr + (offs // SCALE_B) * stride_outer + k * stride_k, mask=mask, other=0.0)


@triton.jit
def _scaled_mm_blockwise_kernel(
    # descriptors and pointers
    a_desc,  # descriptor of A (M, K) fp8 (e4m3/e5m2), row-major; block (BLOCK_M, BLOCK_K)
    b_desc,  # descriptor of B^T (N, K) fp8: B (K, N) read K-major; block (BLOCK_N, BLOCK_K)
    c_desc,  # descriptor of C (M, N) when C_TMA (block: BLOCK_M x a column slice); else unused
    c_ptr,  # (M, N) OUT_DTYPE, strides (stride_cm, stride_cn)
    bias_ptr,  # (N,) bf16/fp16/fp32, stride stride_bias; unused unless HAS_BIAS
    scale_a_ptr,  # (ceil(M / SCALE_BM), ceil(K / 128)) fp32, strides (stride_sam, stride_sak)
    scale_b_ptr,  # (ceil(K / 128), ceil(N / SCALE_BN)) fp32, strides (stride_sbk, stride_sbn)
    # dimensions
    M,
    N,
    K,
    # strides, in elements
    stride_cm,
    stride_cn,
    stride_bias,
    stride_sam,  # 1 for 1x128 tiles' K-block-major scales: a contiguous load per K step
    stride_sak,
    stride_sbk,
    stride_sbn,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (the interpreter's dot on fp8)
    SCALE_BM: tl.constexpr,  # rows of A per scale: 1 or 128
    SCALE_BN: tl.constexpr,  # columns of B per scale: 1 or 128
    NUM_SMS: tl.constexpr,  # programs launched: each walks tiles NUM_SMS apart
    C_TMA: tl.constexpr,  # C stored (and read, ACCUMULATE) through c_desc
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # == SCALE_BLOCK_K: one K step per scale block
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,  # column slices of the ``C +=`` epilogue (see gemm_epilogue.epilogue)
    ACCUMULATE: tl.constexpr = False,  # C += result (C's old value read in the epilogue)
):
    """C = (A * sa) @ (B * sb) + bias (or C += ...) for block-scaled fp8 A and B, fp32
    accumulation promoted once per 128-wide K block; persistent, TMA loads. Shapes above."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_steps):
            # The K step's scales: a (BLOCK_M,) vector of A's row scales (one contiguous
            # load: K-block-major) or one value for a 128-row block, and likewise for B;
            # the software pipeliner issues them num_stages - 1 steps ahead (the prefetch).
            sa = _block_scales(scale_a_ptr, offs_m, mask_m, pid_m * BLOCK_M, k, stride_sam, stride_sak,
                               SCALE_BM, BLOCK_M)  # fmt: skip
            sb = _block_scales(scale_b_ptr, offs_n, mask_n, pid_n * BLOCK_N, k, stride_sbn, stride_sbk,
                               SCALE_BN, BLOCK_N)  # fmt: skip
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            # A fresh product over one scale block (fp8 products are exact; the tensor
            # cores sum 128 of them), promoted into fp32 with one fused multiply-add.
            part = tl.dot(a, b)
            acc = tl.fma(part, sa[:, None] * sb[None, :], acc)
        if C_TMA:
            epilogue_tma(
                acc, pid_m, pid_n, N, c_desc, bias_ptr, stride_bias, HAS_BIAS, 0, OUT_DTYPE,
                BLOCK_M, BLOCK_N, EPI_SPLIT, ACCUMULATE,
            )  # fmt: skip
        else:
            epilogue(
                acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, c_ptr, stride_cm, stride_cn, stride_bias,
                HAS_BIAS, 0, False, OUT_DTYPE, OUT_DTYPE, BLOCK_M, BLOCK_N, EPI_SPLIT, ACCUMULATE,
            )  # fmt: skip


#: The launches' autotuners, by (``C +=``, B's scales a vector along N): each ``C +=`` one
#: restores C after each config it benchmarks (see gemm._matmul_accumulate_kernel); per-column
#: B scales get their own tiles (gemm_configs.blockwise_configs).
_KERNELS = {
    (accumulate, column): gemm_autotune(
        configs=blockwise_configs(column),
        key=_AUTOTUNE_KEY,
        tma=True,
        restore=("c_ptr",) if accumulate else (),
    )(_scaled_mm_blockwise_kernel)
    for accumulate in (False, True)
    for column in (False, True)
}


def blockwise_eligible(
    a: torch.Tensor, b: torch.Tensor, block_a: tuple[int, int], block_b: tuple[int, int]
) -> bool:
    """Whether :func:`scaled_mm_blockwise` runs on fp8 ``a`` (M, K) and ``b`` (K, N) with
    block scales of ``block_a`` (rows, K) and ``block_b`` (K, columns): Hopper or newer
    (or the interpreter), 128-wide K blocks, 1 or 128 rows (columns) per scale, both
    operands K-major with 16-byte aligned addresses and strides (what a tensor
    descriptor needs), and no empty dimension. The others take gemm.py's pointer kernel."""
    return (
        (INTERPRET or has_tma(a.device))
        and block_a[1] == SCALE_BLOCK_K
        and block_b[0] == SCALE_BLOCK_K
        and block_a[0] in SCALE_BLOCK_MN
        and block_b[1] in SCALE_BLOCK_MN
        and tma_layouts(a, b) == ("row", "col")
    )


def scaled_mm_blockwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    block_a: tuple[int, int] = (1, SCALE_BLOCK_K),
    block_b: tuple[int, int] = (SCALE_BLOCK_K, SCALE_BLOCK_K),
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` on this file's kernel, scales expanded over
    their blocks: the benchmark's and the tests' direct entry; ``tkern.scaled_mm`` routes
    its block-scaled calls here itself (with ``out`` / ``accumulate_into``).

    Args:
        a: (M, K) ``torch.float8_e4m3fn`` or ``float8_e5m2`` (or the FNUZ forms), row-major
            (unit stride along K).
        b: (K, N) fp8, K-major (unit stride along K: ``w.t()`` of a row-major (N, K) ``w``).
        scale_a: (ceil(M / block_a[0]), ceil(K / 128)) fp32, any strides (K-block-major,
            strides (1, rows), reads one contiguous run per K step).
        scale_b: (ceil(K / 128), ceil(N / block_b[1])) fp32, any strides.
        block_a, block_b: (1 or 128, 128) and (128, 1 or 128).
        bias: optional (N,) bf16, fp16 or fp32. out_dtype: bf16, fp16 or fp32.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched; also
        when :func:`blockwise_eligible` is false (another layout or block shape: use
        ``tkern.scaled_mm``, which takes them on its pointer kernel).
    """
    M, N, K = check_operands(a, b, FP8_DTYPES, refuse_e5m2_pair)
    block_a, block_b = tuple(block_a), tuple(block_b)
    # one scale per block of block_a / block_b
    grid_a = (triton.cdiv(M, block_a[0]), triton.cdiv(K, block_a[1]))
    check_tensor("scale_a", scale_a, ndim=2, dtypes=(torch.float32,), shape=grid_a)
    grid_b = (triton.cdiv(K, block_b[0]), triton.cdiv(N, block_b[1]))
    check_tensor("scale_b", scale_b, ndim=2, dtypes=(torch.float32,), shape=grid_b)
    check_bias(bias, N, None)
    check_out_dtype(out_dtype)
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    if not blockwise_eligible(a, b, block_a, block_b):
        raise ValueError(
            f"the blockwise kernel takes K-major, 16-byte aligned fp8 operands on Hopper with "
            f"blocks (1 or 128, 128) x (128, 1 or 128); got a strides {a.stride()}, b strides "
            f"{b.stride()}, blocks {block_a} x {block_b} on {a.device}: use tkern.scaled_mm"
        )
    return launch_blockwise(a, b, scale_a, scale_b, block_a, block_b, bias, out_dtype)


def launch_blockwise(
    a, b, scale_a, scale_b, block_a, block_b, bias, out_dtype, into=None, accumulate=True
) -> torch.Tensor:
    """:func:`scaled_mm_blockwise` for arguments already checked (``tkern.scaled_mm``'s, and
    :func:`blockwise_eligible` true): ``into`` an (M, N) tensor of ``out_dtype`` (any
    strides) the result is added to (``accumulate``) or written into, and returned."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device) if into is None else into
    if M == 0 or N == 0:
        return c
    # A (M, K) and B^T (N, K), both K-major; block shapes are placeholders the configs'
    # pre-hook replaces (gemm_configs.set_blockwise_block_shapes)
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [16, 16])
    b_desc = TensorDescriptor(b, [N, K], [b.stride(1), 1], [16, 16])
    c_tma = tma_layout(c) == "row"
    c_desc = TensorDescriptor(c, [M, N], [c.stride(0), 1], [16, 16]) if c_tma else c
    num_sms = persistent_programs(a.device)
    accumulate = into is not None and accumulate
    kernel = _KERNELS[accumulate, block_b[1] == 1]

    def grid(meta):
        return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    meta = epilogue_meta(a.dtype, bias, None, out_dtype, None, accumulate)
    kernel[grid](
        a_desc, b_desc, c_desc, c, c if bias is None else bias, scale_a, scale_b,
        M, N, K, c.stride(0), c.stride(1), bias_stride(bias),
        scale_a.stride(0), scale_a.stride(1), scale_b.stride(0), scale_b.stride(1),
        HAS_BIAS=bias is not None, OUT_DTYPE=meta["OUT_DTYPE"], UPCAST=meta["UPCAST"],
        SCALE_BM=block_a[0], SCALE_BN=block_b[1], NUM_SMS=num_sms, C_TMA=c_tma, ACCUMULATE=accumulate,
    )  # fmt: skip
    return c
