"""tkern.linear: output and the three gradients against float64, and against
torch.autocast + F.linear on the GPU."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, gpu_only, rel_err, sum_tolerance

import tkern
from tkern.kernels.activation import ACTIVATIONS, GRAD_FROM_OUTPUT

ACT = {
    None: lambda t: t,
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
#: The activations with a second derivative (the bias reaches dx through them).
CURVED = ("gelu", "silu", "gelu_tanh")


def make(dtype, shape=(3, 5, 64), n=48, bias=True, bias_dtype=None):
    torch.manual_seed(0)
    k = shape[-1]
    x = torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype).requires_grad_()
    b = torch.randn(n, device=DEVICE).to(bias_dtype or dtype).requires_grad_() if bias else None
    return x, w, b


def float64_reference(x, w, b, activation, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    bd = b.detach().double().requires_grad_() if b is not None else None
    y = ACT[activation](F.linear(leaves[0], leaves[1], bd))
    y.backward(dy.double())
    return y, leaves[0].grad, leaves[1].grad, None if bd is None else bd.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACT))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape, n", [((3, 5, 64), 48), ((2, 7, 37), 29)])  # aligned, ragged
def test_linear_forward_and_gradients_vs_float64(dtype, activation, bias, shape, n):
    x, w, b = make(dtype, shape=shape, n=n, bias=bias)
    y = tkern.linear(x, w, b, activation)
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rdx, rdw, rdb = float64_reference(x, w, b, activation, dy)
    tol = TOL[dtype]
    # The forward rounds once, at the store, whatever the activation (its fp32 formula
    # errs by a few 2^-24): TOL.
    assert y.shape == (*shape[:-1], n) and y.dtype == dtype
    assert rel_err(y, ry) < tol
    # Gradients carry one more rounding (the fp16/bf16 pre-activation and dz): 2x.
    assert rel_err(x.grad, rdx) < 2 * tol
    assert rel_err(w.grad, rdw) < 2 * tol
    if bias:
        assert b.grad.dtype == b.dtype
        assert rel_err(b.grad, rdb) < 2 * tol


def test_linear_fp32_bias_gets_fp32_grad():
    x, w, b = make(torch.float16, bias_dtype=torch.float32)
    y = tkern.linear(x, w, b, "gelu")
    y.sum().backward()  # an expanded (stride-0) upstream gradient
    _, _, _, rdb = float64_reference(x, w, b, "gelu", torch.ones_like(y))
    assert b.grad.dtype == torch.float32
    assert rel_err(b.grad, rdb) < 2 * TOL[torch.float16]


def test_only_weight_needs_grad():
    x, w, b = make(torch.float16)
    x.requires_grad_(False)
    tkern.linear(x, w, b, "relu").sum().backward()
    assert x.grad is None and w.grad is not None and b.grad is not None


def test_no_grad_forward_matches_grad_forward():
    x, w, b = make(torch.float16)
    with torch.no_grad():
        y0 = tkern.linear(x, w, b, "gelu")
    y1 = tkern.linear(x, w, b, "gelu")
    assert torch.equal(y0, y1.detach())


@gpu_only
@pytest.mark.parametrize("activation", list(ACT))
def test_linear_matches_autocast(activation):
    x, w, b = make(torch.float16)
    y = tkern.linear(x, w, b, activation)
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cuda", dtype=torch.float16):
        ya = ACT[activation](F.linear(*leaves))
    ya.backward(dy)
    tol = 2 * TOL[torch.float16]
    assert rel_err(y, ya) < tol
    for mine, theirs in zip((x, w, b), leaves, strict=True):
        assert rel_err(mine.grad, theirs.grad) < tol


@pytest.mark.parametrize(
    "args, exc, words",
    [
        (
            ((2, 7), (4, 5), None, None),
            ValueError,
            ["x must have shape (..., 5)", "(2, 7)", "(4, 5)"],
        ),
        (((2, 5), (4, 5, 1), None, None), ValueError, ["weight must be 2-D"]),
        (((2, 5), (4, 5), (5,), None), ValueError, ["bias must have shape (4,)", "(5,)"]),
        (((2, 5), (4, 5), None, "swish"), ValueError, ["activation", "'swish'"]),
    ],
)
def test_linear_bad_input(args, exc, words):
    xs, ws, bs, act = args
    x = torch.zeros(*xs, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(*ws, dtype=torch.float16, device=DEVICE)
    b = None if bs is None else torch.zeros(*bs, dtype=torch.float16, device=DEVICE)
    with pytest.raises(exc) as info:
        tkern.linear(x, w, b, act)
    for word in words:
        assert word in str(info.value)


def test_linear_dtype_mismatch():
    x = torch.zeros(2, 5, device=DEVICE)
    w = torch.zeros(4, 5, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="x must have dtype.*float16.*got.*float32"):
        tkern.linear(x, w)


def _linear_arg_cases():
    """(x, weight, bias, activation) around the common case, one thing changed at a time."""
    h, bf = torch.float16, torch.bfloat16

    def t(*shape, dtype=h, **kw):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE, **kw)

    w = t(4, 5)
    yield t(3, 5), w, t(4), None  # the common case
    yield t(2, 3, 5), w, None, "relu"
    yield t(3, 5), w, t(4, dtype=torch.float32), "gelu"
    yield t(3, 5, dtype=bf), t(4, 5, dtype=bf), t(4, dtype=bf), None
    yield t(3, 5), torch.nn.Parameter(w), torch.nn.Parameter(t(4)), None
    yield t(5, 3).t(), w, None, None  # a transposed x
    yield t(3, 5), t(5, 4).t(), None, None  # a transposed weight
    yield t(3, 5), w, t(8)[::2], None  # a strided bias
    yield t(3, 5, dtype=bf), w, None, None  # dtype mismatch
    yield t(3, 5, dtype=torch.float32), t(4, 5, dtype=torch.float32), None, None
    yield t(3, 5), w, t(4, dtype=bf), None
    yield t(3, 6), w, None, None
    yield t(3, 5), t(4, 5, 1), None, None
    yield t(3, 5), w, t(5), None
    yield t(3, 5), w, t(4, 1), None
    yield t(3, 5), w, None, "swish"
    yield t(3, 5), w, None, ["relu"]
    yield t(3, 0), t(4, 0), t(4), "relu"
    yield t(0, 5), w, None, None
    yield torch.zeros(3, 5, dtype=h, device="meta"), w, None, None
    yield t(3, 5), w, "bias", None


@pytest.mark.parametrize("case", range(21))
def test_linear_fast_path_accepts_only_what_the_checks_accept(case):
    """``linear`` skips its checks when ``linear_args_plainly_valid`` says so: that
    must imply every check passes and the eager path applies; the common case must
    take it (else it saves nothing)."""
    from tkern.ops.linear import check_linear_args, linear_args_plainly_valid

    args = list(_linear_arg_cases())[case]
    try:
        eager = check_linear_args(*args)
    except (TypeError, ValueError, AttributeError):
        eager = None
    if linear_args_plainly_valid(*args):
        assert eager is True
    if case == 0:
        assert linear_args_plainly_valid(*args)


# --------------------------------------------------------------------------- second order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACT))
def test_double_backward_gradient_penalty_vs_float64(dtype, activation):
    # A gradient penalty: the loss is ||d<y, dy>/dx||^2, so its gradient w.r.t. the weights
    # differentiates tkern's backward (create_graph=True).
    x, w, b = make(dtype, shape=(6, 32), n=24)
    dy = torch.randn(6, 24, device=DEVICE).to(dtype)

    def penalty_grads(x, w, b, fn):
        y = fn(x, w, b)
        (gx,) = torch.autograd.grad(y, x, dy.to(y.dtype), create_graph=True)
        grads = torch.autograd.grad(gx.float().pow(2).sum(), (w, b), allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (w, b), strict=True)]

    mine = penalty_grads(x, w, b, lambda x, w, b: tkern.linear(x, w, b, activation))
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = penalty_grads(*leaves, lambda x, w, b: ACT[activation](F.linear(x, w, b)))
    # first-order grads carry 2 roundings (2 * TOL); the penalty's gradient is built from
    # the rounded dz and dx, one more: 4 * TOL. Without a curved activation, b does not
    # reach dx: its penalty gradient is exactly zero on both sides.
    assert mine[0].dtype == dtype and rel_err(mine[0], ref[0]) < 4 * TOL[dtype]
    if activation in CURVED:
        assert rel_err(mine[1], ref[1]) < 4 * TOL[dtype]
    else:
        assert ref[1].abs().max() == 0 and mine[1].abs().max() == 0


def test_first_order_backward_without_create_graph_is_not_a_graph():
    x, w, b = make(torch.float16)
    (gx,) = torch.autograd.grad(tkern.linear(x, w, b, "gelu").sum(), x)
    assert gx.grad_fn is None


# --------------------------------------------------------------------------- K = 0, meta


@pytest.mark.parametrize("activation", list(ACT))
def test_linear_with_no_input_features_returns_act_bias(activation):
    x = torch.randn(3, 0, device=DEVICE).half().requires_grad_()
    w = torch.zeros(4, 0, device=DEVICE).half().requires_grad_()
    b = torch.tensor([-1.0, 0.5, 2.0, 0.0], device=DEVICE).half().requires_grad_()
    y = tkern.linear(x, w, b, activation)
    ref = ACT[activation](F.linear(x.double(), w.double(), b.double()))
    assert y.shape == (3, 4) and rel_err(y, ref) < TOL[torch.float16]
    y.sum().backward()
    leaf = b.detach().double().requires_grad_()
    ACT[activation](leaf.expand(3, 4)).sum().backward()
    assert rel_err(b.grad, leaf.grad) < TOL[torch.float16]
    assert x.grad.shape == (3, 0) and w.grad.shape == (4, 0)


def test_linear_on_meta_tensors_gives_shape_and_dtype():
    x = torch.empty(2, 7, 16, dtype=torch.float16, device="meta", requires_grad=True)
    w = torch.empty(8, 16, dtype=torch.float16, device="meta", requires_grad=True)
    b = torch.empty(8, dtype=torch.float32, device="meta")
    y = tkern.linear(x, w, b, "gelu")
    assert y.device.type == "meta" and y.shape == (2, 7, 8) and y.dtype == torch.float16
    y.sum().backward()
    assert w.grad.shape == w.shape and w.grad.device.type == "meta"


# --------------------------------------------------------------------------- torch.compile


def _compile_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 8)
    ).to(DEVICE)
    tkern.convert_network(model)
    fused = tkern.nn.Linear(8, 8, activation="relu", device=DEVICE)
    return torch.nn.Sequential(model, fused)


def _run(model, x):
    y = model(x)
    y.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


def test_compile_fullgraph_has_no_graph_break_and_matches_eager():
    model = _compile_model()
    x = torch.randn(4, 16, device=DEVICE)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    y0, g0 = _run(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y1, g1 = _run(compiled, x)
    # the same kernels on the same inputs: identical
    assert torch.equal(y0, y1)
    for a, c in zip(g0, g1, strict=True):
        assert torch.equal(a, c)


@pytest.mark.slow
def test_compile_with_inductor_matches_eager():
    model = _compile_model()
    x = torch.randn(4, 16, device=DEVICE)
    y0, g0 = _run(model, x)
    torch._dynamo.reset()
    y1, g1 = _run(torch.compile(model, fullgraph=True), x)
    # Inductor fuses the LayerNorm and the elementwise ops differently (fp32, then one
    # fp16 rounding per element): within the fp16 GEMM tolerance, gradients 2x
    assert rel_err(y1, y0) < TOL[torch.float16]
    for a, c in zip(g0, g1, strict=True):
        assert rel_err(c, a) < 2 * TOL[torch.float16]


def test_linear_on_meta_tensors_checks_dtypes_with_tkern_messages():
    x = torch.empty(2, 16, dtype=torch.float16, device="meta")
    with pytest.raises(TypeError, match="weight must be a 2-D fp16 or bf16 tensor.*float32"):
        tkern.linear(x, torch.empty(8, 16, device="meta"))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 4\)"):
        tkern.linear(x, torch.empty(8, 4, dtype=torch.float16, device="meta"))


# ----------------------------------------------------------------------- what the compile gate covers


def test_linear_launches_only_what_the_compile_gate_compiles(monkeypatch):
    """Every GEMM specialisation tkern.linear launches (forward with each bias,
    activation and pre-activation choice, dgrad and wgrad with their operand
    prologue for each of x, weight and bias needing a gradient or not) is one of
    the launches benchmarks/static_report.py compiles for the compile gate
    (``linear_launches``), and that list holds nothing else but tkern.matmul's
    fp32 outputs: a new epilogue in tkern.linear cannot escape the spill gate."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import static_report

    from tkern.kernels import gemm

    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    seen = set()
    only_into = [False]  # record the wgrads into a flat view alone (a Conv1D weight's pass)

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                arg = dict(zip(self.kernel.arg_names, args, strict=False))
                a = arg["a_ptr"]
                # the strides the kernel reads (linear passes W for W^T, dZ for dZ^T)
                layout = ("N" if arg["stride_ak"] == 1 else "T") + ("N" if arg["stride_bn"] == 1 else "T")
                if only_into[0] and not meta["ACCUMULATE"]:
                    return self.kernel[grid](*args, **meta)
                seen.add(
                    static_report.GemmLaunch(
                        dtype=names[a.dtype],
                        out=names[arg["c_ptr"].dtype],
                        bias=names[arg["bias_ptr"].dtype] if meta["HAS_BIAS"] else None,
                        act=meta["ACTIVATION"],
                        preact=meta["STORE_PREACT"],
                        layout=layout,
                        a_act=meta["A_ACT"],
                        store_a=meta["STORE_A"],
                        sum_a=names[arg["a_sum_ptr"].dtype] if meta["SUM_A"] else None,
                        accumulate=meta["ACCUMULATE"],
                        add_sum=meta.get("ADD_SUM", False),
                        out_t=arg["stride_cm"] == 1 and arg["stride_cn"] != 1,  # C column-major
                    )
                )
                return self.kernel[grid](*args, **meta)

            return launch

    monkeypatch.setattr(gemm, "_matmul_kernel", Recorder(gemm._matmul_kernel))
    monkeypatch.setattr(gemm, "_matmul_accumulate_kernel", Recorder(gemm._matmul_accumulate_kernel))
    # which of x, weight, bias need a gradient: all; a first layer; a frozen weight
    # with and without a trainable bias; None: inference (no pre-activation saved)
    needs = [(True, True, True), (False, True, True), (True, False, True), (True, False, False), None]
    for dtype in (torch.float16, torch.bfloat16):
        for bias_dtype in (None, dtype, torch.float32):
            for activation in ACT:
                for need in needs:
                    x, w, b = make(
                        dtype, shape=(16, 32), n=32, bias=bias_dtype is not None, bias_dtype=bias_dtype
                    )
                    leaves = [t for t in (x, w, b) if t is not None]
                    for t, wanted in zip(leaves, need or (False,) * 3, strict=False):
                        t.requires_grad_(wanted)
                    y = tkern.linear(x, w, b, activation)
                    if need is not None:
                        y.sum().backward()
                    if need is not None and need[1]:  # again, dW added into a fused optimizer's buffer
                        tkern.optim.FusedSGD([w], lr=0.1)
                        tkern.linear(x, w, b, activation).sum().backward()
                        # dW and db both into their buffer's views (db added: ADD_SUM), W as
                        # stored and W stored (in, out) read transposed (Conv1D's: C^T; its
                        # wgrad alone: the forward and dgrad read W in other layouts), its
                        # bias in the buffer or not
                        for stored_t, bias_flat in ((False, True), (True, True), (True, False)):
                            only_into[0] = stored_t
                            x2, w2, b2 = make(
                                dtype, shape=(16, 32), n=32, bias=b is not None, bias_dtype=bias_dtype
                            )
                            for t, wanted in zip(
                                [t for t in (x2, w2, b2) if t is not None], need, strict=False
                            ):
                                t.requires_grad_(wanted)
                            leaf = w2.detach().t().contiguous().requires_grad_() if stored_t else w2
                            flat = [
                                leaf,
                                *([b2] if bias_flat and b2 is not None and b2.requires_grad else []),
                            ]
                            tkern.optim.FusedSGD(flat)
                            w_read = leaf.t() if stored_t else leaf
                            tkern.linear(x2, w_read, b2, activation).sum().backward()
                        only_into[0] = False
    offered = set(static_report.linear_launches())
    assert seen <= offered, sorted(map(str, seen - offered))
    # ReLU's pre-activation is saved by the traced door only (torch.compile, not driven
    # here): eager saves the output instead (activation.GRAD_FROM_OUTPUT)
    from_output = {ACTIVATIONS[a] for a in GRAD_FROM_OUTPUT}
    traced_only = {v for v in offered if v.preact and v.act in from_output}
    assert not seen & traced_only
    assert {v for v in offered - seen - traced_only if v.out != "fp32"} == set()


# ----------------------------------------------------------------------- the fused backward


#: which of x and weight need a gradient: both, a first layer (x does not), a frozen weight
NEEDS_IDS = ["all", "first", "frozen"]


def unfused_grads(x2d, w, b, activation, dy):
    """The backward as four passes (main before issue 16 item 3): dZ by the activation
    kernel, dgrad and wgrad by tkern.matmul on that dZ, dbias by torch in fp32."""
    from tkern.kernels.activation import activation_grad

    preact = torch.empty(x2d.shape[0], w.shape[0], dtype=x2d.dtype, device=DEVICE)
    tkern.matmul(x2d, w.t(), bias=b, activation=activation, preact=preact)  # as the forward saves it
    dz = dy if activation is None else activation_grad(dy, preact, activation)
    return tkern.matmul(dz, w), tkern.matmul(dz.t(), x2d), dz


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation, prologue", [("relu", True), ("gelu", False), ("gelu", True)])
@pytest.mark.parametrize("needs", [(True, True), (False, True), (True, False)], ids=NEEDS_IDS)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_backward_is_bit_identical_to_the_four_passes(
    monkeypatch, dtype, activation, prologue, needs, bias
):
    # Ragged sizes (37 rows, 140 outputs, 150 inputs): dgrad has two column blocks (only
    # the first stores dZ), wgrad two row bands (each sums its own dbias rows). GELU runs
    # both ways: its own pass (the default) and in the GEMMs' prologue.
    from tkern.ops import linear as ops_linear

    if prologue:
        monkeypatch.setattr(ops_linear, "PROLOGUE_ACTIVATIONS", frozenset({"relu", activation}))
    x, w, b = make(dtype, shape=(37, 150), n=140, bias=bias)
    x.requires_grad_(needs[0])
    w.requires_grad_(needs[1])
    y = tkern.linear(x, w, b, activation)
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, dw, dz = unfused_grads(x.detach(), w.detach(), None if b is None else b.detach(), activation, dy)
    assert (x.grad is None) != needs[0] and (w.grad is None) != needs[1]
    if needs[0]:
        assert torch.equal(x.grad, dx)  # the same dot on the same rounded dZ
    if needs[1]:
        assert torch.equal(w.grad, dw)
    if bias:  # fp32 sums in another order, rounded once to the bias's dtype
        ref = dz.float().sum(0)
        assert b.grad.dtype == dtype
        assert ((b.grad.float() - ref).abs() <= sum_tolerance(dz, 0, dtype)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_relu_saves_its_output_not_a_pre_activation_with_the_same_gradient(dtype):
    # activation.GRAD_FROM_OUTPUT: ReLU's mask is read off the output y, which the next
    # layer keeps anyway; no pre-activation is written or held. Pre-activations scaled
    # into fp16's subnormal range (many round to +-0 or the smallest subnormal) give
    # the same gradient bits as the mask of the rounded pre-activation.
    x, w, b = make(dtype, shape=(37, 150), n=140, bias=True)
    with torch.no_grad():
        w.mul_(1e-7)  # |z| ~ 1e-6: fp16 subnormals (bf16 keeps them normal)
        b.mul_(1e-7)
    y = tkern.linear(x, w, b, "relu")
    assert not any(t.numel() and t.data_ptr() != y.data_ptr() and t.shape == y.shape
                   for t in y.grad_fn.saved_tensors if t is not None)  # fmt: skip
    assert any(t is not None and t.data_ptr() == y.data_ptr() for t in y.grad_fn.saved_tensors)
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, dw, _ = unfused_grads(x.detach(), w.detach(), b.detach(), "relu", dy)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_fused_backward_of_an_expanded_output_gradient(bias_dtype):
    # y.sum() hands the backward a stride-0 dY: the prologue reads it beside Z made dense
    x, w, b = make(torch.float16, shape=(37, 40), n=24, bias_dtype=bias_dtype)
    y = tkern.linear(x, w, b, "relu")
    y.sum().backward()
    dy = torch.ones_like(y)
    dx, dw, dz = unfused_grads(x.detach(), w.detach(), b.detach(), "relu", dy)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)
    assert b.grad.dtype == bias_dtype
    assert ((b.grad.float() - dz.float().sum(0)).abs() <= sum_tolerance(dz, 0, bias_dtype)).all()


def test_fused_backward_launches_two_gemms_and_nothing_else(monkeypatch):
    # act' + dbias + dgrad + wgrad: two GEMM launches, no activation pass (four passes before)
    from tkern.kernels import activation as activation_module
    from tkern.kernels import gemm

    x, w, b = make(torch.float16, shape=(16, 32), n=24)
    y = tkern.linear(x, w, b, "relu")
    launches = []
    for module, name in ((gemm, "_matmul_kernel"), (activation_module, "_activation_grad_kernel")):
        kernel = getattr(module, name)

        class Counter:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches.append(name)
                return kernel[grid]

        monkeypatch.setattr(module, name, Counter())
    y.backward(torch.randn_like(y))
    assert launches == ["_matmul_kernel", "_matmul_kernel"]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_custom_op_backward_matches_the_autograd_function(activation):
    # the traced door (tkern::linear_forward's registered backward through tkern::mm_backward),
    # run eagerly: the same kernels as the eager door, so identical gradients
    from tkern.ops import linear as ops_linear

    def saved_preact(x, w, b, activation):  # as graphs traced before ReLU saved its output call it
        y, preact = ops_linear._linear_forward_op(x, w, b, activation, True)
        assert preact.shape == y.shape
        return y

    grads = []
    for door in (tkern.linear, ops_linear._linear_op, saved_preact):
        x, w, b = make(torch.bfloat16, shape=(37, 40), n=24)
        y = door(x, w, b, activation)
        y.backward(torch.ones_like(y) * 0.5)
        grads.append((x.grad, w.grad, b.grad))
    for eager, *traced in zip(*grads, strict=True):
        assert all(torch.equal(eager, t) for t in traced)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("needs", [(True, True), (False, True), (True, False)], ids=NEEDS_IDS)
def test_where_the_gemms_take_the_tma_kernel_the_backward_drops_its_prologue(dtype, needs, monkeypatch):
    # Hopper, GEMMs planned on the TMA kernel (one SM with TMA and gemm_plan.TMA_MIN_WAVES
    # patched to 1; the TMA kernel runs through the interpreter): ReLU's gradient is its own
    # pass and dbias a reduction, so that dgrad and wgrad take the TMA kernel
    # (tkern.ops.linear.PROLOGUE_ON_TMA_SHAPES); same gradients
    from tkern.kernels import gemm, gemm_plan

    routes = []
    launch_tma, launch = gemm.launch_tma, gemm._launch
    monkeypatch.setattr(gemm, "device_gemm_info", lambda device: (1, True))
    monkeypatch.setattr(
        gemm, "plan_gemm_cached", functools.lru_cache(gemm.plan_gemm_cached.__wrapped__)
    )  # a fresh memo
    monkeypatch.setattr(gemm_plan, "TMA_MIN_WAVES", 1)
    monkeypatch.setattr(gemm, "launch_tma", lambda *args: routes.append("tma") or launch_tma(*args))
    monkeypatch.setattr(gemm, "_launch", lambda *args: routes.append("pointer") or launch(*args))
    x, w, b = make(dtype, shape=(64, 32), n=48)
    x.requires_grad_(needs[0])
    w.requires_grad_(needs[1])
    y = tkern.linear(x, w, b, "relu")
    dy = torch.randn_like(y)
    y.backward(dy)
    assert routes == ["tma"] * (1 + sum(needs))  # forward, then each backward GEMM
    _, rdx, rdw, rdb = float64_reference(x, w, b, "relu", dy)
    tol = TOL[dtype]
    assert rel_err(b.grad, rdb) < 2 * tol
    if needs[0]:
        assert rel_err(x.grad, rdx) < 2 * tol
    if needs[1]:
        assert rel_err(w.grad, rdw) < 2 * tol
