"""The MX (block-scaled) fp8 GEMM: one ``tl.dot_scaled`` per K tile, e8m0 scales per 32 of K.

``C = act((A * 2^(sa - 127)) @ (B * 2^(sb - 127)) + bias)`` for fp8 ``A`` (M, K) with
one e8m0 scale per 32 consecutive elements of a row (``scale_a`` (M, K / 32)) and fp8
``B`` (K, N) with one per 32 of a column (``scale_b`` given as the transposed
operand's, (N, K / 32), as ``torch._scaled_mm`` and ``tl.dot_scaled`` take it).
Each K tile is one ``tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)`` into the fp32
accumulator: on Blackwell (sm_100) a ``tcgen05.mma`` with block scales, on MI355X
(gfx950) ``v_mfma_scale``; the epilogue (bias, pre-activation, activation, one
rounding) and the grouped tile order are gemm_epilogue.py's, as the other GEMMs'.
Under Triton's interpreter ``tl.dot_scaled`` upcasts both operands with their scales
and multiplies exactly (an fp8 x fp8 product times two powers of two fits in fp32).

Elsewhere (Hopper, Ada, older AMD) Triton would emulate the product through bf16,
slower than tkern's bf16 GEMM: :func:`scaled_mm_mx` refuses with a ``RuntimeError``
naming the device and the fp8 recipes it runs, before anything is compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern import device as _device
from tkern.kernels._common import (
    INTERPRET,
    autotune,
    check_int32_addressable,
    check_same_device,
    check_tensor,
)
from tkern.kernels.activation import check_activation
from tkern.kernels.gemm_epilogue import (
    bias_stride,
    check_bias,
    check_operands,
    check_out_dtype,
    check_preact,
    epilogue,
    epilogue_meta,
    tile_coords,
)

#: fp8 element formats and their names for ``tl.dot_scaled``.
MX_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
#: Elements along K per e8m0 scale.
MX_BLOCK = 32
E8M0 = torch.float8_e8m0fnu
#: The fp8 recipes tkern runs on a GPU with fp8 tensor cores but no native MX MMA.
FP32_SCALE_RECIPES = ("tensorwise", "delayed", "blockwise")


def mx_configs() -> list[triton.Config]:
    """The tiles the autotuner tries. Compiled for sm_100 (Triton 3.9, tests/test_compiled_mx.py),
    128x128x64 on 8 warps is ``tcgen05.mma ... kind::mxf8f6f4.block_scale.block32`` and spills
    nothing; 128x128x128 spills 160-520 B (4 or 8 warps), 128x256x128 368 B, and a 64x64
    tile is no native MX MMA at all (``kind::f16``: upcast through 16 bits), so none of those
    is offered. The interpreter runs 64x64x64 (one program for a 64x64 problem)."""
    small = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "EPI_SPLIT": 1},
                          num_warps=4, num_stages=3)  # fmt: skip
    if INTERPRET:
        return [small]
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "EPI_SPLIT": 2},
                        num_warps=8, num_stages=3)  # fmt: skip
    return [big]


@autotune(configs=mx_configs(), key=["M", "N", "K", "OUT_DTYPE", "ACTIVATION", "A_FMT", "B_FMT"])
@triton.jit
def _scaled_mm_mx_kernel(
    # pointers
    a_ptr,  # (M, K) fp8 (A_FMT), strides (stride_am, stride_ak)
    b_ptr,  # (K, N) fp8 (B_FMT), strides (stride_bk, stride_bn)
    c_ptr,  # (M, N) OUT_DTYPE, strides (stride_cm, stride_cn)
    bias_ptr,  # (N,) bf16/fp16/fp32, stride stride_bias; unused unless HAS_BIAS
    preact_ptr,  # (M, N) PREACT_DTYPE, c's strides; unused unless STORE_PREACT
    scale_a_ptr,  # (M, K // 32) uint8 (e8m0), strides (stride_sam, stride_sak)
    scale_b_ptr,  # (N, K // 32) uint8 (e8m0): B's columns' scales, strides (stride_sbn, stride_sbk)
    # dimensions (K a multiple of 32)
    M,
    N,
    K,
    # strides, in elements
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    # meta-parameters
    A_FMT: tl.constexpr,  # "e4m3" or "e5m2"
    B_FMT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32: BLOCK_K // 32 scales per row per K tile
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) output tile: fp32 accumulation of one scaled dot per K tile,
    then the shared epilogue. Masked past M, N and K (zeros, scale 2^0 past K)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_K // 32)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        kb = k0 // 32 + offs_s
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(ks < K)[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        sa = tl.load(scale_a_ptr + offs_m[:, None] * stride_sam + kb[None, :] * stride_sak,
                     mask=mask_m[:, None] & (kb < K // 32)[None, :], other=127)  # fmt: skip
        sb = tl.load(scale_b_ptr + offs_n[:, None] * stride_sbn + kb[None, :] * stride_sbk,
                     mask=mask_n[:, None] & (kb < K // 32)[None, :], other=127)  # fmt: skip
        acc = tl.dot_scaled(a, sa, A_FMT, b, sb, B_FMT, acc=acc)  # the arguments triton 3.6-3.9 share
    epilogue(
        acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
        HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_M, BLOCK_N, EPI_SPLIT,
    )  # fmt: skip


def is_mx_scale(scale: object) -> bool:
    """Whether ``scale`` is an MX (e8m0) scale tensor: ``tkern.scaled_mm`` routes those here."""
    return isinstance(scale, torch.Tensor) and scale.dtype == E8M0


def check_mx_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` unless ``device`` multiplies MX formats natively (Blackwell
    sm_100, MI355X gfx950, or the interpreter), naming the device and the fp8 recipes it runs."""
    spec = _device.device_spec(device)
    if spec.mx:
        return
    if spec.fp8:
        runs = f"it runs tkern's fp8 recipes with fp32 scales ({', '.join(FP32_SCALE_RECIPES)})"
    else:
        runs = "it has no fp8 tensor cores, so no fp8 recipe (use bf16)"
    raise RuntimeError(
        f"MX (e8m0 block-scaled) GEMMs need native MX tensor cores (Blackwell sm_100, MI355X gfx950); "
        f"{spec.name} ({spec.arch}, {device}) has none (Triton would emulate them through bf16); {runs}"
    )


def scaled_mm_mx(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    activation: str | None = None,
    preact: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act((a * 2^(scale_a - 127)) @ (b * 2^(scale_b - 127)) + bias)`` (scales expanded
    over their 32-element blocks of K), fp32 accumulation, rounded once to ``out_dtype``.

    Args:
        a: (M, K) ``torch.float8_e4m3fn`` or ``float8_e5m2``, any strides; K a multiple of 32.
        b: (K, N) fp8, any strides (K-major, ``w.t()`` of a row-major (N, K) ``w``, is fastest).
        scale_a: (M, K / 32) ``torch.float8_e8m0fnu``: ``tkern.to_mx(x)``'s scales.
        scale_b: (N, K / 32) e8m0: the scales of b's columns, as ``tkern.to_mx(b.t())`` gives them.
        bias: optional (N,) bf16, fp16 or fp32. out_dtype: bf16 (default), fp16 or fp32.
        activation: None, ``"relu"``, ``"gelu"``, ``"silu"`` or ``"gelu_tanh"`` (epilogue, fp32).
        preact: optional contiguous (M, N) ``out_dtype`` tensor receiving ``a @ b + bias``.

    Raises:
        TypeError / ValueError: naming the argument, before anything is launched;
        RuntimeError on a GPU without native MX (before anything is compiled).
    """
    M, N, K = check_operands(a, b, tuple(MX_FORMATS))
    if K % MX_BLOCK:
        raise ValueError(f"MX operands need K a multiple of {MX_BLOCK}, got K = {K}")
    # one e8m0 scale per 32 of K: a's rows', b's columns' (as b^T's rows)
    check_tensor("scale_a", scale_a, ndim=2, dtypes=(E8M0,), shape=(M, K // MX_BLOCK))
    check_tensor("scale_b", scale_b, ndim=2, dtypes=(E8M0,), shape=(N, K // MX_BLOCK))
    check_out_dtype(out_dtype)
    check_bias(bias, N, None)
    check_activation(activation)
    check_preact(preact, (M, N), out_dtype)
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, preact=preact)
    check_mx_device(a.device)
    for name, t in (("a", a), ("b", b)):
        check_int32_addressable(name, t)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    sa, sb = scale_a.view(torch.uint8), scale_b.view(torch.uint8)
    meta = epilogue_meta(out_dtype, bias, activation, out_dtype, preact)
    del meta["ACCUMULATE"], meta["UPCAST"]

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _scaled_mm_mx_kernel[grid](
        a, b, c, c if bias is None else bias, c if preact is None else preact, sa, sb, M, N, K,
        *a.stride(), *b.stride(), *c.stride(), bias_stride(bias), *sa.stride(), *sb.stride(),
        A_FMT=MX_FORMATS[a.dtype], B_FMT=MX_FORMATS[b.dtype], **meta,
    )  # fmt: skip
    return c
