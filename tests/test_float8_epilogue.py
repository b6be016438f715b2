"""The fp8 GEMM's epilogue takes the activation (issue 43 item 3, its second half):
``tkern.scaled_mm(..., activation=, preact=)``, a Float8Linear / Float8Conv1D forward with
the activation fused (``float8_linear(..., activation=)``), its backward through the
stored pre-activation, and GPT-2's MLP under the fp8 recipes routed through it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from test_float8 import E4M3, assert_gemm_close, fp8_pair, quantize_b, reference, sample

import tkern

pytestmark = pytest.mark.skipif(
    not tkern.INTERPRET, reason="fp8 on the CPU runs through Triton's interpreter"
)

#: max |act'(z)| over the reals: erf GELU's is 1.1289 (at z = sqrt(2)); the tanh form's
#: 1.1289 too (to 4 digits); SiLU's 1.0998; ReLU's 1. A bound on how much an error in z moves act(z).
ACT_LIPSCHITZ = 1.13
#: fp32 evaluation of act(z) in the epilogue (erf / tanh / exp and a few products): a few
#: fp32 ulps of |z| (2^-24 each); 2^-20 leaves a 16-ulp margin.
ACT_F32_EVAL = 2.0**-20


def act64(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return F.silu(z) if activation == "silu" else F.relu(z)


#: the tanh form's exp(2u) overflows to inf for large |z| in the interpreter's numpy, which
#: the kernel's formula absorbs (act' and act saturate exactly: test_activation.py)
absorbs_overflow = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@absorbs_overflow
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize(("ga", "gb"), [("tensor", "tensor"), ("row", "col")])
def test_scaled_mm_activation_and_preact_match_float64(activation, ga, gb):
    M, N, K = 37, 45, 256
    x, w = sample((M, K), torch.float32, seed=12, spike=False), sample((K, N), torch.float32, seed=13)
    a, sa = tkern.to_float8(x, E4M3, ga)
    b, sb = quantize_b(w, E4M3, gb)
    bias = torch.randn(N, device=DEVICE).to(torch.bfloat16)
    preact = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
    out = tkern.scaled_mm(a, b, sa, sb, bias=bias, activation=activation, preact=preact)
    z = reference(a, b, sa, sb, bias=bias)
    # the pre-activation: the dequantized product + bias, rounded once to bf16
    assert_gemm_close(preact, z, K, torch.bfloat16)
    # act of the fp32 z (not of the rounded preact): z's accumulation error through act's
    # slope, act's fp32 evaluation, then one rounding to bf16 (2^-8 relative)
    ref = act64(z, activation)
    err = (out.double().cpu() - ref).abs()
    bound = ACT_LIPSCHITZ * K * 2.0**-24 * z.abs().max() + ACT_F32_EVAL * z.abs() + 2.0**-8 * ref.abs()
    assert (err <= bound + 1e-30).all(), (err - bound).max().item()
    # the same GEMM without the activation is preact's bits (one epilogue, one rounding)
    assert torch.equal(tkern.scaled_mm(a, b, sa, sb, bias=bias), preact)


def test_scaled_mm_activation_checks_before_launching():
    a, b, sa, sb = fp8_pair()
    good = torch.empty(8, 16, device=DEVICE, dtype=torch.bfloat16)
    for kwargs, exc, words in [
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"activation": "gelu", "preact": good.float()}, TypeError, "preact"),
        ({"activation": "gelu", "preact": good[:4]}, ValueError, "preact"),
        ({"activation": "gelu", "preact": good.t().contiguous().t()[:, :16]}, ValueError, "preact"),
    ]:
        with pytest.raises(exc, match=words):
            tkern.scaled_mm(a, b, sa, sb, **kwargs)
    x, w = torch.randn(8, 256, device=DEVICE), torch.randn(256, 16, device=DEVICE)
    ab, sab = tkern.to_float8(x, E4M3, (1, 128))
    bb, sbb = tkern.to_float8(w, E4M3, (128, 128))
    with pytest.raises(ValueError, match="block scales"):
        tkern.scaled_mm(ab, bb, sab, sbb, activation="gelu")
