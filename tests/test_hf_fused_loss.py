"""``convert_network(model, dtype, fused_loss=True)`` on transformers' tiny causal LMs of every
family it reads as "base model, head, HF's loss" (GPT-2, Llama, Gemma 2, Mistral, Qwen2, Gemma,
Phi, Phi-3, GPT-NeoX, OPT, a user's Llama subclass): the loss by tkern.linear_cross_entropy, no
(tokens, V) tensor in the step (a TorchDispatchMode watches every aten op), against HF's own
path; the forwards it would get wrong (a logit scale, a router loss) warn and keep HF's loss.

Tolerances: the loss of the converted fp16 model against the unconverted fp32 model's:
fp16 weights and activations round at every layer (u = 2^-11 relative, a few per layer,
one layer here), so the loss (~4.2) moves by ~1e-3 at most: 5e-3, as
test_integrations.py. The gradients against the same converted model running HF's loss
(logits through tkern's Linear, rounded to fp16, then ``F.cross_entropy(logits.float())``):
the two paths round the logits' gradient once each and the logits once (HF's) or never
(tkern's fp32 logits), so each is within ~TOL[fp16] of the exact gradient and they differ
by at most twice that.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE, TOL, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
import tkern.ops.cross_entropy as ce_ops
from tkern.train import gpt_job

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[integrations]')"
)


def _gpt2():
    """The GPT job's model on a CPU (tkern train --model gpt), over 64 tokens."""
    torch.manual_seed(0)
    return gpt_job.gpt2_lm(gpt_job.default_config(torch.device("cpu")), vocab_size=64).to(DEVICE).eval()


#: One small decoder layer, as Llama-like configs spell it (extra keys are ignored by
#: the configs that do not know them).
_DECODER = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def _llama():
    config = transformers.LlamaConfig(**_DECODER, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE).eval()


def _gemma2(softcap=2.0):
    # weights drawn 15x wider than HF's default (logits up to ~10 instead of ~0.1) and a
    # small final-logit softcap (Gemma 2's is 30), so that the softcap bites
    config = transformers.Gemma2Config(
        **_DECODER, head_dim=16, final_logit_softcapping=softcap, initializer_range=0.3
    )
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).to(DEVICE).eval()


#: The families' vocabulary: no other dimension of their tensors is 100 (_LogitsWatch).
_VOCAB = 100


def _family(config_class: str, model_class: str, **extra):
    def make():
        config = getattr(transformers, config_class)(**{**_DECODER, "vocab_size": _VOCAB, **extra})
        torch.manual_seed(0)
        return getattr(transformers, model_class)(config).to(DEVICE).eval()

    make.__name__ = model_class
    return make


def _my_llama():
    # defined here, not at import: transformers imports a model's module lazily, and
    # modeling_llama's imports ask the device for its properties (a GPU machine's collection
    # of this file, tests/test_gpu_collection.py, must not)
    class _MyLlama(transformers.LlamaForCausalLM):
        """A user's subclass (its own name, the same forward): matched by structure."""

    torch.manual_seed(0)
    return _MyLlama(transformers.LlamaConfig(**{**_DECODER, "vocab_size": _VOCAB})).to(DEVICE).eval()


_NEOX = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
#: One tiny model per family that fuses (their forwards are "base model, head, HF's loss").
FAMILIES = {
    "mistral": _family("MistralConfig", "MistralForCausalLM"),
    "qwen2": _family("Qwen2Config", "Qwen2ForCausalLM"),
    "gemma": _family("GemmaConfig", "GemmaForCausalLM", head_dim=16),
    "phi": _family("PhiConfig", "PhiForCausalLM"),
    "phi3": _family("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "gpt_neox": _family("GPTNeoXConfig", "GPTNeoXForCausalLM", **_NEOX),
    "opt": _family("OPTConfig", "OPTForCausalLM", ffn_dim=64, word_embed_proj_dim=32, **_NEOX),
    "llama_subclass": _my_llama,
}


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()


@pytest.mark.filterwarnings("ignore:convert_network")  # Llama's RMSNorm and rotary embedding stay fp32
@pytest.mark.parametrize("make", [_gpt2, _llama, _gemma2], ids=["gpt2", "llama", "gemma2"])
def test_fused_loss_matches_hf(make, monkeypatch):
    monkeypatch.setattr(ce_ops, "default_chunk_rows", lambda n, h, v: 8)  # 3 chunks (_LogitsWatch)
    ref = make()
    ids = torch.randint(0, 64, (2, 12), device=DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100  # some ignored positions (a prompt), as HF's data collators make
    with torch.no_grad():
        expected = ref(ids, labels=labels)
    fused = tkern.convert_network(copy.deepcopy(ref), torch.float16, fused_loss=True)
    plain = tkern.convert_network(copy.deepcopy(ref), torch.float16)
    if make is _gpt2:
        assert fused.lm_head.weight is fused.transformer.wte.weight  # tied embeddings kept
    with _LogitsWatch(64, 32) as watch:
        out = fused(ids, labels=labels)
        out.loss.backward()
    assert out.logits is None and out.loss.dtype == torch.float32 and 0 < watch.rows <= 8
    assert abs(out.loss.item() - expected.loss.item()) < 5e-3
    hf = plain(ids, labels=labels)
    hf.loss.backward()
    assert abs(out.loss.item() - hf.loss.item()) < 5e-3
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters(), strict=True):
        assert rel_err(a.grad, b.grad) <= 2 * TOL[torch.float16], name
    # without labels, and in generate(), the logits come back as before
    with torch.no_grad():
        logits = fused(ids).logits
        assert rel_err(logits, plain(ids).logits) == 0
    prompt = ids[:1, :4]
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(fused.generate(prompt, **kw), plain.generate(prompt, **kw))


@pytest.mark.filterwarnings("ignore:convert_network")
def test_gemma2_final_logit_softcapping_is_honoured():
    # the softcap moves HF's fp32 loss far more than the 5e-3 tolerance: without it the
    # fused loss would miss, with it it matches HF's own softcapped logits' loss
    ref, uncapped = _gemma2(), _gemma2(softcap=None)
    ids = torch.randint(0, 64, (2, 12), device=DEVICE)
    with torch.no_grad():
        expected, plain = ref(ids, labels=ids), uncapped(ids, labels=ids)
        logits = ref(ids).logits
    assert abs(expected.loss.item() - plain.loss.item()) > 0.1
    assert logits.abs().max() < 2.0 and (logits - uncapped(ids).logits).abs().max() > 0.1
    fused = tkern.convert_network(copy.deepcopy(ref), torch.float16, fused_loss=True)
    with torch.no_grad():
        assert abs(fused(ids, labels=ids).loss.item() - expected.loss.item()) < 5e-3


def test_num_items_in_batch_and_tuple_output():
    model = tkern.convert_network(_gpt2(), torch.float16, fused_loss=True)
    ids = torch.randint(0, 64, (2, 10), device=DEVICE)
    with torch.no_grad():
        mean = model(ids, labels=ids).loss
        summed = model(ids, labels=ids, num_items_in_batch=torch.tensor(9, device=DEVICE)).loss
        as_tuple = model(ids, labels=ids, return_dict=False)
    # 2 x 9 predicted positions: sum / 9 is twice the mean
    assert torch.allclose(summed, 2 * mean, rtol=1e-6)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], mean)


def test_reconvert_without_fused_loss_and_back():
    model = tkern.convert_network(_gpt2(), torch.float16, fused_loss=True)
    ids = torch.randint(0, 64, (1, 6), device=DEVICE)
    tkern.convert_network(model, torch.float16)  # converting again replaces the settings
    with torch.no_grad():
        assert model(ids, labels=ids).logits is not None
    tkern.convert_network(model, torch.float16, fused_loss=True)
    other = copy.deepcopy(model)
    with torch.no_grad():
        assert other(ids, labels=ids).logits is None
    tkern.convert_network(model, torch.float32)
    assert "forward" not in model.__dict__ and type(model.lm_head) is torch.nn.Linear


# --------------------------------------------------------------------------- the head under float8


def _head_loss_reference(model, ids):
    """HF's causal loss on the base model's hidden states through the head's 16-bit weight,
    the GEMM and the loss in fp32 (products of bf16 values are exact in fp32)."""
    hidden = model.model(ids).last_hidden_state.float()
    logits = hidden @ model.lm_head.weight.float().t()
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])


@pytest.mark.filterwarnings("ignore:convert_network")  # Llama's RMSNorm and rotary embedding stay fp32
def test_float8_with_fused_loss_keeps_the_head_16bit():
    """convert_network(float8=..., fused_loss=True): every Linear with features that are
    multiples of 16 becomes fp8 but the LM head, whose GEMM the fused loss computes (it has
    no fp8 one), which stays a 16-bit tkern.nn.Linear; nothing warns about the head. A
    float8_filter still applies to the rest."""
    model = tkern.convert_network(_llama(), torch.bfloat16, float8="tensorwise", fused_loss=True)
    assert type(model.lm_head) is tkern.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    fp8 = [n for n, m in model.named_modules() if isinstance(m, tkern.Float8Linear)]
    linears = [n for n, m in _llama().named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]
    assert fp8 == linears
    ids = torch.randint(0, 64, (1, 8), device=DEVICE)
    with torch.no_grad():  # within the fp32 reference's rounding: no fp8 in the head
        loss = model(ids, labels=ids).loss
        assert abs(loss.item() - _head_loss_reference(model, ids).item()) < 1e-4
    only_mlp = tkern.convert_network(
        _llama(), torch.bfloat16, float8="tensorwise", fused_loss=True, float8_filter=lambda n, m: "mlp" in n
    )
    assert {n for n, m in only_mlp.named_modules() if isinstance(m, tkern.Float8Linear)} == {
        n for n in linears if "mlp" in n
    }


@pytest.mark.filterwarnings("ignore:convert_network")  # Llama's RMSNorm and rotary embedding stay fp32
def test_a_float8_head_under_the_fused_loss_warns_that_it_trains_in_16_bits():
    """A head converted to fp8 before the fused loss was installed stays fp8 (the user's
    choice), and the fused loss computes it in 16 bits anyway: one warning names the module
    and says so; the loss is the 16-bit head's (the fp8 head's is 1.2e-3 off here)."""
    model = tkern.convert_network(_llama(), torch.bfloat16, float8="tensorwise")
    assert isinstance(model.lm_head, tkern.Float8Linear)
    with pytest.warns(UserWarning, match=r"LM head lm_head \(Float8Linear\) trains in 16 bits") as caught:
        tkern.convert_network(model, torch.bfloat16, float8="tensorwise", fused_loss=True)
    assert sum("LM head" in str(w.message) for w in caught) == 1
    assert isinstance(model.lm_head, tkern.Float8Linear)
    ids = torch.randint(0, 64, (1, 8), device=DEVICE)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
        assert abs(loss.item() - _head_loss_reference(model, ids).item()) < 1e-4


# --------------------------------------------------------------------------- every family, by structure


class _LogitsWatch(TorchDispatchMode):
    """Records the most rows of any tensor an aten op returns whose last dimension is the
    vocabulary (logits or their gradient: (B, T, V), (tokens, V), a chunk's (rows, V)),
    the head's weight transposed (H, V) aside (a view; dispatch does not flag it as one)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            vocab_last = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
            if vocab_last and tuple(t.shape) != (self.hidden, self.vocab):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.filterwarnings("ignore:convert_network")  # norms, rotary embeddings kept fp32
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_fuses_without_logits(name, monkeypatch):
    # 2 x 12 tokens in chunks of 8 rows (the default rule would take all 24 rows in one
    # chunk: at least MIN_CHUNK_ROWS = 64 rows a chunk), so the largest (rows, V) tensor
    # of the fused step is a chunk's, never all the tokens'; the unfused model's step makes
    # (tokens, V) logits (the watch's positive control).
    monkeypatch.setattr(ce_ops, "default_chunk_rows", lambda n, h, v: 8)
    ref = FAMILIES[name]()
    vocab, tokens = ref.config.vocab_size, 24
    ids = torch.randint(0, vocab, (2, 12), device=DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    fused = tkern.convert_network(copy.deepcopy(ref), torch.float16, fused_loss=True)
    plain = tkern.convert_network(copy.deepcopy(ref), torch.float16)
    expected = ref(ids, labels=labels).loss
    expected.backward()
    with _LogitsWatch(vocab, 32) as watch:
        out = fused(ids, labels=labels)
        out.loss.backward()
    assert out.logits is None and 0 < watch.rows <= 8
    with _LogitsWatch(vocab, 32) as control:
        hf = plain(ids, labels=labels)
        hf.loss.backward()
    assert control.rows >= tokens
    assert abs(out.loss.item() - expected.item()) < 5e-3
    assert abs(out.loss.item() - hf.loss.item()) < 5e-3
    params = zip(ref.named_parameters(), fused.parameters(), plain.parameters(), strict=True)
    for (pname, r), f, p in params:
        # as close to the fp32 model's gradient as HF's own fp16 path (the two round the
        # logits' gradient differently: one fp16 tolerance between them, and a quarter for
        # parameters whose gradient is mostly rounding error, as a key bias's exact zero)
        assert rel_err(f.grad, r.grad) <= 1.25 * rel_err(p.grad, r.grad) + TOL[torch.float16], pname


def _cohere():
    return _family("CohereConfig", "CohereForCausalLM", logit_scale=0.5)()


def _granite():
    return _family("GraniteConfig", "GraniteForCausalLM", logits_scaling=4.0)()


def _mixtral():
    return _family("MixtralConfig", "MixtralForCausalLM", num_local_experts=2, output_router_logits=True)()


@pytest.mark.filterwarnings("ignore:convert_network")
@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_cohere, r"CohereForCausalLM keeps its own loss .*changes the logits.*logit_scale"),
        (_granite, r"GraniteForCausalLM keeps its own loss .*changes the logits.*logits_scaling"),
        (_mixtral, r"MixtralForCausalLM keeps its own loss .*changes the loss after self.loss_function"),
    ],
    ids=["cohere", "granite", "mixtral"],
)
def test_a_forward_the_fused_loss_would_get_wrong_warns_and_keeps_hfs_loss(make, why):
    # a logit scale between the head and the loss, or a router loss added after it: the
    # fused loss would differ from the model's own, so it is refused, with a warning
    ref = make()
    ids = torch.randint(0, 64, (1, 8), device=DEVICE)
    with pytest.warns(UserWarning, match=why):
        model = tkern.convert_network(copy.deepcopy(ref), torch.float16, fused_loss=True)
    assert "forward" not in model.__dict__
    with torch.no_grad():
        out = model(ids, labels=ids)
        assert out.logits is not None and abs(out.loss.item() - ref(ids, labels=ids).loss.item()) < 5e-3


@pytest.mark.filterwarnings("ignore:convert_network")
def test_no_causal_lm_warns():
    bert = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    with pytest.warns(UserWarning, match=r"BertForMaskedLM keeps its own loss .*output embeddings"):
        tkern.convert_network(transformers.BertForMaskedLM(bert), torch.float16, fused_loss=True)
    with pytest.warns(UserWarning, match=r"BertModel holds no transformers causal LM"):
        tkern.convert_network(transformers.BertModel(bert), torch.float16, fused_loss=True)
    with pytest.warns(UserWarning, match=r"Sequential holds no transformers causal LM"):
        tkern.convert_network(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.float16, fused_loss=True)
