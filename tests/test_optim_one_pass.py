"""The one-pass step (issue 45 item 3): a small step's statistics, update and step count in
one launch -- of one program (``one_pass="single"``) or of up to one program per SM meeting
at a grid barrier (``one_pass="grid"``; one program here: the interpreter runs programs in
turn) -- bit for bit the two-pass step (pass 1, its finalize, pass 2, the step counts), for
FusedAdamW, FusedAdam and FusedSGD, fp16 and bf16 params, the master modes, with and without
clipping by the global norm, through a skipped (overflowing) step. That several programs
meet at the barrier is checked on a GPU only (tests/test_gpu_grid_step.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import DEVICE, needs_recorder
from graph_recorder import RecordingCapture
from triton.runtime.interpreter import InterpretedFunction

import tkern
from tkern.kernels import _update, adam, grid_sync, overflow, sgd
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


def _model(dtype, width=WIDTH, bias=True):
    torch.manual_seed(0)
    layers = torch.nn.Linear(16, width, bias=bias), torch.nn.Linear(width, 8, bias=bias)
    return torch.nn.Sequential(*layers).to(DEVICE, dtype)


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


def _train(name, dtype, clip, one_pass, steps=4, scaler=None, width=WIDTH, bias=True, **kw):
    """``one_pass``: True (the default one-pass step), False (two passes) or a mode."""
    cls, hyper = OPTIMIZERS[name]
    model = _model(dtype, width, bias)
    opt = cls(model.parameters(), lr=1e-2, max_grad_norm=clip, cuda_graph=False, **hyper, **kw)
    if not one_pass:
        opt.one_pass_max_elements = 0
    elif isinstance(one_pass, str):
        opt.one_pass = one_pass
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
        assert (fa.master is None and fb.master is None) or torch.equal(fa.master, fb.master)


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
@pytest.mark.parametrize("mode", ["auto", "grid"])
def test_a_captured_one_pass_step_replays_the_eager_one(small_blocks, mode):
    """Through the CUDA-graph recorder: warm-up, capture, replays (the overflow replays
    too, skipped on the device), equal to the eager one-pass step and the two-pass one;
    the grid step's barrier workspace is made in the warm-up, before the capture."""
    capture = RecordingCapture()
    cls, hyper = OPTIMIZERS["adamw"]

    def run(one_pass, capture=None):
        model = _model(torch.float16)
        opt = cls(model.parameters(), lr=1e-2, max_grad_norm=0.05, **hyper)
        if capture is not None:
            opt.graph_capture = capture
        if not one_pass:
            opt.one_pass_max_elements = 0
        else:
            opt.one_pass = mode
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
    assert replayed[1].step_path.path == ("grid" if mode == "grid" else "single")
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


# --------------------------------------------------------------------------- the grid-wide step


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_grid_step_is_the_two_pass_step_bit_for_bit(small_blocks, name, dtype, clip):
    grid = _train(name, dtype, clip, one_pass="grid")
    two = _train(name, dtype, clip, one_pass=False)
    _assert_same(grid, two)
    assert grid[2][2][overflow.FOUND_INF] == 1.0  # step 2 overflowed and was skipped
    assert grid[1].state_dict()["state"][0]["step"] == 3.0  # 4 steps, one skipped
    assert grid[1].step_path.path == "grid" and two[1].step_path.path == "two-pass"
    # 4 steps (one skipped) met at the barrier: its generation 4, its count and ticket 0
    assert grid[1].grid_barrier.word.tolist() == [4 << 16, 0] and two[1].grid_barrier is None
    if tkern.INTERPRET:  # one launch of one program (programs run in turn here)
        kernel = "_sgd_kernel" if name == "sgd" else "_adam_kernel"
        assert grid[1].step_path.programs == 1
        assert all(seen == [(kernel, (1,))] for seen in grid[3])


#: master modes and state dtypes (with the 8-bit state, weights of MIN_8BIT_SIZE elements
#: or more and no biases: every param 8-bit, so the step is one range)
MODES = [
    ("adamw", torch.bfloat16, {"master": "split"}),
    ("adamw", torch.float16, {"master": "none", "state_dtype": torch.bfloat16}),
    ("adam", torch.bfloat16, {"master": "none", "state_dtype": torch.uint8}),
    ("sgd", torch.float16, {"master": "fp32", "state_dtype": torch.uint8}),
]


@pytest.mark.parametrize(
    "name,dtype,modes", MODES, ids=[f"{m[0]}-{'-'.join(map(str, m[2].values()))}" for m in MODES]
)
def test_the_grid_step_keeps_every_master_mode_bit_for_bit(name, dtype, modes):
    # (the interpreter's large blocks: the modes live in the update's tiles; the statistics'
    # row order is the tests above's)
    eight_bit = modes.get("state_dtype") == torch.uint8
    shape = dict(width=_update.MIN_8BIT_SIZE // 8, bias=False) if eight_bit else {}
    grid = _train(name, dtype, 0.05, one_pass="grid", **shape, **modes)
    two = _train(name, dtype, 0.05, one_pass=False, **shape, **modes)
    _assert_same(grid, two)
    assert grid[1].step_path.path == "grid"
    assert [f.state_dtype for f in grid[1].flat_buffers[0]] == [modes.get("state_dtype", torch.float32)]


@needs_interpreter
def test_a_grad_scaler_drives_the_grid_step_as_the_two_pass_one(small_blocks):
    def scaler():
        return torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=2)

    grid = _train("sgd", torch.bfloat16, 0.05, one_pass="grid", steps=5, scaler=scaler())
    two = _train("sgd", torch.bfloat16, 0.05, one_pass=False, steps=5, scaler=scaler())
    _assert_same(grid, two)
    assert grid[2][2][overflow.FOUND_INF] == 1.0
    assert all([k for k, _ in seen] == ["_sgd_kernel"] for seen in grid[3])


def _adam_buffers(n, seed):
    torch.manual_seed(seed)
    param = torch.randn(n, device=DEVICE).to(torch.float16)
    return _update.UpdateBuffers(
        param=param,
        grad=(torch.randn(n, device=DEVICE) * 1024).to(torch.float16),
        master=param.float(),
        stats=torch.zeros(3, device=DEVICE),
        inv_scale=torch.full((1,), 1 / 1024, device=DEVICE),
        step=torch.zeros(1, device=DEVICE),
        state={"exp_avg": torch.zeros(n, device=DEVICE), "exp_avg_sq": torch.zeros(n, device=DEVICE)},
    )


ADAM_ARGS = dict(
    lr=1e-2,
    beta1=0.9,
    beta2=0.999,
    eps=1e-8,
    weight_decay=0.01,
    decoupled=True,
    amsgrad=False,
    max_grad_norm=1.0,
)


@pytest.mark.parametrize("overflow_at", [None, 1])
def test_the_grid_barrier_resets_itself_at_every_step(small_blocks, overflow_at):
    """Three grid-wide launches on one workspace, each equal to the two-pass kernels: the
    barrier's count is back to 0 after each, its generation one on (a skipped step meets at
    the barrier too), the finishing ticket back to 0."""
    n = 1024
    grid, two = _adam_buffers(n, 0), _adam_buffers(n, 0)
    barrier = grid_sync.new_grid_barrier(torch.device(DEVICE))
    assert barrier.max_programs == (1 if tkern.INTERPRET else grid_sync.sm_count(torch.device(DEVICE)))
    for t in range(3):
        grads = torch.randn(n, device=DEVICE) * 1024
        if t == overflow_at:
            grads[5] = float("inf")
        grid.grad.copy_(grads)
        two.grad.copy_(grads)
        adam.adam_update(grid, **ADAM_ARGS, one_pass=True, barrier=barrier)
        two.stats = overflow.grad_stats([two.grad], two.inv_scale)
        adam.adam_update(two, **ADAM_ARGS)
        two.step.add_(1 - two.stats[:1])
        assert barrier.word.tolist() == [(t + 1) << 16, 0]  # generation t + 1, count 0; ticket 0
        for a, b in (
            (grid.param, two.param),
            (grid.master, two.master),
            (grid.step, two.step),
            (grid.stats, two.stats),
        ):
            assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(grid.state[k], two.state[k])
    assert grid.step.item() == (2.0 if overflow_at is not None else 3.0)


@needs_interpreter
def test_the_launchers_check_a_grid_launch_before_launching():
    b = _adam_buffers(256, 0)
    word = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    bad = {
        "co-resident": grid_sync.GridBarrier(word, 2),  # two programs would spin forever here
        "int32": grid_sync.GridBarrier(torch.zeros(2, device=DEVICE), 1),
        "contiguous": grid_sync.GridBarrier(torch.zeros(4, dtype=torch.int32, device=DEVICE)[::2], 1),
    }
    with Launches() as lc:
        for why, barrier in bad.items():
            with pytest.raises((ValueError, TypeError), match=why):
                adam.adam_update(b, **ADAM_ARGS, one_pass=True, barrier=barrier)
        with pytest.raises(ValueError, match="one_pass=True"):
            adam.adam_update(b, **ADAM_ARGS, barrier=grid_sync.GridBarrier(word, 1))
        with pytest.raises(ValueError, match="co-resident"):
            grid_sync.new_grid_barrier(torch.device(DEVICE), 2)
    assert lc.seen == []


def test_which_path_a_step_takes():
    path = _update.step_path
    single, grid = _update.ONE_PASS_MAX_ELEMENTS, _update.GRID_MAX_ELEMENTS
    h100 = dict(device_programs=132, interpret=False)
    cases = [  # (n, mode, device) -> (path, programs)
        ((1 << 20, "auto", h100), ("two-pass", 0)),  # the grid path is not the default
        ((single, "auto", h100), ("single", 1)),
        ((single, "single", h100), ("single", 1)),
        ((single + 16, "single", h100), ("two-pass", 0)),
        ((16, "off", h100), ("two-pass", 0)),
        ((1 << 20, "grid", h100), ("grid", 132)),
        ((16, "grid", h100), ("grid", 132)),  # the launcher keeps one program per tile
        ((grid, "grid", h100), ("grid", 132)),
        ((grid + 16, "grid", h100), ("two-pass", 0)),
        ((1000, "grid", h100), ("two-pass", 0)),  # not a multiple of 16: pass 1 splits it
        ((0, "grid", h100), ("two-pass", 0)),
        ((1 << 20, "grid", dict(device_programs=0, interpret=False)), ("two-pass", 0)),  # no CUDA
        ((1 << 20, "grid", dict(device_programs=1, interpret=True)), ("grid", 1)),  # programs in turn
    ]
    for (n, mode, device), expected in cases:
        got = path(n, mode, **device)
        assert (got.path, got.programs) == expected, (n, mode, device, got)
        assert got.reason
    assert path(64, "single", device_programs=0, single_max=32).path == "two-pass"
    with pytest.raises(ValueError, match="one_pass"):
        path(64, "fast", device_programs=0)
    # the optimizer: the mode it was given, refused when unknown, its last step's path
    opt = FusedAdamW(_model(torch.float16).parameters())
    assert opt.one_pass == "auto" and opt.step_path is None
    with pytest.raises(ValueError, match="one_pass"):
        opt.one_pass = "grid-wide"
    assert opt.one_pass == "auto"
    # a grid launch never has more programs than tiles, nor than the barrier allows
    barrier = grid_sync.GridBarrier(torch.zeros(2, dtype=torch.int32), 132)
    assert [_update.grid_programs(n, 1024, barrier) for n in (16, 1024, 1040, 1 << 20)] == [1, 1, 2, 132]
