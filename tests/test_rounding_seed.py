"""The stochastic rounding's stream (``master="none"``): keyed by the seed and the step
count, it changes from step to step, and the seed travels in the state_dict, so a
resumed run rounds as the uninterrupted one would without ``seed=``."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE

from tkern.optim import FusedAdamW, FusedSGD


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, generator=g).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(2)]


def _step(opt, params, t):
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=g).to(p.grad))
    opt.step()


def test_the_rounding_stream_changes_between_steps():
    # SGD without momentum ignores the step count but for the rounding: the same
    # param, gradient and update rounded at step counts 0 and 7 draw different bits
    # (an update far below bf16's spacing rounds up or down at random)
    rounded = {}
    for count in (0, 7, 0):
        p = torch.full((4096,), 1.0, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        opt = FusedSGD([p], lr=1e-4, master="none", seed=5)
        opt.state[p]["step"] = count
        p.grad.fill_(1.0)
        opt.step()
        rounded.setdefault(count, []).append(p.detach().clone())
    same, other = rounded[0], rounded[7][0]
    assert torch.equal(same[0], same[1])  # the stream is a function of (seed, step count)
    up = same[0] != 1.0
    assert 0 < up.sum() < p.numel()  # rounded both ways
    assert not torch.equal(same[0], other)


def test_a_resumed_run_rounds_as_the_uninterrupted_one_without_seed():
    torch.manual_seed(1)
    params = _params()
    opt = FusedAdamW(params, lr=1e-3, master="none")  # seed: torch.initial_seed()
    for t in range(2):
        _step(opt, params, t)
    saved = copy.deepcopy(opt.state_dict())  # its entries are views of the live buffers
    weights = [p.detach().clone() for p in params]
    assert saved["seed"] == opt.seed
    _step(opt, params, 2)

    torch.manual_seed(2)  # another process: another default seed
    resumed = [w.clone().requires_grad_() for w in weights]
    again = FusedAdamW(resumed, lr=1e-3, master="none")
    assert again.seed != opt.seed
    again.load_state_dict(saved)
    assert again.seed == opt.seed
    _step(again, resumed, 2)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)

    # without the seed the third step rounds otherwise: the test above can fail
    torch.manual_seed(2)
    blind = [w.clone().requires_grad_() for w in weights]
    other = FusedAdamW(blind, lr=1e-3, master="none")
    other.load_state_dict({k: v for k, v in saved.items() if k != "seed"})
    _step(other, blind, 2)
    assert any(not torch.equal(a, b) for a, b in zip(params, blind, strict=True))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_seed_in_a_state_dict_is_refused(bad):
    opt = FusedAdamW(_params(), lr=1e-3, master="none")
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="loaded 'seed' must be an int >= 0"):
        opt.load_state_dict({**saved, "seed": bad})
