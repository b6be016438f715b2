"""convert_network's decoder-layer rules (tkern/nn/residual.py, ``DECODER_RULES``): each ruled
class's forward is Llama's; the whole-model test (a tiny Llama whose first residual add per layer
runs inside tkern's add_rms_norm, forward and backward, against the unconverted model, with a
dispatch-level count of the torch adds left over (tokens, hidden)) is
tests/test_rotary.py::test_converted_llama_matches_fp32_and_autocast_and_its_twin_runs_hf, which
converts the same model (one tiny model run for both); its helpers live here."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import textwrap

import pytest
import torch
from conftest import DEVICE, TOL, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
from tkern.kernels.rotary import _rotary_kernel
from tkern.nn.residual import DECODER_RULES, FusedDecoderForward

transformers = pytest.importorskip("transformers")

#: torch adds over (batch, seq, hidden) in a converted 2-layer Llama's (forward, backward). Per
#: layer, forward: ``y = h + mlp_out`` (HF also runs ``h = x + attn_out``: in add_rms_norm here);
#: backward: the sum of x's two gradients (norm1's and the residual's), of norm1's output's
#: three (q, k, v: two adds) and of norm2's output's two (gate, up) (HF also sums h's two:
#: inside the norm's backward kernel here).
EXPECTED_ADDS = (2, 2 * 4)


def _forward_body(cls) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    return [ast.dump(s) for s in tree.body[0].body]


@pytest.mark.parametrize("name", sorted(n for n in DECODER_RULES if n.endswith("DecoderLayer")))
def test_each_ruled_layer_has_llamas_forward(name):
    family = name.removesuffix("DecoderLayer").lower()
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    assert _forward_body(cls) == _forward_body(transformers.models.llama.modeling_llama.LlamaDecoderLayer)


class _Adds(TorchDispatchMode):
    """Counts torch adds whose output has ``shape``, outside tkern's launches, as (forward,
    backward): ``counts``."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.busy, self.forward, self.backward = torch.Size(shape), 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.busy and "add" in str(func) and isinstance(out, torch.Tensor) and out.shape == self.shape:
            if torch._C._current_graph_task_id() == -1:
                self.forward += 1
            else:
                self.backward += 1
        return out

    @property
    def counts(self) -> tuple[int, int]:
        return self.forward, self.backward


@contextlib.contextmanager
def counting_adds(monkeypatch, shape):
    """A dispatch mode counting the torch adds with output ``shape`` (:class:`_Adds`)."""
    mode = _Adds(shape)
    if tkern.INTERPRET:  # the interpreter's own tensor ops inside a launch are not the model's
        launches = type(_rotary_kernel)
        real = launches.run

        def run(*args, **kwargs):
            mode.busy += 1
            try:
                return real(*args, **kwargs)
            finally:
                mode.busy -= 1

        monkeypatch.setattr(launches, "run", run)
    with mode:
        yield mode


def loss_and_grads(model, ids, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    context = torch.autocast(DEVICE, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with context:
        loss = model(ids, labels=ids).loss
    loss.float().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_converted_gpt2_block_adds_its_first_residual_in_ln_2(monkeypatch):
    """GPT-2's block called as GPT2Model calls it (positional cache, mask and encoder states):
    against the fp32 block and autocast, with tests/test_blocks.py's whole-model bound; one
    torch add over (batch, seq, hidden) forward (HF: two) and one backward (the sum of x's two
    gradients; HF also sums h's two; ln_1's and ln_2's outputs each have one reader)."""
    torch.manual_seed(1)
    dtype = torch.float16
    config = transformers.GPT2Config(n_embd=64, n_head=4, n_inner=128, resid_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0).to(DEVICE)
    x = torch.randn(2, 16, 64, device=DEVICE)

    def run(module, x, autocast_dtype=None):
        module.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        context = torch.autocast(DEVICE, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with context:
            out = module(x, None, None, None, use_cache=False)
        (out.float() ** 2).sum().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}

    ref = run(block, x)
    auto = run(block, x, dtype)
    tkern.convert_network(block, dtype)
    assert isinstance(block.__dict__["forward"], FusedDecoderForward)
    with counting_adds(monkeypatch, (2, 16, 64)) as adds:
        out = run(block, x.to(dtype))
    assert adds.counts == (1, 1)
    for got, want, autocast in ((out[0], ref[0], auto[0]), (out[1], ref[1], auto[1])):
        assert rel_err(got, want) < 2 * max(rel_err(autocast, want), TOL[dtype])
    for name, g in out[2].items():
        assert rel_err(g, ref[2][name]) < 2 * max(rel_err(auto[2][name], ref[2][name]), TOL[dtype]), name
