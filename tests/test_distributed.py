"""The sharded (ZeRO-2) optimizers on gloo ranks, against the single-process
fused optimizers stepped on the mean gradient.

Processes are slow to start (each imports torch and triton), so each world
size is ONE spawn that runs every scenario and saves what it saw; the tests
below check those results. Gradients are multiples of 1/32 in [-2, 2]: every
sum of a few of them is exact in fp32, so the mean gradient the ranks reduce
(an fp32 sum divided by W, rounded once to the param dtype) is bit-identical
to the one the reference computes, and without clipping the sharded run must
match the reference exactly. With clipping the global sum of squares is added
in another order (per shard, then across ranks): the clip factor may differ in
its last bit, so params and master agree within 1e-6 (relative fp32 roundoff
of one factor, 6e-8, times a handful of steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dp_reference import trainer_loader, trainer_model, trainer_reference
from scenarios import result as _result
from scenarios import run_scenarios

import tkern
from tkern.optim import (
    DistributedFusedAdam,
    DistributedFusedAdamW,
    DistributedFusedSGD,
    FusedAdam,
    FusedAdamW,
    FusedSGD,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

SHAPES = [
    ((7,), torch.float32),
    ((5, 3), torch.float32),
    ((70,), torch.float16),
    ((4, 4), torch.float16),
    ((1,), torch.float16),
    ((9,), torch.bfloat16),
]
STEPS = 3
SCALE = 8.0  # gradients arrive multiplied by a loss scale; step(inv_scale=1/8)
OPTIMIZERS = {
    "adamw": (FusedAdamW, DistributedFusedAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (FusedAdam, DistributedFusedAdam, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (FusedSGD, DistributedFusedSGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}),
}
CLIP = {"noclip": None, "clip": 0.5}  # the mean gradients' norm is ~7-9: 0.5 clips every step
CONFIGS = [(o, c) for o in OPTIMIZERS for c in CLIP]
TIMEOUT_S = 240  # a whole spawn; gloo's own timeout (60 s) turns a hang into an error first


def make_params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(d).requires_grad_() for s, d in SHAPES]


def rank_grad(step: int, rank: int, index: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of param ``index`` at ``step``: multiples of 1/32 in [-2, 2]."""
    shape, dtype = SHAPES[index]
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + index)
    return (torch.randint(-64, 65, shape, generator=g) / 32).to(dtype)


def mean_grad(step: int, world: int, index: int) -> torch.Tensor:
    """The mean of the ranks' loss-scaled gradients as the optimizer forms it: fp32 sum / W,
    rounded once to the param's dtype."""
    total = sum(rank_grad(step, r, index).float() * SCALE for r in range(world))
    return (total / world).to(SHAPES[index][1])


def reference(name: str, clip: float | None, world: int, skip: frozenset = frozenset()):
    """Single-process optimizer stepped on the mean gradients (steps in ``skip`` left out)."""
    fused, _, kw = OPTIMIZERS[name]
    params = make_params(100)
    opt = fused(params, max_grad_norm=clip, **kw)
    inv = torch.tensor([1 / SCALE])
    for t in range(STEPS):
        if t in skip:
            continue
        for i, p in enumerate(params):
            p.grad.copy_(mean_grad(t, world, i))
        opt.step(inv_scale=inv)
    return [p.detach().clone() for p in params], opt.state_dict()


# ----------------------------------------------------------------------- the ranks' side


def _sharded_run(name, clip, rank, world, group=None, inf_at=None, record=None, **extra):
    """Step a sharded optimizer STEPS times on this rank's gradients."""
    _, sharded, kw = OPTIMIZERS[name]
    params = make_params(100 + rank)  # different on every rank: construction broadcasts rank 0's
    opt = sharded(params, max_grad_norm=clip, process_group=group, **kw, **extra)
    inv = torch.tensor([1 / SCALE])
    for t in range(STEPS):
        for i, p in enumerate(params):
            p.grad.copy_(rank_grad(t, rank, i) * SCALE)
        if inf_at == t and rank == 1:
            params[2].grad[5] = float("inf")
        before = [p.detach().clone() for p in params]
        opt.step(inv_scale=inv)
        if record is not None and t == inf_at:
            record["found_inf"] = float(opt.grad_stats[0])
            record["unchanged"] = all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    return [p.detach().clone() for p in params], opt.state_dict()


def _scenario_equivalence(rank, world):
    # 128 B buckets: the fp32 staging of the reduce-scatter runs in chunks of 16 elements per rank
    out = {cfg: _sharded_run(cfg[0], CLIP[cfg[1]], rank, world, bucket_mb=2.0**-13) for cfg in CONFIGS}
    if world == 2:
        out["own_dtype"] = _sharded_run("adamw", None, rank, world, grad_sync_dtype=None)
    return out


def _scenario_skip(rank, world):
    record = {}
    params, state = _sharded_run("adamw", None, rank, world, inf_at=1, record=record)
    # tkern's loss scaler drives the sharded optimizer as any fused one: only rank 0 overflows
    p = torch.ones(40, dtype=torch.float16, requires_grad=True)
    opt = DistributedFusedSGD([p], lr=0.1)
    scaler = tkern.DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
    scales, skipped = [], []
    for step in range(6):
        scaler.scale(p.float().sum()).backward()
        if step == 2 and rank == 0:
            p.grad[3] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(scaler.skipped_steps)
    return {"params": params, "state": state, **record, "scaler": (scales, skipped, p.detach().clone())}


def _scenario_memory(rank, world):
    # fp16 params of awkward sizes: padding per param and per buffer
    sizes = [1000, 37, 4096, 3, 250_000]
    params = [torch.zeros(n, dtype=torch.float16, requires_grad=True) for n in sizes]
    opt = DistributedFusedAdamW(params)
    return {"sizes": sizes, "report": opt.memory_report()}


def _scenario_size_one_group(rank, world):
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    out = {}
    for name in OPTIMIZERS:
        fused, sharded, kw = OPTIMIZERS[name]
        a, b = make_params(7 + rank), make_params(7 + rank)
        single = fused(a, max_grad_norm=0.5, **kw)
        solo = sharded(b, max_grad_norm=0.5, process_group=groups[rank], **kw)
        for t in range(STEPS):
            for i in range(len(SHAPES)):
                a[i].grad.copy_(rank_grad(t, rank, i))
                b[i].grad.copy_(rank_grad(t, rank, i))
            single.step()
            solo.step()
        out[name] = {
            "params_equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)),
            "state": (single.state_dict(), solo.state_dict()),
            "memory": solo.memory_report(),
        }
    return out


def _scenario_bad_input(rank, world):
    out = {}
    # 1. a param of another shape on rank 1
    params = make_params(0)
    if rank == 1:
        params[1] = torch.zeros(3, 5, requires_grad=True)
    try:
        DistributedFusedAdamW(params)
    except ValueError as e:
        out["mismatch"] = str(e)
    # 2. a param on another device, on rank 1 only
    params = make_params(0)
    if rank == 1:
        params[3] = torch.zeros(4, 4, dtype=torch.float16, device="meta", requires_grad=True)
    try:
        DistributedFusedAdamW(params)
    except ValueError as e:
        out["device"] = str(e)
    # 3. an invalid hyperparameter on rank 1 only (in the second of two groups): no hang
    params = make_params(0)
    try:
        DistributedFusedSGD(
            [{"params": params[:2]}, {"params": params[2:], "lr": 0.5 if rank == 0 else -0.5}]
        )
    except ValueError as e:
        out["bad_lr"] = str(e)
    # 4. step() inside no_sync(): an error, nothing changes
    params = make_params(0)
    opt = DistributedFusedAdamW(params)
    for p in params:
        p.grad.fill_(1.0)
    before = [p.detach().clone() for p in params]
    try:
        with opt.no_sync():
            opt.step()
    except RuntimeError as e:
        out["no_sync_step"] = str(e)
    out["no_sync_unchanged"] = all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    # 5. no_sync() for accumulation: two backward passes, one step == one step on the mean of the sums
    params = make_params(3)
    opt = DistributedFusedAdamW(params, lr=1e-2)
    opt.zero_grad()
    with opt.no_sync():
        sum((p.float() * rank_grad(0, rank, i).float()).sum() for i, p in enumerate(params)).backward()
    sum((p.float() * rank_grad(1, rank, i).float()).sum() for i, p in enumerate(params)).backward()
    opt.step()
    out["accumulated"] = [p.detach().clone() for p in params]
    # 6. torch's step hooks run once per step (FusedAdamW.step is hooked too once one exists)
    FusedAdamW(make_params(0))
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    opt.step()
    out["hooks"] = calls
    # 7. add_param_group after construction: a collective; rank 0's values win, mismatches raise
    extra = torch.full((20,), float(rank), dtype=torch.float16, requires_grad=True)
    opt.add_param_group({"params": [extra], "lr": 0.5})
    out["added"] = extra.detach().clone()
    try:
        opt.add_param_group({"params": [torch.zeros(3 + rank, requires_grad=True)]})
    except ValueError as e:
        out["added_mismatch"] = str(e)
    out["groups_after"] = len(opt.param_groups)
    return out


def _scenario_reshard(rank, world):
    """Resharding 2 -> 3 -> 1 -> 2 against an uninterrupted 2-rank run, in one 3-rank world
    (the 2-rank legs run on the subgroup {0, 1})."""
    assert world == 3
    pair = dist.new_group([0, 1])
    total = 8
    # Each rank's gradient is G_t + (r - (W - 1) / 2) * D_t: the mean is G_t at every world size.

    def grads(t, r, w):
        return [
            ((rank_grad(t, 0, i).float() + (r - (w - 1) / 2) * rank_grad(t, 1, i).float() / 2) * SCALE).to(
                SHAPES[i][1]
            )
            for i in range(len(SHAPES))
        ]

    inv = torch.tensor([1 / SCALE])

    def leg(params, opt, steps, r, w):
        for t in steps:
            for p, g in zip(params, grads(t, r, w), strict=True):
                p.grad.copy_(g)
            opt.step(inv_scale=inv)

    def fresh(values):
        return [v.clone().requires_grad_() for v in values]

    out = {}
    if rank < 2:  # the uninterrupted run
        params = make_params(100)
        opt = DistributedFusedAdamW(params, lr=1e-2, process_group=pair)
        leg(params, opt, range(total), rank, 2)
        out["straight"] = ([p.detach().clone() for p in params], opt.state_dict())
        params = make_params(100)  # leg 1: 2 ranks
        opt = DistributedFusedAdamW(params, lr=1e-2, process_group=pair)
        leg(params, opt, range(0, 2), rank, 2)
        carry = [[p.detach().clone() for p in params], opt.state_dict()]
    else:
        carry = [None, None]
    dist.broadcast_object_list(carry, src=0)
    params = fresh(carry[0])  # leg 2: 3 ranks
    opt = DistributedFusedAdamW(params, lr=1e-2)
    opt.load_state_dict(carry[1])
    leg(params, opt, range(2, 4), rank, 3)
    carry = [[p.detach().clone() for p in params], opt.state_dict()]  # every rank gets the full state
    # the shard alone round-trips at this world size (and refuses another rank's shard)
    shard = opt.sharded_state_dict()
    twin_params = fresh(carry[0])
    twin = DistributedFusedAdamW(twin_params, lr=1e-2)
    twin.load_sharded_state_dict(shard)
    others = [None] * world
    dist.all_gather_object(others, shard)
    try:
        twin.load_sharded_state_dict(others[(rank + 1) % world])
    except ValueError as e:
        out["wrong_shard"] = str(e)
    leg(params, opt, [4], rank, 3)
    leg(twin_params, twin, [4], rank, 3)
    out["sharded"] = ([p.detach().clone() for p in params], [p.detach().clone() for p in twin_params])
    out["sharded_state"] = (opt.state_dict(), twin.state_dict())
    if rank == 0:  # leg 3: one process, the plain optimizer, on the mean gradient
        params = fresh(carry[0])
        opt = FusedAdamW(params, lr=1e-2)
        opt.load_state_dict(carry[1])
        leg(params, opt, range(4, 6), 0, 1)
        carry = [[p.detach().clone() for p in params], opt.state_dict()]
    dist.broadcast_object_list(carry, src=0)
    if rank < 2:  # leg 4: 2 ranks again
        params = fresh(carry[0])
        opt = DistributedFusedAdamW(params, lr=1e-2, process_group=pair)
        opt.load_state_dict(carry[1])
        leg(params, opt, range(6, total), rank, 2)
        out["resumed"] = ([p.detach().clone() for p in params], opt.state_dict())
    return out


def _scenario_trainer(rank, world):
    """The Trainer with the sharded optimizer and tkern's scaler; each rank its half of the
    data (as DistributedSampler splits it), two micro-batches accumulated per step."""
    loader = trainer_loader(rank, world)
    model = trainer_model()
    opt = DistributedFusedAdamW(model.parameters(), lr=1e-2)
    trainer = tkern.Trainer(
        model, opt, torch.nn.functional.cross_entropy, tkern.DynamicLossScaler(), accumulation_steps=2,
        progress=False,
    )  # fmt: skip
    trainer.fit(loader, epochs=2)
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": trainer.step}


#: The memory modes (issue 18) under ZeRO-2: params large enough for 8-bit state.
MODE_SHAPES = [((5000,), torch.bfloat16), ((300,), torch.bfloat16), ((4096,), torch.float32)]
MODE_CONFIGS = {
    "split-uint8": {"master": "split", "state_dtype": torch.uint8},
    "none-bf16": {"master": "none", "state_dtype": torch.bfloat16, "seed": 5},
}


def _mode_params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(d).requires_grad_() for s, d in MODE_SHAPES]


def _mode_grad(step: int, rank: int, index: int) -> torch.Tensor:
    shape, dtype = MODE_SHAPES[index]
    g = torch.Generator().manual_seed(500 * step + 10 * rank + index)
    return (torch.randint(-64, 65, shape, generator=g) / 32).to(dtype)


def mode_reference(config: str, world: int):
    """The single-process optimizer in the same memory mode, stepped on the mean gradients
    (W = 2: the mean of two multiples of 1/32 is exact in every dtype)."""
    params = _mode_params(100)
    opt = FusedAdamW(params, lr=1e-2, **MODE_CONFIGS[config])
    for t in range(STEPS):
        for i, p in enumerate(params):
            total = sum(_mode_grad(t, r, i).float() * SCALE for r in range(world))
            p.grad.copy_((total / world).to(p.dtype))
        opt.step(inv_scale=torch.tensor([1 / SCALE]))
    return [p.detach().clone() for p in params], opt.state_dict()


def _scenario_modes(rank, world):
    out = {}
    for config, modes in MODE_CONFIGS.items():
        params = _mode_params(100 + rank)
        opt = DistributedFusedAdamW(params, lr=1e-2, **modes)
        for t in range(STEPS):
            for i, p in enumerate(params):
                p.grad.copy_(_mode_grad(t, rank, i) * SCALE)
            opt.step(inv_scale=torch.tensor([1 / SCALE]))
        out[config] = ([p.detach().clone() for p in params], opt.state_dict(), opt.memory_report())
    return out


SCENARIOS = {
    "modes": _scenario_modes,
    "equivalence": _scenario_equivalence,
    "skip": _scenario_skip,
    "memory": _scenario_memory,
    "size_one_group": _scenario_size_one_group,
    "bad_input": _scenario_bad_input,
    "reshard": _scenario_reshard,
    "trainer": _scenario_trainer,
}


def _spawn(world, names, out_dir):
    return run_scenarios("test_distributed", world, names, out_dir, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(
        2,
        ["equivalence", "skip", "memory", "size_one_group", "bad_input", "trainer", "modes"],
        tmp_path_factory.mktemp("w2"),
    )


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return _spawn(3, ["equivalence", "memory", "reshard"], tmp_path_factory.mktemp("w3"))


def _assert_states_match(got: dict, ref: dict, exact: bool) -> None:
    assert got["param_groups"] == ref["param_groups"]
    assert got["state"].keys() == ref["state"].keys()
    for k, ref_entry in ref["state"].items():
        entry = got["state"][k]
        assert entry.keys() == ref_entry.keys(), k
        for name, want in ref_entry.items():
            have = entry[name]
            assert have.shape == want.shape and have.dtype == want.dtype, (k, name)
            if exact or name == "step":
                assert torch.equal(have, want), (k, name)
            else:
                torch.testing.assert_close(have, want, atol=1e-6, rtol=0, msg=f"param {k} {name!r}")


def _assert_params_match(got, ref, exact: bool) -> None:
    for i, (have, want) in enumerate(zip(got, ref, strict=True)):
        if exact:
            assert torch.equal(have, want), i
        elif have.dtype == torch.float32:
            torch.testing.assert_close(have, want, atol=1e-6, rtol=0)
        else:  # the masters agree within 1e-6; their roundings within one half-precision ulp
            torch.testing.assert_close(have, want, atol=0, rtol=2.0**-10)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_sharded_step_matches_single_process_on_the_mean_gradient(request, world, config):
    ranks = _result(request.getfixturevalue(f"world{world}"), "equivalence")
    ref_params, ref_state = reference(config[0], CLIP[config[1]], world)
    exact = CLIP[config[1]] is None
    for r, res in enumerate(ranks):
        params, state = res[config]
        _assert_params_match(params, ref_params, exact)
        _assert_states_match(state, ref_state, exact)
        other = ranks[0][config][0]
        assert all(torch.equal(a, b) for a, b in zip(params, other, strict=True)), f"rank {r} differs"


def test_grad_sync_in_the_gradients_own_dtype(world2):
    # W = 2: halving a multiple of 1/32 and adding two of them are exact in fp16 and bf16, so
    # pre-dividing gives the fp32 sum's mean bit for bit
    ref_params, ref_state = reference("adamw", None, 2)
    for res in _result(world2, "equivalence"):
        params, state = res["own_dtype"]
        _assert_params_match(params, ref_params, exact=True)
        _assert_states_match(state, ref_state, exact=True)


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(world2):
    ranks = _result(world2, "skip")
    ref_params, ref_state = reference("adamw", None, 2, skip=frozenset({1}))
    for res in ranks:
        assert res["found_inf"] == 1.0
        assert res["unchanged"]
        _assert_params_match(res["params"], ref_params, exact=True)
        _assert_states_match(res["state"], ref_state, exact=True)
        assert all(float(e["step"]) == STEPS - 1 for e in res["state"]["state"].values())
        scales, skipped, p = res["scaler"]
        assert scales == [256.0, 512.0, 256.0, 256.0, 512.0, 512.0]  # as test_amp_contracts.py's DDP-free run
        assert skipped == [0, 0, 1, 1, 1, 1]
        assert torch.equal(p, torch.full((40,), 1 - 5 * 0.1, dtype=torch.float16))  # 5 applied steps of 0.1


def test_resharding_2_3_1_2_continues_the_uninterrupted_run_bit_exactly(world3):
    ranks = _result(world3, "reshard")
    for res in ranks[:2]:
        straight, resumed = res["straight"], res["resumed"]
        _assert_params_match(resumed[0], straight[0], exact=True)
        _assert_states_match(resumed[1], straight[1], exact=True)
        assert float(resumed[1]["state"][0]["step"]) == 8


def test_sharded_state_dict_round_trips_at_the_same_world_size(world3):
    for r, res in enumerate(_result(world3, "reshard")):
        original, twin = res["sharded"]
        _assert_params_match(twin, original, exact=True)
        _assert_states_match(res["sharded_state"][1], res["sharded_state"][0], exact=True)
        assert f"saved by rank {(r + 1) % 3} of 3, this is rank {r} of 3" in res["wrong_shard"]


def _expected_memory(sizes: list[int], world: int) -> dict[str, int]:
    slots = sum(-(-n // 16) * 16 for n in sizes)
    padded = -(-slots // (16 * world)) * 16 * world
    return {"padded_numel": padded, "param": 2 * padded, "grad": 2 * padded, "master": 4 * padded // world,
            "state": 8 * padded // world}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_memory_per_rank_is_4_plus_12_over_w_bytes_per_param(request, world):
    for r, res in enumerate(_result(request.getfixturevalue(f"world{world}"), "memory")):
        report, sizes = res["report"], res["sizes"]
        expected = _expected_memory(sizes, world)
        assert {k: report[k] for k in expected} == expected
        assert report["numel"] == sum(sizes) and report["world_size"] == world and report["rank"] == r
        assert report["total"] == sum(expected[k] for k in ("param", "grad", "master", "state"))
        padding = expected["padded_numel"] / sum(sizes)  # < 1.001 here
        assert report["bytes_per_param"] == pytest.approx((4 + 12 / world) * padding, rel=1e-12)


@pytest.mark.parametrize("config", list(MODE_CONFIGS))
def test_memory_modes_shard_like_the_single_process_optimizer(world2, config):
    """A split master with 8-bit moments, and stochastic rounding with bf16 moments, under
    ZeRO-2: bit-identical to the single-process run (the 8-bit blocks and the random
    stream are the flat buffer's, whatever the shards), each rank holding half the state."""
    ref_params, ref_state = mode_reference(config, 2)
    single = FusedAdamW(_mode_params(0), **MODE_CONFIGS[config]).memory_report()
    for res in _result(world2, "modes"):
        params, state, report = res[config]
        _assert_params_match(params, ref_params, exact=True)
        _assert_states_match(state, ref_state, exact=True)
        # half of each buffer, plus the padding that makes the shards equal (< 1% here)
        assert single["state"] / 2 <= report["state"] < 0.51 * single["state"]
        assert single["master"] / 2 <= report["master"] <= 0.51 * single["master"]


def test_a_process_group_of_size_one_is_the_plain_optimizer(world2):
    for res in _result(world2, "size_one_group"):
        for name in OPTIMIZERS:
            assert res[name]["params_equal"], name
            single, solo = res[name]["state"]
            _assert_states_match(solo, single, exact=True)
        memory = res["adamw"]["memory"]
        assert memory["world_size"] == 1
        # AdamW at W = 1: 16 B per slot for fp32 params (param, grad, 2 moments; the param is its own
        # master) and for 16-bit ones (2 + 2 + 4 + 8); slots: 16 + 16 fp32, 80 + 16 + 16 fp16, 16 bf16
        assert memory["padded_numel"] == 160 and memory["numel"] == 118
        assert memory["total"] == 16 * 160


def test_params_that_differ_across_ranks_raise_on_every_rank(world2):
    for res in _result(world2, "bad_input"):
        msg = res["mismatch"]
        assert "param 1 of param group 0" in msg and "(5, 3)" in msg and "(3, 5)" in msg and "rank 1" in msg
        assert "on rank 1" in res["device"] and "meta" in res["device"]
    r0, r1 = (res["bad_lr"] for res in _result(world2, "bad_input"))
    assert r1 == "Invalid learning rate: -0.5 (param group 1)"  # FusedSGD's own error, on rank 1
    assert r0 == f"DistributedFusedSGD: on rank 1: ValueError: {r1}"
    for res in _result(world2, "bad_input"):
        assert torch.equal(res["added"], torch.zeros(20, dtype=torch.float16))  # rank 0's values
        assert "param 0 of param group 2" in res["added_mismatch"] and "(4,)" in res["added_mismatch"]
        assert res["groups_after"] == 2  # the rejected group left nothing behind


def test_no_sync_rejects_a_step_and_accumulates_micro_batches(world2):
    ranks = _result(world2, "bad_input")
    params = make_params(3)
    opt = FusedAdamW(params, lr=1e-2)
    for i, p in enumerate(params):
        local = [(rank_grad(0, r, i) + rank_grad(1, r, i)).float() for r in range(2)]
        p.grad.copy_((sum(local) / 2).to(p.dtype))
    opt.step()
    for res in ranks:
        assert "inside no_sync()" in res["no_sync_step"] and res["no_sync_unchanged"]
        assert res["hooks"] == ["pre", "post"]
        _assert_params_match(res["accumulated"], [p.detach() for p in params], exact=True)


def test_the_trainer_trains_data_parallel_with_the_sharded_optimizer(world2):
    # Reference: one process, FusedAdamW, each step on the union of the ranks' micro-batches with
    # the loss averaged over all of them: the same mean gradient up to the order of the sums in
    # backward (fp32 roundoff, ~1e-7 relative), over 4 steps of lr 1e-2: params within 1e-6.
    ranks = _result(world2, "trainer")
    model = trainer_reference(FusedAdamW, lr=1e-2)
    for res in ranks:
        assert res["steps"] == 4
        for have, want in zip(res["params"], model.parameters(), strict=True):
            torch.testing.assert_close(have, want.detach(), atol=1e-6, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
