"""The activations a GEMM can apply in its epilogue, and their gradients, in fp32.

The formulas live once, as jit helpers: :func:`apply_activation` (called by
the GEMM epilogue, gemm_epilogue.py) and :func:`activation_grad_f32`
(``dz = dy * act'(z)``, where ``z`` is the pre-activation the forward GEMM
saved; called by the standalone kernel here and by any GEMM that applies it
while loading its operand).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tkern.kernels._common import (
    INTERPRET,
    aligned_slices,
    block_offsets,
    cast_rne,
    check_same_device,
    check_tensor,
    tl_dtype,
)

#: Activations the epilogue can apply; the integer is the kernels' constexpr code.
ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}
_RELU: tl.constexpr = tl.constexpr(ACTIVATIONS["relu"])
_GELU: tl.constexpr = tl.constexpr(ACTIVATIONS["gelu"])
_INV_SQRT2: tl.constexpr = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))

#: Elements per program: large under the interpreter, where each program costs
#: milliseconds; 1024 (4 warps x 32 threads x 8 halves = 16-byte loads) on a GPU.
BLOCK = 65536 if INTERPRET else 1024
NUM_WARPS = 4


def check_activation(activation: str | None) -> None:
    """Raise ``ValueError`` unless ``activation`` is one the kernels know."""
    if activation not in ACTIVATIONS:
        known = ", ".join(repr(a) for a in ACTIVATIONS)
        raise ValueError(f"activation must be one of {known}, got {activation!r}")


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def apply_activation(z, ACTIVATION: tl.constexpr):
    """act(z) on an fp32 tensor of any shape (ACTIVATION 0 is the identity)."""
    if ACTIVATION == _RELU:
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == _GELU:
        z = 0.5 * z * (1.0 + tl.erf(z * _INV_SQRT2))
    return z


@triton.jit
def activation_grad_f32(dy, z, ACTIVATION: tl.constexpr):
    """dy * act'(z) on fp32 tensors of one shape (ACTIVATION > 0)."""
    if ACTIVATION == _RELU:
        dz = tl.where(z > 0.0, dy, 0.0)
    else:
        # d/dz [z * Phi(z)] = Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + tl.erf(z * _INV_SQRT2))
        pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        dz = dy * (cdf + z * pdf)
    return dz


# --------------------------------------------------------------------------- kernel


@triton.jit
def _activation_grad_kernel(
    dy_ptr,  # (n,) upstream gradient, fp16/bf16
    z_ptr,  # (n,) pre-activation saved by the forward GEMM, same dtype
    dz_ptr,  # (n,) output, same dtype
    n,
    ACTIVATION: tl.constexpr,  # 1 relu, 2 gelu (erf form)
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dz = dy * act'(z) for n elements, computed in fp32 and cast once to dy's dtype
    (the activation's gradient in the linear backward; pointer shapes above)."""
    offs = block_offsets(BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dz = activation_grad_f32(dy, z, ACTIVATION)
    tl.store(dz_ptr + offs, cast_rne(dz, DTYPE), mask=mask)


def activation_grad(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """``dy * act'(z)`` computed in fp32, returned in ``dy``'s dtype.

    Args:
        dy: upstream gradient, any shape, fp16/bf16.
        z: pre-activation, same shape and dtype as ``dy``.
        activation: ``"relu"`` or ``"gelu"``.
    """
    check_activation(activation)
    if activation is None:
        raise ValueError("activation_grad needs an activation, got None")
    check_tensor("dy", dy, dtypes=(torch.float16, torch.bfloat16))
    check_tensor("z", z, dtypes=(dy.dtype,))
    if z.shape != dy.shape:
        raise ValueError(f"z has shape {tuple(z.shape)} but dy has shape {tuple(dy.shape)}")
    check_same_device(dy=dy, z=z)
    dy, z = dy.contiguous(), z.contiguous()
    dz = torch.empty_like(dy)
    flat = dy.view(-1), z.view(-1), dz.view(-1)
    # The head (a multiple of 16 elements) is read in 16-byte vectors; a tail
    # of n % 16 elements gets its own launch rather than making every access scalar.
    for s in aligned_slices(dy.numel()):
        n = s.stop - s.start
        _activation_grad_kernel[(triton.cdiv(n, BLOCK),)](
            *(t[s] for t in flat), n,
            ACTIVATION=ACTIVATIONS[activation], DTYPE=tl_dtype(dy.dtype),
            BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return dz
