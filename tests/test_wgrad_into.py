"""tkern.linear's weight gradient added by its GEMM straight into a fused
optimizer's flat gradient buffer (issue 16, item 3): the ``C +=`` epilogue, and
autograd adopting that memory as ``.grad`` without a copy or an add. The bias
gradient the wgrad GEMM sums goes the same way (its row sums added into the
bias's view, ``ADD_SUM``), and so does the weight of GPT-2's ``Conv1D``, stored
transposed (dW written through the transposed view; issue 54: no ``add_`` per
parameter in a step).

The reference is the same model and optimizer with the fused accumulation
turned off (``common.flat_wgrad`` patched to decline): AccumulateGrad then
adds a fresh dW into ``.grad`` as before. Into a zeroed buffer the two are the
same bits (0 + x == x in fp32); a second micro-batch is rounded once instead of
twice (``round(g + dW_fp32)`` against ``round(g + round(dW_fp32))``), so the two
differ by at most one rounding of the sum per micro-batch: an fp16/bf16 ulp.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DEVICE
from torch import nn

import tkern
from tkern.flat import grad_is_flat_view
from tkern.ops import common
from tkern.optim import FusedAdamW

HALF = [torch.float16, torch.bfloat16]
#: One rounding of a sum in the gradient's dtype, relative: half an ulp (2^-11, 2^-8).
HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _model(dtype, activation="relu", bias=True):
    torch.manual_seed(0)
    return nn.Sequential(
        tkern.nn.Linear(12, 24, bias=bias, activation=activation),
        tkern.nn.Linear(24, 8, bias=bias),
    ).to(device=DEVICE, dtype=dtype)


def _batches(dtype, n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 12, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(n)]


def _loss(model, x):
    return model(x).float().square().mean()


@pytest.fixture
def counts(wgrad_counts):
    """How often the fused accumulation ran, and how often a gradient was copied into the buffer."""
    return wgrad_counts


@contextlib.contextmanager
def _unfused(monkeypatch):
    """A context in which every backward declines the fused accumulation (the reference)."""
    with monkeypatch.context() as m:
        m.setattr(common, "flat_wgrad", lambda *args: None)
        yield


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_one_micro_batch_gives_the_same_bits_without_a_copy(dtype, activation, bias, counts, monkeypatch):
    fused, ref = _model(dtype, activation, bias), _model(dtype, activation, bias)
    opts = FusedAdamW(fused.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)  # noqa: F841 (kept)
    (x,) = _batches(dtype, 1)
    _loss(fused, x).backward()
    assert counts == {"into": 2 * (1 + bias), "copies": 0}  # weights and biases in place, nothing copied
    with _unfused(monkeypatch):
        _loss(ref, x).backward()
    for (name, p), q in zip(fused.named_parameters(), ref.parameters(), strict=True):
        assert grad_is_flat_view(p), name  # .grad is the buffer's view again
        assert torch.equal(p.grad, q.grad), name


def _train(model, batches, micro, zero_model=False):
    """Steps of ``micro`` micro-batches each, zeroing the gradients before each step
    through the optimizer or the model (``.grad`` None); each step's gradients."""
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    grads = []
    for s in range(len(batches) // micro):
        (model if zero_model else opt).zero_grad(set_to_none=True)
        for x in batches[s * micro : (s + 1) * micro]:
            (_loss(model, x) / micro).backward()
        assert all(grad_is_flat_view(p) for p in model.parameters())
        grads.append([p.grad.float().clone() for p in model.parameters()])
        opt.step()
    return grads


def _assert_one_rounding_apart(fused, ref, micro, dtype):
    """Each micro-batch after the first: one rounding apart, on partial sums <= |final| * micro."""
    for step_f, step_r in zip(fused, ref, strict=True):
        for f, r in zip(step_f, step_r, strict=True):
            tol = (micro - 1) * HALF_ULP[dtype] * 2 * r.abs().max().item()
            assert (f - r).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", HALF)
def test_training_with_micro_batches_tracks_the_unfused_run(dtype, monkeypatch):
    # 3 steps of 3 micro-batches, zero_grad(set_to_none=True) between steps: the fused
    # gradients must count as "has a gradient" (the kernel's write bumps the version).
    # (A step the fused run failed to take, its gradients not counted, would show in the
    # next step's gradients: the reference's params would have moved and the fused run's not.)
    batches = _batches(dtype, 9)
    fused = _train(_model(dtype), batches, micro=3)
    with _unfused(monkeypatch):
        ref = _train(_model(dtype), batches, micro=3)
    _assert_one_rounding_apart(fused, ref, 3, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_one_micro_batch_per_step_trains_bit_identically(dtype, monkeypatch):
    batches = _batches(dtype, 3)

    def train(model):
        opt = FusedAdamW(model.parameters(), lr=1e-2)
        for x in batches:
            opt.zero_grad()
            _loss(model, x).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    fused = train(_model(dtype))
    with _unfused(monkeypatch):
        ref = train(_model(dtype))
    for f, r in zip(fused, ref, strict=True):
        assert torch.equal(f, r)


def test_autograd_grad_captures_without_touching_dot_grad(counts):
    dtype = torch.float16
    model, plain = _model(dtype), _model(dtype)  # plain: no optimizer, .grad never flat
    opt = FusedAdamW(model.parameters(), lr=1e-3)  # noqa: F841 (kept alive: its hooks put .grad back)
    x, x2 = _batches(dtype, 2)
    _loss(model, x).backward()
    before = [p.grad.clone() for p in model.parameters()]
    got = torch.autograd.grad(_loss(model, x2), list(model.parameters()))
    want = torch.autograd.grad(_loss(plain, x2), list(plain.parameters()))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)  # the captured gradient alone, not .grad + it
    for b, p in zip(before, model.parameters(), strict=True):
        assert grad_is_flat_view(p) and torch.equal(p.grad, b)
    # a backward that does not reach the weights (inputs=[x]) leaves them alone too
    xg = x2.clone().requires_grad_()
    _loss(model, xg).backward(inputs=[xg])
    for b, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(p.grad, b)
    assert counts["into"] == 4  # the first backward only (two weights, two biases)


def test_a_tensor_hook_on_the_weight_sees_only_the_new_gradient(counts, monkeypatch):
    # a hook rewrites the incoming gradient before it is accumulated: no fused accumulation
    dtype = torch.float16
    fused, ref = _model(dtype), _model(dtype)
    opts = [FusedAdamW(m.parameters(), lr=1e-3) for m in (fused, ref)]  # noqa: F841 (kept)
    for m in (fused, ref):
        m[0].weight.register_hook(lambda g: g * 2)
    for x in _batches(dtype, 2):
        _loss(fused, x).backward()
        with _unfused(monkeypatch):
            _loss(ref, x).backward()
    assert counts["into"] == 4  # the second layer's weight and bias only, once per micro-batch
    for p, q in zip(fused.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2 * HALF_ULP[dtype], atol=1e-6)
    assert torch.equal(fused[0].weight.grad, ref[0].weight.grad)  # not fused: same bits


@pytest.mark.parametrize("dtype", HALF)
def test_a_weight_used_twice_sums_both_uses(dtype, counts, monkeypatch):
    # the first use adds into the buffer, the second returns its gradient: autograd sums them
    def run(model, x):
        layer = model[0]  # 12 -> 24, applied again to the first 12 columns of its output
        layer(layer(x)[:, :12]).float().square().mean().backward()

    def make():
        torch.manual_seed(0)
        return nn.Sequential(tkern.nn.Linear(12, 24)).to(device=DEVICE, dtype=dtype)

    fused, ref = make(), make()
    opts = FusedAdamW(fused.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)  # noqa: F841
    (x,) = _batches(dtype, 1)
    run(fused, x)
    assert counts["into"] == 2  # the outer use (W, b); the inner one finds .grad taken and returns its share
    with _unfused(monkeypatch):
        run(ref, x)
    for p, q in zip(fused.parameters(), ref.parameters(), strict=True):
        assert grad_is_flat_view(p)
        # the two uses' sum rounded once in one order or the other
        torch.testing.assert_close(p.grad, q.grad, rtol=2 * HALF_ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_after_model_zero_grad_the_gradient_is_written_into_the_buffer(dtype, counts, monkeypatch):
    # model.zero_grad() (set_to_none, as HF and Lightning loops call it) leaves .grad None:
    # the wgrad GEMM writes dW and db into the flat views (no C +=) and autograd adopts them
    # as they are: nothing is copied in
    batches = _batches(dtype, 4)
    fused = _train(_model(dtype), batches, micro=2, zero_model=True)
    assert counts == {"into": 4 * 4, "copies": 0}
    with _unfused(monkeypatch):
        ref = _train(_model(dtype), batches, micro=2, zero_model=True)
    _assert_one_rounding_apart(fused, ref, 2, dtype)


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_a_shared_weight_after_either_zero_grad_sums_both_uses(zero, counts, monkeypatch):
    # the first use takes the flat view (adds or writes); the second finds it taken
    # and returns its share, which autograd adds to the first before .grad is set
    dtype = torch.float16

    def make():
        torch.manual_seed(0)
        return nn.Sequential(tkern.nn.Linear(12, 12)).to(device=DEVICE, dtype=dtype)

    def run(model, opt, x):
        (opt if zero == "optimizer" else model).zero_grad(set_to_none=True)
        layer = model[0]
        layer(layer(x)).float().square().mean().backward()

    fused, ref = make(), make()
    opts = FusedAdamW(fused.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)
    (x,) = _batches(dtype, 1)
    run(fused, opts[0], x)
    assert counts["into"] == 2  # the outer use's weight and bias
    with _unfused(monkeypatch):
        run(ref, opts[1], x)
    for p, q in zip(fused.parameters(), ref.parameters(), strict=True):
        assert grad_is_flat_view(p)
        torch.testing.assert_close(p.grad, q.grad, rtol=2 * HALF_ULP[dtype], atol=1e-6)


def test_without_a_fused_optimizer_nothing_changes(counts):
    dtype = torch.float16
    model = _model(dtype)
    g0 = torch.zeros_like(model[0].weight)
    model[0].weight.grad = g0  # a plain tensor, not a flat view: AccumulateGrad adds in place
    _loss(model, _batches(dtype, 1)[0]).backward()
    assert counts["into"] == 0
    assert model[0].weight.grad is g0


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_float8_linear_adds_its_wgrad_into_the_buffer_too(recipe, counts, monkeypatch):
    # the fp8 wgrad (scaled_mm) with the same C += epilogue: its scales multiply the
    # fp32 product before C is added, so into a zeroed buffer the bits are the same
    def make():
        torch.manual_seed(0)
        return nn.Sequential(
            tkern.nn.Float8Linear(32, 64, recipe=recipe), tkern.nn.Float8Linear(64, 16, recipe=recipe)
        ).to(DEVICE)

    fused, ref = make(), make()
    opts = FusedAdamW(fused.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)  # noqa: F841
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 32, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    _loss(fused, x).backward()
    assert counts == {"into": 2, "copies": 0}
    with _unfused(monkeypatch):
        _loss(ref, x).backward()
    for (name, p), q in zip(fused.named_parameters(), ref.parameters(), strict=True):
        assert grad_is_flat_view(p), name
        assert torch.equal(p.grad, q.grad), name


def test_a_view_taken_by_a_failed_backward_is_released_by_zero_grad():
    from tkern.flat import take_grad_view

    w = nn.Parameter(torch.zeros(4, 3, dtype=torch.float16, device=DEVICE))
    opt = FusedAdamW([w], lr=1e-3)
    view, accumulate = take_grad_view(w)  # a backward took it and failed before its hook ran
    assert view is w.grad and accumulate
    assert take_grad_view(w) is None  # still taken
    opt.zero_grad()
    assert take_grad_view(w) == (view, True)  # released
    opt.zero_grad()
    w.grad = None  # as model.zero_grad() leaves it: the gradient is written, not added
    assert take_grad_view(w) == (view, False)


def _conv1d_model(dtype, float8=None):
    """Two GPT-2 ``Conv1D`` layers (weights stored (in, out)), converted by tkern."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    model = nn.Sequential(pytorch_utils.Conv1D(32, 16), nn.GELU(), pytorch_utils.Conv1D(16, 32)).to(DEVICE)
    return tkern.convert_network(model, dtype, float8=float8)


def _dispatched(fn) -> list[str]:
    """The aten ops ``fn`` runs, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        fn()
    return seen.names


@pytest.mark.parametrize("dtype", HALF)
def test_a_transposed_conv1d_weight_and_its_bias_go_into_the_buffer(dtype, counts, monkeypatch):
    # Conv1D's forward reads W.t(): dW is written through the transposed flat view and handed
    # back through autograd's transpose as the weight's own memory; db by the wgrad GEMM
    fused, ref = _conv1d_model(dtype), _conv1d_model(dtype)
    opts = FusedAdamW(fused.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)  # noqa: F841
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(24, 16, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(2)]
    for step, x in enumerate(batches):  # into a zeroed buffer, then added into it
        ops = _dispatched(lambda x=x: _loss(fused, x).backward())
        assert "add_" not in ops and "add" not in ops, ops  # AccumulateGrad added nothing
        assert counts == {"into": 4 * (step + 1), "copies": 0}
        with _unfused(monkeypatch):
            _loss(ref, x).backward()
        for (name, p), q in zip(fused.named_parameters(), ref.parameters(), strict=True):
            assert grad_is_flat_view(p), name
            if step == 0:  # 0 + x: the same bits
                assert torch.equal(p.grad, q.grad), name
            else:  # the sum rounded once, not twice
                torch.testing.assert_close(p.grad, q.grad, rtol=2 * HALF_ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_a_float8_conv1d_weight_goes_into_the_buffer_through_its_transpose(recipe, counts, monkeypatch):
    fused, ref = _conv1d_model(torch.bfloat16, recipe), _conv1d_model(torch.bfloat16, recipe)
    assert sum(type(m).__name__ == "Float8Conv1D" for m in fused.modules()) == 2
    opts = FusedAdamW(fused.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)  # noqa: F841
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(4)).to(
        device=DEVICE, dtype=torch.bfloat16
    )
    _loss(fused, x).backward()
    assert counts == {"into": 2, "copies": 0}  # the two weights (fp8 biases are summed apart)
    with _unfused(monkeypatch):
        _loss(ref, x).backward()
    for (name, p), q in zip(fused.named_parameters(), ref.parameters(), strict=True):
        assert grad_is_flat_view(p), name
        assert torch.equal(p.grad, q.grad), name
