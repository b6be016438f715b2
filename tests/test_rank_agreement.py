"""Nothing silently differs across ranks (issue 36), on 2 gloo ranks.

* One rounding seed: ranks that seed torch differently (``torch.manual_seed(rank)``)
  still agree on the default seed of stochastic rounding, so ZeRO-2's and FSDP2's
  ``state_dict()`` are one and DDP replicas stepped with ``master="none"`` stay equal
  bit for bit.
* One decision: a plain param group beside FSDP2's DTensor groups (each rank its own
  gradient) cannot make ranks clip by different norms or one rank skip alone.
* Each rank loads its own rows of a whole (unsharded) state tensor, and ZeRO-2's
  overlapped reduce-scatter gives the mean gradient: both against references that do
  not run the code under test (the saved whole tensor; one process stepped on the mean
  of the ranks' autograd gradients).
* A write through ``p.to_local()`` is kept by the next step (against one process that
  makes the same write to the whole param).

ONE spawn runs every scenario (tests/scenarios.py); the tests check what each rank saved.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scenarios import result, run_scenarios
from torch import nn

from tkern.optim import DistributedFusedAdamW, DistributedFusedSGD, FusedAdamW, FusedSGD

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TIMEOUT_S = 300
#: 256 B of fp32 per bucket: each Linear(8, 8)'s weight is a bucket of its own, so the
#: overlap issues reduce-scatters from the backward hooks while backward goes on
TINY_BUCKET_MB = 256 / 2**20


def _mlp(dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = (8, 8, 4)) -> nn.Sequential:
    torch.manual_seed(0)  # one start on every rank
    layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False)]
    return nn.Sequential(*layers).to(dtype)


def _batch(step: int, rank: int, dtype: torch.dtype = torch.float32, width: int = 8) -> torch.Tensor:
    """Multiples of 1/8: products and sums in the gradients stay exact in bf16 and fp32."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randint(-8, 9, (4, width), generator=g) / 8).to(dtype)


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _shard(model: nn.Sequential, mesh) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(tensors) -> list[torch.Tensor]:
    return [t.full_tensor().detach().clone() for t in tensors]


# ----------------------------------------------------------------------- the ranks' side


def _scenario_seed(rank, world):
    """Each rank seeds torch with its rank before building the optimizers."""
    out = {}
    # ZeRO-2 with stochastic rounding: one state_dict on every rank
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(300, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2)]
    torch.manual_seed(rank)
    opt = DistributedFusedAdamW(params, lr=1e-3, master="none")
    for t in range(2):
        for i, p in enumerate(params):
            p.grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * t + i)))
        opt.step()
    weights = [p.detach().clone() for p in params]
    out["zero2"] = {"seed": opt.seed, "state": opt.state_dict(), "params": weights}

    # DDP with master="none": each replica rounds its own update; they must round alike
    model = _mlp(torch.bfloat16, (16, 16, 4))
    torch.manual_seed(rank)
    opt = FusedAdamW(model.parameters(), lr=1e-3, master="none")
    ddp = nn.parallel.DistributedDataParallel(model)
    for t in range(3):
        opt.zero_grad()
        ddp(_batch(t, rank, torch.bfloat16, 16)).float().square().mean().backward()
        opt.step()
    out["ddp"] = {"seed": opt.seed, "params": [p.detach().clone() for p in model.parameters()]}

    # FSDP2 (fp32 master: the seed only travels in the state_dict, which must be one)
    model = _shard(_mlp(), _mesh(world))
    torch.manual_seed(rank)
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    out["fsdp"] = {"seed": opt.seed, "saved": opt.state_dict()["seed"]}

    # a seed given is kept as it is (no collective: any rank may build such an optimizer)
    if rank == 1:
        out["given"] = FusedAdamW([torch.ones(4, requires_grad=True)], master="none", seed=7).seed
    return out


def _scenario_mixed_groups(rank, world):
    """FSDP2's params beside a plain param whose gradient is each rank's own: step 0 clips,
    step 1 has an inf in the plain gradient of rank 1 only."""
    model = _shard(_mlp(), _mesh(world))
    extra = nn.Parameter(torch.ones(3))
    opt = FusedAdamW([{"params": model.parameters()}, {"params": [extra]}], lr=1e-2, max_grad_norm=0.5)
    steps = []
    for t in range(2):
        opt.zero_grad()
        (model(_batch(t, rank)).sum() + (extra * (rank + 1) * 4.0).sum()).backward()
        if t == 1 and rank == 1:
            extra.grad[0] = float("inf")
        before = _full(model.parameters()) + [extra.detach().clone()]
        sharded_sumsq = sum(float(g.square().sum()) for g in _full(p.grad for p in model.parameters()))
        plain_sumsq = float(extra.grad.square().sum())
        opt.step()
        after = _full(model.parameters()) + [extra.detach().clone()]
        steps.append(
            {
                "stats": opt.grad_stats.clone(),
                "sharded_sumsq": sharded_sumsq,
                "plain_sumsq": plain_sumsq,
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            }
        )
    return steps


#: The single-process run whose whole state the sharded optimizer loads.
LOAD_STEPS = 2


def whole_state() -> dict:
    """One process's AdamW state over the unsharded model (exp_avg and exp_avg_sq differ
    row by row, so a rank that takes another rank's rows is seen)."""
    params = [p.detach().clone().requires_grad_() for p in _mlp(sizes=(8, 5, 3)).parameters()]
    opt = FusedAdamW(params, lr=1e-2)
    for t in range(LOAD_STEPS):
        g = torch.Generator().manual_seed(t)
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=g))
        opt.step()
    return opt.state_dict()


def _scenario_whole_load(rank, world):
    """Load one process's whole state into the optimizer over FSDP2's shards (uneven: the
    first layer's 5 rows split 3 + 2, the second's 3 split 2 + 1)."""
    model = _shard(_mlp(sizes=(8, 5, 3)), _mesh(world))
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(whole_state())
    state = opt.state_dict()["state"]
    return {k: {n: v.full_tensor() for n, v in entry.items() if n != "step"} for k, entry in state.items()}


#: ZeRO-2's overlapped gradient sync: (params' dtype, grad_sync_dtype)
OVERLAP_CASES = {
    "fp32": (torch.float32, torch.float32),
    "bf16-fp32-sum": (torch.bfloat16, torch.float32),
    "bf16-own-sum": (torch.bfloat16, None),
}


def _scenario_overlap_mean(rank, world):
    out = {}
    for case, (dtype, sync) in OVERLAP_CASES.items():
        model = _mlp(dtype, (8, 8, 8, 4))
        opt = DistributedFusedSGD(
            model.parameters(), lr=0.5, bucket_mb=TINY_BUCKET_MB, grad_sync_dtype=sync, overlap_grad_sync=True
        )
        for t in range(2):
            opt.zero_grad()
            model(_batch(t, rank, dtype)).float().sum().backward()
            opt.step()
        out[case] = {
            "buckets": sum(map(len, opt.flat_buffers)),
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return out


def _scenario_to_local_write(rank, world):
    """Step, double every param through ``p.to_local()``, step again."""
    model = _shard(_mlp(), _mesh(world))
    opt = FusedSGD(model.parameters(), lr=0.5)
    grads = []
    for t in range(2):
        if t == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().mul_(2)
        opt.zero_grad()
        model(_batch(t, rank)).sum().backward()
        grads.append(_full(p.grad for p in model.parameters()))
        opt.step()
    return {"grads": grads, "params": _full(model.parameters())}


SCENARIOS = {
    "seed": _scenario_seed,
    "mixed_groups": _scenario_mixed_groups,
    "whole_load": _scenario_whole_load,
    "overlap_mean": _scenario_overlap_mean,
    "to_local_write": _scenario_to_local_write,
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(__name__, 2, list(SCENARIOS), tmp_path_factory.mktemp("agree"), timeout_s=TIMEOUT_S)


# ----------------------------------------------------------------------- item 8: one seed


def _equal_states(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a["param_groups"] != b["param_groups"] or a.get("seed") != b.get("seed"):
        return False
    return all(
        torch.equal(torch.as_tensor(x), torch.as_tensor(b["state"][k][n]))
        for k, entry in a["state"].items()
        for n, x in entry.items()
    )


def test_zero2_ranks_seeded_differently_agree_on_rank_0s_seed(world2):
    ranks = result(world2, "seed")
    assert _equal_states(ranks[0]["zero2"]["state"], ranks[1]["zero2"]["state"])
    assert [r["zero2"]["seed"] for r in ranks] == [0, 0]  # torch.manual_seed(0) on rank 0
    for a, b in zip(ranks[0]["zero2"]["params"], ranks[1]["zero2"]["params"], strict=True):
        assert torch.equal(a, b)


def test_ddp_replicas_with_stochastic_rounding_stay_equal_bit_for_bit(world2):
    ranks = result(world2, "seed")
    start = list(_mlp(torch.bfloat16, (16, 16, 4)).parameters())
    for a, b, s in zip(ranks[0]["ddp"]["params"], ranks[1]["ddp"]["params"], start, strict=True):
        assert not torch.equal(a, s)  # they moved (so rounding was drawn)
        assert torch.equal(a, b)
    assert [r["ddp"]["seed"] for r in ranks] == [0, 0]


def test_fsdp2_ranks_seeded_differently_save_one_seed(world2):
    ranks = result(world2, "seed")
    assert [(r["fsdp"]["seed"], r["fsdp"]["saved"]) for r in ranks] == [(0, 0), (0, 0)]
    assert ranks[1]["given"] == 7


# ----------------------------------------------------------------------- item 2: one decision


def test_plain_group_beside_dtensor_groups_cannot_split_the_ranks_decision(world2):
    ranks = result(world2, "mixed_groups")
    for t in range(2):
        a, b = (r[t]["stats"] for r in ranks)
        assert torch.equal(a, b), t  # one clip norm, one skip flag
    # step 0: the plain gradients differ (x1 and x2 per rank); the ranks clip by the norm of
    # the DTensor gradients joined with the largest plain one (max: as for replicas)
    plain = max(r[0]["plain_sumsq"] for r in ranks)
    assert ranks[0][0]["plain_sumsq"] != ranks[1][0]["plain_sumsq"]
    norm = (ranks[0][0]["sharded_sumsq"] + plain) ** 0.5
    assert float(ranks[0][0]["stats"][1].sqrt()) == pytest.approx(norm, rel=1e-6)
    assert norm > 0.5 and not ranks[0][0]["unchanged"] and not ranks[1][0]["unchanged"]
    # step 1: the inf on rank 1 alone skips the step on both
    assert [float(r[1]["stats"][0]) for r in ranks] == [1.0, 1.0]
    assert ranks[0][1]["unchanged"] and ranks[1][1]["unchanged"]


# ----------------------------------------------------------------------- item 9: references


def test_each_rank_loads_its_own_rows_of_a_whole_state(world2):
    # the reference is the saved whole tensor itself: the ranks' shards, gathered, are it
    whole = whole_state()["state"]
    for res in result(world2, "whole_load"):
        assert res.keys() == whole.keys()
        for k, entry in res.items():
            for name, got in entry.items():
                assert torch.equal(got, whole[k][name]), (k, name)


def test_overlapped_reduce_scatter_gives_the_mean_gradient(world2):
    # the reference: one process stepped on the mean of the two ranks' autograd gradients
    # (multiples of 1/8 summed and halved: exact, so the bits must match)
    ranks = result(world2, "overlap_mean")
    for case, (dtype, _) in OVERLAP_CASES.items():
        assert ranks[0][case]["buckets"] > 1
        model = _mlp(dtype, (8, 8, 8, 4))
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        opt = FusedSGD(params, lr=0.5)
        for t in range(2):
            grads = []
            for r in range(2):
                replica = _mlp(dtype, (8, 8, 8, 4))
                with torch.no_grad():
                    for q, p in zip(replica.parameters(), params, strict=True):
                        q.copy_(p)
                replica(_batch(t, r, dtype)).float().sum().backward()
                grads.append([q.grad.float() for q in replica.parameters()])
            for p, g0, g1 in zip(params, *grads, strict=True):
                p.grad.copy_(((g0 + g1) / 2).to(dtype))
            opt.step()
        for res in ranks:
            for i, (got, want) in enumerate(zip(res[case]["params"], params, strict=True)):
                assert torch.equal(got, want.detach()), (case, i)


# ----------------------------------------------------------------------- item 3: to_local writes


def test_a_write_through_to_local_is_kept_by_the_next_step(world2):
    # one process: the same steps on the gathered gradients, the whole params doubled between
    ranks = result(world2, "to_local_write")
    params = [p.detach().clone().requires_grad_() for p in _mlp().parameters()]
    opt = FusedSGD(params, lr=0.5)
    for t, grads in enumerate(ranks[0]["grads"]):
        if t == 1:
            with torch.no_grad():
                for p in params:
                    p.mul_(2)
        for p, g in zip(params, grads, strict=True):
            p.grad.copy_(g)
        opt.step()
    for res in ranks:
        for got, want in zip(res["params"], params, strict=True):
            assert torch.equal(got, want.detach())
