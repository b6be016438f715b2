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


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_forward_matches_float64_and_casts_fp32_input(activation):
    torch.manual_seed(0)
    layer = tkern.nn.Linear(32, 16, activation=activation).to(DEVICE)
    x = torch.randn(8, 32, device=DEVICE)  # fp32 input is cast to fp16, as autocast does
    y = layer(x)
    ref = torch.nn.functional.linear(x.half().double(), layer.weight.double(), layer.bias.double())
    ref = {None: ref, "relu": ref.relu(), "gelu": torch.nn.functional.gelu(ref)}[activation]
    assert y.dtype == torch.float16
    assert rel_err(y, ref) < TOL[torch.float16]


def test_no_bias_and_repr():
    layer = tkern.nn.Linear(4, 3, bias=False, activation="gelu")
    assert layer.bias is None
    assert "activation=gelu" in repr(layer)


def test_bad_arguments():
    with pytest.raises(TypeError, match="dtype must be torch.float16 or torch.bfloat16"):
        tkern.nn.Linear(4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="activation"):
        tkern.nn.Linear(4, 3, activation="tanh")
