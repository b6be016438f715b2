"""convert_network on transformers' MLP blocks (tkern/nn/fusion.py, ``MLP_RULES``): GPT-2's
activation in c_fc's GEMM epilogue, Llama's ``act(gate) * up`` one fused kernel, forward and
backward, with the same Parameter objects; no torch op over the (tokens, intermediate)
activation (a dispatch-level check); tiny configs built here, nothing downloaded."""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import inspect
import pickle
import re
import textwrap
import warnings

import pytest
import torch
from conftest import DEVICE, TOL, ops_over, rel_err
from torch import nn

from tkern.nn import convert_network, fusion
from tkern.nn.fusion import MLP_RULES, FusedMLPForward

transformers = pytest.importorskip("transformers")

HIDDEN, INTER, TOKENS = 32, 80, (2, 5)  # (batch, seq): 10 x 80: no weight, no 3 * HIDDEN (c_attn)


def _module(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


# --------------------------------------------------------------------------- the table is true


_FAMILY_OF = {
    "GPT2MLP": "gpt2", "PhiMLP": "phi", "GPTNeoXMLP": "gpt_neox", "BertIntermediate": "bert",
    "LlamaMLP": "llama", "MistralMLP": "mistral", "Qwen2MLP": "qwen2", "Qwen3MLP": "qwen3",
    "GemmaMLP": "gemma", "Gemma2MLP": "gemma2", "Gemma3MLP": "gemma3", "OlmoMLP": "olmo",
    "GraniteMLP": "granite", "Phi3MLP": "phi3", "T5DenseActDense": "t5", "T5DenseGatedActDense": "t5",
}  # fmt: skip
_CONFIGS = {
    "gpt2": "GPT2Config", "phi": "PhiConfig", "gpt_neox": "GPTNeoXConfig", "bert": "BertConfig",
    "llama": "LlamaConfig", "gemma": "GemmaConfig", "phi3": "Phi3Config", "t5": "T5Config",
}  # fmt: skip
#: T5's ``if`` before ``wo`` (MLPRule.to_down_dtype), whitespace removed.
_T5_CAST = (
    "ifisinstance(self.wo.weight,torch.Tensor)andhidden_states.dtype!=self.wo.weight.dtype"
    "and(self.wo.weight.dtype!=torch.int8):hidden_states=hidden_states.to(self.wo.weight.dtype)"
)


def _statements(rule) -> list[str]:
    """The forward body each form stands for (whitespace removed, names as the rule gives)."""
    mid = [f"hidden_states=self.{n}(hidden_states)" for n in rule.mid] + (
        [_T5_CAST] if rule.to_down_dtype else []
    )
    if rule.form == "gated" and mid:  # T5's statements
        return [
            f"hidden_gelu=self.{rule.act}(self.{rule.gate}(hidden_states))",
            f"hidden_linear=self.{rule.up}(hidden_states)",
            "hidden_states=hidden_gelu*hidden_linear",
            *mid,
            f"hidden_states=self.{rule.down}(hidden_states)",
            "returnhidden_states",
        ]
    if rule.form == "gated":
        return [
            f"down_proj=self.{rule.down}(self.{rule.act}(self.{rule.gate}(x))*self.{rule.up}(x))",
            "returndown_proj",
        ]
    if rule.form == "packed":
        return [
            f"up_states=self.{rule.up}(hidden_states)",
            "gate,up_states=up_states.chunk(2,dim=-1)",
            f"up_states=up_states*self.{rule.act}(gate)",
            f"returnself.{rule.down}(up_states)",
        ]
    first = [f"hidden_states=self.{n}(hidden_states)" for n in (rule.up, rule.act)]
    last = [
        f"hidden_states=self.{n}(hidden_states)" for n in ([rule.down] if rule.down else []) + [*rule.tail]
    ]
    return [*first, *mid, *last, "returnhidden_states"]


@pytest.mark.parametrize("name", sorted(MLP_RULES))
def test_each_rule_is_its_class_forward(name):
    # the rule replaces the class's forward: read that forward's statements from its source
    cls = getattr(_module(_FAMILY_OF[name]), name)
    body = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0].body
    code = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert [re.sub(r"\s", "", ast.unparse(s)) for s in code] == _statements(MLP_RULES[name])


# --------------------------------------------------------------------------- one block


def _block(name: str, act: str | None = None, **extra) -> nn.Module:
    """An MLP block of family ``name`` from a tiny config (fp32, seeded)."""
    torch.manual_seed(0)
    module = _module(_FAMILY_OF[name])
    config_cls = getattr(transformers, _CONFIGS[_FAMILY_OF[name]])
    sizes = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": 2, **extra}
    if name == "GPT2MLP":
        config = config_cls(n_embd=HIDDEN, n_head=2, activation_function=act or "gelu_new", resid_pdrop=0.0)
        return module.GPT2MLP(INTER, config).to(DEVICE)
    if name.startswith("T5"):  # act: T5Config's feed_forward_proj ("relu", "gated-gelu", ...)
        config = config_cls(d_model=HIDDEN, d_ff=INTER, num_heads=2, feed_forward_proj=act, dropout_rate=0.0)
        return getattr(module, name)(config).to(DEVICE)
    config = config_cls(**sizes, **({"hidden_act": act} if act else {}))
    return getattr(module, name)(config).to(DEVICE)


def _run(block: nn.Module, x: torch.Tensor, dy_dtype: torch.dtype | None = None):
    """Output, and the gradients of x and every param for an upstream gradient of O(1)
    (seeded normal values rounded to ``dy_dtype``: the same values for every run)."""
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = block(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dy_dtype or y.dtype)
    y.backward(dy.to(y.dtype).to(y.device))
    return y.detach(), [x.grad, *(p.grad for p in block.parameters())]


def _float64_twin(block: nn.Module, converted: nn.Module) -> nn.Module:
    """``block`` in float64 with ``converted``'s (rounded) weights."""
    twin = copy.deepcopy(block).double()
    for p, q in zip(twin.parameters(), converted.parameters(), strict=True):
        p.data = q.detach().double()
    return twin


def _act_calls(monkeypatch, block, rule) -> list:
    """Calls of the activation module's class forward (a counter that hooks nothing)."""
    calls = []
    act_cls = type(getattr(block, rule.act))
    real = act_cls.forward
    monkeypatch.setattr(act_cls, "forward", lambda self, x: calls.append(1) or real(self, x))
    return calls


BLOCKS = [
    ("GPT2MLP", "gelu_new"),
    ("GPT2MLP", "gelu_pytorch_tanh"),
    ("GPT2MLP", "gelu_fast"),
    ("GPT2MLP", "gelu"),
    ("GPT2MLP", "relu"),
    ("GPT2MLP", "silu"),
    ("PhiMLP", "gelu_new"),
    ("GPTNeoXMLP", "gelu"),
    ("BertIntermediate", "gelu"),
    ("LlamaMLP", "silu"),
    ("GemmaMLP", None),  # its default, gelu_pytorch_tanh: GeGLU
    ("Phi3MLP", "silu"),
    ("T5DenseActDense", "relu"),
    ("T5DenseActDense", "gelu_new"),
    ("T5DenseGatedActDense", "gated-gelu"),  # flan-T5's: gelu_new
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("name", "act"), BLOCKS)
def test_block_runs_fused_and_matches_float64(name, act, dtype, monkeypatch):
    block = _block(name, act)
    converted = convert_network(copy.deepcopy(block), dtype)
    rule = MLP_RULES[name]
    assert isinstance(vars(converted)["forward"], FusedMLPForward) and type(converted) is type(block)
    calls = _act_calls(monkeypatch, converted, rule)
    x = torch.randn(*TOKENS, HIDDEN, device=DEVICE)
    got = _run(converted, x)
    assert calls == []  # the activation module never ran: tkern's kernels computed it
    want = _run(_float64_twin(block, converted), x.to(dtype).double(), dtype)  # the same dy
    # each output and gradient is a chain of two or three kernels, each rounding once to
    # dtype (u; TOL is 2u) from fp32: as test_fusion's Linear + activation pairs, 2 * TOL
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        assert rel_err(a, b) < 2 * TOL[dtype]


def test_gelu_tanh_in_fp32_keeps_the_digits_hf_fp16_loses_at_negative_x():
    # HF's NewGELUActivation in fp16: 0.5 x (1 + tanh(u)) cancels for negative x (tanh(u)
    # -> -1); the epilogue computes x * sigmoid(2u) in fp32 and rounds once
    block = _block("GPT2MLP", "gelu_new")
    with torch.no_grad():
        block.c_fc.weight.copy_(torch.eye(HIDDEN, INTER))
        block.c_fc.bias.zero_()
    convert_network(block)
    seen = []
    block.c_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))  # c_proj's input
    x = torch.full((1, HIDDEN), -3.6, device=DEVICE)
    block(x)
    h = seen[0][0, 0].double()
    z = torch.tensor(-3.6, dtype=torch.float16).double()
    ref = 0.5 * z * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (z + 0.044715 * z**3)))
    ulp = torch.finfo(torch.float16).eps * 2.0 ** torch.floor(torch.log2(ref.abs()))  # fp16 spacing at ref
    hf = transformers.activations.NewGELUActivation()(torch.tensor([-3.6], dtype=torch.float16)).double()
    assert (h - ref).abs() <= ulp / 2 * 1.01  # correctly rounded, within one fp16 rounding
    assert (hf - ref).abs() > 1000 * ulp  # HF's fp16 chain gives -0.0: ~1700 spacings off


def test_hook_on_the_activation_runs_the_class_forward_until_removed(monkeypatch):
    block = convert_network(_block("LlamaMLP", "silu"))
    seen = []
    handle = block.act_fn.register_forward_hook(lambda m, args, out: seen.append(out))
    x = torch.randn(*TOKENS, HIDDEN, device=DEVICE)
    y = block(x)
    assert len(seen) == 1 and seen[0].shape == (*TOKENS, INTER)  # the hook saw the activation
    handle.remove()
    calls = _act_calls(monkeypatch, block, MLP_RULES["LlamaMLP"])
    fused = block(x)
    assert calls == []
    # the class's forward rounds silu(gate) and the product in fp16, the kernel once: 2 * TOL
    assert rel_err(fused, y) < 2 * TOL[torch.float16]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "back", "again"])
def test_copies_and_converting_back(how):
    block = convert_network(_block("GPT2MLP"))
    x = torch.randn(3, HIDDEN, device=DEVICE)
    if how == "again":  # converting again replaces the fused forward; without fusion, removes it
        first = vars(block)["forward"]
        y = block(x)
        convert_network(block)
        assert vars(block)["forward"] is not first and torch.equal(block(x), y)
        convert_network(block, fuse_activations=False)
        assert "forward" not in vars(block)
        return
    if how == "back":
        params = list(block.parameters())
        convert_network(block, torch.float32)
        assert "forward" not in vars(block) and list(block.parameters()) == params
        assert block(x).dtype == torch.float32
        return
    other = copy.deepcopy(block) if how == "deepcopy" else pickle.loads(pickle.dumps(block))
    assert vars(other)["forward"].mlp is other
    assert torch.equal(other(x), block(x))


@pytest.mark.parametrize("name", ["GPT2MLP", "LlamaMLP", "Phi3MLP"])
def test_fused_blocks_compile_fullgraph_as_eager(name, monkeypatch):
    # the fused forwards trace (tkern's custom ops: no graph break) to the same kernels; a
    # traced GPT-2 MLP runs its layers one by one (tkern.ops.mlp has no custom op yet), so
    # eager is compared on that path (act' after c_proj's dgrad, not in its epilogue)
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", False)
    block = convert_network(_block(name, "silu" if name != "GPT2MLP" else None))
    x = torch.randn(*TOKENS, HIDDEN, device=DEVICE)
    eager = _run(block, x)
    torch._dynamo.reset()
    compiled = _run(torch.compile(block, fullgraph=True, backend="aot_eager"), x)
    for a, b in zip([compiled[0], *compiled[1]], [eager[0], *eager[1]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("name", "act"), [("T5DenseActDense", "relu"), ("T5DenseGatedActDense", "gated-silu")]
)
def test_t5_blocks_fuse_with_wo_kept_fp32(name, act, monkeypatch):
    # T5's models keep wo in fp32 in fp16 (_keep_in_fp32_modules); its forward casts wo's
    # input to wo's dtype: so does the fused form, and the output is fp32 as eager's
    class Keeps(nn.Module):
        _keep_in_fp32_modules = ["wo"]

        def __init__(self, ff):
            super().__init__()
            self.ff = ff

    with pytest.warns(UserWarning, match=r"ff\.wo \(Linear\): kept in fp32"):
        model = convert_network(Keeps(_block(name, act)), torch.float16)
    block = model.ff
    assert isinstance(vars(block)["forward"], FusedMLPForward)
    assert block.wo.weight.dtype == torch.float32  # kept, as asked
    assert getattr(block, MLP_RULES[name].up).weight.dtype == torch.float16
    x = torch.randn(*TOKENS, HIDDEN, device=DEVICE, dtype=torch.float16)
    eager = type(block).forward(block, x)  # the class's own forward on the converted block
    calls = _act_calls(monkeypatch, block, MLP_RULES[name])
    fused = block(x)
    assert calls == [] and fused.dtype == eager.dtype == torch.float32
    if act == "relu":  # relu(round(z)) == round(relu(z)): the same fp16 input to wo
        assert torch.equal(fused, eager)
    else:  # eager rounds silu(gate) and the product in fp16, the kernel once: 2 * TOL
        assert rel_err(fused, eager) < 2 * TOL[torch.float16]


# --------------------------------------------------------------------------- what is left eager


def test_an_activation_without_a_kernel_and_an_mlp_without_a_rule_warn_once_per_class():
    gptj = _module("gptj")
    config = gptj.GPTJConfig(n_embd=HIDDEN, n_head=2, rotary_dim=4)
    model = nn.ModuleDict(
        {
            "quick": nn.ModuleList([_block("GPT2MLP", "quick_gelu"), _block("GPT2MLP", "quick_gelu")]),
            "gptj": nn.ModuleList([gptj.GPTJMLP(INTER, config), gptj.GPTJMLP(INTER, config)]),
        }
    ).to(DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_network(model)
    said = [str(w.message) for w in caught if "left eager" in str(w.message)]
    assert len(said) == 2, said
    assert "quick.0, quick.1 (GPT2MLP): left eager, its activation QuickGELUActivation is not one" in said[0]
    assert "gptj.0, gptj.1 (GPTJMLP): left eager, tkern has no fusion rule for this MLP class" in said[1]
    assert all(w.filename == __file__ for w in caught if "left eager" in str(w.message))
    assert not any("forward" in vars(m) for m in model.modules())


def _left_eager(model: nn.Module) -> list[str]:
    """convert_network's "left eager" warnings for ``model`` (fp16)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_network(model)
    return [str(w.message) for w in caught if "left eager" in str(w.message)]


def test_an_activation_inline_between_gemm_layers_warns_once_per_class():
    # OPT's decoder layer calls fc2(activation_fn(fc1(x))) in its own forward: no rule, said
    opt = _module("opt")
    config = transformers.OPTConfig(
        hidden_size=HIDDEN, ffn_dim=INTER, num_attention_heads=2, word_embed_proj_dim=HIDDEN
    )
    model = nn.ModuleList([opt.OPTDecoderLayer(config, i) for i in range(2)]).to(DEVICE)
    said = _left_eager(model)
    assert len(said) == 1, said
    assert (
        "0, 1 (OPTDecoderLayer): left eager, tkern has no fusion rule for this class, whose "
        "activation_fn runs between its GEMM layers" in said[0]
    )


def test_models_whose_blocks_have_rules_say_nothing_left_eager():
    # the same search finds nothing in models whose MLP blocks all have rules (T5's both kinds)
    t5 = [
        transformers.T5Model(
            transformers.T5Config(
                vocab_size=64,
                d_model=HIDDEN,
                d_kv=8,
                d_ff=INTER,
                num_layers=1,
                num_heads=2,
                feed_forward_proj=proj,
            )
        )
        for proj in ("relu", "gated-gelu")
    ]
    for model in (_gpt2(), _llama(), *t5):
        assert _left_eager(model.to(DEVICE)) == [], type(model).__name__
    assert sum(isinstance(vars(m).get("forward"), FusedMLPForward) for t in t5 for m in t.modules()) == 4


# --------------------------------------------------------------------------- whole models


def test_the_dispatch_check_sees_an_unfused_block(monkeypatch):
    # the check can fail: the same blocks unfused run torch ops over (tokens, intermediate)
    tokens = TOKENS[0] * TOKENS[1]
    for name in ("GPT2MLP", "LlamaMLP"):
        block = convert_network(_block(name, "silu" if name == "LlamaMLP" else None), fuse_activations=False)
        with ops_over(monkeypatch, {(tokens * INTER, INTER)}) as seen:
            _run(block, torch.randn(*TOKENS, HIDDEN, device=DEVICE))
        assert any("mul" in op for op in seen), (name, seen)


@pytest.mark.parametrize("name", ["GemmaMLP", "Phi3MLP"])
def test_fused_gated_blocks_run_no_torch_op_over_the_activation(name, monkeypatch):
    tokens = TOKENS[0] * TOKENS[1]
    block = convert_network(_block(name))
    sizes = {(tokens * INTER, INTER), (tokens * 2 * INTER, 2 * INTER)}  # Phi-3's gate_up too
    with ops_over(monkeypatch, sizes) as seen:
        _run(block, torch.randn(*TOKENS, HIDDEN, device=DEVICE))
    assert seen == []


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=2, n_inner=INTER,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _loss_and_grads(model, ids, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    context = torch.autocast(DEVICE, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with context:
        loss = model(ids, labels=ids).loss
    loss.float().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("make", "dtype"), [(_gpt2, torch.float16), (_llama, torch.bfloat16)])
def test_whole_model_matches_fp32_and_autocast_with_no_torch_op_over_the_activation(make, dtype, monkeypatch):
    torch.manual_seed(0)
    model = make().to(DEVICE)
    ids = torch.randint(0, 64, TOKENS, device=DEVICE)
    ref_loss, ref = _loss_and_grads(model, ids)  # fp32
    auto_loss, auto = _loss_and_grads(model, ids, dtype)
    params = {n: p for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rotary_emb.*")  # Llama's inv_freq stays fp32
        convert_network(model, dtype)
    assert {n: p for n, p in model.named_parameters()} == params  # the very same Parameter objects
    assert all(p1 is p2 for p1, p2 in zip(params.values(), model.parameters(), strict=True))
    tokens = TOKENS[0] * TOKENS[1]
    with ops_over(monkeypatch, {(tokens * INTER, INTER)}) as seen:
        loss, grads = _loss_and_grads(model, ids)
    assert seen == []  # forward and backward: only tkern's kernels touched the activation
    # the loss: a mean over tokens of fp32 log-softmax of 16-bit logits: within one rounding
    assert rel_err(loss, ref_loss) < TOL[dtype] and rel_err(auto_loss, ref_loss) < TOL[dtype]
    # every gradient within twice autocast's distance from fp32 (tkern rounds the weight
    # gradients to dtype once more: autocast keeps them fp32), or two roundings (2 * TOL)
    for name, g in grads.items():
        assert g.dtype == params[name].dtype
        bound = 2 * max(rel_err(auto[name], ref[name]), TOL[dtype])
        assert rel_err(g, ref[name]) < bound, name
