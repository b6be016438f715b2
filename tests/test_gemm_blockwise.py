"""The blockwise fp8 GEMM (tkern/kernels/gemm_blockwise.py, issue 43 item 5): DeepSeek-V3's
1x128 / 128x128 scales (and the wgrad's 128x1 columns) in the layouts the "blockwise" recipe
launches, against the product of the dequantized operands in float64; ``tkern.scaled_mm``'s
routing to it (and away from it); its argument checks."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import tkern
from tkern.kernels import gemm, gemm_blockwise
from tkern.kernels.float8 import cast_blocks
from tkern.ops.float8 import float8_linear

E4M3 = torch.float8_e4m3fn
TILE, WEIGHT_BLOCK, TILE_T = (1, 128), (128, 128), (128, 1)
#: Ragged in M, N and K (K = 2.5 scale blocks, a multiple of 16 as a descriptor needs), and even.
SHAPES = [(130, 200, 320), (64, 128, 256), (40, 72, 48)]
#: One output tile, ragged in M and N: the epilogue's tests.
SMALL = (70, 96, 256)


def sample(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 4, shape, generator=g).float())
    return x.to(DEVICE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.double().cpu().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.double().cpu() * s


def recipe_operands(layout: str, M: int, N: int, K: int):
    """``(a, b, scale_a, scale_b, block_a, block_b)`` of the (M, K) @ (K, N) GEMM as
    ops/float8.py's blockwise recipe launches it: forward x @ W^T, dgrad dY @ W (W^T's
    cast), wgrad dY^T @ X (both cast transposed, 1x128 tiles along the tokens)."""
    if layout == "forward":  # x (M, K) in 1x128 tiles, W (N, K) in 128x128 blocks
        xq, sx, _ = cast_blocks(sample((M, K), 1), E4M3, TILE)
        wq, sw, _ = cast_blocks(sample((N, K), 2), E4M3, WEIGHT_BLOCK)
        return xq, wq.t(), sx, sw.t(), TILE, WEIGHT_BLOCK
    if layout == "dgrad":  # dY (M, K) in tiles, W (K, N) cast with W^T stored
        gq, sg, _ = cast_blocks(sample((M, K), 3), E4M3, TILE)
        _, sw, wq_t = cast_blocks(sample((K, N), 4), E4M3, WEIGHT_BLOCK, store_t=True)
        return gq, wq_t.t(), sg, sw, TILE, WEIGHT_BLOCK
    # wgrad: dY^T (M, K) and X^T (N, K) cast in 1x128 tiles: b = (X^T)^T, scales per column
    gq, sg, _ = cast_blocks(sample((K, M), 5).t(), E4M3, TILE)
    xq, sx, _ = cast_blocks(sample((K, N), 6).t(), E4M3, TILE)
    return gq, xq.t(), sg, sx.t(), TILE, TILE_T


def assert_close(out, ref, K, out_dtype):
    # fp8 products are exact in fp32; the 128-term block sums, their scaling and the fused
    # promotion round K + 2 * blocks times at most (2^-24 each, of the largest partial
    # sum); then one rounding to out_dtype
    unit = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = (K + 2 * -(-K // 128)) * 2.0**-24 * ref.abs().max().item() + unit * ref.abs() + 1e-30
    err = (out.double().cpu() - ref).abs()
    assert (err <= bound).all(), err.max().item()


@pytest.fixture
def launches(monkeypatch):
    """The blockwise kernel's launches through ``tkern.scaled_mm``, counted."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return gemm_blockwise.launch_blockwise(*args, **kwargs)

    monkeypatch.setattr(gemm, "launch_blockwise", spy)
    return calls


@pytest.mark.parametrize("layout", ["forward", "dgrad", "wgrad"])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES)
def test_recipe_layouts_match_the_dequantized_product(layout, M, N, K, launches):
    a, b, sa, sb, block_a, block_b = recipe_operands(layout, M, N, K)
    if K > 128:  # 1x128 tiles' scales K-block-major (cast_blocks; one K block: (M, 1) row-major)
        assert sa.stride() == (1, M)
    out = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, block_a=block_a, block_b=block_b)
    assert launches == [(M, K)]
    ref = dequantize(a, sa, block_a) @ dequantize(b, sb, block_b)
    assert_close(out, ref, K, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_and_out_dtypes(out_dtype, launches):
    M, N, K = SMALL
    a, b, sa, sb, block_a, block_b = recipe_operands("forward", M, N, K)
    bias = sample((N,), 7).to(out_dtype)
    out = gemm_blockwise.scaled_mm_blockwise(a, b, sa, sb, block_a, block_b, bias=bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    ref = dequantize(a, sa, block_a) @ dequantize(b, sb, block_b) + bias.double().cpu()
    assert_close(out, ref, K, out_dtype)
    # through scaled_mm (routed here), the same bits
    routed = tkern.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, block_a=block_a, block_b=block_b)
    assert launches and torch.equal(routed, out)


def test_accumulates_into_a_gradient_and_writes_a_strided_out(launches):
    # the wgrad added into a bf16 gradient buffer: one rounding of C + product; into
    # zeros, the bits of a fresh product; out= with column-major strides (C stored
    # without a descriptor)
    M, N, K = SMALL
    a, b, sa, sb, block_a, block_b = recipe_operands("wgrad", M, N, K)
    kw = dict(block_a=block_a, block_b=block_b)
    c = sample((M, N), 8).to(torch.bfloat16)
    c0 = c.double().cpu()
    assert tkern.scaled_mm(a, b, sa, sb, accumulate_into=c, **kw) is c
    ref = dequantize(a, sa, block_a) @ dequantize(b, sb, block_b)
    assert_close(c, ref + c0, K, torch.bfloat16)
    fresh = tkern.scaled_mm(a, b, sa, sb, **kw)
    zeros = torch.zeros(M, N, device=DEVICE, dtype=torch.bfloat16)
    tkern.scaled_mm(a, b, sa, sb, accumulate_into=zeros, **kw)
    out = torch.full((N, M), float("nan"), device=DEVICE, dtype=torch.bfloat16).t()
    assert tkern.scaled_mm(a, b, sa, sb, out=out, **kw) is out
    assert torch.equal(zeros, fresh) and torch.equal(out, fresh)
    assert len(launches) == 4


@pytest.mark.parametrize(
    ("K", "block_a", "block_b"),
    [
        (200, TILE, WEIGHT_BLOCK),  # K not a multiple of 16: no descriptor over a or b
        (256, (1, 256), (256, 128)),  # 256-wide K blocks: not one K step per block
        (256, (64, 128), (128, 128)),  # 64-row blocks of a
    ],
)
def test_what_the_kernel_does_not_take_runs_on_the_pointer_kernel(K, block_a, block_b, launches):
    M, N = 70, 96
    a, sa, _ = cast_blocks(sample((M, K), 9), E4M3, block_a)
    w, sw, _ = cast_blocks(sample((K, N), 10).t(), E4M3, block_b[::-1])  # b = w^T, K-major
    b, sb = w.t(), sw.t()
    assert not gemm_blockwise.blockwise_eligible(a, b, block_a, block_b)
    out = tkern.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, block_a=block_a, block_b=block_b)
    assert launches == []
    assert_close(out, dequantize(a, sa, block_a) @ dequantize(b, sb, block_b), K, torch.float32)


def test_a_non_k_major_operand_is_refused_by_name_before_any_launch(monkeypatch):
    M, N, K = SHAPES[1]
    a, b, sa, sb, block_a, block_b = recipe_operands("forward", M, N, K)

    def launched(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(gemm_blockwise, "launch_blockwise", launched)
    cases = [
        ((a, b.contiguous(), sa, sb), ValueError, "K-major"),  # b row-major: N along the rows
        ((a, b, sa[:, :1], sb), ValueError, r"scale_a must have shape \(64, 2\)"),
        ((a, b, sa, sb.t()), ValueError, r"scale_b must have shape \(2, 1\)"),
        ((a, b, sa.double(), sb), TypeError, "scale_a"),
        ((a.float(), b, sa, sb), TypeError, "a"),
        ((a.to(torch.float8_e5m2), b.to(torch.float8_e5m2), sa, sb), TypeError, "float8_e5m2"),
        ((a, b[:128], sa, sb), ValueError, "b must have shape"),
    ]
    for args, exc, words in cases:
        with pytest.raises(exc, match=words):
            gemm_blockwise.scaled_mm_blockwise(*args, block_a, block_b)
    with pytest.raises(ValueError, match="bias must have shape"):
        gemm_blockwise.scaled_mm_blockwise(a, b, sa, sb, block_a, block_b, bias=torch.zeros(3, device=DEVICE))
    # and through scaled_mm: a scale grid that does not fit its blocks
    with pytest.raises(ValueError, match="scale_b"):
        tkern.scaled_mm(a, b, sa, sb[:1], block_a=block_a, block_b=block_b)


def test_the_blockwise_recipe_runs_all_three_gemms_here(launches):
    # Float8Linear's blockwise recipe: forward, dgrad and wgrad each one launch of this kernel
    x = sample((96, 256), 11).requires_grad_()
    w = sample((160, 256), 12).requires_grad_()
    bias = sample((160,), 13).requires_grad_()
    y = float8_linear(x, w, bias, scaling="blockwise")
    y.backward(sample(tuple(y.shape), 14))
    assert launches == [(96, 256), (96, 160), (160, 96)]
    assert x.grad is not None and w.grad is not None and bias.grad is not None


def test_bench_gemms_blockwise_rows_run_on_this_kernel():
    # benchmarks/bench_gemm_layouts.py (bench_gemm --sections fp8_layouts, gpu_check.sh's
    # bench_gemm_fp8_layouts): its blockwise operands in each training layout are what the
    # recipe launches, K-major, and take this kernel
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gemm_layouts as bench

    x, w, dy = sample((128, 96), 15), sample((48, 96), 16), sample((128, 48), 17)
    for layout in bench.LAYOUTS:
        a, b, sa, sb, block_a, block_b = bench.quantize_operands(
            "blockwise", layout, *bench.layout_operands(layout, x, w, dy)
        )
        assert gemm_blockwise.blockwise_eligible(a, b, block_a, block_b), layout
        assert block_b == ((128, 1) if layout == "wgrad" else (128, 128))
