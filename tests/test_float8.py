"""FP8 casts (tkern.to_float8, delayed scaling) and the fp8 GEMM (tkern.scaled_mm).

References: torchao's tensorwise cast (bit-exact), a float64 emulation of the
same convention per row and per block (bit-exact: every step is exact or one
correctly rounded fp32 operation), and float64 products for the GEMM.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE

import tkern
from tkern.kernels.float8 import EPS, FP8_MAX, to_float8_delayed

torchao_utils = pytest.importorskip("torchao.float8.float8_utils")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HIGH = [torch.float32, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def sample(shape, dtype, seed=0, spike=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x = x * torch.exp2(torch.randint(-12, 6, shape, generator=g).float())  # many binades
    if spike:
        x.view(-1)[0] = 1e3
    return x.to(dtype).to(DEVICE)


def emulate_blocks(x: torch.Tensor, dtype, bm: int, bk: int):
    """The convention in float64 where it is exact: per (bm, bk) block, amax
    clamped at 1e-12, multiplier fp8_max / amax rounded once to fp32, data
    saturate(x * multiplier) rounded by torch's cast, scale 1 / multiplier."""
    x = x.float().cpu()
    M, K = x.shape
    data = torch.empty((M, K), dtype=dtype)
    scales = torch.empty((math.ceil(M / bm), math.ceil(K / bk)))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
            amax = blk.abs().max().double().clamp(min=EPS)
            mult = (FP8_MAX[dtype] / amax).float()
            data[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk] = (
                (blk * mult).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
            )
            scales[i, j] = mult.reciprocal()
    return data, scales


# ----------------------------------------------------------------------------- to_float8


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", [(1,), (37, 53), (5000,), (3, 4, 17)])
def test_tensorwise_is_torchaos_cast_bit_for_bit(fp8, dtype, shape):
    x = sample(shape, dtype)
    data, scale = tkern.to_float8(x, fp8)
    ref_mult = torchao_utils.tensor_to_scale(x, fp8)
    ref = torchao_utils.to_fp8_saturated(x.float() * ref_mult, fp8)
    assert data.dtype == fp8 and data.shape == x.shape and scale.shape == ()
    assert torch.equal(bits(data), bits(ref))
    assert torch.equal(scale, ref_mult.reciprocal())


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize(
    ("granularity", "block"),
    [("row", None), ((1, 128), (1, 128)), ((128, 128), (128, 128)), ((3, 50), (3, 50))],
)
def test_rows_and_blocks_match_the_float64_emulation(fp8, dtype, granularity, block):
    x = sample((130, 300), dtype, seed=1)
    data, scale = tkern.to_float8(x, fp8, granularity)
    bm, bk = block or (1, 300)
    ref_data, ref_scale = emulate_blocks(x, fp8, bm, bk)
    assert scale.shape == ref_scale.shape
    assert torch.equal(bits(data.cpu()), bits(ref_data))
    assert torch.equal(scale.cpu(), ref_scale)


def test_a_strided_view_is_read_in_place():
    x = sample((64, 256), torch.bfloat16, seed=2)
    data, scale = tkern.to_float8(x.t(), E4M3, (128, 16))
    ref, ref_scale = emulate_blocks(x.t(), E4M3, 128, 16)
    assert torch.equal(bits(data.cpu()), bits(ref)) and torch.equal(scale.cpu(), ref_scale)


@pytest.mark.parametrize("granularity", ["tensor", "row", (4, 8)])
def test_an_all_zero_block_stays_zeros_with_a_finite_scale(granularity):
    x = torch.zeros(8, 16, device=DEVICE)
    x[4:, 8:] = 2.0
    data, scale = tkern.to_float8(x, E4M3, granularity)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(data.float() == 0, x == 0)
    # the dequantized value is the input wherever it is representable
    if scale.dim() == 0:
        expanded = scale
    else:
        expanded = scale.repeat_interleave(8 // scale.shape[0], 0).repeat_interleave(16 // scale.shape[1], 1)
    torch.testing.assert_close(data.float() * expanded, x, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(x=torch.zeros(4, dtype=torch.int32)), TypeError, "x"),
        (dict(x=torch.zeros(4), dtype=torch.float16), TypeError, "dtype must be torch.float8"),
        (dict(x=torch.zeros(4), granularity="row"), ValueError, "2-D"),
        (dict(x=torch.zeros(4, 4), granularity=(0, 4)), ValueError, "granularity"),
        (dict(x=torch.zeros(4, 4), granularity="col"), ValueError, "granularity"),
    ],
)
def test_bad_input_is_named_before_any_launch(kwargs, exc, words):
    kwargs["x"] = kwargs["x"].to(DEVICE)
    with pytest.raises(exc, match=words):
        tkern.to_float8(**kwargs)


# ----------------------------------------------------------------------------- delayed scaling


def test_delayed_scaling_follows_its_history_and_saturates_a_spike():
    history = torch.zeros(4, device=DEVICE)
    # step 1: an empty history: the scale starts at 1 (Transformer Engine's start)
    x1 = sample((64,), torch.float32, seed=3, spike=False)
    d1, s1 = to_float8_delayed(x1, history, E4M3)
    assert s1.item() == 1.0 and torch.equal(bits(d1), bits(x1.clamp(-448, 448).to(E4M3)))
    assert history[0] == x1.abs().max() and (history[1:] == 0).all()
    # step 2: a spike 100x beyond the history saturates this step, never inf/nan ...
    x2 = x1 * 100
    d2, s2 = to_float8_delayed(x2, history, E4M3, margin=1)
    mult = (torch.tensor(448.0, dtype=torch.float64) / x1.abs().max().double()).float() * 0.5
    assert torch.equal(s2, mult.reciprocal().to(DEVICE))
    assert torch.equal(bits(d2), bits((x2 * mult.to(DEVICE)).clamp(-448, 448).to(E4M3)))
    assert d2.float().abs().max() == 448.0 and torch.isfinite(d2.float()).all()
    # ... and the scale adapts on the next: the history now holds the spike
    assert history[0] == x2.abs().max() and history[1] == x1.abs().max()
    d3, s3 = to_float8_delayed(x2, history, E4M3, update=False)
    mult3 = (torch.tensor(448.0, dtype=torch.float64) / x2.abs().max().double()).float()
    assert torch.equal(s3, mult3.reciprocal().to(DEVICE))
    assert history[0] == x2.abs().max()  # update=False leaves the history alone


def test_the_history_drops_its_oldest_amax():
    history = torch.zeros(3, device=DEVICE)
    for k in range(5):
        to_float8_delayed(torch.full((8,), float(k + 1), device=DEVICE), history)
    assert history.tolist() == [5.0, 4.0, 3.0]


# ----------------------------------------------------------------------------- scaled_mm


def expand(scale: torch.Tensor, rows: int, cols: int, block) -> torch.Tensor:
    s = scale.double().cpu()
    if s.numel() == 1 and block is None:
        return s.reshape(1, 1).expand(rows, cols)
    if block is None:
        return s.expand(rows, cols)
    return s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def reference(a, b, sa, sb, block_a=None, block_b=None, bias=None):
    (M, K), N = a.shape, b.shape[1]
    out = (a.double().cpu() * expand(sa, M, K, block_a)) @ (b.double().cpu() * expand(sb, K, N, block_b))
    return out if bias is None else out + bias.double().cpu()


def quantize_b(w: torch.Tensor, fp8, granularity):
    """b (K, N) and its scale: per column means one scale per row of b^T."""
    if granularity == "col":
        data, scale = tkern.to_float8(w.t(), fp8, "row")
        return data.t(), scale.t()
    return tkern.to_float8(w, fp8, granularity)


PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
GRANULARITIES = [
    ("tensor", "tensor", None, None),
    ("row", "col", None, None),
    ((1, 128), (128, 128), (1, 128), (128, 128)),
]


def assert_gemm_close(out, ref, K, out_dtype):
    # fp32 accumulation of K products: relative error <= K * 2^-24 of the largest
    # partial sums; then one rounding to out_dtype (2^-8 bf16, 2^-11 fp16)
    unit = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    scale = ref.abs().max().item()
    err = (out.double().cpu() - ref).abs()
    assert (err <= K * 2.0**-24 * scale + unit * ref.abs() + 1e-30).all(), err.max().item()


@pytest.mark.parametrize(("fa", "fb"), PAIRS)
@pytest.mark.parametrize(("ga", "gb", "block_a", "block_b"), GRANULARITIES)
@pytest.mark.parametrize(("M", "N", "K"), [(37, 45, 300), (64, 16, 128)])
def test_scaled_mm_matches_float64(fa, fb, ga, gb, block_a, block_b, M, N, K):
    x, w = sample((M, K), torch.float32, seed=4), sample((K, N), torch.float32, seed=5)
    a, sa = tkern.to_float8(x, fa, ga)
    b, sb = quantize_b(w, fb, gb)
    out = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert_gemm_close(out, reference(a, b, sa, sb, block_a, block_b), K, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_bias_and_out_dtype(out_dtype):
    # no spike: fp16's range (65504) must hold the products
    x, w = sample((33, 256), torch.float32, seed=6, spike=False), sample((256, 24), torch.float32, seed=7)
    a, sa = tkern.to_float8(x, E4M3, "row")
    b, sb = quantize_b(w, E4M3, "col")
    bias = torch.randn(24, device=DEVICE).to(out_dtype)
    out = tkern.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_gemm_close(out, reference(a, b, sa, sb, bias=bias), 256, out_dtype)


def test_explicit_block_shapes_and_mixed_granularities():
    x, w = sample((40, 256), torch.float32, seed=8), sample((256, 70), torch.float32, seed=9)
    a, sa = tkern.to_float8(x, E4M3, (16, 128))
    b, sb = tkern.to_float8(w, E4M3, "tensor")
    out = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, block_a=(16, 128))
    assert_gemm_close(out, reference(a, b, sa, sb, (16, 128), None), 256, torch.float32)


@pytest.mark.parametrize(("ga", "gb", "block_a", "block_b"), GRANULARITIES)
def test_scaled_mm_accumulates_into_a_tensor(ga, gb, block_a, block_b):
    # C += (a * sa) @ (b * sb): the scaled fp32 product plus C read in fp32, rounded once to
    # C's dtype (bf16: a Float8Linear's wgrad into its optimizer's gradient buffer); into
    # zeros, the same bits as a fresh product (0 + x == x)
    M, N, K = 37, 45, 256
    x, w = sample((M, K), torch.float32, seed=10), sample((K, N), torch.float32, seed=11)
    a, sa = tkern.to_float8(x, E4M3, ga)
    b, sb = quantize_b(w, E4M3, gb)
    c = torch.randn(M, N, device=DEVICE).to(torch.bfloat16) * 100
    c0 = c.clone()
    assert tkern.scaled_mm(a, b, sa, sb, accumulate_into=c) is c
    ref = reference(a, b, sa, sb, block_a, block_b)
    assert_gemm_close(c, ref + c0.double().cpu(), K, torch.bfloat16)
    zeros = torch.zeros(M, N, device=DEVICE, dtype=torch.bfloat16)
    tkern.scaled_mm(a, b, sa, sb, accumulate_into=zeros)
    fresh = tkern.scaled_mm(a, b, sa, sb)
    assert torch.equal(zeros, fresh)
    out = torch.full((N, M), float("nan"), device=DEVICE, dtype=torch.bfloat16).t()  # out=, as torch's
    assert tkern.scaled_mm(a, b, sa, sb, out=out) is out and torch.equal(out, fresh)


def test_scaled_mm_accumulate_into_must_fit_the_output():
    a, b, sa, sb = fp8_pair()
    for into, exc, words in [
        (torch.zeros(8, 16, device=DEVICE), TypeError, "accumulate_into must have dtype"),
        (torch.zeros(16, 8, device=DEVICE, dtype=torch.bfloat16), ValueError, r"shape \(8, 16\)"),
    ]:
        with pytest.raises(exc, match=words):
            tkern.scaled_mm(a, b, sa, sb, accumulate_into=into)


def fp8_pair(M=8, K=128, N=16):
    a, sa = tkern.to_float8(torch.randn(M, K, device=DEVICE), E4M3)
    b, sb = tkern.to_float8(torch.randn(K, N, device=DEVICE), E4M3)
    return a, b, sa, sb


@pytest.mark.parametrize(
    ("change", "exc", "words"),
    [
        (lambda a, b, sa, sb: (a.float(), b, sa, sb), TypeError, "a"),
        (lambda a, b, sa, sb: (a, b[:64], sa, sb), ValueError, "inner dimensions"),
        (lambda a, b, sa, sb: (a, b, torch.ones(3, 3, device=DEVICE), sb), ValueError, "scale_a"),
        (lambda a, b, sa, sb: (a, b, sa.double(), sb), TypeError, "scale_a"),
        (lambda a, b, sa, sb: (a, b, sa, torch.ones(16, 1, device=DEVICE)), ValueError, "scale_b"),
        (lambda a, b, sa, sb: (a.to(E5M2), b.to(E5M2), sa, sb), TypeError, "float8_e5m2"),
        (lambda a, b, sa, sb: (a, b, torch.ones(8, 2, device=DEVICE), sb), ValueError, "multiple of 128"),
    ],
)
def test_scaled_mm_bad_input_is_named_before_any_launch(change, exc, words):
    with pytest.raises(exc, match=words):
        tkern.scaled_mm(*change(*fp8_pair()))
