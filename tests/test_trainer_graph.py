"""Trainer(cuda_graph=True): who may capture, the eager fallback, the per-shape
graph bookkeeping (through :class:`graph_recorder.RecordingCapture`, a seam that
records the step's launches at capture and replays exactly those, so it runs on a
CPU and a wrong capture shows as a difference from eager), the command's flag, and
a real capture on a GPU."""

from __future__ import annotations

import math
import warnings
from types import FunctionType

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, needs_recorder
from graph_recorder import RecordingCapture
from torch import nn

import tkern
from tkern.graphs import STRICT_ENV, CudaGraphCapture
from tkern.optim import DistributedFusedAdamW, FusedAdamW
from tkern.train import demo
from tkern.train.cli import main
from tkern.train.trainer import WARMUP_STEPS, graph_blocker

CUDA = torch.device("cuda")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return tkern.convert_network(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(DEVICE))


def batches(sizes, seed=0, overflow_at=None):
    """A fixed list of (x, y) batches of the given sizes; batch ``overflow_at``
    holds an inf, so its gradients overflow and its step must be skipped."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, 6, generator=g)
        if i == overflow_at:
            x[0, 0] = float("inf")
        out.append((x, torch.randint(0, 3, (n,), generator=g)))
    return out


def make_trainer(capture=None, *, cuda_graph=False, **kwargs):
    """A trainer; with ``cuda_graph=False`` an eager reference all through (its
    optimizer's own step graph off too)."""
    model = tiny_model()
    opt = FusedAdamW(model.parameters(), lr=1e-2, cuda_graph=None if cuda_graph else False)
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=5)
    if capture is not None:
        kwargs["graph_capture"] = capture
    return tkern.Trainer(
        model, opt, nn.functional.cross_entropy, scaler, progress=False, cuda_graph=cuda_graph, **kwargs
    )


def same_history(a, b):
    """Per-step loss and scale equal bit for bit (NaN equal to NaN)."""
    assert len(a) == len(b)
    for ha, hb in zip(a, b, strict=True):
        for key in ("loss", "scale"):
            va, vb = ha[key], hb[key]
            assert va == vb or (math.isnan(va) and math.isnan(vb)), (key, ha, hb)


def same_params(ta, tb):
    for (name, pa), (_, pb) in zip(ta.model.named_parameters(), tb.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


# ------------------------------------------------------------------ who may capture


def _eligible(**changes):
    model = tiny_model()
    args = {
        "model": model,
        "optimizer": FusedAdamW(model.parameters(), lr=1e-3),
        "scaler": tkern.DynamicLossScaler(),
        "accumulation_steps": 1,
        "scheduler": None,
        "device": CUDA,
        "interpreted": False,
    }
    # a lambda builds its part from the others (an optimizer over the model's params)
    args.update({k: v(args) if isinstance(v, FunctionType) else v for k, v in changes.items()})
    return graph_blocker(**args)


def test_a_fused_optimizer_with_a_tkern_scaler_or_none_can_capture():
    assert _eligible() is None
    assert _eligible(scaler=None) is None
    assert _eligible(scaler=tkern.StaticLossScaler()) is None
    assert _eligible(scaler=tkern.DynamicLossScaler(enabled=False)) is None


def test_torch_parts_that_stay_on_the_device_can_capture():
    # GradScaler hands its scale and found_inf to an optimizer that takes them
    # (_step_supports_amp_scaling): no host read
    assert _eligible(scaler=torch.amp.GradScaler("cpu")) is None
    # a torch optimizer built capturable, without a scaler
    assert (
        _eligible(
            optimizer=lambda a: torch.optim.AdamW(a["model"].parameters(), capturable=True), scaler=None
        )
        is None
    )


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"device": torch.device("cpu")}, "the model is on cpu, and only cuda work can be captured"),
        ({"interpreted": True}, "Triton's interpreter"),
        ({"accumulation_steps": 4}, "accumulation_steps=4: only a step of one forward and backward"),
        (
            {"scheduler": lambda a: torch.optim.lr_scheduler.StepLR(a["optimizer"], 5)},
            "a StepLR changes the learning rate every step",
        ),
        (
            {
                "optimizer": lambda a: torch.optim.SGD(a["model"].parameters(), lr=0.1),
                "scaler": torch.amp.GradScaler("cpu"),
            },
            "torch.amp.GradScaler with SGD reads found_inf on the host every step",
        ),
        (
            {"optimizer": lambda a: torch.optim.AdamW(a["model"].parameters(), capturable=True)},
            "a DynamicLossScaler with AdamW, which is not a tkern fused optimizer, reads found_inf",
        ),
        ({"scaler": object()}, "a object loss scaler is not known to be free of host syncs"),
        (
            {"optimizer": lambda a: torch.optim.AdamW(a["model"].parameters()), "scaler": None},
            "AdamW is not built with capturable=True",
        ),
        (
            {"optimizer": lambda a: FusedAdamW(a["model"].parameters(), lr=torch.tensor(1e-3))},
            "FusedAdamW has a tensor lr (param group 0), which its step reads on the host",
        ),
    ],
    ids=["cpu", "interpreted", "accumulation", "scheduler", "gradscaler-sync", "tkern-scaler-torch-opt",
         "unknown-scaler", "not-capturable", "tensor-lr"],
)  # fmt: skip
def test_each_reason_to_run_eager_is_one_line(changes, reason):
    why = _eligible(**changes)
    assert why is not None and reason in why and "\n" not in why


class _NcclLike:
    """A seam's collectives_blocker that captures every group's collectives (as NCCL's)."""

    def __call__(self, groups):
        return None


def test_data_parallel_parts_run_eager():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_model()
        why = _eligible(model=nn.parallel.DistributedDataParallel(model))
        assert why == "a DistributedDataParallel model: its gradient all-reduce hooks are not captured"
        why = _eligible(optimizer=DistributedFusedAdamW(model.parameters(), lr=1e-3))
        assert why == "DistributedFusedAdamW is sharded: its collectives are not captured"
        replicas = FusedAdamW(model.parameters(), lr=1e-3, process_group=dist.group.WORLD)
        why = _eligible(optimizer=replicas)
        assert why == "FusedAdamW has a process_group: its collectives are not captured"
        why = _eligible(optimizer=replicas, collectives_blocker=CudaGraphCapture().collectives_blocker)
        assert why == (
            "FusedAdamW has a process_group: the step's collectives run on gloo, which CUDA graphs "
            "cannot capture (NCCL's can)"
        )
        assert _eligible(optimizer=replicas, collectives_blocker=_NcclLike()) is None
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the eager fallback


@pytest.mark.skipif(DEVICE == "cuda", reason="the fallback for a model off CUDA")
def test_cuda_graph_off_cuda_warns_once_and_trains_exactly_as_eager():
    data = batches([4, 4, 4, 2], overflow_at=1)
    with pytest.warns(UserWarning, match=r"^Trainer\(cuda_graph=True\) runs eager: the model is on cpu") as w:
        fallback = make_trainer(cuda_graph=True)
        fallback.fit(data, 2)
    assert sum("cuda_graph" in str(x.message) for x in w) == 1 and fallback.graphs is None
    assert fallback.graph_fallback.startswith("the model is on cpu")
    eager = make_trainer()
    eager.fit(data, 2)
    same_history(fallback.history, eager.history)
    same_params(fallback, eager)
    assert fallback.skipped_steps == eager.skipped_steps == 2


@needs_recorder
def test_bad_cuda_graph_arguments():
    with pytest.raises(TypeError, match="cuda_graph must be True, False or 'auto', got 1"):
        make_trainer(cuda_graph=1)
    with pytest.raises(TypeError, match="cuda_graph must be True, False or 'auto', got 'on'"):
        make_trainer(cuda_graph="on")
    with pytest.raises(ValueError, match="graph_capture is used only with cuda_graph=True"):
        make_trainer(RecordingCapture())


# ------------------------------------------------------------------ the graphs' bookkeeping


@needs_recorder
def test_warmup_then_capture_then_replay_per_batch_shape():
    # every epoch: three full batches of 4 and the last, smaller one of 2
    capture = RecordingCapture()
    trainer = make_trainer(capture, cuda_graph=True)
    trainer.fit(batches([4, 4, 4, 2]), 4)
    assert trainer.graph_fallback is None
    assert WARMUP_STEPS == 3  # the epochs below are laid out for it
    warmup, replay = ["warmup"], ["replay"]
    # the full batch's graph is replayed around the small batch's warm-ups (one an
    # epoch); the small batch is captured at its fourth appearance
    assert capture.log == (
        warmup * 3 + warmup  # epoch 1
        + ["capture"] + replay * 3 + warmup  # epoch 2: capture, then replay at once
        + replay * 3 + warmup  # epoch 3
        + replay * 3 + ["capture", "replay"]  # epoch 4
    )  # fmt: skip
    assert trainer.graphs.counts == {"warmup": 6, "capture": 2, "replay": 8}
    assert trainer.step == 16


@needs_recorder
def test_graphed_steps_match_eager_bit_for_bit_through_an_overflow_and_the_last_small_batch():
    # the overflowing batch comes after capture in every epoch but the first: its
    # skip and the scale's backoff happen inside the replayed step, on the device
    data = batches([4, 4, 4, 4, 4, 2], overflow_at=4)
    capture = RecordingCapture()
    graphed = make_trainer(capture, cuda_graph=True)
    graphed.fit(data, 4)  # the small batch is captured in the fourth epoch
    eager = make_trainer()
    eager.fit(data, 4)
    assert graphed.graph_counts == {"warmup": 6, "capture": 2, "replay": 16}
    # every launch of both captures (forward, backward, the optimizer's step, the
    # scaler's update) has a specialization its shape's warm-ups compiled
    assert len(capture.launches["capture"]) > 10 and capture.unseen_launches() == []
    # inside the whole step the optimizer's own graph stepped aside, in the 6 warm-ups
    # as in the 2 captures (replays run no Python)
    assert graphed.optimizer.graph_counts == {"eager": 8}
    same_history(graphed.history, eager.history)
    same_params(graphed, eager)
    assert graphed.skipped_steps == eager.skipped_steps == 4
    scales = [h["scale"] for h in graphed.history]
    assert scales[4] == scales[3] / 2  # the first overflow halved S
    for name in ("exp_avg", "exp_avg_sq"):
        for pa, pb in zip(graphed.model.parameters(), eager.model.parameters(), strict=True):
            assert torch.equal(graphed.optimizer.state[pa][name], eager.optimizer.state[pb][name])


@needs_recorder
def test_each_steps_grad_stats_is_its_own_under_the_whole_step_graph():
    """A user who keeps every step's ``opt.grad_stats`` (for logging) reads that
    step's statistics after replays too, equal to an eager trainer's step by step."""
    data = batches([4] * 8, overflow_at=6)

    def kept(trainer):
        out = []
        for x, y in data:
            trainer.train_step([(x, y)])
            out.append(trainer.optimizer.grad_stats)
        return out

    graphed = make_trainer(RecordingCapture(), cuda_graph=True)
    graphed_stats = kept(graphed)
    eager_stats = kept(make_trainer())
    assert graphed.graph_counts["replay"] >= 3  # the steps after the capture replayed
    for step, (g, e) in enumerate(zip(graphed_stats, eager_stats, strict=True)):
        assert torch.equal(g, e), (step, g, e)
    assert len({id(g) for g in graphed_stats}) == len(data)


@needs_recorder
def test_a_third_batch_shape_runs_eager_and_warns_once():
    capture = RecordingCapture()
    trainer = make_trainer(capture, cuda_graph=True)
    data = batches([4] * (WARMUP_STEPS + 1) + [2, 3, 3, 4])
    with pytest.warns(
        UserWarning, match=r"batches of shape \(3, 6\) run eager; graphs are kept for the first 2"
    ):
        trainer.fit(data, 1)
    assert trainer.graphs.counts == {"warmup": WARMUP_STEPS + 1, "capture": 1, "replay": 1, "eager": 2}
    assert capture.log[-1] == "replay"  # the last batch, of the first shape


@needs_recorder
def test_shape_changing_back_replays_the_graph_it_had():
    capture = RecordingCapture()
    trainer = make_trainer(capture, cuda_graph=True)
    trainer.fit(batches([4] * (WARMUP_STEPS + 1) + [2, 4, 2, 4]), 1)
    # 4 4 4 | 4 | 2 4 2 4: the batches of 4 replay between the warm-ups of the batches of 2
    assert capture.log[WARMUP_STEPS:] == ["capture", "replay", "warmup", "replay", "warmup", "replay"]
    assert trainer.graphs.counts == {"warmup": WARMUP_STEPS + 2, "capture": 1, "replay": 2}


@needs_recorder
def test_a_changed_learning_rate_is_captured_again_after_warmup():
    capture = RecordingCapture()
    trainer = make_trainer(capture, cuda_graph=True)
    data = batches([4] * (WARMUP_STEPS + 2))
    trainer.fit(data, 1)
    assert capture.log.count("capture") == 1
    trainer.optimizer.param_groups[0]["lr"] = 5e-3  # a graph would replay the old lr
    trainer.fit(data, 2)
    assert capture.log.count("capture") == 2
    assert trainer.graphs.counts["warmup"] == 2 * WARMUP_STEPS


@needs_recorder
def test_loading_a_checkpoint_drops_the_graphs(tmp_path):
    capture = RecordingCapture()
    trainer = make_trainer(capture, cuda_graph=True)
    data = batches([4] * (WARMUP_STEPS + 2))
    trainer.fit(data, 1, checkpoint_path=tmp_path / "run.ckpt")
    trainer.load_checkpoint(tmp_path / "run.ckpt")
    trainer.fit(data, 2)
    assert capture.log.count("capture") == 2


@needs_recorder
def test_a_failed_capture_says_so(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)  # as a user runs
    trainer = make_trainer(RecordingCapture(fail=True), cuda_graph=True)
    with pytest.raises(RuntimeError, match=r"capturing the step for batches of shape \(4, 6\) failed "
                       r"\(RuntimeError: operation not permitted when stream is capturing\); train with "
                       r"cuda_graph=False"):  # fmt: skip
        trainer.fit(batches([4] * (WARMUP_STEPS + 1)), 1)


@needs_recorder
def test_a_failed_capture_raises_itself_under_the_strict_flag(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    trainer = make_trainer(RecordingCapture(fail=True), cuda_graph=True)
    with pytest.raises(RuntimeError, match="^operation not permitted when stream is capturing"):
        trainer.fit(batches([4] * (WARMUP_STEPS + 1)), 1)


# ------------------------------------------------------------------ the command


def test_cli_cuda_graph_reaches_the_tkern_run(monkeypatch, capsys):
    seen = {}

    def fake_compare(cfg):
        seen["cfg"] = cfg
        counts = {"warmup": 6, "capture": 2, "replay": 92} if cfg.cuda_graph is True else None
        return [demo.Result("tkern", 0.1, 0.9, 1.0, 2**20, 0, 1024.0, graph_counts=counts)]

    monkeypatch.setattr(demo, "compare", fake_compare)
    assert main(["train", "--cuda-graph", "--no-progress"]) == 0
    assert seen["cfg"].cuda_graph is True
    out = capsys.readouterr().out
    assert "tkern run: whole-step CUDA graphs, steps by kind: 6 warmup, 2 capture, 92 replay, 0 eager" in out
    assert main(["train", "--no-progress"]) == 0
    assert seen["cfg"].cuda_graph == "auto"  # the Trainer chooses
    assert "CUDA graphs" not in capsys.readouterr().out


def test_cli_cuda_graph_without_the_tkern_run_is_a_usage_error(capsys):
    assert main(["train", "--cuda-graph", "--only", "fp32"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "tkern train: error: --cuda-graph applies to the tkern run, but --only fp32 leaves it out"
    )


def test_demo_passes_cuda_graph_to_the_tkern_trainer_only(monkeypatch):
    made = {}

    class StopError(Exception):
        pass

    class Recording(tkern.Trainer):
        def __init__(self, *args, **kwargs):
            made[type(args[1]).__name__] = kwargs.get("cuda_graph", False)
            raise StopError

    monkeypatch.setattr(demo, "Trainer", Recording)
    cfg = demo.Config(cuda_graph=True, progress=False)
    base = demo.make_mlp(64, (8,), 10)
    data = ((torch.rand(8, 64), torch.randint(0, 10, (8,))),) * 2
    for name in demo.RUNS:
        with pytest.raises(StopError):
            demo.run_one(name, base, data, cfg, torch.device("cpu"))
    assert made == {"FusedAdamW": True, "AdamW": False}


# ------------------------------------------------------------------ a real capture


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device and compiled Triton")
def test_real_cuda_graph_matches_eager_through_an_overflow_and_the_last_small_batch():
    data = [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches([64] * 6 + [40], overflow_at=5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may fall back
        graphed = make_trainer(cuda_graph=True)
    graphed.fit(data, 5)
    eager = make_trainer()  # cuda_graph=False, its optimizer's step graph off too
    eager.fit(data, 5)
    assert graphed.graph_fallback is None
    # 35 steps: each batch shape warms up 3 times and is captured once (a capture
    # replays at once), every other step replays
    assert graphed.graph_counts == {"warmup": 6, "capture": 2, "replay": 27}
    assert graphed.skipped_steps == eager.skipped_steps == 5
    # the same kernels on the same buffers, and no atomics whose order could differ:
    # bit for bit
    same_history(graphed.history, eager.history)
    same_params(graphed, eager)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device and compiled Triton")
def test_real_cuda_graph_of_one_batch_shape_replays_all_but_the_warmups():
    n = 10
    data = [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches([64] * n, overflow_at=7)]
    graphed = make_trainer(cuda_graph=True)
    graphed.fit(data, 1)
    eager = make_trainer()
    eager.fit(data, 1)
    counts = graphed.graph_counts
    assert graphed.graph_fallback is None
    assert counts["capture"] >= 1 and counts["capture"] + counts["replay"] >= n - 3, counts
    same_history(graphed.history, eager.history)
    same_params(graphed, eager)


@needs_recorder
def test_sampling_underflows_under_the_whole_step_graph_warns_that_it_sees_nothing():
    """The whole-step graph's steps are not sampled (optimizer.track_underflows): the
    Trainer says so once at construction rather than never warning about the scale."""
    model = tiny_model()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    opt.track_underflows(every=10)
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10)
    with pytest.warns(UserWarning, match="whole-step graph are not sampled for zero and subnormal"):
        tkern.Trainer(
            model, opt, nn.functional.cross_entropy, scaler, progress=False, cuda_graph=True,
            graph_capture=RecordingCapture(),
        )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_trainer(RecordingCapture(), cuda_graph=True)  # not sampling: no warning
