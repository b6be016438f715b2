"""Checks that only mean something compiled on a CUDA device; skipped on a CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, gpu_only, rel_err

import tkern
from tkern.optim import FusedAdamW, FusedSGD

pytestmark = gpu_only


@pytest.mark.parametrize("opt_cls", [FusedSGD, FusedAdamW])
def test_step_and_scaler_never_wait_for_the_host(opt_cls):
    params = [torch.randn(1000, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    opt = opt_cls(params, lr=1e-3, max_grad_norm=1.0)
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.ones((), device="cuda"))
    for p in params:
        p.grad.normal_()
    for _ in range(2):  # the first call compiles and allocates; the second must not sync either
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.scale(torch.ones((), device="cuda"))
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_compiled_bf16_copy_rounds_to_nearest_even():
    p = torch.randn(4097, device="cuda").to(torch.bfloat16).requires_grad_()
    opt = FusedSGD([p], lr=1e-3)
    p.grad.copy_(torch.randn(4097, device="cuda"))
    opt.step()
    assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2048, 2048, 2048), (8192, 1024, 4096), (1000, 3000, 777)])
def test_autotuned_large_shapes(dtype, shape):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype).t()
    out = tkern.matmul(a, b, activation="gelu")
    ref = torch.nn.functional.gelu(a.double() @ b.double())
    assert rel_err(out, ref) < TOL[dtype]
