"""tkern.layer_norm / rms_norm / add_layer_norm / add_rms_norm against float64
references (``F.layer_norm`` / ``F.rms_norm`` on the same values in double).

Tolerances come from conftest's one table, ``TOL`` (keyed by the output's dtype):
every output here is an fp32 value rounded once to that dtype, so its relative
error is at most the unit roundoff u (fp16 4.9e-4, bf16 3.9e-3) plus the fp32
arithmetic's ~sqrt(N) * 2^-24, inside TOL's 2u; fp32 outputs (and the fp32
dweight / dbias sums over a few rows) are within a few 2^-24, inside TOL's 2e-6.
Gradients dx are a difference of terms of size rstd * |w * dy| (exactly 0 for a
LayerNorm of one element), so their error is measured against that scale.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, eager_and_compiled
from torch import nn

import tkern
from tkern.kernels.norm import MAX_BLOCK
from tkern.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
#: hidden sizes: one element, odd sizes in one block, and one row over MAX_BLOCK (chunked)
CHUNKED = MAX_BLOCK + 9
SIZES = [1, 1023, 1500, CHUNKED]
#: an offset on unit-variance fp32 data: the mean then carries fp32's rounding of
#: itself, half an ulp of 2000 (6.1e-5 of a standard deviation) per element, as in
#: torch's own fp32 kernels; bound 2^-23 * OFFSET (2.4e-4, twice that) per element.
OFFSET = 2000.0
OFFSET_TOL = OFFSET * 2.0**-23


def rel(out: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, scale) in float64; 0 for an exact zero."""
    diff = (out.double().cpu() - ref.double().cpu()).norm().item()
    denom = max(ref.double().norm().item(), scale)
    return diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))


def shape_for(n: int) -> tuple[int, ...]:
    return (3, n) if n > MAX_BLOCK else (2, 3, n)  # a few rows over the block threshold


def reference(kind: str, x, w, b, eps):
    """The float64 reference norm of ``x`` (double, requires grad)."""
    n = x.shape[-1]
    if kind == "rms":
        return F.rms_norm(x, (n,), w, eps)
    return F.layer_norm(x, (n,), w, b, eps)


def run_case(kind, dtype, n, has_weight, has_bias, *, offset=0.0, seed=0):
    """((y, dx, dw, db), the reference's, (dx's scale, dw's scale)) for one configuration."""
    gen = torch.Generator().manual_seed(seed)
    shape = shape_for(n)
    x = (torch.randn(shape, generator=gen) + offset).to(dtype).to(DEVICE)
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE) if has_weight else None
    b = (0.5 * torch.randn(n, generator=gen)).to(DEVICE) if has_bias else None
    eps = 1e-5
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    y = layer_norm(x, n, w, b, eps) if kind == "ln" else rms_norm(x, n, w, eps)
    y.backward(dy)
    xd, wd, bd = (None if t is None else t.detach().double().requires_grad_() for t in (x, w, b))
    yd = reference(kind, xd, wd, bd, eps)
    yd.backward(dy.double())
    # dx's scale: rstd * |w * dy| (the terms dx is a difference of)
    xc = xd.detach() if kind == "rms" else xd.detach() - xd.detach().mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    wdy = dy.double() * (1 if w is None else wd.detach())
    scale = (rstd * wdy).norm().item()
    dw_scale = dy.double().abs().reshape(-1, n).sum(0).norm().item()  # sum |dy * xhat|, |xhat| ~ 1
    assert all(t.grad is not None for t in leaves)
    grads = (x.grad, *(None if t is None else t.grad for t in (w, b)))
    refs = (xd.grad, *(None if t is None else t.grad for t in (wd, bd)))
    return (y, *grads), (yd, *refs), (scale, dw_scale)


AFFINE = [
    ("ln", True, True),
    ("ln", True, False),
    ("ln", False, False),
    ("rms", True, False),
    ("rms", False, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind,has_weight,has_bias", AFFINE)
def test_forward_and_gradients_match_float64(kind, dtype, n, has_weight, has_bias):
    (y, dx, dw, db), (yd, dxd, dwd, dbd), (scale, dw_scale) = run_case(kind, dtype, n, has_weight, has_bias)
    assert y.dtype == dtype and y.shape == yd.shape
    assert dx.dtype == dtype
    assert rel(y, yd) < TOL[dtype]
    assert rel(dx, dxd, scale) < TOL[dtype]
    if dw is not None:  # fp32 weight: dy * xhat summed in fp32 over 6 rows
        assert dw.dtype == torch.float32
        # against the size of sum |dy| (xhat has unit mean square per row, but is 0,
        # up to the reference's own 1e-14, for a LayerNorm of one element)
        assert rel(dw, dwd, dw_scale) < TOL[torch.float32]
    if db is not None:
        assert db.dtype == torch.float32
        assert rel(db, dbd) < TOL[torch.float32]


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_rows_taken_in_tiles_match_each_row_alone(kind):
    """Under the interpreter one-block rows are taken ROWS at a time ((ROWS, BLOCK) tiles,
    ``norm.tile_rows``; one row on a GPU): 200 rows of 4096 are four forward programs of 64
    rows (the last one 8 rows short) and four backward programs of 50 rows, each in four
    tiles of 16 (the last one 14 short). Every row's output and dx are bit for bit that row
    normalized alone, and dweight / dbias within fp32 rounding of the float64 sums."""
    from tkern.kernels import norm

    n, m = 4096, 200
    assert norm.tile_rows(m, n, interpret=False) == 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE).requires_grad_()
    b = (0.5 * torch.randn(n, generator=gen)).to(DEVICE).requires_grad_() if kind == "ln" else None
    call = (lambda t: layer_norm(t, n, w, b, 1e-5)) if kind == "ln" else (lambda t: rms_norm(t, n, w, 1e-5))
    y = call(x)
    y.backward(dy)
    dw, db = w.grad.clone(), None if b is None else b.grad.clone()
    for i in (0, 63, 64, 199):  # tile edges, the last row
        xi = x.detach()[i : i + 1].clone().requires_grad_()
        yi = call(xi)
        yi.backward(dy[i : i + 1])
        assert torch.equal(y[i : i + 1], yi), i
        assert torch.equal(x.grad[i : i + 1], xi.grad), i
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    reference(kind, xd, wd, bd, 1e-5).backward(dy.double())
    assert rel(dw, wd.grad, dy.double().abs().sum(0).norm().item()) < TOL[torch.float32]
    if b is not None:
        assert rel(db, bd.grad) < TOL[torch.float32]


@pytest.mark.parametrize("n", [1500, CHUNKED])  # one block; chunks combined by Chan's formula
def test_layer_norm_is_accurate_on_offset_fp32_input(n):
    (y, dx, dw, db), (yd, dxd, dwd, dbd), (scale, _) = run_case(
        "ln", torch.float32, n, True, True, offset=OFFSET
    )
    assert rel(y, yd) < OFFSET_TOL
    assert rel(dx, dxd, scale) < OFFSET_TOL
    assert rel(dw, dwd) < OFFSET_TOL
    assert rel(db, dbd) < TOL[torch.float32]
    # the bound has teeth: a one-pass E[x^2] - E[x]^2 in fp32 misses it by orders of magnitude
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape_for(n), generator=gen) + OFFSET
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    naive = (x - mean) * torch.rsqrt(var.clamp_min(0) + 1e-5)
    assert rel(naive, F.layer_norm(x.double(), (n,))) > 100 * OFFSET_TOL


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("n", [1023, CHUNKED])
def test_add_forms_return_the_rounded_sum_and_its_norm(kind, dtype, n):
    gen = torch.Generator().manual_seed(1)
    shape = shape_for(n)
    x, r, dy, dh = (torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(4))
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE).requires_grad_()
    b = (0.5 * torch.randn(n, generator=gen)).to(DEVICE).requires_grad_() if kind == "ln" else None
    x.requires_grad_(), r.requires_grad_()
    if kind == "ln":
        y, h = add_layer_norm(x, r, n, w, b, eps=1e-5)
    else:
        y, h = add_rms_norm(x, r, n, w, eps=1e-5)
    torch.autograd.backward((y, h), (dy, dh))
    # h: the fp32 sum of two values of dtype is exact, then rounded once
    hd = x.detach().double() + r.detach().double()
    assert torch.equal(h, hd.to(dtype))
    href = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    yd = reference(kind, href, wd, bd, 1e-5)
    yd.backward(dy.double())
    assert rel(y, yd) < TOL[dtype]
    dxd = href.grad + dh.double()
    assert rel(x.grad, dxd) < TOL[dtype]
    assert torch.equal(x.grad, r.grad)
    assert rel(w.grad, wd.grad) < TOL[torch.float32]
    if b is not None:
        assert rel(b.grad, bd.grad) < TOL[torch.float32]


def test_add_form_with_only_the_sum_used():
    x, r = (torch.randn(2, 8, device=DEVICE).half().requires_grad_() for _ in range(2))
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    _, h = add_layer_norm(x, r, 8, w)
    h.float().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_rms_norm_default_eps_matches_torch():
    # a tiny mean square, where fp16's eps (1e-3) and fp32's (1.2e-7) give different results
    x = torch.full((2, 4), 1e-3, device=DEVICE).half()
    x[0, 0] = 2e-3
    ref = F.rms_norm(x.double(), (4,), eps=torch.finfo(torch.float32).eps)
    assert rel(rms_norm(x, (4,)), ref) < TOL[torch.float16]
    assert rel(F.rms_norm(x.float(), (4,)), ref) < TOL[torch.float16]  # torch's default is the same eps


def test_multi_dim_normalized_shape_and_strided_rows():
    base = torch.randn(4, 2, 40, device=DEVICE).half()
    x = base[:, :, 3:35]  # rows of 32 with row stride 40: read in place
    w = torch.randn(2, 32, device=DEVICE, requires_grad=True)
    b = torch.randn(2, 32, device=DEVICE, requires_grad=True)
    y = layer_norm(x, (2, 32), w, b)
    yd = F.layer_norm(x.double(), (2, 32), w.double(), b.double())
    assert y.shape == x.shape and rel(y, yd) < TOL[torch.float16]
    xt = torch.randn(16, 6, device=DEVICE).half().t()  # column stride 6: copied
    assert rel(rms_norm(xt, 16), F.rms_norm(xt.double(), (16,), eps=1.2e-7)) < TOL[torch.float16]


def test_weight_in_input_dtype_gives_gradient_in_its_dtype():
    x = torch.randn(5, 24, device=DEVICE).bfloat16().requires_grad_()
    w = torch.randn(24, device=DEVICE).bfloat16().requires_grad_()
    y = rms_norm(x, 24, w)
    y.backward(torch.ones_like(y))
    wd = w.detach().double().requires_grad_()
    F.rms_norm(x.detach().double(), (24,), wd, torch.finfo(torch.float32).eps).sum().backward()
    assert w.grad.dtype == torch.bfloat16
    assert rel(w.grad, wd.grad) < TOL[torch.bfloat16]


def saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_saves_the_16_bit_input_and_fp32_statistics_only():
    m, n = 16, 64
    x = torch.randn(m, n, device=DEVICE).half().requires_grad_()
    r = torch.randn(m, n, device=DEVICE).half().requires_grad_()
    w = torch.randn(n, device=DEVICE, requires_grad=True)
    b = torch.randn(n, device=DEVICE, requires_grad=True)
    params = 2 * 4 * n  # weight and bias, fp32 references (no copies)
    # x (2 bytes per element) + mean and rstd (fp32 per row)
    assert saved_bytes(lambda: layer_norm(x, n, w, b)) == 2 * m * n + 8 * m + params
    assert saved_bytes(lambda: rms_norm(x, n, w)) == 2 * m * n + 4 * m + 4 * n
    # the residual forms save h = x + residual only, not x and residual
    assert saved_bytes(lambda: add_layer_norm(x, r, n, w, b)) == 2 * m * n + 8 * m + params
    # what torch's norm on an upcast input saves: an fp32 copy, twice the bytes of x at least
    assert saved_bytes(lambda: F.layer_norm(x.float(), (n,), w, b)) >= 4 * m * n


def test_double_backward_falls_back_to_float32_torch_ops():
    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, device=DEVICE)
    (g,) = torch.autograd.grad(layer_norm(x, 8, w).pow(3).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad((g * g).sum(), x)
    xd = x.detach().double().requires_grad_()
    (gd,) = torch.autograd.grad(F.layer_norm(xd, (8,), w.double()).pow(3).sum(), xd, create_graph=True)
    (ggd,) = torch.autograd.grad((gd * gd).sum(), xd)
    # fp32 operations on fp32 input: a few 2^-24 per operation, through two backward passes
    assert rel(gg, ggd) < 100 * TOL[torch.float32]


def test_meta_tensors_get_shapes_through_the_custom_op():
    x = torch.empty(2, 3, 16, dtype=torch.bfloat16, device="meta")
    w = torch.empty(16, device="meta")
    y, h = add_rms_norm(x, x, 16, w)
    assert y.shape == h.shape == x.shape and y.dtype == torch.bfloat16 and y.is_meta


def test_compile_fullgraph_traces_layer_norm():
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    b = torch.randn(32, device=DEVICE, requires_grad=True)

    def f(x):
        return layer_norm(x, (32,), w, b).float().square().sum()

    x = torch.randn(4, 32, device=DEVICE).half().requires_grad_()
    out0, grads0, out1, grads1 = eager_and_compiled(f, x, (w, b))
    assert torch.equal(out0, out1)  # the same kernels on the same inputs
    for a, c in zip(grads0, grads1, strict=True):
        assert torch.equal(a, c)


def test_public_names():
    assert tkern.layer_norm is layer_norm and tkern.rms_norm is rms_norm
    assert tkern.add_layer_norm is add_layer_norm and tkern.add_rms_norm is add_rms_norm
    assert tkern.layer_norm_and_residual is tkern.ops.norm.layer_norm_and_residual
    assert tkern.rms_norm_and_residual is tkern.ops.norm.rms_norm_and_residual


ERRORS = [
    (lambda x, w: layer_norm(x.int(), 16), TypeError, "input must be a float16, bfloat16 or float32"),
    (lambda x, w: layer_norm(x, 8), ValueError, r"normalized_shape \(8,\) must match the trailing"),
    (lambda x, w: layer_norm(x, (3, 4, 16)), ValueError, "must match the trailing dimensions"),
    (lambda x, w: layer_norm(x, 16, w[:8]), ValueError, r"weight must have shape \(16,\)"),
    (lambda x, w: layer_norm(x, 16, w.double()), TypeError, "weight must be float32 or input's dtype"),
    (lambda x, w: layer_norm(x, 16, w, w.bfloat16()), TypeError, "bias must be float32 or input's dtype"),
    (lambda x, w: add_layer_norm(x, x[:, :1], 16), ValueError, "residual must have x's shape"),
    (lambda x, w: add_rms_norm(x, x.float(), 16), ValueError, "residual must have x's shape .* dtype"),
    (lambda x, w: rms_norm(x, 16, w.to("meta")), ValueError, "weight is on meta but input is on"),
]


@pytest.mark.parametrize("call,error,match", ERRORS)
def test_bad_arguments_raise_clear_errors(call, error, match):
    x = torch.randn(2, 16, device=DEVICE).half()
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(error, match=match):
        call(x, w)


# ----------------------------------------------------------------------- modules


def test_modules_have_torchs_parameters_and_stay_fp32_in_a_16_bit_model():
    for ours, theirs in (
        (tkern.nn.LayerNorm(16), nn.LayerNorm(16)),
        (tkern.nn.LayerNorm((2, 8), bias=False), nn.LayerNorm((2, 8), bias=False)),
        (tkern.nn.LayerNorm(16, elementwise_affine=False), nn.LayerNorm(16, elementwise_affine=False)),
        (tkern.nn.RMSNorm(16), nn.RMSNorm(16)),
        (tkern.nn.RMSNorm(16, eps=1e-6, dtype=torch.float16), nn.RMSNorm(16, eps=1e-6)),
    ):
        assert isinstance(ours, type(theirs))
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        torch.nn.init.normal_(theirs.weight) if theirs.weight is not None else None
        ours.load_state_dict(theirs.state_dict())
        ours.to(DEVICE).half()  # a 16-bit model: the norm's parameters stay fp32
        assert all(p.dtype == torch.float32 and p.device.type == DEVICE for p in ours.parameters())
        x = torch.randn(3, *theirs.normalized_shape, device=DEVICE).half()
        y = ours(x)
        ref = theirs.to(DEVICE).double()(x.double())
        assert y.dtype == torch.float16 and rel(y, ref) < TOL[torch.float16]


def _norm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.RMSNorm(16, eps=1e-6)).to(
        DEVICE
    )


def test_convert_network_replaces_norms_keeping_parameters_and_back():
    model = _norm_model()
    params = list(model.parameters())
    keys = model.state_dict().keys()
    tkern.convert_network(model)
    assert type(model[1]) is tkern.nn.LayerNorm and type(model[3]) is tkern.nn.RMSNorm
    assert list(model.parameters()) == params and model.state_dict().keys() == keys
    assert model[1].weight.dtype == model[3].weight.dtype == torch.float32 and model[3].eps == 1e-6
    assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks  # reads 16-bit input itself
    assert model(torch.randn(2, 8, device=DEVICE)).dtype == torch.float16
    tkern.convert_network(model, torch.float32)
    assert type(model[1]) is nn.LayerNorm and type(model[3]) is nn.RMSNorm
    assert (
        list(model.parameters()) == params and model(torch.randn(2, 8, device=DEVICE)).dtype == torch.float32
    )


def test_convert_network_norms_false_keeps_torchs_norms_in_fp32():
    model = tkern.convert_network(_norm_model(), norms=False)
    assert type(model[1]) is nn.LayerNorm and type(model[3]) is nn.RMSNorm
    assert model[1]._forward_hooks  # run on an fp32 copy of the input, cast back
    tkern.convert_network(model)
    assert type(model[1]) is tkern.nn.LayerNorm
    tkern.convert_network(model, norms=False)  # converting again switches back
    assert type(model[1]) is nn.LayerNorm
    with pytest.raises(TypeError, match="norms must be True or False"):
        tkern.convert_network(model, norms=1)


def _tiny_hf(kind: str):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config).to(DEVICE)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(DEVICE)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_convert_network_on_tiny_hf_models(kind):
    model = _tiny_hf(kind).eval()  # GPT-2's dropout off: the same loss twice
    ids = torch.randint(0, 64, (2, 12), device=DEVICE)
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    keys = model.state_dict().keys()
    norm_names = [n for n, m in model.named_modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm"))]
    norm_params = {n: model.get_submodule(n).weight for n in norm_names}
    eps = {n: getattr(model.get_submodule(n), "variance_epsilon", None) for n in norm_names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Llama's rotary embedding's buffers are kept fp32, with a warning
        tkern.convert_network(model)
    expected_type = tkern.nn.LayerNorm if kind == "gpt2" else tkern.nn.RMSNorm
    for n in norm_names:
        m = model.get_submodule(n)
        assert type(m) is expected_type and m.weight is norm_params[n] and m.weight.dtype == torch.float32
        assert eps[n] is None or m.eps == eps[n]
    assert model.state_dict().keys() == keys
    # fp16 weights and activations against fp32 through one block, the existing GPT-2
    # integration test's bound: a few fp16 roundings (u = 4.9e-4) of a loss near ln(64)
    loss = model(ids, labels=ids).loss
    assert abs(loss.item() - expected) < 5e-3
    before = {n: p.detach().clone() for n, p in norm_params.items()}
    loss.backward()
    tkern.optim.FusedAdamW(model.parameters(), lr=1e-2).step()  # a training step moves the norms
    for n, p in norm_params.items():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n
