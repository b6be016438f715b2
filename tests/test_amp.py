"""Loss scalers against torch.amp.GradScaler and DeepSpeed's hysteresis rules: the
dynamic and static scalers' trajectories, arguments and state dicts. The log-normal
scaler against OpenSeq2Seq's equations: test_amp_lognormal.py; GradScaler's contracts
and the process group: test_amp_contracts.py."""

from __future__ import annotations

import io
import random

import pytest
import torch
from conftest import DEVICE
from scaler_drive import fused_setup, run_fused

import tkern
from tkern.optim import FusedAdam, FusedSGD


def run_grad_scaler(overflows, **kwargs):
    q = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([q], lr=0.1)
    gs = torch.amp.GradScaler("cpu", **kwargs)
    scales = []
    for bad in overflows:
        opt.zero_grad()
        gs.scale(q.sum() + 1.0).backward()
        if bad:
            q.grad.fill_(float("inf"))
        gs.step(opt)
        gs.update()
        scales.append(gs.get_scale())
    return scales


SEQUENCES = {
    "none": [0] * 20,
    "leading": [1, 1, 1] + [0] * 17,
    "scattered": [0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0],
    "periodic": [1 if i % 5 == 4 else 0 for i in range(25)],
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_dynamic_follows_grad_scaler(name):
    seq = SEQUENCES[name]
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    mine = run_fused(tkern.DynamicLossScaler(**kwargs), seq)
    theirs = run_grad_scaler(seq, **kwargs)
    assert mine == theirs


def test_dynamic_with_a_torch_optimizer_follows_grad_scaler():
    seq = SEQUENCES["scattered"]
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    q = torch.zeros(4, device=DEVICE, requires_grad=True)
    ref = torch.zeros(4, requires_grad=True)
    opt, ropt = torch.optim.SGD([q], lr=0.1), torch.optim.SGD([ref], lr=0.1)
    scaler, gs = tkern.DynamicLossScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)
    for bad in seq:
        for x, o, s in ((q, opt, scaler), (ref, ropt, gs)):
            o.zero_grad()
            s.scale((x * torch.arange(4.0, device=x.device)).sum()).backward()
            if bad:
                x.grad[1] = float("nan")
            s.step(o)
            s.update()
        assert scaler.get_scale() == gs.get_scale()
        assert torch.equal(q.detach().cpu(), ref.detach())
    assert scaler.skipped_steps == sum(seq)


class DeepSpeedReference:
    """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis=False),
    restated: backoff at the hysteresis-th overflow since the last growth."""

    def __init__(self, scale, factor, window, hysteresis, min_scale):
        self.scale, self.factor, self.window = scale, factor, window
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.min_scale = min_scale
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.scale *= self.factor
        self.cur_iter += 1
        return self.scale


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_follows_deepspeed(hysteresis):
    rng = random.Random(hysteresis)
    seq = [int(rng.random() < 0.3) for _ in range(40)]
    ref = DeepSpeedReference(2.0**12, 2.0, 4, hysteresis, min_scale=2.0**6)
    expected = [ref.update(bad) for bad in seq]
    scaler = tkern.DynamicLossScaler(
        init_scale=2.0**12, growth_interval=4, hysteresis=hysteresis, min_scale=2.0**6
    )
    assert run_fused(scaler, seq) == expected


def test_hysteresis_tolerates_isolated_overflows():
    scaler = tkern.DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    assert run_fused(scaler, [1, 0, 0, 1, 1]) == [1024.0, 1024.0, 1024.0, 512.0, 256.0]


def test_min_and_max_scale():
    scaler = tkern.DynamicLossScaler(init_scale=8.0, min_scale=2.0, max_scale=32.0, growth_interval=1)
    assert run_fused(scaler, [1, 1, 1, 1, 0, 0, 0, 0, 0]) == [4.0, 2.0, 2.0, 2.0, 4.0, 8.0, 16.0, 32.0, 32.0]


def test_default_max_scale_is_two_to_the_24():
    scaler = tkern.DynamicLossScaler(init_scale=2.0**23, growth_interval=1)
    assert run_fused(scaler, [0, 0, 0]) == [2.0**24] * 3


def test_static_scaler_keeps_its_scale_and_skips_overflows():
    scaler = tkern.StaticLossScaler(512.0)
    assert run_fused(scaler, [0, 1, 0, 1]) == [512.0] * 4
    assert scaler.skipped_steps == 2


def test_gives_up_after_consecutive_overflows_at_min_scale():
    scaler = tkern.DynamicLossScaler(init_scale=8.0, min_scale=2.0, max_overflows_at_min=5)
    p, opt = fused_setup()
    scaler.scale(torch.tensor(0.75, device=DEVICE))  # the last finite loss
    with pytest.raises(
        RuntimeError, match=r"5 consecutive steps overflowed at the minimum loss scale 2.*0\.75"
    ):
        for _ in range(20):
            scaler.scale(torch.tensor(float("nan"), device=DEVICE))
            p.grad.fill_(float("inf"))
            scaler.step(opt)
            scaler.update()
    # 2 backoffs (8 -> 4 -> 2), then 5 overflows at the floor
    assert scaler.skipped_steps == 7


def test_underflowing_gradients_are_rescued_by_scaling():
    # d/dp of sum(p * 1e-8) is 1e-8, below fp16's smallest subnormal (6e-8):
    # unscaled it rounds to 0 in the fp16 grad; scaled by 2^16 it is 6.6e-4.
    def train(scaler):
        p = torch.ones(8, dtype=torch.float16, device=DEVICE, requires_grad=True)
        opt = FusedSGD([p], lr=1.0)
        loss = (p.float() * 1e-8).sum()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        return opt.state[p]["master"]

    assert torch.equal(train(None), torch.ones(8, device=DEVICE))
    moved = 1.0 - train(tkern.StaticLossScaler(2.0**16))
    # the scaled fp16 grad 1e-8 * 2^16 is rounded to 11 bits: 1e-3 relative
    assert torch.allclose(moved, torch.full_like(moved, 1e-8), rtol=1e-3)


def test_gradient_accumulation_matches_one_big_batch():
    def train(micro_batches):
        torch.manual_seed(0)
        layer = tkern.nn.Linear(8, 4).to(DEVICE)
        opt = FusedAdam(layer.parameters(), lr=1e-2)
        scaler = tkern.DynamicLossScaler(init_scale=256.0)
        x = torch.randn(8, 8, device=DEVICE)
        for chunk in x.chunk(micro_batches):
            scaler.scale(layer(chunk).float().pow(2).sum()).backward()
        scaler.step(opt)
        scaler.update()
        return opt.state[layer.weight]["master"]

    one, four = train(1), train(4)
    # the same gradient, summed in fp16 over 4 micro-batches vs in one GEMM:
    # Adam's first step moves each weight by ~lr * sign(g), so only elements
    # whose tiny gradients change sign could differ; none should.
    assert torch.allclose(one, four, rtol=0, atol=1e-4)


def test_unscale_then_clip_by_hand():
    p, opt = fused_setup()
    scaler = tkern.DynamicLossScaler(init_scale=1024.0)
    scaler.scale((p.float() * 3.0).sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.full_like(p.grad, 3.0))
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(opt.state[p]["master"], torch.full((4,), -0.3, device=DEVICE))
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()


def test_step_twice_is_an_error():
    p, opt = fused_setup()
    scaler = tkern.DynamicLossScaler()
    scaler.scale(p.float().sum()).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: tkern.DynamicLossScaler(init_scale=0.0), "init_scale must be a finite number > 0"),
        (lambda: tkern.DynamicLossScaler(growth_factor=0.5), "growth_factor must be > 1"),
        (lambda: tkern.DynamicLossScaler(backoff_factor=1.5), r"backoff_factor must be in \(0, 1\)"),
        (lambda: tkern.DynamicLossScaler(growth_interval=0), "growth_interval must be a positive int"),
        (lambda: tkern.DynamicLossScaler(hysteresis=1.5), "hysteresis must be a positive int"),
        (lambda: tkern.DynamicLossScaler(init_scale=2.0**30), "min_scale <= init_scale <= max_scale"),
        (lambda: tkern.StaticLossScaler(float("inf")), "^scale must be a finite number"),
        (lambda: tkern.LogNormalLossScaler(beta1=1.0), r"beta1 must be in \[0, 1\)"),
        (
            lambda: tkern.DynamicLossScaler(max_overflows_at_min=0),
            "max_overflows_at_min must be a positive int",
        ),
    ],
)
def test_bad_arguments(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_scale_rejects_non_tensor_loss():
    with pytest.raises(TypeError, match="loss must be a floating-point tensor"):
        tkern.DynamicLossScaler().scale(1.0)


@pytest.mark.parametrize("cls", [tkern.DynamicLossScaler, tkern.LogNormalLossScaler])
def test_state_dict_round_trip_continues_the_same_trajectory(cls):
    kwargs = dict(growth_interval=2, hysteresis=2) if cls is tkern.DynamicLossScaler else {}
    rng = random.Random(0)
    grads = [rng.choice([1e-3, 5e-2, 2.0, float("inf")]) for _ in range(16)]

    def drive(scaler, p, opt, values):
        out = []
        for g in values:
            scaler.scale(torch.tensor(2.5, device=DEVICE))
            p.grad.fill_(g)
            scaler.step(opt)
            scaler.update()
            out.append(scaler.get_scale())
        return out

    p, opt = fused_setup()
    full = cls(**kwargs)
    drive(full, p, opt, grads[:8])
    buf = io.BytesIO()
    torch.save(full.state_dict(), buf)
    rest = drive(full, p, opt, grads[8:])
    buf.seek(0)
    resumed = cls(**kwargs)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert drive(resumed, *fused_setup(), grads[8:]) == rest
    assert torch.equal(resumed.state, full.state)


class ConsecutiveDeepSpeedReference(DeepSpeedReference):
    """DeepSpeed's DynamicLossScaler.update_scale with consecutive_hysteresis=True:
    every clean step refills the hysteresis counter."""

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                self.scale *= self.factor
        self.cur_iter += 1
        return self.scale


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_consecutive_hysteresis_follows_deepspeed(hysteresis):
    rng = random.Random(10 + hysteresis)
    seq = [int(rng.random() < 0.35) for _ in range(60)]
    ref = ConsecutiveDeepSpeedReference(2.0**12, 2.0, 4, hysteresis, min_scale=2.0**4)
    expected = [ref.update(bad) for bad in seq]
    scaler = tkern.DynamicLossScaler(
        init_scale=2.0**12,
        growth_interval=4,
        hysteresis=hysteresis,
        min_scale=2.0**4,
        consecutive_hysteresis=True,
    )
    assert run_fused(scaler, seq) == expected
    if hysteresis > 1:  # the option matters on this sequence
        plain = DeepSpeedReference(2.0**12, 2.0, 4, hysteresis, min_scale=2.0**4)
        assert [plain.update(bad) for bad in seq] != expected


def test_consecutive_hysteresis_survives_a_state_dict_round_trip():
    scaler = tkern.DynamicLossScaler(hysteresis=2, consecutive_hysteresis=True)
    other = tkern.DynamicLossScaler(hysteresis=2)
    other.load_state_dict(scaler.state_dict())
    assert other.consecutive_hysteresis is True
