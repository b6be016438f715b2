"""ZeRO-2's overlapped gradient sync issues each bucket as soon as its gradients are
complete, in the order they complete (issue 36, item 7), on 2 gloo ranks.

The model is a converted network in miniature: four blocks of Linear then LayerNorm,
the linears in one param group (a bucket each), the norms in a second (one bucket over
every block, as the fp32 norms of ``convert_network``'s models are). Backward reaches
block 0's norm near the end, so the norm bucket completes after three linear buckets; a
fixed order that puts it first makes every linear bucket wait for it (the collapse: all
issued after the last gradient).
Each rank counts the gradients as they arrive and records after how many each bucket's
reduce-scatter is issued: from the second step (the first learns the order) that must be
exactly when the bucket's last gradient arrived. The params must equal, bit for bit,
those of the same run with ``overlap_grad_sync=False`` (every bucket reduced in step()).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scenarios import result, run_scenarios
from torch import nn

import tkern.optim.distributed_sync as sync
from tkern.optim import DistributedFusedAdamW

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 3
BUCKET_MB = 512 / 2**20  # one Linear(8, 8) per bucket (320 B padded), the 4 norms (512 B) in one


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.LayerNorm(8))])


def _train(rank, overlap: bool):
    model = _model()
    counted = [0]
    arrived: dict[int, int] = {}  # id(param) -> gradients counted when its own arrived

    def count(p):
        counted[0] += 1
        arrived[id(p)] = counted[0]

    for p in model.parameters():  # before the optimizer's hooks: they run first
        p.register_post_accumulate_grad_hook(count)
    linears = [p for m in model if isinstance(m, nn.Linear) for p in m.parameters()]
    norms = [p for m in model if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    opt = DistributedFusedAdamW(
        [{"params": linears}, {"params": norms}], lr=1e-2, bucket_mb=BUCKET_MB, overlap_grad_sync=overlap
    )
    flats = [f for fs in opt.flat_buffers for f in fs]
    issued: dict[int, int] = {}
    original = sync.reduce_scatter

    def recording(recv, send, **kw):
        for k, f in enumerate(flats):
            if send.data_ptr() == f.grad.data_ptr():
                issued[k] = counted[0]
        return original(recv, send, **kw)

    sync.reduce_scatter = recording
    steps = []
    try:
        for t in range(STEPS):
            counted[0] = 0
            issued.clear()
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * t + rank)
            model(torch.randint(-8, 9, (4, 8), generator=g) / 8).square().sum().backward()
            opt.step()
            done = [max(arrived[id(p)] for p in f.params) for f in flats]
            steps.append({"issued": [issued[k] for k in range(len(flats))], "complete": done})
    finally:
        sync.reduce_scatter = original
    return {"steps": steps, "buckets": len(flats), "params": [p.detach().clone() for p in model.parameters()]}


def _scenario_order(rank, world):
    return {"overlap": _train(rank, True), "in_step": _train(rank, False)}


SCENARIOS = {"order": _scenario_order}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(__name__, 2, list(SCENARIOS), tmp_path_factory.mktemp("order"), timeout_s=300)


def test_each_bucket_is_issued_when_its_last_gradient_arrives(world2):
    for res in result(world2, "order"):
        run = res["overlap"]
        assert run["buckets"] == 5  # four linear buckets and the norms'
        for step in run["steps"][1:]:
            assert step["issued"] == step["complete"], step
        # what the collapse needs: the norm bucket (the last, and the first of a fixed order)
        # completes after three of the four linear buckets (at 4, 8 and 12 of 16 gradients)
        done = run["steps"][-1]["complete"]
        assert sum(c < done[-1] for c in done[:-1]) == 3, done


def test_reordered_overlap_is_bit_identical_to_syncing_in_step(world2):
    for res in result(world2, "order"):
        for a, b in zip(res["overlap"]["params"], res["in_step"]["params"], strict=True):
            assert torch.equal(a, b)
