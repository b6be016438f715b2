"""Drive a loss scaler through scripted clean and overflowing steps of a fused optimizer
(tests/test_amp.py, test_amp_lognormal.py, test_amp_contracts.py)."""

from __future__ import annotations

import torch
from conftest import DEVICE

from tkern.optim import FusedSGD


def fused_setup(n=4):
    p = torch.zeros(n, dtype=torch.float16, device=DEVICE, requires_grad=True)
    return p, FusedSGD([p], lr=0.1)


def run_fused(scaler, overflows):
    """Drive a fused optimizer through a scripted sequence of clean/overflowing
    steps; return the scale after each update."""
    p, opt = fused_setup()
    scales = []
    for bad in overflows:
        scaler.scale(p.float().sum() + 1.0)
        p.grad.fill_(float("inf") if bad else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales
