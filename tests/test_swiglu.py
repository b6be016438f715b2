"""tkern.swiglu / swiglu_packed: ``act(gate) * up`` and its gradients in one kernel each
way (fp32 inside, one rounding), against torch in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, rel_err

import tkern
from tkern.ops.swiglu import swiglu_packed

#: the kernels' activation names -> torch's formula
TORCH_ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


def _inputs(dtype, shape=(3, 5, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)  # well into both tails
    up = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    dh = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return gate, up, dh


def _reference(gate, up, dh, activation):
    """h, dgate, dup in float64 from the same 16-bit values."""
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    h = TORCH_ACTS[activation](g) * u
    h.backward(dh.double())
    return h.detach(), g.grad, u.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", list(TORCH_ACTS))
def test_matches_float64(activation, dtype):
    gate, up, dh = _inputs(dtype)
    gate.requires_grad_(), up.requires_grad_()
    h = tkern.swiglu(gate, up, activation)
    h.backward(dh)
    assert h.dtype == gate.grad.dtype == up.grad.dtype == dtype and h.shape == gate.shape
    # each output is computed in fp32 from the 16-bit inputs and rounded once (u; TOL is 2u)
    for got, want in zip((h, gate.grad, up.grad), _reference(gate, up, dh, activation), strict=True):
        assert rel_err(got, want) < TOL[dtype]


def test_one_rounding_beats_torch_in_fp16():
    # HF's eager fp16 MLP rounds silu(gate) and then the product: two roundings
    gate, up, dh = _inputs(torch.float16, shape=(64, 256))
    h64 = _reference(gate, up, dh, "silu")[0]
    eager = F.silu(gate) * up
    assert rel_err(tkern.swiglu(gate, up), h64) < rel_err(eager, h64)


def test_packed_halves_match_two_tensors_and_give_one_gradient():
    gate, up, dh = _inputs(torch.float16)
    gate_up = torch.cat([gate, up], dim=-1).requires_grad_()
    h = swiglu_packed(gate_up)
    h.backward(dh)
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h2 = tkern.swiglu(g2, u2)
    h2.backward(dh)
    assert torch.equal(h, h2)  # the same kernel on the same values, read in place from the halves
    assert gate_up.grad.shape == gate_up.shape
    assert torch.equal(gate_up.grad, torch.cat([g2.grad, u2.grad], dim=-1))


def test_strided_and_expanded_gradients():
    gate, up, _ = _inputs(torch.float16, shape=(6, 16))
    gate.requires_grad_()
    h = tkern.swiglu(gate.t().contiguous().t(), up)  # gate with column stride 6: made dense
    h.float().sum().backward()  # dh expanded from a scalar: stride 0
    dgate = _reference(gate, up, torch.ones_like(up), "silu")[1]
    assert rel_err(gate.grad, dgate) < TOL[torch.float16]


def test_bad_arguments_raise_before_launching():
    gate, up, _ = _inputs(torch.float16, shape=(4, 8))
    with pytest.raises(ValueError, match="one shape"):
        tkern.swiglu(gate, up[:, :4])
    with pytest.raises(TypeError, match="up must have dtype"):
        tkern.swiglu(gate, up.to(torch.bfloat16))
    with pytest.raises(TypeError, match="gate must have dtype"):
        tkern.swiglu(gate.float(), up.float())
    with pytest.raises(ValueError, match="activation must be one of"):
        tkern.swiglu(gate, up, "tanh")
    with pytest.raises(ValueError, match="needs an activation"):
        tkern.swiglu(gate, up, None)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu_packed(gate[:, :7])


def test_second_order_gradients_through_the_differentiable_backward():
    gate, up, _ = _inputs(torch.float16, shape=(4, 8))
    gate.requires_grad_()
    (dgate,) = torch.autograd.grad(tkern.swiglu(gate, up).float().sum(), gate, create_graph=True)
    (d2,) = torch.autograd.grad(dgate.float().square().sum(), gate)  # a gradient penalty
    g = gate.detach().double().requires_grad_()
    (dg64,) = torch.autograd.grad((F.silu(g) * up.double()).sum(), g, create_graph=True)
    (d2_64,) = torch.autograd.grad(dg64.square().sum(), g)
    assert rel_err(dgate, dg64) < TOL[torch.float16]
    # dgate rounded to fp16 once inside (u), squared and differentiated in fp32: within 2 TOL
    assert rel_err(d2, d2_64) < 2 * TOL[torch.float16]


def test_custom_ops_pass_opcheck_and_compile_matches_eager():
    gate, up, dh = _inputs(torch.float16, shape=(4, 16))
    torch.library.opcheck(torch.ops.tkern.swiglu.default, (gate.requires_grad_(), up, "silu"))
    torch.library.opcheck(torch.ops.tkern.swiglu_backward.default, (dh, gate.detach(), up, "silu"))
    eager = tkern.swiglu(gate, up)
    torch._dynamo.reset()
    compiled = torch.compile(tkern.swiglu, fullgraph=True, backend="aot_eager")(gate, up)
    assert torch.equal(compiled, eager)
    meta = tkern.swiglu(gate.detach().to("meta"), up.to("meta"), "gelu_tanh")
    assert meta.shape == gate.shape and meta.dtype == gate.dtype


def test_compile_accepts_column_strided_inputs_as_eager_does():
    gate, up, dh = _inputs(torch.float16, shape=(8, 16))
    gate = gate.t().contiguous().t().requires_grad_()  # column stride 8: eager makes it dense
    up = up.t().contiguous().t().requires_grad_()
    eager = tkern.swiglu(gate, up)
    eager.backward(dh)
    expected = (gate.grad, up.grad)
    gate.grad = up.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(tkern.swiglu, fullgraph=True, backend="aot_eager")(gate, up)
    compiled.backward(dh)
    assert torch.equal(compiled, eager)
    assert torch.equal(gate.grad, expected[0]) and torch.equal(up.grad, expected[1])
