"""The MXFP8 recipe (Float8Recipe(scaling="mxfp8")): one Float8Linear step against a float64
emulation built from torchao's to_mx on the same axes, its launches, and no torch op over x or dY."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, LazyModule, ops_over

import tkern
import tkern.device
from tkern.nn import Float8Linear, Float8Recipe

mx_tensor = LazyModule("torchao.prototype.mx_formats.mx_tensor")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def mx_dequantized(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` (2-D) cast by torchao along its last axis and dequantized, in float64."""
    scales, data = mx_tensor.to_mx(t.detach().cpu().float().contiguous(), dtype, 32)
    exps = scales.view(torch.uint8).double() - 127
    return data.double() * torch.exp2(exps).repeat_interleave(32, dim=-1)


def assert_close_rounding(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor):
    """Within one bf16 rounding of the float64 value plus fp32 accumulation."""
    err = (got.detach().cpu().double() - want).abs()
    assert (err <= 2.0**-8 * want.abs() + 2.0**-20 * magnitude + 1e-12).all(), err.max()


def layer_and_inputs(grad_dtype=None, seed=0):
    torch.manual_seed(seed)
    recipe = Float8Recipe(scaling="mxfp8", grad_dtype=grad_dtype)
    layer = Float8Linear(64, 32, bias=True, dtype=torch.bfloat16, recipe=recipe, device=DEVICE)
    x = (torch.randn(64, 64) * 2).to(torch.bfloat16).to(DEVICE).requires_grad_()
    dy = torch.randn(64, 32).to(torch.bfloat16).to(DEVICE)
    return layer, x, dy


@pytest.mark.parametrize("grad_dtype", [None, E5M2])
def test_step_matches_float64_emulation(grad_dtype):
    layer, x, dy = layer_and_inputs(grad_dtype)
    y = layer(x)
    y.backward(dy)
    w, b = layer.weight, layer.bias
    g = E4M3 if grad_dtype is None else grad_dtype
    # forward: x and W along in_features
    xk, wk = mx_dequantized(x, E4M3), mx_dequantized(w, E4M3)
    assert_close_rounding(y, xk @ wk.t() + b.detach().cpu().double(), xk.abs() @ wk.abs().t())
    # dgrad: dY and W along out_features
    gn, wn = mx_dequantized(dy, g), mx_dequantized(w.t(), E4M3).t()
    assert_close_rounding(x.grad, gn @ wn, gn.abs() @ wn.abs())
    # wgrad: dY and x along the tokens
    gm, xm = mx_dequantized(dy.t(), g), mx_dequantized(x.t(), E4M3)
    assert_close_rounding(w.grad, gm @ xm.t(), gm.abs() @ xm.abs().t())
    assert_close_rounding(b.grad, dy.cpu().double().sum(0), dy.cpu().double().abs().sum(0))
    # the same Parameters and state_dict as nn.Linear
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_launches_per_step(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    if not tkern.INTERPRET:
        pytest.skip("counts interpreted launches")
    seen: list[str] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        seen.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    layer, x, dy = layer_and_inputs()
    y = layer(x)
    forward = list(seen)
    seen.clear()
    y.backward(dy)
    assert forward == ["_to_mx_kernel", "_to_mx_kernel", "_scaled_mm_mx_kernel"]
    assert seen == ["_to_mx_kernel", "_scaled_mm_mx_kernel", "_scaled_mm_mx_kernel"]


def test_no_torch_op_over_x_or_dy(monkeypatch):
    # the bias gradient is summed in dY's cast (to_mx_both_sum), not by a torch sum over dY
    layer, x, dy = layer_and_inputs()
    with ops_over(monkeypatch, {(x.numel(), x.shape[-1]), (dy.numel(), dy.shape[-1])}) as seen:
        layer(x).backward(dy)
    assert seen == []
    assert layer.bias.grad is not None


def test_refusals():
    with pytest.raises(ValueError, match="grad_dtype"):
        Float8Recipe(scaling="tensorwise", grad_dtype=E5M2)
    with pytest.raises(TypeError, match="grad_dtype"):
        Float8Recipe(scaling="mxfp8", grad_dtype=torch.bfloat16)
    layer = Float8Linear(64, 32, dtype=torch.bfloat16, recipe="mxfp8", device=DEVICE)
    with pytest.raises(ValueError, match=r"tokens.*multiple of 32"):
        layer(torch.randn(48, 64, dtype=torch.bfloat16, device=DEVICE))


def test_refused_on_hopper(monkeypatch):
    monkeypatch.setattr(tkern.device, "device_spec", lambda device=None: tkern.device.SPECS["h100"])
    with pytest.raises(RuntimeError, match="h100"):
        Float8Linear(64, 32, dtype=torch.bfloat16, recipe="mxfp8", device=DEVICE)


@pytest.mark.slow  # ~25 s through the interpreter on a loaded 2-core machine
def test_a_small_mlp_trains_to_the_bf16_loss():
    """convert_network(float8="mxfp8") on an MLP (its 16-wide head stays 16-bit: not a multiple
    of 32) trains to within 1% of bf16's loss."""
    import copy

    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(DEVICE)
    labels = torch.randint(0, 16, (32,), generator=g).to(DEVICE)

    def train(model, steps):
        opt = tkern.optim.FusedAdamW(model.parameters(), lr=3e-3)
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).float(), labels)
            loss.backward()
            opt.step()
        return loss.item()

    mx_model = tkern.convert_network(copy.deepcopy(base).to(DEVICE), torch.bfloat16, float8="mxfp8")
    assert [type(m).__name__ for m in mx_model if isinstance(m, nn.Linear)] == ["Float8Linear"] * 2 + [
        "Linear"
    ]
    first = train(tkern.convert_network(copy.deepcopy(base).to(DEVICE), torch.bfloat16), 1)
    ref = train(tkern.convert_network(copy.deepcopy(base).to(DEVICE), torch.bfloat16), 6)
    got = train(mx_model, 6)
    assert ref < 0.95 * first
    assert abs(got - ref) <= 0.01 * ref, (got, ref)


def test_compiled_step_is_the_eager_step():
    layer, x, dy = layer_and_inputs()
    y = layer(x)
    y.backward(dy)
    eager = (y.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    x.grad = layer.weight.grad = layer.bias.grad = None
    y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    y.backward(dy)
    for got, want in zip((y.detach(), x.grad, layer.weight.grad, layer.bias.grad), eager, strict=True):
        assert torch.equal(got, want)
