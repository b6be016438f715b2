"""Activation gradients (activation.py) against torch autograd in float64, the
formulas' behaviour at large |z|, and the launcher's input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE

import tkern
from tkern.kernels.activation import ACTIVATIONS, activation_grad

#: torch's function for each activation the kernels know.
TORCH = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def torch_grad(activation: str, dy: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """dy * act'(z) by torch autograd in float64, on the CPU."""
    zz = z.double().cpu().requires_grad_()
    (ref,) = torch.autograd.grad(TORCH[activation](zz), zz, dy.double().cpu())
    return ref


def test_every_activation_has_a_torch_reference():
    assert set(TORCH) == set(ACTIVATIONS) - {None}


def test_activation_grad_checks_its_inputs():
    with pytest.raises(ValueError, match="needs an activation"):
        activation_grad(t(4, dtype=torch.float16), t(4, dtype=torch.float16), None)
    with pytest.raises(ValueError, match=r"z has shape \(5,\) but dy has shape \(4,\)"):
        activation_grad(t(4, dtype=torch.float16), t(5, dtype=torch.float16), "relu")
    with pytest.raises(TypeError, match="dy must have dtype"):
        activation_grad(t(4), t(4), "gelu")
    with pytest.raises(ValueError, match="activation must be one of.*'silu'.*'gelu_tanh'.*got 'swish'"):
        activation_grad(t(4, dtype=torch.float16), t(4, dtype=torch.float16), "swish")


@pytest.mark.parametrize("n", [1000, 37, 3])
@pytest.mark.parametrize("activation", list(TORCH))
def test_activation_grad_any_length_matches_torch(n, activation):
    gen = torch.Generator().manual_seed(2)
    dy = torch.randn(n, generator=gen).to(DEVICE, torch.float16)
    z = (3 * torch.randn(n, generator=gen)).to(DEVICE, torch.float16)  # the curved parts and both tails
    dz = activation_grad(dy, z, activation)
    # one rounding to fp16 of an fp32 result: 2^-11 relative, plus fp32's erf/exp error
    torch.testing.assert_close(dz.double().cpu(), torch_grad(activation, dy, z), rtol=1e-3, atol=1e-5)


#: Pre-activations far out in both tails: where exp(-z) or z^3 overflow fp32 (1e30 and
#: 3e38 are bf16 values), the formulas must still give act' (0 or 1), never NaN.
LARGE = [-3e38, -1e30, -1e4, -100.0, -30.0, 30.0, 100.0, 1e4, 1e30, 3e38]


#: Under the interpreter numpy reports the fp32 overflow (z * z, exp(-z)) that the
#: formulas are written to absorb.
absorbs_overflow = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@absorbs_overflow
@pytest.mark.parametrize("activation", list(TORCH))
def test_activation_grad_at_large_magnitudes_is_finite_and_exact(activation):
    z = torch.tensor(LARGE).to(DEVICE, torch.bfloat16)
    dy = torch.full_like(z, 0.75)
    dz = activation_grad(dy, z, activation)
    ref = torch_grad(activation, dy, z)
    assert torch.isfinite(dz).all()
    # one rounding to bf16 (2^-8) of an fp32 result; values below fp32's range (float64
    # sees gelu'(-30) = -3e-195) are 0
    torch.testing.assert_close(dz.double().cpu(), ref, rtol=2**-8, atol=1e-37)


@absorbs_overflow
@pytest.mark.parametrize("activation", list(TORCH))
def test_epilogue_at_large_magnitudes_matches_torch(activation):
    # identity @ b puts b's values exactly into the fp32 accumulator, out in both tails
    z = torch.tensor(LARGE + [-5.0, -1.0, -0.25, 0.0, 0.25, 1.0, 5.0])
    n = z.numel()
    a = torch.eye(n).to(DEVICE, torch.bfloat16)
    b = torch.diag(z).to(DEVICE, torch.bfloat16)
    out = tkern.matmul(a, b, activation=activation, out_dtype=torch.float32)
    ref = TORCH[activation](b.double().cpu())
    assert torch.isfinite(out).all()
    # fp32 out, no rounding to half: the formulas' own fp32 error (exp, erf, one division:
    # a few ulp, 2^-22 relative); where the true value is below fp32's range (silu(-100)
    # = -4e-42) the kernel may flush it to 0. The erf form cancels in 1 + erf(z / sqrt 2)
    # for z < 0: an absolute error up to |z| 2^-24 (3e-7 at z = -5)
    atol = 1e-6 if activation == "gelu" else 1e-37
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-6, atol=atol)
