"""Activation gradients in the dgrad epilogue (issue 54 item 5): ``dZ = (dY @ W) * act'(Z)``
computed by the GEMM that produces the layer's input gradient (gemm.matmul_grad_act), and
the converted GPT-2 MLP's backward built on it (tkern.ops.mlp.linear_act_linear): no
act' pass and no act' prologue, gradients within one rounding of the previous path. The
same for a gated unit (gemm.matmul_grad_glu, ops.mlp.linear_glu_linear: Llama's and Phi-3's
MLPs): no gated-unit backward launch, and no torch add summing gate's and up's dX."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, AddsOver, loss_and_grads, rel_err

import tkern
from tkern.kernels import gemm
from tkern.kernels.activation import ACTIVATIONS, activation_grad
from tkern.nn import convert_network, fusion

HALF = [torch.float16, torch.bfloat16]
_TORCH_ACT = {
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _float64_dz(a, b, z, activation):
    """(a @ b) * act'(z) in float64 from the same half inputs."""
    z64 = z.double().requires_grad_()
    (slope,) = torch.autograd.grad(_TORCH_ACT[activation](z64).sum(), z64)
    return (a.double() @ b.double()) * slope


def _operands(dtype, m, k, n, b_transposed=False):
    torch.manual_seed(0)
    a = _randn(m, k, dtype=dtype)
    b = _randn(n, k, dtype=dtype, scale=0.2).t() if b_transposed else _randn(k, n, dtype=dtype, scale=0.2)
    return a, b, _randn(m, n, dtype=dtype, scale=2.0)


def _check_against_float64(out, old, ref, dtype):
    """``out`` within one rounding (and the interpreter's bf16 truncation) of float64, and
    never further from it than the previous path ``old`` (which rounds dH, then dZ)."""
    eps = torch.finfo(dtype).eps
    err = (out.double() - ref).abs()
    assert (err <= eps * ref.abs() + 1e-4 * eps).all()
    assert (out.double() - old.double()).abs().le(2 * eps * ref.abs() + 1e-4 * eps).all()
    assert err.sum() <= (old.double() - ref).abs().sum()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "relu", "silu"])
def test_epilogue_is_dy_at_w_times_the_activation_gradient(dtype, activation):
    # ragged sizes (masked edges in M, N and K), W read transposed in place as dgrad does
    a, b, z = _operands(dtype, 70, 50, 90, b_transposed=True)
    out = gemm.matmul_grad_act(a, b, z, activation)
    old = activation_grad(tkern.matmul(a, b), z, activation)  # today's: dH rounded, then a pass
    assert out.dtype == dtype and out.shape == (70, 90) and out.is_contiguous()
    _check_against_float64(out, old, _float64_dz(a, b, z, activation), dtype)
    if activation == "relu":  # a select commutes with the rounding: bit for bit
        assert torch.equal(out, old)


@pytest.mark.parametrize("dtype", HALF)
def test_the_tma_kernel_reads_z_in_its_pointer_epilogue(dtype, hopper_routes):
    # descriptor-aligned K and N
    routes = hopper_routes
    a, b, z = _operands(dtype, 70, 64, 96)
    out = gemm.matmul_grad_act(a, b, z, "gelu_tanh")
    assert routes == ["tma"]
    old = activation_grad(tkern.matmul(a, b), z, "gelu_tanh")
    _check_against_float64(out, old, _float64_dz(a, b, z, "gelu_tanh"), dtype)


def test_arguments_are_refused_before_a_launch():
    a, b, z = _operands(torch.float16, 8, 16, 24)
    with pytest.raises(ValueError, match="needs an activation"):
        gemm.matmul_grad_act(a, b, z, None)
    with pytest.raises(ValueError, match="activation must be one of"):
        gemm.matmul_grad_act(a, b, z, "tanh")
    with pytest.raises(ValueError, match="contiguous"):
        gemm.matmul_grad_act(a, b, z.t().contiguous().t(), "gelu")
    with pytest.raises(ValueError, match="contiguous"):
        gemm.matmul_grad_act(a, b, z[:4], "gelu")
    with pytest.raises(TypeError, match="z"):
        gemm.matmul_grad_act(a, b, z.bfloat16(), "gelu")


# --------------------------------------------------------------------------- GPT-2's MLP


def _gpt2(activation="gelu_new"):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2, activation_function=activation,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(DEVICE)


def _act_launches(seen):
    """What applies act' in a backward: the pass, prologues, and the dgrad epilogue."""
    passes = sum(name == "_activation_grad_kernel" for name, _ in seen)
    prologues = sum(bool(kw.get("A_ACT")) for _, kw in seen)
    epilogues = [kw["GRAD_ACT"] for _, kw in seen if kw.get("GRAD_ACT")]
    return passes, prologues, epilogues


def test_converted_gpt2_backward_applies_act_grad_in_c_proj_dgrad(launches, monkeypatch):
    dtype = torch.float16
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 8), device=DEVICE, generator=torch.Generator().manual_seed(0))
    ref_loss, ref = loss_and_grads(model, ids)  # fp32, HF's own modules
    convert_network(model, dtype)
    params = dict(model.named_parameters())
    # a hook on the block keeps its residual add a torch add on both paths (fusion.mlp_with_residual
    # puts it in c_proj's epilogue only on the fused one): the two forwards are the same GEMMs
    model.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: None)
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", False)
    old_loss, old = loss_and_grads(model, ids)  # the previous path: act' after c_proj's dgrad
    assert _act_launches(launches)[:2] == (1, 0)  # GELU's gradient: a pass of its own
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", True)
    launches.clear()
    loss, grads = loss_and_grads(model, ids)
    assert _act_launches(launches) == (0, 0, [ACTIVATIONS["gelu_tanh"]])  # c_proj's dgrad only
    assert torch.equal(loss, old_loss)  # the same forward GEMMs
    assert rel_err(loss, ref_loss) < TOL[dtype]
    for name, g in grads.items():
        assert g.dtype == params[name].dtype
        if "mlp.c_proj" in name:  # dW2 and db2 from dY and H as before: bit for bit
            assert torch.equal(g, old[name]), name
        assert rel_err(g, old[name]) < TOL[dtype], name  # within one rounding of dZ
        assert rel_err(g, ref[name]) <= max(2 * TOL[dtype], 1.01 * rel_err(old[name], ref[name])), name


def _block_grads(mlp, x):
    x = x.detach().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    y = mlp(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y))
    return [y.detach(), x.grad, *(p.grad for p in mlp.parameters())]


@pytest.mark.parametrize("dtype", HALF)
def test_relu_mlp_is_bit_for_bit_the_previous_path(dtype, launches, monkeypatch):
    # ReLU's gradient is a select, which commutes with the rounding of dH: every gradient equal
    mlp = _gpt2("relu").transformer.h[0].mlp
    convert_network(mlp, dtype)
    x = torch.randn(2, 5, 64, device=DEVICE).to(dtype)
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", False)
    old = _block_grads(mlp, x)
    assert _act_launches(launches)[1] == 1  # the previous path: act' in c_fc's dgrad prologue
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", True)
    launches.clear()
    new = _block_grads(mlp, x)
    assert _act_launches(launches) == (0, 0, [ACTIVATIONS["relu"]])
    assert all(torch.equal(a, b) for a, b in zip(new, old, strict=True))


def test_hooks_and_create_graph_keep_their_meaning(monkeypatch):
    # a hook on c_proj: the layers one by one (the hook sees c_proj's input); a backward with
    # create_graph through the fused function: torch's differentiable formulas, as each layer's
    model = _gpt2()
    convert_network(model, torch.float16)
    mlp = model.transformer.h[0].mlp
    x = torch.randn(2, 4, 64, device=DEVICE).half().requires_grad_()
    seen = []
    handle = mlp.c_proj.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    y_hooked = mlp(x)
    handle.remove()
    assert seen == [torch.Size([2, 4, 256])]
    y = mlp(x)
    assert torch.equal(y, y_hooked)
    (gx,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
    (gx2,) = torch.autograd.grad(gx.float().sum(), x)
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", False)
    (ox,) = torch.autograd.grad(mlp(x).float().square().sum(), x, create_graph=True)
    (ox2,) = torch.autograd.grad(ox.float().sum(), x)
    assert torch.equal(gx, ox)  # torch's formulas on the same saved tensors
    # the second order also runs each path's first-order kernels (through y): one rounding apart
    assert rel_err(gx2, ox2) < TOL[torch.float16]


@pytest.mark.parametrize("up_bias", [True, False])
def test_both_weight_gradients_go_into_a_fused_optimizers_flat_buffer(wgrad_counts, up_bias):
    # tkern Linear weights (inputs 1 and 3 of the function): each wgrad added in place, and
    # each bias's dbias beside it; with no first bias autograd lists the second weight one slot
    # earlier (next_function_slots)
    from torch import nn

    from tkern.flat import grad_is_flat_view
    from tkern.ops.mlp import linear_act_linear
    from tkern.optim import FusedAdamW

    torch.manual_seed(0)
    up, down = tkern.nn.Linear(24, 40, bias=up_bias).to(DEVICE), tkern.nn.Linear(40, 16).to(DEVICE)
    model = nn.ModuleList([up, down])
    opt = FusedAdamW(model.parameters(), lr=1e-3)  # noqa: F841 (kept: it owns the flat buffer)
    x = torch.randn(12, 24, device=DEVICE).half()
    linear_act_linear(x, up.weight, up.bias, "gelu_tanh", down.weight, down.bias).float().sum().backward()
    assert wgrad_counts == {"into": 2 + 1 + up_bias, "copies": 0}
    assert all(grad_is_flat_view(p) for p in model.parameters())
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    tkern.linear(
        tkern.linear(x, up.weight, up.bias, "gelu_tanh"), down.weight, down.bias
    ).float().sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert rel_err(g, p.grad) < TOL[torch.float16]


# --------------------------------------------------------------------------- gated units


def _float64_glu(a, b, gate_up, activation):
    """[d(gate) | d(up)] of ``act(gate) * up`` for dH = a @ b, in float64 from the half inputs."""
    n = b.shape[1]
    g, u = (t.double().requires_grad_() for t in (gate_up[:, :n], gate_up[:, n:]))
    dg, du = torch.autograd.grad(_TORCH_ACT[activation](g) * u, (g, u), a.double() @ b.double())
    return torch.cat((dg, du), 1)


def _glu_operands(dtype, m, k, n):
    torch.manual_seed(0)
    return _randn(m, k, dtype=dtype), _randn(n, k, dtype=dtype, scale=0.2).t(), _randn(m, 2 * n, dtype=dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu", "relu"])
def test_glu_epilogue_is_the_gated_units_backward_of_dy_at_w(dtype, activation):
    # ragged sizes (masked edges in M, N and K), W read transposed in place as dgrad does
    a, b, gate_up = _glu_operands(dtype, 70, 50, 45)
    out = gemm.matmul_grad_glu(a, b, gate_up, activation)
    assert out.dtype == dtype and out.shape == (70, 90) and out.is_contiguous()
    dh = tkern.matmul(a, b)  # the previous path: dH rounded, then the gated unit's backward
    old = torch.cat(tkern.kernels.swiglu.swiglu_backward(dh, gate_up[:, :45], gate_up[:, 45:], activation), 1)
    _check_against_float64(out, old, _float64_glu(a, b, gate_up, activation), dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_the_tma_kernel_writes_both_glu_gradients_in_its_pointer_epilogue(dtype, hopper_routes):
    # C is the left half of the (M, 2N) output: the epilogue stores through C's row stride 2N
    routes = hopper_routes
    a, b, gate_up = _glu_operands(dtype, 70, 64, 48)
    out = gemm.matmul_grad_glu(a, b.contiguous(), gate_up, "silu")
    assert routes == ["tma"]
    dh = tkern.matmul(a, b)
    old = torch.cat(tkern.kernels.swiglu.swiglu_backward(dh, gate_up[:, :48], gate_up[:, 48:]), 1)
    _check_against_float64(out, old, _float64_glu(a, b, gate_up, "silu"), dtype)


def test_glu_arguments_are_refused_before_a_launch(launches):
    a, b, gate_up = _glu_operands(torch.float16, 8, 16, 12)
    for bad, match in (
        ((a, b, gate_up, None), "needs the gate's activation"),
        ((a, b, gate_up, "tanh"), "activation must be one of"),
        ((a, b, gate_up[:, :12], "silu"), r"contiguous \(8, 24\)"),
        ((a, b, gate_up.t().contiguous().t(), "silu"), "contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            gemm.matmul_grad_glu(*bad)
    with pytest.raises(TypeError, match="gate_up"):
        gemm.matmul_grad_glu(a, b, gate_up.bfloat16(), "silu")
    with pytest.raises(ValueError, match="w_down"):
        tkern.ops.mlp.linear_glu_linear(a, b.t(), None, b.t(), None, "silu", b.t(), None)
    assert launches == []


def _llama_mlp(name="LlamaMLP"):
    transformers = pytest.importorskip("transformers")
    family = {"LlamaMLP": ("llama", "LlamaConfig"), "Phi3MLP": ("phi3", "Phi3Config")}[name]
    config = getattr(transformers, family[1])(hidden_size=32, intermediate_size=40, num_attention_heads=2)
    module = __import__(f"transformers.models.{family[0]}.modeling_{family[0]}", fromlist=[name])
    torch.manual_seed(0)
    return getattr(module, name)(config).to(DEVICE)


@pytest.mark.parametrize(("name", "dtype"), [("LlamaMLP", torch.bfloat16), ("Phi3MLP", torch.float16)])
def test_converted_gated_mlp_backward_runs_in_downs_dgrad_epilogue(name, dtype, launches, monkeypatch):
    # no gated-unit backward launch, one GRAD_GLU dgrad, and x's gradient summed by the GEMMs
    # (no torch add over (tokens, hidden)); against the previous path and fp32
    mlp = _llama_mlp(name)
    x = torch.randn(2, 5, 32, device=DEVICE)
    ref = _block_grads(mlp, x)  # fp32, HF's own modules
    convert_network(mlp, dtype)
    x = x.to(dtype)
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", False)
    old = _block_grads(mlp, x)
    assert sum(n == "_swiglu_bwd_kernel" for n, _ in launches) == 1
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", True)
    launches.clear()
    with AddsOver(2 * 5 * 32) as adds:
        new = _block_grads(mlp, x)
    assert sum(n == "_swiglu_bwd_kernel" for n, _ in launches) == 0
    assert [(kw["GRAD_ACT"], kw["GRAD_GLU"]) for _, kw in launches if kw.get("GRAD_GLU")] == [
        (ACTIVATIONS["silu"], True)
    ]
    assert adds.seen == 0
    assert torch.equal(new[0], old[0])  # the same forward GEMMs and gated unit
    for got, prev, want in zip(new, old, ref, strict=True):
        assert got.dtype == dtype
        assert rel_err(got, prev) < TOL[dtype]  # within one rounding of dH
        assert rel_err(got, want) <= max(2 * TOL[dtype], 1.01 * rel_err(prev, want))


def test_gated_mlp_hooks_create_graph_and_the_flat_buffer(wgrad_counts, monkeypatch):
    # a hook on up_proj: the layers one by one; create_graph: torch's formulas, as each layer's;
    # a fused optimizer's flat buffer: the three weight gradients written into it
    from tkern.flat import grad_is_flat_view
    from tkern.optim import FusedAdamW

    mlp = convert_network(_llama_mlp(), torch.float16)
    opt = FusedAdamW(mlp.parameters(), lr=1e-3)  # noqa: F841 (kept: it owns the flat buffer)
    x = torch.randn(2, 4, 32, device=DEVICE).half().requires_grad_()
    seen = []
    handle = mlp.up_proj.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    y_hooked = mlp(x)
    handle.remove()
    assert seen == [torch.Size([2, 4, 40])]
    y = mlp(x)
    assert torch.equal(y, y_hooked)
    (gx,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", False)
    (ox,) = torch.autograd.grad(mlp(x).float().square().sum(), x, create_graph=True)
    assert rel_err(gx, ox) < TOL[torch.float16]  # the same formulas; x's two halves summed once here
    monkeypatch.setattr(fusion, "DGRAD_EPILOGUE", True)
    wgrad_counts.update(into=0, copies=0)
    mlp(x.detach()).float().sum().backward()
    assert wgrad_counts == {"into": 3, "copies": 0}
    assert all(grad_is_flat_view(p) for p in mlp.parameters())
