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
from tkern.graphs import STRICT_ENV
from tkern.optim import FusedAdamW
from tkern.train.trainer import HOST_BOUND_SHARE
from tkern.train.trainer_graph import Observation, batch_key, choose

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
    assert not capture and "different ops (a data-dependent branch)" in why
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


class Branchy(nn.Module):
    """A data-dependent branch: the sign of the batch's first value picks the activation."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = self.inner[0](x)
        return self.inner[2](torch.relu(h) if x[0, 0] > 0 else torch.tanh(h))


@needs_recorder
def test_auto_never_captures_a_step_whose_ops_vary():
    data = batches([4] * 6)
    for i, (x, _) in enumerate(data):
        x[0, 0] = 1.0 if i % 2 else -1.0
    model = Branchy(tiny_model())
    opt = FusedAdamW(model.parameters(), lr=1e-2, cuda_graph=False)
    capture = RecordingCapture(timing=HOST_BOUND)
    auto = tkern.Trainer(
        model, opt, nn.functional.cross_entropy, tkern.DynamicLossScaler(init_scale=2.0**10),
        progress=False, graph_capture=capture,
    )  # fmt: skip
    auto.fit(data, 2)
    assert "capture" not in capture.log
    assert auto.graph_status == (
        "eager for batches of shape (4, 6): its steps ran different ops (a data-dependent branch), "
        "so one graph cannot replay them"
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
