"""Split-K: a GEMM whose output has too few tiles to fill the GPU, with K cut into ranges.

``C = A @ B`` for fp16/bf16 ``A`` (M, K) and ``B`` (K, N) of any strides, when
``gemm_plan.plan_gemm`` says so (the wgrad ``dY^T @ X`` over 16384 tokens has 36-144
output tiles on 132 SMs). Two launches:

1. :func:`_matmul_split_k_kernel`: a (tiles, splits) grid; program (t, s) sums its
   tile over K range s in an fp32 accumulator and stores that partial into an fp32
   workspace (splits, M, N); the first column of tiles also stores the range's fp32
   row sums of A (the bias gradient, as the pointer kernel's ``SUM_A``);
2. :func:`_split_k_reduce_kernel`: each output element's partials summed in fp32 in
   split order 0, 1, ..., (C's old value added for ``C +=``), rounded once.

The reduction is a second pass in a fixed order, not atomics: the result is
deterministic (bit-identical run to run). Its one extra rounding is of fp32
partials (the pointer kernel's own fp32 accumulator rounds after every K step too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import cast_rne, check_int32_elements
from tkern.kernels.gemm_configs import gemm_autotune, split_k_configs
from tkern.kernels.gemm_epilogue import epilogue_meta, tile_coords
from tkern.kernels.gemm_plan import SPLIT_K_ALIGN

#: The tile of the output each reduction program sums: 32 x 128 (fp32 partials: 16 KB a
#: split; 128 columns give every thread of 4 warps 16-byte vector loads and stores).
REDUCE_BLOCK_M, REDUCE_BLOCK_N = 32, 128
#: Warps of a reduction program.
REDUCE_WARPS = 4
#: Warps of a reduction program into a column-major C (a weight stored (in, out), GPT-2's
#: Conv1D, written through its transposed flat view): the tile goes through shared memory to
#: be stored along M, and at 4 warps that spills 8 B on sm_100 (triton 3.9; none at 8).
REDUCE_WARPS_C_T = 8

_AUTOTUNE_KEY = ["M", "N", "K", "K_CHUNK", "A_T", "B_T", "SUM_A"]


@gemm_autotune(configs=split_k_configs(), key=_AUTOTUNE_KEY)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _matmul_split_k_kernel(
    # pointers
    a_ptr,  # (M, K) fp16/bf16
    b_ptr,  # (K, N) a's dtype
    ws_ptr,  # (splits, M, N) fp32, contiguous: the partial products
    sums_ptr,  # (splits, M) fp32, contiguous: A's partial row sums; unused unless SUM_A
    # dimensions
    M,
    N,
    K,
    K_CHUNK,  # K per split, a multiple of BLOCK_K (gemm_plan.SPLIT_K_ALIGN)
    # strides, in elements
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    # meta-parameters
    UPCAST: tl.constexpr,  # multiply in fp32 (the interpreter cannot multiply bf16)
    A_T: tl.constexpr,  # A is not row-major: for the autotune key
    B_T: tl.constexpr,  # B is not row-major: for the autotune key
    SUM_A: tl.constexpr,  # the first column of tiles stores A's row sums over its range
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no mask on the K loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,  # unused (the config tables' field): the partial needs no epilogue
):
    """ws[s] = A[:, range s] @ B[range s, :] for one (BLOCK_M, BLOCK_N) tile per
    program along axis 0 and one K range per program along axis 1; fp32
    accumulation, stored unrounded. Shapes above."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    k0 = split * K_CHUNK
    k_len = tl.minimum(K - k0, K_CHUNK)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    first_col = (offs_m * 0 + pid_n) == 0  # (BLOCK_M,): the interpreter cannot store under a scalar
    a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:  # every range is whole BLOCK_K tiles (K_CHUNK is a multiple of BLOCK_K)
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = k_len - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if SUM_A:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if pid_n == 0:
                a_sum += tl.sum(a.to(tl.float32), axis=1)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    base = split.to(tl.int64) * M * N  # the workspace may pass 2^31 elements over all splits
    ws_ptrs = ws_ptr + base + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])
    if SUM_A:
        tl.store(sums_ptr + split * M + offs_m, a_sum, mask=mask_m & first_col)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,  # (splits, M, N) fp32, contiguous: the partial products
    c_ptr,  # (M, N) OUT_DTYPE, strides (stride_cm, stride_cn)
    sums_ptr,  # (splits, M) fp32, contiguous: partial row sums; unused unless SUM_A
    a_sum_ptr,  # (M,) fp32 or a's dtype, contiguous: receives the row sums; unused unless SUM_A
    SPLITS,
    M,
    N,
    stride_cm,
    stride_cn,
    OUT_DTYPE: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # C += the product (C's old value read in fp32, one rounding)
    SUM_A: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ADD_SUM: tl.constexpr = False,  # with SUM_A: a_sum += the row sums (its old value read in fp32)
):
    """C = sum over s of ws[s] (plus C's old value with ACCUMULATE), summed in fp32 in
    split order and rounded once, one (BLOCK_M, BLOCK_N) tile per program; the
    programs of column block 0 sum the row sums likewise (plus a_sum's old value with
    ADD_SUM: a bias gradient added into its ``.grad``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    size = M.to(tl.int64) * N
    ws_ptrs = ws_ptr + rows[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLITS):  # a fixed order: deterministic
        acc += tl.load(ws_ptrs + s * size, mask=mask, other=0.0)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, cast_rne(acc, OUT_DTYPE), mask=mask)
    if SUM_A:
        mask_s = (rows < M) & ((rows * 0 + pid_n) == 0)  # column block 0 only
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for s in range(0, SPLITS):
            total += tl.load(sums_ptr + s * M + rows, mask=mask_s, other=0.0)
        if ADD_SUM:
            total += tl.load(a_sum_ptr + rows, mask=mask_s, other=0.0).to(tl.float32)
        tl.store(a_sum_ptr + rows, cast_rne(total, a_sum_ptr.dtype.element_ty), mask=mask_s)


def launch_split_k(
    a: torch.Tensor,
    sa: tuple[int, int],
    b: torch.Tensor,
    M: int,
    N: int,
    K: int,
    splits: int,
    k_chunk: int,
    out_dtype: torch.dtype,
    a_sum: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
    accumulate: bool = True,
    add_sum: bool = False,
) -> torch.Tensor:
    """``a @ b`` (``a`` read with strides ``sa``) as ``splits`` K ranges of ``k_chunk``
    and an ordered reduction, for arguments already checked (gemm.py's launchers);
    ``a_sum``: a contiguous (M,) tensor receiving a's row sums (fp32 accumulated; added to
    what it holds with ``add_sum``);
    ``into``: an (M, N) tensor of ``out_dtype`` the product is added to
    (``accumulate``) or written into, and returned, instead of a new one."""
    if k_chunk % SPLIT_K_ALIGN or splits < 1 or (splits - 1) * k_chunk >= K or splits * k_chunk < K:
        raise ValueError(
            f"split-K needs K ranges of a multiple of {SPLIT_K_ALIGN} covering K = {K} with none empty; "
            f"got {splits} ranges of {k_chunk}"
        )
    check_int32_elements("out", (M, N))
    c = torch.empty(M, N, dtype=out_dtype, device=a.device) if into is None else into
    ws = torch.empty(splits, M, N, dtype=torch.float32, device=a.device)
    sums = ws if a_sum is None else torch.empty(splits, M, dtype=torch.float32, device=a.device)
    sb = b.stride()
    meta = epilogue_meta(a.dtype, None, None, out_dtype, None)

    def grid(cfg):
        return (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), splits)

    _matmul_split_k_kernel[grid](
        a, b, ws, sums, M, N, K, k_chunk, *sa, *sb,
        UPCAST=meta["UPCAST"], A_T=sa[1] != 1, B_T=sb[1] != 1, SUM_A=a_sum is not None,
    )  # fmt: skip
    _split_k_reduce_kernel[(triton.cdiv(M, REDUCE_BLOCK_M), triton.cdiv(N, REDUCE_BLOCK_N))](
        ws, c, sums, c if a_sum is None else a_sum, splits, M, N, *c.stride(),
        OUT_DTYPE=meta["OUT_DTYPE"], ACCUMULATE=into is not None and accumulate, SUM_A=a_sum is not None,
        BLOCK_M=REDUCE_BLOCK_M, BLOCK_N=REDUCE_BLOCK_N, ADD_SUM=add_sum and a_sum is not None,
        num_warps=REDUCE_WARPS if c.stride(1) == 1 or N == 1 else REDUCE_WARPS_C_T,
    )  # fmt: skip
    return c
