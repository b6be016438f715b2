"""tkern.ops.projections.shared_input_linears (linears reading one input as one autograd node,
dX summed in the dgrad GEMMs) against float64 and against separate tkern.linear calls, its
flat-buffer wgrads and its argument checks; and tkern/nn/projections.py, which runs a converted
attention's q, k, v projections (``RotaryRule.shared_input``) as one such call.

Tolerances. Each output, dW and db is one GEMM (or reduction) accumulated in fp32 and rounded
once to its dtype: within ``TOL`` (2u, tests/conftest.py) of float64, and bit-identical to
tkern.linear's (the same launches). dX is three GEMMs, the first writing it and each next
adding its product into it in fp32 before rounding again: three roundings of partial sums no
larger than dX's terms, ``2 * TOL``.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, LazyModule, rel_err

import tkern
from tkern.nn import projections
from tkern.nn.projections import grouped_code
from tkern.nn.rotary import ROTARY_RULES, RotaryAttentionForward, route_rotary
from tkern.ops.projections import shared_input_linears

NS = (32, 16, 16)  # GQA: q's width, then k's and v's
K = 48
modeling_llama = LazyModule("transformers.models.llama.modeling_llama")


def _case(dtype, bias, seed=0):
    """x (2, 6, K) and per-projection weights and biases (fp32 biases for bias="fp32")."""
    torch.manual_seed(seed)
    x = torch.randn(2, 6, K, device=DEVICE).to(dtype).requires_grad_()
    ws = [(torch.randn(n, K, device=DEVICE) / K**0.5).to(dtype).requires_grad_() for n in NS]
    bias_dtype = torch.float32 if bias == "fp32" else dtype
    bs = [torch.randn(n, device=DEVICE).to(bias_dtype).requires_grad_() for n in NS] if bias else None
    return x, ws, bs


def _grads(fn, x, ws, bs, dys):
    """(outputs, [dx, dW_i..., db_i...]) of ``fn(x, ws, bs)`` under upstream gradients ``dys``."""
    inputs = [x, *ws, *(bs or [])]
    for t in inputs:
        t.grad = None
    ys = fn(x, ws, bs)
    torch.autograd.backward(ys, dys)
    return [y.detach() for y in ys], [t.grad for t in inputs]


def _float64(x, ws, bs):
    xd = x.detach().double().requires_grad_()
    wd = [w.detach().double().requires_grad_() for w in ws]
    bd = [b.detach().double().requires_grad_() for b in bs] if bs else None
    return xd, wd, bd


def _separate(x, ws, bs):
    return tuple(tkern.linear(x, w, None if bs is None else bs[i]) for i, w in enumerate(ws))


def _reference(x, ws, bs):
    return tuple(F.linear(x, w, None if bs is None else bs[i]) for i, w in enumerate(ws))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [None, "same", "fp32"])
def test_outputs_and_every_gradient_against_float64_and_separate_linears(dtype, bias):
    x, ws, bs = _case(dtype, bias)
    dys = [torch.randn(2, 6, n, device=DEVICE).to(dtype) for n in NS]
    ys, grads = _grads(shared_input_linears, x, ws, bs, dys)
    ref_ys, ref = _grads(_reference, *_float64(x, ws, bs), [d.double() for d in dys])
    sep_ys, sep = _grads(_separate, x, ws, bs, dys)
    for y, r, s in zip(ys, ref_ys, sep_ys, strict=True):
        assert y.dtype == dtype and y.shape == r.shape
        assert rel_err(y, r) < TOL[dtype] and torch.equal(y, s)
    assert grads[0].shape == x.shape and grads[0].dtype == dtype
    assert rel_err(grads[0], ref[0]) < 2 * TOL[dtype]
    for g, r, s in zip(grads[1:], ref[1:], sep[1:], strict=True):  # dW and db: tkern.linear's launches
        assert g.dtype == s.dtype and rel_err(g, r) < TOL[dtype] and torch.equal(g, s)


def test_strided_and_missing_upstream_gradients_and_2d_input():
    # y.transpose(...) in the loss: a strided dY; an output left out of the loss: no gradient
    # for its weight, and dX from the other two only
    dtype = torch.float16
    x, ws, _ = _case(dtype, None, seed=1)
    x2 = x.detach().reshape(12, K).requires_grad_()
    q, k, v = shared_input_linears(x2, ws)
    assert q.shape == (12, NS[0]) and v.shape == (12, NS[2])
    (q.t().float().square().sum() + k.float().sum()).backward()
    assert ws[2].grad is None
    xd, wd, _ = _float64(x2, ws, None)
    (F.linear(xd, wd[0]).t().square().sum() + F.linear(xd, wd[1]).sum()).backward()
    assert rel_err(x2.grad, xd.grad) < 2 * TOL[dtype]
    for w, r in zip(ws[:2], wd[:2], strict=True):
        assert rel_err(w.grad, r.grad) < TOL[dtype]


def test_create_graph_gives_a_differentiable_gradient():
    # the torch formulas in fp32 (tkern.ops.linear.differentiable_grads), then a second order
    dtype = torch.float16
    x, ws, bs = _case(dtype, "same", seed=2)
    (gx,) = torch.autograd.grad(sum(y.float().square().sum() for y in shared_input_linears(x, ws, bs)), x,
                                create_graph=True)  # fmt: skip
    (gw,) = torch.autograd.grad(gx.float().square().sum(), ws[1])
    xd, wd, bd = _float64(x, ws, bs)
    (rx,) = torch.autograd.grad(sum(y.square().sum() for y in _reference(xd, wd, bd)), xd, create_graph=True)
    (rw,) = torch.autograd.grad(rx.square().sum(), wd[1])
    assert rel_err(gx, rx) < 2 * TOL[dtype]
    assert rel_err(gw, rw) < 4 * TOL[dtype]  # through the rounded outputs and dX: a few roundings


@pytest.mark.parametrize("first_bias", [True, False])
def test_each_weight_gradient_goes_into_a_fused_optimizers_flat_buffer(wgrad_counts, first_bias):
    # the weights are inputs 1, 3, 5 (a None bias moves the later ones down a slot:
    # common.next_function_slots): each wgrad added in place, and each dbias (the wgrad
    # GEMM's row sums), none copied
    from torch import nn

    from tkern.flat import grad_is_flat_view
    from tkern.optim import FusedAdamW

    torch.manual_seed(3)
    layers = [tkern.nn.Linear(K, n, bias=first_bias or i > 0).to(DEVICE) for i, n in enumerate(NS)]
    model = nn.ModuleList(layers)
    opt = FusedAdamW(model.parameters(), lr=1e-3)  # noqa: F841 (kept: it owns the flat buffer)
    x = torch.randn(12, K, device=DEVICE).half()
    ys = shared_input_linears(x, [m.weight for m in layers], [m.bias for m in layers])
    sum(y.float().square().sum() for y in ys).backward()
    assert wgrad_counts == {"into": 3 + 2 + first_bias, "copies": 0}
    assert all(grad_is_flat_view(p) for p in model.parameters())
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    sum(m(x).float().square().sum() for m in layers).backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.equal(g, p.grad)  # the same wgrad launches, into the view or not


def _bad_calls(x, ws, bs):
    half = torch.float16
    return [
        ((x, []), TypeError, "non-empty list"),
        ((x, ws[0]), TypeError, "non-empty list"),
        ((x, ws, bs[:2]), ValueError, "one entry per weight"),
        ((x, ws, bs[0]), TypeError, "biases must be None or a list"),
        ((x, [ws[0], ws[1][:, :-1]]), ValueError, "x must have shape"),
        ((x, [ws[0], ws[1].to(torch.bfloat16)]), TypeError, "x must have dtype"),
        ((x, [*ws[:2], ws[2].float()]), TypeError, "weight"),
        ((x, ws, [bs[0], bs[1], bs[2][:-1]]), ValueError, "bias"),
        ((x, ws, [bs[0], bs[1], bs[2].to(torch.int32)]), TypeError, "bias"),
        ((x.float(), ws), TypeError, "x must have dtype"),
        ((x, [ws[0], "w"]), TypeError, "each weight must be a tensor"),
        ((x, [ws[0], torch.randn(4, K, dtype=half, device="meta")]), ValueError, "one device"),
    ]


def test_bad_arguments_are_refused_before_any_launch(launches):
    x, ws, bs = _case(torch.float16, "same")
    for args, error, message in _bad_calls(x, ws, bs):
        with pytest.raises(error, match=message):
            shared_input_linears(*args)
    assert launches == []


def test_meta_and_empty_calls_run_separate_linears():
    x = torch.empty(3, 5, K, dtype=torch.bfloat16, device="meta")
    ws = [torch.empty(n, K, dtype=torch.bfloat16, device="meta") for n in NS]
    assert [tuple(y.shape) for y in shared_input_linears(x, ws)] == [(3, 5, n) for n in NS]
    x, ws, bs = _case(torch.float16, "same", seed=4)
    ws[1] = ws[1][:0]
    ys = shared_input_linears(x, ws, [bs[0], bs[1][:0], bs[2]])
    assert ys[1].shape == (2, 6, 0) and torch.equal(ys[0], tkern.linear(x, ws[0], bs[0]))


# --------------------------------------------------------------------------- the routing


@pytest.mark.parametrize("name", sorted(ROTARY_RULES))
def test_each_rules_projections_are_what_its_forward_calls(name):
    """A rule's ``shared_input`` children are each called once on one name in its family's
    forward (its code is rewritten); a family without one calls one packed projection."""
    rule = ROTARY_RULES[name]
    family = "gpt_neox" if name == "GPTNeoXAttention" else name.removesuffix("Attention").lower()
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    inner = cls.forward
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    if rule.shared_input:
        assert grouped_code(inner, rule.shared_input) is not None
    else:
        assert not {"q_proj", "k_proj", "v_proj"} & set(inner.__code__.co_names)
    assert grouped_code(inner, ("q_proj", "o_proj")) is None  # not called on one input


def _llama_attention(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "eager"
    attn = modeling_llama.LlamaAttention(config, layer_idx=0).to(DEVICE)
    tkern.convert_network(attn, dtype)
    rope = modeling_llama.LlamaRotaryEmbedding(config).to(DEVICE)
    x = torch.randn(2, 8, 64, device=DEVICE).to(dtype)
    return attn, x, {"position_embeddings": rope(x, torch.arange(8, device=DEVICE)[None])}


def _run(attn, x, kwargs):
    x = x.detach().requires_grad_()
    attn.zero_grad(set_to_none=True)
    out = attn(x, **kwargs)[0]
    out.float().square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in attn.named_parameters()}


def test_a_converted_attention_runs_its_projections_as_one_call_unless_one_is_hooked(monkeypatch):
    """One shared_input_linears call per forward, the same Parameters and children; a hook on
    k_proj (or a projection that is not a tkern Linear) gets the three layers called as
    modules, the hook firing on the same input: the same outputs (the same forward
    launches), dX within the roundings above and the same dW."""
    dtype = torch.bfloat16
    attn, x, kwargs = _llama_attention(dtype)
    assert isinstance(attn.__dict__["forward"], RotaryAttentionForward)
    assert route_rotary(copy.deepcopy(attn)) is None
    calls = []
    real = projections.shared_input_linears
    monkeypatch.setattr(projections, "shared_input_linears", lambda *a: calls.append(1) or real(*a))
    out, gx, grads = _run(attn, x, kwargs)
    assert len(calls) == 1
    seen = []
    handle = attn.k_proj.register_forward_hook(lambda m, args, y: seen.append(args[0]))
    hooked_out, hooked_gx, hooked_grads = _run(attn, x, kwargs)
    handle.remove()
    assert len(calls) == 1 and len(seen) == 1 and seen[0].shape == x.shape
    assert torch.equal(out, hooked_out)
    assert rel_err(gx, hooked_gx) < 2 * TOL[dtype]
    for name, g in grads.items():
        assert torch.equal(g, hooked_grads[name]), name
    _run(attn, x, kwargs)
    assert len(calls) == 2  # the hook removed: one call again
    attn.v_proj = torch.nn.Linear(64, 32, device=DEVICE, dtype=dtype)
    _run(attn, x, kwargs)
    assert len(calls) == 2
