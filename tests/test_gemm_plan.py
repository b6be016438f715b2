"""The GEMM plan (gemm_plan.py: which kernel, how many K splits, at GPT-2's and Llama's
shapes), split-K (gemm_split.py), the LM head's aligned backward and the TMA kernel's
store epilogue, against float64 references built from the same half inputs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TOL, rel_err, sum_tolerance
from test_gemm import HALF, randn, reference

import tkern

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
    # C + the fp32 sum of the partials) or written; the rest of the buffer untouched. The
    # row sums (dbias) likewise into the bias's view: added (ADD_SUM) or written
    from tkern.kernels.gemm_split import launch_split_k

    m, n, k = 40, 30, 640
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype, scale=0.2)
    buf = randn(m, n + 6, dtype=dtype)
    c, buf0 = buf[:, 3 : 3 + n], buf.clone()
    sums = randn(m, dtype=dtype)
    sums0 = sums.clone()
    assert launch_split_k(a, a.stride(), b, m, n, k, 2, 384, dtype, sums, c, accumulate, accumulate) is c
    want = reference(a, b) + (buf0[:, 3 : 3 + n].double() if accumulate else 0)
    assert rel_err(c, want) < TOL[dtype]
    assert torch.equal(buf[:, :3], buf0[:, :3]) and torch.equal(buf[:, 3 + n :], buf0[:, 3 + n :])
    want_sums = a.double().sum(1) + (sums0.double() if accumulate else 0)
    # the fp32 sum's own error, then one rounding to the bias's dtype
    tol = sum_tolerance(a, 1, torch.float32).double() + TOL[dtype] * want_sums.abs()
    assert ((sums.double() - want_sums).abs() <= tol).all()


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
    # weight and bias each micro-batch: the second adds dbias into the bias's view (ADD_SUM)
    assert wgrad_counts["into"] == 4 and routes.count("split_k") == 4
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
