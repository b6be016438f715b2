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
    cdiv,
    check_same_device,
    check_tensor,
    tl_dtype,
)

#: Activations the epilogue can apply; the integer is the kernels' constexpr code.
#: "gelu" is the erf form (``F.gelu``), "gelu_tanh" its tanh approximation
#: (``F.gelu(approximate="tanh")``), "silu" ``x * sigmoid(x)`` (``F.silu``).
ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2, "silu": 3, "gelu_tanh": 4}
_RELU: tl.constexpr = tl.constexpr(ACTIVATIONS["relu"])
_GELU: tl.constexpr = tl.constexpr(ACTIVATIONS["gelu"])
_SILU: tl.constexpr = tl.constexpr(ACTIVATIONS["silu"])
_GELU_TANH: tl.constexpr = tl.constexpr(ACTIVATIONS["gelu_tanh"])
#: The activations computed with exp/erf (every one but ReLU): the ones whose
#: temporaries compete with a GEMM's accumulator for registers (gemm_epilogue
#: applies them in column slices; gemm_configs.ACT_MAX_ACC_ACTIVATIONS names those
#: for which large tiles are pruned as well).
TRANSCENDENTAL = frozenset(ACTIVATIONS[a] for a in ("gelu", "silu", "gelu_tanh"))
#: Activations whose gradient can be taken from the stored output instead of the
#: stored pre-activation, bit for bit: ReLU's act'(z) = [z > 0], and with z and
#: y = relu(z) both rounded once from the same fp32 value, round(z) > 0 exactly when
#: round(max(z, 0)) > 0 (a positive z that rounds to 0 gives y = 0 too; NaN and -0
#: are not > 0 either way). A layer with one of these saves its output for backward
#: (which the next layer saves as its input anyway) and writes no pre-activation.
GRAD_FROM_OUTPUT = frozenset({"relu"})
#: :data:`TRANSCENDENTAL` as a bit set for jit code: ``(TRANSCENDENTAL_BITS >> ACTIVATION) & 1``.
TRANSCENDENTAL_BITS: tl.constexpr = tl.constexpr(sum(1 << code for code in TRANSCENDENTAL))
_INV_SQRT2: tl.constexpr = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
#: tanh-GELU's cubic coefficient: gelu_tanh(z) = 0.5 z (1 + tanh(u)) = z * sigmoid(2u),
#: u = sqrt(2/pi) (z + GELU_TANH_COEFF z^3), as torch's ``F.gelu(approximate="tanh")``.
GELU_TANH_COEFF = 0.044715
#: |z| beyond which gelu_tanh'(z) is exactly 1 (z > 0) or 0 (z < 0) in fp32
#: (sigmoid(2u) rounds to 1 from z ~ 5.5; its complement underflows to 0 from z ~ 11):
#: the gradient clamps z here so that z^3 cannot overflow (|z| > 7e12) into inf * 0.
GELU_TANH_SATURATED = 20.0
_TANH_K: tl.constexpr = tl.constexpr(GELU_TANH_COEFF)
_TANH_2C: tl.constexpr = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))  # 2u = _TANH_2C (z + _TANH_K z^3)
_GELU_TANH_SATURATED: tl.constexpr = tl.constexpr(GELU_TANH_SATURATED)

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
    """act(z) on an fp32 tensor of any shape (ACTIVATION 0 is the identity).

    SiLU and tanh-GELU are ``z * sigmoid(v)`` written ``z / (1 + exp(-v))``: for
    any finite z the exponential is finite or +inf, and z / inf is the exact
    limit 0 (no inf/inf, no NaN); the fewest temporaries next to an accumulator."""
    if ACTIVATION == _RELU:
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == _GELU:
        z = 0.5 * z * (1.0 + tl.erf(z * _INV_SQRT2))
    elif ACTIVATION == _SILU:
        z = z / (1.0 + tl.exp(-z))
    elif ACTIVATION == _GELU_TANH:
        # 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for negative z
        z = z / (1.0 + tl.exp((z + z * z * z * _TANH_K) * -_TANH_2C))
    return z


@triton.jit
def activation_grad_f32(dy, z, ACTIVATION: tl.constexpr):
    """dy * act'(z) on fp32 tensors of one shape (ACTIVATION > 0)."""
    if ACTIVATION == _RELU:
        dz = tl.where(z > 0.0, dy, 0.0)
    elif ACTIVATION == _GELU:
        # d/dz [z * Phi(z)] = Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + tl.erf(z * _INV_SQRT2))
        pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        dz = dy * (cdf + z * pdf)
    elif ACTIVATION == _SILU:
        # d/dz [z s(z)] = s(z) (1 + z (1 - s(z))); s = 1 / (1 + exp(-z)) is 0 (not NaN)
        # where exp(-z) is inf, and then s * (1 + z) is 0 * finite
        s = 1.0 / (1.0 + tl.exp(-z))
        dz = dy * (s * (1.0 + z * (1.0 - s)))
    else:
        # d/dz [z s(2u)] = s(2u) (1 + z (1 - s(2u)) 2u'), 2u' = _TANH_2C (1 + 3 _TANH_K z^2);
        # z clamped where act' is exactly 0 or 1, so z * 2u' stays finite
        zc = tl.minimum(tl.maximum(z, -_GELU_TANH_SATURATED), _GELU_TANH_SATURATED)
        z2 = zc * zc
        s = 1.0 / (1.0 + tl.exp(zc * (1.0 + z2 * _TANH_K) * -_TANH_2C))
        dz = dy * (s * (1.0 + zc * (1.0 - s) * ((1.0 + z2 * (3.0 * _TANH_K)) * _TANH_2C)))
    return dz


# --------------------------------------------------------------------------- kernel


@triton.jit
def _activation_grad_kernel(
    dy_ptr,  # (n,) upstream gradient, fp16/bf16
    z_ptr,  # (n,) pre-activation saved by the forward GEMM, same dtype
    dz_ptr,  # (n,) output, same dtype
    n,
    ACTIVATION: tl.constexpr,  # an ACTIVATIONS code other than 0
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
        activation: a name in :data:`ACTIVATIONS` other than None.
    """
    check_activation(activation)
    if activation is None:
        raise ValueError("activation_grad needs an activation, got None")
    check_tensor("dy", dy, dtypes=(torch.float16, torch.bfloat16))
    check_tensor("z", z, dtypes=(dy.dtype,))
    if z.shape != dy.shape:
        raise ValueError(f"z has shape {tuple(z.shape)} but dy has shape {tuple(dy.shape)}")
    check_same_device(dy=dy, z=z)
    return activation_grad_prechecked(dy, z, activation)


def activation_grad_prechecked(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`activation_grad` for a caller whose arguments are valid: a backward whose ``dy``
    autograd gave (the output's shape, dtype and device) and whose ``z`` its forward saved
    (tkern.linear's, Float8Linear's, the MLP's): the pass, with nothing checked again."""
    dy, z = dy.contiguous(), z.contiguous()
    dz = torch.empty_like(dy)
    flat = dy.view(-1), z.view(-1), dz.view(-1)
    # The head (a multiple of 16 elements) is read in 16-byte vectors; a tail
    # of n % 16 elements gets its own launch rather than making every access scalar.
    for s in aligned_slices(dy.numel()):
        n = s.stop - s.start
        _activation_grad_kernel[(cdiv(n, BLOCK),)](
            *(t[s] for t in flat), n,
            ACTIVATION=ACTIVATIONS[activation], DTYPE=tl_dtype(dy.dtype),
            BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return dz
