"""tkern.matmul against a float64 reference built from the same half inputs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, rel_err, sum_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

import tkern

HALF = [torch.float16, torch.bfloat16]


def reference(a, b, bias=None, activation=None):
    out = a.double() @ b.double()
    if bias is not None:
        out = out + bias.double()
    if activation == "relu":
        out = out.relu()
    elif activation == "gelu":
        out = F.gelu(out)
    elif activation == "silu":
        out = F.silu(out)
    elif activation == "gelu_tanh":
        out = F.gelu(out, approximate="tanh")
    return out


#: Every activation the epilogue knows (see reference).
ACTIVATIONS = [None, "relu", "gelu", "silu", "gelu_tanh"]


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (17, 33, 65), (17, 65, 33), (129, 31, 96), (64, 64, 256)])
def test_shapes(dtype, M, N, K):
    a, b = randn(M, K, dtype=dtype), randn(K, N, dtype=dtype)
    out = tkern.matmul(a, b)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, reference(a, b)) < TOL[dtype]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_epilogue(dtype, bias_dtype, activation, out_dtype):
    M, N, K = 33, 47, 96
    a, b = randn(M, K, dtype=dtype), randn(K, N, dtype=dtype, scale=0.2)
    bias = None
    if bias_dtype is not None:
        bias = randn(N, dtype=dtype if bias_dtype == "same" else bias_dtype)
    out = tkern.matmul(a, b, bias=bias, activation=activation, out_dtype=out_dtype)
    expected_dtype = out_dtype or dtype
    assert out.dtype == expected_dtype
    assert rel_err(out, reference(a, b, bias, activation)) < TOL[expected_dtype]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["strided", "expanded", "fp32-strided"])
@pytest.mark.parametrize("tma", [False, True])
def test_strided_and_expanded_bias_are_read_in_place(dtype, kind, tma):
    from tkern.kernels.gemm import matmul_tma_persistent

    M, N, K = 40, 48, 32
    a, b = randn(M, K, dtype=dtype), randn(K, N, dtype=dtype, scale=0.2)
    if kind == "expanded":
        bias = randn(1, dtype=dtype).expand(N)  # stride 0: one value for every column
    else:
        bias = randn(3 * N, dtype=dtype if kind == "strided" else torch.float32)[::3]  # stride 3
    assert bias.stride(0) != 1
    out = (matmul_tma_persistent if tma else tkern.matmul)(a, b, bias=bias, activation="gelu")
    assert rel_err(out, reference(a, b, bias, "gelu")) < TOL[dtype]


@pytest.mark.parametrize("dtype", HALF)
def test_transposed_and_sliced_views_are_read_in_place(dtype):
    a = randn(47 * 3, 60, dtype=dtype)[::3, 2:58:2].t()  # (28, 47), strides (2, 180)
    b = randn(47, 70, dtype=dtype)[:, ::2]  # (47, 35), strides (70, 2)
    assert a.shape == (28, 47) and b.shape == (47, 35)
    assert not a.is_contiguous() and not b.is_contiguous()
    out = tkern.matmul(a, b)
    assert rel_err(out, reference(a, b)) < TOL[dtype]
    out_t = tkern.matmul(b.t(), a.t())  # (35, 28): both operands transposed views
    assert rel_err(out_t, reference(b.t(), a.t())) < TOL[dtype]


def test_fp32_accumulator_where_fp16_accumulation_fails():
    # 4096 ones: an fp16 running sum sticks at 2048 (2048 + 1 rounds to 2048);
    # an fp32 accumulator reaches 4096 exactly, which fp16 can also store.
    a = torch.ones(16, 4096, dtype=torch.float16, device=DEVICE)
    b = torch.ones(4096, 16, dtype=torch.float16, device=DEVICE)
    assert torch.equal(
        tkern.matmul(a, b, out_dtype=torch.float32), torch.full((16, 16), 4096.0, device=DEVICE)
    )
    assert torch.equal(tkern.matmul(a, b), torch.full((16, 16), 4096.0, dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("with_bias", [False, True])
def test_k_zero_gives_zeros_plus_bias(dtype, with_bias):
    a = torch.empty(5, 0, dtype=dtype, device=DEVICE)
    b = torch.empty(0, 7, dtype=dtype, device=DEVICE)
    bias = randn(7, dtype=dtype) if with_bias else None
    out = tkern.matmul(a, b, bias=bias, activation="relu")
    expected = torch.zeros(5, 7, dtype=dtype, device=DEVICE)
    if with_bias:
        expected = bias.float().relu().to(dtype).expand(5, 7)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("M,N", [(0, 4), (4, 0)])
def test_empty_output(M, N):
    out = tkern.matmul(
        torch.empty(M, 3, dtype=torch.float16, device=DEVICE),
        torch.empty(3, N, dtype=torch.float16, device=DEVICE),
    )
    assert out.shape == (M, N)


@settings(max_examples=12, deadline=None)
@given(
    M=st.integers(1, 70),
    N=st.integers(1, 70),
    K=st.integers(1, 150),
    transpose_a=st.booleans(),
    transpose_b=st.booleans(),
    step=st.integers(1, 3),
    dtype=st.sampled_from(HALF),
)
def test_property_random_shapes_and_strides(M, N, K, transpose_a, transpose_b, step, dtype):
    a = (
        randn(K * step, M, dtype=dtype).t()[:, ::step]
        if transpose_a
        else randn(M, K * step, dtype=dtype)[:, ::step]
    )
    b = randn(N, K, dtype=dtype).t() if transpose_b else randn(K, N * step, dtype=dtype)[:, ::step]
    assert a.shape == (M, K) and b.shape == (K, N)
    out = tkern.matmul(a, b)
    assert rel_err(out, reference(a, b)) < TOL[dtype]


# ----------------------------------------------------------------------- bad input


def h(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def test_later_launches_skip_the_autotuner_and_give_the_same_bits(monkeypatch):
    # the first launch of a key goes through triton.autotune (which picks the config),
    # the later ones call the chosen config directly; any change of key (shape, bias
    # dtype, strides) goes through the autotuner once more
    from tkern.kernels import gemm

    runs = []
    autotuner = type(gemm._matmul_kernel)
    original = autotuner.run
    monkeypatch.setattr(autotuner, "run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    monkeypatch.setattr(gemm, "_LAUNCHES", {})  # nothing resolved by earlier tests
    a, b = randn(37, 48, dtype=torch.float16), randn(48, 24, dtype=torch.float16)
    bias16, bias32 = randn(24, dtype=torch.float16), randn(24, dtype=torch.float32)
    for bias in (bias16, bias32):
        outs = [tkern.matmul(a, b, bias=bias, activation="gelu") for _ in range(3)]
        ref = (a.double() @ b.double() + bias.double()).float()
        ref = torch.nn.functional.gelu(ref)
        assert all(torch.equal(o, outs[0]) for o in outs)
        torch.testing.assert_close(outs[0].float(), ref, atol=2e-2, rtol=1e-2)
    assert len(runs) == 2  # once per key
    runs.clear()
    at = randn(48, 37, dtype=torch.float16).t()  # a new key: A's strides
    first, second = tkern.matmul(at, b), tkern.matmul(at, b)
    assert len(runs) == 1
    assert torch.equal(first, second) and torch.equal(first, tkern.matmul(at.contiguous(), b))


def test_a_replaced_kernel_sees_every_launch_even_after_one_was_resolved(monkeypatch):
    # a direct launch is kept for the kernel object it was resolved from: a patched
    # _matmul_kernel (a recorder, a stub) gets the launch, and a stub resolves nothing
    from tkern.kernels import gemm

    a, b = randn(20, 32, dtype=torch.float16), randn(32, 16, dtype=torch.float16)
    want = tkern.matmul(a, b)
    assert torch.equal(tkern.matmul(a, b), want)  # resolved by now
    real, seen = gemm._matmul_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append(args[5:8])  # M, N, K
                return real[grid](*args, **meta)

            return launch

    monkeypatch.setattr(gemm, "_matmul_kernel", Recorder())
    assert torch.equal(tkern.matmul(a, b), want) and seen == [(20, 16, 32)]
    monkeypatch.setattr(gemm, "_matmul_kernel", real)
    monkeypatch.setattr(type(real), "__getitem__", lambda self, grid: lambda *args, **meta: None)
    monkeypatch.setattr(gemm, "_LAUNCHES", {})
    tkern.matmul(a, b)  # a stubbed launch: the autotuner never ran, nothing to keep
    assert gemm._LAUNCHES == {}


@pytest.mark.parametrize(
    "mnk, ragged, route",
    [
        ((4096, 4096, 4096), False, "tma"),  # 7.8 waves of 128 x 128 tiles on 132 SMs
        ((8192, 11008, 4096), False, "tma"),
        ((8192, 4096, 2048), False, "tma"),  # 15.5 waves: K does not matter to the rule
        ((2048, 2048, 2048), False, "pointer"),  # 1.9 waves: below gemm_plan.TMA_MIN_WAVES
        ((16384, 768, 768), False, "tma"),  # GPT-2's attention projection forward: 5.8 waves
        ((768, 768, 16384), False, "split_k"),  # its wgrad: 36 tiles, K = 16384 tokens
        ((520, 1000, 264), True, "tma"),  # ragged operands: TMA at any size
    ],
)
def test_hopper_routes_gemms_by_their_plan(monkeypatch, mnk, ragged, route):
    # the routing on an H100 (132 SMs, TMA: gemm.device_gemm_info patched; no kernel
    # runs): matmul, and linear's forward and dgrad (x @ W^T, dY @ W) through the same
    # plan, and a GEMM adding into a gradient buffer (the wgrad's C +=)
    from tkern.kernels import gemm

    routes = []
    monkeypatch.setattr(gemm, "device_gemm_info", lambda device: (132, True))
    monkeypatch.setattr(
        gemm, "plan_gemm_cached", functools.lru_cache(gemm.plan_gemm_cached.__wrapped__)
    )  # a fresh memo
    monkeypatch.setattr(gemm, "launch_tma", lambda *args: routes.append("tma"))
    monkeypatch.setattr(gemm, "launch_split_k", lambda *args: routes.append("split_k"))
    monkeypatch.setattr(gemm, "_launch", lambda *args: routes.append("pointer"))
    m, n, k = mnk
    a = torch.empty(m, k + 8 if ragged else k, dtype=torch.float16, device=DEVICE)[:, :k]
    b, w = (torch.empty(*s, dtype=torch.float16, device=DEVICE) for s in ((k, n), (n, k)))
    gemm.matmul(a, b)
    gemm.linear_prechecked(a, w, None, None, None)
    gemm.matmul_backward_prechecked(a, b, None, None, None, None)
    into = torch.empty(m, n, dtype=torch.float16, device=DEVICE)
    gemm.matmul_backward_prechecked(a, b, None, None, None, None, False, into)
    assert routes == [route] * 4


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("shape", [(70, 30, 20), (0, 30, 20), (70, 0, 20), (70, 30, 0)])
def test_matmul_backward_reads_a_transposed_operand_in_place(activation, shape):
    # transpose_a (tkern.linear's wgrad dZ^T @ X): a, z and a_out are given as their
    # transposes and read through swapped strides; the same bits as on the views,
    # the empty shapes included (they take the views)
    from tkern.kernels.gemm import matmul_backward, matmul_backward_prechecked

    m, n, k = shape  # dZ (m, n) and X (m, k): dW = dZ^T @ X is (n, k), dbias (n,)
    dz, z, x = (randn(m, c, dtype=torch.float16) for c in (n, n, k))
    z = z if activation else None
    outs = [torch.full_like(dz, float("nan")) for _ in range(2)]
    sums = [torch.full((n,), float("nan"), device=DEVICE) for _ in range(2)]
    got = matmul_backward_prechecked(dz, x, activation, z, outs[0], sums[0], transpose_a=True)
    ref = matmul_backward(
        dz.t(), x, activation=activation, z=None if z is None else z.t(), a_out=outs[1].t(), a_sum=sums[1]
    )
    assert got.shape == (n, k) and torch.equal(got, ref)
    assert torch.equal(outs[0], outs[1]) and torch.equal(sums[0], sums[1])


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(a=h(4, 5), b=h(6, 3)), ValueError, ["inner dimensions", "(4, 5)", "(6, 3)"]),
        (
            dict(a=h(4, 5), b=h(5, 3, dtype=torch.bfloat16)),
            TypeError,
            ["same dtype", "float16", "bfloat16"],
        ),
        (
            dict(a=h(4, 5, dtype=torch.float32), b=h(5, 3, dtype=torch.float32)),
            TypeError,
            ["a must have dtype", "float32"],
        ),
        (dict(a=h(4, 5, 2), b=h(5, 3)), ValueError, ["a must be 2-D", "(4, 5, 2)"]),
        (dict(a=h(4, 5), b=h(5)), ValueError, ["b must be 2-D", "(5,)"]),
        (dict(a=h(4, 5), b=h(5, 3), bias=h(4)), ValueError, ["bias must have shape (3,)", "(4,)"]),
        (
            dict(a=h(4, 5), b=h(5, 3), bias=h(3, dtype=torch.bfloat16)),
            TypeError,
            ["bias must have dtype", "bfloat16"],
        ),
        (dict(a=h(4, 5), b=h(5, 3), activation="tanh"), ValueError, ["activation", "'tanh'"]),
        (dict(a=h(4, 5), b=h(5, 3), out_dtype=torch.int32), TypeError, ["out_dtype", "int32"]),
        (dict(a=[[1.0]], b=h(1, 1)), TypeError, ["a must be a torch.Tensor", "list"]),
    ],
)
def test_bad_input_raises_before_launch(kwargs, exc, words):
    a, b = kwargs.pop("a"), kwargs.pop("b")
    with pytest.raises(exc) as info:
        tkern.matmul(a, b, **kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs two devices (cpu and cuda)")
def test_tensors_on_different_devices():
    # Compiled: a CPU operand is refused by name, as on no device the kernels can run on.
    with pytest.raises(ValueError, match=r"b is on device cpu, but tkern runs compiled kernels on CUDA"):
        tkern.matmul(h(4, 5), h(5, 3).cpu())
    with pytest.raises(ValueError, match=r"bias is on device cpu"):
        tkern.matmul(h(4, 5), h(5, 3), bias=torch.zeros(3, dtype=torch.float16))


def test_cpu_and_meta_devices_differ_is_reported():
    # On any machine: a meta tensor next to a real one is a device mismatch.
    if DEVICE == "cuda":
        pytest.skip("covered by test_tensors_on_different_devices")
    with pytest.raises(ValueError, match="b is on meta but a is on cpu"):
        tkern.matmul(h(4, 5), torch.zeros(5, 3, dtype=torch.float16, device="meta"))


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled mode rejects meta tensors before this check")
@pytest.mark.parametrize(
    "a_shape, b_shape, name",
    [((70000, 40000), (40000, 8), "a"), ((8, 40000), (40000, 70000), "b"), ((50000, 16), (16, 50000), "out")],
)
def test_operands_beyond_int32_offsets_are_refused(a_shape, b_shape, name):
    # meta tensors: the shapes are real, nothing is allocated
    a = torch.empty(a_shape, dtype=torch.float16, device="meta")
    b = torch.empty(b_shape, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=rf"{name} \(shape .* spans \d+ elements; .* at most 2147483648"):
        tkern.matmul(a, b)


# ----------------------------------------------------------------------- persistent TMA variant


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("activation", [None, "gelu", "silu", "gelu_tanh"])
def test_tma_persistent_matches_float64(dtype, a_t, b_t, activation):
    from tkern.kernels.gemm import matmul_tma_persistent
    from tkern.kernels.gemm_tma import tma_eligible

    # M, N multiples of 8 so both layouts are describable; ragged against the
    # 128-row tiles; more tiles than programs, so the persistent loop turns.
    M, N, K = 264, 200, 96
    a = randn(K, M, dtype=dtype).t() if a_t else randn(M, K, dtype=dtype)
    b = randn(N, K, dtype=dtype, scale=0.2).t() if b_t else randn(K, N, dtype=dtype, scale=0.2)
    bias = randn(N, dtype=dtype)
    assert tma_eligible(a, b)
    out = matmul_tma_persistent(a, b, bias=bias, activation=activation)
    assert rel_err(out, reference(a, b, bias, activation)) < TOL[dtype]


def test_tma_persistent_falls_back_where_descriptors_cannot_go():
    from tkern.kernels.gemm import matmul_tma_persistent
    from tkern.kernels.gemm_tma import tma_eligible

    a = randn(33, 20, dtype=torch.float16)[:, ::2]  # no unit stride
    b = randn(10, 7, dtype=torch.float16)  # rows of 14 bytes: not 16-byte aligned
    assert not tma_eligible(a, b)
    assert rel_err(matmul_tma_persistent(a, b), reference(a, b)) < TOL[torch.float16]
    with pytest.raises(ValueError, match="inner dimensions differ"):
        matmul_tma_persistent(a, randn(11, 7, dtype=torch.float16))


# ----------------------------------------------------------------------- configs offered per device


def test_configs_that_cannot_launch_are_pruned_per_device():
    from tkern.kernels.gemm_configs import gemm_configs, prune_configs, smem_estimate, smem_limit, tma_configs

    for cc in (90, 80):
        for tma in (False, True):
            configs = tma_configs() if tma else gemm_configs()
            kept = prune_configs(configs, cc, tma=tma)
            assert kept and all(smem_estimate(c) <= smem_limit(cc) for c in kept)
            dropped = [c for c in configs if c not in kept]
            # dropped: over the shared memory, or (before Hopper) over 64 accumulator values a thread
            acc = [c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps) for c in dropped]
            assert all(
                smem_estimate(c) > smem_limit(cc) or (cc < 90 and a > 64)
                for c, a in zip(dropped, acc, strict=True)
            )
    # the 128x256x128 TMA tiles (288-384 KB) never fit; 128x256x64 in 4 stages fits an H100 only
    assert not [c for c in prune_configs(tma_configs(), 90, tma=True) if c.kwargs["BLOCK_K"] == 128
                and c.kwargs["BLOCK_N"] == 256]  # fmt: skip
    big = [c for c in gemm_configs() if (c.kwargs["BLOCK_N"], c.num_stages) == (256, 4)]
    assert (
        big
        and big[0] in prune_configs(gemm_configs(), 90)
        and big[0] not in prune_configs(gemm_configs(), 80)
    )


def test_ragged_operands_get_only_the_tiles_that_do_not_spill():
    from tkern.kernels.gemm_configs import (
        RAGGED_MAX_LOADS,
        RAGGED_MAX_TILE,
        gemm_configs,
        loads_per_thread,
        operands_ragged,
        prune_configs,
    )

    def loads(c):
        return loads_per_thread(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps)

    for cc in (90, 80):
        kept = prune_configs(gemm_configs(), cc, ragged=True)
        assert kept and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= RAGGED_MAX_TILE for c in kept)
        assert all(loads(c) <= RAGGED_MAX_LOADS for c in kept)
    # 64x64x64 on 4 warps loads 64 elements a thread per K step: it spilled on ragged wgrad operands
    assert [c for c in gemm_configs() if loads(c) == 64 and c.kwargs["BLOCK_K"] == 64 and c.num_warps == 4]
    assert loads_per_thread(64, 64, 64, 4) > RAGGED_MAX_LOADS >= loads_per_thread(128, 64, 32, 4)
    a, b = h(64, 1000), h(1000, 48)
    assert operands_ragged(a, b) and operands_ragged(h(64, 32), h(32, 40))
    assert not operands_ragged(h(64, 32), h(32, 48))
    assert operands_ragged(h(64, 40)[:, :32], h(32, 48))  # row stride 40


def test_large_accumulators_are_pruned_only_for_the_activations_that_spill_with_them():
    # gemm_configs.ACT_MAX_ACC: GELU's erf next to 128 accumulator values a thread spills
    # on sm_90 under triton 3.6; SiLU and tanh-GELU (one exp and one division) fit there
    # (the compile gate holds every config offered to each of them to zero spills)
    from tkern.kernels.activation import ACTIVATIONS
    from tkern.kernels.gemm_configs import (
        ACT_MAX_ACC,
        ACT_MAX_ACC_ACTIVATIONS,
        acc_per_thread,
        gemm_configs,
        prune_configs,
        tma_configs,
    )

    def acc(c):
        return acc_per_thread(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps)

    assert {ACTIVATIONS["gelu"]} == ACT_MAX_ACC_ACTIVATIONS
    plain = prune_configs(gemm_configs(), 90)
    assert max(map(acc, plain)) > ACT_MAX_ACC
    for name, code in ACTIVATIONS.items():
        kept = prune_configs(gemm_configs(), 90, activation=code)
        if name == "gelu":
            assert kept == [c for c in plain if acc(c) <= ACT_MAX_ACC]
        else:
            assert kept == plain, name
        # the TMA kernel's configs are not pruned for any activation on aligned outputs
        assert prune_configs(tma_configs(), 90, tma=True, activation=code) == prune_configs(
            tma_configs(), 90, tma=True
        )
        # on a ragged output (scalar stores) GELU keeps the TMA kernel to ACT_MAX_ACC as well
        tma_plain = prune_configs(tma_configs(), 90, tma=True, ragged=True)
        tma_kept = prune_configs(tma_configs(), 90, tma=True, ragged=True, activation=code)
        assert tma_kept == ([c for c in tma_plain if acc(c) <= ACT_MAX_ACC] if name == "gelu" else tma_plain)
        assert tma_kept, name


def test_every_config_offers_hopper_a_whole_warpgroup():
    # wgmma needs 4 warps (one warpgroup) and 64-row tiles
    from tkern.kernels.gemm_configs import gemm_configs

    assert all(c.num_warps >= 4 and c.kwargs["BLOCK_M"] >= 64 for c in gemm_configs())


# ----------------------------------------------------------------------- autotune key


def test_operand_layout_is_in_both_kernels_autotune_keys(monkeypatch):
    # a transposed weight (x @ W^T) wants other tiles than a row-major one: the
    # autotuners must not reuse one's choice for the other
    from tkern.kernels import gemm, gemm_tma

    for kernel in (gemm._matmul_kernel, gemm_tma._matmul_tma_kernel):
        assert {"A_T", "B_T"} <= set(kernel.keys)
    flags = []
    kernel = gemm._matmul_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                flags.append((meta["A_T"], meta["B_T"]))
                return kernel[grid](*args, **meta)

            return launch

    monkeypatch.setattr(gemm, "_matmul_kernel", Recorder())
    a, w = randn(32, 48, dtype=torch.float16), randn(64, 48, dtype=torch.float16)
    for x, y in ((a, w.t()), (a, w.t().contiguous()), (a.t().contiguous().t(), w.t())):
        assert rel_err(tkern.matmul(x, y), reference(x, y)) < TOL[torch.float16]
    assert flags == [(False, True), (False, False), (True, True)]


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


# --------------------------------------------------------------------------- the plan (gemm_plan.py)

#: GPT-2 small at seq 1024 x batch 16: tokens, width, the MLP's width, qkv, vocabulary.
GPT2_TOKENS, GPT2_D, GPT2_FF, GPT2_QKV, GPT2_VOCAB = 16384, 768, 3072, 2304, 50257
#: Llama-2-7B's block at 8192 tokens: width, the MLP's width (gate, up, down).
LLAMA_TOKENS, LLAMA_D, LLAMA_FF = 8192, 4096, 11008
H100_SMS = 132


def _layouts(tokens, n_out, k_in):
    """(m, n, k) of a linear layer's forward x @ W^T, dgrad dY @ W and wgrad dY^T @ X."""
    return {"fwd": (tokens, n_out, k_in), "dgrad": (tokens, k_in, n_out), "wgrad": (n_out, k_in, tokens)}


@pytest.mark.parametrize(
    "n_out, k_in", [(GPT2_QKV, GPT2_D), (GPT2_D, GPT2_D), (GPT2_FF, GPT2_D), (GPT2_D, GPT2_FF)]
)
def test_plan_at_gpt2_small_block_shapes(n_out, k_in):
    # forward and dgrad have >= 5.8 waves of 128 x 128 tiles on 132 SMs: the TMA kernel
    # (the old rule, min(M, N, K) >= 4096, never took it at width 768); the wgrads sum
    # over 16384 tokens into 36-144 tiles: split-K where the cost model finds a gain
    from tkern.kernels.gemm_plan import PLAN_BLOCK_M, SPLIT_K_ALIGN, SPLIT_K_MIN_CHUNK, plan_gemm

    plans = {
        name: plan_gemm(*mnk, H100_SMS, tma=True) for name, mnk in _layouts(GPT2_TOKENS, n_out, k_in).items()
    }
    assert plans["fwd"].kernel == plans["dgrad"].kernel == "tma"
    wgrad = plans["wgrad"]
    assert wgrad.tiles == (n_out // PLAN_BLOCK_M) * (k_in // PLAN_BLOCK_M)
    if n_out == GPT2_QKV:  # 108 tiles, 0.82 waves: a split cannot fill the last wave better
        assert (wgrad.kernel, wgrad.split_k) == ("pointer", 1)
    else:  # 36 tiles -> 3 splits (0.82 waves), 144 tiles (1.09 waves, 2 rounds) -> 4 splits
        assert wgrad.kernel == "split_k"
        assert wgrad.split_k == (3 if n_out == k_in else 4)
        assert wgrad.k_chunk % SPLIT_K_ALIGN == 0 and wgrad.k_chunk >= SPLIT_K_MIN_CHUNK
        assert (wgrad.split_k - 1) * wgrad.k_chunk < GPT2_TOKENS <= wgrad.split_k * wgrad.k_chunk
    # without TMA (Ampere) the same split; forward and dgrad on the pointer kernel
    assert plan_gemm(*_layouts(GPT2_TOKENS, n_out, k_in)["wgrad"], H100_SMS) == wgrad._replace()
    assert plan_gemm(*_layouts(GPT2_TOKENS, n_out, k_in)["fwd"], H100_SMS).kernel == "pointer"


def test_plan_at_gpt2_lm_head_and_llama_shapes():
    from tkern.kernels.gemm_plan import plan_gemm

    # the LM head: 2358-50304 tiles; its vocabulary makes the operands ragged, TMA either way
    for mnk in _layouts(GPT2_TOKENS, GPT2_VOCAB, GPT2_D).values():
        assert plan_gemm(*mnk, H100_SMS, tma=True, ragged=True).kernel == "tma"
        assert plan_gemm(*mnk, H100_SMS, tma=True).kernel == "tma"
    # Llama-2-7B's projections at 8192 tokens: >= 7.8 waves in every layout, no split
    for n_out, k_in in (
        (3 * LLAMA_D, LLAMA_D),
        (LLAMA_D, LLAMA_D),
        (2 * LLAMA_FF, LLAMA_D),
        (LLAMA_D, LLAMA_FF),
    ):
        for name, mnk in _layouts(LLAMA_TOKENS, n_out, k_in).items():
            plan = plan_gemm(*mnk, H100_SMS, tma=True)
            assert (plan.kernel, plan.split_k) == ("tma", 1), (name, mnk, plan)
    # a Llama-like width 1024 model (seq 2048 x batch 8): its wgrads have 64 and 176 tiles
    assert plan_gemm(1024, 1024, 16384, H100_SMS, tma=True).kernel == "split_k"
    # the H100-measured squares keep their faster kernel: 2048 pointer (1.9 waves), 4096 TMA
    assert plan_gemm(2048, 2048, 2048, H100_SMS, tma=True).kernel == "pointer"
    assert plan_gemm(4096, 4096, 4096, H100_SMS, tma=True).kernel == "tma"


def test_plan_rule_edges():
    from tkern.kernels.gemm_plan import SPLIT_K_MIN_GAIN, plan_gemm, split_k_time

    assert plan_gemm(768, 768, 16384, 0, tma=True).kernel == "pointer"  # no SM count: the interpreter
    assert plan_gemm(768, 768, 16384, H100_SMS, split=False).kernel == "pointer"  # bias/act: no split
    assert plan_gemm(768, 768, 1024, H100_SMS).kernel == "pointer"  # K too short for two chunks
    assert plan_gemm(0, 768, 16384, H100_SMS).kernel == "pointer"
    assert plan_gemm(520, 1000, 264, H100_SMS, tma=True, ragged=True).kernel == "tma"
    # every split taken is modelled at least SPLIT_K_MIN_GAIN faster than none, and no
    # other split count is modelled faster than the one taken
    for tiles_mn in ((128, 128), (768, 768), (2048, 768), (3072, 768), (1024, 4096)):
        for k in (2048, 8192, 16384, 65536):
            plan = plan_gemm(*tiles_mn, k, H100_SMS)
            t1 = split_k_time(plan.tiles, k, 1, H100_SMS)
            if plan.kernel == "split_k":
                t = split_k_time(plan.tiles, k, plan.split_k, H100_SMS)
                assert t <= SPLIT_K_MIN_GAIN * t1
                assert all(
                    split_k_time(plan.tiles, k, s, H100_SMS) >= t - 1e-12 for s in range(2, plan.split_k)
                )


def test_plans_are_remembered_for_a_bounded_number_of_shapes(monkeypatch):
    # the hot path's memo keeps the last PLAN_CACHE_SIZE shapes (a varying sequence length
    # must not grow it without end) and answers what plan_gemm answers
    from tkern.kernels import gemm
    from tkern.kernels.gemm_plan import plan_gemm

    assert gemm.plan_gemm_cached.cache_info().maxsize == gemm.PLAN_CACHE_SIZE
    memo = functools.lru_cache(maxsize=gemm.PLAN_CACHE_SIZE)(gemm.plan_gemm_cached.__wrapped__)
    for m in range(1, gemm.PLAN_CACHE_SIZE + 17):
        assert memo(m, 768, 3072, H100_SMS, True, m % 16 != 0, True) == plan_gemm(
            m, 768, 3072, H100_SMS, tma=True, ragged=m % 16 != 0
        )
    assert memo.cache_info().currsize == gemm.PLAN_CACHE_SIZE


# --------------------------------------------------------------------------- split-K (gemm_split.py)


def _fp32_tol(k: int) -> float:
    """Relative norm-wise error of an fp32 result: half x half products are exact, the fp32
    sums of k terms (in any order: K tiles, then the ranges' partials) err ~sqrt(k) 2^-24 each."""
    return 4 * k**0.5 * 2.0**-24


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_split_k_matches_float64_and_is_deterministic(dtype, out_dtype, transpose_a):
    # K = 1000 in 3 ranges of 384 (the last 232, not a multiple of BLOCK_K); a read in
    # place as the wgrad's dZ^T (transpose_a); its row sums (dbias) summed per range
    from tkern.kernels.gemm_split import launch_split_k

    m, n, k = 70, 50, 1000
    a_store = randn(k, m, dtype=dtype) if transpose_a else randn(m, k, dtype=dtype)
    a = a_store.t() if transpose_a else a_store
    b = randn(k, n, dtype=dtype, scale=0.2)
    out_dtype = out_dtype or dtype
    sums = [torch.full((m,), float("nan"), device=DEVICE) for _ in range(2)]
    outs = [launch_split_k(a, a.stride(), b, m, n, k, 3, 384, out_dtype, sums[i]) for i in range(2)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(sums[0], sums[1])  # ordered: the same bits
    tol = _fp32_tol(k) if out_dtype == torch.float32 else TOL[dtype]
    assert outs[0].dtype == out_dtype and rel_err(outs[0], reference(a, b)) < tol
    ref_sums = a.double().sum(1)
    assert ((sums[0].double() - ref_sums).abs() <= sum_tolerance(a, 1, torch.float32).double()).all()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_k_writes_or_adds_into_a_strided_tensor(dtype, accumulate):
    # the wgrad into a flat gradient buffer: a strided (M, N) view, C += (one rounding of
    # C + the fp32 sum of the partials) or written; the rest of the buffer untouched
    from tkern.kernels.gemm_split import launch_split_k

    m, n, k = 40, 30, 640
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype, scale=0.2)
    buf = randn(m, n + 6, dtype=dtype)
    c, buf0 = buf[:, 3 : 3 + n], buf.clone()
    assert launch_split_k(a, a.stride(), b, m, n, k, 2, 384, dtype, None, c, accumulate) is c
    want = reference(a, b) + (buf0[:, 3 : 3 + n].double() if accumulate else 0)
    assert rel_err(c, want) < TOL[dtype]
    assert torch.equal(buf[:, :3], buf0[:, :3]) and torch.equal(buf[:, 3 + n :], buf0[:, 3 + n :])


def test_split_k_refuses_ranges_that_do_not_cover_k():
    from tkern.kernels.gemm_split import launch_split_k

    a, b = randn(8, 1000, dtype=torch.float16), randn(1000, 8, dtype=torch.float16)
    for splits, chunk in ((2, 384), (4, 384), (3, 300)):
        with pytest.raises(ValueError, match="split-K needs K ranges"):
            launch_split_k(a, a.stride(), b, 8, 8, 1000, splits, chunk, torch.float16)


def _linear_reference(x, w, b, activation, dy):
    """dX, dW, db of ``act(x @ W^T + b)`` in float64 from the same half-precision values."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    bd = None if b is None else b.detach().double().requires_grad_()
    y = F.linear(*leaves, bd)
    (y.relu() if activation == "relu" else y).backward(dy.double())
    return leaves[0].grad, leaves[1].grad, None if bd is None else bd.grad


def _gpu_without_tma(monkeypatch, sms=4, tma=False):
    """gemm's device seam patched: a GPU of ``sms`` SMs (with TMA or not); the kernels still
    run through the interpreter. Returns the list the launches routed append to."""
    from tkern.kernels import gemm

    routes = []
    launch_tma, launch_split_k, launch = gemm.launch_tma, gemm.launch_split_k, gemm._launch
    monkeypatch.setattr(gemm, "device_gemm_info", lambda device: (sms, tma))
    monkeypatch.setattr(
        gemm, "plan_gemm_cached", functools.lru_cache(gemm.plan_gemm_cached.__wrapped__)
    )  # a fresh memo
    monkeypatch.setattr(gemm, "launch_tma", lambda *args: routes.append("tma") or launch_tma(*args))
    monkeypatch.setattr(
        gemm, "launch_split_k", lambda *args: routes.append("split_k") or launch_split_k(*args)
    )
    monkeypatch.setattr(gemm, "_launch", lambda *args: routes.append("pointer") or launch(*args))
    return routes


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", [None, "relu"])
def test_linear_wgrad_over_many_tokens_takes_split_k(dtype, activation, monkeypatch):
    # a GPU of 4 SMs: the wgrad dY^T @ X over 2048 tokens has one 128 x 128 tile, so
    # it is split in 4 K ranges (gemm_plan), dbias summed in the ranges; forward and
    # dgrad stay on the pointer kernel (ReLU's act' in dgrad's prologue). Gradients
    # against float64.
    routes = _gpu_without_tma(monkeypatch)
    tokens, k_in, n_out = 2048, 48, 64
    x = randn(tokens, k_in, dtype=dtype).requires_grad_()
    w = randn(n_out, k_in, dtype=dtype, scale=k_in**-0.5).requires_grad_()
    b = randn(n_out, dtype=dtype).requires_grad_()
    y = tkern.linear(x, w, b, activation)
    dy = randn(*y.shape, dtype=dtype)
    y.backward(dy)
    assert routes == ["pointer", "pointer", "split_k"]
    rdx, rdw, rdb = _linear_reference(x, w, b, activation, dy)
    assert rel_err(x.grad, rdx) < 2 * TOL[dtype]
    assert rel_err(w.grad, rdw) < 2 * TOL[dtype]
    assert rel_err(b.grad, rdb) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", HALF)
def test_split_k_wgrad_adds_into_the_flat_gradient_buffer(dtype, monkeypatch, wgrad_counts):
    # the fused optimizer's flat buffer receives the split-K wgrad in place (the reduce
    # pass's C +=), two micro-batches, against the unfused path's gradients
    from tkern.ops import common
    from tkern.optim import FusedAdamW

    routes = _gpu_without_tma(monkeypatch)

    def run(fused):
        torch.manual_seed(0)
        layer = tkern.nn.Linear(48, 64).to(device=DEVICE, dtype=dtype)
        opt = FusedAdamW(layer.parameters(), lr=1e-3)  # noqa: F841 (kept: its buffer holds the grads)
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(common, "flat_wgrad", lambda *args: None)
            for seed in (1, 2):
                g = torch.Generator().manual_seed(seed)
                x = torch.randn(2048, 48, generator=g).to(device=DEVICE, dtype=dtype)
                layer(x).float().square().mean().backward()
        return layer.weight.grad.clone(), layer.bias.grad.clone()

    fused, ref = run(True), run(False)
    assert wgrad_counts["into"] == 2 and routes.count("split_k") == 4
    tol = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]  # one rounding of the sum a step
    for got, want in zip(fused, ref, strict=True):
        assert rel_err(got, want) < 2 * tol


# --------------------------------------------------------------------------- the LM head's aligned backward


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias", [False, True])
def test_lm_head_backward_takes_the_tma_kernel_over_an_odd_vocabulary(dtype, bias, monkeypatch):
    # Hopper (TMA; 132 SMs): dlogits over 101 classes have a row stride of 202 bytes, which
    # no tensor descriptor can describe; the backward copies them once with aligned rows
    # (gemm.tma_aligned_rows) so that dgrad and wgrad both take the TMA kernel, like the
    # forward (ragged N), instead of the pointer kernel's scalar loads
    import tkern.ops.linear as ops_linear
    from tkern.kernels import gemm

    routes = _gpu_without_tma(monkeypatch, sms=H100_SMS, tma=True)
    aligned = []
    real = gemm.tma_aligned_rows
    monkeypatch.setattr(ops_linear, "tma_aligned_rows", lambda t: aligned.append(real(t)) or aligned[-1])
    tokens, d, vocab = 40, 32, 101
    x = randn(tokens, d, dtype=dtype).requires_grad_()
    w = randn(vocab, d, dtype=dtype, scale=d**-0.5).requires_grad_()
    b = randn(vocab, dtype=dtype).requires_grad_() if bias else None
    logits = tkern.linear(x, w, b)
    dlogits = randn(tokens, vocab, dtype=dtype)
    assert dlogits.stride(0) * dlogits.element_size() % 16  # the unaligned rows this is about
    logits.backward(dlogits)
    assert routes == ["tma"] * 3
    (dz,) = aligned
    assert dz.stride() == (gemm.ROW_ALIGN_ELEMS * 2, 1) and torch.equal(dz, dlogits)
    rdx, rdw, rdb = _linear_reference(x, w, b, None, dlogits)
    assert rel_err(x.grad, rdx) < 2 * TOL[dtype]
    assert rel_err(w.grad, rdw) < 2 * TOL[dtype]
    if bias:
        assert rel_err(b.grad, rdb) < 2 * TOL[dtype]
    # an aligned operand, or a device without TMA, is passed through untouched
    assert real(dz) is dz
    monkeypatch.setattr(gemm, "device_gemm_info", lambda device: (H100_SMS, False))
    assert real(dlogits) is dlogits


# --------------------------------------------------------------------------- the TMA-store epilogue


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("accumulate", [False, True])
def test_tma_kernel_stores_c_through_a_descriptor_where_it_can(dtype, accumulate, monkeypatch):
    # C with 16-byte aligned rows: the TMA-store epilogue (C read through the descriptor
    # too for C +=; bias + GELU in column slices otherwise), its ragged tile edges (M = 200,
    # N = 136 on 128 x 128 tiles) clipped by the descriptor; C with unaligned rows (a
    # view into a wider buffer) keeps the pointer epilogue. Both against float64.
    from tkern.kernels import gemm_tma

    seen = []

    def recorder(real):
        class Recorder:
            def __getitem__(self, grid):
                return lambda *args, **meta: seen.append(meta["C_TMA"]) or real[grid](*args, **meta)

        return Recorder()

    for name in ("_matmul_tma_kernel", "_matmul_tma_accumulate_kernel"):
        monkeypatch.setattr(gemm_tma, name, recorder(getattr(gemm_tma, name)))
    m, k, n = 200, 96, 136
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype, scale=0.2)
    bias, act = (None, None) if accumulate else (randn(n, dtype=dtype), "gelu")
    layouts = gemm_tma.tma_layouts(a, b)
    aligned = randn(m, n, dtype=dtype)
    buf = randn(m, n + 3, dtype=dtype)  # rows of 278 / 139 * 2 bytes: no descriptor
    ragged, buf0 = buf[:, :n], buf.clone()
    for c in (aligned, ragged):
        c0 = c.clone()
        out = gemm_tma.launch_tma(a, b, m, n, k, bias, act, dtype, None, layouts, c, accumulate)
        want = reference(a, b, bias, act) + (c0.double() if accumulate else 0)
        assert out is c and rel_err(c, want) < TOL[dtype]
    assert torch.equal(buf[:, n:], buf0[:, n:])  # nothing stored beyond the view
    fresh = gemm_tma.launch_tma(a, b, m, n, k, bias, act, dtype, None, layouts)  # a new C: aligned
    assert rel_err(fresh, reference(a, b, bias, act)) < TOL[dtype]
    assert seen == [True, False, True]


def test_aligned_rows_copy_traces_on_fake_tensors(monkeypatch):
    # tkern.linear's traced backward (torch.compile) runs tma_aligned_rows on FakeTensors,
    # which have no data pointer: the copy is decided from strides and offsets alone
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tkern.kernels import gemm

    monkeypatch.setattr(gemm, "device_gemm_info", lambda device: (H100_SMS, True))
    with FakeTensorMode():
        t = torch.empty(40, 101, dtype=torch.float16)
        out = gemm.tma_aligned_rows(t)
        assert out.shape == t.shape and out.stride() == (2 * gemm.ROW_ALIGN_ELEMS, 1)
        assert gemm.tma_aligned_rows(out) is out
        offset = torch.empty(40, 136, dtype=torch.float16)[:, 1:]  # aligned stride, unaligned start
        assert gemm.tma_aligned_rows(offset) is not offset
