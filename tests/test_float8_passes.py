"""What one Float8Linear step launches (issue 43 items 1, 2 and 4), counted through
Triton's interpreter: every fp8 GEMM operand K-major (each cast writes the layouts its
GEMMs read), one pass per cast (delayed scaling records its amax inside the cast's
launch; dY's cast writes dY, dY^T and the bias gradient together), the gradient GEMMs
promoting their accumulators (the forward's fast accumulation kept).

Triton launches are counted on the interpreter's ``InterpretedFunction.run`` (every
launcher, autotuned or direct, ends there); torch's own kernels through a
``TorchDispatchMode`` that leaves out what launches nothing (allocations, views)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import tkern
from tkern.device import SPECS
from tkern.kernels import float8 as f8
from tkern.kernels import gemm
from tkern.kernels.activation import ACTIVATIONS
from tkern.nn import Float8Linear
from tkern.nn.float8 import float8_forward

pytestmark = pytest.mark.skipif(not tkern.INTERPRET, reason="counts launches through Triton's interpreter")

#: aten ops that launch no kernel: allocations, views, metadata.
NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view",
    "t", "transpose", "permute", "expand", "as_strided", "reshape", "alias", "detach", "slice", "select",
    "unsqueeze", "squeeze", "lift_fresh", "_reshape_alias", "unbind", "split",
}  # fmt: skip


class _Recorder(TorchDispatchMode):
    """torch ops that launch kernels: (name, whether an argument shares dY's storage)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, bool]] = []
        self.watch: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            tensors = [
                a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
            ]
            reads_dy = any(t.numel() and t.untyped_storage().data_ptr() in self.watch for t in tensors)
            self.ops.append((name, reads_dy))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, its keyword meta) of every Triton launch, run outside the dispatch mode
    (the interpreter's own copies are not the step's torch ops)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, dict]] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        seen.append((self.fn.__name__, {**kwargs, "args": args}))
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    return seen


def _step(layer, opt, x):
    """One training step; returns (forward launches, forward torch ops, backward launches,
    backward torch ops) of the step after the optimizer has cast the weight once."""
    opt.zero_grad()
    y = layer(x)
    y.float().sum().backward()
    opt.step()


def _measure(layer, x, launches):
    rec = _Recorder()
    xg = x.clone().requires_grad_()
    launches.clear()
    with rec:
        y = layer(xg)
    forward = (list(launches), list(rec.ops))
    launches.clear()
    rec.ops.clear()
    g = torch.randn_like(y)
    y.register_hook(lambda dy: rec.watch.add(dy.untyped_storage().data_ptr()))
    with rec:
        y.backward(g)
    return forward, (list(launches), list(rec.ops))


#: recipe -> (forward launches, backward launches) at most, with the optimizer's weight cast
BUDGET = {"tensorwise": (3, 4), "delayed": (2, 4)}


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_one_step_launches_within_the_budget_and_no_torch_op_over_dy(recipe, launches):
    torch.manual_seed(0)
    layer = Float8Linear(256, 384, bias=True, recipe=recipe, device=DEVICE)
    opt = tkern.optim.FusedAdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(256, 256, device=DEVICE).to(torch.bfloat16)
    _step(layer, opt, x)  # the step casts the weight for the next forward
    (fwd, fwd_ops), (bwd, bwd_ops) = _measure(layer, x, launches)
    names = [n for n, _ in fwd]
    assert len(fwd) <= BUDGET[recipe][0], names
    assert names.count("_matmul_kernel") == 1 and "_roll_history_kernel" not in names, names
    assert not fwd_ops, f"torch kernels in the forward: {fwd_ops}"
    assert len(bwd) <= BUDGET[recipe][1], [n for n, _ in bwd]
    assert [n for n, _ in bwd].count("_matmul_kernel") == 2  # dgrad and wgrad
    over_dy = [name for name, reads in bwd_ops if reads]
    assert not over_dy, f"torch ops over dY in the backward: {over_dy}"
    # delayed: one launch per cast, the history rolled inside it (cast, GEMM | cast, 2 GEMMs)
    if recipe == "delayed":
        assert len(fwd) == 2 and len(bwd) == 3


def test_blockwise_step_reads_x_and_dy_once(launches):
    """Blockwise (weights not cached by the optimizer): forward = x's tile cast (x and x^T
    in one read), W's block cast (W and W^T), the GEMM; backward = dY's tile cast (dY, dY^T
    and the bias gradient's per-band sums in one read), dgrad, wgrad. No torch op over x or
    dY: the bias gradient's last sum is over the (M / 128, N) band sums."""
    torch.manual_seed(0)
    layer = Float8Linear(256, 384, bias=True, recipe="blockwise", device=DEVICE)
    x = torch.randn(256, 256, device=DEVICE).to(torch.bfloat16)
    f8.fp8_constants(torch.float8_e4m3fn)  # computed once per process on the CPU, then cached
    (fwd, fwd_ops), (bwd, bwd_ops) = _measure(layer, x, launches)
    fwd_names, bwd_names = [n for n, _ in fwd], [n for n, _ in bwd]
    assert fwd_names.count("_cast_tiles_kernel") == 1 and "_cast_blocks_kernel" in fwd_names, fwd_names
    assert len(fwd) == 3 and not fwd_ops, (fwd_names, fwd_ops)
    assert bwd_names.count("_cast_tiles_kernel") == 1 and len(bwd) == 3, bwd_names
    assert [meta["COL_SUM"] and meta["STORE_T"] for n, meta in bwd if n == "_cast_tiles_kernel"] == [True]
    over_dy = [name for name, reads in bwd_ops if reads]
    assert not over_dy, f"torch ops over dY in the backward: {over_dy}"


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("conv1d", [False, True])
def test_every_fp8_gemm_operand_is_k_major_and_only_the_forward_accumulates_fast(recipe, conv1d, monkeypatch):
    """Each scaled_mm of a step (forward, dgrad, wgrad; the optimizer's cached weight
    in the second step) gets a (M, K) with unit stride along K and b (K, N) with unit
    stride along K: what Hopper's fp8 wgmma loads asynchronously. The forward keeps the
    tensor cores' fast accumulation, dgrad and wgrad promote every K tile."""
    if conv1d:
        pytest.importorskip("transformers")
        from torch import nn
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        model = tkern.convert_network(
            nn.Sequential(Conv1D(128, 128)).to(DEVICE), torch.bfloat16, float8=recipe
        )
        layer = model[0]
    else:
        layer = Float8Linear(128, 128, recipe=recipe, device=DEVICE)
    calls = []
    real = tkern.ops.float8.scaled_mm

    def recording(a, b, *args, **kw):
        calls.append((a.shape, a.stride(), b.shape, b.stride(), kw["use_fast_accum"]))
        return real(a, b, *args, **kw)

    monkeypatch.setattr(tkern.ops.float8, "scaled_mm", recording)
    opt = tkern.optim.FusedAdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(128, 128, device=DEVICE).to(torch.bfloat16).requires_grad_()
    for _ in range(2):
        _step(layer, opt, x)
    assert len(calls) == 6
    for a_shape, a_stride, b_shape, b_stride, _ in calls:
        assert a_stride[1] == 1 and b_stride[0] == 1, (a_shape, a_stride, b_shape, b_stride)
    assert [c[4] for c in calls] == [True, False, False] * 2


def test_the_gradient_gemms_launch_with_promoted_accumulation(launches):
    layer = Float8Linear(128, 128, device=DEVICE)
    x = torch.randn(128, 128, device=DEVICE).to(torch.bfloat16).requires_grad_()
    launches.clear()
    layer(x).float().sum().backward()
    precise = [meta.get("PRECISE_ACC") for name, meta in launches if name == "_matmul_kernel"]
    assert precise == [False, True, True]


def test_scaled_mm_on_hopper_copies_a_non_k_major_operand_once(monkeypatch):
    """sm_90's fp8 wgmma: an operand without unit stride along K is made K-major before the
    launch (the result is the same product); before Hopper, both are launched as they are."""
    torch.manual_seed(0)
    a, sa = tkern.to_float8(torch.randn(64, 128, device=DEVICE))
    w, sw = tkern.to_float8(torch.randn(32, 128, device=DEVICE))
    a_mn = a.t().contiguous().t()  # (64, 128) with unit stride along M
    b_nk = w.t().contiguous()  # (128, 32) row-major: unit stride along N
    want = tkern.scaled_mm(a, w.t(), sa, sw)
    seen = []
    real = gemm._launch_matmul
    monkeypatch.setattr(
        gemm,
        "_launch_matmul",
        lambda a, b, *r, **k: seen.append((a.stride(), b.stride())) or real(a, b, *r, **k),
    )
    for name, expect in (("l4", ((1, 64), (32, 1))), ("h100", ((128, 1), (1, 128)))):
        monkeypatch.setattr(f8, "compiled_spec", lambda device, name=name: SPECS[name])
        seen.clear()
        got = tkern.scaled_mm(a_mn, b_nk, sa, sw)
        assert seen == [expect] and torch.equal(got, want), name


@pytest.mark.parametrize(
    ("recipe", "activation"),
    [
        ("tensorwise", None),
        ("delayed", None),
        ("blockwise", None),
        ("delayed", "gelu_tanh"),
        ("tensorwise", "gelu"),
    ],
)
def test_every_scaled_mm_launch_is_one_the_compile_gate_compiles(recipe, activation, launches):
    """The compile gate (tests/test_compiled.py) compiles static_report.FP8_GEMM_LAUNCHES for
    every config offered to fp8 operands (and BLOCKWISE_LAUNCHES for the blockwise kernel,
    which the blockwise recipe's GEMMs run on): each scaled_mm launch of a recipe's step must be
    one of them (formats, scale kinds, both operands K-major, the accumulation), with the
    same or a lighter epilogue (no bias, no C +=); with an MLP's activation fused into the
    forward (tkern.nn.fusion), the same activation and the pre-activation stored."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import static_report

    names = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
    layer = Float8Linear(128, 128, recipe=recipe, device=DEVICE)
    opt = tkern.optim.FusedAdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(128, 128, device=DEVICE).to(torch.bfloat16).requires_grad_()
    launches.clear()
    _step(functools.partial(float8_forward, layer, activation=activation), opt, x)
    seen = 0
    for name, meta in launches:
        if name == "_scaled_mm_blockwise_kernel":  # its own cases in the gate (BLOCKWISE_LAUNCHES)
            seen += 1
            assert recipe == "blockwise" and meta["SCALE_BM"] == 1, meta
            assert {meta["args"][0].base.dtype, meta["args"][1].base.dtype} == {torch.float8_e4m3fn}
            gated = [
                launch
                for launch in static_report.BLOCKWISE_LAUNCHES
                if launch[1] == meta["SCALE_BN"]
                and (launch[2] or not meta["HAS_BIAS"])
                and (launch[3] or not meta["ACCUMULATE"])
            ]
            assert gated, meta
            continue
        if name != "_matmul_kernel":
            continue
        seen += 1
        assert meta["A_T"] is False and meta["B_T"] is True, meta  # K-major: unit strides along K
        assert meta["SCALE_A"] == meta["SCALE_B"] in (1, 3)
        gated = [
            launch
            for launch in static_report.FP8_GEMM_LAUNCHES
            if (launch[1], launch[2]) == (names[meta["args"][0].dtype], names[meta["args"][1].dtype])
            and launch[3] == meta["SCALE_A"]
            and launch[6] == meta["PRECISE_ACC"]
            and (launch[4] or not meta["HAS_BIAS"])
            and (launch[5] or not meta["ACCUMULATE"])
            and ACTIVATIONS[launch[7]] == meta["ACTIVATION"]
            and (launch[7] is not None) == meta["STORE_PREACT"]
        ]
        assert gated, meta
    assert seen == 3


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_each_gemm_is_the_product_of_its_dequantized_k_major_operands(recipe, monkeypatch):
    """Forward, dgrad and wgrad (the precise ones included) against the float64 product of
    the fp8 operands each received, dequantized with their scales: fp8 x fp8 products are
    exact in fp32, their fp32 sum over K errs by <= K * 2^-24 * sum |products|, and the
    result is rounded once to bf16 (2^-9 relative); both bounds doubled."""
    calls = []
    real = tkern.ops.float8.scaled_mm

    def recording(a, b, scale_a, scale_b, **kw):
        out = real(a, b, scale_a, scale_b, **kw)
        calls.append((a, b, scale_a, scale_b, out.clone() if kw.get("accumulate_into") is None else None))
        return out

    monkeypatch.setattr(tkern.ops.float8, "scaled_mm", recording)
    torch.manual_seed(3)
    layer = Float8Linear(192, 64, bias=False, recipe=recipe, device=DEVICE)
    x = torch.randn(48, 192, device=DEVICE).to(torch.bfloat16).requires_grad_()
    for _ in range(2):  # delayed: the second step casts with the first's amaxes
        calls.clear()
        layer(x).backward(torch.randn(48, 64, device=DEVICE).to(torch.bfloat16))
    assert len(calls) == 3
    for a, b, sa, sb, out in calls:
        qa, qb = a.double() * sa.double(), b.double() * sb.double()
        ref = qa @ qb
        k = a.shape[1]
        tol = 2 * (2.0**-9 * ref.abs() + k * 2.0**-24 * (qa.abs() @ qb.abs()))
        assert ((out.double() - ref).abs() <= tol).all(), (a.shape, b.shape)


def test_fp8_configs_are_128_deep_in_k_and_count_shared_memory_at_one_byte_an_element():
    """Issue 43 item 6: scaled_mm's tiles (gemm_configs.fp8_gemm_configs) are 128 deep in K
    (one per 128-wide block scale) and pruned with one byte an element: on Ada (99 KB a
    block) the 96 KB tiles (128x128x128 in three stages, 128x64x128 in four) are offered,
    where two bytes an element (192 KB) would prune them; launches promoting every K tile are held to
    64 accumulator values a thread, blockwise before Hopper to 32 (measured spills)."""
    from tkern.kernels.gemm_configs import (
        acc_per_thread,
        fp8_gemm_configs,
        prune_configs,
        smem_estimate,
        smem_limit,
    )

    configs = fp8_gemm_configs()
    assert (
        configs[0].kwargs["BLOCK_K"] == 128
        and sum(c.kwargs["BLOCK_K"] == 128 for c in configs) >= len(configs) - 1
    )
    # the tiles whose fp8 operands fit Ada's 99 KB but would not at two bytes an element
    between = [c for c in configs if smem_estimate(c, 1) <= smem_limit(89) < smem_estimate(c, 2)]
    assert between
    for c in between:
        assert c in prune_configs(configs, 89, elem_bytes=1) and c not in prune_configs(
            configs, 89, elem_bytes=2
        )
    for cc in (89, 90):
        for two_acc, blocks in ((False, False), (True, False), (True, True)):
            kept = prune_configs(configs, cc, elem_bytes=1, two_accumulators=two_acc, block_scales=blocks)
            limit = 32 if blocks and cc < 90 else 64 if two_acc or cc < 90 else None
            assert kept and all(smem_estimate(c, 1) <= smem_limit(cc) for c in kept)
            if limit is not None and len(kept) > 1:
                accs = [acc_per_thread(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept]
                assert max(accs) <= limit, (cc, two_acc, blocks, accs)
