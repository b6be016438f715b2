"""The MX GEMM: tkern.scaled_mm with e8m0 block scales (gemm_mx.py), against the float64
product of the operands dequantized from torchao's to_mx."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, LazyModule

import tkern
import tkern.device

mx_tensor = LazyModule("torchao.prototype.mx_formats.mx_tensor")

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu


def torchao_mx(x: torch.Tensor, dtype):
    """torchao's cast along the last axis: (data, scales) on DEVICE."""
    scales, data = mx_tensor.to_mx(x.contiguous(), dtype, 32)
    return data.to(DEVICE), scales.to(DEVICE)


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 data x 2^(scale - 127), each scale over its 32 elements of the last axis."""
    exps = scales.cpu().view(torch.uint8).double() - 127
    return data.cpu().double() * torch.exp2(exps).repeat_interleave(32, dim=-1)


def operands(m: int, n: int, k: int, a_dtype=E4M3, b_dtype=E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g)
    (a, sa), (wt, sb) = torchao_mx(x, a_dtype), torchao_mx(w, b_dtype)
    return (
        a,
        wt.t(),
        sa,
        sb,
        dequantize(a, sa) @ dequantize(wt, sb).t(),
        dequantize(a, sa).abs() @ dequantize(wt, sb).abs().t(),
    )


def assert_one_rounding(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor):
    """Within one rounding of y's dtype (half an ulp, as 2^-mant relative) plus fp32 accumulation."""
    rel = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[y.dtype]
    err = (y.cpu().double() - ref).abs()
    assert (err <= rel * ref.abs() + 2.0**-22 * magnitude + 1e-30).all(), err.max()


@pytest.mark.parametrize(("a_dtype", "b_dtype"), [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E5M2)])
def test_matches_float64_of_dequantized(a_dtype, b_dtype):
    a, b, sa, sb, ref, mag = operands(64, 64, 64, a_dtype, b_dtype)
    y = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert y.shape == (64, 64) and y.dtype == torch.float32
    assert_one_rounding(y, ref, mag)


def test_ragged_bias_activation_preact():
    m, n, k = 40, 24, 96  # ragged M and N, K three scale blocks past one 64-wide tile
    a, b, sa, sb, ref, mag = operands(m, n, k, seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    preact = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    y = tkern.scaled_mm(a, b, sa, sb, bias=bias, activation="gelu", preact=preact)
    z = ref + bias.cpu().double()
    assert_one_rounding(preact, z, mag)
    want = torch.nn.functional.gelu(z)
    assert (y.cpu().double() - want).abs().max() <= 2.0**-8 * want.abs().max() + 1e-6


def test_custom_op_takes_mx_scales():
    a, b, sa, sb, ref, mag = operands(64, 32, 64)
    y, _ = torch.ops.tkern.scaled_mm(a, b, sa, sb, None, torch.bfloat16, [], [], False)
    assert_one_rounding(y, ref, mag)


def test_refused_without_native_mx(monkeypatch):
    a, b, sa, sb, _, _ = operands(64, 32, 64)
    monkeypatch.setattr(tkern.device, "device_spec", lambda device=None: tkern.device.SPECS["h100"])
    with pytest.raises(RuntimeError, match=r"h100.*sm_90.*tensorwise, delayed, blockwise"):
        tkern.scaled_mm(a, b, sa, sb)


def test_bad_scales_and_arguments():
    a, b, sa, sb, _, _ = operands(64, 32, 64)
    with pytest.raises(ValueError, match=r"scale_b must have shape \(32, 2\)"):
        tkern.scaled_mm(a, b, sa, sb.t().contiguous())
    with pytest.raises(TypeError, match="scale_a must have dtype"):
        tkern.scaled_mm(a, b, sa.view(torch.uint8), sb)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        tkern.scaled_mm(a[:, :48], b[:48], sa, sb)
    with pytest.raises(ValueError, match="takes no block_a, out"):
        tkern.scaled_mm(a, b, sa, sb, block_a=(1, 32), out=torch.empty(64, 32, device=DEVICE))
    with pytest.raises(TypeError, match="a must have dtype"):
        tkern.scaled_mm(a.float(), b, sa, sb)
