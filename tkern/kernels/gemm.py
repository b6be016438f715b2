"""GEMM with FP32 accumulation and a fused epilogue.

``C = act(A @ B + bias)`` for fp16 or bf16 ``A`` (M, K) and ``B`` (K, N) of any
strides. Products are accumulated in an FP32 tile; the epilogue (bias,
activation, one cast) runs on that FP32 tile, so the only rounding to half
precision is the final store.
"""

from __future__ import annotations

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


@_autotune(configs=gemm_configs(), key=["M", "N", "K", "OUT_DTYPE", "ACTIVATION"])
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
):
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
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

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
    check_int32_addressable("out", torch.empty((M, N), device="meta"))

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
        "PREACT_DTYPE": tl_dtype(dtype),
        "UPCAST": INTERPRET and dtype == torch.bfloat16,  # the interpreter cannot multiply bf16
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
    M, N, K, out_dtype = _check_matmul_args(a, b, bias, activation, out_dtype, preact)
    if _ragged(a, b) and _tma_layouts(a, b) is not None and _has_tma(a.device):
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
    return not INTERPRET and torch.cuda.get_device_capability(device)[0] >= 9


def _launch_matmul(a, b, M, N, K, bias, activation, out_dtype, preact) -> torch.Tensor:
    """:func:`matmul` after its arguments were checked."""
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](
        a, b, c, bias if bias is not None else c, preact if preact is not None else c,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), _bias_stride(bias),
        **_epilogue_meta(a.dtype, bias, activation, out_dtype, preact),
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
