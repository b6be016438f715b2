"""Loss scalers keep torch.amp.GradScaler's contracts (issue 9): refused arguments and
states, errors before anything changes, disabled scalers, nested outputs, sparse
gradients; and across ranks they agree only through a process group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE
from scaler_drive import fused_setup, run_fused

import tkern
from tkern.kernels import scale as K
from tkern.optim import FusedSGD
from tkern.optim.distributed import run_local_processes

# ----------------------------------------------------------------------- GradScaler's contracts (issue 9)


@pytest.mark.parametrize(
    "make",
    [
        lambda: tkern.DynamicLossScaler(init_scale=1.0, min_scale=1e-40),  # fp32 subnormal: 1/x = inf
        lambda: tkern.DynamicLossScaler(init_scale=1.0, min_scale=1e-50),  # rounds to 0 in fp32
        lambda: tkern.LogNormalLossScaler(scale_min=1e-45),
    ],
)
def test_min_scale_whose_fp32_reciprocal_is_not_finite_is_refused(make):
    with pytest.raises(ValueError, match="reciprocal .* is not finite in float32"):
        make()


def test_smallest_normal_min_scale_is_accepted():
    scaler = tkern.DynamicLossScaler(init_scale=1.0, min_scale=2.0**-126)
    assert scaler.min_scale == 2.0**-126


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: tkern.StaticLossScaler(1e39), "scale"),
        (lambda: tkern.DynamicLossScaler(init_scale=1e39, max_scale=1e39), "init_scale"),
    ],
)
def test_scale_whose_fp32_value_overflows_is_refused(make, name):
    with pytest.raises(ValueError, match=rf"^{name}=1e\+39 overflows float32"):
        make()


def _param_and_optimizer(kind):
    """Four zeros and an SGD over them: tkern's fused one (fp16), or torch's (its fallback path)."""
    if kind == "fused":
        return fused_setup()
    p = torch.zeros(4, device=DEVICE, requires_grad=True)
    return p, torch.optim.SGD([p], lr=0.1)


@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_step_without_scale_is_an_error(kind):
    p, opt = _param_and_optimizer(kind)
    scaler = tkern.DynamicLossScaler()
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"without scale\(loss\) first"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"without scale\(loss\) first"):
        scaler.unscale_(opt)
    assert torch.equal(p.detach(), torch.zeros_like(p))
    # a loaded state is not a scale(loss) either (as GradScaler's, whose scale is created lazily)
    other = tkern.DynamicLossScaler()
    other.load_state_dict(run_and_save())
    with pytest.raises(RuntimeError, match=r"without scale\(loss\) first"):
        other.step(opt)
    scaler.scale(p.float().sum())
    scaler.step(opt)
    scaler.update()


def run_and_save():
    scaler = tkern.DynamicLossScaler()
    run_fused(scaler, [0, 1])
    return scaler.state_dict()


def test_step_with_a_closure_is_an_error_as_grad_scaler():
    p, opt = fused_setup()
    scaler = tkern.DynamicLossScaler()
    scaler.scale(p.float().sum()).backward()
    before = p.detach().clone()

    def closure():
        return p.float().sum()

    for call in (lambda: scaler.step(opt, closure), lambda: scaler.step(opt, closure=closure)):
        with pytest.raises(RuntimeError, match="Closure use is not supported"):
            call()
    assert torch.equal(p.detach(), before)
    gs = torch.amp.GradScaler("cpu")
    q = torch.zeros(2, requires_grad=True)
    gs.scale(q.sum()).backward()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        gs.step(torch.optim.SGD([q], lr=0.1), closure=lambda: q.sum())


def test_step_none_names_the_argument():
    scaler = tkern.DynamicLossScaler()
    scaler.scale(torch.tensor(1.0, device=DEVICE))
    with pytest.raises(TypeError, match=r"step\(\): optimizer must be a torch.optim.Optimizer, got NoneType"):
        scaler.step(None)


@pytest.mark.parametrize("cls", [tkern.StaticLossScaler, tkern.DynamicLossScaler, tkern.LogNormalLossScaler])
def test_disabled_scaler_is_a_no_op_as_grad_scalers(cls):
    def train(scaler, opt_cls):
        torch.manual_seed(0)
        q = torch.randn(4, requires_grad=True)
        opt = opt_cls([q], lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            loss = (q * q).sum()
            out = scaler.scale(loss)
            assert out is loss
            out.backward()
            scaler.step(opt, closure=lambda: (q * q).sum().detach())  # a closure is fine when disabled
            scaler.update()
        return q.detach()

    mine, theirs = cls(enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    assert torch.equal(train(mine, torch.optim.SGD), train(theirs, torch.optim.SGD))
    assert not mine.is_enabled() and mine.get_scale() == theirs.get_scale() == 1.0
    assert mine.state_dict() == theirs.state_dict() == {}
    assert mine.skipped_steps == 0 and mine.found_inf is None
    mine.load_state_dict(cls().state_dict())  # ignored, as GradScaler
    assert mine.state_dict() == {}
    # a fused optimizer steps unscaled
    p, opt = fused_setup()
    p.grad.fill_(1.0)
    scaler = cls(enabled=False)
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(opt.state[p]["master"], torch.full((4,), -0.1, device=DEVICE))


def test_enabled_scaler_refuses_an_empty_state_dict():
    with pytest.raises(RuntimeError, match="state dict is empty"):
        tkern.DynamicLossScaler().load_state_dict({})


def test_scale_of_nested_tuples_lists_and_dicts():
    Pair = __import__("collections").namedtuple("Pair", "a b")
    a, b, c, d = (torch.tensor(v, device=DEVICE) for v in (1.5, -2.0, 0.25, 3.0))
    scaler = tkern.StaticLossScaler(2.0**10)
    out = scaler.scale({"x": a, "y": [b, (c, Pair(d, a))]})
    assert isinstance(out, dict) and isinstance(out["y"], list) and isinstance(out["y"][1][1], Pair)
    flat = [out["x"], out["y"][0], out["y"][1][0], out["y"][1][1].a, out["y"][1][1].b]
    assert [t.item() for t in flat] == [v * 2.0**10 for v in (1.5, -2.0, 0.25, 3.0, 1.5)]
    # lists and tuples as GradScaler returns them
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref = gs.scale([a.cpu(), (b.cpu(), c.cpu())])
    mine = scaler.scale([a, (b, c)])
    assert type(mine) is type(ref) and type(mine[1]) is type(ref[1])
    assert [mine[0].item(), *(t.item() for t in mine[1])] == [ref[0].item(), *(t.item() for t in ref[1])]
    with pytest.raises(TypeError, match="got a str"):
        scaler.scale([a, "loss"])


@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_found_inf_and_grad_stats_describe_the_last_step_after_update(kind):
    p, opt = _param_and_optimizer(kind)
    scaler = tkern.DynamicLossScaler(init_scale=4.0)
    for g, found in ((2.0, 0.0), (float("inf"), 1.0), (8.0, 0.0)):
        scaler.scale(p.float().sum())
        p.grad = torch.full_like(p, g)
        scaler.step(opt)
        scaler.update()
        assert scaler.found_inf.item() == found
        if not found:
            s = 4.0 if g == 2.0 else 2.0  # the scale that step used (backed off after the overflow)
            assert scaler.grad_stats.tolist() == [0.0, 4 * (g / s) ** 2, g / s]


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        ("growth_interval", -3, "growth_interval must be a positive int"),
        ("min_scale", float("nan"), "min_scale must be a finite number > 0"),
        ("hysteresis", 0, "hysteresis must be a positive int"),
        ("backoff_factor", 2.0, "backoff_factor"),
        ("max_scale", 1e39, "max_scale=1e\\+39 overflows float32"),
        ("updates", -1, "updates must be an int >= 0"),
        ("state", torch.zeros(3), "state has shape"),
        ("state", torch.full((K.STATE_SIZE,), float("inf")), "scale in state must be finite"),
        ("class", "StaticLossScaler", "state dict is for a StaticLossScaler"),
    ],
)
def test_load_state_dict_validates_before_changing_anything(key, value, pattern):
    p, opt = fused_setup()
    scaler = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    run = [0, 1, 0, 0, 0]
    for bad in run:
        scaler.scale(p.float().sum())
        p.grad.fill_(float("inf") if bad else 1.0)
        scaler.step(opt)
        scaler.update()
    before = scaler.state_dict()
    bad_sd = {**before, key: value}
    with pytest.raises(ValueError, match=pattern):
        scaler.load_state_dict(bad_sd)
    after = scaler.state_dict()
    assert {k: v for k, v in after.items() if k != "state"} == {
        k: v for k, v in before.items() if k != "state"
    }
    assert torch.equal(after["state"], before["state"])
    # and it still trains on from where it was
    scaler.scale(p.float().sum())
    scaler.step(opt)
    scaler.update()


def test_load_state_dict_puts_the_state_on_the_device_of_first_use():
    # a checkpoint's state is saved on the CPU; a fresh scaler takes it to the loss's device
    full = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    run_fused(full, [0, 0, 1])
    resumed = tkern.DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    resumed.load_state_dict(full.state_dict())
    assert resumed.get_scale() == full.get_scale()
    assert run_fused(resumed, [0, 0]) == run_fused(full, [0, 0])
    assert resumed.state.device == full.state.device


def test_sparse_gradients_in_the_fallback_path_match_grad_scaler():
    def train(scaler, device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True).to(device)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        idx = torch.tensor([1, 4, 4, 7, 1], device=device)  # repeats: an uncoalesced gradient
        for step in range(4):
            opt.zero_grad()
            scaler.scale((emb(idx) * torch.arange(3.0, device=device)).sum()).backward()
            if step == 1:
                g = emb.weight.grad
                emb.weight.grad = torch.sparse_coo_tensor(
                    g._indices(),
                    g._values().index_fill(1, torch.tensor([2], device=device), float("inf")),
                    g.shape,
                    check_invariants=True,
                )
            scaler.step(opt)
            scaler.update()
        return emb.weight.detach().cpu(), scaler

    mine, scaler = train(tkern.DynamicLossScaler(init_scale=2.0**8, growth_interval=100), DEVICE)
    theirs, gs = train(torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=100), "cpu")
    assert torch.equal(mine, theirs)  # S is a power of 2: unscaling is exact in either order
    assert scaler.get_scale() == gs.get_scale() == 2.0**7 and scaler.skipped_steps == 1
    # the statistics are those of the coalesced gradient: rows 1 and 4 hold
    # 2 * [0, 1, 2] (each index twice), row 7 holds [0, 1, 2]
    assert scaler.grad_stats.tolist() == [0.0, 2 * (4 + 16) + (1 + 4), 4.0]


def test_fused_step_leaves_the_gradients_scaled():
    # documented: tkern's optimizer unscales inside its kernel and never writes .grad
    p, opt = fused_setup()
    scaler = tkern.StaticLossScaler(2.0**6)
    scaler.scale((p.float() * 0.5).sum()).backward()
    scaler.step(opt)
    assert torch.equal(p.grad, torch.full_like(p.grad, 0.5 * 2.0**6))
    assert "still hold the scaled gradients" in " ".join(tkern.amp.__doc__.split())


# ----------------------------------------------------------------------- multi-process


def _rank_main(rank, world, out_dir):
    """One rank; the process group is set up and torn down by run_local_processes."""
    results = {}
    world = dist.group.WORLD
    for mode, group in (("default", None), ("group", world), ("fused", world)):
        p = torch.ones(5, device=DEVICE, requires_grad=True)
        if mode == "fused":  # tkern's optimizer decides the skip: it opts in too
            p = torch.ones(5, device=DEVICE, dtype=torch.float16, requires_grad=True)
            opt = FusedSGD([p], lr=0.1, process_group=world)
        else:  # a plain torch optimizer: the scaler decides the skip (its fallback path)
            opt = torch.optim.SGD([p], lr=0.1)
        scaler = tkern.DynamicLossScaler(init_scale=2.0**8, growth_interval=2, process_group=group)
        scales, skipped = [], []
        for step in range(6):
            scaler.scale(p.sum())
            p.grad = torch.ones_like(p)
            if step == 2 and rank == 0:
                p.grad[3] = float("inf")  # only rank 0 overflows
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skipped.append(scaler.skipped_steps)
        results[mode] = {"scales": scales, "skipped": skipped, "param": p.detach().cpu().clone()}
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_communicate_only_with_a_process_group(tmp_path):
    """Without process_group a scaler is rank-local (no collective that could
    hang a rank-local optimizer); with one, every rank skips the same steps."""
    run_local_processes(_rank_main, 2, (str(tmp_path),), timeout_s=240)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    shared = [256.0, 512.0, 256.0, 256.0, 512.0, 512.0]
    g0, g1 = r0["group"], r1["group"]
    assert g0["scales"] == g1["scales"] == shared
    assert g0["skipped"] == g1["skipped"] == [0, 0, 1, 1, 1, 1]
    assert torch.equal(g0["param"], g1["param"])
    f0, f1 = r0["fused"], r1["fused"]  # tkern's fused optimizer with process_group: the same agreement
    assert f0["scales"] == f1["scales"] == shared and f0["skipped"] == f1["skipped"] == [0, 0, 1, 1, 1, 1]
    assert torch.equal(f0["param"], f1["param"])
    d0, d1 = r0["default"], r1["default"]
    assert d0["scales"] == shared and d0["skipped"] == [0, 0, 1, 1, 1, 1]
    assert d1["scales"] == [256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0] and d1["skipped"] == [0] * 6
