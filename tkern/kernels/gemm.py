"""The pointer GEMM with FP32 accumulation and a fused epilogue, and its launchers.

``C = act(A @ B + bias)`` for fp16 or bf16 ``A`` (M, K) and ``B`` (K, N) of any
strides, or fp8 operands with their scales (:func:`scaled_mm`). Products are
accumulated in an FP32 tile; the epilogue (bias, activation, one cast; shared
with the TMA kernel, see gemm_epilogue.py) runs on that FP32 tile, so the only
rounding to half precision is the final store.

The family's other rooms: gemm_configs.py (tile tables and the pruning rules),
gemm_epilogue.py (tile order, epilogue, argument checks), gemm_plan.py (the
rule that schedules each GEMM by its tile count and waves on the GPU's SMs),
gemm_tma.py (the persistent tensor-descriptor kernel, which :func:`matmul` runs
on Hopper where the plan says so; :func:`matmul_tma_persistent` runs everything
it can there) and gemm_split.py (split-K with an ordered reduction).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkern import device as tkdev
from tkern.kernels import float8
from tkern.kernels._common import (
    INTERPRET,
    DirectLaunch,
    cast_rne,
    check_int32_addressable,
    check_int32_elements,
    check_same_device,
    check_tensor,
    resolve_launch,
)
from tkern.kernels.activation import ACTIVATIONS, activation_grad, activation_grad_f32, check_activation
from tkern.kernels.float8 import (
    FP8_DTYPES,
    cast_2d_prechecked,
    cast_multiplier,
    check_fp8_device,
    fp8_constants,
    last_to_finish,
    max_of_chunks,
    release_counter,
    roll_if_last,
    roll_value_if_last,
)
from tkern.kernels.gemm_blockwise import blockwise_eligible, launch_blockwise
from tkern.kernels.gemm_configs import (
    VECTOR_ELEMS,
    fp8_gemm_configs,
    gemm_autotune,
    gemm_configs,
    operands_ragged,
    transposed,
)
from tkern.kernels.gemm_configs import tma_configs as tma_configs  # re-exported (aot_report.py)
from tkern.kernels.gemm_emit import Float8Emit, Float8Emitted, check_emit, emit_counter
from tkern.kernels.gemm_epilogue import (
    EpilogueRead,
    bias_stride,
    check_bias,
    check_matmul_args,
    check_operands,
    check_out_dtype,
    check_preact,
    epilogue,
    epilogue_emit,
    epilogue_meta,
    read_meta,
    refuse_e5m2_pair,
    tile_coords,
)
from tkern.kernels.gemm_mx import is_mx_scale, scaled_mm_mx
from tkern.kernels.gemm_plan import POINTER, SPLIT_K, TMA, GemmPlan, plan_gemm
from tkern.kernels.gemm_split import launch_split_k
from tkern.kernels.gemm_tma import TMA_ALIGN_BYTES, has_tma, launch_tma, tma_layouts

#: How an operand's fp8 scale is laid out (the kernel's constexpr SCALE_A/SCALE_B):
#: none (fp16/bf16 operands), one element for the whole tensor, one per row of a
#: (M, 1) / per column of b (1, N), or one per block of the operand.
SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR, SCALE_BLOCK = 0, 1, 2, 3
_SCALE_TENSOR: tl.constexpr = tl.constexpr(SCALE_TENSOR)
_SCALE_VECTOR: tl.constexpr = tl.constexpr(SCALE_VECTOR)
_SCALE_BLOCK: tl.constexpr = tl.constexpr(SCALE_BLOCK)


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


@triton.jit
def _matmul_tile(
    a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    scale_a_ptr, scale_b_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn,
    block_am, block_ak, block_bk, block_bn, z_ptr, a_out_ptr, a_sum_ptr,
    UPCAST: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    A_ACT: tl.constexpr, STORE_A: tl.constexpr, SUM_A: tl.constexpr, PRECISE_ACC: tl.constexpr,
    ADD_SUM: tl.constexpr,
):  # fmt: skip
    """The program body both entry kernels share (``_matmul_kernel``, ``_matmul_emit_kernel``):
    this program's output tile ``(acc, pid_m, pid_n)``, the fp32 accumulator with the fp8
    scales applied, before the epilogue (the arguments are the entry kernels'; ``ADD_SUM``:
    A's row sums are added to what ``a_sum_ptr`` holds, in fp32 with one rounding)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_offs = offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    a_ptrs = a_ptr + a_offs
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    # the prologue's pointers walk K with A's (same strides); only column block 0 stores
    z_ptrs = z_ptr + a_offs
    a_out_ptrs = a_out_ptr + a_offs
    # (BLOCK_M,) rather than a scalar: the interpreter cannot store under a scalar condition
    first_col = (offs_m * 0 + pid_n) == 0
    a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)

    # Accumulate in fp32: fp16 products are exact in fp32, and the running sum
    # keeps 24 bits where an fp16 sum would keep 11 (4096 ones sum to 2048 in fp16).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            mask_a = mask_m[:, None]
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - k * BLOCK_K
            mask_a = mask_m[:, None] & (offs_k[None, :] < k_left)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_a, other=0.0)
        if A_ACT != 0:
            # dZ = dY * act'(Z) in fp32, rounded once to the operand dtype: exactly the
            # standalone kernel's dZ (zero where masked: dY = 0 there)
            z = tl.load(z_ptrs, mask=mask_a, other=0.0)
            a = cast_rne(activation_grad_f32(a.to(tl.float32), z.to(tl.float32), A_ACT), a.dtype)
            z_ptrs += BLOCK_K * stride_ak
        if STORE_A:
            tl.store(a_out_ptrs, a, mask=mask_a & first_col[:, None])
            a_out_ptrs += BLOCK_K * stride_ak
        if SUM_A:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if pid_n == 0:  # only column block 0 stores the sums: the others skip them
                a_sum += tl.sum(a.to(tl.float32), axis=1)
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
        elif PRECISE_ACC:
            # Hopper's fp8 wgmma keeps fewer accumulator bits than fp32: its partial sum
            # over each K tile (<= 128) is added into the fp32 accumulator (the gradient
            # GEMMs, as torch._scaled_mm's default and torchao's backward; the forward
            # keeps the fast accumulation)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
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
    if SUM_A:
        sum_dtype: tl.constexpr = a_sum_ptr.dtype.element_ty
        if ADD_SUM:  # a bias gradient added into .grad (a fused optimizer's flat view)
            a_sum += tl.load(a_sum_ptr + offs_m, mask=mask_m & first_col, other=0.0).to(tl.float32)
        tl.store(a_sum_ptr + offs_m, cast_rne(a_sum, sum_dtype), mask=mask_m & first_col)
    return acc, pid_m, pid_n


#: What the pointer kernel's autotuners choose a config by (both: plain and ``C +=``).
_AUTOTUNE_KEY = ["M", "N", "K", "OUT_DTYPE", "ACTIVATION", "A_T", "B_T", "SCALE_A", "SCALE_B", "A_ACT",
                 "GRAD_ACT", "GRAD_GLU", "ADD_RESIDUAL", "GLU_FWD", "ROW_STATS"]  # fmt: skip


@gemm_autotune(configs=gemm_configs(), key=_AUTOTUNE_KEY)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _matmul_kernel(
    # pointers
    a_ptr,  # (M, K) fp16/bf16
    b_ptr,  # (K, N) same dtype as a
    c_ptr,  # (M, N) OUT_DTYPE
    bias_ptr,  # (N,) a's dtype or fp32; unused unless HAS_BIAS
    preact_ptr,  # (M, N) a's dtype, c's strides: A @ B + bias before the activation (STORE_PREACT),
    # or the Z whose act' multiplies the result (GRAD_ACT); else unused
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
    # the operand prologue (the linear backward); unused unless A_ACT / STORE_A / SUM_A
    z_ptr,  # (M, K) a's dtype, a's strides: the pre-activation whose act' multiplies A; A_ACT only
    a_out_ptr,  # (M, K) a's dtype, a's strides: receives A' (the operand fed to the dot); STORE_A only
    a_sum_ptr,  # (M,) fp32 or a's dtype, contiguous: receives A'.sum(1) summed in fp32; SUM_A only
    # meta-parameters; constexpr so the untaken branches are compiled out
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 relu, 2 gelu (erf form)
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (the interpreter cannot multiply bf16)
    A_T: tl.constexpr,  # A is not row-major (e.g. a transposed view): for the autotune key
    B_T: tl.constexpr,  # B is not row-major (x @ W^T reads W^T in place): for the autotune key
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no mask on the K loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,  # column slices of the GELU epilogue (see gemm_epilogue.epilogue)
    SCALE_A: tl.constexpr = 0,  # SCALE_NONE / _TENSOR / _VECTOR (per row) / _BLOCK
    SCALE_B: tl.constexpr = 0,  # SCALE_NONE / _TENSOR / _VECTOR (per column) / _BLOCK
    A_ACT: tl.constexpr = 0,  # activation code: A' = A * act'(Z) rounded to a's dtype (0: A' = A)
    STORE_A: tl.constexpr = False,  # the programs of column block 0 store A' (a_out_ptr)
    SUM_A: tl.constexpr = False,  # the programs of column block 0 store A'.sum(1) (a_sum_ptr)
    ACCUMULATE: tl.constexpr = False,  # C += A' @ B (C's old value read in the epilogue)
    ADD_SUM: tl.constexpr = False,  # with SUM_A and ACCUMULATE: a_sum_ptr += A'.sum(1) (fp32, one rounding)
    PRECISE_ACC: tl.constexpr = False,  # fp8: promote the tensor cores' partial sums every K tile
    GRAD_ACT: tl.constexpr = 0,  # activation code: C = (A' @ B) * act'(Z), Z at preact_ptr (0: off)
    GRAD_GLU: tl.constexpr = False,  # with GRAD_ACT: a gated unit's two gradients (epilogue's GRAD_GLU)
    ADD_RESIDUAL: tl.constexpr = False,  # the (M, N) tensor at preact_ptr added (epilogue's ADD_RESIDUAL)
    GLU_FWD: tl.constexpr = 0,  # activation code: up stored into [gate | up] at preact_ptr, C = act(gate)*up
    ROW_STATS: tl.constexpr = False,  # C's softmax statistics written at preact_ptr (epilogue's ROW_STATS)
):
    """C = act(A' @ B + bias) for one (BLOCK_M, BLOCK_N) output tile per program, fp32
    accumulation; fp8 operands with their scales (scaled_mm) on the accumulator:
    per tensor/row/column after the K loop, per block inside it. Shapes above.

    The operand prologue serves the linear backward: ``A' = A * act'(Z)`` (dZ from
    dY and the saved pre-activation, as activation.activation_grad stores it) is
    built while A's tiles are loaded, and the programs of the first column block
    (``pid_n == 0``, each of A's row bands has exactly one) store the A' tiles they
    built and their row sums (dbias): no atomics, every row written once. The epilogue's
    ``GRAD_ACT`` serves the layer before: ``dZ = (dY @ W) * act'(Z)`` (matmul_grad_act),
    and with ``GRAD_GLU`` a gated unit's d(gate) and d(up) (matmul_grad_glu); ``GLU_FWD`` a
    gated unit's forward in its up GEMM (matmul_glu: up stored, C = act(gate) * up)."""
    acc, pid_m, pid_n = _matmul_tile(
        a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, scale_a_ptr, scale_b_ptr,
        stride_sam, stride_sak, stride_sbk, stride_sbn, block_am, block_ak, block_bk, block_bn, z_ptr,
        a_out_ptr, a_sum_ptr, UPCAST, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SCALE_A, SCALE_B, A_ACT,
        STORE_A, SUM_A, PRECISE_ACC, ADD_SUM,
    )  # fmt: skip
    epilogue(
        acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
        HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_M, BLOCK_N, EPI_SPLIT,
        ACCUMULATE, GRAD_ACT, GRAD_GLU, ADD_RESIDUAL, GLU_FWD, ROW_STATS,
    )  # fmt: skip


#: The pointer kernel's launches with ``ACCUMULATE`` (C += A' @ B): the same jit
#: function under an autotuner of its own that restores C (and the row sums ``ADD_SUM``
#: adds into) after each config it benchmarks (every benchmark run adds into them).
_matmul_accumulate_kernel = gemm_autotune(
    configs=gemm_configs(), key=_AUTOTUNE_KEY, restore=("c_ptr", "a_sum_ptr")
)(_matmul_kernel.fn)
#: scaled_mm's launches: the same jit function over the fp8 tiles (gemm_configs.fp8_gemm_configs:
#: 128-deep K tiles, shared memory counted at one byte an element), plain and ``C +=``.
_FP8_AUTOTUNE_KEY = [*_AUTOTUNE_KEY, "PRECISE_ACC"]
_scaled_mm_kernel = gemm_autotune(configs=fp8_gemm_configs(), key=_FP8_AUTOTUNE_KEY)(_matmul_kernel.fn)
_scaled_mm_accumulate_kernel = gemm_autotune(
    configs=fp8_gemm_configs(), key=_FP8_AUTOTUNE_KEY, restore=("c_ptr",)
)(_matmul_kernel.fn)


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _matmul_emit_kernel(
    # the GEMM's pointers, dimensions and strides: _matmul_kernel's (c contiguous)
    a_ptr, b_ptr, c_ptr, bias_ptr, preact_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    stride_cm, stride_cn, stride_bias, scale_a_ptr, scale_b_ptr, stride_sam, stride_sak, stride_sbk,
    stride_sbn, block_am, block_ak, block_bk, block_bn,
    # the next GEMM's input cast (gemm_emit.py)
    data_ptr,  # (M, N) e4m3, contiguous: C's cast (DELAYED)
    data_t_ptr,  # (N, M) e4m3, contiguous: C^T's cast (DELAYED and STORE_T)
    scale_ptr,  # (1,) fp32: 1 / multiplier, written by program 0 (DELAYED)
    partials_ptr,  # (>= programs,) fp32: each program's max |C| (COUNT)
    amax_ptr,  # (1,) fp32: max |C|, written by the last program (COUNT, not DELAYED)
    history_ptr,  # (H,) fp32: the consumer's input amax history (DELAYED); rolled with max |C| (COUNT)
    counter_ptr,  # (1,) int32, 0 between launches: programs finished (COUNT)
    roll2_ptr,  # (H2,) fp32: a cached weight's history, rolled with max(roll2_amax) (ROLL2)
    roll2_amax_ptr,  # (count2,) fp32 (ROLL2)
    H, H2, count2,
    margin_factor,  # 2^-margin (DELAYED)
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    PRECISE_ACC: tl.constexpr,
    DELAYED: tl.constexpr,  # cast C with the history's multiplier in the epilogue
    STORE_T: tl.constexpr,
    COUNT: tl.constexpr,  # record max |C| per program; the last reduces it (tensorwise) or rolls it
    ROLL2: tl.constexpr,
    FP8_MAX: tl.constexpr, MULT_AT_EPS: tl.constexpr, EPS_F32: tl.constexpr, DTYPE8: tl.constexpr,
    CHUNK: tl.constexpr,  # partial maxima reduced this many at a time
    HBLOCK: tl.constexpr,  # a power of two >= H, H2 and 1
    PBLOCK2: tl.constexpr,  # a power of two >= count2
):  # fmt: skip
    """:func:`_matmul_kernel`'s program (``_matmul_tile``, the same code) with an epilogue
    that also writes the next fp8 GEMM's input (``scaled_mm(emit_fp8=...)``, gemm_emit.py):
    under DELAYED each tile of C cast with the consumer's history's multiplier into C's
    and C^T's layouts (``gemm_epilogue.epilogue_emit``); with COUNT every program stores
    its max |C| and counts itself finished (float8.last_to_finish), and the last one rolls
    the reduced max into the history (DELAYED; and ROLL2's) or stores it at ``amax_ptr``
    for the one cast pass that follows (tensorwise). Every program reads the history
    before it counts itself, so the last one's roll comes after every read."""
    pid = tl.program_id(0)
    mult = 1.0
    if DELAYED:
        mult = cast_multiplier(
            history_ptr, H, margin_factor, scale_ptr, pid, True, FP8_MAX, MULT_AT_EPS, EPS_F32, HBLOCK
        )
    acc, pid_m, pid_n = _matmul_tile(
        a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, scale_a_ptr, scale_b_ptr,
        stride_sam, stride_sak, stride_sbk, stride_sbn, block_am, block_ak, block_bk, block_bn, c_ptr,
        c_ptr, c_ptr, UPCAST, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SCALE_A, SCALE_B, 0, False,
        False, PRECISE_ACC, False,
    )  # fmt: skip
    best = epilogue_emit(
        acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias, mult,
        data_ptr, data_t_ptr, HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_M,
        BLOCK_N, EPI_SPLIT, DELAYED, STORE_T, FP8_MAX, DTYPE8,
    )  # fmt: skip
    if COUNT:
        nprog = tl.num_programs(0)
        tl.store(partials_ptr + pid, best)
        last = last_to_finish(counter_ptr, nprog)
        amax = max_of_chunks(partials_ptr, tl.where(last, nprog, 0), CHUNK)
        if DELAYED:
            roll_value_if_last(history_ptr, H, amax, last, HBLOCK)
        else:
            roll_value_if_last(amax_ptr, 1, amax, last, HBLOCK)  # a one-element "history": amax[0]
        if ROLL2:
            roll_if_last(roll2_ptr, H2, roll2_amax_ptr, count2, last, PBLOCK2, HBLOCK)
        release_counter(counter_ptr, last, nprog)


_EMIT_AUTOTUNE_KEY = ["M", "N", "K", "OUT_DTYPE", "ACTIVATION", "A_T", "B_T", "SCALE_A", "SCALE_B",
                      "PRECISE_ACC", "DELAYED", "STORE_T"]  # fmt: skip
#: scaled_mm(emit_fp8=...)'s launches: the fp8 tiles; the histories a benchmarked config
#: rolls are put back after it (only the launch itself rolls them).
_scaled_mm_emit_kernel = gemm_autotune(
    configs=fp8_gemm_configs(), key=_EMIT_AUTOTUNE_KEY, restore=("history_ptr", "roll2_ptr")
)(_matmul_emit_kernel)
#: The smallest fp8 tile: no config launches more programs than (M, N) cut in these.
_MIN_FP8_TILE = tuple(min(c.kwargs[k] for c in fp8_gemm_configs()) for k in ("BLOCK_M", "BLOCK_N"))
#: Partial maxima the emitting epilogue's last program reduces at a time.
EMIT_CHUNK = 1024


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
        activation: None, ``"relu"``, ``"gelu"`` (exact, erf form), ``"silu"`` or
            ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``), applied in fp32.
        out_dtype: dtype of the result: fp16, bf16 or fp32; default ``a.dtype``.
        preact: optional (M, N) contiguous tensor of ``a``'s dtype that receives
            ``a @ b + bias`` before the activation (what its gradient needs).

    Returns:
        A new contiguous (M, N) tensor. K == 0 gives ``act(bias)`` (zeros without bias).

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    _, _, _, out_dtype = check_matmul_args(a, b, bias, activation, out_dtype, preact)
    return matmul_prechecked(a, b, bias, activation, out_dtype, preact)


def matmul_prechecked(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    out_dtype: torch.dtype,
    preact: torch.Tensor | None,
    into: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """:func:`matmul` for a caller that has validated the arguments itself
    (:func:`tkern.linear` checks its inputs once; its backward feeds the GEMM
    tensors it made): the hot path, with no checks repeated per call. ``into``:
    an (M, N) tensor of ``out_dtype`` the product is added to (``accumulate``) or
    written into, and returned. Scheduled by :func:`plan_for` (gemm_plan.py)."""
    (M, K), N = a.shape, b.shape[1]
    plain = bias is None and activation is None and preact is None
    plan = plan_for(a, b, M, N, K, split=plain)
    return run_plan(plan, a, b, M, N, K, bias, activation, out_dtype, preact, into, accumulate)


def run_plan(
    plan: GemmPlan,
    a: torch.Tensor,
    b: torch.Tensor,
    M: int,
    N: int,
    K: int,
    bias: torch.Tensor | None,
    activation: str | None,
    out_dtype: torch.dtype,
    preact: torch.Tensor | None,
    into: torch.Tensor | None = None,
    accumulate: bool = True,
    a_sum: torch.Tensor | None = None,
    transpose_a: bool = False,
    add_sum: bool = False,
) -> torch.Tensor:
    """``act(a @ b + bias)`` on the kernel ``plan`` names, for arguments already
    checked; with ``transpose_a`` ``a`` is given as its (K, M) transpose and read in
    place. ``a_sum`` (split-K and the pointer kernel): a contiguous (M,) tensor
    receiving A's row sums, summed in fp32 (added to it with ``add_sum``, beside a C
    accumulated into ``into``). A TMA plan whose operands a descriptor cannot describe,
    or with ``a_sum``, runs on the pointer kernel."""
    sa = a.stride()[::-1] if transpose_a else a.stride()
    if plan.kernel == SPLIT_K:
        splits, chunk = plan.split_k, plan.k_chunk
        return launch_split_k(a, sa, b, M, N, K, splits, chunk, out_dtype, a_sum, into, accumulate, add_sum)
    if plan.kernel == TMA and a_sum is None:
        if transpose_a:
            a = a.t()
        layouts = tma_layouts(a, b)
        if layouts is not None:
            # Ragged: the pointer kernel cannot prove 16-byte alignment, every load is a
            # 16-bit scalar without cp.async (255 registers and spills, see the static
            # report); descriptors zero-fill the edges and keep wgmma fed. Many waves: the
            # persistent schedule wins (gemm_plan.TMA_MIN_WAVES).
            return launch_tma(a, b, M, N, K, bias, activation, out_dtype, preact, layouts, into, accumulate)
    prologue = NO_PROLOGUE if a_sum is None else OperandPrologue(a_sum=a_sum, add_sum=add_sum)
    sb = b.stride()
    args = (bias, activation, out_dtype, preact, NO_SCALES, prologue, into, accumulate)
    return _launch(a, sa, b, sb, M, N, K, *args)


def device_gemm_info(device: torch.device) -> tuple[int, bool]:
    """``(SMs, TMA)`` of ``device`` as :func:`gemm_plan.plan_gemm` takes them, from its
    :class:`tkern.DeviceSpec` (no TMA on AMD's GPUs: the pointer kernel and split-K):
    ``(0, False)`` under the interpreter and off CUDA (no SM count: the pointer
    kernel alone, as before there was a plan). The tests' seam for a GPU's routing."""
    if device.type != "cuda":
        return 0, False
    spec = tkdev.device_spec(device)  # the interpreter's spec under TRITON_INTERPRET=1
    return (0, False) if spec.vendor == "cpu" else (spec.sms, spec.tma)


#: How many shapes :func:`plan_gemm_cached` remembers (least recently used dropped past it):
#: a model's GEMMs are a few dozen shapes, a varying sequence length a few thousand.
PLAN_CACHE_SIZE = 4096


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan_gemm_cached(m: int, n: int, k: int, num_sms: int, tma: bool, ragged: bool, split: bool) -> GemmPlan:
    """:func:`gemm_plan.plan_gemm`, remembered for the last :data:`PLAN_CACHE_SIZE` shapes:
    the hot path asks once per shape."""
    return plan_gemm(m, n, k, num_sms, tma=tma, ragged=ragged, split=split)


def plan_for(a: torch.Tensor, b: torch.Tensor, M: int, N: int, K: int, split: bool = True) -> GemmPlan:
    """The plan of ``a`` (M, K) @ ``b`` (K, N) on their device (:func:`device_gemm_info`):
    ``ragged`` from the operands' shapes and strides (``gemm_configs.operands_ragged``),
    TMA where the device has it and a descriptor can describe both operands."""
    num_sms, tma = device_gemm_info(a.device)
    if num_sms <= 0:
        return _NO_PLAN
    ragged = operands_ragged(a, b)
    plan = plan_gemm_cached(M, N, K, num_sms, tma, ragged, split)
    if plan.kernel == TMA and tma_layouts(a, b) is None:  # no descriptor: plan without TMA
        plan = plan_gemm_cached(M, N, K, num_sms, False, ragged, split)
    return plan


def plan_for_shape(device: torch.device, m: int, n: int, k: int, split: bool = True) -> GemmPlan:
    """The plan of ``(m, k) @ (k, n)`` on ``device`` for dense operands (strides their
    dimensions): what :func:`plan_for` gives them, ragged where a dimension is not a
    multiple of 16 elements (``tkern.linear`` decides its backward's prologue by it
    before the GEMMs run)."""
    num_sms, tma = device_gemm_info(device)
    if num_sms <= 0:
        return _NO_PLAN
    ragged = any(d % VECTOR_ELEMS for d in (m, n, k))
    return plan_gemm_cached(m, n, k, num_sms, tma, ragged, split)


#: Row stride (in elements) of the copy :func:`tma_aligned_rows` makes: 64 half-precision
#: elements, 128 bytes (a multiple of the 16 bytes a tensor descriptor needs, and of the
#: 16 elements the pointer kernel's vector loads need: gemm_configs.VECTOR_ELEMS).
ROW_ALIGN_ELEMS = 64


def tma_aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) itself, or, on a device with TMA when a tensor descriptor cannot
    describe ``t``'s rows (a row stride that is not a multiple of 16 bytes: the LM
    head's dlogits over GPT-2's 50257 classes, 100514 bytes a row), a copy of the
    same values whose rows start :data:`ROW_ALIGN_ELEMS`-aligned (a view of the first
    ``t.shape[1]`` columns of a padded buffer; the padding is never read). One read
    and one write of ``t``, so that both GEMMs that read it take the TMA kernel
    instead of the pointer kernel's scalar loads (gemm_configs.RAGGED_MAX_TILE)."""
    if not device_gemm_info(t.device)[1] or t.dim() != 2 or t.stride(1) != 1 or t.shape[1] <= 1:
        return t
    size = t.element_size()  # the offset, not data_ptr(): traced (fake) tensors have no data
    if (t.stride(0) * size) % TMA_ALIGN_BYTES == 0 and (t.storage_offset() * size) % TMA_ALIGN_BYTES == 0:
        return t
    rows, cols = t.shape
    width = -(-cols // ROW_ALIGN_ELEMS) * ROW_ALIGN_ELEMS
    padded = torch.empty(rows, width, dtype=t.dtype, device=t.device)[:, :cols]
    return padded.copy_(t)


#: The plan where no SM count is known (the interpreter, CPU tensors): the pointer kernel.
_NO_PLAN = GemmPlan(POINTER, 1, 0, 0, 0.0)


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
    precise_acc: bool = False  # PRECISE_ACC: fp8 partial sums promoted every K tile

    def args(self, dummy: torch.Tensor) -> tuple:
        """The kernel's scale arguments, from ``scale_a_ptr`` to ``block_bn``."""
        sa = self.scale_a if self.scale_a is not None else dummy
        sb = self.scale_b if self.scale_b is not None else dummy
        sam, sak = (sa.stride(0), sa.stride(1)) if sa.dim() == 2 else (0, 0)
        sbk, sbn = (sb.stride(0), sb.stride(1)) if sb.dim() == 2 else (0, 0)
        return (sa, sb, sam, sak, sbk, sbn, *self.block_a, *self.block_b)


NO_SCALES = OperandScales()
#: :meth:`OperandScales.args` of NO_SCALES after its two (dummy) pointers.
_NO_SCALE_ARGS = (0, 0, 0, 0, *NO_SCALES.block_a, *NO_SCALES.block_b)
#: How each pointer-kernel launch seen so far runs again without the autotuner, by
#: everything its autotune key holds and more (operand, bias, output and sum dtypes,
#: activation, pre-activation, M, N, K, both operands' strides, fp8 scale kinds and
#: the prologue): ``_common.DirectLaunch``. Like the autotuner's own cache it keeps
#: one entry per shape.
_LAUNCHES: dict[tuple, DirectLaunch] = {}


class OperandPrologue(NamedTuple):
    """What :func:`matmul_backward`'s kernel does to its A operand (the constexprs
    ``A_ACT``, ``STORE_A``, ``SUM_A``, ``ADD_SUM``): ``A' = A * act'(z)`` when ``activation``
    is set, ``A'`` stored into ``a_out`` and its fp32 row sums into ``a_sum`` (added to what
    it holds with ``add_sum``, a launch that also accumulates C)."""

    activation: str | None = None
    z: torch.Tensor | None = None  # (M, K), a's strides
    a_out: torch.Tensor | None = None  # (M, K), a's strides
    a_sum: torch.Tensor | None = None  # (M,) contiguous
    add_sum: bool = False

    def args(self, dummy: torch.Tensor) -> tuple:
        """The kernel's prologue pointers, ``z_ptr`` to ``a_sum_ptr``."""
        z, out, sums = self.z, self.a_out, self.a_sum
        return (dummy if z is None else z, dummy if out is None else out, dummy if sums is None else sums)

    def meta(self) -> dict:
        """The kernel's prologue constexprs."""
        return {
            "A_ACT": ACTIVATIONS[self.activation],
            "STORE_A": self.a_out is not None,
            "SUM_A": self.a_sum is not None,
            "ADD_SUM": self.add_sum,
        }


NO_PROLOGUE = OperandPrologue()


def _prologue_without_gemm(a: torch.Tensor, prologue: OperandPrologue) -> None:
    """The prologue's outputs when the GEMM has no output tile (N == 0: no
    program runs) or no row (M == 0): A' by the standalone kernel, its sums by torch."""
    ap = a if prologue.activation is None else activation_grad(a, prologue.z, prologue.activation)
    if prologue.a_out is not None:
        prologue.a_out.copy_(ap)
    if prologue.a_sum is not None:
        sums = ap.sum(1, dtype=torch.float32)
        prologue.a_sum.add_(sums) if prologue.add_sum else prologue.a_sum.copy_(sums)


def _launch_matmul(
    a,
    b,
    M,
    N,
    K,
    bias,
    activation,
    out_dtype,
    preact,
    scales: OperandScales = NO_SCALES,
    prologue: OperandPrologue = NO_PROLOGUE,
    into: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """:func:`matmul` (and :func:`scaled_mm`, :func:`matmul_backward`) after its arguments were checked."""
    sa, sb = a.stride(), b.stride()
    return _launch(
        a, sa, b, sb, M, N, K, bias, activation, out_dtype, preact, scales, prologue, into, accumulate
    )


def _kernel_meta(
    a_dtype, bias, activation, out_dtype, preact, a_t, b_t, scales, prologue, accumulate, read=None
) -> dict:
    """The pointer kernel's constexprs for one launch."""
    return {
        **epilogue_meta(a_dtype, bias, activation, out_dtype, preact, accumulate),
        "A_T": a_t, "B_T": b_t, "SCALE_A": scales.kind_a, "SCALE_B": scales.kind_b,
        "PRECISE_ACC": scales.precise_acc,
        **prologue.meta(),  # A_ACT is in the autotune key: passed even when off
        **read_meta(read),  # GRAD_ACT and GLU_FWD are in the key too: passed even when off
    }  # fmt: skip


def _launch(
    a, sa, b, sb, M, N, K, bias, activation, out_dtype, preact, scales, prologue, into=None, accumulate=True,
    read=None,
) -> torch.Tensor:  # fmt: skip
    """The pointer kernel on ``a`` (M, K) with strides ``sa`` and ``b`` (K, N) with
    strides ``sb``: explicit strides let a caller pass a tensor for its transpose
    (``linear`` reads W^T from W) without building a view. The hot path of every
    eager GEMM: one allocation, one dict lookup, one launch; the first launch of
    each :data:`_LAUNCHES` key goes through the autotuner, the later ones call the
    config it chose directly (``_common.resolve_launch``). ``into``: an (M, N)
    tensor of ``out_dtype`` (any strides) the result is added to (``accumulate``)
    or written into, and returned, instead of a new one. ``read``: a
    :class:`EpilogueRead`, the epilogue's product with act'(z) (z read where a pre-activation
    would be stored), a gated unit's two gradients, or a residual added."""
    c = torch.empty(M, N, dtype=out_dtype, device=a.device) if into is None else into
    if M == 0 or N == 0:
        if prologue is not NO_PROLOGUE:
            _prologue_without_gemm(a, prologue)  # prologue launches pass a with its own strides
        return c
    sc = (N, 1) if into is None else into.stride()
    pre = preact if read is None else read.z
    args = (
        a, b, c, c if bias is None else bias, c if pre is None else pre,
        M, N, K, *sa, *sb, *sc, bias_stride(bias),
        *(scales.args(c) if scales is not NO_SCALES else (c, c, *_NO_SCALE_ARGS)),
        *(prologue.args(c) if prologue is not NO_PROLOGUE else (c, c, c)),
    )  # fmt: skip
    key = (a.dtype, b.dtype, None if bias is None else bias.dtype, activation, out_dtype,
           preact is not None, M, N, K, sa, sb, scales.kind_a, scales.kind_b, prologue.activation,
           prologue.a_out is not None,
           None if prologue.a_sum is None else (prologue.a_sum.dtype, prologue.add_sum),
           None if into is None else sc, accumulate, scales.precise_acc,
           None if read is None else (read.activation, *read[2:]))  # fmt: skip
    accumulate = into is not None and accumulate
    if scales is NO_SCALES:
        kernel = _matmul_accumulate_kernel if accumulate else _matmul_kernel
    else:
        kernel = _scaled_mm_accumulate_kernel if accumulate else _scaled_mm_kernel
    direct = _LAUNCHES.get(key)
    if direct is not None and direct.kernel is kernel:
        direct.jit[direct.grid](*args, **direct.kwargs)
        return c

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    meta = _kernel_meta(
        a.dtype, bias, activation, out_dtype, preact, transposed(sa), transposed(sb), scales, prologue,
        accumulate, read,
    )  # fmt: skip
    direct = resolve_launch(kernel, grid, args, meta)
    if direct is not None:
        _LAUNCHES[key] = direct
    return c


def linear_prechecked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    preact: torch.Tensor | None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` in ``x``'s dtype for :func:`tkern.linear`, which
    checked its arguments (x (M, K), weight (N, K)): :func:`matmul_prechecked` on
    ``weight.T``, which the pointer kernel reads in place through ``weight``'s
    strides (no view made per call)."""
    if device_gemm_info(x.device)[0] > 0:  # a GPU: matmul_prechecked's plan, on the view
        return matmul_prechecked(x, weight.t(), bias, activation, x.dtype, preact)
    (M, K), N = x.shape, weight.shape[0]
    sw = weight.stride()
    return _launch(x, x.stride(), weight, (sw[1], sw[0]), M, N, K, bias, activation, x.dtype, preact,
                   NO_SCALES, NO_PROLOGUE)  # fmt: skip


def linear_residual_prechecked(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """``residual + (x @ weight.T + bias)`` in ``x``'s dtype, the add in the epilogue (fp32,
    one rounding), for a caller that checked its arguments (x (M, K), weight (N, K), residual
    (M, N) contiguous of ``x``'s dtype): the pre-norm block's last layer writing the residual
    stream, ``tkern.ops.mlp``'s. The pointer or TMA kernel (never split-K: no epilogue)."""
    return _launch_reading(x, weight.t(), EpilogueRead(None, residual, residual=True), None, bias)


def matmul_row_stats_prechecked(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, stats: torch.Tensor
) -> torch.Tensor:
    """``out = a @ b (+ bias)`` (fp32 accumulation, one rounding to ``out``'s dtype) and, in the
    same epilogue, the softmax statistics of each row of ``out`` per ``STATS_COLS`` columns
    into ``stats`` (gemm_epilogue's ``ROW_STATS``), for a caller that checked its arguments:
    ``a`` (M, K) and ``b`` (K, N) 16-bit, any strides; ``out`` (M, N) of any of fp16 / bf16 /
    fp32, any strides; ``stats`` a contiguous fp32 (M, ``row_stats_slots(N)``, 2). The head's
    logits of ops/loss_chunks.py, whose row logsumexp the cross-entropy kernel then takes from
    ``stats`` instead of a pass over the row. The pointer or TMA kernel (never split-K: its
    reduction has no epilogue). Returns ``out``."""
    return _launch_reading(a, b, EpilogueRead(None, stats, row_stats=True), out, bias)


def matmul_backward(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    activation: str | None = None,
    z: torch.Tensor | None = None,
    a_out: torch.Tensor | None = None,
    a_sum: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A' @ b`` with fp32 accumulation, in ``a``'s dtype, where ``A' = a * act'(z)``
    (computed in fp32, rounded once to ``a``'s dtype) when ``activation`` is set, else
    ``a``: the linear backward's GEMMs with the activation's gradient applied while
    the operand is loaded, and optionally ``A'`` and its row sums written on the way.

    ``A'`` is bit-identical to ``activation.activation_grad(a, z, activation)``, and
    the product to :func:`matmul` on that ``A'``: dgrad ``dY @ W`` reads dY and the
    saved pre-activation instead of a dZ made by another pass (and stores dZ for
    wgrad with ``a_out``); wgrad ``dZ^T @ X`` sums dZ^T's rows into dbias with
    ``a_sum``. Always the pointer kernel (the TMA kernel has no prologue).

    Args:
        a: (M, K) fp16 or bf16, any strides (dY, dZ, or a transposed view of either).
        b: (K, N), ``a``'s dtype, any strides.
        activation: None, or an activation (``"relu"``, ``"gelu"``, ...) whose
            gradient multiplies ``a``; then ``z`` is required.
        z: (M, K) pre-activation, ``a``'s dtype and strides (``z^T`` read in place
            when ``a`` is ``dY^T``).
        a_out: optional (M, K) tensor of ``a``'s dtype and strides, not sharing
            memory with ``a`` or ``z``: receives ``A'``.
        a_sum: optional contiguous (M,) tensor, fp32 or ``a``'s dtype: receives
            ``A'.sum(1)`` accumulated in fp32 (rounded once to its dtype).
        out: optional (M, N) tensor of ``a``'s dtype, any strides, not sharing
            memory with the other tensors: the product is written into it and it
            is returned (the wgrad written straight into a gradient buffer).
        accumulate_into: like ``out``, but the product is added to it in place
            (read in fp32, ``round(C + A' @ b)``: one rounding, where
            ``C += A' @ b`` in torch rounds the product first): the wgrad
            accumulated into a gradient buffer. At most one of the two.

    Returns:
        A new contiguous (M, N) tensor of ``a``'s dtype, or ``out`` / ``accumulate_into``.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    M, _, K, _ = check_matmul_args(a, b, None, None, None, None)
    check_activation(activation)
    if (activation is None) != (z is None):
        raise ValueError(
            f"z (the pre-activation) is needed exactly when activation is set; got activation="
            f"{activation!r} and z {'None' if z is None else 'given'}"
        )
    for name, t in (("z", z), ("a_out", a_out)):
        if t is None:
            continue
        check_tensor(name, t, ndim=2, dtypes=(a.dtype,))
        if t.shape != a.shape or t.stride() != a.stride():
            raise ValueError(
                f"{name} must have a's shape {tuple(a.shape)} and strides {a.stride()}, "
                f"got shape {tuple(t.shape)}, strides {t.stride()}"
            )
    if a_out is not None and _shares_memory(a_out, a, z):
        raise ValueError("a_out must not share memory with a or z: other programs still read them")
    if a_sum is not None:
        check_tensor("a_sum", a_sum, ndim=1, dtypes=(torch.float32, a.dtype))
        if a_sum.shape != (M,) or (M > 1 and a_sum.stride(0) != 1):
            raise ValueError(
                f"a_sum must be a contiguous ({M},) tensor, got shape {tuple(a_sum.shape)}, "
                f"strides {a_sum.stride()}"
            )
    into, accumulate = _output_into(out, accumulate_into, (M, b.shape[1]), a.dtype, a, b, z, a_out, a_sum)
    check_same_device(a=a, z=z, a_out=a_out, a_sum=a_sum, out=out, accumulate_into=accumulate_into)
    return matmul_backward_prechecked(a, b, activation, z, a_out, a_sum, False, into, accumulate)


def _output_into(out, accumulate_into, shape: tuple[int, int], dtype: torch.dtype, *others):
    """``(tensor, accumulate)``: where a GEMM's result of ``shape`` goes (``out``:
    written; ``accumulate_into``: added; None: a new tensor), after checking it:
    at most one of the two, 2-D, ``dtype`` and ``shape``, no memory shared with the
    GEMM's other tensors ``others`` (programs read those while others store C)."""
    if out is not None and accumulate_into is not None:
        raise ValueError("give out or accumulate_into, not both")
    c, name = (out, "out") if accumulate_into is None else (accumulate_into, "accumulate_into")
    if c is None:
        return None, False
    check_tensor(name, c, ndim=2, dtypes=(dtype,))
    if tuple(c.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(c.shape)}")
    check_int32_addressable(name, c)
    if _shares_memory(c, *others):
        raise ValueError(f"{name} must not share memory with the GEMM's other tensors")
    return c, accumulate_into is not None


def _shares_memory(t: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether ``t`` has storage in common with any of ``others`` (None skipped;
    empty tensors share nothing: they all have address 0)."""
    if not t.numel():
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(o is not None and o.numel() and o.untyped_storage().data_ptr() == ptr for o in others)


def matmul_backward_prechecked(
    a: torch.Tensor,
    b: torch.Tensor,
    activation: str | None,
    z: torch.Tensor | None,
    a_out: torch.Tensor | None,
    a_sum: torch.Tensor | None,
    transpose_a: bool = False,
    into: torch.Tensor | None = None,
    accumulate: bool = True,
    add_sum: bool = False,
) -> torch.Tensor:
    """:func:`matmul_backward` for a caller that made or checked its arguments
    (:func:`tkern.linear`'s backward): the hot path, no checks repeated.

    ``transpose_a``: ``a``, ``z`` and ``a_out`` are given as their transposes
    (K, M), read in place through swapped strides (the wgrad ``dZ^T @ X``
    without a view per call); ``a_sum`` is still (M,). ``into``: the
    ``accumulate_into`` (``accumulate``) or ``out`` tensor, or None. ``add_sum``: the
    row sums are added to ``a_sum`` (a bias gradient into its ``.grad``, beside dW added
    into ``into``: only with ``accumulate``)."""
    if add_sum and (into is None or not accumulate or a_sum is None):
        raise ValueError("add_sum adds the row sums into a_sum beside a product accumulated into `into`")
    if transpose_a and (a.numel() == 0 or b.shape[1] == 0):  # the empty shapes take views
        t = [None if v is None else v.t() for v in (a, z, a_out)]
        return matmul_backward_prechecked(
            t[0], b, activation, t[1], t[2], a_sum, False, into, accumulate, add_sum
        )
    (M, K), N = (a.shape[::-1] if transpose_a else a.shape), b.shape[1]
    if activation is None and a_out is None:
        # plain, or with A's row sums (dbias): planned (split-K sums them per K range; the
        # TMA kernel has none, so a TMA plan with sums runs on the pointer kernel)
        plan = _NO_PLAN
        if device_gemm_info(a.device)[0] > 0:
            plan = plan_for(a.t() if transpose_a else a, b, M, N, K)
        args = (None, None, a.dtype, None, into, accumulate, a_sum, transpose_a, add_sum)
        return run_plan(plan, a, b, M, N, K, *args)
    # The TMA and split-K kernels have no act' prologue and store no A': these launches
    # take the pointer kernel on every GPU, ragged operands on Hopper included (its
    # configs for them are pruned so that nothing spills); the dot runs on the same A'.
    sa = a.stride()[::-1] if transpose_a else a.stride()
    prologue = OperandPrologue(activation, z, a_out, a_sum, add_sum)
    sb = b.stride()
    return _launch(a, sa, b, sb, M, N, K, None, None, a.dtype, None, NO_SCALES, prologue, into, accumulate)


def matmul_grad_act(a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """``(a @ b) * act'(z)``: the product accumulated in fp32, multiplied by the
    activation's gradient in fp32 in the epilogue and rounded once to ``a``'s dtype.

    The dgrad of the layer after an activation, ``dZ = (dY @ W) * act'(Z)`` with Z the
    pre-activation the layer before stored (its forward epilogue's ``preact``): dZ in
    one launch, where ``matmul`` then ``activation.activation_grad`` round dH = dY @ W
    first and make a second pass over it. On the pointer kernel or, where the plan says
    so (Hopper), the TMA kernel; never split-K (its reduction has no epilogue).

    Args:
        a: (M, K) fp16 or bf16, any strides.
        b: (K, N), ``a``'s dtype, any strides.
        z: (M, N) contiguous, ``a``'s dtype: the pre-activation.
        activation: an activation other than None (``"relu"``, ``"gelu"``, ``"silu"``,
            ``"gelu_tanh"``).

    Returns:
        A new contiguous (M, N) tensor of ``a``'s dtype.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    _check_grad_epilogue(a, b, "z", z, 1, activation, "matmul_grad_act needs an activation")
    return matmul_grad_act_prechecked(a, b, z, activation)


def _check_grad_epilogue(a, b, name: str, z, width: int, activation, refusal: str) -> None:
    """A dgrad-epilogue GEMM's checks: ``a @ b``'s operands, an activation (None refused with
    ``refusal``) and ``z`` (``name``) a contiguous (M, ``width`` N) tensor of ``a``'s dtype."""
    M, N, _, _ = check_matmul_args(a, b, None, None, None, None)
    check_activation(activation)
    if activation is None:
        raise ValueError(f"{refusal}, got None")
    check_tensor(name, z, ndim=2, dtypes=(a.dtype,))
    if tuple(z.shape) != (M, width * N) or not z.is_contiguous():
        raise ValueError(f"{name} must be a contiguous ({M}, {width * N}) tensor, got shape {tuple(z.shape)}")
    check_int32_addressable(name, z)
    check_same_device(a=a, **{name: z})


def matmul_grad_act_prechecked(
    a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, activation: str
) -> torch.Tensor:
    """:func:`matmul_grad_act` for a caller that checked its arguments (the hot path)."""
    return _launch_reading(a, b, EpilogueRead(activation, z), None)


def _launch_reading(a, b, read: EpilogueRead, into, bias=None) -> torch.Tensor:
    """A GEMM whose epilogue reads ``read`` (a dgrad epilogue, or a residual added) or writes
    it (row statistics) on the kernel the plan names (the pointer or TMA kernel, never
    split-K: its reduction has no epilogue); C new (``a``'s dtype) or ``into`` (its own)."""
    (M, K), N = a.shape, b.shape[1]
    out_dtype = a.dtype if into is None else into.dtype
    if device_gemm_info(a.device)[0] > 0:
        plan = plan_for(a, b, M, N, K, split=False)
        layouts = tma_layouts(a, b) if plan.kernel == TMA else None
        if layouts is not None:
            return launch_tma(a, b, M, N, K, bias, None, out_dtype, None, layouts, into, False, read)
    sa, sb = a.stride(), b.stride()
    return _launch(
        a, sa, b, sb, M, N, K, bias, None, out_dtype, None, NO_SCALES, NO_PROLOGUE, into, False, read
    )


def matmul_grad_glu(a: torch.Tensor, b: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradients of a gated unit ``h = act(gate) * up`` from the GEMM that produces
    dH: ``dH = a @ b`` accumulated in fp32, then in the epilogue, in fp32 and each rounded
    once to ``a``'s dtype, ``d(gate) = dH * up * act'(gate)`` and ``d(up) = dH * act(gate)``.

    The dgrad of the layer after a GLU (Llama's ``down_proj``: ``dH = dY @ W_down``), with
    ``gate_up`` the gate and up projections side by side (the forward's saved (M, 2N)
    tensor): one launch writes ``[d(gate) | d(up)]`` as one (M, 2N) tensor, where
    :func:`matmul` then ``swiglu_backward`` round dH first and pass over it again. On the
    pointer kernel or, where the plan says so, the TMA kernel; never split-K.

    Args:
        a: (M, K) fp16 or bf16, any strides (dY).
        b: (K, N), ``a``'s dtype, any strides (W_down, (hidden, N) read as is).
        gate_up: (M, 2N) contiguous, ``a``'s dtype: gate in columns ``[0, N)``, up in ``[N, 2N)``.
        activation: the gate's activation (``"silu"``: SwiGLU; ``"gelu_tanh"``, ``"gelu"``,
            ``"relu"``).

    Returns:
        A new contiguous (M, 2N) tensor of ``a``'s dtype: ``[d(gate) | d(up)]``.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched.
    """
    _check_grad_epilogue(
        a, b, "gate_up", gate_up, 2, activation, "matmul_grad_glu needs the gate's activation"
    )
    return matmul_grad_glu_prechecked(a, b, gate_up, activation)


def matmul_grad_glu_prechecked(
    a: torch.Tensor, b: torch.Tensor, gate_up: torch.Tensor, activation: str
) -> torch.Tensor:
    """:func:`matmul_grad_glu` for a caller that checked its arguments (the hot path)."""
    M, N = a.shape[0], b.shape[1]
    d = torch.empty(M, 2 * N, dtype=a.dtype, device=a.device)
    _launch_reading(a, b, EpilogueRead(activation, gate_up[:, :N], glu=True), d[:, :N])
    return d


def matmul_glu_prechecked(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, gate_up: torch.Tensor, activation: str
) -> torch.Tensor:
    """The up GEMM of a gated unit ``h = act(gate) * up`` whose gate GEMM ran first, for a caller
    that checked its arguments (``tkern.ops.mlp``'s forward): ``up = a @ b + bias`` accumulated
    in fp32, rounded once and stored into ``gate_up[:, N:]``; in the same epilogue the stored
    ``gate_up[:, :N]`` read and ``h = act(gate) * up`` computed in fp32 from the two 16-bit
    values and rounded once: bit for bit what ``swiglu.swiglu_forward`` makes of the stored gate
    and up, without its pass over them (the epilogue's ``GLU_FWD``). On the pointer kernel or,
    where the plan says so, the TMA kernel; never split-K.

    Args:
        a: (M, K) fp16 or bf16, any strides (x); b: (K, N), ``a``'s dtype, any strides (W_up^T,
            read in place). bias: optional (N,), ``a``'s dtype or fp32 (up's).
        gate_up: (M, 2N) contiguous, ``a``'s dtype, gate in columns ``[0, N)``; up is written
            into ``[N, 2N)``.
        activation: the gate's activation (``"silu"``: SwiGLU; ``"gelu_tanh"``, ``"gelu"``,
            ``"relu"``).

    Returns:
        A new contiguous (M, N) tensor of ``a``'s dtype: ``h``.
    """
    M, N = a.shape[0], b.shape[1]
    h = torch.empty(M, N, dtype=a.dtype, device=a.device)
    _launch_reading(a, b, EpilogueRead(activation, gate_up, glu_forward=True), h, bias)
    return h


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
    loads (gemm_tma.py), the layout Hopper favours; same arguments, same result.

    Operands a descriptor cannot describe (no unit-stride dimension, or
    addresses and strides not 16-byte aligned), and GPUs before Hopper (no
    TMA), go to :func:`matmul`'s pointer kernel. :func:`matmul` itself runs
    it on Hopper where :func:`plan_for` says so (ragged operands, and
    :data:`gemm_plan.TMA_MIN_WAVES` waves of tiles or more); this entry point
    runs it on every shape it can, for the benchmark (benchmarks/bench_gemm.py)
    to compare.
    """
    M, N, K, out_dtype = check_matmul_args(a, b, bias, activation, out_dtype, preact)
    layouts = tma_layouts(a, b)
    if layouts is None or not (INTERPRET or has_tma(a.device)):
        # before Hopper there is no TMA: the descriptor loads compile to scalar
        # loads without cp.async and the kernel spills (see the static report)
        return _launch_matmul(a, b, M, N, K, bias, activation, out_dtype, preact)
    return launch_tma(a, b, M, N, K, bias, activation, out_dtype, preact, layouts)


# --------------------------------------------------------------------------- fp8 (scaled_mm)

#: fp8 operand formats (float8.FP8_DTYPES: OCP and FNUZ; the pairs the tensor cores take
#: are one family's e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3: refuse_e5m2_pair).
#: Block scales change along K at most once per this many elements: every K tile
#: of every config (BLOCK_K <= 128) then lies inside one scale block, and partial
#: sums are promoted to fp32 at least this often (DeepSeek-V3's interval).
SCALE_BLOCK_K = 128


def _infer_block(size: int, count: int) -> int:
    """The block length that gives ``count`` scales over ``size`` elements:
    ceil(size / count) rounded up to a power of two."""
    return triton.next_power_of_2(max(1, triton.cdiv(size, max(count, 1))))


def _scale_layout(
    scale: torch.Tensor, rows: int, cols: int, vector_shape: tuple[int, int], block
) -> tuple[int, tuple[int, int]]:
    """(kind, block shape) of an operand's scale over its (rows, cols) elements, as the
    kernel reads it, for a scale :func:`_check_scale` accepts: one element (per tensor),
    ``vector_shape`` (per row of a / column of b), else a 2-D block grid (``block`` or
    the shape :func:`_infer_block` finds)."""
    if block is None:
        if scale.numel() == 1:
            return SCALE_TENSOR, (1, 1)
        if tuple(scale.shape) == vector_shape:
            return SCALE_VECTOR, (1, 1)
        return SCALE_BLOCK, (_infer_block(rows, scale.shape[0]), _infer_block(cols, scale.shape[1]))
    return SCALE_BLOCK, (int(block[0]), int(block[1]))


def _check_scale(
    name: str, scale: torch.Tensor, rows: int, cols: int, vector_shape: tuple[int, int], block, k_dim: int
) -> tuple[int, tuple[int, int]]:
    """Raise unless ``scale`` is a valid fp32 scale of an operand of (rows, cols) elements
    (:func:`_scale_layout`'s kinds; ``k_dim``: which of the two is K, 1 for a, 0 for b);
    its (kind, block shape)."""
    check_tensor(name, scale, dtypes=(torch.float32,))
    per_tensor_or_vector = block is None and (scale.numel() == 1 or tuple(scale.shape) == vector_shape)
    if not per_tensor_or_vector and scale.dim() != 2:
        raise ValueError(
            f"{name} must have one element, shape {vector_shape} or a 2-D block grid; "
            f"got shape {tuple(scale.shape)}"
        )
    if block is not None and not (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)
    ):
        raise ValueError(f"the block shape of {name} must be two positive ints, got {block!r}")
    kind, block = _scale_layout(scale, rows, cols, vector_shape, block)
    if kind != SCALE_BLOCK:
        return kind, block
    grid, want = tuple(scale.shape), (triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1]))
    if grid != want:
        raise ValueError(
            f"{name} has shape {grid}, but blocks of {block} over ({rows}, {cols}) need {want} scales"
        )
    if block[k_dim] % SCALE_BLOCK_K:
        raise ValueError(
            f"{name}: block scales must span a multiple of {SCALE_BLOCK_K} along K, got blocks of {block}"
        )
    return SCALE_BLOCK, block


def _check_fp8_device(device: torch.device, dtypes=()) -> None:
    check_fp8_device(device, "scaled_mm", dtypes)


#: The tensor-core instructions whose fp8 operands must both be K-major in shared memory
#: (Triton cannot transpose fp8 tiles there: it stages them through registers).
K_MAJOR_FP8_MMA = frozenset({"wgmma", "tcgen05"})


def k_major_fp8_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (M, K) and ``b`` (K, N) as scaled_mm launches them: where the device's
    tensor cores read fp8 from shared memory (:data:`K_MAJOR_FP8_MMA`: Hopper, B200),
    an operand without unit stride along K is copied K-major (one transposing copy);
    elsewhere (mma.sync, MFMA, the interpreter) both as they are."""
    spec = float8.compiled_spec(a.device)  # through the module: the one seam tests answer
    if spec is None or spec.mma not in K_MAJOR_FP8_MMA or a.shape[1] <= 1:
        return a, b
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    return a, b


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
    out: torch.Tensor | None = None,
    accumulate_into: torch.Tensor | None = None,
    use_fast_accum: bool = False,
    activation: str | None = None,
    preact: torch.Tensor | None = None,
    emit_fp8: Float8Emit | None = None,
    prechecked: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, Float8Emitted]:
    """``act((a.float() * scale_a) @ (b.float() * scale_b) + bias)``, accumulated in fp32 and
    rounded once to ``out_dtype``, as ``torch._scaled_mm`` defines its scales. :func:`matmul`'s
    kernel (tiles, ordering, epilogue, configs) with the scales on the fp32 accumulator.

    Args:
        a: (M, K) ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or their FNUZ forms,
            gfx942's), any strides.
        b: (K, N) fp8, any strides; e5m2 x e5m2 is refused (no such tensor-core op).
        scale_a: fp32: one element (per tensor), (M, 1) (per row of a), or block scales
            (ceil(M / bm), ceil(K / bk)); scale_b: one element, (1, N) (per column of b),
            or block scales (ceil(K / bk), ceil(N / bn)).
        bias: optional (N,) bf16, fp16 or fp32, added after the scales.
        out_dtype: bf16 (default), fp16 or fp32.
        block_a, block_b: the block shapes (bm, bk) / (bk, bn) of block scales; omitted: ceil(size
            / scales) per dimension rounded up to a power of two (finds DeepSeek-V3's (1, 128) and
            (128, 128)). K extents are multiples of 128: partial sums are promoted that often.
        out: optional (M, N) tensor of ``out_dtype``, any strides, sharing no memory with
            the other tensors: the result is written into it and returned (``_scaled_mm``'s).
        accumulate_into: like ``out``, but the result is added to it in place (read in
            fp32, rounded once): a Float8Linear's wgrad into a fused optimizer's gradient
            buffer. At most one of the two.
        use_fast_accum: as ``torch._scaled_mm``'s: False (the default) promotes the fp8 tensor
            cores' partial sums into the fp32 accumulator every K tile (<= 128 of K) on Hopper;
            True keeps them in the tensor cores' accumulator (faster, fewer bits: Float8Linear's
            forward). Block scales are promoted every K tile either way. No effect elsewhere.
        activation: None, ``"relu"``, ``"gelu"`` (erf form), ``"silu"`` or ``"gelu_tanh"``,
            in fp32 in the epilogue after the scales and the bias, as :func:`matmul`'s (a
            Float8Linear's fused MLP activation). Per-tensor or per-row scales only.
        preact: optional (M, N) contiguous ``out_dtype`` tensor receiving the scaled ``a @ b +
            bias`` before the activation, rounded once (for act's gradient); per-tensor or per-row scales.
        emit_fp8: a :class:`~tkern.kernels.gemm_emit.Float8Emit`: the epilogue also writes
            the next fp8 GEMM's e4m3 input in both layouts, bit for bit ``cast_2d`` of the
            result (as rounded to ``out_dtype``) under that GEMM's recipe (gemm_emit.py says
            how), and the call returns ``(result, Float8Emitted(data, data_t, scale))``.
            Per-tensor or per-row scales, bf16 / fp16 ``out_dtype``, no ``out`` / ``accumulate_into``.
        prechecked: True from a caller whose fp32-scaled arguments are valid by construction
            (Float8Linear's own casts): nothing is checked (:func:`scaled_mm_prechecked`).

    MX operands (``torch.float8_e8m0fnu`` scales, ``tkern.to_mx``'s) run on
    :func:`~tkern.kernels.gemm_mx.scaled_mm_mx` (shapes there; e5m2 x e5m2 too) with ``bias``,
    ``activation`` and ``preact`` only; a GPU without native MX raises ``RuntimeError``.
    Which kernel runs, and when an operand is copied K-major first: :func:`scaled_mm_prechecked`.
    Returns a new contiguous (M, N) tensor of ``out_dtype``, or ``out`` / ``accumulate_into``.

    Raises:
        TypeError / ValueError naming the argument, before anything is launched; RuntimeError
        on a GPU without fp8 tensor cores (before Ada, sm_89).
    """
    if prechecked:
        into, accumulate = (out, False) if accumulate_into is None else (accumulate_into, True)
    elif is_mx_scale(scale_a) or is_mx_scale(scale_b):
        _check_mx_call(block_a, block_b, out, accumulate_into, emit_fp8)
        return scaled_mm_mx(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, activation=activation,
                            preact=preact)  # fmt: skip
    else:
        into, accumulate = check_scaled_mm_args(
            a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, out, accumulate_into, use_fast_accum,
            activation, preact, emit_fp8,
        )  # fmt: skip
    return scaled_mm_prechecked(
        a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum, activation, preact, into,
        accumulate, emit_fp8,
    )  # fmt: skip


def check_scaled_mm_args(
    a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, out, accumulate_into, use_fast_accum,
    activation, preact, emit_fp8,
) -> tuple[torch.Tensor | None, bool]:  # fmt: skip
    """Every check :func:`scaled_mm` makes of fp32-scaled operands (its arguments, in its
    order), raising ``TypeError`` / ``ValueError`` that names the argument (``RuntimeError``
    on a GPU without fp8 tensor cores); returns where the result goes: ``(into, accumulate)``."""
    M, N, K = check_operands(a, b, FP8_DTYPES, refuse_e5m2_pair)
    check_out_dtype(out_dtype)
    check_bias(bias, N, None)
    kind_a, _ = _check_scale("scale_a", scale_a, M, K, (M, 1), block_a, 1)
    kind_b, _ = _check_scale("scale_b", scale_b, K, N, (1, N), block_b, 0)
    into, accumulate = _output_into(out, accumulate_into, (M, N), out_dtype, a, b, scale_a, scale_b, bias)
    check_same_device(
        a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out=out, accumulate_into=accumulate_into
    )
    _check_fp8_device(a.device, (a.dtype, b.dtype))
    check_int32_addressable("a", a)
    check_int32_addressable("b", b)
    check_int32_elements("out", (M, N))
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be True or False, got {use_fast_accum!r}")
    _check_fp8_epilogue(
        activation, preact, (M, N), out_dtype, kind_a, kind_b, a, b, scale_a, scale_b, bias, into
    )
    if emit_fp8 is not None:
        check_emit(emit_fp8, out_dtype, SCALE_BLOCK in (kind_a, kind_b), into, a)
    return into, accumulate


def scaled_mm_prechecked(
    a, b, scale_a, scale_b, bias, out_dtype, block_a, block_b, use_fast_accum, activation=None,
    preact=None, into=None, accumulate=True, emit_fp8=None,
):  # fmt: skip
    """:func:`scaled_mm` of fp32-scaled operands for a caller whose arguments are valid
    (:func:`check_scaled_mm_args` passed, or it made them so: Float8Linear's forward and
    backward feed the GEMM their own casts): the hot path, no checks repeated. ``into``
    (``out`` or ``accumulate_into``, with ``accumulate``) may be None; block shapes may
    be None or empty (inferred, as :func:`scaled_mm`'s).

    Block scales on both operands with 128-wide K blocks and 1 or 128 rows / columns
    per scale (DeepSeek-V3's 1x128 activations and 128x128 weights, and the blockwise
    wgrad's 128x1 columns of X), K-major 16-byte aligned operands, on Hopper (or the
    interpreter) run on the persistent TMA kernel of gemm_blockwise.py (one K step per
    scale block, promoted with one fused multiply-add). Every other call (before Hopper,
    other block shapes, one operand block-scaled and the other not, a K that is not a
    multiple of 16) runs on the pointer kernel, which applies block scales per K tile.

    On Hopper (sm_90) an fp8 ``wgmma`` reads both operands K-major (``a`` with unit
    stride along K, ``b`` with unit stride along K: ``b = w.t()`` of a row-major
    ``w`` (N, K)): an operand that is not is copied K-major once before the launch
    (Float8Linear's casts write every operand K-major and never pay it)."""
    (M, K), N = a.shape, b.shape[1]
    kind_a, blk_a = _scale_layout(scale_a, M, K, (M, 1), tuple(block_a) if block_a else None)
    kind_b, blk_b = _scale_layout(scale_b, K, N, (1, N), tuple(block_b) if block_b else None)
    a, b = k_major_fp8_operands(a, b)
    # one element as (1, 1); (M, 1), (1, N) and block grids as they are (2-D, any strides)
    sa = scale_a.reshape(1, 1) if kind_a == SCALE_TENSOR else scale_a
    sb = scale_b.reshape(1, 1) if kind_b == SCALE_TENSOR else scale_b
    if kind_a == SCALE_BLOCK and kind_b == SCALE_BLOCK and blockwise_eligible(a, b, blk_a, blk_b):
        # DeepSeek-V3's 1x128 / 128x128 scales on Hopper: one K step per scale block, TMA,
        # persistent (gemm_blockwise.py); promoted every 128 of K whatever use_fast_accum says
        return launch_blockwise(a, b, sa, sb, blk_a, blk_b, bias, out_dtype, into, accumulate)
    scales = OperandScales(kind_a, kind_b, sa, sb, blk_a, blk_b, not use_fast_accum)
    if emit_fp8 is not None:
        return launch_emit(a, b, M, N, K, bias, activation, out_dtype, preact, scales, emit_fp8)
    return _launch_matmul(
        a, b, M, N, K, bias, activation, out_dtype, preact, scales, NO_PROLOGUE, into, accumulate
    )


def _check_mx_call(block_a, block_b, out, accumulate_into, emit_fp8) -> None:
    """Raise ``ValueError`` for a :func:`scaled_mm` argument MX (e8m0) scales do not take."""
    given = {"block_a": block_a, "block_b": block_b, "out": out, "accumulate_into": accumulate_into,
             "emit_fp8": emit_fp8}  # fmt: skip
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise ValueError(f"scaled_mm with MX (e8m0) scales takes no {', '.join(named)} (32-wide K blocks)")


def _check_fp8_epilogue(activation, preact, shape, out_dtype, kind_a, kind_b, *others) -> None:
    """Raise unless :func:`scaled_mm`'s ``activation`` and ``preact`` are valid for a
    launch of ``shape`` with scales of kinds ``kind_a`` / ``kind_b``: an activation the
    epilogue computes; ``preact`` None or a contiguous ``shape`` tensor of ``out_dtype``
    sharing no memory with the GEMM's ``others``; either only with per-tensor or
    per-row scales (the pointer kernel's epilogue; the blockwise kernel has none)."""
    check_activation(activation)
    if activation is None and preact is None:
        return
    if SCALE_BLOCK in (kind_a, kind_b):
        raise ValueError(
            "scaled_mm's activation and preact take per-tensor or per-row scales, not block scales"
        )
    if preact is not None:
        check_preact(preact, shape, out_dtype)
        check_same_device(a=others[0], preact=preact)
        if _shares_memory(preact, *others):
            raise ValueError("preact must not share memory with the GEMM's other tensors")


def launch_emit(a, b, M, N, K, bias, activation, out_dtype, preact, scales, emit: Float8Emit):
    """:func:`scaled_mm` with ``emit_fp8`` after its arguments were checked (``a`` and ``b``
    K-major where the device needs them): ``(C, Float8Emitted)``."""
    dev = a.device
    delayed = emit.scaling == "delayed"
    history = emit.history if delayed else None
    roll = delayed and emit.update
    c = torch.empty(M, N, dtype=out_dtype, device=dev)
    if M == 0 or N == 0:  # no tile, no program: the cast's own launch (it rolls the histories)
        cast = cast_2d_prechecked(
            c, emit.dtype, True, emit.store_t, None, history, emit.margin, emit.update, False,
            emit.counter if roll else None, emit.roll2,
        )  # fmt: skip
        return c, Float8Emitted(cast.data, cast.data_t, cast.scale)
    count = roll or not delayed
    data = torch.empty((M, N), dtype=emit.dtype, device=dev) if delayed else None
    data_t = torch.empty((N, M), dtype=emit.dtype, device=dev) if delayed and emit.store_t else None
    scale = torch.empty((), dtype=torch.float32, device=dev)
    tiles = triton.cdiv(M, _MIN_FP8_TILE[0]) * triton.cdiv(N, _MIN_FP8_TILE[1])
    partials = torch.empty(tiles, dtype=torch.float32, device=dev) if count else None
    amax = torch.empty(1, dtype=torch.float32, device=dev) if not delayed else None
    counter = (emit.counter if emit.counter is not None else emit_counter(dev)) if count else None
    roll2 = emit.roll2 if roll else None
    h2, amax2 = roll2 if roll2 is not None else (c, c)
    h, n2, count2 = (history.numel() if delayed else 0), h2.numel(), amax2.numel()
    sa, sb = a.stride(), b.stride()
    args = (
        a, b, c, c if bias is None else bias, c if preact is None else preact, M, N, K, *sa, *sb, N, 1,
        bias_stride(bias), *scales.args(c), *(c if t is None else t for t in (data, data_t)), scale,
        *(scale if t is None else t for t in (partials, amax, history, counter)), h2, amax2,
        h, n2 if roll2 is not None else 0, count2 if roll2 is not None else 0, 2.0**-emit.margin,
    )  # fmt: skip
    key = ("emit", a.dtype, b.dtype, None if bias is None else bias.dtype, activation, out_dtype,
           preact is not None, M, N, K, sa, sb, scales.kind_a, scales.kind_b, scales.precise_acc,
           delayed, emit.store_t, count, roll2 is not None, h, n2, count2)  # fmt: skip
    direct = _LAUNCHES.get(key)
    if direct is not None and direct.kernel is _scaled_mm_emit_kernel:
        direct.jit[direct.grid](*args, **direct.kwargs)
    else:

        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        const8 = fp8_constants(emit.dtype)
        const8["DTYPE8"] = const8.pop("DTYPE")
        meta = {
            **epilogue_meta(a.dtype, bias, activation, out_dtype, preact), "A_T": transposed(sa),
            "B_T": transposed(sb), "SCALE_A": scales.kind_a, "SCALE_B": scales.kind_b,
            "PRECISE_ACC": scales.precise_acc, "DELAYED": delayed, "STORE_T": emit.store_t,
            "COUNT": count, "ROLL2": roll2 is not None, **const8, "CHUNK": EMIT_CHUNK,
            "HBLOCK": triton.next_power_of_2(max(h, n2, 1)), "PBLOCK2": triton.next_power_of_2(count2),
        }  # fmt: skip
        del meta["ACCUMULATE"]  # the emitting kernel never adds into C
        direct = resolve_launch(_scaled_mm_emit_kernel, grid, args, meta)
        if direct is not None:
            _LAUNCHES[key] = direct
    if not delayed:  # the one cast pass, with the max |C| this launch found
        cast = cast_2d_prechecked(c, emit.dtype, True, emit.store_t, None, None, 0, False, False, None,
                                  None, amax)  # fmt: skip
        return c, Float8Emitted(cast.data, cast.data_t, cast.scale)
    if roll:  # in-place writes, as torch's own would count them
        for t in (history, None if roll2 is None else roll2[0]):
            if t is not None and not t.is_inference():
                torch.autograd.graph.increment_version(t)
    return c, Float8Emitted(data, data_t, scale)
