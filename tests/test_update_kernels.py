"""The fused update kernels (adam.py, sgd.py, _update.py): their launchers' input checks and
one step against torch.optim on the same fp32 buffers."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from tkern.kernels._update import UpdateBuffers
from tkern.kernels.adam import adam_update
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


def _fp32_buffers(n, seed, names):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(DEVICE)
    g = torch.randn(n, generator=gen).to(DEVICE)
    state = {k: torch.rand(n, generator=gen).to(DEVICE) for k in names}
    half, three = torch.full((1,), 0.5, device=DEVICE), torch.full((1,), 3.0, device=DEVICE)
    return UpdateBuffers(param=p, grad=g, master=p, stats=t(3), inv_scale=half, step=three, state=state)


# lengths: aligned (64), head + tail (37 = 32 + 5), tail only (5)
@pytest.mark.parametrize("n", [64, 37, 5])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_sgd_update_maximize_and_device_lr_match_torch(n, maximize, lr_tensor):
    b = _fp32_buffers(n, 0, ("momentum_buffer",))
    p0, buf0, g = b.param.cpu().clone(), b.state["momentum_buffer"].cpu().clone(), b.grad.cpu() * 0.5
    lr = torch.full((1,), 0.1, device=DEVICE) if lr_tensor else 0.1
    sgd_update(b, lr=lr, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True,
               max_grad_norm=None, maximize=maximize)  # fmt: skip
    # torch.optim.SGD with the same momentum buffer (not the first step)
    p = p0.clone().requires_grad_()
    p.grad = g
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True,
                          maximize=maximize, foreach=False)  # fmt: skip
    opt.state[p]["momentum_buffer"] = buf0.clone()
    opt.step()
    # fp32 throughout on both sides; a few ulps for a different operation order
    torch.testing.assert_close(b.param.cpu(), p.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        b.state["momentum_buffer"].cpu(), opt.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("n", [64, 37])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("lr_tensor", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_update_maximize_and_device_lr_match_torch(n, maximize, lr_tensor, decoupled):
    b = _fp32_buffers(n, 1, ("exp_avg", "exp_avg_sq"))
    p0, g = b.param.cpu().clone(), b.grad.cpu() * 0.5
    m0, v0 = b.state["exp_avg"].cpu().clone(), b.state["exp_avg_sq"].cpu().clone()
    lr = torch.full((1,), 1e-2, device=DEVICE) if lr_tensor else 1e-2
    adam_update(b, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=decoupled,
                amsgrad=False, max_grad_norm=None, maximize=maximize)  # fmt: skip
    p = p0.clone().requires_grad_()
    p.grad = g
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, maximize=maximize, foreach=False)
    opt.state[p].update(step=torch.tensor(3.0), exp_avg=m0.clone(), exp_avg_sq=v0.clone())
    opt.step()
    # fp32 on both sides; the bias corrections are computed differently (fp32
    # expm1 here, float64 pow in torch): ~1e-6 relative on the update, which is
    # ~1e-2 of p, so ~1e-8 absolute on p; AdamW's decay in fp32 from a device lr adds 1 ulp
    torch.testing.assert_close(b.param.cpu(), p.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(b.state["exp_avg"].cpu(), opt.state[p]["exp_avg"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "lr, exc, pattern",
    [
        (torch.ones(2), ValueError, "tensor lr must hold one fp32 value"),
        (torch.ones(1, dtype=torch.float64), TypeError, "lr must have dtype"),
        ("0.1", TypeError, "lr must be a float or a"),
    ],
)
def test_update_launchers_check_lr(lr, exc, pattern):
    lr = lr.to(DEVICE) if isinstance(lr, torch.Tensor) else lr
    with pytest.raises(exc, match=pattern):
        sgd_update(buffers(), **{**SGD, "lr": lr})
    with pytest.raises(exc, match=pattern):
        adam_update(buffers(), amsgrad=False, **{**ADAM, "lr": lr})
