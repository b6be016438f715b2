"""tkern.cross_entropy against F.cross_entropy in float64 on the same (rounded) logits.

Tolerances (relative Frobenius error, conftest.rel_err):
* the loss is fp32: each row's logsumexp is an fp32 sum of V exponentials (tree sums
  within a chunk, then across chunks: a few times log2(V) * 2^-24 relative) and a
  log/exp within a few ulps; rows summed in fp32 add at most N * 2^-24. For the
  shapes here (N <= 188, V <= 2^17 + 3) that is below 3e-6; LOSS_TOL = 1e-5.
* the gradient is computed in fp32 and rounded once to the logits' dtype: per element
  within the unit roundoff u of that dtype (plus fp32 noise ~1e-6 relative), so the
  GEMM table's 2u (conftest.TOL) bounds it; fp32 gradients: TOL[fp32] = 2e-6 covers
  the lse's rounding (an absolute 2^-24 * |lse| error becomes p's relative error).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, count_syncs, rel_err

import tkern
import tkern.kernels.cross_entropy as ce_kernels
from tkern.kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward

LOSS_TOL = 1e-5
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
N, V = 188, 123


def _reference(logits, target, weight=None, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
               ignore_index=-100, grad_out=None):  # fmt: skip
    """(loss, grad) from float64 torch: softcap, F.cross_entropy, then the z-loss."""
    x = logits.detach().double().requires_grad_()
    capped = x if softcap is None else softcap * torch.tanh(x / softcap)
    w = None if weight is None else weight.double()
    target = target.long()
    loss = F.cross_entropy(
        capped,
        target,
        weight=w,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if z_loss:
        valid = target != ignore_index
        z = z_loss * torch.logsumexp(capped, -1) ** 2 * valid
        loss = loss + {"none": z, "sum": z.sum(), "mean": z.sum() / valid.sum()}[reduction]
    loss.backward(torch.ones_like(loss) if grad_out is None else grad_out.double())
    return loss.detach(), x.grad


def _run(logits, target, grad_out=None, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = tkern.cross_entropy(x, target, **kw)
    loss.backward(torch.ones_like(loss) if grad_out is None else grad_out)
    return loss, x.grad


def _inputs(dtype, n=N, v=V, seed=0, scale=3.0, ignore_every=7):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype).to(DEVICE)
    target = torch.randint(0, v, (n,), generator=g)
    target[::ignore_every] = -100
    weight = (torch.rand(v, generator=g) + 0.5).to(DEVICE)
    return logits, target.to(DEVICE), weight


OPTIONS = {
    "plain": {},
    "weight": {"weight": True},
    "smoothing": {"label_smoothing": 0.1},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.2},
    "z_softcap": {"z_loss": 1e-2, "softcap": 4.0},
    "all": {"weight": True, "label_smoothing": 0.05, "z_loss": 1e-3, "softcap": 7.5},
}


def _options(name, weight):
    kw = dict(OPTIONS[name])
    if kw.pop("weight", False):
        kw["weight"] = weight
    return kw


def _check(logits, target, grad_out=None, **kw):
    loss, grad = _run(logits, target, grad_out, **kw)
    ref_loss, ref_grad = _reference(logits, target, grad_out=grad_out, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert rel_err(loss, ref_loss) <= LOSS_TOL, (rel_err(loss, ref_loss), kw)
    assert rel_err(grad, ref_grad) <= TOL[logits.dtype], (rel_err(grad, ref_grad), kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", list(OPTIONS))
def test_matches_float64_reference(dtype, options):
    logits, target, weight = _inputs(dtype)
    _check(logits, target, **_options(options, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_with_upstream_gradient(dtype, reduction):
    logits, target, weight = _inputs(dtype, n=40)
    grad_out = torch.tensor(0.75) if reduction == "sum" else torch.rand(40) + 0.5
    _check(
        logits,
        target,
        grad_out.to(DEVICE),
        weight=weight,
        label_smoothing=0.1,
        z_loss=1e-3,
        reduction=reduction,
    )


def test_int32_target_and_ignore_index():
    logits, target, weight = _inputs(torch.float16, n=24)
    target = torch.where(target == -100, 5, target).to(torch.int32)
    _check(logits, target, ignore_index=5, weight=weight)


def test_strided_logits_read_in_place_and_left_unchanged():
    # a column slice of a wider tensor: row stride V + 9, read in place (no copy), never written
    wide = (torch.randn(30, V + 9) * 3).half().to(DEVICE)
    logits = wide[:, 4 : 4 + V]
    before = wide.clone()
    target = torch.randint(0, V, (30,), device=DEVICE)
    leaf = wide.clone().requires_grad_()
    loss = tkern.cross_entropy(leaf[:, 4 : 4 + V], target, label_smoothing=0.1)
    loss.backward()
    ref_loss, ref_grad = _reference(logits, target, label_smoothing=0.1)
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    assert rel_err(leaf.grad[:, 4 : 4 + V], ref_grad) <= TOL[torch.float16]
    assert torch.all(leaf.grad[:, :4] == 0) and torch.all(leaf.grad[:, 4 + V :] == 0)
    assert torch.equal(wide, before)
    # the same through a transposed (column-major) view
    t_logits = logits.t().contiguous().t()
    _check(t_logits, target)


def test_large_vocabulary():
    # 2^17 + 3 classes: several vocabulary chunks and a ragged last one
    v = 2**17 + 3
    logits, target, weight = _inputs(torch.bfloat16, n=3, v=v, ignore_every=10)
    target[1] = v - 1  # the target in the ragged tail
    _check(logits, target, weight=weight, label_smoothing=0.1, z_loss=1e-4)


def test_confident_predictions_keep_p_minus_one():
    # p(target) from 0.99 to 0.999 in bf16 logits: p - 1 must come from the fp32 p
    # (Liger PR 1329: rounding p to bf16 first is 20-100% wrong there). Bound: the
    # target's gradient within 2 bf16 ulps (2^-7 relative) of the float64 p - 1.
    n = 16
    p = torch.linspace(0.99, 0.999, n, dtype=torch.float64)
    big = torch.log(p * (V - 1) / (1 - p))  # target logit L with others 0: p = e^L / (e^L + V - 1)
    logits = torch.zeros(n, V, dtype=torch.float64)
    target = torch.arange(n) * 5 % V
    logits[torch.arange(n), target] = big
    logits = logits.bfloat16().to(DEVICE)
    target = target.to(DEVICE)
    _, grad = _run(logits, target, reduction="sum")
    _, ref = _reference(logits, target, reduction="sum")
    rows = torch.arange(n, device=DEVICE)
    g, r = grad[rows, target].double().cpu(), ref[rows, target].cpu()
    assert torch.all(r < -5e-4)  # p - 1 in [-0.01, -0.001], reference on the rounded logits
    assert torch.all((g - r).abs() <= 2.0**-7 * r.abs()), (g, r)
    assert rel_err(grad, ref) <= TOL[torch.bfloat16]


ULP32 = 2.0**-24


def _softcap_probe(c, n=400):
    """fp32 logits ``c * y`` with |y| geometric in [1e-4, 30], both signs, as (2n, 1)."""
    mag = torch.logspace(-4, math.log10(30.0), n, dtype=torch.float64)
    return (torch.cat([mag, -mag]) * c).float()[:, None].to(DEVICE)


@pytest.mark.parametrize("c", [1.0, 1.5, 30.0])
def test_softcap_keeps_relative_precision_for_every_logit(c):
    # One class per row: the kernel's lse is the capped logit c tanh(x / c) itself, and the
    # gradient of lse (grad_loss 0, grad_lse 1) is the cap's slope 1 - tanh(x / c)^2, so
    # both are compared element by element with float64 on the same fp32 x. Bounds: the
    # forward within 4 fp32 ulp (tanh to < 3 ulp, then x / c and c * t rounded once each);
    # the slope within (4 + 2|y|) ulp: y = x / c is rounded (half an ulp) and sech^2's
    # condition number is 2 |y| tanh|y|. torch's own fp32 c * tanh(x / c) is measured in the
    # same test: the forward within 3x its error; its 1 - t^2 slope loses every digit for
    # large |y| (t rounds to 1), so only its |y| < 1 error is a reference for the slope.
    x = _softcap_probe(c)
    target = torch.zeros(x.shape[0], dtype=torch.long, device=DEVICE)
    y = x.double().cpu()[:, 0] / c
    ref_cap, ref_slope = c * torch.tanh(y), torch.cosh(y) ** -2
    _, lse = cross_entropy_forward(x, target, softcap=c)
    one, zero = torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    slope = cross_entropy_backward(x, target, lse, zero, one, softcap=c)[:, 0]
    xt = x.clone().requires_grad_()
    torch_cap = c * torch.tanh(xt / c)
    torch_cap.sum().backward()

    def rel(out, ref):
        return (out.double().cpu().reshape(-1) - ref).abs() / ref.abs()

    cap_err, torch_cap_err = rel(lse, ref_cap), rel(torch_cap.detach(), ref_cap)
    assert cap_err.max() <= max(4 * ULP32, 3 * torch_cap_err.max()), (cap_err.max(), torch_cap_err.max())
    slope_err = rel(slope, ref_slope)
    assert torch.all(slope_err <= (4 + 2 * y.abs()) * ULP32), (slope_err.max(), y[slope_err.argmax()])
    near = y.abs() < 1
    torch_near = rel(xt.grad, ref_slope)[near].max()
    assert slope_err[near].max() <= 3 * torch_near, (slope_err[near].max(), torch_near)


def test_softcap_cross_entropy_gradient_at_torchs_accuracy():
    # Rows [c y, 0] with the target 0, |y| in [1e-4, 30]: the loss and gradient against a
    # float64 reference whose slope is 1 / cosh(y)^2 (float64 autograd's 1 - tanh^2 rounds
    # to 0 past |y| = 19), relative Frobenius error within 2x torch's fp32 error measured here.
    c = 1.5
    x = _softcap_probe(c)
    x = torch.cat([x, torch.zeros_like(x)], 1)
    target = torch.zeros(x.shape[0], dtype=torch.long, device=DEVICE)
    y = x.double().cpu() / c
    cap = c * torch.tanh(y)
    ref_loss = torch.logsumexp(cap, 1) - cap[:, 0]
    ref_grad = (torch.softmax(cap, 1) - F.one_hot(target.cpu(), 2)) / torch.cosh(y) ** 2
    loss, grad = _run(x, target, reduction="none", softcap=c)
    xt = x.clone().requires_grad_()
    t_loss = F.cross_entropy(c * torch.tanh(xt / c), target, reduction="none")
    t_loss.sum().backward()
    for out, ref, torch_out in ((loss, ref_loss, t_loss.detach()), (grad, ref_grad, xt.grad)):
        err, torch_err = rel_err(out, ref), rel_err(torch_out, ref)
        assert err <= 2 * torch_err, (err, torch_err)


@pytest.mark.parametrize("reduction, expected", [("mean", float("nan")), ("sum", 0.0), ("none", 0.0)])
def test_all_ignored_batch(reduction, expected):
    logits, _, weight = _inputs(torch.float16, n=8)
    target = torch.full((8,), -100, device=DEVICE)
    for kw in ({}, {"weight": weight, "label_smoothing": 0.1, "z_loss": 1e-3}):
        loss, grad = _run(logits, target, reduction=reduction, **kw)
        ref, _ = _reference(
            logits, target, reduction=reduction, **{k: v for k, v in kw.items() if k != "z_loss"}
        )
        assert torch.equal(loss.isnan().cpu(), ref.isnan().cpu())
        assert torch.all(loss.isnan()) if expected != expected else torch.all(loss == expected)
        assert torch.all(grad == 0)


def test_torch_shapes():
    logits, target, weight = _inputs(torch.float32, n=6, v=11, ignore_every=100)
    # (C,) with a 0-d target
    _check(logits[1], target[1])
    _check(logits[1], target[1], reduction="none")
    # (N, C, d1, d2) with (N, d1, d2): the class dimension is 1
    x = logits.reshape(2, 3, 11).permute(0, 2, 1).unsqueeze(-1).expand(2, 11, 3, 2).contiguous()
    t = torch.randint(0, 11, (2, 3, 2), device=DEVICE)
    _check(x, t, weight=weight)
    _check(x, t, reduction="none")


def test_errors_name_the_argument():
    logits, target, _ = _inputs(torch.float16, n=4, v=10, ignore_every=100)
    # out-of-range targets on the CPU: a ValueError naming the value, the range and
    # ignore_index, before any launch (on a GPU the check is a device-side assert, which
    # would end the process's CUDA context: test_out_of_range_target_on_the_device_path)
    bad = target.clone().cpu()
    bad[2] = 10
    msg = r"target\[2\] = 10 is out of range: targets must be in \[0, 10\) or equal ignore_index \(-100\)"
    with pytest.raises(ValueError, match=msg):
        tkern.cross_entropy(logits.cpu(), bad)
    bad[2], bad[0] = -3, 7  # 7 is then ignore_index, -100 a class out of range
    with pytest.raises(ValueError, match=r"target\[2\] = -3 .* ignore_index \(7\)"):
        tkern.cross_entropy(logits.cpu(), bad, ignore_index=7)
    with pytest.raises(ValueError, match="target must have shape"):
        tkern.cross_entropy(logits, target[:3])
    with pytest.raises(TypeError, match="class-probability targets"):
        tkern.cross_entropy(logits, torch.rand(4, 10, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be a 1-D tensor of 10"):
        tkern.cross_entropy(logits, target, weight=torch.ones(9, device=DEVICE))
    with pytest.raises(TypeError, match="logits must have dtype"):
        tkern.cross_entropy(logits.int(), target)
    with pytest.raises(ValueError, match="reduction must be one of"):
        tkern.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        tkern.cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be None or > 0"):
        tkern.cross_entropy(logits, target, softcap=0.0)
    with pytest.raises(ValueError, match="z_loss must be"):
        tkern.cross_entropy(logits, target, z_loss=-1.0)


@pytest.fixture
def device_path_check(monkeypatch):
    """The device-side target check on this machine's device too (the CPU reads its
    targets on the host, which costs nothing there)."""
    monkeypatch.setattr(ce_kernels, "HOST_CHECK_DEVICES", ())


def test_no_host_sync_per_call(device_path_check):
    # the target check on the device path, the launches and the reduction: no value read
    # on the host in forward or backward (the counter does see a host check)
    logits, target, weight = _inputs(torch.bfloat16, n=24)
    x = logits.clone().requires_grad_()
    with count_syncs() as calls:
        loss = tkern.cross_entropy(x, target, weight=weight, label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
        loss.backward()
    assert calls == [] and x.grad is not None
    ref_loss, ref_grad = _reference(
        logits, target, weight=weight, label_smoothing=0.1, z_loss=1e-3, softcap=5.0
    )
    assert rel_err(loss, ref_loss) <= LOSS_TOL and rel_err(x.grad, ref_grad) <= TOL[torch.bfloat16]
    with count_syncs() as calls:
        ce_kernels.HOST_CHECK_DEVICES = (DEVICE,)
        ce_kernels.check_targets(target, V, -100)
    assert calls, "the counter must see the host-side check's read"


@pytest.mark.skipif(DEVICE != "cpu", reason="a failed device-side assert ends the CUDA context")
def test_out_of_range_target_on_the_device_path(device_path_check):
    logits, target, _ = _inputs(torch.float32, n=6, v=10, ignore_every=100)
    target[4] = 10
    with pytest.raises(RuntimeError, match=r"must be in \[0, 10\) or equal ignore_index \(-100\)"):
        tkern.cross_entropy(logits, target)


def test_launcher_refuses_an_in_place_gradient():
    from tkern.kernels.cross_entropy import cross_entropy_forward

    logits, target, _ = _inputs(torch.float16, n=4, v=10)
    with pytest.raises(ValueError, match="grad must not share memory with logits"):
        cross_entropy_forward(logits, target, grad=logits, a=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="a .* is needed with grad"):
        cross_entropy_forward(logits, target, grad=torch.empty_like(logits))


def _check_loss_fn(loss_fn, dtype, **kw):
    """``loss_fn(logits, target)`` (a compiled function, a module) against the reference with ``kw``."""
    logits, target, weight = _inputs(dtype, n=20, v=16)
    kw = {**kw, "weight": weight}
    x = logits.clone().requires_grad_()
    loss = loss_fn(x, target, kw)
    loss.backward()
    ref_loss, ref_grad = _reference(logits, target, **kw)
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    assert rel_err(x.grad, ref_grad) <= TOL[dtype]


def test_compile_fullgraph_traces_cross_entropy():
    compiled = torch.compile(
        lambda x, t, kw: tkern.cross_entropy(x, t, **kw), fullgraph=True, backend="aot_eager"
    )
    _check_loss_fn(compiled, torch.float16, label_smoothing=0.1, z_loss=1e-3)


def test_cross_entropy_loss_module():
    def module_loss(x, target, kw):
        module = tkern.nn.CrossEntropyLoss(**kw)
        assert isinstance(module, torch.nn.CrossEntropyLoss)
        assert list(module.state_dict()) == list(torch.nn.CrossEntropyLoss(weight=kw["weight"]).state_dict())
        return module(x, target)

    _check_loss_fn(module_loss, torch.bfloat16, label_smoothing=0.1, z_loss=1e-3, softcap=3.0)


def test_custom_ops_pass_opcheck():
    # schema, fake (meta) implementation, autograd registration and AOT dispatch of both ops
    logits, target, weight = _inputs(torch.float16, n=6, v=10)
    x = logits.clone().requires_grad_()
    torch.library.opcheck(torch.ops.tkern.cross_entropy_rows.default, (x, target, weight, -100, 0.1, 0.0))
    _, lse = torch.ops.tkern.cross_entropy_rows(logits, target, None, -100, 0.0, 2.0)
    grad_loss = torch.ones(6, device=DEVICE)
    args = (logits, target, lse, grad_loss, None, None, -100, 0.0, 2.0)
    torch.library.opcheck(torch.ops.tkern.cross_entropy_backward.default, args)
