"""tkern.nn.Linear: a drop-in nn.Linear on tkern.linear."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, TOL, rel_err

import tkern


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_same_parameters_and_init_as_nn_linear(dtype):
    torch.manual_seed(3)
    ref = torch.nn.Linear(20, 12)
    torch.manual_seed(3)
    mine = tkern.nn.Linear(20, 12, dtype=dtype)
    assert isinstance(mine, torch.nn.Linear)
    assert [n for n, _ in mine.named_parameters()] == ["weight", "bias"]
    assert torch.equal(mine.weight, ref.weight.to(dtype))
    assert torch.equal(mine.bias, ref.bias.to(dtype))
    assert mine.weight.dtype == dtype


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu", "gelu_tanh"])
def test_forward_matches_float64_and_casts_fp32_input(activation):
    torch.manual_seed(0)
    layer = tkern.nn.Linear(32, 16, activation=activation).to(DEVICE)
    x = torch.randn(8, 32, device=DEVICE)  # fp32 input is cast to fp16, as autocast does
    y = layer(x)
    ref = torch.nn.functional.linear(x.half().double(), layer.weight.double(), layer.bias.double())
    F = torch.nn.functional
    ref = {
        None: ref,
        "relu": ref.relu(),
        "gelu": F.gelu(ref),
        "silu": F.silu(ref),
        "gelu_tanh": F.gelu(ref, approximate="tanh"),
    }[activation]
    assert y.dtype == torch.float16
    assert rel_err(y, ref) < TOL[torch.float16]


def test_no_bias_and_repr():
    layer = tkern.nn.Linear(4, 3, bias=False, activation="gelu")
    assert layer.bias is None
    assert "activation=gelu" in repr(layer)


def test_bad_arguments():
    with pytest.raises(TypeError, match="dtype must be torch.float16, torch.bfloat16 or torch.float32"):
        tkern.nn.Linear(4, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp32 parameters need a compute_dtype"):
        tkern.nn.Linear(4, 3, dtype=torch.float32)
    with pytest.raises(TypeError, match="compute_dtype must be"):
        tkern.nn.Linear(4, 3, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="activation"):
        tkern.nn.Linear(4, 3, activation="tanh")


@pytest.mark.parametrize("activation", [None, "relu"])
def test_no_input_features_returns_the_bias_as_nn_linear(activation):
    torch.manual_seed(0)
    ref = torch.nn.Linear(0, 5)
    torch.nn.init.uniform_(ref.bias, -1, 1)
    layer = tkern.nn.Linear(0, 5, activation=activation).to(DEVICE)
    with torch.no_grad():
        layer.bias.copy_(ref.bias)
    x = torch.randn(3, 0, device=DEVICE)
    y = layer(x)
    want = ref(x.cpu()) if activation is None else ref(x.cpu()).relu()
    assert y.shape == (3, 5) and y.dtype == torch.float16
    assert rel_err(y, want) < TOL[torch.float16]  # the bias, rounded once to fp16
    y.float().sum().backward()
    assert rel_err(layer.bias.grad, torch.full((5,), 3.0) * (want[0] > 0 if activation else 1)) == 0


def test_meta_device_layer_runs_shapes_only():
    layer = tkern.nn.Linear(16, 8, activation="gelu", device="meta")
    y = layer(torch.empty(4, 16, device="meta"))  # fp32 in: cast as autocast would
    assert y.device.type == "meta" and y.shape == (4, 8) and y.dtype == torch.float16
    y.sum().backward()
    assert layer.weight.grad.shape == (8, 16)
