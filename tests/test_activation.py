"""Activation gradients (activation.py) against torch autograd in float64, and the
launcher's input checks."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from tkern.kernels.activation import activation_grad


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def test_activation_grad_checks_its_inputs():
    with pytest.raises(ValueError, match="needs an activation"):
        activation_grad(t(4, dtype=torch.float16), t(4, dtype=torch.float16), None)
    with pytest.raises(ValueError, match=r"z has shape \(5,\) but dy has shape \(4,\)"):
        activation_grad(t(4, dtype=torch.float16), t(5, dtype=torch.float16), "relu")
    with pytest.raises(TypeError, match="dy must have dtype"):
        activation_grad(t(4), t(4), "gelu")


@pytest.mark.parametrize("n", [1000, 37, 3])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_activation_grad_any_length_matches_torch(n, activation):
    gen = torch.Generator().manual_seed(2)
    dy = torch.randn(n, generator=gen).to(DEVICE, torch.float16)
    z = torch.randn(n, generator=gen).to(DEVICE, torch.float16)
    zz = z.double().cpu().requires_grad_()
    out = zz.relu() if activation == "relu" else torch.nn.functional.gelu(zz)
    (ref,) = torch.autograd.grad(out, zz, dy.double().cpu())
    dz = activation_grad(dy, z, activation)
    # one rounding to fp16 of an fp32 result: 2^-11 relative, plus fp32's erf/exp error
    torch.testing.assert_close(dz.double().cpu(), ref, rtol=1e-3, atol=1e-5)
