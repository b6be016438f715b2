"""The residual stream's add in the block's last GEMM (issue 54 item 4): ``y = h + mlp(x)``
with the add in down's (c_proj's) epilogue (the kernels' ``ADD_RESIDUAL``: fp32, one
rounding), its gradient the output's passed on as it is, and tkern.nn.fusion.mlp_with_residual
choosing it for a converted MLP block: against float64, the unfused add, and with no torch
add over (tokens, hidden) forward or backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, AddsOver, rel_err

from tkern.nn import convert_network, fusion
from tkern.ops.mlp import linear_act_linear, linear_glu_linear

HALF = [torch.float16, torch.bfloat16]


def _params(dtype, *shapes, scale=0.15):
    torch.manual_seed(0)
    return [(torch.randn(*s, device=DEVICE) * scale).to(dtype).requires_grad_() for s in shapes]


def _float64(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _check(out, grads, ref, ref_grads, dtype):
    """Output and gradients within a few roundings of float64 (fp32 accumulation; the output
    and each gradient rounded once or twice to ``dtype``)."""
    assert rel_err(out, ref) < TOL[dtype]
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", HALF)
def test_gelu_mlp_adds_the_residual_in_its_second_gemm(dtype):
    x, w1, b1, w2, b2, r = _params(dtype, (2, 7, 32), (64, 32), (64,), (32, 64), (32,), (2, 7, 32))
    y = linear_act_linear(x, w1, b1, "gelu_tanh", w2, b2, r)
    dy = torch.randn_like(y)
    y.backward(dy)
    p = _float64((x, w1, b1, w2, b2, r))
    ref = p[5] + F.linear(F.gelu(F.linear(p[0], p[1], p[2]), approximate="tanh"), p[3], p[4])
    ref.backward(dy.double())
    _check(y, [t.grad for t in (x, w1, b1, w2, b2)], ref, [q.grad for q in p[:5]], dtype)
    assert torch.equal(r.grad, dy)  # the residual's gradient is the output's
    # against the unfused add: the same GEMMs, the sum rounded once instead of twice
    plain = r + linear_act_linear(x, w1, b1, "gelu_tanh", w2, b2)
    assert (
        rel_err(y, plain) < TOL[dtype]
        and (y.double() - ref).abs().sum() <= (plain.double() - ref).abs().sum()
    )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("packed", [False, True])
def test_gated_mlp_adds_the_residual_in_downs_gemm(dtype, packed):
    gate = (80, 32) if packed else (40, 32)
    x, wg, wu, wd, r = _params(dtype, (2, 7, 32), gate, (40, 32), (32, 40), (2, 7, 32))
    y = linear_glu_linear(x, wg, None, None if packed else wu, None, "silu", wd, None, residual=r)
    dy = torch.randn_like(y)
    y.backward(dy)
    p = _float64((x, wg, wu, wd, r))
    if packed:
        g, u = F.linear(p[0], p[1]).chunk(2, -1)
    else:
        g, u = F.linear(p[0], p[1]), F.linear(p[0], p[2])
    ref = p[4] + F.linear(F.silu(g) * u, p[3])
    ref.backward(dy.double())
    used = (x, wg, wd) if packed else (x, wg, wu, wd)
    ref_used = (p[0], p[1], p[3]) if packed else p[:4]
    _check(y, [t.grad for t in used], ref, [q.grad for q in ref_used], dtype)
    assert torch.equal(r.grad, dy)


def test_the_tma_kernel_adds_the_residual_in_its_pointer_epilogue(hopper_routes):
    x, w1, w2, r = _params(torch.bfloat16, (70, 64), (96, 64), (64, 96), (70, 64))
    y = linear_act_linear(x, w1, None, "relu", w2, None, r)
    assert hopper_routes  # the forward GEMMs took the TMA kernel
    p = _float64((x, w1, w2, r))
    ref = p[3] + F.linear(F.relu(F.linear(p[0], p[1])), p[2])
    assert rel_err(y, ref) < TOL[torch.bfloat16]


def test_a_residual_of_the_wrong_shape_or_dtype_is_refused_before_a_launch(launches):
    x, w1, w2, r = _params(torch.float16, (4, 32), (64, 32), (32, 64), (4, 32))
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 32\)"):
        linear_act_linear(x, w1, None, "gelu", w2, None, r[:, :16])
    with pytest.raises(TypeError, match="residual"):
        linear_glu_linear(x, w1[:32], None, w1[32:], None, "silu", w2[:, :32], None, residual=r.bfloat16())
    assert launches == []


# --------------------------------------------------------------------------- the blocks


def _mlp(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "GPT2MLP":
        config = transformers.GPT2Config(n_embd=32, n_head=2, resid_pdrop=0.0)
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        return GPT2MLP(128, config).to(DEVICE)
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(transformers.LlamaConfig(hidden_size=32, intermediate_size=40)).to(DEVICE)


@pytest.mark.parametrize("name", ["GPT2MLP", "LlamaMLP"])
def test_mlp_with_residual_runs_no_torch_add_over_the_stream(name, launches):
    mlp = convert_network(_mlp(name), torch.bfloat16)
    x, h = (torch.randn(2, 5, 32, device=DEVICE).bfloat16().requires_grad_() for _ in range(2))
    with AddsOver(2 * 5 * 32) as adds:
        y = fusion.mlp_with_residual(mlp, x, h)
        y.float().square().sum().backward()
    assert adds.seen == 0
    assert any(kw.get("ADD_RESIDUAL") for _, kw in launches)
    got = (y.detach(), x.grad, h.grad, *(p.grad for p in mlp.parameters()))
    x2, h2 = (t.detach().requires_grad_() for t in (x, h))
    mlp.zero_grad(set_to_none=True)
    y2 = h2 + mlp(x2)  # the unfused add
    y2.float().square().sum().backward()
    want = (y2.detach(), x2.grad, h2.grad, *(p.grad for p in mlp.parameters()))
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 2 * TOL[torch.bfloat16]


def test_mlp_with_residual_keeps_hooks_and_training_dropout():
    # a hook on the block, or a dropout that drops: the block called as a module, a torch add
    mlp = convert_network(_mlp("GPT2MLP"), torch.float16)
    x, h = torch.randn(2, 3, 32, device=DEVICE).half(), torch.randn(2, 3, 32, device=DEVICE).half()
    seen = []
    handle = mlp.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    y = fusion.mlp_with_residual(mlp, x, h)
    handle.remove()
    assert seen == [torch.Size([2, 3, 32])]
    assert rel_err(y, fusion.mlp_with_residual(mlp, x, h)) < TOL[torch.float16]
    mlp.dropout.p = 0.5
    torch.manual_seed(1)
    dropped = fusion.mlp_with_residual(mlp.train(), x, h)
    torch.manual_seed(1)
    assert torch.equal(dropped, h + mlp(x))


def test_the_traced_residual_add_is_the_eager_ones():
    # tkern::linear_residual: opcheck (fake, schema, autograd registration), and a compiled
    # block (aot_eager) rounds its residual add as the eager one does: the same bits forward,
    # the same gradients
    x, w1, b1, w2, b2, r = _params(torch.float16, (2, 5, 32), (64, 32), (64,), (32, 64), (32,), (2, 5, 32))
    h = torch.randn(10, 64, device=DEVICE).half().requires_grad_()
    torch.library.opcheck(torch.ops.tkern.linear_residual.default, (h, w2, b2, r.reshape(10, 32)))

    def block(x, r):
        return linear_act_linear(x, w1, b1, "gelu_tanh", w2, b2, r)

    eager = block(x, r)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, r)
    assert torch.equal(compiled, eager)
    dy = torch.randn_like(eager)
    got = torch.autograd.grad(compiled, (x, w2, r), dy)
    want = torch.autograd.grad(eager, (x, w2, r), dy)
    assert torch.equal(got[2], dy) and torch.equal(got[1], want[1])  # the residual's, down's dW: as eager
    assert rel_err(got[0], want[0]) < TOL[torch.float16]  # dX: act' in a pass of its own when traced
