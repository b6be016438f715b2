"""The mxfp8 recipe's weight casts written by a fused optimizer's step (Float8WeightCache,
issue 53): the forward casts only x, and two steps are bit for bit those of a twin that
casts its weight in every forward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import DEVICE, ops_over

import tkern
from tkern.functional import float8_weight_cache


@contextlib.contextmanager
def mx_casts(monkeypatch):
    """The (rows, columns) of each tensor an MX cast kernel (``_to_mx_kernel``) reads while
    inside: its launches through Triton's interpreter, whichever door called them (the
    launchers on plain tensors, the tkern:: custom ops while tracing)."""
    if not tkern.INTERPRET:
        pytest.skip("counts launches through Triton's interpreter")
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[int, int]] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        if self.fn.__name__ == "_to_mx_kernel":
            seen.append(tuple(args[0].shape[-2:]))  # x as a (batch, R, C) view
        return run(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", counting)
        yield seen


def test_the_step_writes_both_mx_weight_casts_and_the_forward_casts_only_x(monkeypatch):
    torch.manual_seed(0)
    cached = tkern.nn.Float8Linear(64, 32, recipe="mxfp8").to(DEVICE, torch.bfloat16)
    plain = copy.deepcopy(cached)
    float8_weight_cache(plain.weight, register=False)  # the reference casts in every forward
    opts = [tkern.optim.FusedAdamW(m.parameters(), lr=1e-2) for m in (cached, plain)]
    x = torch.randn(32, 64, device=DEVICE).to(torch.bfloat16)
    for step in range(2):
        outs, grads = [], []
        for model, opt in zip((cached, plain), opts, strict=True):
            xi = x.clone().requires_grad_()  # dgrad too: the weight's cast along N is read
            with mx_casts(monkeypatch) as launched:
                y = model(xi)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y)
            grads.append(xi.grad)
            if model is cached and step > 0:
                assert launched == [(32, 64)], launched  # x's cast alone: W's came from the step
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), step
    assert torch.equal(cached.weight, plain.weight)
    cache = float8_weight_cache(cached.weight)
    held = [t.data_ptr() for t in (cache.data, cache.scale, cache.data_t, cache.scale_t)]
    with ops_over(monkeypatch, {(32 * 64, 64), (64 * 32, 32)}) as seen:  # cast again: into them,
        cache.refresh()  # no copy of a fresh cast
    assert seen == []
    assert [t.data_ptr() for t in (cache.data, cache.scale, cache.data_t, cache.scale_t)] == held
    data, scale, data_t, scale_t = tkern.kernels.mx.to_mx_both(cached.weight.detach())
    for mine, want in (
        (cache.data, data),
        (cache.scale, scale),
        (cache.data_t, data_t),
        (cache.scale_t, scale_t),
    ):
        assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8))
