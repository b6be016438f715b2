"""The fp8 GEMM's epilogue takes the activation (issue 43 item 3, its second half):
``tkern.scaled_mm(..., activation=, preact=)``, a Float8Linear / Float8Conv1D forward with
the activation fused (``float8_linear(..., activation=)``), its backward through the
stored pre-activation, and GPT-2's MLP under the fp8 recipes routed through it."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ops_over
from test_float8 import E4M3, assert_gemm_close, fp8_pair, quantize_b, reference, sample
from test_float8_passes import launches  # noqa: F401 (the fixture)

import tkern
from tkern.nn.fusion import FusedMLPForward

pytestmark = pytest.mark.skipif(
    not tkern.INTERPRET, reason="fp8 on the CPU runs through Triton's interpreter"
)

#: max |act'(z)| over the reals: erf GELU's is 1.1289 (at z = sqrt(2)); the tanh form's
#: 1.1289 too (to 4 digits); SiLU's 1.0998; ReLU's 1. A bound on how much an error in z moves act(z).
ACT_LIPSCHITZ = 1.13
#: fp32 evaluation of act(z) in the epilogue (erf / tanh / exp and a few products): a few
#: fp32 ulps of |z| (2^-24 each); 2^-20 leaves a 16-ulp margin.
ACT_F32_EVAL = 2.0**-20


def act64(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return F.silu(z) if activation == "silu" else F.relu(z)


#: the tanh form's exp(2u) overflows to inf for large |z| in the interpreter's numpy, which
#: the kernel's formula absorbs (act' and act saturate exactly: test_activation.py)
absorbs_overflow = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@absorbs_overflow
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize(("ga", "gb"), [("tensor", "tensor"), ("row", "col")])
def test_scaled_mm_activation_and_preact_match_float64(activation, ga, gb):
    M, N, K = 37, 45, 256
    x, w = sample((M, K), torch.float32, seed=12, spike=False), sample((K, N), torch.float32, seed=13)
    a, sa = tkern.to_float8(x, E4M3, ga)
    b, sb = quantize_b(w, E4M3, gb)
    bias = torch.randn(N, device=DEVICE).to(torch.bfloat16)
    preact = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
    out = tkern.scaled_mm(a, b, sa, sb, bias=bias, activation=activation, preact=preact)
    z = reference(a, b, sa, sb, bias=bias)
    # the pre-activation: the dequantized product + bias, rounded once to bf16
    assert_gemm_close(preact, z, K, torch.bfloat16)
    # act of the fp32 z (not of the rounded preact): z's accumulation error through act's
    # slope, act's fp32 evaluation, then one rounding to bf16 (2^-8 relative)
    ref = act64(z, activation)
    err = (out.double().cpu() - ref).abs()
    bound = ACT_LIPSCHITZ * K * 2.0**-24 * z.abs().max() + ACT_F32_EVAL * z.abs() + 2.0**-8 * ref.abs()
    assert (err <= bound + 1e-30).all(), (err - bound).max().item()
    # the same GEMM without the activation is preact's bits (one epilogue, one rounding)
    assert torch.equal(tkern.scaled_mm(a, b, sa, sb, bias=bias), preact)


def test_scaled_mm_activation_checks_before_launching():
    a, b, sa, sb = fp8_pair()
    good = torch.empty(8, 16, device=DEVICE, dtype=torch.bfloat16)
    for kwargs, exc, words in [
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"activation": "gelu", "preact": good.float()}, TypeError, "preact"),
        ({"activation": "gelu", "preact": good[:4]}, ValueError, "preact"),
        ({"activation": "gelu", "preact": good.t().contiguous().t()[:, :16]}, ValueError, "preact"),
    ]:
        with pytest.raises(exc, match=words):
            tkern.scaled_mm(a, b, sa, sb, **kwargs)
    x, w = torch.randn(8, 256, device=DEVICE), torch.randn(256, 16, device=DEVICE)
    ab, sab = tkern.to_float8(x, E4M3, (1, 128))
    bb, sbb = tkern.to_float8(w, E4M3, (128, 128))
    with pytest.raises(ValueError, match="block scales"):
        tkern.scaled_mm(ab, bb, sab, sbb, activation="gelu")


# --------------------------------------------------------------------------- float8_linear(activation=)


def _layer_args(scaling, n=48, k=64, dtype=torch.bfloat16):
    torch.manual_seed(1)
    w = (torch.randn(n, k, device=DEVICE) / 8).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    kw = {}
    if scaling == "delayed":
        kw["histories"] = tuple(torch.zeros(4, device=DEVICE) for _ in range(3))
    return w, b, kw


@absorbs_overflow
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_float8_linear_with_activation_is_act_of_the_same_gemm_and_its_backward(scaling, activation):
    """The forward is act(z) of the very GEMM the unfused layer runs (its output z, rounded to
    bf16, is the stored pre-activation); the backward is the unfused layer's backward given
    dZ = activation_grad(dY, z): the same kernels on the same bits, so bit for bit."""
    from tkern.kernels.activation import activation_grad
    from tkern.ops.float8 import float8_linear

    w, b, kw = _layer_args(scaling)
    x = torch.randn(3, 40, 64, device=DEVICE).to(torch.bfloat16)
    dy = torch.randn(3, 40, 48, device=DEVICE).to(torch.bfloat16)
    grads, outputs = [], []
    for fused in (True, False):
        hist = {k: tuple(h.clone() for h in v) for k, v in kw.items()}
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        if fused:
            y = float8_linear(*leaves, scaling=scaling, activation=activation, **hist)
            y.backward(dy)
        else:
            y = float8_linear(*leaves, scaling=scaling, **hist)  # z
            y.backward(activation_grad(dy, y.detach(), activation))
        outputs.append(y.detach())
        grads.append([t.grad for t in leaves] + [h for v in hist.values() for h in v])
    # act of the bf16 z against act of the fp32 z: z's rounding (2^-8) through act's slope,
    # then one rounding of y (2^-8)
    z = outputs[1].double()
    ref = act64(z, activation)
    bound = ACT_LIPSCHITZ * 2.0**-8 * z.abs() + 2.0**-8 * ref.abs() + 1e-30
    assert ((outputs[0].double() - ref).abs() <= bound).all()
    for a, b_ in zip(*grads, strict=True):
        assert torch.equal(a, b_)


def test_float8_linear_activation_is_checked_before_launching():
    from tkern.ops.float8 import float8_linear

    w, b, _ = _layer_args("tensorwise")
    x = torch.randn(8, 64, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="activation must be one of"):
        float8_linear(x, w, b, activation="gelu_erf")
    with pytest.raises(ValueError, match='not "blockwise"'):
        float8_linear(x, w, b, scaling="blockwise", activation="gelu")
    with pytest.raises(TypeError, match="bf16 or fp16"):
        float8_linear(x.float(), w.float(), b.float(), activation="gelu")


# --------------------------------------------------------------------------- GPT-2's MLP under fp8


def _gpt2_fp32():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2, n_inner=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(DEVICE)


def _convert(model, scaling):
    return tkern.convert_network(
        model, torch.bfloat16, float8=tkern.nn.Float8Recipe(scaling, history_len=4),
        float8_filter=lambda n, m: "lm_head" not in n,
    )  # fmt: skip


def _unfused(model):
    """A deep copy of ``model`` whose MLP runs HF's own forward (GELU as torch ops)."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(vars(m).get("forward"), FusedMLPForward):
            del m.forward
    return twin


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@absorbs_overflow
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_fp8_gpt2_fuses_gelu_into_c_fc_and_trains_as_the_unfused_path(scaling):
    """GPT-2's MLP under fp8 runs gelu_new in c_fc's epilogue, keeping its Parameters.

    Tolerance: the fused path computes GELU in fp32 on the fp32 pre-activation and rounds
    once; HF's chain rounds z to bf16 and each of its ~8 ops to bf16. Those few-ulp
    differences in h flip some of c_proj's e4m3 roundings (2^-4 relative), so the two fp8
    paths may differ by up to the fp8 quantization error itself, never more: per
    parameter, the gradients of the two paths differ by less than the unfused path's own
    error against the float64 model, and the fused path is no farther from float64 than
    1.25x the unfused one (measured 0.90-1.07x on the MLP's and its neighbours'
    parameters). The losses agree to 2^-8 (bf16's unit), before and after the step."""
    base = _gpt2_fp32()
    ref = copy.deepcopy(base).double()
    before = [id(p) for p in base.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "left eager" warning: the block is fused
        fused = _convert(base, scaling)
    mlp = fused.transformer.h[0].mlp
    assert isinstance(vars(mlp)["forward"], FusedMLPForward)
    assert [id(p) for p in fused.parameters()] == before, "the same Parameter objects"
    plain = _unfused(fused)
    ids = torch.randint(0, 64, (1, 16), device=DEVICE)
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    losses = []
    for model in (fused, plain):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        tkern.optim.FusedAdamW(model.parameters(), lr=1e-3).step()  # then casts the weights
    assert abs(losses[0] - losses[1]) <= 2.0**-8 * abs(losses[1]), losses
    params = zip(fused.named_parameters(), plain.parameters(), ref.parameters(), strict=True)
    for (name, p), q, r in params:  # the step's gradients against float64
        off, own = _rel(p.grad, r.grad), _rel(q.grad, r.grad)
        assert _rel(p.grad, q.grad) <= own and off <= 1.25 * own, (name, off, own)
    with torch.no_grad():  # after the step: the forward on the optimizer's weight casts
        after = [model(ids, labels=ids).loss.item() for model in (fused, plain)]
    assert abs(after[0] - after[1]) <= 2.0**-8 * abs(after[1]) and after[1] < losses[1], (losses, after)


def test_blockwise_gpt2_mlp_is_left_eager_with_the_reason():
    with pytest.warns(UserWarning, match="whose GEMM takes no activation under recipe 'blockwise'"):
        model = _convert(_gpt2_fp32(), "blockwise")
    assert "forward" not in vars(model.transformer.h[0].mlp)


@absorbs_overflow
@pytest.mark.parametrize(("scaling", "forward"), [("tensorwise", 6), ("delayed", 4)])
def test_fp8_mlp_runs_no_torch_op_over_the_activation(scaling, forward, launches, monkeypatch):  # noqa: F811
    """GPT-2's fp8 MLP after an optimizer step (its weight casts cached), counted through
    the interpreter: in forward the unfused MLP's Triton launches (tensorwise: x's amax and
    cast, the GEMM, per layer; delayed: the cast and the GEMM) less one, c_proj's input cast
    written by c_fc's epilogue (tensorwise: its amax pass; delayed: the cast;
    tests/test_float8_gemm_emit.py); one more in backward (act' applied to dY, the
    activation_grad kernel, before c_fc's dY cast), and no torch op over the (tokens,
    intermediate) activation either way, where HF's gelu_new ran 8 in forward and 11 in
    backward."""
    fused = _convert(_gpt2_fp32(), scaling)
    counts = {}
    for tag, model in (("fused", fused), ("plain", _unfused(fused))):
        mlp = model.transformer.h[0].mlp
        opt = tkern.optim.FusedAdamW(mlp.parameters(), lr=1e-3)
        x = torch.randn(2, 16, 64, device=DEVICE).to(torch.bfloat16).requires_grad_()
        mlp(x).float().sum().backward()
        opt.step()  # casts the weights for the next forward
        launches.clear()
        with ops_over(monkeypatch, {(32 * 128, 128)}) as seen:
            y = mlp(x)
            n_forward, ops_forward = len(launches), len(seen)
            y.backward(torch.ones_like(y))
        counts[tag] = (n_forward, len(launches) - n_forward, ops_forward, len(seen) - ops_forward)
    assert counts["fused"][0] + 1 == counts["plain"][0] == forward, counts
    assert counts["fused"][1] == counts["plain"][1] + 1, counts
    assert counts["fused"][2:] == (0, 0) and counts["plain"][2:] == (8, 11), counts


@absorbs_overflow
def test_torch_compile_fullgraph_matches_eager_with_the_activation():
    """Traced, the fused forward and its backward run through custom ops (tkern::scaled_mm with
    its activation, tkern::activation_grad): one graph, the same bits as eager."""
    from tkern.nn.float8 import float8_forward

    layer = tkern.nn.Float8Linear(64, 32, device=DEVICE)
    x = torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)
    compiled = torch.compile(
        lambda t: float8_forward(layer, t, "gelu_tanh"), fullgraph=True, backend="aot_eager"
    )
    results = []
    for fn in (lambda t: float8_forward(layer, t, "gelu_tanh"), compiled):
        layer.weight.grad = layer.bias.grad = None
        xg = x.clone().requires_grad_()
        y = fn(xg)
        y.float().sum().backward()
        results.append((y.detach(), xg.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_fp8_configs_with_an_exp_activation_keep_to_128x128_tiles():
    """The autotuner's pruning for an fp8 epilogue with an exp/erf activation: the compile
    gate found the 128x256 and 256x128 tiles spilling there (gemm_configs.FP8_ACT_MAX_TILE);
    without an activation they stay on offer."""
    from tkern.kernels.activation import ACTIVATIONS
    from tkern.kernels.gemm_configs import FP8_ACT_MAX_TILE, fp8_gemm_configs, prune_configs

    def tiles(**kw):
        return {
            (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in prune_configs(fp8_gemm_configs(), 90, **kw)
        }

    plain = tiles(elem_bytes=1)
    assert (128, 256) in plain and (256, 128) in plain
    for name in ("gelu_tanh", "silu", "gelu"):
        kept = tiles(elem_bytes=1, activation=ACTIVATIONS[name])
        assert kept and all(m * n <= FP8_ACT_MAX_TILE for m, n in kept), (name, kept)
    assert (128, 128) in tiles(elem_bytes=1, activation=ACTIVATIONS["gelu_tanh"])
