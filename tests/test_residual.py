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
from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
from tkern.kernels.rotary import _rotary_kernel
from tkern.nn.residual import DECODER_RULES

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


@pytest.mark.parametrize("name", sorted(DECODER_RULES))
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
