"""tkern.matmul against a float64 reference built from the same half inputs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, rel_err
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


def test_gemm_module_names_both_config_tables():
    """gemm.py is the family's front door: the pointer and the TMA kernels' config tables are read
    through it (/work/shared/tools/aot_report.py counts both as gemm.gemm_configs / gemm.tma_configs)."""
    import triton

    from tkern.kernels import gemm, gemm_configs

    assert gemm.gemm_configs is gemm_configs.gemm_configs
    assert gemm.tma_configs is gemm_configs.tma_configs
    tma = gemm.tma_configs()
    assert tma and all(isinstance(c, triton.Config) for c in tma)
    # every TMA config carries the pre-hook that gives the descriptors its block shape
    assert all(c.pre_hook is gemm_configs.set_tma_block_shapes for c in tma)
    assert {c.kwargs["BLOCK_M"] for c in tma} == {128}


def test_configs_that_cannot_launch_are_pruned_per_device():
    from tkern.kernels.gemm_configs import (
        TMA_MIN_BLOCK_N,
        gemm_configs,
        prune_configs,
        smem_estimate,
        smem_limit,
        tma_configs,
    )

    for cc in (90, 80):
        for tma in (False, True):
            configs = tma_configs() if tma else gemm_configs()
            kept = prune_configs(configs, cc, tma=tma)
            assert kept and all(smem_estimate(c) <= smem_limit(cc) for c in kept)
            dropped = [c for c in configs if c not in kept]
            # dropped: over the shared memory, (before Hopper) over 64 accumulator values a
            # thread, or the TMA kernel's narrow tile (kept for ragged GELU outputs alone)
            acc = [c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps) for c in dropped]
            assert all(
                smem_estimate(c) > smem_limit(cc)
                or (cc < 90 and a > 64)
                or (tma and c.kwargs["BLOCK_N"] < TMA_MIN_BLOCK_N)
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
