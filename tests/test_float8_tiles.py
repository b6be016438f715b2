"""The blockwise recipe's one-read cast (issue 43 item 2 under "blockwise"):
``cast_tiles`` writes x in 1x128 tiles, x^T in 1x128 tiles along M (wgrad's operand,
K-major) and dY's bias gradient from one read. Each cast is checked bit for bit against
the two ``cast_blocks`` launches it replaces (themselves bit-exact against torchao's
per-block convention, tests/test_float8.py), the column sums against float64."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from tkern.kernels.float8 import cast_blocks, cast_tiles

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _input(m: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Columns and rows spanning six decades, so that the row tiles' and column tiles'
    scales differ from each other and across tiles."""
    torch.manual_seed(m * 1000 + k)
    x = torch.randn(m, k, device=DEVICE) * torch.logspace(-3, 3, k, device=DEVICE)
    return (x * torch.logspace(1, -1, m, device=DEVICE)[:, None]).to(dtype)


@pytest.mark.parametrize(("m", "k", "dtype"), [(130, 200, E4M3), (40, 136, E5M2)])
def test_both_layouts_bit_for_bit_the_two_block_casts(m, k, dtype):
    x = _input(m, k)
    got = cast_tiles(x, dtype, store_t=True)
    data, scale, _ = cast_blocks(x, dtype, (1, 128))
    data_t, scale_t, _ = cast_blocks(x.t(), dtype, (1, 128))
    assert torch.equal(_bits(got.data), _bits(data)) and torch.equal(got.scale, scale)
    assert torch.equal(_bits(got.data_t), _bits(data_t)) and torch.equal(got.scale_t, scale_t)
    # the scaled GEMM's layouts: per-row tiles K-block-major
    assert got.scale.stride() == scale.stride() and got.scale_t.stride() == scale_t.stride()
    assert got.col_sum is None


def test_strided_input_and_no_transpose():
    x = _input(136, 40, torch.float32).t()  # (40, 136), unit stride along M
    got = cast_tiles(x, E4M3)
    data, scale, _ = cast_blocks(x, E4M3, (1, 128))
    assert torch.equal(_bits(got.data), _bits(data)) and torch.equal(got.scale, scale)
    assert got.data_t is None and got.scale_t is None


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.bfloat16])
def test_column_sums_against_float64(sum_dtype):
    """Summed in fp32 (per band of 128 rows, the bands in order): within fp32's summation
    bound of the float64 sum, M * 2^-24 * sum |x|, plus one rounding to ``sum_dtype``."""
    x = _input(260, 136)
    got = cast_tiles(x, E4M3, store_t=True, sum_dtype=sum_dtype).col_sum
    ref = x.double().sum(0)
    assert got.dtype == sum_dtype and got.shape == (136,)
    bound = x.shape[0] * 2.0**-24 * x.double().abs().sum(0)
    rounding = ref.abs() * (2.0**-8 if sum_dtype == torch.bfloat16 else 0.0)
    assert ((got.double() - ref).abs() <= bound + rounding).all()


def test_empty_input():
    got = cast_tiles(torch.empty(0, 64, device=DEVICE, dtype=torch.bfloat16), E4M3, True, torch.bfloat16)
    assert got.data.shape == (0, 64) and got.data_t.shape == (64, 0)
    assert torch.equal(got.col_sum, torch.zeros(64, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(2, 3, 4), E4M3), "x"),
        ((torch.zeros(4, 4, dtype=torch.int32), E4M3), "x"),
        ((torch.zeros(4, 4), torch.float16), "dtype"),
        ((torch.zeros(4, 4), E4M3, False, torch.int64), "sum_dtype"),
    ],
)
def test_bad_input_is_refused(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cast_tiles(*args)
