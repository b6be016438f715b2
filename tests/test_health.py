"""Mixed-precision health: which tensors overflowed, recorded by the step's
statistics pass on the device, the sampled fraction of each tensor's gradient that is
zero or subnormal in 16 bits, and the "scale likely too low" warning, read on demand
(issue 37 item 7)."""

from __future__ import annotations

import logging
import math
import warnings
from unittest import mock

import pytest
import torch
from conftest import DEVICE, count_syncs, needs_recorder
from graph_recorder import RecordingCapture
from torch import nn
from triton.runtime.interpreter import InterpretedFunction

import tkern
from tkern.kernels.overflow import (
    BLOCK,
    FOUND_INF,
    N_COUNTS,
    OverflowFlags,
    UnderflowCounts,
    grad_stats,
    grad_underflow,
)
from tkern.optim import FusedAdamW
from tkern.optim.report import OverflowReport


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


def test_params_given_with_names_are_reported_by_them_and_tracking_stays_opt_in():
    torch.manual_seed(0)
    model = Net().to(DEVICE).half()
    named = list(model.named_parameters())
    # two groups, as torch takes them: names from named_parameters() land in param_names
    opt = FusedAdamW([{"params": named[:4]}, {"params": named[4:], "lr": 1e-4}], lr=1e-3)
    backward(model, model.head.weight)
    opt.step()
    with pytest.raises(RuntimeError, match="tracking is off"):  # names alone turn nothing on
        opt.overflow_report()
    opt.track_overflows = True
    opt.zero_grad()
    backward(model, model.head.weight)
    model.blocks[0].bias.grad[0] = float("nan")
    opt.step()
    assert sorted(opt.overflow_report().nonfinite) == ["blocks.0.bias", "head.weight"]
    # name_params' names win over the given ones
    opt.name_params(nn.ModuleDict({"top": model}))
    assert sorted(opt.overflow_report().nonfinite) == ["top.blocks.0.bias", "top.head.weight"]


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
    grad = grad.to(DEVICE)
    flags = torch.full((len(sizes),), 7, dtype=torch.int32, device=DEVICE)  # untouched slots keep theirs
    inv_scale = torch.full((1,), 0.5, device=DEVICE)
    track = [OverflowFlags((starts + base).to(DEVICE), flags, base)]
    stats = grad_stats([grad], inv_scale, track, stamp=9)
    expected = torch.full((len(sizes),), 7, dtype=torch.int32)
    for i in bad_at:
        expected[torch.searchsorted(starts, torch.tensor(i), right=True) - 1] = 9
    assert torch.equal(flags.cpu(), expected)
    assert torch.equal(stats, grad_stats([grad], inv_scale))  # the statistics are the same
    assert stats[FOUND_INF] == 1.0


def test_grad_stats_rejects_bad_tracking_input():
    grad, inv = torch.zeros(32, dtype=torch.float16, device=DEVICE), torch.ones(1, device=DEVICE)
    flags = OverflowFlags(
        torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE)
    )
    with pytest.raises(ValueError, match="one entry per gradient"):
        grad_stats([grad], inv, [flags, flags])
    with pytest.raises(ValueError, match="stamp"):
        grad_stats([grad], inv, [flags], stamp=0)
    starts = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="one non-empty length"):
        grad_stats([grad], inv, [OverflowFlags(starts, flags.flags)])


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


# --------------------------------------------------------------------------- zeros and subnormals


def reference_counts(grad: torch.Tensor) -> tuple[int, int, int]:
    """(zeros, subnormals, elements) of a 16-bit (or fp32) gradient, in plain torch."""
    x = grad.detach().reshape(-1).float()  # exact: every fp16/bf16 value, subnormals too
    tiny = torch.finfo(grad.dtype).tiny  # the dtype's smallest normal
    return int((x == 0).sum()), int(((x != 0) & (x.abs() < tiny)).sum()), x.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_underflow_counts_match_a_torch_reference(dtype):
    # params padded to 16 (the padding is not counted), several programs' shares, params
    # smaller than a chunk and larger, the tensor starting `base` into the first param's slot
    # and running 3 elements past the last slot's end into a tail launch of its own
    g = torch.Generator().manual_seed(2)
    sizes = torch.randint(1, BLOCK // 3, (30,), generator=g).tolist() + [7, 1, 130]
    slots = [-(-n // 16) * 16 for n in sizes]
    starts = torch.tensor([0, *torch.tensor(slots).cumsum(0)[:-1].tolist()])
    ends = starts + torch.tensor(sizes)
    base = 16
    n = sum(slots) - base + 3
    tiny = torch.finfo(dtype).tiny
    grad = (torch.randn(n, generator=g) * tiny * 4).to(dtype)  # a third or so subnormal
    grad[torch.rand(n, generator=g) < 0.1] = 0.0
    grad[torch.rand(n, generator=g) < 0.05] = -0.0  # a negative zero is a zero
    padded = torch.ones(sum(slots), dtype=dtype)
    padded[base:] = grad[: sum(slots) - base]
    expected = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        expected.append(reference_counts(padded[max(s, base) : e]) if e > base else (0, 0, 0))
    counts = torch.full((len(sizes), N_COUNTS), 5, dtype=torch.int64, device=DEVICE)  # added to
    grad_underflow([grad.to(DEVICE)], [UnderflowCounts(starts.to(DEVICE), ends.to(DEVICE), counts, base)])
    assert torch.equal(counts.cpu() - 5, torch.tensor(expected))
    assert (counts[:, 1] > 5).sum() > 20  # the subnormals are really there


def test_grad_underflow_rejects_bad_input():
    grad = torch.zeros(32, dtype=torch.float16, device=DEVICE)
    starts, ends = torch.tensor([0, 16], device=DEVICE), torch.tensor([10, 30], device=DEVICE)
    counts = torch.zeros(2, N_COUNTS, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="one entry per gradient"):
        grad_underflow([grad], [])
    with pytest.raises(ValueError, match=r"counts \(P, 3\)"):
        grad_underflow([grad], [UnderflowCounts(starts, ends, counts[:1])])
    with pytest.raises(TypeError):
        grad_underflow([grad], [UnderflowCounts(starts, ends, counts.int())])
    with pytest.raises(ValueError, match="base"):
        grad_underflow([grad], [UnderflowCounts(starts, ends, counts, -1)])
    with pytest.raises(TypeError):
        grad_underflow([grad.to(torch.int16)], [UnderflowCounts(starts, ends, counts)])
    assert not counts.any()  # nothing was counted


def scaled_backward(model, scale):
    """One backward of the loss times ``scale`` (what a loss scaler does)."""
    (model(torch.randn(16, 8, device=DEVICE).half()).float().sum() * scale).backward()


def test_fractions_match_torch_on_the_stored_gradients_named():
    model, opt = named_setup()
    opt.track_underflows(every=1)
    scaled_backward(model, 2.0**-18)  # a tiny scale: many gradients subnormal or flushed
    expected = {name: reference_counts(p.grad) for name, p in model.named_parameters()}
    opt.step(inv_scale=torch.full((1,), 2.0**18, device=DEVICE))
    report = opt.overflow_report()
    assert report.sampled_step == 1 and not report.sampled_skipped
    assert report.zero_fraction.keys() == report.subnormal_fraction.keys() == expected.keys()
    for name, (zeros, subnormals, n) in expected.items():
        assert report.zero_fraction[name] == zeros / n, name
        assert report.subnormal_fraction[name] == subnormals / n, name
    assert sum(report.subnormal_fraction.values()) > 1.0  # the case is not vacuous
    assert report.sampled_scale == 2.0**-18
    largest = max(p.grad.float().abs().max().item() for p in model.parameters())
    assert report.headroom == pytest.approx(torch.finfo(torch.float16).max / largest, rel=1e-6)


#: Tests that count launches through Triton's interpreter (CPU tensors): on a GPU machine
#: the kernels are compiled and nothing would be counted.
needs_interpreter = pytest.mark.skipif(
    not tkern.INTERPRET, reason="counts launches through Triton's interpreter (CPU tensors)"
)


class LaunchCount:
    """Counts the Triton launches (interpreted kernels) by kernel name."""

    def __init__(self):
        self.names: list[str] = []

    def __enter__(self):
        run = InterpretedFunction.run
        names = self.names

        def counted(fn, *args, **kwargs):
            names.append(fn.fn.__name__)
            return run(fn, *args, **kwargs)

        self._patch = mock.patch.object(InterpretedFunction, "run", counted)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)

    def count(self, name: str) -> int:
        return self.names.count(name)


@needs_interpreter
def test_sampled_every_k_steps_and_no_extra_launch_otherwise():
    model, opt = named_setup()
    backward(model)
    opt.step()  # state allocated
    launches = {}
    for every in (None, 3):
        opt.track_underflows(every)
        per_step = []
        for _ in range(6):  # steps 2..7 off, then 8..13 with every=3
            opt.zero_grad()
            backward(model)
            with LaunchCount() as lc:
                opt.step()
            per_step.append(lc.names)
        launches[every] = per_step
    assert all("_grad_underflow_kernel" not in names for names in launches[None])
    sampled = [names.count("_grad_underflow_kernel") for names in launches[3]]
    assert sampled == [0, 1, 0, 0, 1, 0]  # steps 9 and 12 (of 8..13)
    # a step that is not sampled launches exactly what a step with sampling off does
    assert launches[3][0] == launches[None][0]
    assert opt.overflow_report().sampled_step == 12


@needs_interpreter
def test_zero_launches_and_no_state_when_off():
    # off by default: the step launches what it did before health tracking existed (the
    # statistics, the update, the step counts; a small step all in one launch), and no
    # counts are ever allocated
    model, opt = named_setup(name=False)
    assert opt.underflow_every is None and not opt.track_overflows
    backward(model)
    opt.step()
    with LaunchCount() as lc:
        opt.step()
    assert lc.names == ["_adam_kernel"]  # the one-pass step (tests/test_optim_one_pass.py)
    opt.one_pass_max_elements = 0
    with LaunchCount() as lc:
        opt.step()
    assert lc.names == ["_grad_stats_kernel", "_finalize_stats_kernel", "_adam_kernel"]
    assert opt._underflow_counts == {} and opt._underflow_meta is None


def test_no_sync_in_sampled_steps_one_when_the_report_is_read():
    model, opt = named_setup()
    opt.track_underflows(every=2)
    backward(model)
    opt.step()
    with count_syncs() as calls:
        for _ in range(4):
            opt.zero_grad()
            scaled_backward(model, 2.0**-18)
            opt.step()
    assert calls == []
    with count_syncs() as calls:
        report = opt.overflow_report()
    assert len(calls) == 1
    assert report.sampled_step == 4 and report.subnormal_fraction


def test_track_underflows_rejects_bad_every_and_changes_nothing():
    _, opt = named_setup(name=False)
    bad_values = ((0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("3", TypeError))
    for bad, error in bad_values:
        with pytest.raises(error, match="every must be an int >= 1 or None"):
            opt.track_underflows(bad)
        assert opt.underflow_every is None and not opt.track_overflows
    opt.track_underflows(every=4)
    assert opt.underflow_every == 4 and opt.track_overflows  # the report needs overflow tracking
    opt.track_underflows(None)
    assert opt.underflow_every is None and opt.track_overflows


@needs_recorder
def test_a_sampled_step_replays_the_graph_and_counts_after_it():
    # the graph is the same whether or not a step is sampled (the count is launched after
    # the replay): every step after the capture replays, and the fractions are the sampled
    # step's own gradients
    model, opt = named_setup()
    opt.graph_capture = RecordingCapture()
    opt.track_underflows(every=3)
    reasons, expected = [], None
    for t in range(1, 8):
        opt.zero_grad()
        scaled_backward(model, 2.0 ** (-18 if t == 6 else -10))
        if t == 6:
            expected = {name: reference_counts(p.grad) for name, p in model.named_parameters()}
        with LaunchCount() as lc:
            opt.step()
        reasons.append((opt.graph_fallback, lc.count("_grad_underflow_kernel")))
    assert reasons[2:] == [(None, 1), (None, 0), (None, 0), (None, 1), (None, 0)]
    assert opt.graph_counts == {"warmup": 1, "capture": 1, "replay": 5}
    report = opt.overflow_report()
    assert report.sampled_step == 6 and report.sampled_scale == 1.0
    assert report.subnormal_fraction == {name: s / n for name, (_, s, n) in expected.items()}


def report_with(**fields):
    base = dict(step=10, skipped=False, nonfinite=[], last_overflow={}, sampled_step=10,
                zero_fraction={"a": 0.5, "b": 0.9}, subnormal_fraction={"a": 0.2, "b": 0.001},
                sampled_scale=1.0, headroom=1e4)  # fmt: skip
    return OverflowReport(**{**base, **fields})


def test_scale_too_low_rule():
    assert report_with().scale_too_low() == ["a"]  # b: zeros do not count, 0.1% subnormal is below 1%
    assert report_with().scale_too_low(threshold=0.001) == ["a", "b"]
    assert report_with(sampled_skipped=True).scale_too_low() == []  # the scale overflowed there
    assert report_with(headroom=1.9).scale_too_low() == []  # doubling the scale would overflow
    assert report_with(headroom=math.inf).scale_too_low() == ["a"]
    assert report_with(sampled_step=None).scale_too_low() == []
    with pytest.raises(ValueError, match="threshold"):
        report_with().scale_too_low(threshold=0.0)


def test_scaler_overflow_report_is_the_optimizers():
    model, opt = named_setup()
    opt.track_underflows(every=1)
    scaler = tkern.StaticLossScaler(2.0**-16)
    with pytest.raises(RuntimeError, match="stepped no tkern fused optimizer"):
        scaler.overflow_report()
    scaler.scale(model(torch.randn(16, 8, device=DEVICE).half()).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    assert report == opt.overflow_report() == scaler.overflow_report(opt)
    assert report.sampled_scale == 2.0**-16 and report.scale_too_low()
    _, other = named_setup()
    with pytest.raises(ValueError, match="not stepped that optimizer"):
        scaler.overflow_report(other)


def test_a_scaler_that_has_stepped_pickles_and_its_copies_report_their_own():
    """The scaler's weak references to the optimizers it stepped (for overflow_report)
    must not make it unpicklable (torch.save of a checkpoint dict holding it, deepcopy
    of (model, opt, scaler)); a copy's report is the copied optimizer's."""
    import copy
    import pickle

    model, opt = named_setup()
    scaler = tkern.DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(model(torch.randn(16, 8, device=DEVICE).half()).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    again = pickle.loads(pickle.dumps(scaler))
    got = again.state_dict()
    for k, v in scaler.state_dict().items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
    m2, o2, s2 = copy.deepcopy((model, opt, scaler))
    with pytest.raises(RuntimeError, match="stepped no tkern fused optimizer"):
        s2.overflow_report()  # not the original's optimizer
    s2.scale(m2(torch.randn(16, 8, device=DEVICE).half()).float().sum()).backward()
    s2.step(o2)
    s2.update()
    assert s2.overflow_report() == o2.overflow_report()


def fit_small(scaler, every=1):
    torch.manual_seed(0)
    model = tkern.convert_network(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 2)).to(DEVICE))
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    opt.track_underflows(every)
    trainer = tkern.Trainer(model, opt, nn.functional.cross_entropy, scaler, progress=False)
    x = torch.randn(32, 12)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(loader, 1)
    low = [w for w in seen if "likely too low" in str(w.message)]
    assert all(w.category is RuntimeWarning for w in low)
    return [str(w.message) for w in low]


def test_trainer_warns_when_the_scale_is_likely_too_low():
    # a scale of 2^-20 pushes the fp16 gradients into the subnormals and below (flushed)
    lines = fit_small(tkern.StaticLossScaler(2.0**-20))
    assert len(lines) == 1
    head = "step 4: loss scale 9.53674e-07 is likely too low: gradients subnormal in 16 bits: "
    assert lines[0].startswith(head)
    assert "2.weight " in lines[0] and "(1% or more of a tensor" in lines[0]


def test_trainer_does_not_warn_on_a_healthy_scale():
    assert fit_small(tkern.DynamicLossScaler()) == []
