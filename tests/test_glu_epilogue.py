"""The gated unit's forward in the up GEMM's epilogue (issue 54: ``GLU_FWD``): in a converted
Llama-family MLP (tkern.ops.mlp.linear_glu_linear with separate gate and up weights) the
gate GEMM stores gate, then the up GEMM (gemm.matmul_glu_prechecked) stores up and, from the
stored 16-bit gate and the rounded up, ``h = act(gate) * up`` rounded once: bit for bit what
the gate GEMM, the up GEMM and the gated-unit kernel (kernels/swiglu.py) made, with no
``_swiglu_fwd_kernel`` launch. The packed Phi-3 weight keeps its gated-unit pass."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, loss_and_grads

from tkern.kernels import gemm, swiglu
from tkern.kernels.activation import ACTIVATIONS
from tkern.nn import convert_network
from tkern.ops import mlp as ops_mlp

HALF = [torch.float16, torch.bfloat16]
ACTS = ["silu", "gelu_tanh", "gelu", "relu"]


def _operands(dtype, m, k, n, bias):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w_gate, w_up = ((torch.randn(n, k, device=DEVICE) * 0.3).to(dtype) for _ in range(2))
    b_up = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    return x, w_gate, w_up, b_up


def _gate_up(x, w_gate, n):
    """The (M, 2N) buffer with the gate GEMM's half written (the forward's first GEMM)."""
    gate_up = torch.empty(x.shape[0], 2 * n, dtype=x.dtype, device=x.device)
    gemm.matmul_prechecked(x, w_gate.t(), None, None, x.dtype, None, gate_up[:, :n], False)
    return gate_up


def _unfused(x, b, bias, gate_up, activation):
    """The previous path (gemm.matmul_glu_prechecked's arguments: ``b`` W_up^T): up's GEMM into
    its half, then the gated-unit kernel."""
    n = b.shape[1]
    gemm.matmul_prechecked(x, b, bias, None, x.dtype, None, gate_up[:, n:], False)
    return swiglu.swiglu_forward_prechecked(gate_up[:, :n], gate_up[:, n:], activation)


def _check_bit_identical(x, w_gate, w_up, b_up, activation, routes=None):
    """The fused up GEMM against the previous path; ``routes``: hopper_routes' list, which
    must say the fused GEMM took the TMA kernel."""
    n = w_up.shape[0]
    old_gate_up = _gate_up(x, w_gate, n)
    gate_up = old_gate_up.clone()
    old_h = _unfused(x, w_up.t(), b_up, old_gate_up, activation)
    taken = None if routes is None else len(routes)
    h = gemm.matmul_glu_prechecked(x, w_up.t(), b_up, gate_up, activation)
    if routes is not None:
        assert routes[taken:] == ["tma"]
    assert h.shape == (x.shape[0], n) and h.dtype == x.dtype and h.is_contiguous()
    assert torch.equal(gate_up, old_gate_up)  # gate untouched, up as the plain GEMM stores it
    assert torch.equal(h, old_h)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_up_gemm_stores_up_and_the_gated_unit_bit_for_bit(dtype, activation, bias, launches):
    # ragged M, N and K (masked edges), W_up read transposed in place as the forward does
    _check_bit_identical(*_operands(dtype, 70, 50, 45, bias), activation)
    modes = [kw["GLU_FWD"] for name, kw in launches if name == "_matmul_kernel" and kw.get("GLU_FWD")]
    assert modes == [ACTIVATIONS[activation]]  # one GEMM computed h
    assert sum(name == "_swiglu_fwd_kernel" for name, _ in launches) == 1  # the reference's alone


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("gelu_tanh", True)])
def test_the_tma_kernel_stores_up_and_h_in_its_pointer_epilogue(dtype, activation, bias, hopper_routes):
    # descriptor-aligned K and N, ragged M: h's rows N apart, gate_up's 2N
    _check_bit_identical(*_operands(dtype, 70, 64, 48, bias), activation, hopper_routes)


def _llama_mlp(name="LlamaMLP"):
    transformers = pytest.importorskip("transformers")
    family = {"LlamaMLP": ("llama", "LlamaConfig"), "Phi3MLP": ("phi3", "Phi3Config")}[name]
    config = getattr(transformers, family[1])(hidden_size=32, intermediate_size=40, num_attention_heads=2)
    module = __import__(f"transformers.models.{family[0]}.modeling_{family[0]}", fromlist=[name])
    torch.manual_seed(0)
    return getattr(module, name)(config).to(DEVICE)


@pytest.mark.parametrize(("name", "swiglu_launches"), [("LlamaMLP", 0), ("Phi3MLP", 1)])
def test_converted_gated_mlp_forward_runs_no_gated_unit_kernel(name, swiglu_launches, launches):
    # Llama's separate gate and up: h in up's epilogue; Phi-3's packed gate_up: its pass kept
    block = convert_network(_llama_mlp(name), torch.bfloat16)
    with torch.no_grad():
        block(torch.randn(2, 5, 32, device=DEVICE).bfloat16())
    assert sum(n == "_swiglu_fwd_kernel" for n, _ in launches) == swiglu_launches
    glu = [kw["GLU_FWD"] for n, kw in launches if kw.get("GLU_FWD")]
    assert glu == ([] if swiglu_launches else [ACTIVATIONS["silu"]])


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE)


@pytest.mark.filterwarnings("ignore:.*rotary_emb.*")
def test_converted_llama_loss_and_gradients_are_the_unfused_paths(monkeypatch):
    model = convert_network(_llama(), torch.bfloat16)
    ids = torch.randint(0, 64, (2, 8), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    loss, grads = loss_and_grads(model, ids)
    monkeypatch.setattr(ops_mlp, "matmul_glu_prechecked", _unfused)  # the previous forward
    old_loss, old = loss_and_grads(model, ids)
    assert torch.equal(loss, old_loss)
    for name, g in grads.items():
        assert torch.equal(g, old[name]), name
