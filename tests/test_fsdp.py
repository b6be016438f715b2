"""tkern's fused optimizers and loss scalers under FSDP2 (``fully_shard``), on 2 gloo ranks,
against one process stepped on the same gathered gradients.

Processes are slow to start (each imports torch and triton), so ONE spawn runs every
scenario and saves what it saw; the tests below check those results. The model is
Linear(8, 5) -> Linear(5, 1): on 2 ranks its shards are uneven (3 and 2 rows) and the
second layer's are empty on rank 1 (one row). Each rank records the gradients FSDP2
left it, gathered (``full_tensor()``), before each step; the reference is the
single-process optimizer on the full params fed those gradients. Without clipping the
update is elementwise and must match bit for bit. With clipping the sum of squares is
added in another order (per shard, then across ranks): the clip factor may differ in its
last bit (relative 6e-8), so params agree within 1e-6 over the few steps taken.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from scenarios import result, run_scenarios

import tkern
from tkern.optim import DistributedFusedAdamW, FusedAdamW, FusedSGD

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 3
SCALE = 8.0
OPTIMIZERS = {
    "adamw": (FusedAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (FusedSGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}),
}
CLIP = {"noclip": None, "clip": 0.5}  # the gradients' norm is ~2-4: 0.5 clips every step
CONFIGS = [(o, c) for o in OPTIMIZERS for c in CLIP]
TIMEOUT_S = 300


def make_model(dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = (8, 5, 1)) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False)]
    return torch.nn.Sequential(*layers).to(dtype)


def batch(step: int, rank: int, dtype: torch.dtype = torch.float32, width: int = 8) -> torch.Tensor:
    """Rank ``rank``'s input at ``step``: multiples of 1/8, so the gradients are exact in bf16."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randint(-8, 9, (4, width), generator=g) / 8).to(dtype)


def shard(model: torch.nn.Module, mesh, **policy) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **policy)
    return fully_shard(model, mesh=mesh, **policy)


def full(params) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in params]


def reference(name: str, clip: float | None, grads: list[list[torch.Tensor]], skip=frozenset(), **modes):
    """One process: the optimizer on the full params, fed the gathered gradients of each step."""
    fused, kw = OPTIMIZERS[name]
    params = [p.detach().clone().requires_grad_() for p in make_model(**modes.pop("model", {})).parameters()]
    opt = fused(params, max_grad_norm=clip, **kw, **modes)
    inv = torch.tensor([1 / SCALE])
    for t, step_grads in enumerate(grads):
        if t in skip:
            continue
        for p, g in zip(params, step_grads, strict=True):
            p.grad.copy_(g)
        opt.step(inv_scale=inv)
    return [p.detach().clone() for p in params], opt


# ----------------------------------------------------------------------- the ranks' side


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _train(model, opt, rank, steps=STEPS, inf_at=None, dtype=torch.float32, width=8, start=0, zero=None):
    """FSDP2 forward/backward of the loss times SCALE, then the step; returns each step's
    gathered gradients (as the optimizer saw them) and the statistics' norms. ``zero``:
    how gradients are cleared (default ``opt.zero_grad``)."""
    grads, norms = [], []
    inv = torch.tensor([1 / SCALE])
    for t in range(start, start + steps):
        (zero or opt.zero_grad)()
        (model(batch(t, rank, dtype, width)).float().sum() * SCALE).backward()
        if inf_at == t and rank == 1:
            next(model.parameters()).grad.to_local()[0, 0] = float("inf")
        grads.append(full(p.grad for p in model.parameters()))
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).full_tensor()) / SCALE
        )
        opt.step(inv_scale=inv)
        norms[-1] = (norms[-1], float(opt.grad_stats[1].sqrt()))
    return grads, norms


def _scenario_equivalence(rank, world):
    mesh, out = _mesh(world), {}
    for name, clip in CONFIGS:
        fused, kw = OPTIMIZERS[name]
        model = shard(make_model(), mesh)
        opt = fused(model.parameters(), max_grad_norm=CLIP[clip], **kw)
        # SGD's gradients cleared by the model (to None): FSDP2 then hands over new DTensor grads,
        # which the optimizer's post-accumulate-grad hooks copy into its flat buffer
        grads, norms = _train(model, opt, rank, zero=model.zero_grad if name == "sgd" else None)
        out[name, clip] = {
            "grads": grads,
            "norms": norms,
            "params": full(model.parameters()),
            "local": [p.to_local().shape for p in model.parameters()],
        }
    return out


def _scenario_skip(rank, world):
    """An inf in rank 1's shard at step 1: (a) FusedAdamW, tkern's scaler; (b) FusedAdamW,
    torch.amp.GradScaler; (c) torch.optim.AdamW, tkern's scaler (its unscale-and-check path,
    with rank 1's empty shards)."""
    mesh, out = _mesh(world), {}
    for case in ("tkern", "grad_scaler", "torch_opt"):
        model = shard(make_model(), mesh)
        if case == "torch_opt":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if case == "grad_scaler":
            scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
        else:
            scaler = tkern.DynamicLossScaler(init_scale=SCALE, growth_interval=1)
        params, scales, grads, unchanged = [], [], [], []
        for t in range(STEPS):
            opt.zero_grad()
            scaler.scale(model(batch(t, rank)).sum()).backward()
            if t == 1 and rank == 1:
                next(model.parameters()).grad.to_local()[0, 0] = float("inf")
            grads.append(full(p.grad for p in model.parameters()))
            before = full(model.parameters())
            scaler.step(opt)
            scaler.update()
            after = full(model.parameters())
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
            scales.append(scaler.get_scale())
            params.append(after)
        out[case] = {"params": params, "scales": scales, "grads": grads, "unchanged": unchanged}
    return out


#: bf16 params with 8-bit state (the first layer's 8192-element weight: 4096 rows-worth per
#: rank, whole 256-blocks) and a split master; stochastic rounding with bf16 state. (An fp32
#: master on bf16 shards: test_mixed_precision_under_fsdp2_both_ways.)
MODE_SIZES = (64, 128, 3)
MODE_CONFIGS = {
    "split-uint8": {"master": "split", "state_dtype": torch.uint8},
    "none-bf16": {"master": "none", "state_dtype": torch.bfloat16, "seed": 5},
}


def _scenario_modes(rank, world):
    mesh, out = _mesh(world), {}
    for config, modes in MODE_CONFIGS.items():
        model = shard(make_model(torch.bfloat16, MODE_SIZES), mesh)
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **modes)
        grads, _ = _train(model, opt, rank, dtype=torch.bfloat16, width=MODE_SIZES[0])
        out[config] = {"grads": grads, "params": full(model.parameters()), "memory": opt.memory_report()}
    return out


def _scenario_errors(rank, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, out = _mesh(world), {}
    model = shard(make_model(), mesh)
    dparams = list(model.parameters())
    plain = torch.nn.Parameter(torch.ones(3))

    def attempt(key, build):
        before = full(dparams)
        try:
            build()
        except ValueError as e:
            out[key] = str(e)
        out[key + "_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, full(dparams), strict=True))

    attempt("mixed", lambda: FusedAdamW([dparams[0], plain]))
    replicated = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Replicate()]))
    attempt("placement", lambda: FusedAdamW([replicated]))
    from torch.distributed.device_mesh import init_device_mesh

    mesh2 = init_device_mesh("cpu", (1, world))
    # HSDP's (Replicate(), Shard(0)) is taken (tests/test_fsdp_hsdp.py); a tensor-parallel layout is not
    two_d = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh2, [Replicate(), Shard(1)]))
    attempt("mesh_2d", lambda: FusedAdamW([two_d]))
    attempt("zero2", lambda: DistributedFusedAdamW([dparams[0]]))
    # a rejected second group leaves the optimizer as it was
    opt = FusedAdamW([plain])
    attempt("added", lambda: opt.add_param_group({"params": [dparams[0], torch.nn.Parameter(torch.ones(2))]}))
    out["groups_after"] = len(opt.param_groups)
    # plain and DTensor params in separate groups work together
    extra = torch.nn.Parameter(torch.ones(3))
    both = FusedSGD([{"params": dparams}, {"params": [extra]}], lr=0.5)
    (model(batch(0, rank)).sum() + extra.sum() * (rank + 1)).backward()
    grads = full(p.grad for p in dparams) + [extra.grad.clone()]
    both.step()
    out["groups"] = {"grads": grads, "params": full(dparams) + [extra.detach().clone()]}
    return out


def _scenario_dcp(rank, world, out_dir):
    """tkern owns the mixed precision (bf16 params, fp32 master): 2 steps, a DCP checkpoint
    of model and optimizer, 2 more steps; then a fresh model and optimizer (params zeroed,
    state zero) load the checkpoint and take the same 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    mesh, ckpt = _mesh(world), os.path.join(out_dir, "ckpt")
    model = shard(make_model(torch.bfloat16), mesh)
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, rank, steps=2, dtype=torch.bfloat16)
    osd = get_optimizer_state_dict(model, opt)
    entries = {f"{k}.{n}": type(v).__name__ for k, e in osd["state"].items() for n, v in e.items()}
    dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=ckpt)
    grads, _ = _train(model, opt, rank, steps=2, dtype=torch.bfloat16, start=2)
    straight = full(model.parameters())

    fresh = shard(make_model(torch.bfloat16), mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = FusedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    _train(fresh, fresh_opt, rank, steps=2, dtype=torch.bfloat16, start=2)
    master = [
        e["master"].full_tensor() if isinstance(e["master"], DTensor) else e["master"]
        for e in fresh_opt.state_dict()["state"].values()
    ]
    return {
        "entries": entries,
        "grads": grads,
        "straight": straight,
        "resumed": full(fresh.parameters()),
        "master": master,
        "ckpt": ckpt,
    }


def _scenario_precision(rank, world):
    """Mixed precision under FSDP2 with tkern's layers (GEMMs through the interpreter), both
    ways: (a) tkern owns it: convert_network to bf16, then fully_shard, FusedAdamW keeps the
    fp32 master of the bf16 shards; (b) FSDP2 owns it: keep_fp32_params=True, then fully_shard
    with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), FusedAdamW steps the fp32
    shards as their own master."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh, out = _mesh(world), {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for way, keep, kw in (("tkern", False, {}), ("fsdp", True, {"mp_policy": policy})):
        model = shard(tkern.convert_network(make_model(), torch.bfloat16, keep_fp32_params=keep), mesh, **kw)
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        grads, _ = _train(model, opt, rank, steps=2)
        out[way] = {
            "layers": [isinstance(m, tkern.nn.Linear) for m in model],
            "out_dtype": model(batch(0, rank)).dtype,
            "grads": grads,
            "params": full(model.parameters()),
            "memory": opt.memory_report(),
        }
    return out


SCENARIOS = {
    "equivalence": _scenario_equivalence,
    "skip": _scenario_skip,
    "modes": _scenario_modes,
    "errors": _scenario_errors,
    "dcp": _scenario_dcp,
    "precision": _scenario_precision,
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(
        "test_fsdp", 2, list(SCENARIOS), tmp_path_factory.mktemp("fsdp2"), timeout_s=TIMEOUT_S
    )


def _assert_params(got, want, exact: bool) -> None:
    for i, (have, ref) in enumerate(zip(got, want, strict=True)):
        if exact:
            assert torch.equal(have, ref), i
        else:
            torch.testing.assert_close(have, ref, atol=1e-6, rtol=0)


def test_the_shards_are_uneven_and_one_is_empty(world2):
    r0, r1 = (res[("adamw", "noclip")]["local"] for res in result(world2, "equivalence"))
    assert [tuple(s) for s in r0] == [(3, 8), (3,), (1, 5), (1,)]
    assert [tuple(s) for s in r1] == [(2, 8), (2,), (0, 5), (0,)]


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_sharded_step_matches_one_process_fed_the_gathered_gradients(world2, config):
    ranks = result(world2, "equivalence")
    name, clip = config
    grads = ranks[0][config]["grads"]
    for res in ranks[1:]:  # FSDP2 gave every rank the same (averaged) gradient
        assert all(torch.equal(a, b) for s, o in zip(grads, res[config]["grads"], strict=True)
                   for a, b in zip(s, o, strict=True))  # fmt: skip
    ref_params, _ = reference(name, CLIP[clip], grads)
    for res in ranks:
        _assert_params(res[config]["params"], ref_params, exact=CLIP[clip] is None)


def test_clipping_uses_the_global_norm_of_the_dtensor_gradients(world2):
    # torch's clip_grad_norm_ over the DTensor grads and tkern's statistics agree up to the
    # order of the fp32 sums (a few ulps); every rank sees the same norm
    for res in result(world2, "equivalence"):
        for torch_norm, tkern_norm in res[("adamw", "clip")]["norms"]:
            assert tkern_norm == pytest.approx(torch_norm, rel=1e-6)
            assert tkern_norm > 0.5  # so every step clipped
    norms = [res[("adamw", "clip")]["norms"] for res in result(world2, "equivalence")]
    assert norms[0] == norms[1]


@pytest.mark.parametrize("case", ["tkern", "grad_scaler", "torch_opt"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(world2, case):
    ranks = result(world2, "skip")
    for res in ranks:
        r = res[case]
        assert r["unchanged"] == [False, True, False]
        # a backoff at the skipped step, growth after each clean one (growth_interval=1)
        assert r["scales"] == [2 * SCALE, SCALE, 2 * SCALE]
    a, b = (res[case]["params"] for res in ranks)
    assert all(torch.equal(x, y) for s, o in zip(a, b, strict=True) for x, y in zip(s, o, strict=True))
    if case != "torch_opt":  # the fused step: as one process fed the same gradients (scaled by S)
        grads = ranks[0][case]["grads"]
        params = [p.detach().clone().requires_grad_() for p in make_model().parameters()]
        opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
        for t, scale in ((0, SCALE), (2, SCALE)):
            for p, g in zip(params, grads[t], strict=True):
                p.grad.copy_(g)
            opt.step(inv_scale=torch.tensor([1 / scale]))
        _assert_params(ranks[0][case]["params"][-1], [p.detach() for p in params], exact=True)


@pytest.mark.parametrize("config", list(MODE_CONFIGS))
def test_memory_modes_on_shards(world2, config):
    """The 8-bit blocks of 256 lie within each local shard; the first weight's shards are
    whole blocks that start where the one-process buffer's do, so a split master with
    8-bit moments matches one process bit for bit. Stochastic rounding draws per position in
    the flat buffer, which differs between a shard and the whole: within a bf16 ulp there."""
    ranks = result(world2, "modes")
    grads = ranks[0][config]["grads"]
    modes = dict(MODE_CONFIGS[config])
    model = {"dtype": torch.bfloat16, "sizes": MODE_SIZES}
    ref_params, ref_opt = reference("adamw", None, grads, model=model, **modes)
    single = ref_opt.memory_report()
    for res in ranks:
        got = res[config]["params"]
        if config == "none-bf16":
            # each step rounds the same fp32 value to one of its two bf16 neighbours, perhaps the
            # other one: at most a bf16 ulp apart per step, 3 steps; |params| < 2^-2 (an init bound
            # of 1/8 plus 3 steps of lr 1e-2), where an ulp is at most 2^-10
            for have, want in zip(got, ref_params, strict=True):
                assert want.abs().max() < 0.25
                torch.testing.assert_close(have.float(), want.float(), atol=3 * 2.0**-10, rtol=0)
        else:
            _assert_params(got, ref_params, exact=True)
        memory = res[config]["memory"]
        # each rank holds about half the master and state (64 + 2 rows of 128 + 3)
        assert single["state"] * 0.45 < memory["state"] < single["state"] * 0.6
        assert memory["master"] <= single["master"] * 0.6


def test_mixing_dtensor_and_plain_params_in_a_group_and_other_layouts_raise(world2):
    for res in result(world2, "errors"):
        assert "mixes DTensor params" in res["mixed"] and "separate param groups" in res["mixed"]
        assert "Replicate" in res["placement"] and "Shard(dim=0)" in res["placement"]
        assert "2-D device mesh" in res["mesh_2d"]
        assert "ZeRO-2 optimizers shard plain params" in res["zero2"]
        assert "mixes DTensor params" in res["added"] and res["groups_after"] == 1
        for key in ("mixed", "placement", "mesh_2d", "zero2", "added"):
            assert res[key + "_unchanged"], key


def test_plain_and_dtensor_param_groups_step_together(world2):
    # the plain param's gradient is each rank's own (FSDP2 does not touch it): each rank steps
    # it alone, the DTensor params on the gathered gradient (one process fed rank 0's view)
    ranks = result(world2, "errors")
    params = [p.detach().clone().requires_grad_() for p in make_model().parameters()]
    params.append(torch.ones(3, requires_grad=True))
    opt = FusedSGD([{"params": params[:-1]}, {"params": params[-1:]}], lr=0.5)
    for p, g in zip(params, ranks[0]["groups"]["grads"], strict=True):
        p.grad.copy_(g)
    opt.step()
    _assert_params(ranks[0]["groups"]["params"], [p.detach() for p in params], exact=True)
    assert torch.equal(ranks[1]["groups"]["params"][-1], torch.full((3,), 1 - 0.5 * 2))


def test_state_dict_entries_of_dtensor_params_are_dtensors(world2):
    for res in result(world2, "dcp"):
        for key, kind in res["entries"].items():
            assert kind == ("Tensor" if key.endswith(".step") else "DTensor"), key
        assert any(k.endswith(".master") for k in res["entries"])  # bf16 params: the fp32 master travels


def test_dcp_resume_continues_bit_for_bit(world2):
    for res in result(world2, "dcp"):
        _assert_params(res["resumed"], res["straight"], exact=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # loading in one process
def test_a_dcp_checkpoint_written_on_2_ranks_loads_in_one_process(world2):
    """One process (no process group, plain params) loads the 2-rank checkpoint and takes the
    2 steps the ranks took after saving, fed their gathered gradients: the same params, bit
    for bit (no clipping: the update is elementwise)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    res = result(world2, "dcp")[0]
    model = make_model(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=res["ckpt"])
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    assert all(float(e["step"]) == 2 for e in opt.state_dict()["state"].values())
    inv = torch.tensor([1 / SCALE])
    for step_grads in res["grads"]:
        for p, g in zip(model.parameters(), step_grads, strict=True):
            p.grad.copy_(g)
        opt.step(inv_scale=inv)
    _assert_params([p.detach() for p in model.parameters()], res["straight"], exact=True)
    for have, want in zip(opt.state_dict()["state"].values(), res["master"], strict=True):
        assert torch.equal(have["master"], want)


@pytest.mark.parametrize("way", ["tkern", "fsdp"])
def test_mixed_precision_under_fsdp2_both_ways(world2, way):
    """Both ways compute tkern's GEMMs in bf16 and step as one process fed the gathered
    gradients, bit for bit: (a) bf16 params with an fp32 master (fp32 master + moments: 12 B per
    element of the shard), (b) fp32 params that are their own master (no master bytes)."""
    ranks = result(world2, "precision")
    grads = ranks[0][way]["grads"]
    model = tkern.convert_network(make_model(), torch.bfloat16, keep_fp32_params=way == "fsdp")
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    assert {p.dtype for p in params} == {torch.bfloat16 if way == "tkern" else torch.float32}
    assert {g.dtype for step in grads for g in step} == {params[0].dtype}  # (b): reduced in fp32
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad.copy_(g)
        opt.step(inv_scale=torch.tensor([1 / SCALE]))
    for res in ranks:
        r = res[way]
        assert r["layers"] == [True, True] and r["out_dtype"] == torch.bfloat16
        _assert_params(r["params"], [p.detach() for p in params], exact=True)
        assert (r["memory"]["master"] > 0) == (way == "tkern")
