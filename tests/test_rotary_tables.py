"""The rotary embedding's (cos, sin) tables on tkern's kernel (kernels/rotary.py's
``rotary_tables``, ops/rotary.py, nn/rotary_tables.py's ``ROTARY_TABLES_RULES``) against
transformers' own rotary embedding modules; tiny shapes, nothing downloaded.

Tolerances. The kernel forms the angle as HF does, one fp32 product ``position * inv_freq``
(the same value in both), then its cos and sin in fp32: the remainder modulo pi/2 in fp64,
cephes' polynomials (about an fp32 ulp), times the scaling (one more fp32 rounding), then one
rounding to the output dtype. Against the exact cos / sin of that fp32 angle times the
scaling, each element is within half an ulp of its dtype (``eps/2 * |ref|``) plus the fp32
arithmetic's error, a few units of 2^-24 of the scaling (the values are at most the scaling
in magnitude): :data:`FP32_ARITH`.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
from conftest import DEVICE, TOL, LazyModule, rel_err

import tkern
from tkern.kernels.rotary import rotary_tables
from tkern.nn.rotary_tables import ROTARY_TABLES_RULES, STATIC_ROPE_TYPES, RotaryTablesForward

transformers = pytest.importorskip("transformers")
modeling_llama = LazyModule("transformers.models.llama.modeling_llama")

S = 16
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
FP32_ARITH = 4 * 2.0**-24  # the polynomial's ~1 ulp, the reduction's rounding, the scaling's product
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": S, "rope_theta": 10000.0}


def _config(rope=None, head_dim=None, **kw):
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        **({"head_dim": head_dim} if head_dim else {}), **kw,
    )  # fmt: skip


def _reference(module, position_ids):
    """HF's module's tables in float64 from its own fp32 angles (HF's one fp32 product)."""
    angle = position_ids[..., None].float() * module.inv_freq.float()  # HF's freqs, fp32
    emb = torch.cat((angle, angle), -1).double()
    return emb.cos() * module.attention_scaling, emb.sin() * module.attention_scaling


def _check(out, ref, dtype, scaling, name):
    bound = EPS[dtype] / 2 * ref.abs() + FP32_ARITH * abs(scaling)
    err = (out.double() - ref).abs()
    assert out.dtype == dtype and out.shape == ref.shape, name
    assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_tables_match_hfs_module_in_float64_within_one_rounding(dtype, rope):
    """Ragged sizes (head_dim 24: 12 frequencies, 37 positions), a batch of 3 position-id rows
    (one running to 40000: large angles), yarn's attention_scaling != 1; HF's own fp32
    tables are within the same bound (the reference is HF's)."""
    module = modeling_llama.LlamaRotaryEmbedding(_config(YARN if rope == "yarn" else None, head_dim=24))
    module = module.to(DEVICE)
    assert (module.attention_scaling != 1.0) == (rope == "yarn")
    position_ids = torch.stack((torch.arange(37), torch.arange(37).flip(0) + 5, torch.arange(37) * 1111)).to(
        DEVICE
    )
    x = torch.empty(3, 37, 64, dtype=dtype, device=DEVICE)
    cos, sin = rotary_tables(position_ids, module.inv_freq, module.attention_scaling, dtype)
    ref_cos, ref_sin = _reference(module, position_ids)
    _check(cos, ref_cos, dtype, module.attention_scaling, "cos")
    _check(sin, ref_sin, dtype, module.attention_scaling, "sin")
    hf_cos, hf_sin = module(x.float(), position_ids)  # HF's own, fp32
    _check(hf_cos, ref_cos, torch.float32, module.attention_scaling, "HF's cos")
    _check(hf_sin, ref_sin, torch.float32, module.attention_scaling, "HF's sin")
    # int32 position ids and a broadcast batch (stride 0) give the same tables
    wide = position_ids[:1].int().expand(3, -1)
    cos32, _ = rotary_tables(wide, module.inv_freq, module.attention_scaling, dtype)
    assert torch.equal(cos32, cos[:1].expand(3, -1, -1))


def test_bad_inputs_raise_naming_the_argument_before_launching(launches):
    pos, inv = torch.arange(S)[None], torch.ones(4)
    cases = [
        ((pos[0], inv), ValueError, r"position_ids must be 2-D, got shape \(16,\)"),
        ((pos.float(), inv), TypeError, r"position_ids must have dtype in"),
        ((pos, inv.double()), TypeError, r"inv_freq must have dtype in \(torch.float32\)"),
        ((pos, inv[None]), ValueError, r"inv_freq must be 1-D"),
        ((pos, inv[:0]), ValueError, r"inv_freq must have at least one frequency"),
        ((pos, inv, "1"), TypeError, r"attention_scaling must be a float, got '1'"),
        ((pos, inv, 1.0, torch.int8), TypeError, r"dtype must be one of"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            rotary_tables(*args)
    assert launches == []
    cos, sin = rotary_tables(pos[:, :0], inv, 1.0, torch.float16)  # no rows: no launch
    assert cos.shape == sin.shape == (1, 0, 8) and launches == []


def test_traced_and_meta_calls_run_the_same_math_as_torch_ops():
    module = modeling_llama.LlamaRotaryEmbedding(_config(YARN)).to(DEVICE)
    position_ids = torch.arange(S, device=DEVICE)[None]
    scaling = module.attention_scaling

    def f(pos, inv_freq):
        return tkern.ops.rotary.rotary_tables(pos, inv_freq, scaling, torch.bfloat16)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    try:
        cos, sin = compiled(position_ids, module.inv_freq)
    finally:
        torch._dynamo.reset()
    ref_cos, ref_sin = _reference(module, position_ids)
    _check(cos, ref_cos, torch.bfloat16, scaling, "traced cos")
    _check(sin, ref_sin, torch.bfloat16, scaling, "traced sin")
    meta = f(position_ids.to("meta"), module.inv_freq.to("meta"))
    assert all(t.is_meta and t.shape == (1, S, 16) and t.dtype == torch.bfloat16 for t in meta)


# --------------------------------------------------------------------------- the rules


_FAMILIES = {
    "LlamaRotaryEmbedding": "llama", "MistralRotaryEmbedding": "mistral",
    "Qwen2RotaryEmbedding": "qwen2", "Qwen3RotaryEmbedding": "qwen3",
    "GemmaRotaryEmbedding": "gemma", "Gemma2RotaryEmbedding": "gemma2",
    "GraniteRotaryEmbedding": "granite", "PhiRotaryEmbedding": "phi",
    "Phi3RotaryEmbedding": "phi3", "GPTNeoXRotaryEmbedding": "gpt_neox",
    "OlmoRotaryEmbedding": "olmo", "Olmo2RotaryEmbedding": "olmo2",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROTARY_TABLES_RULES))
def test_each_rule_is_what_its_family_computes(name):
    """The family's forward (below dynamic_rope_update) is Llama's math, returning its tables
    in x's dtype or fp32 as the rule says."""
    family = _FAMILIES[name]
    module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=[name])
    source = inspect.getsource(inspect.unwrap(getattr(module, name).forward))
    body = "".join(source.split())
    for line in (
        "freqs=position_ids[...,None].float()*self.inv_freq.to(device=x.device,dtype=torch.float)",
        "emb=torch.cat((freqs,freqs),dim=-1)",
        "cos=emb.cos()*self.attention_scaling",
        "sin=emb.sin()*self.attention_scaling",
    ):
        assert line in body, (name, line)
    into_x = ROTARY_TABLES_RULES[name].tables == "input"
    returns = "returncos.to(dtype=x.dtype),sin.to(dtype=x.dtype)" if into_x else "returncos,sin"
    assert body.endswith(returns), name
    assert inspect.signature(inspect.unwrap(getattr(module, name).forward)).parameters.keys() == {
        "self", "x", "position_ids"
    }  # fmt: skip


def _buffers_and_attributes(module):
    return (
        {n: (b, b.clone()) for n, b in module.named_buffers()},
        {k: v for k, v in module.__dict__.items() if not k.startswith("_") and k != "forward"},
    )


def test_a_converted_llama_runs_its_tables_in_one_launch_and_keeps_its_state(launches, monkeypatch):
    """A converted tiny Llama (bf16, yarn: attention_scaling != 1): the rotary embedding keeps
    its buffers (the same fp32 tensors), attributes and state_dict, is not warned about, takes
    its input uncast and makes its tables in one launch, no aten op computing; its loss and
    logits against the fp32 model within tests/test_blocks.py's whole-model bound (the loss
    within one rounding of fp32, the logits within twice autocast's distance from fp32)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = transformers.LlamaForCausalLM(_config(YARN)).to(DEVICE)
    twin = copy.deepcopy(model)
    rope = model.model.rotary_emb
    buffers, attributes = _buffers_and_attributes(rope)
    keys = model.state_dict().keys()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tkern.convert_network(model, dtype)
    assert not [str(w.message) for w in caught if "rotary_emb" in str(w.message)]
    assert isinstance(rope.__dict__["forward"], RotaryTablesForward)
    assert model.state_dict().keys() == keys and rope.state_dict() == {}
    for name, (tensor, value) in buffers.items():
        now = dict(rope.named_buffers())[name]
        assert now is tensor and now.dtype == torch.float32 and torch.equal(now, value), name
    assert _buffers_and_attributes(rope)[1] == attributes
    assert not rope._forward_pre_hooks and not rope._forward_hooks  # its input is not cast
    # the module alone: one launch, no aten op but the tables' allocation
    ids = torch.randint(0, 64, (2, S), device=DEVICE)
    x = torch.randn(2, S, 64, device=DEVICE, dtype=dtype)
    position_ids = torch.arange(S, device=DEVICE)[None]
    with _AtenOps() as ops:
        cos, sin = rope(x, position_ids)
    assert [name for name, _ in launches] == ["_rotary_tables_kernel"]
    assert ops.seen == [] and cos.dtype == sin.dtype == dtype
    ref_cos, ref_sin = _reference(rope, position_ids)
    _check(cos[0], ref_cos[0], dtype, rope.attention_scaling, "cos")
    _check(sin[0], ref_sin[0], dtype, rope.attention_scaling, "sin")
    # the model: once per step
    launches.clear()
    out = model(ids, labels=ids)
    assert sum(name == "_rotary_tables_kernel" for name, _ in launches) == 1
    ref = twin(ids, labels=ids)
    with torch.autocast(DEVICE, dtype=dtype):
        auto = twin(ids, labels=ids)
    assert rel_err(out.loss, ref.loss) < TOL[dtype]
    bound = 2 * max(rel_err(auto.logits, ref.logits), TOL[dtype])
    assert rel_err(out.logits, ref.logits) < bound
    # pickles and deep-copies with its forward; converting back to fp32 removes it
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert clone.model.rotary_emb.__dict__["forward"].module is clone.model.rotary_emb
    tkern.convert_network(model, torch.float32)
    assert "forward" not in rope.__dict__


class _AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops that compute (not allocations or views) outside Triton's launches (the
    ``launches`` fixture disables modes)."""

    FREE = ("empty", "empty_strided", "view", "expand", "detach", "alias", "_to_copy", "lift_fresh")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        copies = name == "_to_copy" and isinstance(out, torch.Tensor) and out.data_ptr() != args[0].data_ptr()
        if name not in self.FREE or copies:
            self.seen.append(str(func))
        return out


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_rope_type_that_updates_inv_freq_keeps_hfs_forward_and_is_reported_once(rope_type, launches):
    assert rope_type not in STATIC_ROPE_TYPES
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8, "original_max_position_embeddings": S // 2}  # fmt: skip
    model = transformers.LlamaForCausalLM(_config(rope)).to(DEVICE)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tkern.convert_network(model, torch.float16)
    said = [str(w.message) for w in caught if "rotary_emb" in str(w.message)]
    assert len(said) == 1, said
    assert (
        f"model.rotary_emb (LlamaRotaryEmbedding): rotary embedding left eager, its rope_type '{rope_type}'"
        in said[0]
    )
    rope_emb = model.model.rotary_emb
    assert "forward" not in rope_emb.__dict__ and rope_emb.inv_freq.dtype == torch.float32
    x = torch.randn(1, 2 * S, 64, device=DEVICE, dtype=torch.float16)
    position_ids = torch.arange(2 * S, device=DEVICE)[None]  # past max_position_embeddings: updated
    cos, sin = rope_emb(x, position_ids)
    ref_cos, ref_sin = twin.model.rotary_emb(x.float(), position_ids)
    assert not launches and cos.dtype == torch.float16
    assert torch.equal(cos, ref_cos.half()) and torch.equal(sin, ref_sin.half())
