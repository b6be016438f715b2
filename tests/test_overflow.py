"""Pass 1 of a step (overflow.py): the gradient statistics against torch, and their
launcher's input checks."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from tkern.kernels.overflow import grad_stats


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def test_grad_stats_checks_its_inputs():
    with pytest.raises(ValueError, match="inv_scale must hold one value"):
        grad_stats([t(4, dtype=torch.float16)], torch.ones(2, device=DEVICE))
    with pytest.raises(TypeError, match=r"grads\[0\] must have dtype"):
        grad_stats([t(4, dtype=torch.int32)], torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match=r"grads\[0\] must be contiguous"):
        grad_stats([t(4, 2, dtype=torch.float16).t().reshape(-1)[::2]], torch.ones(1, device=DEVICE))


def test_grad_stats_against_torch():
    g = torch.randn(70000, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.float16)
    h = torch.randn(333, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    inv = torch.full((1,), 0.25, device=DEVICE)
    found, sumsq, amax = grad_stats([g, h], inv).tolist()
    ref = torch.cat([g.double(), h.double()]) * 0.25
    assert found == 0.0
    assert sumsq == pytest.approx(ref.pow(2).sum().item(), rel=1e-5)  # fp32 sums of 70k terms
    assert amax == ref.abs().max().item()  # exact: a max of exactly scaled values
    g[123] = float("nan")
    assert grad_stats([g, h], inv)[0].item() == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_grad_stats_reports_a_non_finite_inv_scale_as_an_overflow(bad):
    g = torch.ones(40, dtype=torch.float16, device=DEVICE)
    inv = torch.full((1,), bad, device=DEVICE)
    assert grad_stats([g], inv)[0].item() == 1.0
    assert grad_stats([], inv)[0].item() == 1.0  # nothing to read, still no step
    assert grad_stats([g], torch.full((1,), 0.5, device=DEVICE))[0].item() == 0.0
