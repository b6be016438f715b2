"""ZeRO-2's gradient reduce-scatter overlapped with backward (issue 27, item 5):
``DistributedFused*(overlap_grad_sync=True)`` issues each bucket's collective from
the backward hooks, and must give the bits of ``overlap_grad_sync=False`` (which
issues the same collectives inside ``step()``) in every configuration: the fp32
staging and the own-dtype sum, micro-batches under ``no_sync()`` and without it,
tkern.nn.Linear's weight gradient written straight into the flat buffer.

The reference of each run is the same run with the overlap off, on the same ranks:
the same collectives on the same data, so equality is exact (``torch.equal``). The
order is checked by logging every reduce-scatter against a hook on the FIRST
layer's weight, whose gradient backward produces last: with the overlap on, the
later layers' buckets must already be issued when it fires.

Each world size is ONE spawn running every scenario (tests/scenarios.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from scenarios import result, run_scenarios
from torch import nn

import tkern
import tkern.optim.distributed_sync as zero2
from tkern.flat import grad_is_flat_view
from tkern.ops import common
from tkern.optim import DistributedFusedAdamW, DistributedFusedSGD

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 2
#: 256 B of fp32 per bucket: each Linear(8, 8)'s weight (64 elements) is a bucket of its own
TINY_BUCKET_MB = 256 / 2**20


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(3)  # the same start on every rank (construction broadcasts rank 0's anyway)
    layers = [
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 4),
    ]
    return nn.Sequential(*layers).to(dtype)


def _batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(6, 8, generator=g).to(dtype)


def _train(model, opt, rank, dtype, accumulate: str, scale: float = 1.0) -> dict:
    """STEPS steps of two micro-batches; ``accumulate``: "no_sync" (the first micro-batch's
    backward inside ``no_sync()``), "plain" (two backwards, no no_sync) or "one" (one)."""
    for t in range(STEPS):
        micros = 1 if accumulate == "one" else 2
        for m in range(micros):
            quiet = accumulate == "no_sync" and m < micros - 1
            with opt.no_sync() if quiet else contextlib.nullcontext():
                (model(_batch(t, m, rank, dtype)).float().square().mean() * scale).backward()
        opt.step(inv_scale=torch.tensor([1 / scale]))
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "state": opt.state_dict()}


def _run(rank: int, dtype: torch.dtype, sync, accumulate: str, overlap: bool) -> dict:
    model = _mlp(dtype)
    opt = DistributedFusedAdamW(
        model.parameters(), lr=1e-2, max_grad_norm=0.5, bucket_mb=TINY_BUCKET_MB,
        grad_sync_dtype=sync, overlap_grad_sync=overlap,
    )  # fmt: skip
    out = _train(model, opt, rank, dtype, accumulate, scale=64.0)
    out["buckets"] = sum(map(len, opt.flat_buffers))
    return out


IDENTITY = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float16, None)]


def _scenario_identity(rank, world):
    """Overlap on and off, both gradient sync dtypes, micro-batches under no_sync; without
    no_sync: right with the overlap off, an error with it on."""
    out = {}
    for dtype, sync in IDENTITY:
        for overlap in (True, False):
            out[(str(dtype), str(sync), overlap)] = _run(rank, dtype, sync, "no_sync", overlap)
        out[(str(dtype), str(sync), "plain")] = _run(rank, dtype, sync, "plain", False)
    try:
        _run(rank, torch.float32, torch.float32, "plain", True)
    except RuntimeError as e:
        out["plain_overlap_error"] = str(e)
    return out


def _order_run(rank: int, overlap: bool) -> dict:
    log: list[str] = []
    issue = zero2.reduce_scatter

    def logged(*args, **kwargs):
        log.append("reduce_scatter")
        return issue(*args, **kwargs)

    zero2.reduce_scatter = logged
    try:
        model = _mlp(torch.float32)
        # registered first, so it runs before the optimizer's hooks on that weight
        model[0].weight.register_post_accumulate_grad_hook(lambda p: log.append("first layer's grad"))
        opt = DistributedFusedSGD(model.parameters(), lr=0.1, bucket_mb=TINY_BUCKET_MB,
                                  overlap_grad_sync=overlap)  # fmt: skip
        model(_batch(0, 0, rank, torch.float32)).square().mean().backward()
        log.append("backward returned")
        opt.step()
        log.append("step returned")
    finally:
        zero2.reduce_scatter = issue
    return {"log": log, "buckets": sum(map(len, opt.flat_buffers))}


def _scenario_order(rank, world):
    """Log each reduce-scatter and the moment backward reaches the first layer's weight."""
    return {overlap: _order_run(rank, overlap) for overlap in (True, False)}


def _wgrad_run(rank: int, overlap: bool) -> dict:
    taken = []
    flat_wgrad = common.flat_wgrad

    def spy(*args):
        into = flat_wgrad(*args)
        taken.append(into is not None)
        return into

    common.flat_wgrad = spy
    try:
        torch.manual_seed(4)
        model = tkern.convert_network(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.float16
        )
        opt = DistributedFusedAdamW(model.parameters(), lr=1e-2, bucket_mb=TINY_BUCKET_MB,
                                    overlap_grad_sync=overlap)  # fmt: skip
        res = _train(model, opt, rank, torch.float16, "no_sync", scale=256.0)
        res["views"] = all(grad_is_flat_view(m.weight) for m in model if isinstance(m, tkern.nn.Linear))
    finally:
        common.flat_wgrad = flat_wgrad
    res["into"] = sum(taken)
    return res


def _scenario_wgrad(rank, world):
    """tkern.nn.Linear puts dW into the flat buffer; the overlap reduces it from there."""
    return {overlap: _wgrad_run(rank, overlap) for overlap in (True, False)}


def _scenario_staging(rank, world):
    """fp16 gradients whose fp16 sum over the ranks overflows: summed in fp32 from the hooks,
    the mean is finite and the step is taken."""
    p = torch.zeros(40, dtype=torch.float16, requires_grad=True)
    opt = DistributedFusedSGD([p], lr=1.0)
    coeff = torch.full((40,), 30000.0 + 1000.0 * rank)
    (p.float() * coeff).sum().backward()
    opt.step()
    return {"found_inf": float(opt.grad_stats[0]), "param": p.detach().clone()}


SCENARIOS = {
    "identity": _scenario_identity,
    "order": _scenario_order,
    "wgrad": _scenario_wgrad,
    "staging": _scenario_staging,
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(
        __name__, 2, ["order", "identity", "wgrad"], tmp_path_factory.mktemp("w2"), timeout_s=240
    )


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return run_scenarios(__name__, 3, ["identity", "staging"], tmp_path_factory.mktemp("w3"), timeout_s=240)


def _assert_same_run(got: dict, ref: dict) -> None:
    for i, (have, want) in enumerate(zip(got["params"], ref["params"], strict=True)):
        assert torch.equal(have, want), f"param {i}"
    assert got["state"]["param_groups"] == ref["state"]["param_groups"]
    for k, entry in ref["state"]["state"].items():
        for name, want in entry.items():
            assert torch.equal(got["state"]["state"][k][name], want), (k, name)


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_gives_the_bits_of_the_sync_in_step(request, world):
    for res in result(request.getfixturevalue(f"world{world}"), "identity"):
        for dtype, sync in IDENTITY:
            on, off = res[(str(dtype), str(sync), True)], res[(str(dtype), str(sync), False)]
            assert on["buckets"] == off["buckets"] >= 4  # several buckets: several collectives
            _assert_same_run(on, off)


@pytest.mark.parametrize("world", [2, 3])
def test_micro_batches_without_no_sync(request, world):
    """Overlap off: two plain backwards accumulate and step() reduces once, the bits of the
    no_sync run (the same local sums). Overlap on: the second backward finds its buckets
    reduced already and raises, naming the way out."""
    for res in result(request.getfixturevalue(f"world{world}"), "identity"):
        for dtype, sync in IDENTITY:
            _assert_same_run(res[(str(dtype), str(sync), "plain")], res[(str(dtype), str(sync), False)])
        msg = res["plain_overlap_error"]
        assert "a second backward" in msg and "no_sync()" in msg and "overlap_grad_sync=False" in msg


def test_buckets_are_reduce_scattered_while_backward_runs(world2):
    for res in result(world2, "order"):
        on, off = res[True], res[False]
        n = on["buckets"]
        assert n >= 4  # one bucket per weight at least
        # overlap: buckets of the later layers are issued before backward reaches the first
        # layer's weight, and all of them before backward returns
        log = on["log"]
        first = log.index("first layer's grad")
        assert 1 <= log[:first].count("reduce_scatter") < n
        assert log[: log.index("backward returned")].count("reduce_scatter") == n
        assert log.count("reduce_scatter") == n  # nothing issued twice
        # without overlap: nothing until step()
        assert off["log"] == ["first layer's grad", "backward returned"] + ["reduce_scatter"] * n + [
            "step returned"
        ]


def test_the_weight_gradient_written_into_the_flat_buffer_is_reduced_by_the_hooks(world2):
    for res in result(world2, "wgrad"):
        on, off = res[True], res[False]
        assert on["into"] == off["into"] > 0  # tkern.linear put dW into the buffer
        assert on["views"] and off["views"]
        _assert_same_run(on, off)
    ranks = result(world2, "wgrad")
    assert all(
        torch.equal(a, b) for a, b in zip(ranks[0][True]["params"], ranks[1][True]["params"], strict=True)
    )


def test_fp32_staging_from_the_hooks_sums_without_overflow(world3):
    # sum 30000 + 31000 + 32000 = 93000 overflows fp16 (max 65504); the fp32 sum / 3 = 31000 is
    # exact in fp16 (a multiple of 8 below 32768), so SGD with lr 1 gives exactly -31000
    for res in result(world3, "staging"):
        assert res["found_inf"] == 0.0
        assert torch.equal(res["param"], torch.full((40,), -31000.0, dtype=torch.float16))
