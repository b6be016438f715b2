"""Producers write fp8 (issue 43 item 3): LayerNorm / RMSNorm emit the next GEMM's e4m3
input (x and x^T) under the recipe's scale, and a converted model's fp8 layers use it.

Every comparison is bit for bit against the unfused path (the norm, then the layer's own
cast): the fused kernel reuses the norm's row code and the cast's tile code, so y, its
cast, the histories, the forward and every gradient must be the same bytes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import DEVICE
from test_float8_passes import launches  # noqa: F401 (the fixture)
from torch import nn

import tkern
from tkern.kernels.float8 import cast_2d
from tkern.kernels.norm import MAX_ROLLS, norm_forward, norm_forward_float8
from tkern.nn import Float8Linear, Float8Recipe
from tkern.nn.float8_norm import Float8NormForward, remove_float8_norm
from tkern.ops.float8 import Float8Input, float8_linear
from tkern.ops.norm import layer_norm, norm_float8, rms_norm

pytestmark = pytest.mark.skipif(
    not tkern.INTERPRET, reason="fp8 on the CPU runs through Triton's interpreter"
)


def _bits(t):
    """A tensor's bytes, so that NaN == NaN and -0 != +0 (bit for bit)."""
    return None if t is None else t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(_bits(a), _bits(b)))


# --------------------------------------------------------------------------- kernel


@pytest.mark.parametrize(
    ("m", "n", "rms"),
    [
        (130, 96, False),
        (70, 200, True),
        (2, 4100, False),
    ],  # bands with a ragged end; rows wider than the kernel takes
)
def test_norm_forward_float8_is_the_norm_then_cast_2d(m, n, rms):
    torch.manual_seed(0)
    x = (torch.randn(m, n, device=DEVICE) * 3 + 1).to(torch.bfloat16)
    w = torch.randn(n, device=DEVICE)
    b = None if rms else torch.randn(n, device=DEVICE)
    ref = norm_forward(x, w, b, 1e-5, rms)
    # tensorwise: the norm's amax, then one cast
    out = norm_forward_float8(x, w, b, 1e-5, rms, store_t=True)
    want = cast_2d(ref.y, store_t=True)
    assert _same(out.y, ref.y) and _same(out.rstd, ref.rstd) and _same(out.mean, ref.mean)
    assert _same(out.data, want.data) and _same(out.data_t, want.data_t) and _same(out.scale, want.scale)
    # delayed: a history holding an amax (and a margin); y's amax rolled into it and into two
    # more histories, and a weight's deferred amax into a fourth
    h, h_ref = (torch.tensor([0.0, 2.0, 5.0], device=DEVICE) for _ in range(2))  # the max last
    other, weight_h = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    rolls = ((other, None), (weight_h, torch.tensor([1.0, 7.0], device=DEVICE)))
    out = norm_forward_float8(
        x, w, b, 1e-5, rms, store_t=True, history=h, margin=1, counter=counter, rolls=rolls
    )
    want = cast_2d(ref.y, store_t=True, history=h_ref, margin=1)
    assert _same(out.y, ref.y)
    assert _same(out.data, want.data) and _same(out.data_t, want.data_t) and _same(out.scale, want.scale)
    assert torch.equal(h, h_ref) and torch.equal(other, torch.stack([h_ref[0], *torch.zeros(2)]))
    assert weight_h.tolist() == [7.0, 1.0, 1.0] and counter.item() == 0
    assert out.scale.item() == pytest.approx(5.0 / 448 * 2, rel=1e-6)  # the history max, margin 2^1
    # no update: the cast alone, every history left as it was
    before = h.clone()
    out = norm_forward_float8(x, w, b, 1e-5, rms, history=h, update=False)
    assert torch.equal(h, before) and out.data_t is None
    assert _same(out.data, cast_2d(ref.y, history=before.clone(), update=False).data)


def test_norm_forward_float8_checks_its_arguments_before_launching():
    x = torch.randn(4, 32, device=DEVICE)
    h = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="rolls ride on"):
        norm_forward_float8(x, None, None, 1e-5, True, history=h, update=False, rolls=((h.clone(), None),))
    with pytest.raises(ValueError, match=f"at most {MAX_ROLLS}"):
        norm_forward_float8(x, None, None, 1e-5, True, history=h, rolls=((h.clone(), None),) * 6)
    with pytest.raises(ValueError, match="counter is delayed"):
        norm_forward_float8(x, None, None, 1e-5, True, counter=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype must be"):
        norm_forward_float8(x, None, None, 1e-5, True, torch.float16)
    with pytest.raises(ValueError, match="N >= 1"):
        norm_forward_float8(x[:, :0], None, None, 1e-5, True)
    assert torch.equal(h, torch.zeros(4))


# --------------------------------------------------------------------------- op: norm_float8 -> float8_linear


def _norm_linear(fused, rms, scaling, params, x, steps=2):
    """Two steps of norm -> float8_linear (histories carried); outputs, grads and histories."""
    nw, nb, w, b = (p.detach().clone().requires_grad_() for p in params)
    nb = None if rms else nb
    histories = tuple(torch.zeros(4, device=DEVICE) for _ in range(3)) if scaling == "delayed" else None
    outs = []
    for step in range(steps):
        xg = x.detach().clone().requires_grad_()
        kw = {}
        if fused:
            if histories is not None:
                kw = dict(history=histories[0])
            y, x_fp8 = norm_float8(xg, 64, nw, nb, rms=rms, store_t=True, **kw)
            assert isinstance(x_fp8, Float8Input)
        else:
            y = rms_norm(xg, 64, nw) if rms else layer_norm(xg, 64, nw, nb)
            x_fp8 = None
        out = float8_linear(y, w, b, scaling=scaling, histories=histories, x_fp8=x_fp8)
        out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(step)))
        outs += [out, xg.grad, nw.grad, w.grad, b.grad, None if nb is None else nb.grad]
    return outs + list(histories or ())


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_norm_float8_into_float8_linear_is_bit_for_bit_the_unfused_path(scaling, rms):
    torch.manual_seed(1)
    x = torch.randn(2, 24, 64, device=DEVICE).to(torch.bfloat16) * 2
    norm_params = (1 + torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE))  # fp32
    linear_params = (torch.randn(48, 64, device=DEVICE), torch.randn(48, device=DEVICE))
    params = (*norm_params, *(p.to(torch.bfloat16) for p in linear_params))
    fused = _norm_linear(True, rms, scaling, params, x)
    plain = _norm_linear(False, rms, scaling, params, x)
    assert len(fused) == len(plain)
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert _same(a, b), i


def test_float8_linear_checks_x_fp8():
    x = torch.randn(8, 32, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(16, 32, device=DEVICE).to(torch.bfloat16)
    data, scale = tkern.to_float8(x)
    with pytest.raises(ValueError, match="x's \\(8, 32\\)"):
        float8_linear(x, w, x_fp8=Float8Input(data[:4], None, scale))
    with pytest.raises(ValueError, match="tensorwise or delayed"):
        float8_linear(x, w, scaling="blockwise", x_fp8=Float8Input(data, None, scale))
    with pytest.raises(ValueError, match="transpose"):
        float8_linear(x, w, x_fp8=Float8Input(data, data, scale))
    # without x^T, wgrad makes it with one copy: the same result as casting x here
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    float8_linear(xg, wg, x_fp8=Float8Input(data, None, scale)).float().sum().backward()
    w2 = w.clone().requires_grad_()
    float8_linear(x, w2).float().sum().backward()
    assert _same(wg.grad, w2.grad)


# --------------------------------------------------------------------------- modules: convert_network


def _converted(recipe, model_class: str, config_class: str, **config):
    """A one-layer transformers LM (seeded), converted to bf16 with ``recipe`` (head kept out)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).to(DEVICE)
    return tkern.convert_network(
        model, torch.bfloat16, float8=recipe, float8_filter=lambda n, m: "lm_head" not in n
    )


def _gpt2(recipe):
    return _converted(
        recipe, "GPT2LMHeadModel", "GPT2Config", vocab_size=64, n_positions=16, n_embd=64, n_layer=1,
        n_head=2, n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def _llama(recipe):
    return _converted(
        recipe, "LlamaForCausalLM", "LlamaConfig", vocab_size=64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip


def _unfused(model):
    """A deep copy of ``model`` whose norms emit nothing (every fp8 layer casts its input)."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        remove_float8_norm(m)
    return twin


def _train(model, steps, ids):
    """``steps`` optimizer steps (the optimizer casts each weight for the next forward)."""
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=1e-2)
    record = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        record += [loss, *(p.grad.clone() for p in model.parameters())]
        opt.step()
    return record + list(model.buffers())


@pytest.mark.parametrize("make", [_gpt2, _llama])
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_a_converted_model_trains_bit_for_bit_as_without_the_norms_fp8_output(make, scaling, launches):  # noqa: F811
    model = make(Float8Recipe(scaling, history_len=4))
    norms = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), Float8NormForward)]
    assert len(norms) == 2, "every rule's norm routed"
    twin = _unfused(model)
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    launches.clear()
    fused = _train(model, 2, ids)  # the second step's forward reads the optimizer's weight casts
    fused_launches = len(launches)
    launches.clear()
    plain = _train(twin, 2, ids)
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert _same(a, b), i
    # per step (one layer): GPT-2's two norms each save one cast (delayed) or amax pass
    # (tensorwise); Llama's save the casts of q, k, v and gate, up (tensorwise: but one each)
    saved = {
        (_gpt2, "delayed"): 2, (_gpt2, "tensorwise"): 2,
        (_llama, "delayed"): 5, (_llama, "tensorwise"): 2 * 5 - 2,
    }[make, scaling]  # fmt: skip
    assert len(launches) - fused_launches == 2 * saved


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_norm_then_float8_forward_under_delayed_saves_the_cast_launch(scaling, launches):  # noqa: F811
    """One GPT-2 block's ln_2 -> c_fc forward after an optimizer step: the norm and the GEMM
    (delayed: 2 launches, was 3; tensorwise: the norm, the cast and the GEMM, was 4)."""
    model = _gpt2(scaling)
    mlp_in = model.transformer.h[0].ln_2
    c_fc = model.transformer.h[0].mlp.c_fc
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    model(ids, labels=ids).loss.backward()
    opt.step()  # casts the weights for the next forward
    x = torch.randn(2, 16, 64, device=DEVICE).to(torch.bfloat16)
    counts = []
    for norm_forward_of in (mlp_in.forward, lambda t: type(mlp_in).forward(mlp_in, t)):
        opt.step()  # a fresh weight cast (the history moved in the last forward)
        launches.clear()
        c_fc(norm_forward_of(x))
        counts.append([n for n, _ in launches])
    fused, plain = counts
    assert len(fused) == {"delayed": 2, "tensorwise": 3}[scaling], fused
    assert len(plain) == len(fused) + 1, plain
    assert fused[0] == "_norm_fwd_fp8_kernel" and "_roll_history_kernel" not in fused


def test_a_consumer_given_another_tensor_casts_it_itself():
    model = _gpt2("tensorwise")
    block = model.transformer.h[0]
    x = torch.randn(2, 8, 64, device=DEVICE).to(torch.bfloat16)
    y = block.ln_2(x)
    other = y.clone()
    assert _same(block.mlp.c_fc(other), _unfused(model).transformer.h[0].mlp.c_fc(other))
    # written in place after the norm: not the tensor the cast was made of
    y = block.ln_2(x)
    y.mul_(2)
    assert _same(block.mlp.c_fc(y), _unfused(model).transformer.h[0].mlp.c_fc(y))
    # a forward hook on the norm that hands on another tensor
    handle = block.ln_2.register_forward_hook(lambda m, i, o: o * 1)
    y = block.ln_2(x)
    assert _same(block.mlp.c_fc(y), _unfused(model).transformer.h[0].mlp.c_fc(y))
    handle.remove()


def test_under_delayed_a_consumer_given_another_tensor_warns():
    model = _gpt2("delayed")
    block = model.transformer.h[0]
    y = block.ln_2(torch.randn(2, 8, 64, device=DEVICE).to(torch.bfloat16))
    with pytest.warns(UserWarning, match="not its norm's output"):
        block.mlp.c_fc(y.clone())


def test_a_converted_model_with_fp8_norms_pickles_copies_and_converts_back():
    model = _gpt2("delayed").eval()
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        f = twin.transformer.h[0].ln_1.forward
        assert isinstance(f, Float8NormForward) and f.norm is twin.transformer.h[0].ln_1
        assert twin.transformer.h[0].attn.c_attn.fp8_producer is f and f._emission is None
    assert _same(twin(ids, labels=ids).loss, model(ids, labels=ids).loss)
    tkern.convert_network(model, torch.float32)
    assert all("forward" not in m.__dict__ and "fp8_producer" not in m.__dict__ for m in model.modules())
    assert type(model.transformer.h[0].ln_1) is nn.LayerNorm


def test_float8_linear_layers_outside_a_rule_are_untouched():
    """A plain Sequential (no transformers block): no norm forward replaced."""
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)).to(DEVICE)
    tkern.convert_network(model, torch.bfloat16, float8="delayed")
    assert isinstance(model[1], Float8Linear) and "forward" not in model[0].__dict__


def test_under_torch_compile_the_norm_emits_nothing_and_the_graph_is_whole():
    """fullgraph=True: nothing in the norm's forward or the layer's hand-off breaks the graph;
    the compiled block is the unfused eager block, and no fp8 output was made."""
    model = _gpt2("delayed").eval()
    block = model.transformer.h[0]
    x = torch.randn(2, 16, 64, device=DEVICE).to(torch.bfloat16)
    with torch.no_grad():
        want = _unfused(model).transformer.h[0](x)
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert _same(got, want)
    assert block.ln_1.forward._emission is None and block.ln_2.forward._emission is None
