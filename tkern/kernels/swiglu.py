"""The gated activation of a GLU MLP, ``h = act(gate) * up`` (SwiGLU with SiLU, GeGLU with
a GELU), forward and backward, computed in fp32 and rounded once.

Llama's MLP is ``down(act(gate(x)) * up(x))``: unfused, torch runs the activation, the
product and their gradients as separate kernels over the (tokens, intermediate)
activation, each rounding to 16 bits. Here one kernel reads ``gate`` and ``up`` and
writes ``h``; its backward reads ``dh``, ``gate`` and ``up`` and writes ``dgate`` and
``dup``. The activation's formulas are activation.py's jit helpers (the GEMM epilogue's).

``gate`` and ``up`` (and the gradients) are 2-D with unit column stride and any row
stride, so the two halves of one (tokens, 2 * intermediate) GEMM output (Phi-3's
``gate_up_proj``) are read, and their gradients written, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    HALF_DTYPES,
    INTERPRET,
    cast_rne,
    cdiv,
    check_int32_addressable,
    check_same_device,
    check_tensor,
    tl_dtype,
)
from tkern.kernels.activation import ACTIVATIONS, activation_grad_f32, apply_activation, check_activation

#: Elements per program: large under the interpreter, where each program costs
#: milliseconds; on a GPU the forward's 4096 (4 warps x 32 threads x 4 vectors of 8 halves:
#: 16-byte loads; 38 registers, 75% occupancy on sm_90), the backward's 1024 (one vector of
#: each of its five arrays per thread: at 4096 it held 168 registers, 19% occupancy, and
#: spilled on sm_80 for tanh-GELU in bf16; the compile gate's swiglu cases).
FWD_ELEMENTS = 65536 if INTERPRET else 4096
BWD_ELEMENTS = 65536 if INTERPRET else 1024
#: The widest column block: a row of up to this many columns is one block (the rest of
#: BLOCK_ELEMENTS goes to rows); 1024 = 4 warps x 32 threads x 8 halves on a GPU.
MAX_BLOCK_N = 4096 if INTERPRET else 1024
NUM_WARPS = 4


# --------------------------------------------------------------------------- kernels


@triton.jit
def _tile(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column offsets of block (pid_m, pid_n) and its mask."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows < M)[:, None] & (cols < N)[None, :]


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr,  # (M, N) fp16/bf16, strides (stride_g, 1)
    up_ptr,  # (M, N) same dtype, strides (stride_u, 1)
    h_ptr,  # (M, N) output, same dtype, strides (stride_h, 1)
    M,
    N,
    stride_g,
    stride_u,
    stride_h,
    ACTIVATION: tl.constexpr,  # an activation.ACTIVATIONS code other than 0
    DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """h = act(gate) * up, in fp32 from the 16-bit inputs, one rounding on the store."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    rows = rows.to(tl.int64)[:, None]  # int64 rows: a row stride times M may pass 2^31
    g = tl.load(gate_ptr + rows * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = apply_activation(g, ACTIVATION) * u
    tl.store(h_ptr + rows * stride_h + cols[None, :], cast_rne(h, DTYPE), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr,  # (M, N) upstream gradient, fp16/bf16, strides (stride_dh, 1)
    gate_ptr,  # (M, N) the forward's gate, same dtype, strides (stride_g, 1)
    up_ptr,  # (M, N) the forward's up, strides (stride_u, 1)
    dgate_ptr,  # (M, N) output, strides (stride_dg, 1)
    dup_ptr,  # (M, N) output, strides (stride_du, 1)
    M,
    N,
    stride_dh,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    ACTIVATION: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dup = dh * act(gate); dgate = (dh * up) * act'(gate); in fp32, each rounded once."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    rows = rows.to(tl.int64)[:, None]
    cols = cols[None, :]
    dh = tl.load(dh_ptr + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        dup_ptr + rows * stride_du + cols, cast_rne(dh * apply_activation(g, ACTIVATION), DTYPE), mask=mask
    )
    dg = activation_grad_f32(dh * u, g, ACTIVATION)
    tl.store(dgate_ptr + rows * stride_dg + cols, cast_rne(dg, DTYPE), mask=mask)


# --------------------------------------------------------------------------- launchers


def _blocks(m: int, n: int, elements: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): a whole row up to MAX_BLOCK_N columns, rows filling ``elements``."""
    block_n = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK_N)
    block_m = max(1, min(elements // block_n, triton.next_power_of_2(max(m, 1))))
    return block_m, block_n


def _check_operand(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype | None) -> None:
    """Raise unless ``t`` is a ``shape`` tensor of ``dtype`` (None: fp16 or bf16) with unit
    column stride that int32 offsets reach."""
    check_tensor(name, t, ndim=2, dtypes=HALF_DTYPES if dtype is None else (dtype,), shape=shape)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")
    check_int32_addressable(name, t)


def _check_activation(activation: str) -> None:
    check_activation(activation)
    if activation is None:
        raise ValueError("the gated activation needs an activation (e.g. 'silu'), got None")


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` computed in fp32, returned as a new contiguous tensor of the inputs' dtype.

    Args:
        gate: (M, N), fp16/bf16, unit column stride (any row stride).
        up: (M, N), ``gate``'s dtype, unit column stride.
        activation: a name in :data:`tkern.kernels.activation.ACTIVATIONS` other than None
            (``"silu"``: SwiGLU; ``"gelu_tanh"`` / ``"gelu"``: GeGLU).
    """
    _check_activation(activation)
    check_tensor("gate", gate, ndim=2, dtypes=HALF_DTYPES)
    shape = tuple(gate.shape)
    _check_operand("gate", gate, shape, None)
    _check_operand("up", up, shape, gate.dtype)
    check_same_device(gate=gate, up=up)
    return swiglu_forward_prechecked(gate, up, activation)


def swiglu_forward_prechecked(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`swiglu_forward` on tensors the caller made or checked (``tkern.ops.mlp``'s
    gate and up, the halves of the buffer its GEMMs wrote): the launch."""
    shape = tuple(gate.shape)
    h = torch.empty(shape, dtype=gate.dtype, device=gate.device)
    if h.numel():
        block_m, block_n = _blocks(*shape, FWD_ELEMENTS)
        _swiglu_fwd_kernel[(cdiv(shape[0], block_m), cdiv(shape[1], block_n))](
            gate, up, h, *shape, gate.stride(0), up.stride(0), h.stride(0),
            ACTIVATION=ACTIVATIONS[activation], DTYPE=tl_dtype(gate.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS,
        )  # fmt: skip
    return h


def swiglu_backward(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str = "silu",
    dgate: torch.Tensor | None = None,
    dup: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of ``h = act(gate) * up`` from ``dh``, computed in fp32, each rounded once.

    Args:
        dh: (M, N) upstream gradient, fp16/bf16, unit column stride.
        gate, up: (M, N), what the forward read, ``dh``'s dtype, unit column stride.
        activation: as :func:`swiglu_forward`.
        dgate, dup: optional (M, N) outputs of ``dh``'s dtype with unit column stride
            (e.g. the two halves of one buffer); new contiguous tensors where None.
    """
    _check_activation(activation)
    check_tensor("dh", dh, ndim=2, dtypes=HALF_DTYPES)
    shape = tuple(dh.shape)
    dgate = torch.empty(shape, dtype=dh.dtype, device=dh.device) if dgate is None else dgate
    dup = torch.empty(shape, dtype=dh.dtype, device=dh.device) if dup is None else dup
    for name, t in (("dh", dh), ("gate", gate), ("up", up), ("dgate", dgate), ("dup", dup)):
        _check_operand(name, t, shape, dh.dtype)
    check_same_device(dh=dh, gate=gate, up=up, dgate=dgate, dup=dup)
    return swiglu_backward_prechecked(dh, gate, up, activation, dgate, dup)


def swiglu_backward_prechecked(dh, gate, up, activation: str, dgate, dup) -> tuple[torch.Tensor, ...]:
    """:func:`swiglu_backward` for a backward that trusts its tensors (``tkern.swiglu``'s: gate
    and up checked by its forward and saved, dgate and dup its own, dh autograd's gradient of
    the output with unit column stride, whose int32 reach alone it checks): the launch."""
    shape = tuple(dh.shape)
    if dh.numel():
        block_m, block_n = _blocks(*shape, BWD_ELEMENTS)
        _swiglu_bwd_kernel[(cdiv(shape[0], block_m), cdiv(shape[1], block_n))](
            dh, gate, up, dgate, dup, *shape,
            dh.stride(0), gate.stride(0), up.stride(0), dgate.stride(0), dup.stride(0),
            ACTIVATION=ACTIVATIONS[activation], DTYPE=tl_dtype(dh.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS,
        )  # fmt: skip
    return dgate, dup
