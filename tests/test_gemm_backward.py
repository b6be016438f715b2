"""tkern's GEMM in the backward: the operand prologue (an activation's gradient applied
to an operand as it is loaded, the bias gradient summed beside) and the wgrad's ``C +=``
into a gradient buffer, against float64 references built from the same half inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, TOL, rel_err, sum_tolerance
from test_gemm import HALF, h, randn

import tkern

# ----------------------------------------------------------------------- the backward's operand prologue


def _prologue_reference(a, z, activation):
    from tkern.kernels.activation import activation_grad

    return a if activation is None else activation_grad(a, z, activation)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("layout", ["dgrad", "wgrad"])
def test_matmul_backward_prologue_is_bit_identical_to_the_separate_pass(dtype, activation, layout):
    # dgrad: dY (M, N) @ W; wgrad: dY^T (N, M) @ X with Z^T read in place. Ragged sizes,
    # two column blocks (only the first stores A' and the sums), three K steps in wgrad.
    from tkern.kernels.gemm import matmul_backward

    m, n, k = 300, 140, 150
    dy, z = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype)
    b = randn(n, k, dtype=dtype) if layout == "dgrad" else randn(m, k, dtype=dtype)
    if layout == "wgrad":
        dy, z = dy.t(), z.t()
    dz = _prologue_reference(dy, z, activation)
    a_out = torch.full_like(dy, float("nan"))
    a_sum = torch.empty(dy.shape[0], dtype=torch.float32, device=DEVICE)
    out = matmul_backward(dy, b, activation=activation, z=z, a_out=a_out, a_sum=a_sum)
    assert torch.equal(out, tkern.matmul(dz, b))  # the same dot on the same operand
    assert torch.equal(a_out, dz)  # every element written once, as the pass rounds it
    ref = dz.float().sum(1)
    assert ((a_sum - ref).abs() <= sum_tolerance(dz, 1, torch.float32)).all()


@pytest.mark.parametrize("sum_dtype", [torch.float32, "same"])
def test_matmul_backward_sums_a_plain_or_expanded_operand(sum_dtype):
    # no activation: wgrad of a linear without one, dbias from dY^T; an expanded dY
    # (from y.sum()) is read in place with stride 0
    from tkern.kernels.gemm import matmul_backward

    dtype = torch.bfloat16
    sum_dtype = dtype if sum_dtype == "same" else sum_dtype
    for dy in (randn(77, 50, dtype=dtype), randn(1, 1, dtype=dtype).expand(77, 50)):
        x = randn(77, 33, dtype=dtype)
        a_sum = torch.empty(50, dtype=sum_dtype, device=DEVICE)
        out = matmul_backward(dy.t(), x, a_sum=a_sum)
        assert torch.equal(out, tkern.matmul(dy.t(), x))
        ref = dy.float().sum(0)
        assert a_sum.dtype == sum_dtype
        assert ((a_sum.float() - ref).abs() <= sum_tolerance(dy.t(), 1, sum_dtype)).all()


@pytest.mark.parametrize("shape", [(5, 8, 0), (0, 8, 6), (5, 0, 6)])
def test_matmul_backward_without_output_tiles_still_writes_the_operand(shape):
    # N == 0 (x without features): no program runs, yet dZ and dbias are owed
    from tkern.kernels.gemm import matmul_backward

    m, k, n = shape
    dy, z = randn(m, k, dtype=torch.float16), randn(m, k, dtype=torch.float16)
    a_out, a_sum = torch.full_like(dy, float("nan")), torch.full((m,), float("nan"), device=DEVICE)
    out = matmul_backward(
        dy, randn(k, n, dtype=torch.float16), activation="gelu", z=z, a_out=a_out, a_sum=a_sum
    )
    dz = _prologue_reference(dy, z, "gelu")
    assert out.shape == (m, n) and torch.equal(a_out, dz)
    assert ((a_sum - dz.float().sum(1)).abs() <= sum_tolerance(dz, 1, torch.float32)).all()


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(activation="relu"), ValueError, ["z (the pre-activation)", "'relu'"]),
        (dict(z=h(4, 5)), ValueError, ["z (the pre-activation)", "None"]),
        (dict(activation="relu", z=h(5, 4).t()), ValueError, ["z must have a's shape", "strides (1, 4)"]),
        (dict(activation="relu", z=h(4, 5, dtype=torch.bfloat16)), TypeError, ["z must have dtype"]),
        (dict(a_out=h(4, 6)), ValueError, ["a_out must have a's shape (4, 5)", "(4, 6)"]),
        (dict(a_sum=h(5)), ValueError, ["a_sum must be a contiguous (4,) tensor", "(5,)"]),
        (dict(a_sum=h(4, dtype=torch.bfloat16)), TypeError, ["a_sum must have dtype", "bfloat16"]),
        (dict(activation="swish", z=h(4, 5)), ValueError, ["activation", "'swish'"]),
    ],
)
def test_matmul_backward_bad_input_raises_before_launch(kwargs, exc, words):
    from tkern.kernels.gemm import matmul_backward

    with pytest.raises(exc) as info:
        matmul_backward(h(4, 5), h(5, 3), **kwargs)
    for word in words:
        assert word in str(info.value)


def test_matmul_backward_refuses_to_overwrite_its_operand():
    # other programs still read A's tiles while column block 0 writes A'
    from tkern.kernels.gemm import matmul_backward

    a = h(4, 5)
    with pytest.raises(ValueError, match="a_out must not share memory with a or z"):
        matmul_backward(a, h(5, 3), a_out=a)


def test_prologue_activation_is_in_the_autotune_key_and_its_outputs_are_not():
    # A_ACT prunes the configs (gemm_configs.PROLOGUE_MAX_ACC): a config tuned for a plain
    # launch of the same shape may spill with the prologue, so the two must not share
    # a choice. STORE_A / SUM_A prune nothing and add work to column block 0 only (one
    # store or one row sum of a tile already loaded): they leave the ranking alone.
    from tkern.kernels import gemm

    assert "A_ACT" in gemm._matmul_kernel.keys
    assert not {"STORE_A", "SUM_A"} & set(gemm._matmul_kernel.keys)


def test_prologue_configs_are_pruned_by_their_named_rules():
    from tkern.kernels.activation import ACTIVATIONS
    from tkern.kernels.gemm_configs import (
        PROLOGUE_ACT_MAX_A,
        PROLOGUE_ACT_PRE_HOPPER_MAX_ACC,
        PROLOGUE_MAX_ACC,
        RAGGED_MAX_LOADS,
        acc_per_thread,
        gemm_configs,
        loads_per_thread,
        prune_configs,
    )

    def tiles(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps

    relu, gelu = ACTIVATIONS["relu"], ACTIVATIONS["gelu"]
    configs = gemm_configs()
    for cc in (90, 80):
        plain = prune_configs(configs, cc)
        with_relu = prune_configs(configs, cc, prologue=relu)
        with_gelu = prune_configs(configs, cc, prologue=gelu)
        assert set(map(id, with_gelu)) <= set(map(id, with_relu)) <= set(map(id, plain))
        assert with_gelu and all(
            acc_per_thread(*tiles(c)[:2], c.num_warps) <= PROLOGUE_MAX_ACC for c in with_relu
        )
        for c in with_gelu:
            bm, bn, bk, w = tiles(c)
            assert bm * bk // (32 * w) <= PROLOGUE_ACT_MAX_A
            assert cc >= 90 or acc_per_thread(bm, bn, w) <= PROLOGUE_ACT_PRE_HOPPER_MAX_ACC
        # ragged operands: Z's scalar loads count beside A's and B's
        for c in prune_configs(configs, cc, ragged=True, prologue=relu):
            bm, bn, bk, w = tiles(c)
            assert loads_per_thread(2 * bm, bn, bk, w) <= RAGGED_MAX_LOADS
    # the 128-value tiles spill with a prologue on Hopper; 128x128 on 8 warps (64) is kept for ReLU
    big = [c for c in configs if acc_per_thread(*tiles(c)[:2], c.num_warps) > PROLOGUE_MAX_ACC]
    assert big and not set(map(id, big)) & set(map(id, prune_configs(configs, 90, prologue=relu)))


# ----------------------------------------------------------------------- C += (the wgrad into a buffer)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("strided", [False, True])
def test_matmul_backward_accumulates_into_a_tensor(dtype, activation, strided):
    # C += A' @ B in the epilogue: C read in fp32 and the sum rounded once, so against
    # float64 it is within the GEMM's own tolerance; a strided C (a column slice of a
    # wider buffer) is written in place and its neighbours are left alone
    from tkern.kernels.activation import activation_grad
    from tkern.kernels.gemm import matmul_backward

    m, k, n = 37, 70, 45
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype, scale=0.2)
    z = randn(m, k, dtype=dtype) if activation else None
    buf = randn(m, n + 9, dtype=dtype)
    c = buf[:, 4 : 4 + n] if strided else buf[:, :n].contiguous()
    c0, buf0 = c.clone(), buf.clone()
    out = matmul_backward(a, b, activation=activation, z=z, accumulate_into=c)
    assert out is c
    ap = a if activation is None else activation_grad(a, z, activation)
    assert rel_err(c, c0.double() + ap.double() @ b.double()) < TOL[dtype]
    if strided:
        assert torch.equal(buf[:, :4], buf0[:, :4]) and torch.equal(buf[:, 4 + n :], buf0[:, 4 + n :])


@pytest.mark.parametrize("dtype", HALF)
def test_accumulating_into_zeros_is_bit_identical_to_a_new_product(dtype):
    # 0 + x == x in fp32: a zeroed gradient buffer gets exactly the bits of a fresh wgrad
    # (what training without the fused accumulation would have); dZ^T read in place
    from tkern.kernels.gemm import matmul_backward_prechecked

    dz, x = randn(50, 33, dtype=dtype), randn(50, 21, dtype=dtype)
    fresh = matmul_backward_prechecked(dz, x, None, None, None, None, True)
    into = torch.zeros(33, 21, dtype=dtype, device=DEVICE)
    assert matmul_backward_prechecked(dz, x, None, None, None, None, True, into) is into
    assert torch.equal(into, fresh)


@pytest.mark.parametrize("dtype", HALF)
def test_the_tma_kernel_accumulates_into_a_tensor(dtype):
    # Hopper's large wgrads take the TMA kernel (gemm.TMA_MIN_DIM): same C += epilogue
    from tkern.kernels.gemm_tma import launch_tma, tma_layouts

    m, k, n = 264, 96, 200
    a, b = randn(k, m, dtype=dtype).t(), randn(k, n, dtype=dtype, scale=0.2)  # dZ^T read in place
    c = randn(m, n, dtype=dtype)
    c0 = c.clone()
    out = launch_tma(a, b, m, n, k, None, None, dtype, None, tma_layouts(a, b), c)
    assert out is c
    assert rel_err(c, c0.double() + a.double() @ b.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", HALF)
def test_matmul_backward_writes_into_out(dtype):
    # out=: the product written into a given tensor (a strided slice here), the same
    # bits as a new one; out and accumulate_into together are refused
    from tkern.kernels.gemm import matmul_backward

    a, b = randn(37, 70, dtype=dtype), randn(70, 45, dtype=dtype, scale=0.2)
    buf = randn(37, 54, dtype=dtype)
    out, buf0 = buf[:, 4:49], buf.clone()
    assert matmul_backward(a, b, out=out) is out
    assert torch.equal(out, matmul_backward(a, b))
    assert torch.equal(buf[:, :4], buf0[:, :4]) and torch.equal(buf[:, 49:], buf0[:, 49:])
    with pytest.raises(ValueError, match="give out or accumulate_into, not both"):
        matmul_backward(a, b, out=out, accumulate_into=out.clone())
    with pytest.raises(ValueError, match=r"out must have shape \(37, 45\), got \(45, 37\)"):
        matmul_backward(a, b, out=out.t())
    with pytest.raises(ValueError, match="out must not share memory"):
        matmul_backward(a, b, out=a[:, :45])


def test_accumulate_into_bad_input_raises_before_launch():
    from tkern.kernels.gemm import matmul_backward

    a, b = h(4, 5), h(5, 3)
    cases = [
        (h(3, 4), ValueError, "accumulate_into must have shape (4, 3), got (3, 4)"),
        (h(4, 3, dtype=torch.bfloat16), TypeError, "accumulate_into must have dtype"),
        (h(12), ValueError, "accumulate_into must be 2-D"),
        (h(4, 3).t(), ValueError, "accumulate_into must have shape (4, 3), got (3, 4)"),
        (a[:, :3], ValueError, "accumulate_into must not share memory"),
        (b.view(-1)[:12].view(4, 3), ValueError, "accumulate_into must not share memory"),
    ]
    for into, exc, words in cases:
        before = into.clone()
        with pytest.raises(exc) as info:
            matmul_backward(a, b, accumulate_into=into)
        assert words in str(info.value)
        assert torch.equal(into, before)
