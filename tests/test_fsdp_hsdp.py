"""tkern's fused optimizers under HSDP (``fully_shard`` on a 2 x 2 (replicate, shard) mesh)
and under an int ``reshard_after_forward``, on 4 gloo ranks.

Rank r sits at (r // 2, r % 2) of the mesh: ranks 0 and 2 hold the rows of shard 0, ranks 1
and 3 those of shard 1. The model is test_fsdp's Linear(8, 5) -> Linear(5, 1): over the
shard dim's 2 ranks its shards are 3 and 2 rows, and the second layer's are empty on shard 1.
Each rank feeds its own batch; FSDP2 reduce-scatters the gradients over the shard dim and
all-reduces them over the replicate dim, so every rank's gathered gradient is the mean over
the 4 ranks. One spawn runs every scenario; the tests check what the ranks saved against:

* one process stepping the same tkern optimizer on the full params fed the gathered
  gradients (the sharding must not change the step: bit for bit without clipping; with
  clipping the sum of squares is added in another order, per shard then across the shard
  dim, so the clip factor may differ in its last bit and params agree within 1e-6);
* plain torch in one process: ``torch.optim.AdamW`` with ``clip_grad_norm_`` on the mean
  loss of the 4 ranks' batches (the same gradient up to fp32 roundoff in backward and in
  FSDP2's collectives, ~1e-7 relative; 3 steps of lr 1e-2: params within 1e-6);
* torch's ``clip_grad_norm_`` over the DTensor gradients, for the norm tkern clips by.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from scenarios import result, run_scenarios
from test_fsdp import SCALE, STEPS, _assert_params, _train, batch, full, make_model, reference, shard
from test_fsdp_alias import _pointers

import tkern
import tkern.amp.unscale
from tkern.optim import FusedAdamW, FusedSGD

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD = 4
CLIP = 0.5  # the gradients' norm is ~2-4: every step clips
TIMEOUT_S = 300


def _mesh2d():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _state(opt) -> list[dict[str, torch.Tensor]]:
    """The optimizer's state, each entry whole (DTensors gathered: a collective), copied."""
    from torch.distributed.tensor import DTensor

    return [
        {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in e.items()}
        for e in opt.state_dict()["state"].values()
    ]


# ----------------------------------------------------------------------- the ranks' side


def _scenario_train(rank, world):
    """FusedAdamW with clipping, 3 steps on the HSDP mesh; the aliasing of FSDP2's storage."""
    mesh = _mesh2d()
    model = shard(make_model(), mesh)
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    grads, norms = _train(model, opt, rank)
    return {
        "coordinate": list(mesh.get_coordinate()),
        "placements": [tuple(map(repr, p.placements)) for p in model.parameters()],
        "local": [tuple(p.to_local().shape) for p in model.parameters()],
        "grads": grads,
        "norms": norms,
        "params": full(model.parameters()),
        "ptrs": _pointers(model, opt),
        "memory": opt.memory_report(),
    }


def _scenario_skip(rank, world):
    """Ranks seeded differently; an inf at step 1 in rank 3's gradient only (replica 1, shard 1):
    (a) in a shard, FusedAdamW with tkern's scaler; (b) the same with torch.amp.GradScaler;
    (c) in a shard, torch.optim.AdamW with tkern's scaler (its unscale-and-check path); (d) in
    a plain param beside the HSDP ones (each rank's own gradient), FusedSGD."""
    mesh, out = _mesh2d(), {}
    for case in ("tkern", "grad_scaler", "torch_opt", "plain"):
        model = shard(make_model(), mesh)
        torch.manual_seed(100 + rank)  # the default seed of stochastic rounding differs per rank
        extra = torch.nn.Parameter(torch.ones(3))
        if case == "torch_opt":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        elif case == "plain":
            opt = FusedSGD([{"params": list(model.parameters())}, {"params": [extra]}], lr=0.5)
        else:
            opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if case == "grad_scaler":
            scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
        else:
            scaler = tkern.DynamicLossScaler(init_scale=SCALE, growth_interval=1)
        params, scales, grads, unchanged = [], [], [], []
        for t in range(STEPS):
            opt.zero_grad()
            scaler.scale(model(batch(t, rank)).sum() + extra.sum()).backward()
            if t == 1 and rank == 3:
                if case == "plain":
                    extra.grad[0] = float("inf")
                else:
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
        if case != "torch_opt":
            out[case]["seed"] = opt.seed
    return out


def _scenario_dcp(rank, world, out_dir):
    """bf16 params with tkern's fp32 master: 2 steps, a DCP checkpoint, 2 more steps; a fresh
    model and optimizer (params zeroed) load it and take the same 2 steps. Then a fresh HSDP
    optimizer loads one process's state_dict (whole tensors: each rank takes its rows)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mesh, ckpt = _mesh2d(), os.path.join(out_dir, "hsdp_ckpt")
    model = shard(make_model(torch.bfloat16), mesh)
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    grads, _ = _train(model, opt, rank, steps=2, dtype=torch.bfloat16)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=ckpt,
    )
    _train(model, opt, rank, steps=2, dtype=torch.bfloat16, start=2)
    straight = {"params": full(model.parameters()), "state": _state(opt)}

    fresh = shard(make_model(torch.bfloat16), mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = FusedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    _train(fresh, fresh_opt, rank, steps=2, dtype=torch.bfloat16, start=2)
    resumed = {"params": full(fresh.parameters()), "state": _state(fresh_opt)}

    # one process's optimizer on the whole params, fed the first 2 steps' gathered gradients
    single = [p.detach().clone().requires_grad_() for p in make_model(torch.bfloat16).parameters()]
    single_opt = FusedAdamW(single, lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    for step_grads in grads:
        for p, g in zip(single, step_grads, strict=True):
            p.grad.copy_(g)
        single_opt.step(inv_scale=torch.tensor([1 / SCALE]))
    loaded = shard(make_model(torch.bfloat16), mesh)
    loaded_opt = FusedAdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP)
    loaded_opt.load_state_dict(single_opt.state_dict())
    return {
        "straight": straight,
        "resumed": resumed,
        "single_state": _state(single_opt),
        "loaded_state": _state(loaded_opt),
    }


def _scenario_int_reshard(rank, world):
    """``reshard_after_forward=2`` on a 1-D mesh of 4: FSDP2 keeps a second sharded copy after
    forward, so the flat buffer holds a copy; training is unchanged."""
    from torch.distributed.device_mesh import init_device_mesh

    model = shard(make_model(), init_device_mesh("cpu", (world,)), reshard_after_forward=2)
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads, _ = _train(model, opt, rank)
    return {"grads": grads, "params": full(model.parameters()), "memory": opt.memory_report()}


def _scenario_errors(rank, world):
    """Other layouts on a 2-D mesh (tensor-parallel-like) raise before anything changes."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, out = _mesh2d(), {}
    model = shard(make_model(), mesh)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    before = full(model.parameters())
    layouts = {"replicate-shard1": [Replicate(), Shard(1)], "shard-shard": [Shard(0), Shard(1)]}
    for key, placements in layouts.items():
        tp = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, placements))
        for how, build in (
            ("new", lambda tp=tp: FusedAdamW([tp])),
            ("added", lambda tp=tp: opt.add_param_group({"params": [tp]})),
            ("scaler", lambda tp=tp: _unscale(tp)),
        ):
            try:
                build()
                out[key, how] = None
            except ValueError as e:
                out[key, how] = str(e)
    from torch.distributed.device_mesh import init_device_mesh

    mesh3 = init_device_mesh("cpu", (1, 2, 2))
    three_d = torch.nn.Parameter(
        distribute_tensor(torch.ones(4, 2), mesh3, [Replicate(), Replicate(), Shard(0)])
    )
    try:
        FusedAdamW([three_d])
        out["mesh_3d"] = None
    except ValueError as e:
        out["mesh_3d"] = str(e)
    out["groups_after"] = len(opt.param_groups)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, full(model.parameters()), strict=True))
    return out


def _unscale(p):
    """A loss scaler's own unscale path over ``p`` (given a gradient of its layout)."""
    p.grad = torch.ones_like(p)
    return tkern.amp.unscale.unscale_grads([p], torch.ones(1), p.device)


def _scenario_fp8_all_gather(rank, world):
    """fp8 all-gather under HSDP: the Float8Linear weights gathered in fp8 over the shard
    dim, the scale precomputed once per step over it; a bf16-all-gather twin beside."""
    from test_float8_fsdp import batch as fp8_batch
    from test_float8_fsdp import local
    from test_float8_fsdp import make_model as fp8_model
    from torch.distributed.fsdp import fully_shard

    import tkern.nn.float8_fsdp as f8fsdp

    mesh, out = _mesh2d(), {}
    for name in ("fp8", "bf16"):
        model = fp8_model(name == "fp8")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ys = []
        for t in range(2):
            opt.zero_grad()
            y = model(fp8_batch(t, rank))
            y.float().square().sum().backward()
            opt.step()
            if name == "fp8":
                out["precomputed"] = f8fsdp.precompute_float8_dynamic_scale_for_fsdp(model)
            ys.append(y.detach().clone())
        out[name] = {"ys": ys, "params": [local(p) for p in model.parameters()]}
    return out


def _scenario_underflow_warning(rank, world):
    """track_underflows on an optimizer of FSDP2 shards only: shards are not sampled."""
    import warnings

    model = shard(make_model(), _mesh2d())
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.track_underflows(every=5)
    return [str(w.message) for w in seen]


SCENARIOS = {
    "train": _scenario_train,
    "skip": _scenario_skip,
    "dcp": _scenario_dcp,
    "int_reshard": _scenario_int_reshard,
    "errors": _scenario_errors,
    "fp8_all_gather": _scenario_fp8_all_gather,
    "underflow_warning": _scenario_underflow_warning,
}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(
        "test_fsdp_hsdp", WORLD, list(SCENARIOS), tmp_path_factory.mktemp("hsdp"), timeout_s=TIMEOUT_S
    )


# ----------------------------------------------------------------------- the checks


def _torch_reference() -> list[torch.Tensor]:
    """Plain torch in one process: AdamW with clip_grad_norm_ on the mean loss of the 4 ranks' batches."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for t in range(STEPS):
        opt.zero_grad()
        (sum(model(batch(t, r)).sum() for r in range(WORLD)) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_hsdp_params_are_replicated_over_dim_0_and_sharded_over_dim_1(world4):
    ranks = result(world4, "train")
    for r, res in enumerate(ranks):
        assert res["coordinate"] == [r // 2, r % 2]
        assert res["placements"] == [("Replicate()", "Shard(dim=0)")] * 4
        # the shard dim's 2 ranks split the rows (3 and 2; 1 and 0): replicas hold the same rows
        want = [(3, 8), (3,), (1, 5), (1,)] if r % 2 == 0 else [(2, 8), (2,), (0, 5), (0,)]
        assert res["local"] == want


def test_hsdp_step_matches_one_process_and_plain_torch(world4):
    ranks = result(world4, "train")
    grads = ranks[0]["grads"]
    for res in ranks[1:]:  # FSDP2 gave every rank the same (averaged) gradient
        assert all(torch.equal(a, b) for s, o in zip(grads, res["grads"], strict=True)
                   for a, b in zip(s, o, strict=True))  # fmt: skip
    ref_params, _ = reference("adamw", CLIP, grads)
    plain = _torch_reference()
    for res in ranks:
        assert all(torch.equal(a, b) for a, b in zip(res["params"], ranks[0]["params"], strict=True))
        for have, want, other in zip(res["params"], ref_params, plain, strict=True):
            torch.testing.assert_close(have, want, atol=1e-6, rtol=0)
            torch.testing.assert_close(have, other, atol=1e-6, rtol=0)
        assert not torch.equal(res["params"][0], make_model()[0].weight.detach())  # it trained


def test_hsdp_clips_by_the_norm_clip_grad_norm_gives_over_the_dtensor_grads(world4):
    # the sum of squares over the shard dim only: over all 4 ranks it would be twice the true one
    ranks = result(world4, "train")
    for res in ranks:
        for torch_norm, tkern_norm in res["norms"]:
            assert tkern_norm == pytest.approx(torch_norm, rel=1e-6)
            assert tkern_norm > CLIP  # so every step clipped
        assert res["norms"] == ranks[0]["norms"]  # every rank clips by one norm


def test_hsdp_flat_buffer_is_fsdp2s_shard_storage(world4):
    for res in result(world4, "train"):
        assert res["memory"]["alias_fallback"] is None and res["memory"]["fsdp_storage"] == 0
        assert any(p is not None for p in res["ptrs"])
        for i, p in enumerate(res["ptrs"]):
            assert p is None or len(set(p)) == 1, (i, p)


def test_hsdp_memory_report_counts_the_shard_dim(world4):
    # world_size: the shard dim's size, what the bytes divide by; numel: this rank's shards
    for r, res in enumerate(result(world4, "train")):
        memory = res["memory"]
        assert memory["world_size"] == 2 and memory["rank"] == r % 2
        assert memory["numel"] == (3 * 8 + 3 + 5 + 1 if r % 2 == 0 else 2 * 8 + 2)


@pytest.mark.parametrize("case", ["tkern", "grad_scaler", "torch_opt", "plain"])
def test_an_inf_on_one_rank_skips_the_step_on_all_four(world4, case):
    ranks = result(world4, "skip")
    for rank, res in enumerate(ranks):
        r = res[case]
        assert r["unchanged"] == [False, True, False]
        # a backoff at the skipped step, growth after each clean one (growth_interval=1). torch's
        # GradScaler reduces its found_inf over the DTensor's non-Replicate dims only (it takes
        # replicas to be equal), so only the replica that saw the inf (ranks 2 and 3) backs off
        # there; tkern's scalers read the statistics agreed on over the whole mesh
        if case != "grad_scaler" or rank // 2 == 1:
            assert r["scales"] == [2 * SCALE, SCALE, 2 * SCALE]
    if case == "grad_scaler":  # (the replicas' scales then differ: so do their params after step 2)
        return
        if case != "torch_opt":
            assert r["seed"] == 100  # rank 0's, though each rank seeded torch with 100 + rank
    for res in ranks[1:]:
        for s, o in zip(res[case]["params"], ranks[0][case]["params"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(s, o, strict=True))
    if case == "tkern":  # as one process fed the clean steps' gradients (scaled by S)
        grads = ranks[0][case]["grads"]
        params = [p.detach().clone().requires_grad_() for p in make_model().parameters()]
        opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
        for t in (0, 2):
            for p, g in zip(params, grads[t], strict=True):
                p.grad.copy_(g)
            opt.step(inv_scale=torch.tensor([1 / SCALE]))
        _assert_params(ranks[0][case]["params"][-1], [p.detach() for p in params], exact=True)


def test_hsdp_dcp_resume_continues_bit_for_bit(world4):
    for res in result(world4, "dcp"):
        straight, resumed = res["straight"], res["resumed"]
        _assert_params(resumed["params"], straight["params"], exact=True)
        assert len(straight["state"]) == 4
        for a, b in zip(straight["state"], resumed["state"], strict=True):
            assert a.keys() == b.keys() and "master" in a
            for k in a:
                assert torch.equal(a[k], b[k]), k


def test_one_process_state_loads_into_hsdp_by_the_shard_coordinate(world4):
    # a whole tensor's rows by the shard dim's coordinate: the wrong rows would not gather back
    for res in result(world4, "dcp"):
        for a, b in zip(res["single_state"], res["loaded_state"], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), k


def test_int_reshard_after_forward_falls_back_to_the_copy_and_trains_alike(world4):
    ranks = result(world4, "int_reshard")
    grads = ranks[0]["grads"]
    ref_params, _ = reference("adamw", None, grads)
    for res in ranks:
        memory = res["memory"]
        assert "reshard_after_forward is an int" in memory["alias_fallback"]
        # FSDP2's copy: its padded shards (each padded to the first rank's rows, ceil(rows / 4))
        padded = sum(-(-p.shape[0] // 4) * p[0].numel() for p in make_model().parameters())
        assert memory["world_size"] == 4 and memory["fsdp_storage"] == 4 * padded >= 4 * memory["numel"]
        _assert_params(res["params"], ref_params, exact=True)


def test_tensor_parallel_layouts_on_a_2d_mesh_and_a_3d_mesh_still_raise(world4):
    for res in result(world4, "errors"):
        for layout in ("replicate-shard1", "shard-shard"):
            for how in ("new", "added", "scaler"):
                msg = res[layout, how]
                assert msg is not None and "2-D device mesh" in msg and "Replicate(), Shard(dim=0)" in msg
        assert "3-D device mesh" in res["mesh_3d"] and "HSDP's 2-D (replicate, shard) mesh" in res["mesh_3d"]
        assert res["groups_after"] == 1 and res["unchanged"]


def test_fp8_all_gather_under_hsdp_equals_the_bf16_all_gather(world4):
    """Float8Recipe(enable_fsdp_float8_all_gather=True) on the 2 x 2 mesh: outputs and
    params bit-identical to the bf16 all-gather's fp8 cast, every rank; the per-step
    precompute finds each weight's scale over the shard dim (a 2-D mesh's get_group()
    without a dim would raise)."""
    for r in result(world4, "fp8_all_gather"):
        assert r["precomputed"] == 3
        for a, b in zip(r["fp8"]["ys"], r["bf16"]["ys"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(r["fp8"]["params"], r["bf16"]["params"], strict=True):
            assert torch.equal(a, b)


def test_sampling_underflows_of_fsdp2_shards_only_warns_that_it_sees_nothing(world4):
    for messages in result(world4, "underflow_warning"):
        assert len(messages) == 1 and "every param of this optimizer is an FSDP2 shard" in messages[0]
