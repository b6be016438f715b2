"""The optimizer steps bench_optimizer.py times, each a callable: tkern's FusedAdamW step
(:class:`TkernStep`, with its loss scaler; with the health tracking), torchao's AdamW,
torch's AdamW under a GradScaler (with the options given; as a CUDA graph) and a
master-weights step written by hand in torch ops (eager or compiled); with the host
syncs a step makes (:func:`count_syncs`).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    GraphCount,
    graph_fields,
)  # noqa: E402

import tkern  # noqa: E402

LR = 1e-3
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 1e-2  # torch.optim.AdamW's defaults
#: Steps over which the host syncs per step are counted (and averaged).
SYNC_STEPS = 20


def make_grads(params, scale):
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3 * scale).to(p.dtype)


class TkernStep:
    """One FusedAdamW step (with a tkern loss scaler's step and update when
    ``scaled``) as a callable; :meth:`fields` is what its row records of the
    CUDA graph (the optimizer's ``cuda_graph`` and ``graph_fallback``, captures
    and replays)."""

    def __init__(
        self,
        sizes: list[int],
        device: torch.device,
        scaled: bool = True,
        dtype: torch.dtype = torch.float16,
        one_pass: str = "auto",
        **options,
    ) -> None:
        params = [torch.randn(n, device=device, dtype=dtype, requires_grad=True) for n in sizes]
        self.opt = tkern.optim.FusedAdamW(params, lr=LR, **options)
        self.opt.one_pass = one_pass
        self.count = GraphCount(self.opt)
        self.scaler = tkern.DynamicLossScaler() if scaled else None
        if self.scaler is not None:
            self.scaler.scale(torch.ones((), device=device))  # state on the device
        make_grads(params, self.scaler.init_scale if scaled else 1.0)

    def __call__(self) -> None:
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()

    def fields(self) -> dict:
        path = self.opt.step_path
        path = None if path is None else f"{path.path} ({path.programs} programs): {path.reason}"
        return {**graph_fields(self.opt, self.count), "one_pass": self.opt.one_pass, "step_path": path}


def tkern_step(sizes, device, scaled=True, **options) -> TkernStep:
    return TkernStep(sizes, device, scaled, **options)


def health_step(sizes, device, every: int | None) -> TkernStep:
    """The scaled step with health tracking as HEALTH_VARIANTS says (``every``)."""
    step = TkernStep(sizes, device)
    if every is not None:
        step.opt.track_overflows = True
    if every:
        step.opt.track_underflows(every)
    return step


def torchao_step(sizes, device, smoke: bool, eight_bit: bool) -> Callable[[], None]:
    """torchao's ``AdamW8bit`` (``eight_bit``) or ``_AdamW(bf16_stochastic_round=True)``
    on bf16 params with bf16 grads: the peers of tkern's master="none" modes. In
    smoke mode its per-tensor ``torch.compile`` uses Dynamo's eager backend."""
    from torchao.optim import AdamW8bit, _AdamW

    params = [torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True) for n in sizes]
    make_grads(params, 1.0)
    opt = (
        AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)
        if eight_bit
        else _AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, bf16_stochastic_round=True)
    )
    if not smoke:
        return opt.step
    eager_compile = functools.partial(torch.compile, backend="eager")

    def step() -> None:
        with mock.patch("torch.compile", eager_compile):
            opt.step()

    return step


def torch_amp_step(sizes, device, scaled=True, **adamw_kwargs):
    """(a)/(b): fp32 params with fp32 grads (what autocast produces), GradScaler."""
    params = [torch.randn(n, device=device, requires_grad=True) for n in sizes]
    opt = torch.optim.AdamW(params, lr=LR, **adamw_kwargs)
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))
    make_grads(params, 2.0**16 if scaled else 1.0)

    def step():
        scaler.step(opt)
        scaler.update()

    return step if scaled else opt.step


def torch_amp_graphed_step(sizes, device):
    """(e): (a) as a CUDA graph, the fair peer of tkern's graphed step where launches
    dominate: ``AdamW(fused=True, capturable=True)`` and GradScaler's step and update
    (no host sync on that path) captured once after a warm-up, then replayed."""
    step = torch_amp_step(sizes, device, fused=True, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: state and the scaler's tensors exist before capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def unscale_and_check(grads16: list[torch.Tensor], inv_scale: torch.Tensor):
    """fp32 copies of the fp16 grads times 1 / S, and whether any is inf/nan
    (a 0-dim bool device tensor). Pure: no host sync, nothing mutated."""
    grads = torch._foreach_mul([g.float() for g in grads16], inv_scale)
    found = torch.stack([g.isinf().any() | g.isnan().any() for g in grads]).any()
    return grads, found


def adamw_update(model, master, grads, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected) on the
    fp32 ``master`` in place, then the fp16 ``model`` copied from it. ``step`` is
    a 0-dim fp32 device tensor (counted here), so a compiled version never sees a
    changing Python number; the hyperparameters are constants."""
    beta1, beta2 = betas
    step.add_(1)
    bias1 = 1 - beta1**step
    bias2_sqrt = (1 - beta2**step).sqrt()
    torch._foreach_mul_(master, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_mul_(denom, 1 / bias2_sqrt)
    torch._foreach_add_(denom, eps)
    updates = torch._foreach_div(exp_avg, denom)
    torch._foreach_mul_(updates, -lr / bias1)
    torch._foreach_add_(master, updates)
    torch._foreach_copy_(model, master)


def master_by_hand(sizes, device, compile_backend: str | None = None):
    """(c): fp16 model, fp32 master, the whole recipe in plain torch ops; with
    ``compile_backend``, (d): its two pure parts compiled (static shapes, one
    graph each), the host sync between them left outside as the recipe needs.

    Compiling the whole step instead (graph break at ``found.item()``, the
    optimizer inside) crashed in Dynamo's dynamic-shape guards on torch 2.11
    (IndexError in produce_guards_verbose) once a second size was compiled."""
    model = [torch.randn(n, device=device, dtype=torch.float16, requires_grad=True) for n in sizes]
    make_grads(model, 2.0**16)
    model_data = [p.detach() for p in model]  # in-place copies into the params
    grads16 = [p.grad for p in model]
    master = [p.detach().float() for p in model]
    exp_avg = [torch.zeros_like(m) for m in master]
    exp_avg_sq = [torch.zeros_like(m) for m in master]
    count = torch.zeros((), device=device)
    inv_scale = torch.full((), 2.0**-16, device=device)
    check, update = unscale_and_check, adamw_update
    if compile_backend is not None:
        torch._dynamo.reset()  # each size compiles afresh: no recompile limit, no automatic dynamic
        check = torch.compile(check, backend=compile_backend, dynamic=False, fullgraph=True)
        update = torch.compile(update, backend=compile_backend, dynamic=False, fullgraph=True)

    @torch.no_grad()
    def step():
        grads, found = check(grads16, inv_scale)
        if not found.item():  # the host sync this recipe needs
            update(model_data, master, grads, exp_avg, exp_avg_sq, count, LR, BETAS, EPS, WEIGHT_DECAY)

    step.tensors = {"model": model_data, "grads16": grads16, "master": master, "count": count}  # for tests
    return step


def count_syncs(step, mode, steps: int = SYNC_STEPS) -> float | None:
    """Host synchronizations per call of ``step`` (CUDA only), averaged over
    ``steps`` calls, so a sync that happens only every few steps (a periodic
    host poll) shows as the fraction it is instead of 0 or 1."""
    if mode.device.type != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return round(sum("synchroniz" in str(w.message) for w in caught) / steps, 3)
