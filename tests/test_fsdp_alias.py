"""The flat buffers ARE FSDP2's shard storage (no copy), on 2 gloo ranks.

tkern points FSDP2's private ``FSDPParam._sharded_param_data`` and each DTensor's local
tensor into the flat buffer (:func:`tkern.optim.fsdp.fsdp_shard_storage`, the one seam).
These tests fail if a torch upgrade breaks that: the three pointers must agree after the
optimizer is built, after FSDP2's lazy init (first forward) and after steps, and training
must stay bit-identical to the copy path (the seam patched to refuse) on the model of
``test_fsdp`` (uneven 3/2-row shards, an empty one). A mode FSDP2 forbids aliasing in
(CPU offload) falls back to the copy and says why in ``memory_report``; an int
``reshard_after_forward`` other than 1 or W needs more than 2 ranks: tests/test_fsdp_hsdp.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from live_tensors import live_tensor_bytes
from scenarios import result, run_scenarios
from test_fsdp import _mesh, _train, batch, full, make_model, shard

import tkern.optim.fsdp as tfsdp
from tkern.optim import FusedAdamW

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _owners():
    """FSDP2's FSDPParam of each sharded param, by the param's id (private names: the seam's check)."""
    from torch.distributed._composable_state import _module_state_mapping

    owners = {}
    for ref in list(_module_state_mapping.values()):
        group = getattr(ref(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()):
            owners[id(fp.sharded_param)] = fp
    return owners


def _fsdp_storages(model):
    """Weak references to the storages FSDP2 made for the shards (its padded shards)."""
    owners = _owners()
    return [weakref.ref(owners[id(p)]._sharded_param_data.untyped_storage()) for p in model.parameters()]


def _alive(refs):
    gc.collect()
    return sum(r() is not None for r in refs)


def _pointers(model, opt):
    """Per param: (flat view, FSDP2's padded shard, DTensor local tensor) data_ptrs, or None
    where the local shard is empty. Reads FSDP2's private storage to check the seam."""
    owners = _owners()
    (flat,) = opt.flat_buffers[0]
    out = []
    for i, p in enumerate(model.parameters()):
        local = p._local_tensor
        if not local.numel():
            out.append(None)
            continue
        out.append(
            (flat.param_views[i].data_ptr(), owners[id(p)]._sharded_param_data.data_ptr(), local.data_ptr())
        )
    return out


def _run(rank, world, *, alias: bool, **policy):
    model = shard(make_model(), _mesh(world), **policy)
    seam = tfsdp.fsdp_shard_storage
    if not alias:
        tfsdp.fsdp_shard_storage = lambda params: "copy path forced by the test"
    fsdp_storages = _fsdp_storages(model)
    try:
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    finally:
        tfsdp.fsdp_shard_storage = seam
    ptrs, alive = [_pointers(model, opt)], [_alive(fsdp_storages)]
    grads, _ = _train(model, opt, rank, steps=1)  # the first forward runs FSDP2's lazy init
    ptrs.append(_pointers(model, opt))
    grads += _train(model, opt, rank, steps=2, start=1)[0]
    ptrs.append(_pointers(model, opt))
    alive.append(_alive(fsdp_storages))
    return {
        "ptrs": ptrs,
        "params": full(model.parameters()),
        "grads": grads,
        "memory": opt.memory_report(),
        "fsdp_storages_alive": alive,
        "n_params": len(fsdp_storages),
    }


def _scenario_alias(rank, world):
    return {"alias": _run(rank, world, alias=True), "copy": _run(rank, world, alias=False)}


def _scenario_offload(rank, world):
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = shard(make_model(), _mesh(world), offload_policy=CPUOffloadPolicy(pin_memory=False))
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, steps=1)
    out = {"offload": opt.memory_report()}
    # a DTensor that fully_shard did not make: no FSDP2 storage to share
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(torch.ones(3, 2), _mesh(world), [Shard(0)]))
    out["plain"] = FusedAdamW([p], lr=1e-2).memory_report()
    return out


LIVE_WIDTH = 256  # three Linear(256, 256): 197k params, beside which the inputs and stray tensors are <0.1%
#: case -> (tkern's optimizer or torch's, the params' dtype, FSDP2's bf16 mixed precision)
LIVE_CASES = {
    "torch AdamW, fp32 params": (False, torch.float32, False),
    "bf16 params, fp32 master": (True, torch.bfloat16, False),
    "keep_fp32_params, bf16 compute": (True, torch.float32, True),
}


def _scenario_live_bytes(rank, world):
    """Bytes per param of the model times W that the process holds in live tensors after two
    steps (the union of every live tensor's storage: FSDP2's included, whatever tkern's report
    says), for torch's AdamW on fp32 params (the reference) and tkern's AdamW both ways."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for case, (fused, dtype, mixed) in LIVE_CASES.items():
        gc.collect()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard(
            make_model(dtype, (LIVE_WIDTH,) * 4), _mesh(world), **({"mp_policy": policy} if mixed else {})
        )
        opt = (FusedAdamW if fused else torch.optim.AdamW)(model.parameters(), lr=1e-2)
        for step in range(2):
            opt.zero_grad()
            model(batch(step, rank, dtype, LIVE_WIDTH)).float().sum().backward()
            opt.step()
        numel = sum(p.numel() for p in model.parameters())
        out[case] = {
            "live": live_tensor_bytes() * world / numel,
            "report": opt.memory_report()["bytes_per_param"] if fused else None,
        }
        del model, opt
    return out


SCENARIOS = {"alias": _scenario_alias, "offload": _scenario_offload, "live_bytes": _scenario_live_bytes}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(
        "test_fsdp_alias", 2, list(SCENARIOS), tmp_path_factory.mktemp("alias"), timeout_s=300
    )


def test_flat_buffer_is_fsdp2s_shard_storage_after_lazy_init_and_steps(world2):
    for res in result(world2, "alias"):
        for when, ptrs in zip(("built", "lazy init", "steps"), res["alias"]["ptrs"], strict=True):
            for i, p in enumerate(ptrs):
                assert p is None or len(set(p)) == 1, (when, i, p)
        assert res["alias"]["memory"]["alias_fallback"] is None
        # the copy path's pointers differ: the check above can fail
        assert any(p is not None and p[0] != p[1] for p in res["copy"]["ptrs"][0])


def test_fsdp2s_own_shard_storage_is_freed_once_aliased(world2):
    for res in result(world2, "alias"):
        # built, and after lazy init and steps: none of FSDP2's padded shards is alive
        assert res["alias"]["fsdp_storages_alive"] == [0, 0]
        # the copy path keeps them all (the check can fail)
        n = res["copy"]["n_params"]
        assert res["copy"]["fsdp_storages_alive"] == [n, n] and n == 4


def test_live_tensor_bytes_under_fsdp2_match_torchs_adamw_and_the_report(world2):
    # every rank: the process's live tensors, per param of the model times W; torch's AdamW on
    # fp32 params holds 16 (shard 4, grad 4, moments 8); tkern's fp32 master on bf16 params
    # 2 + 2 + 4 + 8, and with keep_fp32_params the fp32 shards are the master: 4 + 4 + 8.
    # 0.5 B/param is 3% over 16: room for the inputs and stray tensors, not for a copy of the
    # shards (2 or 4 B/param)
    for res in result(world2, "live_bytes"):
        torch_bytes = res["torch AdamW, fp32 params"]["live"]
        assert 16.0 <= torch_bytes <= 16.5, res
        for case in list(LIVE_CASES)[1:]:
            live, report = res[case]["live"], res[case]["report"]
            assert live <= torch_bytes + 0.5 and live <= 16.5, (case, res)
            # memory_report counts what the process holds (tkern's buffers and FSDP2's storage)
            assert report == pytest.approx(live, abs=0.05), (case, res)


def test_aliased_training_is_bit_identical_to_the_copy_path(world2):
    for res in result(world2, "alias"):
        assert res["copy"]["memory"]["alias_fallback"] == "copy path forced by the test"
        for a, b in zip(res["alias"]["grads"], res["copy"]["grads"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(res["alias"]["params"], res["copy"]["params"], strict=True):
            assert torch.equal(a, b)
        assert not torch.equal(res["alias"]["params"][0], make_model()[0].weight.detach())  # it trained


def test_memory_report_under_fsdp2_counts_the_world_and_the_copy(world2):
    for res in result(world2, "alias"):
        alias, copy = res["alias"]["memory"], res["copy"]["memory"]
        assert alias["world_size"] == copy["world_size"] == 2
        # fp32 AdamW: shard 4 + grad 4 + moments 8 (and padding) against 4 more for the copy
        # FSDP2's copy: its padded shards (each padded to the first rank's rows, ceil(rows / 2))
        padded = sum(-(-p.shape[0] // 2) * p[0].numel() for p in make_model().parameters())
        assert alias["fsdp_storage"] == 0 and copy["fsdp_storage"] == 4 * padded >= 4 * copy["numel"]
        assert copy["total"] == copy["fsdp_storage"] + copy["param"] + copy["grad"] + copy["state"]


@pytest.mark.parametrize(("case", "why"), [("offload", "CPU"), ("plain", "not found")])
def test_modes_that_forbid_aliasing_fall_back_to_the_copy_and_say_why(world2, case, why):
    for res in result(world2, "offload"):
        assert why in res[case]["alias_fallback"]
        assert res[case]["fsdp_storage"] > 0
