"""Fused optimizers against torch.optim on fp32 copies fed the same unscaled
gradients.

Tolerance: the fp32 master must stay within 1e-6 relative (Frobenius) of
torch's fp32 params after 12 steps. Both compute in fp32; they differ only in
rounding order (tkern computes bias corrections as exp2(t log2 beta) in fp32
where torch uses float64 powers, and fused multiply-adds on the GPU), i.e. a
few fp32 ulps (6e-8 each) per step on updates that are themselves ~1e-3 of
the weights. The fp16/bf16 params must equal the master rounded to nearest,
exactly.
"""

from __future__ import annotations

import io

import pytest
import torch
from conftest import DEVICE, rel_err

import tkern
from tkern.optim import FusedAdam, FusedAdamW, FusedSGD

MASTER_TOL = 1e-6
STEPS = 12

CASES = {
    "sgd": (FusedSGD, torch.optim.SGD, dict(lr=0.05)),
    "sgd_wd": (FusedSGD, torch.optim.SGD, dict(lr=0.05, weight_decay=0.1)),
    "sgd_momentum": (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "sgd_dampening": (
        FusedSGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    ),
    "sgd_nesterov": (
        FusedSGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "adam": (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    "adam_wd": (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    "adam_amsgrad": (FusedAdam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, eps=1e-6)),
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    "adamw_amsgrad": (
        FusedAdamW,
        torch.optim.AdamW,
        dict(lr=1e-2, amsgrad=True, weight_decay=0.05),
    ),
}

SHAPES = [(31, 17), (64,), (5, 3, 7), (1,)]


def make_params(dtype, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(DEVICE, dtype).requires_grad_() for s in shapes]


def fp32_copies(params):
    return [p.detach().float().clone().requires_grad_() for p in params]


def random_grads(params, gen, scale=1.0):
    return [(torch.randn(p.shape, generator=gen) * scale).to(DEVICE, p.dtype) for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad.copy_(g)  # the optimizer's own view stays attached


def step_both(opt, ropt, params, ref, grads, scale=1.0):
    """Feed the same gradients to tkern's params (scaled by ``scale``) and,
    unscaled in fp32, to torch's fp32 copies; step both."""
    set_grads(params, [(g.float() * scale).to(g.dtype) for g in grads])
    for r, p in zip(ref, params, strict=True):
        r.grad = p.grad.float() / scale
    opt.step(inv_scale=None if scale == 1.0 else torch.full((1,), 1 / scale, device=DEVICE))
    ropt.step()


def master_of(opt, p):
    return opt.state[p].get("master", p)


def assert_params_match(opt, params, ref):
    for p, r in zip(params, ref, strict=True):
        master = master_of(opt, p)
        assert master.dtype == torch.float32
        assert rel_err(master, r) < MASTER_TOL
        assert torch.equal(p.detach(), master.to(p.dtype))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parity_with_torch(case, dtype):
    mine_cls, torch_cls, kwargs = CASES[case]
    params = make_params(dtype)
    ref = fp32_copies(params)
    opt, ropt = mine_cls(params, **kwargs), torch_cls(ref, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        grads = random_grads(params, gen)
        step_both(opt, ropt, params, ref, grads)
    assert_params_match(opt, params, ref)


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw"])
def test_param_groups_and_lr_scheduler(case):
    mine_cls, torch_cls, kwargs = CASES[case]
    params = make_params(torch.float16)
    ref = fp32_copies(params)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": kwargs["lr"] * 3, "weight_decay": 0.2}]

    opt, ropt = mine_cls(groups(params), **kwargs), torch_cls(groups(ref), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        grads = random_grads(params, gen)
        step_both(opt, ropt, params, ref, grads)
        sched.step()
        rsched.step()
    assert opt.param_groups[1]["lr"] == ropt.param_groups[1]["lr"] < kwargs["lr"] * 3
    assert_params_match(opt, params, ref)


def test_master_weights_keep_updates_fp16_would_lose():
    # 1 + 1e-4 == 1 in fp16 (spacing near 1 is 2^-10 ~ 9.8e-4): plain fp16 SGD
    # never moves the weight; the fp32 master accumulates 10 x 1e-4 = 1e-3,
    # which rounds to a different fp16 value.
    w = torch.ones(4, dtype=torch.float16, device=DEVICE, requires_grad=True)
    plain = w.detach().clone()
    opt = FusedSGD([w], lr=1e-4)
    for _ in range(10):
        w.grad.fill_(-1.0)
        opt.step()
        plain -= 1e-4 * torch.full_like(plain, -1.0)
    assert torch.equal(plain, torch.ones_like(plain))
    assert (opt.state[w]["master"] - 1.001).abs().max() < 1e-6
    assert torch.all(w > 1.0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("case", ["sgd_momentum", "adam_amsgrad"])
def test_overflow_skips_the_whole_step_bit_exactly(case, bad):
    mine_cls, _, kwargs = CASES[case]
    gen = torch.Generator().manual_seed(3)
    params_a, params_b = make_params(torch.float16), make_params(torch.float16)
    opt_a, opt_b = mine_cls(params_a, **kwargs), mine_cls(params_b, **kwargs)
    for step in range(6):
        grads = random_grads(params_a, gen)
        set_grads(params_a, grads)
        opt_a.step()
        if step == 3:  # b first sees a bad step at random positions, then the same good one
            bad_grads = [g.clone() for g in grads]
            for _ in range(3):
                t = int(torch.randint(len(bad_grads), (1,), generator=gen))
                flat = bad_grads[t].view(-1)
                flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = bad
            before = {k: v.clone() for k, v in opt_b.state_dict()["state"][0].items()}
            snapshot = [p.detach().clone() for p in params_b]
            set_grads(params_b, bad_grads)
            opt_b.step()
            assert opt_b.grad_stats[0].item() == 1.0
            for p, s in zip(params_b, snapshot, strict=True):
                assert torch.equal(p.detach(), s)
            for k, v in opt_b.state_dict()["state"][0].items():
                assert torch.equal(v, before[k]), k
        set_grads(params_b, grads)
        opt_b.step()
    for pa, pb in zip(params_a, params_b, strict=True):
        assert torch.equal(pa, pb)
        assert torch.equal(master_of(opt_a, pa), master_of(opt_b, pb))


def test_skipped_without_scaler_and_with_inv_scale():
    params = make_params(torch.float16)
    ref = fp32_copies(params)
    opt, ropt = FusedAdam(params, lr=1e-2), torch.optim.Adam(ref, lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        step_both(opt, ropt, params, ref, random_grads(params, gen, scale=1e-3), scale=1024.0)
    assert_params_match(opt, params, ref)


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw"])
def test_clipping_equals_clip_grad_norm(case):
    mine_cls, torch_cls, kwargs = CASES[case]
    params = make_params(torch.float16)
    ref = fp32_copies(params)
    opt = mine_cls(params, max_grad_norm=0.5, **kwargs)
    ropt = torch_cls(ref, **kwargs)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        grads = random_grads(params, gen)
        set_grads(params, grads)
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.float()
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        opt.step()
        ropt.step()
        assert abs(opt.grad_stats[1].sqrt().item() - norm.item()) < 1e-5 * norm.item()
    assert_params_match(opt, params, ref)


@pytest.mark.parametrize("case", ["sgd_nesterov", "adam_amsgrad"])
def test_state_dict_round_trip_is_bit_exact(case):
    mine_cls, _, kwargs = CASES[case]
    gen = torch.Generator().manual_seed(6)
    all_grads = [random_grads(make_params(torch.float16), gen) for _ in range(8)]
    params = make_params(torch.float16)
    opt = mine_cls(params, **kwargs)
    for grads in all_grads[:4]:
        set_grads(params, grads)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    for grads in all_grads[4:]:
        set_grads(params, grads)
        opt.step()

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = make_params(torch.float16, seed=99)  # different values, overwritten below
    with torch.no_grad():
        for p, v in zip(resumed, saved["model"], strict=True):
            p.copy_(v)
    opt2 = mine_cls(resumed, **kwargs)
    opt2.load_state_dict(saved["opt"])
    for grads in all_grads[4:]:
        set_grads(resumed, grads)
        opt2.step()
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(master_of(opt, p), master_of(opt2, q))
    assert torch.equal(opt.state[params[0]]["step"], opt2.state[resumed[0]]["step"])


def test_many_small_tensors_and_mixed_dtypes():
    gen = torch.Generator().manual_seed(7)
    sizes = [int(s) for s in torch.randint(1, 40, (500,), generator=gen)]
    params = [torch.randn(s, generator=gen).to(DEVICE, torch.float16).requires_grad_() for s in sizes]
    params += [
        torch.randn(s, generator=gen).to(DEVICE).requires_grad_() for s in (3, 17, 64)
    ]  # norm-layer-like fp32
    ref = fp32_copies(params)
    opt, ropt = FusedAdamW(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    assert len(opt._flat[0]) == 2  # one flat buffer per dtype
    for _ in range(4):
        grads = random_grads(params, gen)
        step_both(opt, ropt, params, ref, grads)
    assert_params_match(opt, params, ref)


def test_fp32_param_overflow_skips_half_params_too():
    half, single = make_params(torch.float16, [(8,)]), make_params(torch.float32, [(8,)], seed=1)
    opt = FusedSGD(half + single, lr=0.1)
    before = [p.detach().clone() for p in half + single]
    half[0].grad.fill_(1.0)
    single[0].grad.fill_(1.0)
    single[0].grad[3] = float("nan")
    opt.step()
    for p, b in zip(half + single, before, strict=True):
        assert torch.equal(p.detach(), b)


def test_grads_none_or_frozen_are_left_alone_and_replaced_grads_are_used():
    params = make_params(torch.float16, [(6,), (6,), (6,)])
    params[1].requires_grad_(False)
    opt = FusedSGD(params, lr=0.5, weight_decay=0.1)
    assert params[1].grad is None
    before = [p.detach().clone() for p in params]
    params[0].grad = None  # no grad this step
    params[2].grad = torch.full((6,), 2.0, dtype=torch.float16, device=DEVICE)  # a new tensor
    opt.step()
    assert torch.equal(params[0].detach(), before[0])
    assert torch.equal(params[1].detach(), before[1])
    expected = before[2].float() - 0.5 * (2.0 + 0.1 * before[2].float())
    assert torch.allclose(params[2].float(), expected, atol=1e-3)
    # the replaced grad was adopted: it is a view into the flat buffer again
    assert params[2].grad.data_ptr() == opt._flat[0][0].grad_views[2].data_ptr()


def test_the_cached_plan_sees_gradients_cleared_set_and_zeroed_after_steady_steps():
    """Once every param had a gradient, steps reuse their plan without scanning the
    gradient views again until zero_grad: a ``.grad`` cleared or replaced by hand,
    and a zero_grad(set_to_none=True) followed by a gradient for one param only,
    must still step as torch does."""
    params = make_params(torch.float16, [(6,), (5, 3), (7,)])
    ref = fp32_copies(params)
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):  # steady: every param has a gradient, nothing zeroed
        step_both(opt, ropt, params, ref, random_grads(params, gen))
    assert_params_match(opt, params, ref)
    params[0].grad = ref[0].grad = None  # cleared by hand: param 0 sits this step out
    for p, r in zip(params[1:], ref[1:], strict=True):
        g = random_grads([p], gen)[0]
        p.grad.copy_(g)
        r.grad = g.float()
    opt.step()
    ropt.step()
    assert_params_match(opt, params, ref)
    g = random_grads(params[:1], gen)[0]
    params[0].grad, ref[0].grad = g.clone(), g.float()  # a new tensor: adopted, param 0 steps again
    opt.step()
    ropt.step()
    assert_params_match(opt, params, ref)
    opt.zero_grad(set_to_none=True)
    ropt.zero_grad(set_to_none=True)
    g = random_grads(params[1:2], gen)[0]
    params[1].grad.copy_(g)  # only param 1 gets a gradient
    ref[1].grad = g.float()
    before = [params[0].detach().clone(), params[2].detach().clone()]
    opt.step()
    ropt.step()
    assert_params_match(opt, params, ref)
    assert torch.equal(params[0].detach(), before[0]) and torch.equal(params[2].detach(), before[1])


@pytest.mark.parametrize(
    ("make", "kw"),
    [
        (FusedAdamW, dict(amsgrad=True)),
        (FusedAdamW, dict(master="split", state_dtype=torch.uint8)),
        (FusedAdam, dict(master="none", state_dtype=torch.bfloat16)),
        (FusedSGD, dict(momentum=0.9)),
    ],
)
def test_the_plans_buffers_pass_the_update_kernels_checks(make, kw):
    """The step launches its updates with ``prechecked=True`` (no per-step checks):
    every buffer its plans hand out, after a step and after a param sat one out
    (a cohort split), passes the kernels' own checks."""
    from tkern.kernels._update import check_update_buffers

    shapes = [(300, 17), (64,), (5, 3, 7), (1,)]
    params = make_params(torch.bfloat16, shapes)
    opt = make(params, lr=1e-2, **kw)
    gen = torch.Generator().manual_seed(0)
    for k in range(2):
        set_grads(params, random_grads(params, gen))
        if k == 1:
            params[2].grad = None  # sits this step out: its neighbours are two launches
        opt.step()
    plans = [(gi, flat.plan()) for gi, flats in enumerate(opt.flat_buffers) for flat in flats]
    assert max(len(plan) for _, plan in plans) > 1
    for gi, plan in plans:
        for b in plan:
            b.stats, b.inv_scale = opt.grad_stats, torch.ones(1, device=DEVICE)
            check_update_buffers(b, opt._group_state_names(opt.param_groups[gi]))


def test_zero_grad_keeps_views_and_backward_accumulates_into_them():
    layer = tkern.nn.Linear(8, 4).to(DEVICE)
    opt = FusedSGD(layer.parameters(), lr=0.1)
    flat = opt._flat[0][0]
    ptr = flat.grad.data_ptr()
    layer(torch.randn(3, 8, device=DEVICE)).float().sum().backward()
    assert flat.grad.abs().sum() > 0
    assert layer.weight.grad.data_ptr() == ptr
    opt.zero_grad(set_to_none=True)
    assert layer.weight.grad is not None and layer.weight.grad.data_ptr() == ptr
    assert flat.grad.abs().sum() == 0


def test_refresh_master_after_loading_weights_in_place():
    layer = tkern.nn.Linear(8, 4).to(DEVICE)
    opt = FusedSGD(layer.parameters(), lr=0.1)
    with torch.no_grad():
        layer.weight.fill_(0.25)
    opt.refresh_master()
    assert torch.equal(opt.state[layer.weight]["master"], torch.full((4, 8), 0.25, device=DEVICE))


def test_replacing_param_data_is_an_error():
    p = make_params(torch.float16, [(4,)])[0]
    opt = FusedSGD([p], lr=0.1)
    p.data = torch.zeros(4, dtype=torch.float16, device=DEVICE)
    with pytest.raises(RuntimeError, match="no longer lives in the optimizer's flat buffer"):
        opt.step()


def test_closure_is_evaluated_with_grad():
    layer = tkern.nn.Linear(8, 4).to(DEVICE)
    opt = FusedAdam(layer.parameters())
    x = torch.randn(2, 8, device=DEVICE)

    def closure():
        opt.zero_grad()
        loss = layer(x).float().pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.requires_grad and opt.state[layer.weight]["step"].item() == 1


# ----------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, exc, pattern",
    [
        (lambda p: FusedSGD([], lr=0.1), ValueError, "empty parameter list"),
        (lambda p: FusedSGD([p], lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
        (lambda p: FusedSGD([p], lr=0.1, momentum=-0.5), ValueError, "Invalid momentum value"),
        (
            lambda p: FusedSGD([p], lr=0.1, weight_decay=-1),
            ValueError,
            "Invalid weight_decay value",
        ),
        (lambda p: FusedSGD([p], lr=0.1, nesterov=True), ValueError, "Nesterov momentum requires"),
        (
            lambda p: FusedAdam([p], betas=(1.0, 0.999)),
            ValueError,
            "Invalid beta parameter at index 0: 1.0",
        ),
        (
            lambda p: FusedAdam([p], betas=(0.9, -0.1)),
            ValueError,
            "Invalid beta parameter at index 1",
        ),
        (lambda p: FusedAdamW([p], eps=-1e-8), ValueError, "Invalid epsilon value"),
        (lambda p: FusedAdamW([p], max_grad_norm=0.0), ValueError, "Invalid max_grad_norm value"),
        (
            lambda p: FusedSGD([p, p], lr=0.1),
            ValueError,
            r"param 1 of param group 0 \(shape \(3, 2\).*more than once",
        ),
        (
            lambda p: FusedSGD([{"params": [p]}, {"params": [p]}]),
            ValueError,
            "already belongs to another param group",
        ),
        (
            lambda p: FusedSGD([p * 2], lr=0.1),
            ValueError,
            r"param 0 of param group 0 \(shape \(3, 2\).*not a leaf",
        ),
        (lambda p: FusedSGD([p.detach().long()], lr=0.1), TypeError, "dtype must be one of"),
        (
            lambda p: FusedSGD([{"params": [p], "lr": -0.5}], lr=0.1),
            ValueError,
            r"learning rate: -0.5 \(param group 0\)",
        ),
    ],
)
def test_bad_arguments(make, exc, pattern):
    p = torch.zeros(3, 2, dtype=torch.float16, device=DEVICE, requires_grad=True)
    with pytest.raises(exc, match=pattern):
        make(p)


def test_params_on_different_devices_in_one_group():
    a = torch.zeros(3, dtype=torch.float16, device=DEVICE, requires_grad=True)
    b = torch.zeros(3, dtype=torch.float16, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match=r"param 1 of param group 0 \(shape \(3,\).*is on meta"):
        FusedSGD([a, b], lr=0.1)


def test_sparse_gradient_is_rejected():
    p = torch.zeros(4, 3, dtype=torch.float32, device=DEVICE, requires_grad=True)
    opt = FusedSGD([p], lr=0.1)
    p.grad = torch.zeros(4, 3, device=DEVICE).to_sparse()
    with pytest.raises(TypeError, match="sparse gradients are not supported"):
        opt.step()


def test_bad_inv_scale():
    p = torch.zeros(4, dtype=torch.float16, device=DEVICE, requires_grad=True)
    opt = FusedSGD([p], lr=0.1)
    with pytest.raises(TypeError, match="inv_scale must be a one-element float32 tensor"):
        opt.step(inv_scale=torch.ones(2, device=DEVICE))


def test_bad_state_dict_leaves_the_optimizer_as_it_was():
    params = make_params(torch.float16)
    opt = FusedAdam(params, lr=1e-2)
    gen = torch.Generator().manual_seed(8)
    set_grads(params, random_grads(params, gen))
    opt.step()
    good = opt.state_dict()
    before = {k: v.clone() for k, v in good["state"][0].items()}

    broken = {"state": {k: dict(v) for k, v in good["state"].items()}, "param_groups": good["param_groups"]}
    broken["state"][0] = {k: torch.zeros_like(v) for k, v in broken["state"][0].items()}
    del broken["state"][2]["exp_avg_sq"]  # param 2 lacks a buffer: found after param 0 was read
    with pytest.raises(KeyError, match="param 2 of param group 0.*lacks 'exp_avg_sq'"):
        opt.load_state_dict(broken)
    bad_lr = {"state": good["state"], "param_groups": [{**good["param_groups"][0], "lr": -1.0}]}
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        opt.load_state_dict(bad_lr)
    assert opt.param_groups[0]["lr"] == 1e-2
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, before[k]), k
