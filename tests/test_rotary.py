"""tkern.apply_rotary_pos_emb (kernels/rotary.py, ops/rotary.py) against HF's formula in float64,
and convert_network's rotary rules (tkern/nn/rotary.py, ``ROTARY_RULES``) on transformers'
attention modules and a tiny Llama; tiny shapes, nothing downloaded.

Tolerances. The kernel computes ``x1 c1 - x2 s1`` (and its kin) in fp32 from the inputs as
given, then rounds once to the output dtype: each output element is within half an ulp of
its dtype of the exact value (``eps/2 * |ref|``), plus the fp32 arithmetic's own error,
a few units of 2^-24 of ``|x1 c1| + |x2 s1|`` (the terms, which may cancel). The backward
is the same map transposed, with the same bound over the upstream gradient's terms.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
import warnings

import pytest
import torch
from conftest import DEVICE, TOL, LazyModule, rel_err
from test_residual import EXPECTED_ADDS, counting_adds, loss_and_grads
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
from tkern.kernels.rotary import rotary_embedding
from tkern.nn.rotary import ROTARY_RULES, RotaryAttentionForward, route_rotary

transformers = pytest.importorskip("transformers")
modeling_gpt_neox = LazyModule("transformers.models.gpt_neox.modeling_gpt_neox")
modeling_llama = LazyModule("transformers.models.llama.modeling_llama")

B, H, HK, S, D = 2, 4, 2, 16, 32  # GQA: 2 kv heads for 4 query heads
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
FP32_ARITH = 4 * 2.0**-24  # a few fp32 roundings of the products and their sum


def _tables(batch: int, rotary_dim: int, dtype=torch.float32):
    """cos, sin (batch, S, rotary_dim) as HF's rotary embeddings build them: cat(freqs, freqs)."""
    angles = torch.randn(batch, S, rotary_dim // 2, dtype=torch.float64) * 3
    emb = torch.cat((angles, angles), -1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _reference(q, k, cos, sin, unsqueeze_dim=1):
    """HF's partial-rotary formula (GPT-NeoX's function) in float64: the full form where
    cos spans the head dim."""
    args = (t.double() for t in (q, k, cos, sin))
    return modeling_gpt_neox.apply_rotary_pos_emb(*args, unsqueeze_dim=unsqueeze_dim)


def _bound(x, ref, cos, sin, dtype):
    """Per element: half an ulp of ``dtype`` of the exact result ``ref`` plus the fp32
    arithmetic's error over the terms' magnitudes (``|x1 c1| + |x2 s1|`` and kin, the same
    forward and transposed); the pass-through columns: exact."""
    x, c, s = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    r = c.shape[-1]
    terms = (x[..., :r] * c).abs() + (modeling_llama.rotate_half(x[..., :r]) * s).abs()
    bound = EPS[dtype] / 2 * ref[..., :r].abs() + FP32_ARITH * terms
    return torch.cat((bound, torch.zeros_like(x[..., r:])), -1)


def _check_close(out, ref, bound, name):
    err = (out.double() - ref).abs()
    assert (err <= bound + 1e-300).all(), f"{name}: max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table_dtype", ["fp32", "same"])
def test_forward_and_backward_match_float64_within_one_rounding(dtype, table_dtype):
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(B, HK, S, D, device=DEVICE).to(dtype).requires_grad_()
    cos, sin = _tables(1, D, torch.float32 if table_dtype == "fp32" else dtype)  # broadcast over batch
    q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.dtype == k_embed.dtype == dtype and q_embed.is_contiguous()
    q_ref, k_ref = _reference(q, k, cos, sin)
    _check_close(q_embed, q_ref, _bound(q, q_ref, cos, sin, dtype), "q")
    _check_close(k_embed, k_ref, _bound(k, k_ref, cos, sin, dtype), "k")
    # backward against float64 autograd of HF's formula: the gradient rotated by -theta
    dq, dk = torch.randn_like(q_embed), torch.randn_like(k_embed)
    gq, gk = torch.autograd.grad((q_embed, k_embed), (q, k), (dq, dk))
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    rq, rk = _reference(q64, k64, cos, sin)
    ref_gq, ref_gk = torch.autograd.grad((rq, rk), (q64, k64), (dq.double(), dk.double()))
    _check_close(gq, ref_gq, _bound(dq, ref_gq, cos, sin, dtype), "dq")
    _check_close(gk, ref_gk, _bound(dk, ref_gk, cos, sin, dtype), "dk")


def test_partial_rotary_passes_the_rest_through_with_per_batch_tables():
    torch.manual_seed(1)
    q = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.float16)
    k = torch.randn(B, HK, S, D, device=DEVICE, dtype=torch.float16)
    cos, sin = _tables(B, 12)  # rotary_dim 12 of 32 (GPT-NeoX's rotary_pct), one table per batch row
    q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin)
    q_ref, k_ref = _reference(q, k, cos, sin)
    _check_close(q_embed, q_ref, _bound(q, q_ref, cos, sin, torch.float16), "q")
    _check_close(k_embed, k_ref, _bound(k, k_ref, cos, sin, torch.float16), "k")
    assert torch.equal(q_embed[..., 12:], q[..., 12:]) and torch.equal(k_embed[..., 12:], k[..., 12:])


def test_strided_views_of_a_packed_projection_and_the_seq_major_layout():
    torch.manual_seed(2)
    # GPT-NeoX: qkv (B, S, H * 3D) viewed (B, S, H, 3D), transposed, chunked: strided q, k views
    qkv = torch.randn(B, S, H * 3 * D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    q, k, _ = qkv.view(B, S, H, 3 * D).transpose(1, 2).chunk(3, dim=-1)
    assert not q.is_contiguous()
    cos, sin = _tables(1, D)
    q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin)
    q_ref = _reference(q, k, cos, sin)[0]
    _check_close(q_embed, q_ref, _bound(q, q_ref, cos, sin, torch.bfloat16), "q")
    (q_embed.float().sum() + 2 * k_embed.float().sum()).backward()
    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64, _ = qkv64.view(B, S, H, 3 * D).transpose(1, 2).chunk(3, dim=-1)
    rq, rk = _reference(q64, k64, cos, sin)
    (rq.sum() + 2 * rk.sum()).backward()
    assert rel_err(qkv.grad, qkv64.grad) < TOL[torch.bfloat16]
    # unsqueeze_dim=2: q and k (batch, seq, heads, head_dim), as HF's second layout
    qs, ks = q.detach().transpose(1, 2), k.detach().transpose(1, 2)
    q2, k2 = tkern.apply_rotary_pos_emb(qs, ks, cos, sin, unsqueeze_dim=2)
    assert q2.shape == qs.shape and torch.equal(q2, q_embed.detach().transpose(1, 2))
    assert torch.equal(k2, k_embed.detach().transpose(1, 2))


def test_position_ids_pick_rows_of_2d_tables():
    torch.manual_seed(3)
    q, k = torch.randn(1, H, S, D, device=DEVICE), torch.randn(1, HK, S, D, device=DEVICE)
    cos, sin = (t[0] for t in _tables(1, D))  # (S, D) tables
    position_ids = torch.arange(S, device=DEVICE).flip(0)[None]
    q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    ref = tkern.apply_rotary_pos_emb(q, k, cos.flip(0)[None], sin.flip(0)[None])
    assert torch.equal(q_embed, ref[0]) and torch.equal(k_embed, ref[1])


def test_no_aten_op_makes_a_q_or_k_shaped_tensor_but_the_kernels_outputs(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from tkern.kernels.rotary import _rotary_kernel

    seen, busy = [], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made = isinstance(out, torch.Tensor) and out.dim() == 4
            outputs = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
            if made and not busy and func not in outputs:  # the kernel's outputs are made, no other
                seen.append(str(func))
            return out

    if tkern.INTERPRET:  # the interpreter's own copies to and from the host, inside a launch
        real = type(_rotary_kernel).run
        monkeypatch.setattr(
            type(_rotary_kernel), "run", lambda *a, **k: busy.append(1) or _done(real(*a, **k))
        )

        def _done(result):
            busy.pop()
            return result

    q = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k = torch.randn(B, HK, S, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
    cos, sin = _tables(1, D, torch.float16)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    with Watch():
        q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.grad((q_embed, k_embed), (q, k), (dq, dk))
    assert seen == []


def test_bad_inputs_raise_naming_the_argument_before_launching():
    q, k = torch.randn(B, H, S, D), torch.randn(B, HK, S, D)
    cos, sin = _tables(1, D)
    cases = [
        ((q.half(), k, cos, sin), TypeError, r"k must have q's dtype torch.float16, got shape"),
        ((q[0], k, cos, sin), ValueError, r"q must be 4-D, got shape \(4, 16, 32\)"),
        ((q, k[:, :, :8], cos, sin), ValueError, r"k must have shape \(2, kv_heads, 16, 32\)"),
        ((q, k, cos[..., :7], sin[..., :7]), ValueError, r"rotary_dim even .* got shape \(1, 16, 7\)"),
        ((q, k, torch.cat((cos, cos), -1), sin), ValueError, r"at most head_dim 32"),
        ((q, k, cos, sin[:, :8]), ValueError, r"sin must have cos's shape \(1, 16, 32\)"),
        ((q.int(), k.int(), cos, sin), TypeError, r"q must have dtype in"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            rotary_embedding(*args)
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1"):
        tkern.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="cos and sin must not require grad"):
        tkern.apply_rotary_pos_emb(q, k, cos.requires_grad_(), sin)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        tkern.apply_rotary_pos_emb(q, [1], cos, sin)


def test_torch_compile_fullgraph_traces_the_custom_op():
    def f(q, k, cos, sin):
        q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin)
        return (q_embed.float() * 2).sum() + k_embed.float().sum()

    q = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k = torch.randn(B, HK, S, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
    cos, sin = _tables(1, D, torch.float16)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    try:
        out = compiled(q, k, cos, sin)
        grads = torch.autograd.grad(out, (q, k))
    finally:
        torch._dynamo.reset()
    ref = f(q, k, cos, sin)
    assert torch.equal(out, ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, torch.autograd.grad(ref, (q, k)), strict=True))


def test_double_backward_runs_the_torch_form():
    q = torch.randn(1, 2, S, D, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(1, 1, S, D).requires_grad_()
    cos, sin = _tables(1, D)
    q_embed, k_embed = tkern.apply_rotary_pos_emb(q, k, cos, sin)
    dq = torch.randn_like(q_embed, requires_grad=True)
    (gq,) = torch.autograd.grad(q_embed, q, dq, create_graph=True)
    (ggq,) = torch.autograd.grad(gq.sum(), dq)  # d/d(dq) of sum(R^T dq) = R 1
    ones = torch.ones_like(q)
    assert rel_err(ggq, tkern.apply_rotary_pos_emb(ones, k, cos, sin)[0]) < TOL[torch.float32]


# --------------------------------------------------------------------------- the rules


_FAMILIES = {
    "LlamaAttention": "llama", "MistralAttention": "mistral", "Qwen2Attention": "qwen2",
    "Qwen3Attention": "qwen3", "GemmaAttention": "gemma", "Gemma2Attention": "gemma2",
    "Gemma3Attention": "gemma3", "OlmoAttention": "olmo", "Olmo2Attention": "olmo2",
    "GraniteAttention": "granite", "PhiAttention": "phi", "Phi3Attention": "phi3",
    "GPTNeoXAttention": "gpt_neox",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROTARY_RULES))
def test_each_rule_is_what_its_family_computes(name):
    """The family's forward calls the rule's function, and that function (float64) equals
    tkern's: on the whole head dim, and where ``partial``, on the first 12 columns."""
    family = importlib.import_module(f"transformers.models.{_FAMILIES[name]}.modeling_{_FAMILIES[name]}")
    rule, cls = ROTARY_RULES[name], getattr(family, name)
    assert rule.function in inspect.unwrap(cls.forward).__code__.co_names
    hf = getattr(family, rule.function)
    torch.manual_seed(4)
    q, k = torch.randn(B, H, S, D, device=DEVICE), torch.randn(B, HK, S, D, device=DEVICE)
    for rotary_dim in (D, 12) if rule.partial else (D,):
        cos, sin = _tables(B, rotary_dim)
        ref = hf(*(t.double() for t in (q, k, cos, sin)))
        out = tkern.apply_rotary_pos_emb(q, k, cos, sin)
        for o, r, x in zip(out, ref, (q, k), strict=True):
            _check_close(o, r, _bound(x, r, cos, sin, torch.float32), name)


def _llama_config(**kw):
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S, **kw,
    )  # fmt: skip


def _attention_case(family):
    """(attention module, twin, its forward's arguments) of ``family`` in fp32."""
    if family == "llama":
        config = _llama_config()
        attn = modeling_llama.LlamaAttention(config, layer_idx=0)
        rope = modeling_llama.LlamaRotaryEmbedding(config)
    else:  # partial rotary: 8 of 16 head-dim columns
        config = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.5)
        attn = modeling_gpt_neox.GPTNeoXAttention(config, layer_idx=0)
        rope = modeling_gpt_neox.GPTNeoXRotaryEmbedding(config)
    config._attn_implementation = "eager"
    x = torch.randn(B, S, 64, device=DEVICE, requires_grad=True)
    position_embeddings = rope(x, torch.arange(S, device=DEVICE)[None])
    attn = attn.to(DEVICE)
    return attn, copy.deepcopy(attn), x, {"position_embeddings": position_embeddings, "attention_mask": None}


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_a_routed_attention_module_matches_its_twin_and_leaves_hf_alone(family, monkeypatch):
    torch.manual_seed(5)
    attn, twin, x, kwargs = _attention_case(family)
    params = dict(attn.named_parameters())
    state = {n: t.clone() for n, t in attn.state_dict().items()}
    assert route_rotary(attn) is None
    assert isinstance(attn.__dict__["forward"], RotaryAttentionForward)
    assert dict(attn.named_parameters()) == params and attn.state_dict().keys() == state.keys()
    hf_calls, kernel_calls = [], []
    family_module = importlib.import_module(  # the module itself (patched below), not its lazy proxy
        f"transformers.models.{family}.modeling_{family}"
    )
    real_hf = family_module.apply_rotary_pos_emb
    monkeypatch.setattr(
        family_module, "apply_rotary_pos_emb", lambda *a, **k: hf_calls.append(1) or real_hf(*a, **k)
    )
    real_kernel = tkern.ops.rotary.rotary_embedding
    monkeypatch.setattr(
        tkern.ops.rotary, "rotary_embedding", lambda *a, **k: kernel_calls.append(1) or real_kernel(*a, **k)
    )
    out = attn(x, **kwargs)[0]
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert (len(hf_calls), len(kernel_calls)) == (0, 2)  # forward and backward on tkern's kernel
    ref = twin(x, **kwargs)[0]
    (ref_gx,) = torch.autograd.grad(ref.sum(), x)
    assert len(hf_calls) == 1  # the unconverted twin still runs HF's own rotary
    assert rel_err(out, ref) < 1e-5 and rel_err(gx, ref_gx) < 1e-5
    # pickles and deep-copies with its forward; converting back to fp32 removes it. The counters
    # come off first: with `kernels` installed, transformers' kernelized rotary pickles by its
    # module-level name, which the counter above stands in for
    monkeypatch.undo()
    for clone in (pickle.loads(pickle.dumps(attn)), copy.deepcopy(attn)):
        assert clone.__dict__["forward"].attention is clone
        assert torch.equal(clone(x, **kwargs)[0], out)
    tkern.convert_network(attn, torch.float32)
    assert "forward" not in attn.__dict__


def test_an_unknown_family_is_warned_once_and_left_to_hf():
    config = transformers.GPTJConfig(
        n_embd=32, n_layer=2, n_head=2, rotary_dim=8, vocab_size=64, n_positions=16
    )
    model = transformers.GPTJForCausalLM(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tkern.convert_network(model, torch.float16)
    said = [str(w.message) for w in caught if "rotary embedding left eager" in str(w.message)]
    assert len(said) == 1, said
    assert "transformer.h.0.attn, transformer.h.1.attn (GPTJAttention)" in said[0]
    assert (
        "tkern has no rotary rule for this attention class; its apply_rotary_pos_emb runs as torch ops"
        in said[0]
    )
    assert "forward" not in model.transformer.h[0].attn.__dict__


def test_converted_llama_matches_fp32_and_autocast_and_its_twin_runs_hf(monkeypatch):
    """A converted tiny Llama (rotary on tkern's kernel, the first residual add of each layer in
    its norm: tests/test_residual.py) against the unconverted model: tests/test_blocks.py's
    whole-model bound (the loss within one rounding of fp32, each gradient within twice
    autocast's distance from fp32, or two roundings)."""
    torch.manual_seed(6)
    dtype = torch.bfloat16
    model = transformers.LlamaForCausalLM(_llama_config()).to(DEVICE)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, S), device=DEVICE)
    ref_loss, ref = loss_and_grads(twin, ids)
    auto_loss, auto = loss_and_grads(twin, ids, dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rotary_emb.*")  # Llama's inv_freq stays fp32
        tkern.convert_network(model, dtype)
    assert all(isinstance(layer.self_attn.forward, RotaryAttentionForward) for layer in model.model.layers)
    kernel_calls = []
    real_kernel = tkern.ops.rotary.rotary_embedding
    monkeypatch.setattr(
        tkern.ops.rotary, "rotary_embedding", lambda *a, **k: kernel_calls.append(1) or real_kernel(*a, **k)
    )
    with counting_adds(monkeypatch, (2, S, 64)) as adds:
        loss, grads = loss_and_grads(model, ids)
    assert len(kernel_calls) == 4  # two layers, forward and backward
    assert adds.counts == EXPECTED_ADDS
    assert rel_err(loss, ref_loss) < TOL[dtype] and rel_err(auto_loss, ref_loss) < TOL[dtype]
    for name, g in grads.items():
        bound = 2 * max(rel_err(auto[name], ref[name]), TOL[dtype])
        assert rel_err(g, ref[name]) < bound, name
    assert all("forward" not in layer.self_attn.__dict__ for layer in twin.model.layers)
    assert torch.equal(twin(ids, labels=ids).loss, ref_loss)  # HF's own rotary, untouched


class _CopiesOver(TorchDispatchMode):
    """The aten copies (clone, copy_, cat, contiguous's copies) whose output is 4-D (heads
    split off) with one of ``numels`` elements, outside Triton's launches (the ``launches``
    fixture disables modes)."""

    COPIES = (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten.cat, torch.ops.aten._to_copy)

    def __init__(self, numels):
        super().__init__()
        self.numels, self.seen = numels, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        copied = func.overloadpacket in self.COPIES and isinstance(out, torch.Tensor) and out.dim() == 4
        if copied and out.numel() in self.numels:
            self.seen.append(str(func))
        return out


def test_a_converted_llama_copies_no_q_k_v_or_attention_output(launches):
    """Issue 54 item 6: q and k rotated into their projections' layout (HF's transposed views)
    and their gradients written back in it, so neither the forward (SDPA's output merge) nor
    the backward (``view``'s gradient of a transposed dq / dk) copies an activation. HF's
    cache is off, as a training step runs it (``use_cache=False``: its cat is the cache's)."""
    model = transformers.LlamaForCausalLM(_llama_config()).to(DEVICE)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rotary_emb.*")
        tkern.convert_network(model, torch.bfloat16)
    ids = torch.randint(0, 64, (2, S), device=DEVICE)
    cfg = model.config
    head = cfg.hidden_size // cfg.num_attention_heads
    numels = {2 * S * cfg.num_attention_heads * head, 2 * S * cfg.num_key_value_heads * head}
    with _CopiesOver(numels) as copies:
        model(ids, labels=ids, use_cache=False).loss.float().backward()
    assert copies.seen == []
    assert any(name == "_rotary_kernel" for name, _ in launches)
