"""The kernel launchers' own input checks (the layers above them check their
arguments too; these guard direct users of tkern.kernels)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from tkern.kernels import scale as K
from tkern.kernels._update import UpdateBuffers
from tkern.kernels.activation import activation_grad
from tkern.kernels.adam import adam_update
from tkern.kernels.overflow import grad_stats
from tkern.kernels.sgd import sgd_update


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def buffers(n=8, **override):
    kwargs = dict(
        param=t(n, dtype=torch.float16),
        grad=t(n, dtype=torch.float16),
        master=t(n),
        stats=t(3),
        inv_scale=torch.ones(1, device=DEVICE),
        step=t(1),
        state={"exp_avg": t(n), "exp_avg_sq": t(n), "momentum_buffer": t(n)},
    )
    kwargs.update(override)
    return UpdateBuffers(**kwargs)


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, max_grad_norm=None)
SGD = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, max_grad_norm=None)


@pytest.mark.parametrize(
    "b, launch, exc, pattern",
    [
        (buffers(grad=t(8, dtype=torch.bfloat16)), "adam", TypeError, "grad must have dtype"),
        (buffers(master=t(9)), "sgd", ValueError, r"master must be a contiguous \(8,\) tensor"),
        (buffers(state={"exp_avg": t(8)}), "adam", ValueError, "'exp_avg_sq' is missing"),
        (buffers(stats=t(2)), "sgd", ValueError, r"stats must hold 3 value\(s\)"),
        (buffers(param=t(8), grad=t(8), master=t(8)), "sgd", ValueError, "an fp32 param is its own master"),
        (buffers(param=t(2, 4, dtype=torch.float16)), "adam", ValueError, "param must be 1-D"),
    ],
)
def test_update_launchers_check_their_buffers(b, launch, exc, pattern):
    with pytest.raises(exc, match=pattern):
        if launch == "adam":
            adam_update(b, amsgrad=False, **ADAM)
        else:
            sgd_update(b, **SGD)


def test_amsgrad_needs_its_buffer():
    with pytest.raises(ValueError, match="'max_exp_avg_sq' is missing"):
        adam_update(buffers(), amsgrad=True, **ADAM)


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


def test_activation_grad_checks_its_inputs():
    with pytest.raises(ValueError, match="needs an activation"):
        activation_grad(t(4, dtype=torch.float16), t(4, dtype=torch.float16), None)
    with pytest.raises(ValueError, match=r"z has shape \(5,\) but dy has shape \(4,\)"):
        activation_grad(t(4, dtype=torch.float16), t(5, dtype=torch.float16), "relu")
    with pytest.raises(TypeError, match="dy must have dtype"):
        activation_grad(t(4), t(4), "gelu")


def test_update_scale_checks_its_inputs():
    with pytest.raises(ValueError, match=r"state must be \(11,\) and stats \(3,\)"):
        K.update_scale(t(5), t(3), scheme=K.DYNAMIC, min_scale=1.0, max_scale=2.0)
    with pytest.raises(ValueError, match="scheme must be STATIC, DYNAMIC or LOGNORMAL"):
        K.update_scale(t(K.STATE_SIZE), t(3), scheme=7, min_scale=1.0, max_scale=2.0)
