"""Mixed-precision health: which tensors overflowed, recorded by the step's
statistics pass on the device and read on demand (issue 37 item 7)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import DEVICE, count_syncs
from torch import nn

import tkern
from tkern.kernels.overflow import BLOCK, FOUND_INF, OverflowFlags, grad_stats
from tkern.optim import FusedAdamW


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 24)
        self.blocks = nn.ModuleList([nn.Linear(24, 24) for _ in range(3)])
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def named_setup(name=True):
    torch.manual_seed(0)
    model = Net().to(DEVICE).half()
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    if name:
        opt.name_params(model)
    return model, opt


def backward(model, bad=None, value=float("inf")):
    """One backward; ``bad``: a param whose gradient gets ``value`` at one element."""
    model(torch.randn(4, 8, device=DEVICE).half()).float().sum().backward()
    if bad is not None:
        bad.grad.view(-1)[bad.numel() // 2] = value


def test_report_names_exactly_the_param_that_overflowed():
    model, opt = named_setup()
    backward(model, model.blocks[1].weight)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    report = opt.overflow_report()
    assert report.step == 1 and report.skipped
    assert report.nonfinite == ["blocks.1.weight"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    # a clean step: nothing overflowed now, the earlier overflow is remembered with its step
    opt.zero_grad()
    backward(model)
    opt.step()
    report = opt.overflow_report()
    assert (report.step, report.skipped, report.nonfinite) == (2, False, [])
    assert report.last_overflow == {"blocks.1.weight": 1}
    # nan in two tensors at step 3
    opt.zero_grad()
    backward(model, model.head.bias, float("nan"))
    model.embed.weight.grad[0, 0] = float("-inf")
    opt.step()
    report = opt.overflow_report()
    assert report.skipped and sorted(report.nonfinite) == ["embed.weight", "head.bias"]
    assert report.last_overflow == {"blocks.1.weight": 1, "embed.weight": 3, "head.bias": 3}


def test_unnamed_params_are_named_by_group_index_and_shape():
    model, opt = named_setup(name=False)
    backward(model, model.head.weight)
    opt.step()
    with pytest.raises(RuntimeError, match="tracking is off"):  # off by default: no cost
        opt.overflow_report()
    opt.track_overflows = True
    backward(model, model.head.weight)
    opt.step()
    assert opt.overflow_report().nonfinite == ["group 0 param 8 (3, 24)"]
    with pytest.raises(TypeError, match="nn.Module"):
        opt.name_params(list(model.parameters()))


def test_an_overflowing_scale_is_a_skip_with_no_tensor_named():
    model, opt = named_setup()
    backward(model)
    opt.step(inv_scale=torch.full((1,), float("inf"), device=DEVICE))
    report = opt.overflow_report()
    assert report.skipped and report.nonfinite == [] and report.last_overflow == {}


def test_no_sync_in_steps_one_when_the_report_is_read():
    model, opt = named_setup()
    backward(model)
    opt.step()  # first step: state allocated
    with count_syncs() as calls:
        for bad in (None, model.blocks[0].bias, None):
            opt.zero_grad()
            backward(model, bad)
            opt.step()
    assert calls == []
    with count_syncs() as calls:
        report = opt.overflow_report()
    assert len(calls) == 1
    assert report.last_overflow == {"blocks.0.bias": 3} and report.nonfinite == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flags_match_a_reference_across_programs_and_a_ragged_tail(dtype):
    # params back to back (no padding), several programs' shares and a tail that is not
    # a multiple of 16 (a launch of its own); the tensor starts at `base` in starts' coordinates
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, BLOCK // 3, (40,), generator=g).tolist() + [7, 1, 130]
    base = 5
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()]) - base
    n = sum(sizes) - base
    grad = torch.randn(n, generator=g).to(dtype)
    bad_at = torch.randint(0, n, (12,), generator=g).tolist() + [n - 1, 0]
    for k, i in enumerate(bad_at):
        grad[i] = (float("inf"), float("-inf"), float("nan"))[k % 3]
    flags = torch.full((len(sizes),), 7, dtype=torch.int32)  # untouched slots keep their value
    inv_scale = torch.full((1,), 0.5)
    stats = grad_stats([grad], inv_scale, [OverflowFlags(starts + base, flags, base)], stamp=9)
    expected = torch.full((len(sizes),), 7, dtype=torch.int32)
    for i in bad_at:
        expected[torch.searchsorted(starts, torch.tensor(i), right=True) - 1] = 9
    assert torch.equal(flags, expected)
    assert torch.equal(stats, grad_stats([grad], inv_scale))  # the statistics are the same
    assert stats[FOUND_INF] == 1.0


def test_grad_stats_rejects_bad_tracking_input():
    grad, inv = torch.zeros(32, dtype=torch.float16), torch.ones(1)
    flags = OverflowFlags(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="one entry per gradient"):
        grad_stats([grad], inv, [flags, flags])
    with pytest.raises(ValueError, match="stamp"):
        grad_stats([grad], inv, [flags], stamp=0)
    with pytest.raises(ValueError, match="one non-empty length"):
        grad_stats([grad], inv, [OverflowFlags(torch.zeros(3, dtype=torch.int64), flags.flags)])


def test_trainer_logs_the_skipped_step_with_the_layer(caplog):
    torch.manual_seed(0)
    model = tkern.convert_network(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2)).to(DEVICE))
    calls = []

    def poison(grad):  # the 4th backward's gradient of the last layer's weight overflows
        calls.append(1)
        return grad * float("inf") if len(calls) == 4 else grad

    model[2].weight.register_hook(poison)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    trainer = tkern.Trainer(
        model, opt, nn.functional.cross_entropy, tkern.DynamicLossScaler(init_scale=2.0**8), progress=False
    )
    x = torch.randn(48, 12)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8
    )
    with caplog.at_level(logging.WARNING, logger="tkern.train.trainer"):
        trainer.fit(loader, 1)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert lines == ["step 4 skipped: inf/nan in 2.weight"]
    scales = {h["step"]: h["scale"] for h in trainer.history}
    assert scales[4] < scales[3]  # the scaler saw that step skipped too
