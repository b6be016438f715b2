"""The persistent GEMM with tensor-descriptor (TMA) loads, the schedule Hopper favours.

The same ``C = act(A @ B + bias)`` and epilogue as the pointer kernel
(gemm.py), but one program per SM walks the output tiles, and A and B tiles
are fetched by the tensor memory accelerator, which zero-fills out-of-range
rows and columns. ``tkern.kernels.gemm.matmul_tma_persistent`` (and, for
ragged operands on Hopper, ``matmul``) launch it through :func:`launch_tma`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern import device as tkdev
from tkern.kernels._common import INTERPRET
from tkern.kernels.gemm_configs import gemm_autotune, tma_configs
from tkern.kernels.gemm_epilogue import (
    bias_stride,
    epilogue,
    epilogue_meta,
    epilogue_tma,
    read_meta,
    tile_coords,
)

#: Tensor descriptors need 16-byte aligned base addresses and strides.
TMA_ALIGN_BYTES = 16
#: Programs of the persistent loop under the interpreter: few, each looping over tiles.
_INTERPRET_PROGRAMS = 4


#: What the TMA kernel's autotuners choose a config by (both: plain and ``C +=``).
_AUTOTUNE_KEY = [
    "M",
    "N",
    "K",
    "OUT_DTYPE",
    "ACTIVATION",
    "A_T",
    "B_T",
    "C_TMA",
    "GRAD_ACT",
    "GRAD_GLU",
    "ADD_RESIDUAL",
    "GLU_FWD",
    "ROW_STATS",
]


@gemm_autotune(configs=tma_configs(), key=_AUTOTUNE_KEY, tma=True)
@triton.jit
def _matmul_tma_kernel(
    # descriptors and pointers
    a_desc,  # descriptor of A (M, K), or of A^T (K, M) when A_T; fp16/bf16
    b_desc,  # descriptor of B (K, N), or of B^T (N, K) when B_T; a's dtype
    c_desc,  # descriptor of C (M, N) when C_TMA (block: BLOCK_M x a column slice); else unused
    c_ptr,  # (M, N) OUT_DTYPE
    bias_ptr,  # (N,) a's dtype or fp32; unused unless HAS_BIAS
    preact_ptr,  # (M, N) a's dtype, c's strides: A @ B + bias before the activation (STORE_PREACT),
    # or the Z whose act' multiplies the result (GRAD_ACT); else unused
    # dimensions
    M,
    N,
    K,
    # strides, in elements
    stride_cm,
    stride_cn,
    stride_bias,
    # meta-parameters; constexpr so the untaken branches are compiled out
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 relu, 2 gelu (erf form)
    STORE_PREACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PREACT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (the interpreter cannot multiply bf16)
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    NUM_SMS: tl.constexpr,  # programs launched: each walks tiles NUM_SMS apart
    C_TMA: tl.constexpr,  # C stored (and read, ACCUMULATE) through c_desc: the TMA-store epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,  # column slices of the GELU epilogue (see gemm_epilogue.epilogue)
    ACCUMULATE: tl.constexpr = False,  # C += A @ B (C's old value read in the epilogue)
    GRAD_ACT: tl.constexpr = 0,  # C = (A @ B) * act'(Z), Z at preact_ptr (the pointer epilogue)
    GRAD_GLU: tl.constexpr = False,  # with GRAD_ACT: a gated unit's two gradients (the pointer epilogue)
    ADD_RESIDUAL: tl.constexpr = False,  # the (M, N) tensor at preact_ptr added (epilogue's ADD_RESIDUAL)
    GLU_FWD: tl.constexpr = 0,  # activation code: C = act(gate) * up, up stored (epilogue's GLU_FWD)
    ROW_STATS: tl.constexpr = False,  # C's softmax statistics written at preact_ptr (the pointer epilogue)
):
    """C = act(A @ B + bias) (or C += A @ B), fp32 accumulation, persistent (one program per SM
    walks the tiles) with A and B fetched by the tensor memory accelerator
    through descriptors, and C stored through one where it can describe C (C_TMA). Shapes above."""
    # Persistent: one program per SM loops over output tiles, so tile start-up
    # overlaps the previous tile's epilogue. Descriptors zero-fill out-of-range
    # rows and columns: the ragged edges need no masks until the store.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
        if C_TMA:
            epilogue_tma(
                acc, pid_m, pid_n, N, c_desc, bias_ptr, stride_bias, HAS_BIAS, ACTIVATION, OUT_DTYPE,
                BLOCK_M, BLOCK_N, EPI_SPLIT, ACCUMULATE,
            )  # fmt: skip
        else:
            epilogue(
                acc, pid_m, pid_n, M, N, c_ptr, bias_ptr, preact_ptr, stride_cm, stride_cn, stride_bias,
                HAS_BIAS, ACTIVATION, STORE_PREACT, OUT_DTYPE, PREACT_DTYPE, BLOCK_M, BLOCK_N, EPI_SPLIT,
                ACCUMULATE, GRAD_ACT, GRAD_GLU, ADD_RESIDUAL, GLU_FWD, ROW_STATS,
            )  # fmt: skip


#: The TMA kernel's launches with ``ACCUMULATE``: its own autotuner, which restores
#: C after each config it benchmarks (see gemm._matmul_accumulate_kernel).
_matmul_tma_accumulate_kernel = gemm_autotune(
    configs=tma_configs(), key=_AUTOTUNE_KEY, tma=True, restore=("c_ptr",)
)(_matmul_tma_kernel.fn)


def tma_layout(t: torch.Tensor) -> str | None:
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


def tma_layouts(a: torch.Tensor, b: torch.Tensor) -> tuple[str, str] | None:
    """Both operands' descriptor layouts (``"row"`` or ``"col"``), or None when
    :func:`launch_tma` cannot run on them (a layout missing, or an empty dimension)."""
    layouts = tma_layout(a), tma_layout(b)
    return None if None in layouts or min(*a.shape, *b.shape) == 0 else layouts


def tma_eligible(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``tkern.kernels.gemm.matmul_tma_persistent`` runs the TMA kernel on ``a`` and ``b``."""
    return tma_layouts(a, b) is not None


def has_tma(device) -> bool:
    """Whether ``device`` (a torch device or a :class:`tkern.DeviceSpec`) has the tensor
    memory accelerator: its spec's ``tma`` (Hopper, sm_90, or newer NVIDIA; never AMD's
    GPUs, never the interpreter)."""
    return tkdev.device_spec(device).tma


def persistent_programs(device) -> int:
    """Programs a persistent GEMM launches on ``device``: one per SM (a few under the
    interpreter, which still walks several tiles per program)."""
    if INTERPRET:
        return _INTERPRET_PROGRAMS  # exercises the persistent loop
    return tkdev.device_spec(device).sms


def launch_tma(
    a, b, M, N, K, bias, activation, out_dtype, preact, layouts, into=None, accumulate=True, read=None
) -> torch.Tensor:
    """``act(a @ b + bias)`` on :func:`_matmul_tma_kernel`, for arguments already
    checked (``gemm_epilogue.check_matmul_args``) and ``layouts`` from
    :func:`tma_layouts` (not None); with ``into`` (an (M, N) tensor of
    ``out_dtype``, any strides), ``into += a @ b`` (``accumulate``, no bias or
    activation) or the result written into it, returned. ``read``: a
    ``gemm_epilogue.EpilogueRead``, ``(a @ b) * act'(z)`` for an (M, N) ``z`` with C's
    strides, a gated unit's two gradients (no bias, activation or preact; C new or
    ``into``, not accumulated), ``z`` added to ``act(a @ b + bias)`` (``residual``), or a
    gated unit's forward (``glu_forward``: up, ``a @ b + bias``, stored into ``z``'s right
    half, ``act(gate) * up`` into C), through the pointer epilogue, which reads Z beside C."""
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
    c = torch.empty((M, N), dtype=out_dtype, device=a.device) if into is None else into
    # The TMA-store epilogue where a descriptor can describe C (row-major, 16-byte aligned
    # rows) and nothing else is stored beside it (the pre-activation keeps the pointer
    # epilogue); the block shape is a placeholder the config's pre-hook replaces.
    c_tma = preact is None and read is None and tma_layout(c) == "row"
    c_desc = TensorDescriptor(c, [M, N], [c.stride(0), 1], [16, 16]) if c_tma else c
    num_sms = persistent_programs(a.device)
    accumulate = into is not None and accumulate
    kernel = _matmul_tma_accumulate_kernel if accumulate else _matmul_tma_kernel

    def grid(meta):
        return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    z = preact if read is None else read.z
    kernel[grid](
        a_desc, b_desc, c_desc, c, bias if bias is not None else c, z if z is not None else c,
        M, N, K, c.stride(0), c.stride(1), bias_stride(bias),
        **epilogue_meta(a.dtype, bias, activation, out_dtype, preact, accumulate),
        A_T=a_t,
        B_T=b_t,
        NUM_SMS=num_sms,
        C_TMA=c_tma,
        **read_meta(read),
    )  # fmt: skip
    return c
