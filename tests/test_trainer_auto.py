"""Trainer(cuda_graph="auto"), the default: the rule (:func:`tkern.train.trainer_graph.choose`),
and its choices and fallbacks through :class:`graph_recorder.RecordingCapture`, which
records a capture's launches and replays exactly those on a CPU, with the host and device
times a GPU would measure given to it (a step the host bounds, or the device)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DEVICE, needs_recorder
from graph_recorder import RecordingCapture
from test_trainer_graph import batches, make_trainer, same_history, same_params, tiny_model
from torch import nn

import tkern
from tkern.graphs import STRICT_ENV, PoolUsage, StepGraphs, pool_usage, trace_launches
from tkern.optim import FusedAdamW
from tkern.train.trainer import HOST_BOUND_SHARE
from tkern.train.trainer_graph import Observation, batch_key, choose
from tkern.train.trainer_memory import memory_report

# ------------------------------------------------------------------ cuda_graph="auto"

HOST_BOUND = (2.0, 2.2)  # (host ms, synced ms): the 2-layer MLP's kind of step
DEVICE_BOUND = (0.4, 10.0)  # GPT-2's kind: the host waits for the device


def test_the_auto_rule():
    def traced(ops=("aten::mm",), read=None):  # its times carry the trace's own cost: not used
        return Observation(900e-3, 901e-3, list(ops), read)

    def timed(host, synced):
        return Observation(host / 1e3, synced / 1e3)

    first = timed(900.0, 901.0)  # compiles, builds state: left out
    same = [first, traced(), traced()]
    assert choose([*same, timed(2.0, 2.2)]) == (
        True, "the host bounds it: launching takes 91% (2 ms of a 2.2 ms step; >= 60%)",
    )  # fmt: skip
    assert choose([*same, timed(0.6, 1.0)])[0] and HOST_BOUND_SHARE == 0.6  # the boundary captures
    assert choose([*same, timed(0.4, 10.0)]) == (
        False, "the device bounds it: launching takes 4% (0.4 ms of a 10 ms step; < 60%)",
    )  # fmt: skip
    capture, why = choose([first, traced(("aten::relu",)), traced(("aten::tanh",)), timed(2.0, 2.2)])
    assert not capture and "different ops, or the same ops on different parameters" in why
    capture, why = choose([first, traced(), traced(read="aten._local_scalar_dense.default"), timed(2.0, 2.2)])
    assert not capture and why.startswith("the step reads a device value on the host (aten._local_scalar")


@pytest.mark.skipif(DEVICE == "cuda", reason="the choice for a model off CUDA")
def test_auto_is_the_default_and_resolves_to_eager_on_a_cpu_saying_why(caplog):
    data = batches([4, 4, 4, 2], overflow_at=1)
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="tkern.train.trainer"):
        warnings.simplefilter("error")  # the default is quiet: a log line, not a warning
        model = tiny_model()
        auto = tkern.Trainer(
            model, FusedAdamW(model.parameters(), lr=1e-2, cuda_graph=False), nn.functional.cross_entropy,
            tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=5), progress=False,
        )  # fmt: skip
    assert auto.cuda_graph == "auto" and auto.graphs is None
    assert auto.graph_status == "eager: the model is on cpu, and only cuda work can be captured"
    assert [r.getMessage() for r in caplog.records] == [f"Trainer(cuda_graph='auto'): {auto.graph_status}"]
    auto.fit(data, 1)
    eager = make_trainer()
    eager.fit(data, 1)
    same_history(auto.history, eager.history)
    same_params(auto, eager)


def _auto(timing=HOST_BOUND, **kwargs):
    capture = RecordingCapture(timing=timing, **kwargs)
    return make_trainer(capture, cuda_graph="auto"), capture


@needs_recorder
def test_auto_captures_a_host_bound_static_shape_and_never_the_last_partial_batch(caplog):
    data = batches([4] * 6 + [2], overflow_at=5)
    auto, capture = _auto()
    with caplog.at_level("INFO", logger="tkern.train.trainer"):
        auto.fit(data, 2)
    eager = make_trainer()
    eager.fit(data, 2)
    # epoch 1: four batches of 4 observed (eager), one warm-up through the static buffers,
    # the capture; the batch of 2 is observed once in a row: eager, every epoch
    assert capture.log[:7] == ["time"] * 4 + ["warmup", "capture", "replay"]
    assert capture.log.count("capture") == 1
    assert auto.graph_counts == {"eager": 4 + 2, "warmup": 1, "capture": 1, "replay": 6 * 2 - 6}
    full, small = batch_key(*data[0]), batch_key(*data[-1])
    assert auto.graph_choices == {full: (True, choose_host_bound_reason())}
    assert auto.graph_status == "eager for batches of shape (2, 6): observed 1 of 4 steps in a row"
    lines = [r.getMessage() for r in caplog.records]
    assert (
        lines.count(
            f"Trainer(cuda_graph='auto'): graphed for batches of shape (4, 6): {choose_host_bound_reason()}"
        )
        == 1
    )
    assert (
        "Trainer(cuda_graph='auto'): batches of shape (2, 6) run eager: 1 step(s) in a row, "
        "and a shape is captured after 4 in a row" in lines
    )
    assert small not in auto.graph_choices
    same_history(auto.history, eager.history)
    same_params(auto, eager)
    assert auto.skipped_steps == eager.skipped_steps == 2


def choose_host_bound_reason():
    return "the host bounds it: launching takes 91% (2 ms of a 2.2 ms step; >= 60%)"


@needs_recorder
def test_auto_keeps_a_device_bound_step_eager(caplog):
    auto, capture = _auto(DEVICE_BOUND)
    data = batches([4] * 6)
    with caplog.at_level("INFO", logger="tkern.train.trainer"):
        auto.fit(data, 1)
    assert "capture" not in capture.log and capture.log.count("time") == 4
    why = "the device bounds it: launching takes 4% (0.4 ms of a 10 ms step; < 60%)"
    assert auto.graph_status == f"eager for batches of shape (4, 6): {why}"
    assert auto.graph_counts == {"eager": 6}
    assert [r.getMessage() for r in caplog.records] == [f"Trainer(cuda_graph='auto'): {auto.graph_status}"]
    eager = make_trainer()
    eager.fit(data, 1)
    same_history(auto.history, eager.history)


def _auto_on(model, capture):
    opt = FusedAdamW(model.parameters(), lr=1e-2, cuda_graph=False)
    return tkern.Trainer(
        model, opt, nn.functional.cross_entropy, tkern.DynamicLossScaler(init_scale=2.0**10),
        progress=False, graph_capture=capture,
    )  # fmt: skip


class Branchy(nn.Module):
    """A branch on a host counter: odd calls take relu, even ones tanh."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.inner[0](x)
        return self.inner[2](torch.relu(h) if self.calls % 2 else torch.tanh(h))


VARYING = (
    "eager for batches of shape (4, 6): its steps ran different ops, or the same ops on "
    "different parameters (a data-dependent branch), so one graph cannot replay them"
)


@needs_recorder
def test_auto_never_captures_a_step_whose_ops_vary():
    capture = RecordingCapture(timing=HOST_BOUND)
    auto = _auto_on(Branchy(tiny_model()), capture)
    auto.fit(batches([4] * 6), 1)
    assert "capture" not in capture.log
    assert auto.graph_status == VARYING


class Alternating(nn.Module):
    """A host counter picks the first layer: ``first`` on odd calls, ``other`` on even
    ones, of the same shapes: the same ops, on other weights."""

    def __init__(self):
        super().__init__()
        inner = tiny_model()
        self.first, self.other, self.last = inner[0], tiny_model(seed=1)[0], inner[2]
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.last(torch.relu((self.first if self.calls % 2 else self.other)(x)))


@needs_recorder
def test_auto_never_captures_a_step_that_picks_other_weights_of_the_same_shapes():
    capture = RecordingCapture(timing=HOST_BOUND)
    auto = _auto_on(Alternating(), capture)
    auto.fit(batches([4] * 6), 1)
    assert "capture" not in capture.log
    assert auto.graph_status == VARYING


def test_a_launch_trace_sees_tkern_launches_with_their_tensors_and_only_inside_it():
    """On a GPU tkern's launches never pass torch's dispatcher: the auto rule sees them
    (and which weights they read) through :func:`tkern.graphs.trace_launches`."""
    first, other = tiny_model()[0], tiny_model(seed=1)[0]
    x = torch.randn(4, 6, device=DEVICE)
    seen = []
    with trace_launches(lambda name, args, kwargs: seen.append((name, [*args, *kwargs.values()]))):
        first(x)
    first(x)  # outside: not seen
    other(x)
    assert [name for name, _ in seen] == ["_matmul_kernel"]
    addresses = [a.data_ptr() for a in seen[0][1] if isinstance(a, torch.Tensor)]
    assert first.weight.data_ptr() in addresses and other.weight.data_ptr() not in addresses


class Reading(nn.Module):
    """A branch on the device: the sign of the batch's first value (``.item()``) picks the activation."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = self.inner[0](x)
        return self.inner[2](torch.relu(h) if x[0, 0].item() > 0 else torch.tanh(h))


@needs_recorder
def test_auto_never_captures_a_step_that_reads_the_device_on_the_host():
    data = batches([4] * 6)
    for i, (x, _) in enumerate(data):
        x[0, 0] = 1.0 if i % 2 else -1.0
    capture = RecordingCapture(timing=HOST_BOUND)
    auto = _auto_on(Reading(tiny_model()), capture)
    auto.fit(data, 1)
    assert "capture" not in capture.log
    assert auto.graph_status == (
        "eager for batches of shape (4, 6): the step reads a device value on the host "
        "(aten._local_scalar_dense.default), which a graph cannot replay"
    )


@needs_recorder
def test_auto_decides_again_for_a_new_shape():
    auto, capture = _auto()
    auto.fit(batches([4] * 6), 1)
    auto.fit(batches([6] * 6), 2)  # a new batch shape: observed, then its own graph
    assert capture.log.count("capture") == 2 and capture.log.count("time") == 8
    assert [c for c, _ in auto.graph_choices.values()] == [True, True]
    assert auto.graph_status == f"graphed for batches of shape (6, 6): {choose_host_bound_reason()}"
    assert auto.memory_report()["graphs"] == capture.reserved_bytes() > 0


def test_a_graph_pool_is_measured_by_its_segments_in_an_allocator_snapshot():
    mib = 1 << 20
    segments = [  # torch.cuda.memory_snapshot()'s fields that count
        {"segment_pool_id": (0, 0), "total_size": 20 * mib, "allocated_size": 5 * mib},  # the default pool
        {"segment_pool_id": (0, 3), "total_size": 2 * mib, "allocated_size": 4096},
        {"segment_pool_id": (0, 3), "total_size": 20 * mib, "allocated_size": 12 * mib},
        {"segment_pool_id": (0, 4), "total_size": 2 * mib, "allocated_size": 512},  # another graph's
    ]
    assert pool_usage(segments, (0, 3)) == PoolUsage(reserved=22 * mib, allocated=12 * mib + 4096)
    assert pool_usage(segments, [0, 4]) == (2 * mib, 512) and pool_usage(segments, (0, 9)) == (0, 0)


class MeasuredCapture(RecordingCapture):
    """The recorder with a pool it measures, as :class:`tkern.graphs.CudaGraphCapture` does."""

    def pool_usage(self):
        return PoolUsage(reserved=6 << 20, allocated=1 << 20)


def test_the_graphs_report_the_seams_pool_and_the_activations_less_its_allocated_bytes(monkeypatch):
    graphs = StepGraphs(MeasuredCapture(), warmup_steps=1, max_graphs=1)
    x = torch.ones(4)
    for _ in range(3):  # a warm-up, the capture, a replay
        graphs.run(lambda t: t * 2, (x,), lambda: 0)
    graphs.reset()  # dropped and captured again into the same pool: the pool still holds its segments
    assert graphs.pool_bytes == 6 << 20 and graphs.pool_usage() == (6 << 20, 1 << 20)
    model = tiny_model()  # on CUDA the activations are the allocated peak less the rest, all allocated
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 40 << 20)
    report = memory_report(
        model,
        FusedAdamW(model.parameters()),
        torch.device("cuda"),
        0,
        graph_bytes=6 << 20,
        graph_allocated=1 << 20,
    )
    rest = report["model"] + report["optimizer"] + report["grads"]
    assert report["graphs"] == 6 << 20 and report["activations"] == (40 << 20) - rest - (1 << 20)


@needs_recorder
def test_auto_falls_back_visibly_when_a_capture_fails(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)  # as a user runs
    auto, capture = _auto(fail=True)
    data = batches([4] * 7, overflow_at=5)
    failed = (
        r"^Trainer\(cuda_graph='auto'\): capturing the step for batches of shape \(4, 6\) failed "
        r"\(RuntimeError: operation not permitted when stream is capturing\); "
        r"batches of this shape run eager$"
    )
    with pytest.warns(UserWarning, match=failed):
        auto.fit(data, 1)
    assert auto.graph_status.startswith("eager for batches of shape (4, 6): capturing the step")
    eager = make_trainer()
    eager.fit(data, 1)
    same_history(auto.history, eager.history)  # the recorder fails before the step runs: none lost
    same_params(auto, eager)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="^operation not permitted when stream is capturing"):
        _auto(fail=True)[0].fit(data, 1)


@needs_recorder
def test_a_failed_capture_that_ran_the_step_counts_it_once(monkeypatch):
    """CUDA may fail a capture at its end, after the step's Python ran: the step taken
    again eager counts once in the optimizer's steps and the scaler's updates."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    auto, capture = _auto(fail="after")
    data = batches([4] * 7, overflow_at=5)
    with pytest.warns(UserWarning, match=r"operation failed due to a previous error during capture"):
        auto.fit(data, 1)
    assert capture.log == ["time"] * 4 + ["warmup", "capture"]  # it raised: nothing replays
    eager = make_trainer()
    eager.fit(data, 1)
    assert auto.optimizer.host_counters() == eager.optimizer.host_counters() == {"steps": 7}
    assert auto.scaler.state_dict()["updates"] == eager.scaler.state_dict()["updates"] == 7
    same_history(auto.history, eager.history)  # the recorder undid the capture's launches
    same_params(auto, eager)


def _ranked_run(rank, timings):
    """A trainer on this rank's data whose optimizer combines its statistics over the
    world (DDP-style replicas), the step timed as ``timings[rank]``."""
    import torch.distributed as dist

    model = tiny_model()
    opt = FusedAdamW(model.parameters(), lr=1e-2, cuda_graph=False, process_group=dist.group.WORLD)
    capture = RecordingCapture(timing=timings[rank])
    auto = tkern.Trainer(
        model, opt, nn.functional.cross_entropy, tkern.DynamicLossScaler(init_scale=2.0**10),
        progress=False, graph_capture=capture,
    )  # fmt: skip
    auto.fit(batches([4] * 6, seed=rank), 1)
    return {"choices": list(auto.graph_choices.values()), "log": capture.log}


def _scenario_agree(rank, world):
    return {
        "split": _ranked_run(rank, [HOST_BOUND, DEVICE_BOUND]),
        "alike": _ranked_run(rank, [HOST_BOUND, HOST_BOUND]),
    }


SCENARIOS = {"agree": _scenario_agree}


@needs_recorder
def test_the_ranks_of_a_process_group_choose_alike(tmp_path):
    """Each rank times its own step: under a process_group the choice is all-reduced, so a
    rank that would capture stays eager where another chose eager (and captures where all did)."""
    from scenarios import result, run_scenarios

    host, device = result(run_scenarios("test_trainer_auto", 2, ["agree"], tmp_path, timeout_s=600), "agree")
    assert host["split"]["choices"] == [
        (False, "another rank chose eager for it, and the ranks of a process group choose alike")
    ]
    why = "the device bounds it: launching takes 4% (0.4 ms of a 10 ms step; < 60%)"
    assert device["split"]["choices"] == [(False, why)]
    assert "capture" not in host["split"]["log"] and "capture" not in device["split"]["log"]
    for rank in (host, device):
        assert rank["alike"]["choices"] == [(True, choose_host_bound_reason())]
        assert rank["alike"]["log"].count("capture") == 1


@needs_recorder
def test_auto_stays_eager_while_the_optimizer_samples_underflows():
    auto, capture = _auto()
    auto.optimizer.track_underflows(every=2)
    auto.fit(batches([4] * 5), 1)
    assert "capture" not in capture.log
    assert auto.graph_status.endswith(
        "optimizer.track_underflows samples steps, which a graph's replays would not"
    )


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device and compiled Triton")
def test_real_auto_captures_a_tiny_host_bound_model_and_trains_as_eager():
    """A model this small is all launches: "auto" times it host-bound and captures it;
    the last, smaller batch of every epoch stays eager; bit for bit an eager trainer."""
    data = [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches([64] * 8 + [40], overflow_at=6)]
    auto = make_trainer(cuda_graph="auto")
    auto.fit(data, 3)
    eager = make_trainer()
    eager.fit(data, 3)
    assert [captured for captured, _ in auto.graph_choices.values()] == [True], auto.graph_choices
    assert auto.graph_counts["replay"] >= 8, auto.graph_counts
    assert auto.memory_report()["graphs"] > 0
    same_history(auto.history, eager.history)
    same_params(auto, eager)
