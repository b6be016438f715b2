"""Checks that only mean something compiled on a CUDA device; skipped on a CPU.

The CUDA-graph checks (the optimizer's step graph, a whole step captured by hand)
run with ``TKERN_GRAPH_STRICT=1`` (tests/conftest.py): a failed capture raises. Their
eager references run with ``cuda_graph=False``, and graphed equals eager bit for bit:
a graph replays the very kernels on the very buffers, and tkern has no atomics
whose order could differ (the statistics are one program's reduction, no split-K)."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, gpu_only, rel_err

import tkern
from tkern.optim import FusedAdamW, FusedSGD

pytestmark = gpu_only


@pytest.mark.parametrize("cuda_graph", [False, None])
@pytest.mark.parametrize("opt_cls", [FusedSGD, FusedAdamW])
def test_step_and_scaler_never_wait_for_the_host(opt_cls, cuda_graph):
    params = [torch.randn(1000, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    opt = opt_cls(params, lr=1e-3, max_grad_norm=1.0, cuda_graph=cuda_graph)
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.ones((), device="cuda"))
    for p in params:
        p.grad.normal_()
    # eager: the first call compiles and allocates, the second must not sync either;
    # graphed: a warm-up, a capture (it synchronizes once, before capturing), then replays
    checked = (1, 2, 3) if cuda_graph is False else (2, 3)
    for i in range(4):
        torch.cuda.synchronize()
        if i in checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.scale(torch.ones((), device="cuda"))
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if cuda_graph is None:
        assert opt.graph_fallback is None and opt.graph_counts == {"warmup": 1, "capture": 1, "replay": 2}


def test_compiled_bf16_copy_rounds_to_nearest_even():
    p = torch.randn(4097, device="cuda").to(torch.bfloat16).requires_grad_()
    opt = FusedSGD([p], lr=1e-3)
    p.grad.copy_(torch.randn(4097, device="cuda"))
    opt.step()
    assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2048, 2048, 2048), (8192, 1024, 4096), (1000, 3000, 777)])
def test_autotuned_large_shapes(dtype, shape):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype).t()
    out = tkern.matmul(a, b, activation="gelu")
    ref = torch.nn.functional.gelu(a.double() @ b.double())
    assert rel_err(out, ref) < TOL[dtype]


def _small_tkern_model(cuda_graph=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        tkern.nn.Linear(32, 32, activation="gelu", device="cuda"),
        tkern.nn.Linear(32, 32, device="cuda"),
    )  # every GEMM of the step (forward, dgrad, wgrad at batch 32) is 32^3: two autotuning keys
    opt = FusedAdamW(model.parameters(), lr=1e-2, cuda_graph=cuda_graph)
    # a low S that grows every 3 clean steps: growth and one forced backoff within the test
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    return model, opt, scaler


def _train_step(model, opt, scaler, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


def _batches(n, overflow=None):
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = [
        (
            torch.randn(32, 32, device="cuda", generator=gen).half(),
            torch.randint(0, 32, (32,), device="cuda", generator=gen),
        )
        for _ in range(n)
    ]
    if overflow is not None:
        out[overflow][0].mul_(1e4)  # scaled gradients far beyond fp16's range
    return out


@pytest.mark.parametrize("scaler_kind", ["tkern", "torch", None])
def test_the_optimizers_step_graph_captures_and_replays_as_eager(scaler_kind):
    """The default ``cuda_graph=None`` on CUDA: step 0 warms up, step 1 is captured,
    the rest replay (an overflow too: the skip is on the device); never a fallback;
    params, state and scale equal an eager run's bit for bit."""
    n = 10
    runs = {}
    for cuda_graph in (None, False):
        model, opt, _ = _small_tkern_model(cuda_graph)
        scaler = {
            "tkern": lambda: tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3),
            "torch": lambda: torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3),
            None: lambda: None,
        }[scaler_kind]()
        fallbacks = []
        for x, y in _batches(n, overflow=6):
            _train_step(model, opt, scaler, x, y)
            fallbacks.append(opt.graph_fallback)
        torch.cuda.synchronize()
        runs[cuda_graph] = model, opt, scaler, fallbacks
    model, opt, scaler, fallbacks = runs[None]
    eager, e_opt, e_scaler, _ = runs[False]
    assert fallbacks[1:] == [None] * (n - 1)
    counts = opt.graph_counts
    assert counts["capture"] >= 1 and counts["capture"] + counts["replay"] >= n - 3, counts
    assert counts == {"warmup": 1, "capture": 1, "replay": n - 2}
    for pg, pe in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(pg, pe)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[pg][key], e_opt.state[pe][key]), key
    if scaler is not None:
        assert scaler.get_scale() == e_scaler.get_scale()


def test_whole_training_step_replays_in_a_cuda_graph_like_eager():
    """Forward, backward, scaler.step (FusedAdamW) and scaler.update captured in one
    CUDA graph (warm-up on a side stream first, as torch's whole-network capture
    recipe does) and replayed on new batches: after every replay the params, the
    fp32 master, the loss and S equal, bit for bit, those of the same steps taken
    eagerly by an identical model, including a step whose gradients overflow
    (skipped, S halved) and steps where S grows."""
    warmup, overflow = 3, 6
    batches = _batches(10, overflow)
    # the optimizers' own step graphs off: the eager one is the reference, the graphed
    # one is inside this test's capture
    eager, graphed = _small_tkern_model(), _small_tkern_model()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:warmup]:
            _train_step(*graphed, x, y)
    torch.cuda.current_stream().wait_stream(side)
    for x, y in batches[:warmup]:
        _train_step(*eager, x, y)

    static_x, static_y = batches[warmup][0].clone(), batches[warmup][1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _train_step(*graphed, static_x, static_y)

    scale_after_warmup = eager[2].get_scale()
    scales = []
    for i in range(warmup, len(batches)):
        x, y = batches[i]
        before = [p.detach().clone() for p in eager[0].parameters()]
        scale_before = eager[2].get_scale()
        loss = _train_step(*eager, x, y)
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_loss, loss, rtol=0, atol=0, equal_nan=True)
        for pe, pg in zip(eager[0].parameters(), graphed[0].parameters(), strict=True):
            assert torch.equal(pe, pg), f"step {i}: params differ"
            assert torch.equal(eager[1].state[pe]["master"], graphed[1].state[pg]["master"]), f"step {i}"
        assert graphed[2].get_scale() == eager[2].get_scale(), f"step {i}: S differs"
        skipped = eager[2].get_scale() < scale_before
        assert skipped == (i == overflow), f"step {i}: overflow expected only at step {overflow}"
        moved = [not torch.equal(b, p.detach()) for b, p in zip(before, eager[0].parameters(), strict=True)]
        assert not any(moved) if i == overflow else all(moved), f"step {i}"
        scales.append(eager[2].get_scale())
    assert max(scales) > scale_after_warmup  # S grew inside a replay too
    assert eager[2].skipped_steps == graphed[2].skipped_steps == 1
