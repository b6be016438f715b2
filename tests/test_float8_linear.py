"""Float8Linear, Float8Recipe and convert_network(float8=...).

References: torchao's emulated Float8Linear (tensorwise, forward and backward),
the same model trained in bf16 (every recipe), and the module's own eager run
(state_dict resume, torch.compile); GPT-2's Conv1D as an fp8 layer. The weight cast in
the optimizer's step: test_float8_weight_cast.py.
"""

from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch
from conftest import DEVICE, dequantized
from torch import nn

import tkern
from tkern.nn import Float8Linear, Float8Recipe

RECIPES = ["tensorwise", "delayed", "blockwise"]


def bf16_linear(k=256, n=64, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n).to(DEVICE, torch.bfloat16)


def assert_within(got, ref, rel):
    """|got - ref| <= rel * max |ref| elementwise."""
    bound = rel * ref.float().abs().max().item()
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= bound, f"{err} > {bound}"


def test_tensorwise_matches_torchaos_emulated_float8_linear():
    float8 = pytest.importorskip("torchao.float8")
    lin = bf16_linear()
    ref = float8.convert_to_float8_training(
        nn.Sequential(copy.deepcopy(lin)), config=float8.Float8LinearConfig(emulate=True)
    )
    mine = Float8Linear(256, 64, device=DEVICE)
    mine.load_state_dict(lin.state_dict())
    x = torch.randn(48, 256, device=DEVICE, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = mine(x1), ref(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    # The same fp8 operands and scales (tensorwise casts are bit-exact, test_float8.py);
    # the products are summed in fp32 in another order and rounded once to bf16:
    # one bf16 ulp of the largest output (2^-7 relative) bounds the difference.
    for got, want in ((y1, y2), (x1.grad, x2.grad), (mine.weight.grad, ref[0].weight.grad)):
        assert_within(got, want, 2.0**-7)
    torch.testing.assert_close(mine.bias.grad, ref[0].bias.grad, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_and_gradients_are_the_linear_within_fp8_precision(recipe):
    lin = bf16_linear(seed=1)
    mine = Float8Linear(256, 64, recipe=recipe, device=DEVICE)
    mine.load_state_dict(lin.state_dict())
    x = torch.randn(40, 256, device=DEVICE, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().float().requires_grad_()
    for _ in range(2):  # delayed scaling: the second step casts with the first's amax
        x1.grad = None
        y1 = mine(x1)
        g = torch.randn_like(y1)
        y1.backward(g)
    y2 = nn.functional.linear(x2, lin.weight.float(), lin.bias.float())
    y2.backward(g.float())
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per operand) and e5m2 two;
    # over K = 256 random-sign products the errors average out to a few percent
    # of the largest output (measured ~3%); 10% catches a wrong scale (x2 or more).
    assert_within(y1, y2, 0.1)
    assert_within(x1.grad, x2.grad, 0.15)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_weight_gradient_is_the_product_of_its_quantized_operands(recipe, scaled_mm_calls):
    """dW for every recipe against a float64 product of the fp8 operands the wgrad GEMM
    received (dequantized with their scales): the casts are tested in test_float8.py,
    this is the GEMM, its scales and its operand layout (blockwise re-tiles both)."""
    calls = scaled_mm_calls
    lin = bf16_linear(seed=2)
    mine = Float8Linear(256, 64, recipe=recipe, device=DEVICE)
    mine.load_state_dict(lin.state_dict())
    x = torch.randn(40, 256, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(2):  # delayed scaling: the second step casts with the first's amax
        mine.weight.grad = None
        calls.clear()
        y = mine(x)
        g = torch.randn_like(y)
        y.backward(g)
    (a, b, sa, sb, block_a, block_b) = next(c for c in calls if c[0].shape == (64, 40))  # (N, M) @ (M, K)
    qa, qb = dequantized(a, sa, block_a), dequantized(b, sb, block_b)
    ref = qa @ qb
    # fp8 x fp8 products are exact in fp32; their fp32 sums over M = 40 (per K block,
    # then scaled) each err by <= M * 2^-24 * sum |products|, and the result is
    # rounded once to bf16 (half an ulp, 2^-9 relative): bound both, doubled.
    tol = 2 * (2.0**-9 * ref.abs() + 40 * 2.0**-24 * (qa.abs() @ qb.abs()))
    err = (mine.weight.grad.double() - ref).abs()
    assert (err <= tol).all(), f"max excess {(err - tol).max().item()}"
    # the bound is tight enough to tell the quantized product from the exact one
    exact = g.double().t() @ x.double()
    assert ((mine.weight.grad.double() - exact).abs() > tol).any()


def mlp(width=32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16)
    )


def train(model, steps=30, seed=0) -> list[float]:
    """The loss of each of ``steps`` AdamW steps memorising 32 samples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 32, generator=g).to(DEVICE)
    y = torch.randint(0, 16, (32,), generator=g).to(DEVICE)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.cache
def bf16_losses(steps: int) -> tuple[float, ...]:
    """:func:`train`'s losses for :func:`mlp` converted to bf16 without fp8: the reference
    of every recipe trained for ``steps`` (computed once per process)."""
    return tuple(train(tkern.convert_network(mlp().to(DEVICE), torch.bfloat16), steps))


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "steps"), [("tensorwise", 20), ("delayed", 20), ("blockwise", 8)])
def test_a_small_mlp_trains_to_the_bf16_loss(recipe, steps):
    # (blockwise casts one program per 1x128 tile: slow through the interpreter, fewer steps)
    *_, ref = bf16_losses(steps)
    first = bf16_losses(steps)[0]  # before any step: the loss of the untrained model
    *_, got = train(tkern.convert_network(mlp().to(DEVICE), torch.bfloat16, float8=recipe), steps)
    assert ref < 0.95 * first  # the run learns: the margin below is a real comparison
    # AdamW memorising 32 samples: fp8's rounding moves the final loss by a few
    # percent of it; 10% is the stated margin.
    assert abs(got - ref) <= 0.1 * ref, (got, ref)


def test_delayed_histories_update_only_in_training_with_grad():
    m = Float8Linear(64, 32, recipe=Float8Recipe("delayed", history_len=4), device=DEVICE)
    x = torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)
    m(x).float().sum().backward()
    h = m.fp8_amax_history_input.clone()
    assert h[0] == x.float().abs().max() and (h[1:] == 0).all()
    assert m.fp8_amax_history_grad_output[0] == 1.0  # d(sum)/dy is all ones
    with torch.no_grad():
        m(x * 2)
    m.eval()
    m(x * 3)
    assert torch.equal(m.fp8_amax_history_input, h)


def test_delayed_state_dict_resumes_bit_exactly_and_a_plain_checkpoint_loads_strictly():
    torch.manual_seed(0)
    model = tkern.convert_network(mlp(), torch.bfloat16, float8="delayed").to(DEVICE)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32, device=DEVICE)

    def step(m, o):
        o.zero_grad()
        m(x).float().square().mean().backward()
        o.step()

    for _ in range(2):
        step(model, opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for _ in range(2):
        step(model, opt)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert "0.fp8_amax_history_input" in saved["model"]
    fresh = tkern.convert_network(mlp(seed=5), torch.bfloat16, float8="delayed").to(DEVICE)
    fresh.load_state_dict(saved["model"])
    fopt = tkern.optim.FusedAdamW(fresh.parameters(), lr=1e-3)
    fopt.load_state_dict(saved["opt"])
    for _ in range(2):
        step(fresh, fopt)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # a bf16 checkpoint of the unconverted model (no histories) loads with strict=True
    plain = mlp(seed=7).to(DEVICE, torch.bfloat16).state_dict()
    fresh.load_state_dict(plain, strict=True)
    assert torch.equal(fresh[0].weight, plain["0.weight"])


def test_convert_network_float8_filter_and_sizes():
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Linear(10, 48), nn.Linear(48, 32)
    )
    seen = []

    def keep_last_out(name, module):
        seen.append(name)
        return name != "4"  # e.g. an LM head kept out

    tkern.convert_network(
        model, torch.bfloat16, float8=Float8Recipe("blockwise"), float8_filter=keep_last_out
    )
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Float8Linear", "ReLU", "Linear", "Linear", "Linear"]
    assert isinstance(model[2], tkern.nn.Linear) and model[0].recipe.scaling == "blockwise"
    assert "4" in seen and "2" not in seen  # 10 features: not a multiple of 16, never asked
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_tied_weights_stay_tied_and_a_converted_model_pickles():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight = model[0].weight
    tkern.convert_network(model, torch.bfloat16, float8="tensorwise")
    assert model[1].weight is model[0].weight
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert type(again[0]) is Float8Linear and again[1].weight is again[0].weight


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(scaling="rowwise"), ValueError, "scaling"),
        (dict(history_len=0), ValueError, "history_len"),
        (dict(margin=-1), ValueError, "margin"),
    ],
)
def test_recipe_validation(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        Float8Recipe(**kwargs)
    with pytest.raises(TypeError, match="recipe"):
        Float8Linear(16, 16, recipe=3)
    with pytest.raises(ValueError, match="float32"):
        tkern.convert_network(nn.Sequential(nn.Linear(16, 16)), torch.float32, float8="tensorwise")


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "shape"), [("tensorwise", (8, 64, 32)), ("blockwise", (130, 256, 128))])
def test_torch_compile_fullgraph_matches_eager(recipe, shape):
    """Through the custom ops (fake tensors with the eager outputs' strides), bit for bit
    eager; blockwise with a ragged M (its tile cast's scales K-block-major)."""
    m_rows, k, n = shape
    m = Float8Linear(k, n, recipe=recipe, device=DEVICE)
    x = torch.randn(m_rows, k, device=DEVICE, dtype=torch.bfloat16)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = m(x1), compiled(x2)
    y1.float().sum().backward()
    g1, b1 = m.weight.grad.clone(), m.bias.grad.clone()
    m.weight.grad = m.bias.grad = None
    y2.float().sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(g1, m.weight.grad) and torch.equal(b1, m.bias.grad)


@pytest.mark.slow
def test_cli_train_float8_runs_the_tkern_run_in_fp8(capsys):
    from tkern.train.cli import main

    assert main(["train", "--only", "tkern", "--float8", "delayed", "--epochs", "1", "--no-progress"]) == 0
    assert "tkern" in capsys.readouterr().out


# ----------------------------------------------------------------------- GPT-2's Conv1D


def test_gpt2_conv1d_layers_become_fp8_layers_on_the_transposed_weight():
    """issue 17 item 4: a GPT-2 Conv1D (x @ W + b, W stored (in, out)) converted with float8
    is the Float8Linear of W^T, bit for bit, forward and backward; names, shapes and the
    state_dict stay the Conv1D's; converting back gives transformers' Conv1D."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D as HFConv1D

    torch.manual_seed(0)
    conv = nn.Sequential(HFConv1D(48, 32)).to(DEVICE)  # nf=48 out, nx=32 in
    keys = set(conv.state_dict())
    tkern.convert_network(conv, torch.bfloat16, float8="tensorwise")
    layer = conv[0]
    assert type(layer).__name__ == "Float8Conv1D" and isinstance(layer, HFConv1D)
    assert set(conv.state_dict()) == keys and layer.weight.shape == (32, 48)
    ref = Float8Linear(32, 48, recipe="tensorwise").to(DEVICE)
    with torch.no_grad():
        ref.weight.copy_(layer.weight.t())
        ref.bias.copy_(layer.bias)
    x = torch.randn(5, 32, device=DEVICE).to(torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = conv(x1), ref(x2)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(layer.weight.grad, ref.weight.grad.t())
    assert torch.equal(layer.bias.grad, ref.bias.grad)
    # the optimizer's cast of the stored weight serves the transposed GEMM operand
    opt = tkern.optim.FusedAdamW(conv.parameters(), lr=1e-2)
    opt.step()
    fresh = copy.deepcopy(conv)
    assert torch.equal(conv(x), fresh(x))
    tkern.convert_network(conv, torch.float32)
    assert type(conv[0]) is HFConv1D and conv[0].weight.dtype == torch.float32


def test_a_tiny_gpt2_trains_with_fp8_conv1d_layers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(DEVICE)
    tkern.convert_network(
        model, torch.bfloat16, float8="tensorwise", float8_filter=lambda n, m: "lm_head" not in n
    )
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Float8Conv1D" in kinds
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 16), device=DEVICE)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
