"""convert_network's decoder-layer rules (tkern/nn/residual.py, ``DECODER_RULES``): each ruled
class's forward is Llama's; norm1's form ``(norm(x), x)`` (tkern.rms_norm_and_residual /
layer_norm_and_residual) against float64; the whole-model test (a tiny Llama whose first residual
add per layer runs inside tkern's add_rms_norm and whose input's two gradients are summed in
norm1's backward kernel, against the unconverted model, with a dispatch-level count of the torch
adds left over (tokens, hidden)) is
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
import torch.nn.functional as F
from conftest import DEVICE, TOL, eager_and_compiled, outside_launches, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import tkern
from tkern.kernels.norm import MAX_BLOCK
from tkern.nn.residual import DECODER_RULES, FusedDecoderForward
from tkern.ops.norm import layer_norm, layer_norm_and_residual, rms_norm, rms_norm_and_residual

transformers = pytest.importorskip("transformers")

#: torch adds over (batch, seq, hidden) in a converted 2-layer Llama's (forward, backward). Per
#: layer, forward: none (HF runs ``h = x + attn_out``: in add_rms_norm here, and ``y = h +
#: mlp_out``: in down_proj's epilogue); backward: none (HF sums norm1's output's three gradients,
#: q's, k's and v's: the k and v dgrad GEMMs add into q's dX here,
#: tkern.ops.projections.shared_input_linears; norm2's output's two, gate's and up's: the second
#: GEMM adds into the first's dX, tkern.ops.mlp.linear_glu_linear; and h's two and x's two,
#: norm1's and the residual's: inside add_rms_norm's and rms_norm_and_residual's backward
#: kernels here).
EXPECTED_ADDS = (0, 0)


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


def counting_adds(monkeypatch, shape):
    """A dispatch mode counting the torch adds with output ``shape`` (:class:`_Adds`)."""
    return outside_launches(monkeypatch, _Adds(shape))


def loss_and_grads(model, ids, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    context = torch.autocast(DEVICE, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with context:
        loss = model(ids, labels=ids).loss
    loss.float().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_converted_gpt2_block_adds_its_first_residual_in_ln_2(monkeypatch):
    """GPT-2's block called as GPT2Model calls it (positional cache, mask and encoder states):
    against the fp32 block and autocast, with tests/test_blocks.py's whole-model bound; no
    torch add over (batch, seq, hidden) forward (HF: two; here in ln_2's kernel and c_proj's
    epilogue) and none backward (HF sums h's two gradients and x's two: in ln_2's and ln_1's
    backward kernels here; ln_1's and ln_2's outputs each have one reader). With a hook on ln_1
    it is called as a module and autograd sums x's two gradients again (one add backward), the
    hook seeing the same output."""
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
    assert adds.counts == (0, 0)
    for got, want, autocast in ((out[0], ref[0], auto[0]), (out[1], ref[1], auto[1])):
        assert rel_err(got, want) < 2 * max(rel_err(autocast, want), TOL[dtype])
    for name, g in out[2].items():
        assert rel_err(g, ref[2][name]) < 2 * max(rel_err(auto[2][name], ref[2][name]), TOL[dtype]), name
    seen = []
    block.ln_1.register_forward_hook(lambda module, args, output: seen.append(output))
    with counting_adds(monkeypatch, (2, 16, 64)) as adds:
        hooked = run(block, x.to(dtype))
    assert adds.counts == (0, 1) and len(seen) == 1
    assert torch.equal(hooked[0], out[0])  # the same kernels forward
    # x's gradient: norm1's part rounded to fp16, then the fp16 sum (fused: one rounding)
    assert rel_err(hooked[1], out[1]) < TOL[dtype]


# ------------------------------------------------- norm1's form: (norm(x), x) from one node


def _norm_and_residual(kind, x, n, w, b, eps=1e-5):
    if kind == "ln":
        return layer_norm_and_residual(x, n, w, b, eps)
    return rms_norm_and_residual(x, n, w, eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("n", [1023, MAX_BLOCK + 9])  # ragged in one block; chunked rows
def test_norm_and_residual_sums_xs_two_gradients_in_the_kernel(monkeypatch, kind, dtype, n):
    """Both outputs used, ``(normed * g1).sum() + (residual * g2).sum()``, against float64
    torch: normed is bit for bit the plain norm's (the same kernel) and within TOL of float64
    (one fp32 value rounded once); residual is x's storage, not a copy; x's gradient (norm's
    vjp of g1 plus g2, both of unit size, summed in fp32 in the backward kernel and rounded
    once) within TOL, as tests/test_norm.py's add forms; the weight's and bias's (fp32 sums
    over a few rows) within fp32's TOL; and no torch add over x's shape in backward."""
    gen = torch.Generator().manual_seed(2)
    shape = (3, n) if n > MAX_BLOCK else (2, 3, n)
    x, g1, g2 = (torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(3))
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE).requires_grad_()
    b = (0.5 * torch.randn(n, generator=gen)).to(DEVICE).requires_grad_() if kind == "ln" else None
    x.requires_grad_()
    with counting_adds(monkeypatch, shape) as adds:
        normed, residual = _norm_and_residual(kind, x, n, w, b)
        ((normed * g1).float().sum() + (residual * g2).float().sum()).backward()
    assert adds.counts == (0, 0)
    assert residual.shape == x.shape and residual.dtype == dtype and torch.equal(residual, x)
    assert residual._base is x and residual.data_ptr() == x.data_ptr()  # a view, no copy
    plain = layer_norm(x, n, w, b) if kind == "ln" else rms_norm(x, n, w, 1e-5)
    assert torch.equal(normed, plain)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    bd = None if b is None else b.detach().double().requires_grad_()
    yd = F.layer_norm(xd, (n,), wd, bd, 1e-5) if kind == "ln" else F.rms_norm(xd, (n,), wd, 1e-5)
    ((yd * g1.double()).sum() + (xd * g2.double()).sum()).backward()
    assert rel_err(normed, yd) < TOL[dtype]
    assert x.grad.dtype == dtype and rel_err(x.grad, xd.grad) < TOL[dtype]
    assert rel_err(w.grad, wd.grad) < TOL[torch.float32]
    if b is not None:
        assert rel_err(b.grad, bd.grad) < TOL[torch.float32]


def test_norm_and_residual_with_one_output_used():
    """residual alone: x's gradient is residual's, exactly, and the weight's zero; normed
    alone: exactly the plain norm's gradients (the same backward launch, without dh)."""
    x = torch.randn(4, 48, device=DEVICE).bfloat16().requires_grad_()
    w = torch.randn(48, device=DEVICE, requires_grad=True)
    b = torch.randn(48, device=DEVICE, requires_grad=True)
    g = torch.randn(4, 48, device=DEVICE).bfloat16()
    rms_norm_and_residual(x, 48, w)[1].backward(g)
    assert torch.equal(x.grad, g) and torch.equal(w.grad, torch.zeros_like(w))
    grads = []
    for f in (lambda: layer_norm_and_residual(x, 48, w, b)[0], lambda: layer_norm(x, 48, w, b)):
        x.grad = w.grad = b.grad = None
        f().backward(g)
        grads.append((x.grad, w.grad, b.grad))
    assert all(torch.equal(a, c) for a, c in zip(*grads, strict=True))


def test_norm_and_residual_on_meta_tensors_and_under_compile():
    """Meta tensors and tracing take the custom op, returning ``(norm(x), x)`` (autograd then
    sums x's gradients): shapes on meta; under torch.compile one graph, the loss bit for bit
    eager's (the same kernels), the gradients within one fp16 rounding of eager's (eager
    rounds the fp32 sum once, the traced graph rounds the norm's part, then the fp16 sum)."""
    xm = torch.empty(2, 3, 16, dtype=torch.bfloat16, device="meta")
    y, r = rms_norm_and_residual(xm, 16, torch.empty(16, device="meta"))
    assert y.shape == xm.shape and y.is_meta and r is xm
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    b = torch.randn(32, device=DEVICE, requires_grad=True)

    def f(x):
        normed, residual = layer_norm_and_residual(x, (32,), w, b)
        return normed.float().square().sum() + (3 * residual.float()).sum()

    x = torch.randn(4, 32, device=DEVICE).half().requires_grad_()
    out0, grads0, out1, grads1 = eager_and_compiled(f, x, (w, b))
    assert torch.equal(out0, out1)
    assert rel_err(grads1[0], grads0[0]) < TOL[torch.float16]
    assert torch.equal(grads0[1], grads1[1]) and torch.equal(grads0[2], grads1[2])


NORM1_ERRORS = [
    (lambda x, w: rms_norm_and_residual(x.tolist(), 16), TypeError, "input must be a torch.Tensor"),
    (lambda x, w: rms_norm_and_residual(x.int(), 16), TypeError, "input must be a float16, bfloat16"),
    (lambda x, w: rms_norm_and_residual(x, 8, w), ValueError, r"normalized_shape \(8,\) must match"),
    (lambda x, w: rms_norm_and_residual(x, 16, w[:8]), ValueError, r"weight must have shape \(16,\)"),
    (lambda x, w: layer_norm_and_residual(x, 16, w.double()), TypeError, "weight must be float32 or input"),
    (lambda x, w: layer_norm_and_residual(x, 16, w, w[:4]), ValueError, r"bias must have shape \(16,\)"),
    (lambda x, w: layer_norm_and_residual(x, 16, w, w.bfloat16()), TypeError, "bias must be float32 or"),
]


@pytest.mark.parametrize("call,error,match", NORM1_ERRORS)
def test_norm_and_residual_bad_arguments_raise_before_launching(monkeypatch, call, error, match):
    launches = []
    monkeypatch.setattr(tkern.ops.norm, "norm_forward", lambda *a, **k: launches.append(a))
    monkeypatch.setattr(tkern.ops.norm, "_norm_forward_op", lambda *a, **k: launches.append(a))
    x = torch.randn(2, 16, device=DEVICE).half()
    with pytest.raises(error, match=match):
        call(x, torch.ones(16, device=DEVICE))
    assert not launches
