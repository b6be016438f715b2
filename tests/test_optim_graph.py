"""The optimizer step as one CUDA graph: when it is warmed up, captured, replayed or run
eager, and that a replayed step is the eager step, bit for bit.

A CPU has no CUDA graphs, so the capture goes through the optimizer's seam
(``graph_capture``) with :class:`graph_recorder.RecordingCapture`: the capture records
the step's launches (Triton kernels and torch ops, with their very arguments) and
undoes them, and each replay runs exactly those launches again. A step whose capture
bound anything but the static buffers (a loss scale or found_inf made afresh per
step, a Python value that changed) replays stale values, and the comparison with
eager (``cuda_graph=False``) fails. The recorder needs Triton's interpreter: on a GPU
machine those tests skip (``needs_recorder``) and tests/test_gpu.py captures for real."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, needs_recorder
from graph_recorder import RecordingCapture

import tkern
from tkern.graphs import STRICT_ENV
from tkern.optim import FusedAdamW, FusedSGD


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(
        DEVICE, torch.float16
    )


def _train(capture, steps=12, scaler="tkern", events=True, lr=1e-2, **kw):
    """A loss-scaled loop; with ``events`` an overflow, a param that sits a step out
    and an lr change."""
    model = _model()
    opt = FusedAdamW(model.parameters(), lr=lr, max_grad_norm=1.0, **kw)
    if capture is not None:
        opt.graph_capture = capture
    if scaler == "tkern":
        scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    elif scaler == "torch":
        scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=3)
    torch.manual_seed(1)
    x, y = torch.randn(steps, 8, 16, device=DEVICE), torch.randn(steps, 8, 4, device=DEVICE)
    reasons = []
    for t in range(steps):
        opt.zero_grad()
        out = model(x[t].half()).float()
        loss = (out - y[t]).pow(2).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if events and t == 4:
            model[0].weight.grad[0, 0] = float("inf")  # an overflow: skipped on the device
        if events and t == 7:
            model[2].bias.grad = None  # sits this step out: a new plan
        if events and t == 9:
            opt.param_groups[0]["lr"] = 5e-3  # a scheduler's change: new hyperparameters
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        reasons.append(opt.graph_fallback)
    return model, opt, scaler, reasons


def _same_state(a, b):
    sd_a, sd_b = a.state_dict(), b.state_dict()
    for i, entry in sd_b["state"].items():
        for k, v in entry.items():
            assert torch.equal(sd_a["state"][i][k], v), (i, k)


@needs_recorder
def test_a_replayed_step_is_the_eager_step_bit_for_bit():
    capture = RecordingCapture()
    graphed, g_opt, g_scaler, reasons = _train(capture)
    eager, e_opt, e_scaler, _ = _train(None, cuda_graph=False)
    for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
    assert g_scaler.get_scale() == e_scaler.get_scale() and g_scaler.skipped_steps == 1
    _same_state(g_opt, e_opt)
    # step 0 warms up (a new stamp), step 1 is captured (the stamp repeats), then replays;
    # the overflow step replays too (the skip is on the device); steps 7 and 8 (a param
    # sits out: a new plan, then one more with its own step count) and 9 (new lr) warm
    # up; 10 captures again (9's stamp repeats) and 11 replays
    assert [t for t, r in enumerate(reasons) if r is not None] == [0, 7, 8, 9]
    assert g_opt.graph_counts == {"warmup": 4, "capture": 2, "replay": 6}
    assert capture.log.count("capture") == 2 and capture.log.count("replay") == 8
    assert e_opt.graph_counts == {"eager": 12} and e_opt.graph_fallback == "cuda_graph=False"


@needs_recorder
@pytest.mark.parametrize("scaler", ["tkern", "torch", None])
def test_every_captured_launch_was_warmed_up_with_the_same_specialization(scaler):
    """Triton compiles a kernel per specialization (pointer alignment, divisibility,
    constexprs, options): a captured launch no warm-up ran would compile inside the
    capture, which CUDA refuses. Graphed equals eager for each kind of scaler."""
    capture = RecordingCapture()
    graphed, g_opt, _, _ = _train(capture, steps=5, scaler=scaler, events=False)
    eager, e_opt, _, _ = _train(None, steps=5, scaler=scaler, events=False, cuda_graph=False)
    assert g_opt.graph_counts == {"warmup": 1, "capture": 1, "replay": 3}
    assert capture.launches["capture"], "the capture launched nothing"
    assert capture.unseen_launches() == []
    for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
    _same_state(g_opt, e_opt)


@needs_recorder
def test_the_specialization_check_catches_a_misaligned_loss_scale():
    """The old bug: the eager steps read 1 / S at ``state[1:2]`` (4 bytes past 16-byte
    alignment), the capture a static copy; the two are different compiles."""
    capture = RecordingCapture()
    p = torch.zeros(64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    opt = FusedSGD([p], lr=0.1, cuda_graph=False)
    p.grad.fill_(1.0)
    state = torch.ones(8, device=DEVICE)
    capture.warmup(lambda: opt.step(inv_scale=state[1:2]))
    capture.capture(lambda: opt.step(inv_scale=state[4:5]))
    unseen = capture.unseen_launches()  # the capture's 1 / S is aligned ("D"), the warm-up's not
    assert unseen and all(
        dict((k[0], k[1:]) for k in key[1])["inv_scale_ptr"] == ("*fp32", "D") for key in unseen
    )
    assert all(
        k[1:] == ("*fp32", "") for w in capture.launches["warmup"] for k in w[1] if k[0] == "inv_scale_ptr"
    )


def test_the_loss_scale_is_16_byte_aligned_wherever_it_lives():
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.ones((), device=DEVICE))
    assert scaler.inv_scale.data_ptr() % 16 == 0
    loaded = tkern.DynamicLossScaler()
    loaded.load_state_dict(scaler.state_dict())  # kept on the CPU until its first use
    assert loaded.inv_scale.data_ptr() % 16 == 0
    loaded.scale(torch.ones((), device=DEVICE))
    assert loaded.inv_scale.data_ptr() % 16 == 0
    assert torch.equal(loaded.state, scaler.state)


@needs_recorder
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_device_lr_written_in_place_keeps_one_graph_and_replays_read_it(dtype):
    """An lr tensor on the params' device is read by the kernels: a schedule that
    writes it in place keeps the graph, and every replay reads the current value (a
    replay of a stale copy would differ from eager). Another tensor captures anew."""

    def run(capture, **kw):
        lr = torch.tensor(1e-2, dtype=dtype, device=DEVICE)
        model = _model()
        opt = FusedAdamW(model.parameters(), lr=lr, **kw)
        if capture is not None:
            opt.graph_capture = capture
        torch.manual_seed(1)
        for t in range(8):
            opt.zero_grad()
            model(torch.randn(8, 16, device=DEVICE).half()).float().pow(2).mean().backward()
            lr.mul_(0.7)  # a schedule on the device
            if t == 5:
                opt.param_groups[0]["lr"] = lr.clone()  # another tensor: a new stamp
            opt.step()
        return model, opt

    graphed, g_opt = run(RecordingCapture())
    eager, e_opt = run(None, cuda_graph=False)
    for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
    _same_state(g_opt, e_opt)
    # 0 warms up, 1 captures, 2-4 replay; 5 brings the new tensor, 6 captures, 7 replays
    assert g_opt.graph_counts == {"warmup": 2, "capture": 2, "replay": 4}


def test_the_step_runs_eager_where_it_cannot_be_graphed():
    p = torch.zeros(8, device=DEVICE, requires_grad=True)
    opt = FusedSGD([p], lr=0.1)
    p.grad.fill_(1.0)
    opt.step()
    if DEVICE == "cpu":
        assert opt.graph_fallback == "the params are on cpu, and only cuda work can be captured"
        assert opt.graph_counts == {"eager": 1}
    off = FusedSGD([torch.zeros(8, device=DEVICE, requires_grad=True)], lr=0.1, cuda_graph=False)
    off.step()
    assert off.graph_fallback == "cuda_graph=False"
    with pytest.raises(TypeError, match="cuda_graph must be None, True or False"):
        FusedSGD([torch.zeros(8, device=DEVICE, requires_grad=True)], cuda_graph="yes")


@needs_recorder
def test_the_former_seam_name_is_the_same_seam():
    opt = FusedSGD([torch.zeros(8, device=DEVICE, requires_grad=True)], lr=0.1)
    seam = RecordingCapture()
    opt.graph_runner = seam
    assert opt.graph_capture is seam and opt.graph_runner is seam


@needs_recorder
def test_a_failed_capture_warns_once_and_the_step_is_still_taken(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)  # as a user runs
    with pytest.warns(UserWarning, match="capturing the step failed") as caught:
        model, opt, _, reasons = _train(RecordingCapture(fail=True), steps=4)
    assert len(caught) == 1
    eager, _, _, _ = _train(None, steps=4, cuda_graph=False)
    failure = (
        "capturing the step failed (RuntimeError: operation not permitted when stream is capturing); "
        "running eager"
    )
    # the failure stays the reason of every later step, never the bare "cuda_graph=False"
    # that turning the graphs off would say: a benchmark reading the last step sees why
    assert opt.cuda_graph is False and reasons[1:] == [failure] * 3
    assert opt.graph_failure == failure and opt.graph_counts["eager"] == 3
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)


@needs_recorder
def test_a_failed_capture_raises_under_the_strict_flag(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")  # as the test suite runs
    with pytest.raises(RuntimeError, match="^operation not permitted when stream is capturing"):
        _train(RecordingCapture(fail=True), steps=2)


@needs_recorder
def test_each_steps_grad_stats_is_its_own_after_a_capture():
    """A user who keeps every step's ``grad_stats`` (for logging) reads that step's
    values, graphed as eager: a replay rewrites the graph's static output, so the
    step hands out a copy of it."""

    def run(capture, **kw):
        model = _model()
        opt = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, **kw)
        if capture is not None:
            opt.graph_capture = capture
        torch.manual_seed(1)
        kept = []
        for t in range(5):
            opt.zero_grad()
            (model(torch.randn(8, 16, device=DEVICE).half()).float().pow(2).mean() * (t + 1)).backward()
            opt.step()
            kept.append(opt.grad_stats)
        return opt, kept

    g_opt, graphed = run(RecordingCapture())
    e_opt, eager = run(None, cuda_graph=False)
    assert g_opt.graph_counts == {"warmup": 1, "capture": 1, "replay": 3}
    assert len({s.data_ptr() for s in graphed}) == 5
    norms = [s[1].item() for s in eager]
    assert len(set(norms)) == 5  # the steps' statistics differ: a stale copy would show
    for g, e in zip(graphed, eager, strict=True):
        assert torch.equal(g, e)


# ------------------------------------------------------------------ with collectives


def _replica_run(rank, kind, graphed):
    """8 loss-scaled steps on this rank's own data; rank 0 alone overflows at step 4, so
    every rank skips it only if the statistics' collective ran inside the step."""
    import torch.distributed as dist

    from tkern.optim import DistributedFusedAdamW

    model = _model()
    mode = {} if graphed else {"cuda_graph": False}
    if kind == "replicas":
        opt = FusedAdamW(
            model.parameters(), lr=1e-2, max_grad_norm=1.0, process_group=dist.group.WORLD, **mode
        )
    else:
        opt = DistributedFusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, **mode)
    capture = RecordingCapture()
    if graphed:
        opt.graph_capture = capture
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    g = torch.Generator().manual_seed(1 + rank)
    for t in range(8):
        opt.zero_grad()
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        scaler.scale((model(x.half()).float() - y).pow(2).mean()).backward()
        if t == 4 and rank == 0:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "scale": scaler.get_scale(),
        "skipped": scaler.skipped_steps,
        "counts": dict(opt.graph_counts),
        "fallback": opt.graph_fallback,
        "log": capture.log,
    }


def _scenario_collectives(rank, world):
    return {
        kind: {graphed: _replica_run(rank, kind, graphed) for graphed in (True, False)}
        for kind in ("replicas", "zero2")
    }


SCENARIOS = {"collectives": _scenario_collectives}


@needs_recorder
def test_the_step_is_graphed_with_its_collectives_on_replicas_and_zero2(tmp_path):
    """process_group (DDP-style replicas) and ZeRO-2: the statistics' collective is
    captured with the step and replayed with it (c10d's collectives go through the
    dispatcher, so the recorder records them; gloo's cannot be captured on a GPU, NCCL's
    can: ``CudaGraphCapture.collectives_blocker``). Graphed equals eager bit for bit on
    every rank, through an overflow on rank 0 alone that every rank skips."""
    from scenarios import result, run_scenarios

    ranks = result(
        run_scenarios("test_optim_graph", 2, ["collectives"], tmp_path, timeout_s=600), "collectives"
    )
    for rank, runs in enumerate(ranks):
        for kind, by in runs.items():
            graphed, eager = by[True], by[False]
            assert graphed["fallback"] is None and graphed["counts"]["replay"] >= 4, (rank, kind, graphed)
            assert graphed["log"].count("capture") >= 1
            assert eager["counts"] == {"eager": 8}
            for a, b in zip(graphed["params"], eager["params"], strict=True):
                assert torch.equal(a, b), (rank, kind)
            assert graphed["skipped"] == eager["skipped"] == 1 and graphed["scale"] == eager["scale"]
    zero2 = [r["zero2"][True]["params"] for r in ranks]  # ZeRO-2 all-gathers the params: the ranks agree
    assert all(torch.equal(a, b) for a, b in zip(*zero2, strict=True))


@pytest.mark.skipif(DEVICE == "cuda", reason="a gloo group over the CPU's tensors")
def test_cuda_seam_captures_only_nccl_collectives():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        why = tkern.graphs.CudaGraphCapture().collectives_blocker([dist.group.WORLD])
        assert why == "the step's collectives run on gloo, which CUDA graphs cannot capture (NCCL's can)"
        p = torch.zeros(4, dtype=torch.float16, device=DEVICE, requires_grad=True)
        opt = FusedAdamW([p], lr=1e-3, process_group=dist.group.WORLD)
        p.grad = torch.ones_like(p)
        opt.step()
        assert opt.graph_fallback == why and opt.graph_counts == {"eager": 1}
    finally:
        dist.destroy_process_group()


@needs_recorder
def test_the_step_graph_holds_only_the_steps_few_temporaries(monkeypatch):
    """The pool of the optimizer's graph is what its capture allocates: the statistics'
    partial sums and the step's flags, a few bytes per program of pass 1, nothing the
    size of a param (the master, the moments and the gradients live in the flat buffers,
    outside the graph). The recorder counts the bytes its captures allocate."""
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4))
    monkeypatch.setattr(__import__(__name__), "_model", lambda seed=0: wide.to(DEVICE, torch.float16))
    capture = RecordingCapture()
    model, opt, _, _ = _train(capture, steps=4, events=False)
    assert opt.graph_counts["capture"] == 1
    master = sum(4 * p.numel() for p in model.parameters())  # 86 KB of fp32 master
    assert 0 < opt.graph_pool_bytes == capture.reserved_bytes() < master / 100
