"""The one-pass step (issue 45 item 3): a small step's statistics, update and step count in
one launch of one program, bit for bit the two-pass step (pass 1, its finalize, pass 2,
the step counts), for FusedAdamW, FusedAdam and FusedSGD, fp16 and bf16 params, with and
without clipping by the global norm, through a skipped (overflowing) step."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import DEVICE, needs_recorder
from graph_recorder import RecordingCapture
from triton.runtime.interpreter import InterpretedFunction

import tkern
from tkern.kernels import _update, adam, overflow, sgd
from tkern.optim import FusedAdam, FusedAdamW, FusedSGD

needs_interpreter = pytest.mark.skipif(
    not tkern.INTERPRET, reason="counts launches through Triton's interpreter (CPU tensors)"
)

OPTIMIZERS = {
    "adamw": (FusedAdamW, {}),
    "adam": (FusedAdam, {"weight_decay": 0.1, "amsgrad": True}),
    "sgd": (FusedSGD, {"momentum": 0.9, "weight_decay": 0.01}),
}


class Launches:
    """The Triton launches (interpreted kernels) made inside the block: (name, grid);
    compiled (on a GPU), nothing is counted."""

    def __enter__(self):
        run, seen = InterpretedFunction.run, []
        self.seen = seen

        def counted(fn, *args, grid=None, **kwargs):
            seen.append((fn.fn.__name__, tuple(grid)))
            return run(fn, *args, grid=grid, **kwargs)

        self._patch = mock.patch.object(InterpretedFunction, "run", counted)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)


#: The test model's hidden width: under the interpreter ~1000 elements, with blocks made
#: small (:func:`small_blocks`); compiled, ~12800 (below ONE_PASS_MAX_ELEMENTS), with the
#: GPU's own blocks: several statistics rows and update tiles either way.
WIDTH = 40 if tkern.INTERPRET else 512


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, WIDTH), torch.nn.Linear(WIDTH, 8)).to(DEVICE, dtype)


@pytest.fixture
def small_blocks(monkeypatch):
    """Interpreter blocks small enough that the test model makes several statistics rows
    (whose reduction order then matters) and several update tiles (whole blocks of the
    8-bit state: a multiple of 256). Compiled, the blocks stay: the one-pass kernel must
    match pass 1 in the layouts the GPU's blocks give (tests/test_compiled.py)."""
    if tkern.INTERPRET:
        monkeypatch.setattr(overflow, "BLOCK", 256)
        monkeypatch.setattr(adam, "BLOCK", 256)
        monkeypatch.setattr(sgd, "BLOCK", 256)


def _train(name, dtype, clip, one_pass, steps=4, scaler=None, **kw):
    cls, hyper = OPTIMIZERS[name]
    model = _model(dtype)
    opt = cls(model.parameters(), lr=1e-2, max_grad_norm=clip, cuda_graph=False, **hyper, **kw)
    if not one_pass:
        opt.one_pass_max_elements = 0
    stats, launches = [], []
    for t in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 16, device=DEVICE, dtype=dtype)
        loss = model(x).float().pow(2).sum()
        (loss * 1024.0 if scaler is None else scaler.scale(loss)).backward()
        if t == 2:
            model[0].weight.grad[1, 3] = float("inf")  # skipped: nothing changes, the count stays
        with Launches() as lc:
            if scaler is None:
                opt.step(inv_scale=torch.full((1,), 1 / 1024.0, device=DEVICE))
            else:
                scaler.step(opt)
                scaler.update()
        stats.append(opt.grad_stats.clone())
        launches.append(lc.seen)
    return model, opt, stats, launches


def _assert_same(a, b):
    model_a, opt_a, stats_a, _ = a
    model_b, opt_b, stats_b, _ = b
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
    for s, r in zip(stats_a, stats_b, strict=True):
        assert torch.equal(s, r)  # found_inf, the sum of squares (the clip) and max|g|, bit for bit
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for i, entry in sd_b["state"].items():
        for k, v in entry.items():
            assert torch.equal(sd_a["state"][i][k], v), (i, k)
    for fa, fb in zip(opt_a.flat_buffers[0], opt_b.flat_buffers[0], strict=True):  # the fp32 master
        assert torch.equal(fa.master, fb.master)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_one_pass_step_is_the_two_pass_step_bit_for_bit(small_blocks, name, dtype, clip):
    one = _train(name, dtype, clip, one_pass=True)
    two = _train(name, dtype, clip, one_pass=False)
    _assert_same(one, two)
    assert one[2][2][overflow.FOUND_INF] == 1.0  # step 2 overflowed and was skipped
    assert one[1].state_dict()["state"][0]["step"] == 3.0  # 4 steps, one skipped
    kernel = "_sgd_kernel" if name == "sgd" else "_adam_kernel"
    n = one[1].flat_buffers[0][0].param.numel()
    assert overflow.stats_rows(n) > 2  # the rows' reduction order matters here
    if not tkern.INTERPRET:
        return
    # one Triton launch of one program for the whole step; the two-pass step's three
    assert all(seen == [(kernel, (1,))] for seen in one[3])
    assert all(
        [k for k, _ in seen] == ["_grad_stats_kernel", "_finalize_stats_kernel", kernel] for seen in two[3]
    )


@needs_interpreter
def test_a_grad_scaler_drives_the_one_pass_step_as_the_two_pass_one(small_blocks):
    def scaler():
        return torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=2)

    one = _train("adamw", torch.float16, 0.05, one_pass=True, steps=5, scaler=scaler())
    two = _train("adamw", torch.float16, 0.05, one_pass=False, steps=5, scaler=scaler())
    _assert_same(one, two)
    assert one[2][2][overflow.FOUND_INF] == 1.0
    # besides the scaler's own ops: the step is one Triton launch
    assert all([k for k, _ in seen] == ["_adam_kernel"] for seen in one[3])


@needs_interpreter
def test_steps_the_one_pass_cannot_take_run_in_two_passes():
    model = _model(torch.float16)
    groups = [{"params": [model[0].weight]}, {"params": [p for p in model.parameters()][1:]}]
    cases = {
        "two groups": lambda: FusedAdamW(groups, lr=1e-2),
        "over the size": lambda: _sized(FusedAdamW(model.parameters(), lr=1e-2), 64),
        "tracked overflows": lambda: _tracked(FusedAdamW(model.parameters(), lr=1e-2)),
    }
    for why, make in cases.items():
        opt = make()
        opt.zero_grad()
        model(torch.randn(3, 16, device=DEVICE, dtype=torch.float16)).float().sum().backward()
        with Launches() as lc:
            opt.step()
        names = [k for k, _ in lc.seen]
        assert names[0] == "_grad_stats_kernel" and "_finalize_stats_kernel" in names, why
    assert FusedAdamW(model.parameters()).one_pass_max_elements == _update.ONE_PASS_MAX_ELEMENTS


def _sized(opt, n):
    opt.one_pass_max_elements = n
    return opt


def _tracked(opt):
    opt.track_overflows = True
    return opt


@needs_recorder
def test_a_captured_one_pass_step_replays_the_eager_one(small_blocks):
    """Through the CUDA-graph recorder: warm-up, capture, replays (the overflow replays
    too, skipped on the device), equal to the eager one-pass step and the two-pass one."""
    capture = RecordingCapture()
    cls, hyper = OPTIMIZERS["adamw"]

    def run(one_pass, capture=None):
        model = _model(torch.float16)
        opt = cls(model.parameters(), lr=1e-2, max_grad_norm=0.05, **hyper)
        if capture is not None:
            opt.graph_capture = capture
        if not one_pass:
            opt.one_pass_max_elements = 0
        scale = torch.full((1,), 1 / 1024.0, device=DEVICE)
        stats = []
        for t in range(6):
            opt.zero_grad()
            (
                model(torch.randn(5, 16, device=DEVICE, dtype=torch.float16)).float().pow(2).sum() * 1024
            ).backward()
            if t == 2:
                model[0].weight.grad[1, 3] = float("inf")
            opt.step(inv_scale=scale)
            stats.append(opt.grad_stats.clone())
        return model, opt, stats, None

    replayed = run(True, capture)
    assert replayed[1].graph_counts == {"warmup": 1, "capture": 1, "replay": 4}
    assert capture.unseen_launches() == []
    _assert_same(replayed, run(False, RecordingCapture()))


@needs_interpreter
def test_the_launcher_checks_a_one_pass_launch_before_launching():
    b = _update.UpdateBuffers(
        param=torch.zeros(32, dtype=torch.float16, device=DEVICE),
        grad=torch.zeros(32, dtype=torch.float16, device=DEVICE),
        master=torch.zeros(32, device=DEVICE),
        stats=torch.zeros(3, device=DEVICE),
        inv_scale=torch.ones(1, device=DEVICE),
        step=torch.zeros(1, device=DEVICE),
        state={"momentum_buffer": torch.zeros(32, device=DEVICE)},
    )
    args = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, max_grad_norm=None)
    with Launches() as lc, pytest.raises(ValueError, match="found_inf"):
        sgd.sgd_update(b, one_pass=True, found_inf=torch.zeros(2, device=DEVICE), **args)
    with pytest.raises(ValueError, match="stats"):
        sgd.sgd_update(_with(b, stats=torch.zeros(2, device=DEVICE)), one_pass=True, **args)
    assert lc.seen == []


def _with(b, **kw):
    from dataclasses import replace

    return replace(b, **kw)
