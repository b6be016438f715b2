"""What docs/api.md's "Which recipe" says of a plain fp32 model: the fused optimizers
work on fp32 params, keep no extra master copy and step as torch's AdamW does.

Tolerance: tkern's and torch's AdamW both compute in fp32 and differ only in rounding
order (bias corrections as exp2(t log2 beta) in fp32 against torch's float64 powers,
fused multiply-adds), a few fp32 ulps (6e-8 each) per step on updates ~1e-3 of the
weights: 1e-6 relative after 8 steps, as tests/test_optim.py bounds the fp32 master.
"""

from __future__ import annotations

import copy

import torch
from conftest import DEVICE, rel_err
from torch import nn

import tkern

STEPS = 8
TOL = 1e-6


def test_fused_adamw_on_an_fp32_model_matches_torch_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)).to(DEVICE)
    twin = copy.deepcopy(model)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.05, max_grad_norm=None)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.05)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, device=DEVICE), torch.randn(8, 4, device=DEVICE)
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert p.dtype == torch.float32 and rel_err(p.detach(), q.detach()) < TOL
    state = opt.state_dict()["state"]
    assert all("master" not in s for s in state.values())  # the fp32 param is its own master
    assert torch.equal(state[0]["step"].cpu(), ref.state_dict()["state"][0]["step"].cpu())
