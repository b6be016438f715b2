"""MX casts (tkern.to_mx and the one-pass pair to_mx_both) against torchao's to_mx, bit for bit;
the pair's column sums (to_mx_both_sum, the MX backward's bias gradient) against float64."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, LazyModule

import tkern
from tkern.kernels.mx import to_mx_both, to_mx_both_sum

mx_tensor = LazyModule("torchao.prototype.mx_formats.mx_tensor")
mx_config = LazyModule("torchao.prototype.mx_formats.config")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MODES = ["floor", "rceil"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def reference(x: torch.Tensor, dtype, axis: int, mode: str):
    """torchao's to_mx along ``axis`` (it casts along the last): (data, scales)."""
    last = x.detach().cpu().movedim(axis, -1).contiguous()
    if last.dtype == torch.float16:  # torchao takes fp32 / bf16; fp16 -> fp32 is exact
        last = last.float()
    scales, data = mx_tensor.to_mx(last, dtype, 32, mx_config.ScaleCalculationMode(mode))
    return data.movedim(-1, axis), scales.movedim(-1, axis)


def assert_bits_equal(x, dtype, axis, mode, data, scales):
    """Every scale byte and every element's bits equal torchao's; a NaN element is NaN
    (its sign bit is the CPU's NaN rule in torch's arithmetic, and means nothing)."""
    want_data, want_scales = reference(x, dtype, axis, mode)
    assert data.dtype == dtype and scales.dtype == torch.float8_e8m0fnu
    assert data.shape == x.shape and scales.shape == want_scales.shape
    assert torch.equal(bits(scales.cpu()), bits(want_scales))
    got, want = data.cpu(), want_data
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(bits(got)[~nan], bits(want)[~nan])


def edge_values(rows: int, cols: int) -> torch.Tensor:
    """Many binades (down to subnormals, up to fp32's max) and one edge case per row of blocks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-140, 120, (rows, 1), generator=g).float()
    )
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = -0.0
    x[2, 3] = float("nan")  # NaN in a block
    x[3, 5] = float("inf")
    x[4, 7] = -float("inf")
    x[5, :] = 1e-40  # fp32 subnormals
    x[6, 0] = 3e38  # near fp32's max
    x[7, 1] = 448.0  # e4m3's max, and past it
    x[7, 2] = 500.0
    x[8, 2] = 0.1236  # rounds up across a power of two (the interpreter's cast drops the carry)
    x[9, 4] = 57344.0 * 1.1  # past e5m2's max
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("axis", [0, -1])
def test_edge_values_bit_exact(mode, dtype, axis):
    x = edge_values(64, 64).to(DEVICE)
    data, scales = tkern.to_mx(x, dtype, axis=axis, scale_mode=mode)
    assert_bits_equal(x, dtype, axis, mode, data, scales)


@pytest.mark.parametrize(("hdtype", "mode"), [(torch.bfloat16, "floor"), (torch.float16, "rceil")])
def test_half_inputs_3d_every_axis(hdtype, mode):
    g = torch.Generator().manual_seed(1)
    for axis, shape in ((0, (32, 2, 32)), (1, (2, 32, 32)), (2, (2, 4, 32))):
        x = (torch.randn(shape, generator=g) * 5).to(hdtype).to(DEVICE)
        data, scales = tkern.to_mx(x, E4M3, axis=axis, scale_mode=mode)
        assert_bits_equal(x, E4M3, axis, mode, data, scales)


def test_strided_input_and_default_arguments():
    x = edge_values(64, 128).to(DEVICE)[:, ::2]  # a non-contiguous view
    data, scales = tkern.to_mx(x, axis=1)
    assert_bits_equal(x, E4M3, 1, "floor", data, scales)


@pytest.mark.parametrize("mode", MODES)
def test_both_casts_in_one_pass(mode):
    x = edge_values(64, 96).to(torch.bfloat16).to(DEVICE)
    data, scales, data_t, scales_t = to_mx_both(x, E4M3, scale_mode=mode)
    assert_bits_equal(x, E4M3, 1, mode, data, scales)
    assert data_t.shape == (96, 64) and data_t.is_contiguous()
    assert_bits_equal(x.t(), E4M3, 1, mode, data_t, scales_t)


def test_both_casts_into_given_tensors():
    x = edge_values(64, 96).to(torch.bfloat16).to(DEVICE)
    want = to_mx_both(x, E4M3, scale_mode="rceil")
    out = tuple(torch.empty_like(t) for t in want)
    got = to_mx_both(x, E4M3, scale_mode="rceil", out=out)
    assert all(g is o for g, o in zip(got, out, strict=True))
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.bfloat16])
def test_both_casts_and_the_column_sums_in_one_pass(sum_dtype):
    # 96 rows: a ragged last band of rows under either tile (64 interpreted, 32 compiled)
    torch.manual_seed(0)
    x = (torch.randn(96, 64) * 3).to(torch.bfloat16)
    x[5, 3], x[70, 9], x[90, 9] = float("nan"), float("inf"), float("-inf")
    x = x.to(DEVICE)
    *casts, col_sum = to_mx_both_sum(x, E4M3, scale_mode="rceil", sum_dtype=sum_dtype)
    for got, want in zip(casts, to_mx_both(x, E4M3, scale_mode="rceil"), strict=True):
        assert torch.equal(bits(got), bits(want))  # the same four casts
    assert col_sum.shape == (64,) and col_sum.dtype == sum_dtype
    ref = x.cpu().double().sum(0)
    finite = ref.isfinite()
    assert col_sum[3].isnan() and col_sum[9].isnan()  # NaN, and inf + -inf, reach the bias gradient
    assert torch.equal(finite, col_sum.cpu().isfinite())
    # fp32 accumulation (96 terms), then one rounding to sum_dtype
    err = (col_sum.cpu().double() - ref)[finite].abs()
    rounding = 2.0**-24 if sum_dtype == torch.float32 else 2.0**-8
    assert (err <= rounding * ref[finite].abs() + 96 * 2.0**-24 * x.cpu().double().abs().sum(0)[finite]).all()
    with pytest.raises(ValueError, match="sum_dtype"):
        to_mx_both_sum(x, sum_dtype=torch.int32)


def test_errors_before_launch():
    x = torch.randn(64, 48, device=DEVICE)
    with pytest.raises(ValueError, match="axis 1 has size 48.*block_size 32"):
        tkern.to_mx(x)
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2"):
        tkern.to_mx(x, torch.float16, axis=0)
    with pytest.raises(ValueError, match="scale_mode"):
        tkern.to_mx(x, axis=0, scale_mode="even")
    with pytest.raises(ValueError, match="axis must be an int"):
        tkern.to_mx(x, axis=2)
    with pytest.raises(ValueError, match="block_size"):
        tkern.to_mx(x, block_size=16)
    with pytest.raises(TypeError, match="dtype"):
        tkern.to_mx(torch.ones(64, 64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        tkern.to_mx(torch.ones(64, device=DEVICE))
    with pytest.raises(ValueError, match="axis 0 has size 48"):
        to_mx_both(x.t())
    y = torch.randn(64, 32, device=DEVICE)
    out = list(to_mx_both(y))
    out[1] = out[1].t().contiguous()  # (1, 64) where (64, 1) is written
    with pytest.raises(ValueError, match=r"out's scales must be a contiguous \(64, 1\)"):
        to_mx_both(y, out=tuple(out))


def test_compile_traces_the_op():
    x = torch.randn(64, 64, device=DEVICE)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def cast(t):
        return tkern.to_mx(t, E5M2, axis=0, scale_mode="rceil")

    data, scales = cast(x)
    assert_bits_equal(x, E5M2, 0, "rceil", data, scales)


def test_meta_inputs_get_the_casts_shapes_and_dtypes():
    # a meta tensor (a model built on the meta device, FSDP2's deferred init) takes the custom
    # op's fake implementation: the shapes and dtypes the launcher would give, no launch (the
    # launcher itself cannot read a meta tensor); bad arguments are still refused by name
    from tkern.ops.mx import to_mx_both

    x = torch.empty(64, 96, device="meta", dtype=torch.bfloat16)
    data, scales = tkern.to_mx(x, axis=0)
    assert (data.device.type, data.shape, data.dtype) == ("meta", (64, 96), torch.float8_e4m3fn)
    assert (scales.shape, scales.dtype) == ((2, 96), torch.float8_e8m0fnu)
    got = [(t.device.type, tuple(t.shape), t.dtype) for t in to_mx_both(x, E5M2)]
    want = [(64, 96), (64, 3), (96, 64), (96, 2)]
    assert got == [("meta", s, d) for s, d in zip(want, (E5M2, torch.float8_e8m0fnu) * 2, strict=True)]
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        tkern.to_mx(torch.empty(64, 95, device="meta"))
