"""tkern.linear: output and the three gradients against float64, and against
torch.autocast + F.linear on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, gpu_only, rel_err

import tkern

ACT = {None: lambda t: t, "relu": torch.relu, "gelu": F.gelu}


def make(dtype, shape=(3, 5, 64), n=48, bias=True, bias_dtype=None):
    torch.manual_seed(0)
    k = shape[-1]
    x = torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype).requires_grad_()
    b = torch.randn(n, device=DEVICE).to(bias_dtype or dtype).requires_grad_() if bias else None
    return x, w, b


def float64_reference(x, w, b, activation, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    bd = b.detach().double().requires_grad_() if b is not None else None
    y = ACT[activation](F.linear(leaves[0], leaves[1], bd))
    y.backward(dy.double())
    return y, leaves[0].grad, leaves[1].grad, None if bd is None else bd.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_gradients_vs_float64(dtype, activation, bias):
    x, w, b = make(dtype, bias=bias)
    y = tkern.linear(x, w, b, activation)
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rdx, rdw, rdb = float64_reference(x, w, b, activation, dy)
    tol = TOL[dtype]
    assert y.shape == (3, 5, 48) and y.dtype == dtype
    assert rel_err(y, ry) < tol
    # Gradients carry one more rounding (the fp16/bf16 pre-activation and dz): 2x.
    assert rel_err(x.grad, rdx) < 2 * tol
    assert rel_err(w.grad, rdw) < 2 * tol
    if bias:
        assert b.grad.dtype == b.dtype
        assert rel_err(b.grad, rdb) < 2 * tol


def test_linear_fp32_bias_gets_fp32_grad():
    x, w, b = make(torch.float16, bias_dtype=torch.float32)
    y = tkern.linear(x, w, b, "gelu")
    y.sum().backward()  # an expanded (stride-0) upstream gradient
    _, _, _, rdb = float64_reference(x, w, b, "gelu", torch.ones_like(y))
    assert b.grad.dtype == torch.float32
    assert rel_err(b.grad, rdb) < 2 * TOL[torch.float16]


def test_only_weight_needs_grad():
    x, w, b = make(torch.float16)
    x.requires_grad_(False)
    tkern.linear(x, w, b, "relu").sum().backward()
    assert x.grad is None and w.grad is not None and b.grad is not None


def test_no_grad_forward_matches_grad_forward():
    x, w, b = make(torch.float16)
    with torch.no_grad():
        y0 = tkern.linear(x, w, b, "gelu")
    y1 = tkern.linear(x, w, b, "gelu")
    assert torch.equal(y0, y1.detach())


@gpu_only
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_linear_matches_autocast(activation):
    x, w, b = make(torch.float16)
    y = tkern.linear(x, w, b, activation)
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cuda", dtype=torch.float16):
        ya = ACT[activation](F.linear(*leaves))
    ya.backward(dy)
    tol = 2 * TOL[torch.float16]
    assert rel_err(y, ya) < tol
    for mine, theirs in zip((x, w, b), leaves, strict=True):
        assert rel_err(mine.grad, theirs.grad) < tol


@pytest.mark.parametrize(
    "args, exc, words",
    [
        (
            ((2, 7), (4, 5), None, None),
            ValueError,
            ["x must have shape (..., 5)", "(2, 7)", "(4, 5)"],
        ),
        (((2, 5), (4, 5, 1), None, None), ValueError, ["weight must be 2-D"]),
        (((2, 5), (4, 5), (5,), None), ValueError, ["bias must have shape (4,)", "(5,)"]),
        (((2, 5), (4, 5), None, "swish"), ValueError, ["activation", "'swish'"]),
    ],
)
def test_linear_bad_input(args, exc, words):
    xs, ws, bs, act = args
    x = torch.zeros(*xs, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(*ws, dtype=torch.float16, device=DEVICE)
    b = None if bs is None else torch.zeros(*bs, dtype=torch.float16, device=DEVICE)
    with pytest.raises(exc) as info:
        tkern.linear(x, w, b, act)
    for word in words:
        assert word in str(info.value)


def test_linear_dtype_mismatch():
    x = torch.zeros(2, 5, device=DEVICE)
    w = torch.zeros(4, 5, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="x must have dtype.*float16.*got.*float32"):
        tkern.linear(x, w)
