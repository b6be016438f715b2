"""``torch.compile(converted_model, fullgraph=True)`` on transformers' tiny GPT-2 and Llama
converted with ``fused_loss=True``: forward with labels and backward trace with no graph
break (``tkern::linear_cross_entropy`` is a custom op), a fused optimizer's step on the
compiled model's gradients equals the eager model's.

Tolerances: tkern's ops run the same kernels either way, but the torch ops between them do
not: aot_eager runs their aten decompositions (Llama's SDPA and SiLU in fp16 round apart from
eager's fused CPU kernels: 1-ulp differences, seen here), inductor fuses the elementwise ones
(the rotary embedding's fp32 math, GPT-2's GELU chain) and rounds once where eager rounds per
op. So: the loss within 5e-3 (test_hf_fused_loss.py's bound for one layer of fp16 rounding),
the gradients within twice the fp16 GEMM tolerance (as test_functional.py's inductor test),
the params after one SGD step with lr 1 (each moves by its gradient, ~1e-4 of it) within
one fp16 tolerance. (Not Adam: its first step moves each param by +-lr whatever the size of
its gradient, so a near-zero gradient whose sign rounds differently moves it 2 lr apart.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE, TOL, rel_err

import tkern
from tkern.flat import grad_is_flat_view
from tkern.train import gpt_job

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[integrations]')"
)


def _gpt2():
    """The GPT job's model on a CPU (tkern train --model gpt), over 64 tokens."""
    torch.manual_seed(0)
    return gpt_job.gpt2_lm(gpt_job.default_config(torch.device("cpu")), vocab_size=64).to(DEVICE)


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE)


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    yield
    torch._dynamo.reset()


def _train_step(model, opt, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits is None
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    flat = grad_is_flat_view(model.lm_head.weight)
    opt.step()
    opt.zero_grad()
    return out.loss.detach(), grads, flat


def _eager_and_compiled(make, backend):
    base = tkern.convert_network(make(), torch.float16, fused_loss=True)
    ids = torch.randint(0, 64, (2, 12), device=DEVICE)
    results = []
    for compile_it in (False, True):
        model = copy.deepcopy(base)
        opt = tkern.optim.FusedSGD(model.parameters(), lr=1.0)
        run = torch.compile(model, fullgraph=True, backend=backend) if compile_it else model
        results.append((*_train_step(run, opt, ids), model))
    return results


@pytest.mark.filterwarnings("ignore:convert_network")  # Llama's RMSNorm and rotary embedding stay fp32
@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(
    "backend",
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],  # inductor: ~1 minute a model here
)
def test_fullgraph_compile_matches_eager(make, backend):
    (loss0, grads0, flat0, eager), (loss1, grads1, flat1, compiled) = _eager_and_compiled(make, backend)
    assert abs(loss0.item() - loss1.item()) < 5e-3
    for a, b in zip(grads0, grads1, strict=True):
        assert rel_err(b, a) <= 2 * TOL[torch.float16]
    # the head's gradient lands in the fused optimizer's flat buffer either way: eager by
    # the wgrad written into the view, compiled by autograd adding the op's gradient into it
    assert flat0 and flat1
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert rel_err(b, a) <= TOL[torch.float16]
