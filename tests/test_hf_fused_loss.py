"""``convert_network(model, dtype, fused_loss=True)`` on transformers' tiny GPT-2 and Llama:
the loss by tkern.linear_cross_entropy (no logits), against HF's own path.

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

import tkern

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[integrations]')"
)


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(DEVICE).eval()


#: One small decoder layer, as Llama-like configs spell it.
_DECODER = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
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


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()


@pytest.mark.filterwarnings("ignore:convert_network")  # Llama's RMSNorm and rotary embedding stay fp32
@pytest.mark.parametrize("make", [_gpt2, _llama, _gemma2], ids=["gpt2", "llama", "gemma2"])
def test_fused_loss_matches_hf(make):
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
    out = fused(ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    assert abs(out.loss.item() - expected.loss.item()) < 5e-3
    out.loss.backward()
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
