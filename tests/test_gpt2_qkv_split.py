"""GPT-2's ``self.c_attn(hidden_states).split(self.split_size, dim=2)`` as one autograd node
(tkern.ops.projections.split_linear, wired by tkern/nn/projections.py's ``SPLIT_RULES``): one
GEMM forward whose output q, k and v are views of, and a backward with no concatenation of dq,
dk, dv into a (tokens, 3H) tensor (autograd's split backward is an ``aten.cat``).

Tolerances. Forward is the same GEMM as the unrewritten model's: the loss is bit-identical. Each
part's dW and db is its own wgrad GEMM (or reduction) over the same tokens in fp32, rounded once,
as the whole wgrad's rows were: within ``TOL`` (2u, tests/conftest.py) of the unrewritten model's
(bit-identical where the plans tile alike). dX is three dgrad GEMMs, the first writing it and
each next adding its product in fp32 before rounding again (one rounding before): ``2 * TOL`` for
it (tests/test_projections.py), and every gradient that flows from it (ln_1's, the layers below,
the embeddings) within ``4 * TOL``: a few more roundings of sums no larger than their terms,
through two layers. Against the fp32 model: twice fp16 autocast's own error (or ``TOL``), the
whole-model bound of tests/test_blocks.py.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import DEVICE, TOL, LazyModule, ops_over, rel_err

import tkern
from tkern.nn import projections
from tkern.nn.projections import SPLIT_RULES, SplitAttentionForward, split_code
from tkern.ops.projections import split_linear

transformers = LazyModule("transformers")
modeling_gpt2 = LazyModule("transformers.models.gpt2.modeling_gpt2")

B, T, H, HEADS, VOCAB = 2, 8, 64, 2, 100
DTYPE = torch.float16


def _model(**config):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=H, n_layer=2, n_head=HEADS, n_inner=2 * H,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **config,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(cfg).to(DEVICE)


def _ids():
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def _run(model, ids, autocast=None, **kwargs):
    """The loss and every parameter's gradient, by name (copies)."""
    model.zero_grad(set_to_none=True)
    context = torch.autocast(DEVICE, dtype=autocast) if autocast else contextlib.nullcontext()
    with context:
        loss = model(ids, labels=ids, **kwargs).loss
    loss.float().backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _unsplit(model):
    """``model`` with the rewrite taken off (its attentions run HF's own forward)."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), SplitAttentionForward):
            del m.forward
    return model


def _attentions(model):
    return [m for m in model.modules() if type(m).__name__ == "GPT2Attention"]


def _cats(monkeypatch):
    """The aten ops (no views, no allocations, not inside a launch) touching a (..., 3H)
    tensor of the step's tokens: the c_attn output's own allocation is an ``empty``."""
    return ops_over(monkeypatch, {(B * T * 3 * H, 3 * H)})


def test_gpt2s_forward_splits_as_its_rule_says():
    forward = modeling_gpt2.GPT2Attention.forward.__wrapped__  # under deprecate_kwarg
    assert split_code(forward, SPLIT_RULES["GPT2Attention"]) is not None
    # the rewrite takes the self-attention's split only, not the cross-attention's
    rule = projections.SplitRule(input="encoder_hidden_states")
    assert split_code(forward, rule) is not None  # also exactly one
    assert split_code(forward, projections.SplitRule(layer="q_attn")) is None


def test_converted_gpt2_against_fp32_and_without_the_rewrite(monkeypatch):
    model = _model()
    ids = _ids()
    ref_loss, ref = _run(model, ids)
    auto_loss, auto = _run(model, ids, DTYPE)
    before = {n: id(p) for n, p in model.named_parameters()}
    modules = [n for n, _ in model.named_modules()]
    tkern.convert_network(model, DTYPE)
    assert {n: id(p) for n, p in model.named_parameters()} == before  # the same Parameters
    assert [n for n, _ in model.named_modules()] == modules
    assert all(isinstance(a.__dict__["forward"], SplitAttentionForward) for a in _attentions(model))
    with _cats(monkeypatch) as seen:
        loss, got = _run(model, ids)
    assert seen == []  # no cat, stack, clone, copy or contiguous of (tokens, 3H)
    bound = 2 * max(rel_err(auto_loss, ref_loss), TOL[DTYPE])
    assert rel_err(loss, ref_loss) < bound
    for name, g in got.items():
        assert g.dtype == (torch.float32 if ".ln_" in name else DTYPE), name  # fp32 norms
        assert rel_err(g, ref[name]) < 2 * max(rel_err(auto[name], ref[name]), TOL[DTYPE]), name
    plain = _unsplit(copy.deepcopy(model))
    with _cats(monkeypatch) as seen:
        plain_loss, want = _run(plain, ids)
    assert "aten.cat.default" in seen  # the test can fail: HF's split backward concatenates
    assert torch.equal(loss, plain_loss)  # the same forward GEMM
    for name, g in got.items():
        tol = TOL[DTYPE] if "c_attn" in name else 4 * TOL[DTYPE]  # dX's roundings reach the rest
        assert rel_err(g, want[name]) < tol, name
    assert torch.equal(got["transformer.h.1.attn.c_attn.weight"], want["transformer.h.1.attn.c_attn.weight"])
    tkern.convert_network(model, torch.float32)  # back: the attentions' own forwards again
    assert not any("forward" in a.__dict__ for a in _attentions(model))


def _falls_back(monkeypatch, model, ids, want):
    """``model``'s step runs HF's split (its cat seen) and computes what the unrewritten model does."""
    with _cats(monkeypatch) as seen:
        loss, got = _run(model, ids)
    assert "aten.cat.default" in seen
    assert torch.equal(loss, want[0])
    for name, g in got.items():
        assert torch.equal(g, want[1][name]), name


def test_a_hooked_c_attn_or_a_compiling_call_runs_hfs_split(monkeypatch):
    model = tkern.convert_network(_model(), DTYPE)
    ids = _ids()
    want = _run(_unsplit(copy.deepcopy(model)), ids)
    seen = []
    c_attn = model.transformer.h[0].attn.c_attn
    handle = c_attn.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with _cats(monkeypatch) as ops:
        _run(model, ids)
    assert seen == [(B, T, 3 * H)] and ops.count("aten.cat.default") == 1  # layer 0's only
    handle.remove()
    monkeypatch.setattr(projections, "is_compiling", lambda: True)
    _falls_back(monkeypatch, model, ids, want)


def test_another_dtype_or_a_fp8_layer_runs_hfs_split(monkeypatch):
    model = tkern.convert_network(_model(), DTYPE)
    ids = _ids()
    want = _run(_unsplit(copy.deepcopy(model)), ids)
    monkeypatch.setattr(projections, "compute_operands", lambda m, x, w: (x, w.float()))
    with _cats(monkeypatch) as ops:
        _run(model, ids)
    assert ops.count("aten.cat.default") == 2  # both layers: HF's split
    monkeypatch.undo()
    assert torch.equal(_run(model, ids)[0], want[0])


def test_cross_attention_keeps_hfs_split():
    torch.manual_seed(2)
    model = tkern.convert_network(_model(add_cross_attention=True), DTYPE)
    ids = _ids()
    enc = torch.randn(B, 5, H, device=DEVICE).to(DTYPE)
    loss, got = _run(model, ids, encoder_hidden_states=enc)
    plain_loss, want = _run(_unsplit(copy.deepcopy(model)), ids, encoder_hidden_states=enc)
    assert torch.equal(loss, plain_loss)
    for name, g in got.items():
        assert rel_err(g, want[name]) < 4 * TOL[DTYPE], name


def _flat_steps(model, ids):
    """Two backwards under a FusedAdamW's flat buffer (written into the views, then added into
    them): each step's gradients (copies), every one a view of the buffer."""
    from tkern.flat import grad_is_flat_view
    from tkern.optim import FusedAdamW

    opt = FusedAdamW(model.parameters(), lr=1e-3)  # noqa: F841 (kept: it owns the flat buffer)
    got = []
    for _ in range(2):
        model(ids, labels=ids).loss.float().backward()
        got.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(grad_is_flat_view(p) for p in model.parameters())
    return got


def test_parts_grads_go_into_a_fused_optimizers_flat_buffer(wgrad_counts):
    model = tkern.convert_network(_model(), DTYPE)
    plain = _unsplit(copy.deepcopy(model))
    ids = _ids()
    got = _flat_steps(model, ids)
    counts = dict(wgrad_counts)
    wgrad_counts.update(into=0, copies=0)
    want = _flat_steps(plain, ids)
    # c_attn's dW and db straight into their views, as without the rewrite (the only copies:
    # the tied embedding's gradient, the same in both)
    assert counts == wgrad_counts and counts["into"] > 0
    for step in range(2):
        for name, g in want[step].items():
            if "attn.c_attn" in name and ".1." in name:  # layer 1's: the same dq, dk, dv
                assert torch.equal(got[step][name], g), name
            else:
                assert rel_err(got[step][name], g) < 4 * TOL[DTYPE], name


@pytest.mark.parametrize("bias", [None, torch.float16, torch.float32])
def test_split_linear_against_float64_with_a_missing_part(bias):
    torch.manual_seed(3)
    x = torch.randn(3, 5, 32, device=DEVICE).half().requires_grad_()
    w = (torch.randn(32, 48, device=DEVICE) / 32**0.5).half().requires_grad_()  # Conv1D's (K, N)
    b = None if bias is None else torch.randn(48, device=DEVICE).to(bias).requires_grad_()
    qs = split_linear(x, w.t(), b, (16, 16, 16))
    assert [q.shape for q in qs] == [(3, 5, 16)] * 3 and all(q._base is not None for q in qs)
    dys = [torch.randn(3, 5, 16, device=DEVICE).half() for _ in range(3)]
    torch.autograd.backward([qs[0], qs[2]], [dys[0], dys[2]])  # v's part: no gradient
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    y = xd @ wd + (0 if bd is None else bd)
    rs = y.split(16, -1)
    torch.autograd.backward([rs[0], rs[2]], [dys[0].double(), dys[2].double()])
    assert rel_err(qs[1], rs[1]) < TOL[DTYPE]
    assert rel_err(x.grad, xd.grad) < 2 * TOL[DTYPE]
    assert rel_err(w.grad, wd.grad) < TOL[DTYPE] and not w.grad[:, 16:32].any()
    if b is not None:
        assert b.grad.dtype == bias and rel_err(b.grad, bd.grad) < TOL[DTYPE] and not b.grad[16:32].any()
    with pytest.raises(ValueError, match="sum to"):
        split_linear(x, w.t(), b, (16, 16))
