"""Checks that only mean something compiled on a CUDA device; skipped on a CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, gpu_only, rel_err

import tkern
from tkern.optim import FusedAdamW, FusedSGD

pytestmark = gpu_only


@pytest.mark.parametrize("opt_cls", [FusedSGD, FusedAdamW])
def test_step_and_scaler_never_wait_for_the_host(opt_cls):
    params = [torch.randn(1000, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    opt = opt_cls(params, lr=1e-3, max_grad_norm=1.0)
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.ones((), device="cuda"))
    for p in params:
        p.grad.normal_()
    for _ in range(2):  # the first call compiles and allocates; the second must not sync either
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.scale(torch.ones((), device="cuda"))
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")


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


def _small_tkern_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        tkern.nn.Linear(32, 32, activation="gelu", device="cuda"),
        tkern.nn.Linear(32, 32, device="cuda"),
    )  # every GEMM of the step (forward, dgrad, wgrad at batch 32) is 32^3: two autotuning keys
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    # a low S that grows every 3 clean steps: growth and one forced backoff within the test
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    return model, opt, scaler


def _train_step(model, opt, scaler, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def test_whole_training_step_replays_in_a_cuda_graph_like_eager():
    """Forward, backward, scaler.step (FusedAdamW) and scaler.update captured in one
    CUDA graph (warm-up on a side stream first, as torch's whole-network capture
    recipe does) and replayed on new batches: after every replay the params, the
    fp32 master, the loss and S equal, bit for bit, those of the same steps taken
    eagerly by an identical model, including a step whose gradients overflow
    (skipped, S halved) and steps where S grows."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (
            torch.randn(32, 32, device="cuda", generator=gen).half(),
            torch.randint(0, 32, (32,), device="cuda", generator=gen),
        )
        for _ in range(10)
    ]
    warmup, overflow = 3, 6
    batches[overflow][0].mul_(1e4)  # scaled gradients far beyond fp16's range
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
