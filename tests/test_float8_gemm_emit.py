"""An fp8 GEMM's epilogue writes the next fp8 GEMM's input (issue 43 item 3): scaled_mm's
``emit_fp8``, float8_linear's, and GPT-2's fused MLP handing c_proj its e4m3 input from c_fc.

Every comparison is bit for bit against the unfused path (the GEMM, then the next layer's
own ``cast_2d`` of its output): the emitting kernel runs the same program body and epilogue
as the plain one and casts with the cast kernel's tile code, so C, its cast, the scale, the
histories, the forward and every gradient must be the same bytes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import DEVICE
from test_float8_passes import launches  # noqa: F401 (the fixture)
from test_float8_producers import _gpt2 as _converted_gpt2
from test_float8_producers import _train

import tkern
from tkern.kernels.float8 import cast_2d, to_float8, to_float8_delayed_deferred
from tkern.nn.float8_emit import Float8GemmEmitter, remove_float8_emit
from tkern.ops.float8 import float8_linear

pytestmark = [
    pytest.mark.skipif(not tkern.INTERPRET, reason="fp8 on the CPU runs through Triton's interpreter"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),  # the interpreter's GELU
]


def _bits(t):
    """A tensor's bytes, so that NaN == NaN and -0 != +0 (bit for bit)."""
    return None if t is None else t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(_bits(a), _bits(b)))


def _operands(m, k, n, bias):
    torch.manual_seed(0)
    x = (torch.randn(m, k, device=DEVICE) * 2).to(torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE).to(torch.bfloat16)
    xq, sx = to_float8(x)
    wq, sw = to_float8(w)
    b = torch.randn(n, device=DEVICE).to(torch.bfloat16) if bias else None
    return xq, wq.t(), sx, sw, b


# --------------------------------------------------------------------------- kernel


@pytest.mark.parametrize(
    ("m", "n", "bias", "activation", "store_t"),
    [
        (200, 160, True, "gelu_tanh", True),  # 2 x 2 tiles of 128, ragged at both edges
        (40, 24, False, None, False),  # one ragged tile, no bias, no activation, no C^T
    ],
)
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_scaled_mm_emits_cast_2d_of_its_output(scaling, m, n, bias, activation, store_t):
    a, b, sa, sb, bias_t = _operands(m, 64, n, bias)
    kw = dict(bias=bias_t, out_dtype=torch.bfloat16, activation=activation)
    want_c = tkern.scaled_mm(a, b, sa, sb, **kw)
    delayed = scaling == "delayed"
    history = torch.rand(4, device=DEVICE) * 8 if delayed else None
    roll2 = None
    ref_hist = ref_roll2 = None
    if delayed:  # a cached weight's deferred update rides on the launch (cast_2d's roll2)
        w_hist = torch.rand(3, device=DEVICE)
        _, _, w_amax = to_float8_delayed_deferred(torch.randn(16, 16, device=DEVICE), w_hist)
        roll2, ref_hist, ref_roll2 = (w_hist, w_amax), history.clone(), (w_hist.clone(), w_amax)
    emit = tkern.Float8Emit(scaling, store_t=store_t, history=history, margin=1, roll2=roll2)
    c, got = tkern.scaled_mm(a, b, sa, sb, **kw, emit_fp8=emit)
    want = cast_2d(want_c, store_t=store_t, history=ref_hist, margin=1 if delayed else 0, roll2=ref_roll2)
    assert _same(c, want_c)
    assert _same(got.data, want.data) and _same(got.data_t, want.data_t) and _same(got.scale, want.scale)
    if delayed:
        assert _same(history, ref_hist) and _same(roll2[0], ref_roll2[0])
        assert history[0] == want_c.float().abs().max()


def test_delayed_emit_without_update_leaves_the_history():
    a, b, sa, sb, _ = _operands(40, 32, 48, False)
    history = torch.rand(4, device=DEVICE)
    before = history.clone()
    c, got = tkern.scaled_mm(
        a, b, sa, sb, emit_fp8=tkern.Float8Emit("delayed", history=history, update=False)
    )
    want = cast_2d(c, store_t=True, history=before.clone(), update=False)
    assert _same(history, before) and _same(got.data, want.data) and _same(got.scale, want.scale)


def test_an_empty_output_still_casts_and_rolls():
    a, b, sa, sb, _ = _operands(0, 32, 16, False)
    history = torch.rand(4, device=DEVICE)
    ref = history.clone()
    c, got = tkern.scaled_mm(a, b, sa, sb, emit_fp8=tkern.Float8Emit("delayed", history=history))
    want = cast_2d(c, store_t=True, history=ref)
    assert c.shape == (0, 16) and got.data.shape == (0, 16) and got.data_t.shape == (16, 0)
    assert _same(history, ref) and _same(got.scale, want.scale)


def test_tensorwise_emit_is_two_launches_with_no_amax_pass(launches):  # noqa: F811
    a, b, sa, sb, bias = _operands(40, 32, 48, True)
    launches.clear()
    tkern.scaled_mm(a, b, sa, sb, bias=bias, emit_fp8=tkern.Float8Emit())
    names = [name for name, _ in launches]
    assert names == ["_matmul_emit_kernel", "_cast_2d_kernel"], names
    assert not launches[1][1]["AMAX_ONLY"]


def test_scaled_mm_checks_emit_fp8_before_launching(launches):  # noqa: F811
    a, b, sa, sb, _ = _operands(16, 32, 16, False)
    history = torch.zeros(4, device=DEVICE)
    blocks = torch.ones(1, 1, device=DEVICE)
    cases = [
        (TypeError, "emit_fp8 must be a tkern.Float8Emit", dict(emit_fp8="tensorwise")),
        (ValueError, "emit_fp8: scaling", dict(emit_fp8=tkern.Float8Emit("blockwise"))),
        (ValueError, "emit_fp8: dtype", dict(emit_fp8=tkern.Float8Emit(dtype=torch.float8_e5m2))),
        (ValueError, "emit_fp8: out_dtype", dict(emit_fp8=tkern.Float8Emit(), out_dtype=torch.float32)),
        (ValueError, "emit_fp8: cannot be combined", dict(emit_fp8=tkern.Float8Emit(),
                                                          out=torch.empty(16, 16, device=DEVICE,
                                                                          dtype=torch.bfloat16))),
        (ValueError, "needs the consumer's input amax history", dict(emit_fp8=tkern.Float8Emit("delayed"))),
        (ValueError, "history and roll2", dict(emit_fp8=tkern.Float8Emit(history=history))),
        (ValueError, "roll2 rides", dict(emit_fp8=tkern.Float8Emit(
            "delayed", history=history, update=False, roll2=(history, history)))),
        (TypeError, "emit_fp8.counter", dict(emit_fp8=tkern.Float8Emit(counter=history[:1]))),
    ]  # fmt: skip
    launches.clear()
    for error, match, kw in cases:
        with pytest.raises(error, match=match):
            tkern.scaled_mm(a, b, sa, sb, **kw)
    with pytest.raises(ValueError, match="emit_fp8: the emitting epilogue takes per-tensor"):
        tkern.scaled_mm(
            a, b, blocks, blocks, block_a=(16, 128), block_b=(128, 16), emit_fp8=tkern.Float8Emit()
        )
    assert not launches and not history.any()


# --------------------------------------------------------------------------- float8_linear


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_float8_linear_emit_feeds_the_next_layer_bit_for_bit(scaling):
    """c_fc (GELU in its epilogue) -> c_proj with the emitted cast as c_proj's x_fp8: the
    outputs, the gradients and the histories of the unfused pair (c_proj casting h)."""
    torch.manual_seed(1)
    x = torch.randn(24, 32, device=DEVICE).to(torch.bfloat16)
    w1, w2 = (torch.randn(n, k, device=DEVICE).to(torch.bfloat16) for n, k in ((48, 32), (32, 48)))
    delayed = scaling == "delayed"
    start = torch.rand(2, 3, 4, device=DEVICE) * 4
    results = []
    for emit in (True, False):
        p1, p2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        xg = x.clone().requires_grad_()
        h1, h2 = (None, None) if not delayed else (tuple(start[i].clone()) for i in range(2))
        spec = None
        if emit:
            spec = tkern.Float8Emit(scaling, history=h2 and h2[0], margin=1 if delayed else 0)
        kw = dict(scaling=scaling, margin=1 if delayed else 0, activation="gelu_tanh")
        out = float8_linear(xg, p1, histories=h1, emit_fp8=spec, **kw)
        h, x_fp8 = out if emit else (out, None)
        y = float8_linear(h, p2, scaling=scaling, margin=kw["margin"], histories=h2, x_fp8=x_fp8)
        y.float().square().sum().backward()
        results.append([h, y, xg.grad, p1.grad, p2.grad, *(t for hs in (h1, h2) if hs for t in hs)])
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert _same(a, b), i


def test_float8_linear_checks_emit_fp8():
    x = torch.randn(8, 32, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(16, 32, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match='emit_fp8: the producing layer.*"blockwise"'):
        float8_linear(x, w, scaling="blockwise", emit_fp8=tkern.Float8Emit())
    with pytest.raises(ValueError, match="emit_fp8: the producing layer must be bf16 or fp16"):
        float8_linear(x.float(), w.float(), emit_fp8=tkern.Float8Emit())
    with pytest.raises(RuntimeError, match="eagerly only"):
        float8_linear(x.to("meta"), w.to("meta"), emit_fp8=tkern.Float8Emit())


# --------------------------------------------------------------------------- GPT-2's MLP


def _gpt2(scaling):
    """test_float8_producers' one-layer GPT-2 LM, converted under ``scaling`` (history of 4)."""
    return _converted_gpt2(tkern.nn.Float8Recipe(scaling, history_len=4))


def _unfused(model):
    """A deep copy of ``model`` whose c_fc emits nothing (c_proj casts its input)."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        remove_float8_emit(m)
    return twin


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_gpt2_trains_bit_for_bit_as_without_c_fc_emitting(scaling, launches):  # noqa: F811
    """Two steps (the second on the optimizer's weight casts): losses, every gradient and
    every amax history the bytes of the unfused path; one launch fewer per step (c_proj's
    input cast under delayed, its amax pass under tensorwise)."""
    model = _gpt2(scaling)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    mlp = model.transformer.h[0].mlp
    emitter = mlp.c_fc.fp8_emitter
    assert isinstance(emitter, Float8GemmEmitter) and mlp.c_proj.fp8_producer is emitter
    twin = _unfused(model)
    assert "fp8_producer" not in vars(twin.transformer.h[0].mlp.c_proj)
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    launches.clear()
    fused = _train(model, 2, ids)
    fused_launches = len(launches)
    launches.clear()
    plain = _train(twin, 2, ids)
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert _same(a, b), i
    assert len(launches) - fused_launches == 2
    assert [(n, id(p)) for n, p in model.named_parameters()] == before
    assert model.state_dict().keys() == twin.state_dict().keys()


@pytest.mark.parametrize(("scaling", "fused", "plain"), [("tensorwise", 5, 6), ("delayed", 3, 4)])
def test_c_proj_forward_no_longer_casts_its_input(scaling, fused, plain, launches):  # noqa: F811
    """GPT-2's fp8 MLP forward after an optimizer step: tensorwise x's amax and cast, c_fc's
    emitting GEMM, h's cast (no amax pass), c_proj's GEMM (was 6: h's amax pass too);
    delayed: x's cast, c_fc's emitting GEMM, c_proj's GEMM (was 4: h's cast)."""
    model = _gpt2(scaling)
    counts = []
    for m in (model, _unfused(model)):
        mlp = m.transformer.h[0].mlp
        opt = tkern.optim.FusedAdamW(mlp.parameters(), lr=1e-3)
        x = torch.randn(2, 16, 64, device=DEVICE).to(torch.bfloat16).requires_grad_()
        mlp(x).float().sum().backward()
        opt.step()
        launches.clear()
        mlp(x)
        counts.append([name for name, _ in launches])
    assert (len(counts[0]), len(counts[1])) == (fused, plain), counts
    assert counts[0][-1] == "_matmul_kernel" and counts[0][-2:-1] == (
        ["_matmul_emit_kernel"] if scaling == "delayed" else ["_cast_2d_kernel"]
    ), counts


def test_c_proj_given_another_tensor_casts_it_itself():
    model = _gpt2("delayed").eval()
    mlp = model.transformer.h[0].mlp
    x = torch.randn(2, 8, 64, device=DEVICE).to(torch.bfloat16)
    twin = _unfused(model).transformer.h[0].mlp
    h = tkern.nn.float8.float8_forward(mlp.c_fc, x, "gelu_tanh")
    other = h.clone()
    assert _same(mlp.c_proj(other), twin.c_proj(other))
    # the emission is used once, by the exact module it was made for
    h = tkern.nn.float8.float8_forward(mlp.c_fc, x, "gelu_tanh")
    assert mlp.c_fc.fp8_emitter.take(twin.c_proj, h) is None
    assert mlp.c_fc.fp8_emitter.take(mlp.c_proj, h) is not None
    assert mlp.c_fc.fp8_emitter.take(mlp.c_proj, h) is None


def test_under_delayed_training_c_proj_given_another_tensor_warns():
    model = _gpt2("delayed")
    mlp = model.transformer.h[0].mlp
    h = tkern.nn.float8.float8_forward(mlp.c_fc, torch.randn(2, 8, 64, device=DEVICE).to(torch.bfloat16),
                                       "gelu_tanh")  # fmt: skip
    with pytest.warns(UserWarning, match="not its producer's output"):
        mlp.c_proj(h.clone())


def test_the_hand_off_pickles_copies_and_converts_back():
    model = _gpt2("tensorwise").eval()
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        mlp = twin.transformer.h[0].mlp
        e = mlp.c_fc.fp8_emitter
        assert e.producer is mlp.c_fc and e.consumer is mlp.c_proj and mlp.c_proj.fp8_producer is e
    tkern.convert_network(model, torch.float32)
    assert all("fp8_emitter" not in vars(m) and "fp8_producer" not in vars(m) for m in model.modules())
