"""The optimizers' memory modes (issue 18): master="fp32" | "split" | "none" and
state_dtype=float32 | bfloat16 | uint8, against references: the fp32-master run
(split must be bit-identical), float64 (the update), torchao's code maps and
block quantization (8-bit state), the statistics of stochastic rounding, and
torch.optim.AdamW (checkpoints in both directions)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from conftest import DEVICE

import tkern
from tkern.kernels._update import QBLOCK, code_map, dynamic_code_map, state_from_fp32, state_to_fp32
from tkern.optim import FusedAdam, FusedAdamW, FusedSGD

torchao_quant = pytest.importorskip("torchao.optim.quant_utils", reason="torchao is the 8-bit reference")

BF16, FP16 = torch.bfloat16, torch.float16


def grads(step: int, shapes, dtype, scale: float = 1.0):
    g = torch.Generator().manual_seed(1234 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype).to(DEVICE) for s in shapes]


def params(shapes, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(DEVICE).requires_grad_() for s in shapes]


def run(opt_cls, shapes, dtype, steps, **kw):
    ps = params(shapes, dtype)
    opt = opt_cls(ps, **kw)
    for t in range(steps):
        for p, g in zip(ps, grads(t, shapes, dtype), strict=True):
            p.grad.copy_(g)
        opt.step()
    return ps, opt


def round_ties_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 to nearest, ties away from zero (the split master's param), in int arithmetic."""
    bits = x.view(torch.int32).to(torch.int64)
    sign = bits & (1 << 31)
    mag = (bits & 0x7FFFFFFF) + 0x8000
    return ((sign | mag) >> 16).to(torch.int16).view(torch.bfloat16)


# ----------------------------------------------------------------------- code maps and blocks


@pytest.mark.parametrize("signed", [True, False])
def test_code_maps_are_torchaos_dynamic_maps(signed):
    ours = torch.tensor(dynamic_code_map(signed), dtype=torch.float32)
    ref = torch.tensor(torchao_quant.create_dynamic_map(signed=signed), dtype=torch.float32)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("signed", [True, False])
def test_block_quantization_is_torchaos_bit_for_bit(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * QBLOCK, generator=g) * torch.logspace(-6, 2, 8 * QBLOCK)
    if not signed:
        x = x.abs()
    x[QBLOCK : 2 * QBLOCK] = 0.0  # an all-zero block stays zeros
    x[5] = x[7] = 3e-14  # below the absmax clamp
    x = x.to(DEVICE)
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    absmax = torch.empty(x.numel() // QBLOCK, device=DEVICE)
    state_from_fp32(x, codes, absmax, signed)
    qmap = code_map(signed, torch.device(DEVICE))
    scaled, ref_absmax = torchao_quant.scale_tensor(x, QBLOCK)
    ref_codes = torchao_quant.quantize_8bit_with_qmap(scaled, qmap)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes)
    back = state_to_fp32(codes, absmax, signed)
    assert torch.equal(back, torchao_quant.dequant_with_qmap(ref_codes, qmap, ref_absmax))
    assert torch.equal(back[QBLOCK : 2 * QBLOCK], torch.zeros(QBLOCK, device=DEVICE))
    # each value is the nearest code: within half the code spacing, at most 0.5 * 0.1 * absmax
    err = (back - x).abs().view(-1, QBLOCK) / absmax.view(-1, 1)
    assert err.max() <= 0.05 + 1e-6


# ----------------------------------------------------------------------- split master


@pytest.mark.parametrize(
    "opt_cls, kw", [(FusedAdamW, {"lr": 1e-2}), (FusedSGD, {"lr": 0.1, "momentum": 0.9})]
)
def test_split_master_is_bit_identical_to_fp32_master_step_after_step(opt_cls, kw):
    shapes = [(300,), (17, 5), (4096,)]
    ref_ps, ref = run(opt_cls, shapes, BF16, 0, **kw)
    got_ps, got = run(opt_cls, shapes, BF16, 0, master="split", **kw)
    for t in range(6):
        for opt, ps in ((ref, ref_ps), (got, got_ps)):
            for p, g in zip(ps, grads(t, shapes, BF16), strict=True):
                p.grad.copy_(g)
            opt.step()
        ref_sd, got_sd = ref.state_dict(), got.state_dict()
        for i, p in enumerate(got_ps):
            want = ref_sd["state"][i]["master"]
            have = got_sd["state"][i]["master"]
            assert have.dtype == torch.float32 and torch.equal(have.view(torch.int32), want.view(torch.int32))
            # the forward sees the master rounded to nearest (ties away from zero)
            assert torch.equal(p.detach().view(torch.int16), round_ties_away(want).view(torch.int16))
            assert torch.equal(got.state[p]["master"], want)
    assert got.memory_report()["master"] == sum(math.ceil(math.prod(s) / 16) * 16 for s in shapes) * 2


def test_split_master_refuses_fp16_params_before_anything_changes():
    p = torch.randn(8, dtype=FP16, device=DEVICE, requires_grad=True)
    before = p.detach().clone()
    with pytest.raises(ValueError, match='master="split".*needs bf16 params'):
        FusedAdamW([p], master="split")
    assert torch.equal(p.detach(), before) and p.grad is None
    with pytest.raises(ValueError, match='master must be "fp32", "split" or "none"'):
        FusedAdamW([p], master="fp16")
    with pytest.raises(ValueError, match="state_dtype must be"):
        FusedSGD([p], state_dtype=torch.int8)


def test_split_master_loads_an_fp32_checkpoint_bit_exactly():
    shapes = [(300,), (4096,)]
    ref_ps, ref = run(FusedAdamW, shapes, BF16, 3, lr=1e-2)
    ps = params(shapes, BF16, seed=5)
    opt = FusedAdamW(ps, lr=1e-2, master="split")
    with torch.no_grad():
        for p, r in zip(ps, ref_ps, strict=True):
            p.copy_(r)
    opt.load_state_dict(ref.state_dict())
    for opt_, ps_ in ((ref, ref_ps), (opt, ps)):
        for p, g in zip(ps_, grads(9, shapes, BF16), strict=True):
            p.grad.copy_(g)
        opt_.step()
    for i in range(len(shapes)):
        assert torch.equal(opt.state_dict()["state"][i]["master"], ref.state_dict()["state"][i]["master"])


# ----------------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_rounding_is_unbiased(dtype):
    # every element starts at 1.0 and steps by -lr * g = -0.3 ulp: the exact result lies 30% of
    # the way from one representable value to the next; its rounding is a Bernoulli draw
    n = 200_000
    ulp = 2.0**-7 if dtype == BF16 else 2.0**-10
    p = torch.ones(n, dtype=dtype, device=DEVICE, requires_grad=True)
    opt = FusedSGD([p], lr=1.0, master="none", seed=7)
    p.grad.fill_(0.3 * ulp / 2)  # just below 1.0 the spacing halves: exact = 1 - 0.3 ulp/2
    opt.step()
    exact = 1.0 - 0.3 * ulp / 2
    values = p.detach().double()
    lo, hi = 1.0 - ulp / 2, 1.0
    assert set(values.unique().tolist()) <= {lo, hi}
    frac = 0.6  # exact lies 60% of the way from lo to hi (the spacing below 1 is ulp / 2)
    sigma = (ulp / 2) * math.sqrt(frac * (1 - frac) / n)
    assert abs(values.mean().item() - exact) < 3 * sigma


def test_stochastic_rounding_is_reproducible_per_seed_step_and_element():
    def one(seed, steps):
        p = torch.full((5000,), 1.0, dtype=BF16, device=DEVICE, requires_grad=True)
        opt = FusedAdamW([p], lr=1e-3, master="none", seed=seed)
        for t in range(steps):
            p.grad.copy_(grads(t, [(5000,)], BF16)[0])
            opt.step()
        return p.detach().clone(), opt

    a, _ = one(1, 2)
    b, _ = one(1, 2)
    c, _ = one(2, 2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # a resumed run is bit-identical: model and optimizer state, the same seed
    first, opt = one(3, 1)
    p = first.clone().requires_grad_()
    resumed = FusedAdamW([p], lr=1e-3, master="none", seed=3)
    resumed.load_state_dict(opt.state_dict())
    p.grad.copy_(grads(1, [(5000,)], BF16)[0])
    resumed.step()
    straight, _ = one(3, 2)
    assert torch.equal(p.detach(), straight)
    assert "master" not in opt.state_dict()["state"][0]


def test_no_master_update_matches_float64_in_expectation():
    # AdamW's first step moves every element by ~lr; from bf16 params the fp32 result rounds
    # stochastically: the mean error over many elements is ~0 while round-to-nearest's is not
    n = 100_000
    x0 = (1.0 + torch.arange(n) % 7 * 2.0**-7).to(BF16)
    p = x0.clone().to(DEVICE).requires_grad_()
    opt = FusedAdamW([p], lr=1e-4, weight_decay=0.0, master="none", seed=11)
    p.grad.fill_(1.0)
    opt.step()
    exact = x0.double() - 1e-4  # Adam's first step is lr * sign(g) (g / (|g| + eps))
    err = p.detach().double().cpu() - exact
    assert abs(err.mean().item()) < 3 * 2.0**-7 / math.sqrt(n)  # unbiased: a few sigma
    assert not torch.equal(p.detach().cpu(), x0)  # 1e-4 is below half an ulp: RNE would never move


# ----------------------------------------------------------------------- 8-bit and bf16 state


def emulate_adamw_8bit(p0, gs, lr, betas, eps, wd):
    """fp32 AdamW whose moments are requantized after every step with torchao's own
    block quantization (blocks of 256), the reference for state_dtype=torch.uint8."""
    qs, qu = code_map(True, torch.device("cpu")), code_map(False, torch.device("cpu"))

    def requant(x, qmap):
        scaled, absmax = torchao_quant.scale_tensor(x, QBLOCK)
        return torchao_quant.dequant_with_qmap(
            torchao_quant.quantize_8bit_with_qmap(scaled, qmap), qmap, absmax
        )

    p = p0.double()
    m = torch.zeros_like(p0, dtype=torch.float32)
    v = torch.zeros_like(m)
    for t, g in enumerate(gs, start=1):
        g = g.float()
        p = p * (1 - lr * wd)
        m = m + (1 - betas[0]) * (g - m)
        v = v * betas[1] + (1 - betas[1]) * g * g
        denom = (v.double().sqrt() / math.sqrt(1 - betas[1] ** t)) + eps
        p = p - lr / (1 - betas[0] ** t) * m.double() / denom
        m, v = requant(m, qs), requant(v, qu)
    return p, m, v


def test_8bit_adamw_matches_its_float64_emulation():
    shape, steps = (16 * QBLOCK,), 4  # 4096: the smallest tensor with 8-bit moments
    gs = [grads(t, [shape], torch.float32)[0].cpu() for t in range(steps)]
    p0 = params([shape], torch.float32)[0].detach().cpu()
    ref_p, ref_m, ref_v = emulate_adamw_8bit(p0, gs, 1e-2, (0.9, 0.999), 1e-8, 1e-2)
    p = p0.clone().to(DEVICE).requires_grad_()
    opt = FusedAdamW([p], lr=1e-2, state_dtype=torch.uint8)
    for g in gs:
        p.grad.copy_(g)
        opt.step()
    st = opt.state_dict()["state"][0]
    # the same fp32 moments requantized the same way: identical up to fp32 rounding order
    torch.testing.assert_close(st["exp_avg"].cpu(), ref_m, rtol=0, atol=1e-6 * ref_m.abs().max().item())
    torch.testing.assert_close(st["exp_avg_sq"].cpu(), ref_v, rtol=0, atol=1e-6 * ref_v.abs().max().item())
    torch.testing.assert_close(p.detach().double().cpu(), ref_p, rtol=0, atol=1e-6)
    report = opt.memory_report()
    assert report["state"] == 2 * (shape[0] + shape[0] // QBLOCK * 4)


def test_small_tensors_keep_fp32_state_under_uint8():
    big = torch.zeros(4096, device=DEVICE, requires_grad=True)
    small = torch.zeros(4095, device=DEVICE, requires_grad=True)
    opt = FusedAdam([big, small], state_dtype=torch.uint8)
    big.grad.fill_(1.0)
    small.grad.fill_(1.0)
    opt.step()
    assert opt.state[big].converted("exp_avg") and not opt.state[small].converted("exp_avg")
    assert opt.memory_report()["state"] == 2 * (4096 + 16 * 4) + 2 * 4 * 4096  # 4095 pads to 4096


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.uint8])
def test_compact_state_round_trips_through_torch_adamw(state_dtype):
    shapes = [(4096,), (300,)]
    ps, opt = run(FusedAdamW, shapes, BF16, 3, lr=1e-2, state_dtype=state_dtype)
    sd = opt.state_dict()
    # a tkern checkpoint in any mode loads into torch.optim.AdamW (fp32 master params)
    masters = [sd["state"][i]["master"].clone().requires_grad_() for i in range(len(shapes))]
    torch_opt = torch.optim.AdamW(masters, lr=1e-2)
    torch_opt.load_state_dict({"state": {i: {k: v for k, v in e.items() if k != "master"}
                                         for i, e in sd["state"].items()},
                               "param_groups": sd["param_groups"]})  # fmt: skip
    for i in range(len(shapes)):
        assert torch.equal(torch_opt.state[masters[i]]["exp_avg"], sd["state"][i]["exp_avg"])
    # and a torch checkpoint loads into the compact mode: the moments as it would store them
    twin_ps = [p.detach().clone().requires_grad_() for p in ps]
    twin = FusedAdamW(twin_ps, lr=1e-2, state_dtype=state_dtype)
    twin.load_state_dict(torch_opt.state_dict())
    for i, p in enumerate(twin_ps):
        loaded = twin.state[p]["exp_avg_sq"]
        assert torch.equal(loaded, sd["state"][i]["exp_avg_sq"])  # compact -> fp32 -> compact is stable
        assert float(twin.state[p]["step"]) == 3


def test_bf16_state_is_the_fp32_state_rounded():
    shapes = [(1000,)]
    _, ref = run(FusedAdamW, shapes, torch.float32, 1, lr=1e-2)
    _, got = run(FusedAdamW, shapes, torch.float32, 1, lr=1e-2, state_dtype=torch.bfloat16)
    for name in ("exp_avg", "exp_avg_sq"):
        want = ref.state_dict()["state"][0][name].bfloat16().float()
        assert torch.equal(got.state_dict()["state"][0][name], want)


# ----------------------------------------------------------------------- every mode


MODES = [
    ("fp32", torch.float32),
    ("split", torch.float32),
    ("none", torch.float32),
    ("fp32", torch.uint8),
    ("split", torch.uint8),
    ("none", torch.uint8),
    ("split", torch.bfloat16),
]
#: The modes trained end to end (each the fp32-master run's twin): every master mode, each state dtype.
TRAINED = [("split", torch.float32), ("none", torch.float32), ("fp32", torch.uint8), ("none", torch.uint8),
           ("split", torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize("master, state_dtype", MODES)
def test_an_overflowing_step_changes_nothing_in_any_mode(master, state_dtype):
    shapes = [(4096,), (33,)]
    ps, opt = run(FusedAdamW, shapes, BF16, 2, lr=1e-2, master=master, state_dtype=state_dtype, amsgrad=True)
    before_p = [p.detach().clone() for p in ps]
    before = opt.state_dict()
    ps[1].grad.fill_(1.0)
    ps[0].grad[7] = float("inf")
    opt.step()
    assert float(opt.grad_stats[0]) == 1.0
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before_p, ps, strict=True))
    for i, entry in before["state"].items():
        for k, v in entry.items():
            assert torch.equal(after["state"][i][k], v), (i, k)


@pytest.mark.parametrize("master, state_dtype", TRAINED)
def test_every_mode_trains_like_fp32_master_adamw(master, state_dtype):
    """Two param groups, clipping, a scheduler and a loss scale: each mode's final loss on a
    least-squares problem within its stated margin of the fp32-master run's."""
    torch.manual_seed(0)
    x = torch.randn(256, 64, device=DEVICE)
    w_true = torch.randn(64, 64, device=DEVICE) / 8

    def train(**kw):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(DEVICE, BF16)
        opt = FusedAdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 5e-3}],
                         lr=1e-2, max_grad_norm=1.0, seed=0, **kw)  # fmt: skip
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        inv = torch.tensor([1 / 64.0], device=DEVICE)
        for _ in range(30):
            opt.zero_grad()
            loss = (model(x.to(BF16)).float() - x @ w_true).pow(2).mean()
            (loss * 64).backward()
            opt.step(inv_scale=inv)
            sched.step()
        return loss.item()

    ref = train()
    got = train(master=master, state_dtype=state_dtype)
    margin = {"fp32": 0.02, "split": 0.02, "none": 0.10}[master] + (0.05 if state_dtype == torch.uint8 else 0)
    assert abs(got - ref) <= margin * ref, (got, ref)


def test_memory_report_bytes_per_param_at_10m_params():
    # 10.5M bf16 params in sizes that are multiples of 256: no padding beyond the absmax
    shapes = [(2048, 2048), (2048, 2048), (512, 4096)]
    targets = {("fp32", torch.float32): 16, ("split", torch.float32): 14, ("fp32", torch.uint8): 10,
               ("split", torch.uint8): 8, ("none", torch.uint8): 6}  # fmt: skip
    ps = [torch.zeros(s, dtype=BF16, device=DEVICE, requires_grad=True) for s in shapes]
    for (master, state_dtype), target in targets.items():
        opt = FusedAdamW(ps, master=master, state_dtype=state_dtype)
        report = opt.memory_report()
        assert report["numel"] >= 10_000_000
        absmax = 8 / QBLOCK if state_dtype == torch.uint8 else 0.0  # one fp32 per 256 per moment
        assert report["bytes_per_param"] == pytest.approx(target + absmax, abs=1e-9), (master, state_dtype)
        del opt


def test_assigning_a_compact_entry_writes_through():
    p = torch.randn(4096, dtype=BF16, device=DEVICE, requires_grad=True)
    opt = FusedAdamW([p], lr=1e-2, master="split", state_dtype=torch.uint8)
    p.grad.fill_(0.5)
    opt.step()
    state = opt.state[p]
    assert state.converted("master") and state.converted("exp_avg")
    master = p.detach().float()  # a master that rounds to the param is kept bit for bit
    assert not torch.equal(state["master"], master)
    state["master"] = master
    assert torch.equal(opt.state[p]["master"], master)
    state["exp_avg"] = torch.full((4096,), 0.25)
    assert torch.equal(opt.state[p]["exp_avg"], torch.full((4096,), 0.25, device=DEVICE))


@pytest.mark.slow
def test_8bit_adamw_steps_like_torchaos_adamw8bit():
    """torchao's AdamW8bit (the same blocks of 256, code maps and rounding) on the same
    param and gradients: the same 8-bit codes but for values whose fp32 moments fall within
    rounding of a code boundary (torchao forms v by lerp, tkern by v * b2 + (1 - b2) g^2: the
    two differ in the last bit), the same absmax to fp32 rounding, the same params to the
    effect of those rare codes (none differ with these seeds: the params then agree to fp32
    rounding of the update's different operation order, ~1e-6; a differing code would move
    a param by up to ~10% of lr)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    shape, lr = (4 * 4096,), 1e-3
    p0 = params([shape], torch.float32)[0].detach()
    ours = p0.clone().requires_grad_()
    theirs = p0.clone().requires_grad_()
    opt = FusedAdamW([ours], lr=lr, state_dtype=torch.uint8)
    ref = torchao_optim.AdamW8bit([theirs], lr=lr)
    for t in range(3):
        g = grads(t, [shape], torch.float32)[0]
        ours.grad.copy_(g)
        theirs.grad = g.clone()
        opt.step()
        ref.step()
    flat = opt.flat_buffers[0][0]
    for name in ("exp_avg", "exp_avg_sq"):
        st = ref.state[theirs][name]
        same = (flat.state[name] == st.codes.view(-1)).double().mean().item()
        assert same > 0.999, (name, same)
        torch.testing.assert_close(flat.absmax[name], st.scale.view(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-2 * lr)


def test_memory_reports_keep_bytes_and_print_mib_per_line():
    p = torch.zeros(2**18, dtype=torch.float32, device=DEVICE, requires_grad=True)  # 1 MiB of fp32
    report = FusedAdamW([p]).memory_report()
    assert (report["param"], report["grad"], report["state"], report["graph_pool"]) == (
        2**20,
        2**20,
        2**21,
        0,
    )
    lines = dict(line.split(maxsplit=1) for line in str(report).splitlines())
    assert list(lines) == list(report)  # one line per entry, in order
    assert lines["param"] == "1.00 MiB (1048576 B)" and lines["state"] == "2.00 MiB (2097152 B)"
    assert lines["total"] == "4.00 MiB (4194304 B)" and lines["bytes_per_param"] == "16.00 B/param"
    assert set(report.byte_keys) == {
        "param",
        "grad",
        "master",
        "state",
        "fsdp_storage",
        "graph_pool",
        "total",
    }
    assert pickle.loads(pickle.dumps(report)).byte_keys == report.byte_keys
    # the Trainer's: the same kind, the graphs' pools on their own line
    model = torch.nn.Linear(512, 512, bias=False).to(DEVICE)  # 1 MiB of fp32 weight
    trainer = tkern.Trainer(
        model, FusedAdamW(model.parameters()), torch.nn.functional.mse_loss, progress=False
    )
    report = trainer.memory_report()
    lines = dict(line.split(maxsplit=1) for line in str(report).splitlines())
    assert list(lines) == ["model", "optimizer", "grads", "graphs", "activations", "total"]
    assert lines["model"] == "1.00 MiB (1048576 B)" and report["graphs"] == 0
    assert report["total"] == sum(report[k] for k in report.byte_keys[:-1])
