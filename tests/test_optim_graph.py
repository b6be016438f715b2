"""The optimizer step as one CUDA graph (issue 16): when it is captured, replayed or run
eager, and that a replayed step is the eager step, bit for bit.

A CPU has no CUDA graphs, so the capture goes through the optimizer's seam
(``graph_runner``) with a stand-in that keeps the captured callable and, on each
replay, runs it again against the same static tensors, writing the statistics
into the tensor the capture returned, as a graph replay does. A step that read
anything but the static buffers (a fresh loss scale, found_inf) would then replay
stale values and the comparison with eager would fail."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import tkern
from tkern.optim import FusedAdamW, FusedSGD


class RecordingRunner:
    """Capture: keep ``fn``, run nothing. Replay: ``fn()`` into the captured statistics."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.events: list[str] = []

    def blocker(self, device):
        return None

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.events.append("capture")
        stats = torch.full((3,), float("nan"), device=DEVICE)  # unwritten until a replay
        return (fn, stats), stats

    def replay(self, handle):
        self.events.append("replay")
        fn, stats = handle
        stats.copy_(fn())


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(
        DEVICE, torch.float16
    )


def _train(runner, steps=12, **kw):
    """A loss-scaled loop with an overflow, an lr change, a param that sits a step out."""
    model = _model()
    opt = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, **kw)
    if runner is not None:
        opt.graph_runner = runner
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    torch.manual_seed(1)
    x, y = torch.randn(steps, 8, 16, device=DEVICE), torch.randn(steps, 8, 4, device=DEVICE)
    reasons = []
    for t in range(steps):
        opt.zero_grad()
        out = model(x[t].half()).float()
        loss = (out - y[t]).pow(2).mean()
        scaler.scale(loss).backward()
        if t == 4:
            model[0].weight.grad[0, 0] = float("inf")  # an overflow: skipped on the device
        if t == 7:
            model[2].bias.grad = None  # sits this step out: a new plan
        if t == 9:
            opt.param_groups[0]["lr"] = 5e-3  # a scheduler's change: new hyperparameters
        scaler.step(opt)
        scaler.update()
        reasons.append(opt.graph_fallback)
    return model, opt, scaler, reasons


def test_a_replayed_step_is_the_eager_step_bit_for_bit():
    runner = RecordingRunner()
    graphed, g_opt, g_scaler, reasons = _train(runner)
    eager, e_opt, e_scaler, _ = _train(None, cuda_graph=False)
    for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
    assert g_scaler.get_scale() == e_scaler.get_scale() and g_scaler.skipped_steps == 1
    sd_g, sd_e = g_opt.state_dict(), e_opt.state_dict()
    for i, entry in sd_e["state"].items():
        for k, v in entry.items():
            assert torch.equal(sd_g["state"][i][k], v), (i, k)
    # step 0 eager (new), step 1 captured (the launches repeat), then replays; the overflow
    # step replays too (the skip is on the device); steps 7 and 8 (a param sits out: a new
    # plan, then one more with its own step count) and 9 (new lr) run eager; 10 captures
    # again (9's launches repeat) and 11 replays
    eager_steps = [t for t, r in enumerate(reasons) if r is not None]
    assert eager_steps == [0, 7, 8, 9]
    assert runner.events.count("capture") == 2
    assert runner.events.count("replay") == 12 - len(eager_steps)


def test_the_step_runs_eager_where_it_cannot_be_graphed():
    p = torch.zeros(8, device=DEVICE, requires_grad=True)
    opt = FusedSGD([p], lr=0.1)
    p.grad.fill_(1.0)
    opt.step()
    if DEVICE == "cpu":
        assert "not a CUDA device" in opt.graph_fallback
    off = FusedSGD([torch.zeros(8, device=DEVICE, requires_grad=True)], lr=0.1, cuda_graph=False)
    off.step()
    assert off.graph_fallback == "cuda_graph=False"
    with pytest.raises(TypeError, match="cuda_graph must be None, True or False"):
        FusedSGD([torch.zeros(8, device=DEVICE, requires_grad=True)], cuda_graph="yes")


def test_a_failed_capture_warns_once_and_the_step_is_still_taken():
    with pytest.warns(UserWarning, match="capturing the step failed") as caught:
        model, opt, _, reasons = _train(RecordingRunner(fail=True), steps=4)
    assert len(caught) == 1
    eager, _, _, _ = _train(None, steps=4, cuda_graph=False)
    assert opt.cuda_graph is False and reasons[-1] == "cuda_graph=False"
    assert "capturing the step failed" in reasons[1]
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
