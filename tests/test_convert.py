"""convert_network: which modules become what, and that the result runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DEVICE, rel_err
from torch import nn

import tkern
from tkern.nn import convert_network


def test_apex_fastai_rule_linear_bn_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 30), nn.BatchNorm1d(30), nn.Linear(30, 2)).to(DEVICE)
    reference = [p.detach().clone() for p in model.parameters()]
    keys = list(model.state_dict())
    assert convert_network(model) is model
    assert isinstance(model[0], tkern.nn.Linear) and isinstance(model[2], tkern.nn.Linear)
    assert [p.dtype for p in model[0].parameters()] == [torch.float16] * 2
    assert [p.dtype for p in model[1].parameters()] == [torch.float32] * 2
    assert model[1].running_mean.dtype == model[1].running_var.dtype == torch.float32
    assert [p.dtype for p in model[2].parameters()] == [torch.float16] * 2
    assert list(model.state_dict()) == keys  # same names: checkpoints still load
    for p, r in zip(model.parameters(), reference, strict=True):
        assert torch.equal(p, r.to(p.dtype))
    x = torch.randn(8, 10, device=DEVICE)
    y = model(x.half())
    assert y.dtype == torch.float16
    # the same network in float64 from the converted weights (train-mode BN)
    ref = model[0].weight.double()
    h = x.half().double() @ ref.t() + model[0].bias.double()
    h = torch.nn.functional.batch_norm(
        h, None, None, model[1].weight.double(), model[1].bias.double(), training=True
    )
    out = h.half().double() @ model[2].weight.double().t() + model[2].bias.double()
    assert rel_err(y, out) < 5e-3  # three fp16 roundings in a row (u = 4.9e-4 each) plus BN's fp32


def test_layer_norm_and_group_norm_stay_fp32_and_return_half():
    model = nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.GroupNorm(4, 16)
    )
    convert_network(model.to(DEVICE), dtype=torch.bfloat16)
    assert model[1].weight.dtype == model[4].weight.dtype == torch.float32
    assert model[0].weight.dtype == model[3].weight.dtype == torch.bfloat16
    assert model(torch.randn(3, 8, device=DEVICE)).dtype == torch.bfloat16


def test_unknown_module_with_parameters_is_kept_fp32_with_a_warning():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((4,), 2.0))

        def forward(self, x):
            assert x.dtype == torch.float32  # it really runs in fp32
            return x * self.w

    model = nn.Sequential(nn.Linear(4, 4), Scale()).to(DEVICE)
    with pytest.warns(UserWarning, match=r"1 \(Scale\) is not a type tkern knows"):
        convert_network(model)
    assert model[1].w.dtype == torch.float32
    assert model(torch.randn(2, 4, device=DEVICE)).dtype == torch.float16


def test_embedding_is_cast_and_plain_modules_need_nothing():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Dropout(0.0), nn.Linear(8, 3), nn.ReLU()).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_network(model)
    assert model[0].weight.dtype == torch.float16
    assert model(torch.tensor([[1, 2, 3]], device=DEVICE)).dtype == torch.float16


def test_frozen_linear_stays_frozen():
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    convert_network(model)
    assert not model[0].weight.requires_grad and model[0].bias.requires_grad


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        convert_network("model")
    with pytest.raises(TypeError, match="dtype must be torch.float16 or torch.bfloat16"):
        convert_network(nn.Sequential(nn.Linear(2, 2)), dtype=torch.float64)
    with pytest.raises(TypeError, match="bare nn.Linear"):
        convert_network(nn.Linear(2, 2))
