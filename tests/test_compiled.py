"""The compile gate: every kernel compiled ahead of time for every architecture tkern
plans for (:data:`TARGETS`: NVIDIA sm_80 to sm_120, AMD gfx942 and gfx950, one per
architecture of ``tkern.device.SPECS``), without a GPU, and its machine code held to
what tkern is for.

The interpreter runs the kernels' Python semantics, not the code a GPU would
run; this module compiles them with Triton's own compiler for each target's
``GPUTarget(*spec.target)`` (CUDA or HIP) and reads registers, spills, shared
memory (LDS), tensor-core and copy instructions, layout conversions and (CUDA)
global access widths (``benchmarks/static_report.py`` does the compiling
and reading; its ``all_cases(cc, full=False)`` says what is covered).

It needs compiled mode (tkern imported with ``TRITON_INTERPRET=0``), so the
ordinary interpreted test run skips it, and a machine with a GPU skips it too
(its budget is for what only a GPU can check); CI runs it alone, without a GPU, under each Triton
version tkern supports, with ``benchmarks/ci_compile_gate.sh``, every tests/test_compiled*.py in
one process over one compile of the cases (:func:`gate_rows`). How much of each target is
compiled is ``aot_targets.depth``: on sm_90 and sm_100 (``device_report.COMPILED_EVERY_CONFIG``)
every offered GEMM config on the launches that set its spill bound and every launch on the first
config (benchmarks/aot_gemm_sweep.py), every variant of the other kernels; on the other targets
and under Triton 3.6 each launch's first offered config and the other kernels' heaviest
variants. ``TKERN_GATE_TARGETS=sm_90,gfx942`` restricts a local run to some targets::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled*.py
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import tkern

pytestmark = [
    pytest.mark.compiled,
    pytest.mark.skipif(
        tkern.INTERPRET,
        reason="the compile gate needs compiled mode: TRITON_INTERPRET=0 (benchmarks/ci_compile_gate.sh)",
    ),
    # CI's job, on a machine without a GPU: on a GPU machine it would compile every
    # kernel for eight targets, minutes of a session's device budget
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="the compile gate is CI's, run without a GPU (benchmarks/ci_compile_gate.sh)",
    ),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import static_report  # noqa: E402  (benchmarks/: the cases and their compiling)

#: One target per architecture of tkern.device.SPECS: the list docs/devices.md's "compiled
#: in CI" column is printed from (device_report.COMPILED_IN_CI)
TARGETS = static_report.gate_targets()
#: TKERN_GATE_TARGETS="gfx942,sm_86": a local run over those targets only (CI runs them all)
RUN = tuple(
    t for t in TARGETS if t in re.split(r"[,\s]+", os.environ.get("TKERN_GATE_TARGETS") or ",".join(TARGETS))
)
NVIDIA = tuple(t for t in RUN if t.startswith("sm_"))
AMD = tuple(t for t in RUN if t.startswith("gfx"))
#: The tensor-core instruction each target's GEMMs must use (a row's count of it)
MMA_FIELD = {"sm_90": "wgmma", "sm_100": "tcgen05", **dict.fromkeys(AMD, "mfma")}
#: Streaming kernels keep at least half the SM's warp slots busy: they are
#: bandwidth-bound and hide memory latency with resident warps.
MIN_STREAMING_OCCUPANCY = 50.0


@functools.cache
def gate_rows() -> tuple[dict, ...]:
    """Every case of every target in :data:`RUN` compiled once per process (static_report's
    pool, both cores), for every tests/test_compiled*.py module's ``rows``; written as JSON to
    ``$TKERN_GATE_ROWS`` where that is set (each row's ``compile_s``: where the time goes)."""
    rows = tuple(static_report.run(RUN, full=False))
    if os.environ.get("TKERN_GATE_ROWS"):
        Path(os.environ["TKERN_GATE_ROWS"]).write_text(json.dumps(rows, indent=0) + "\n")
    return rows


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return list(gate_rows())


def _mma(r: dict) -> int:
    """The row's count of its target's tensor-core instruction (:data:`MMA_FIELD`;
    mma.sync on sm_80/86/89/120)."""
    return r[MMA_FIELD.get(r["target"], "mma_sync")]


def every_config(target: str) -> bool:
    """Whether the gate compiles every offered config on ``target`` (aot_targets.depth)."""
    return static_report.depth(target) == static_report.EVERY_CONFIG


def every_variant(target: str) -> bool:
    """Whether the gate compiles every variant of the other kernels on ``target``."""
    return static_report.every_variant(target)


def gate_cases(target: str) -> dict:
    """The gate's cases on ``target`` by name (static_report.all_cases, full=False)."""
    return {c.name: c for c in static_report.all_cases(target, full=False)}


def test_the_targets_are_the_specs_architectures():
    # the gate compiles for what tkern plans for: every architecture tkern.device names, once
    from tkern.device import SPECS

    assert tuple(dict.fromkeys(s.arch for s in SPECS.values())) == TARGETS
    assert {static_report.spec_of(t).arch for t in TARGETS} == set(TARGETS)
    assert re.split(r"[,\s]+", "sm_90,gfx942 sm_86") == ["sm_90", "gfx942", "sm_86"]  # TKERN_GATE_TARGETS


def _needs(*targets: str) -> None:
    """Skip a check about ``targets`` in a local run without any of them (TKERN_GATE_TARGETS)."""
    if not set(targets) & set(RUN):
        pytest.skip(f"needs {' or '.join(targets)}: not in TKERN_GATE_TARGETS")


def _name(r: dict) -> str:
    return f"{r['case']} on {r['target']}"


def _of(rows, family=None, gated=None, target=None):
    return [
        r
        for r in rows
        if (family is None or r["family"] == family)
        and (gated is None or r["gated"] == gated)
        and (target is None or r["target"] == target)
    ]


#: The kernels of the public API every target compiles (the TMA, blockwise, fp8 and MX
#: kernels where the target's plan has them: below)
KERNELS = {
    "_sgd_kernel", "_adam_kernel", "_grad_stats_kernel", "_finalize_stats_kernel",
    "_grad_underflow_kernel", "_activation_grad_kernel", "_update_scale_kernel", "_matmul_kernel",
    "_norm_fwd_kernel", "_norm_bwd_kernel", "_norm_param_grads_kernel", "_swiglu_fwd_kernel",
    "_swiglu_bwd_kernel", "_rotary_kernel", "_rotary_tables_kernel", "_cross_entropy_kernel",
    "_matmul_split_k_kernel", "_split_k_reduce_kernel", "_target_stats_kernel",
}  # fmt: skip


def test_every_kernel_and_target_is_covered(rows):
    compiled = {(r["case"], r["target"]) for r in rows if r["compiled"]}
    for cc in RUN:
        spec = static_report.spec_of(cc)
        kernels = {r["kernel"] for r in rows if r["target"] == cc}
        assert kernels >= KERNELS, (cc, KERNELS - kernels)
        # the TMA kernels where the target has TMA (Hopper and newer NVIDIA), never on AMD;
        # fp8 where planned, the MX GEMM where the tensor cores take MX natively
        assert ("_matmul_tma_kernel" in kernels) == ("_scaled_mm_blockwise_kernel" in kernels) == spec.tma, cc
        assert ("_matmul_emit_kernel" in kernels) == static_report.fp8_planned(cc), cc
        assert ("_scaled_mm_mx_kernel" in kernels) == spec.mx, cc
        names = [case for case, target in compiled if target == cc and case.startswith("matmul[")]
        # every layout (NT forward, NN dgrad, TN wgrad) on every target, aligned and ragged
        for layout in ("NT", "NN", "TN"):
            for ragged in (False, True):
                assert any(f",{layout}," in n and (",ragged" in n) == ragged for n in names), (cc, layout)
        _heaviest_on_the_configs(cc, compiled)
    # the one-pass optimizer step, in one program and grid-wide: adam and sgd, their heaviest
    # flags in bf16 everywhere; where every variant is compiled fp16 and bf16, plainest and
    # heaviest flags (test_no_register_spills holds every row to zero spills)
    for way in ("one-pass", "grid"):
        for cc in RUN:
            ok = {case for case, t in compiled if t == cc and case.endswith(f",{way}]")}
            assert {
                f"adam[bf16,decoupled,amsgrad,clip,{way}]",
                f"sgd[bf16,momentum,nesterov,clip,{way}]",
            } <= ok, cc
            assert len(ok) == (8 if every_variant(cc) else 2), (cc, sorted(ok))
    activation_grads = {(r["case"], r["target"]) for r in rows if r["kernel"] == "_activation_grad_kernel"}
    for cc in RUN:
        for name in ("relu", "gelu", "silu", "gelu_tanh"):
            dtypes = ("fp16", "bf16") if every_variant(cc) else ("bf16",)
            assert {(f"activation_grad[{d},{name}]", cc) for d in dtypes} <= activation_grads, cc


def _heaviest_on_the_configs(cc: str, compiled: set) -> None:
    """Each GEMM autotuner's offered configs on ``cc`` as the gate compiles them
    (aot_gemm_sweep): where every config is compiled, each on the launches that set its spill
    bound (the GELU forwards four ways, ReLU's where GELU's rule prunes it, the ragged
    backward, the prologue's and the dgrad epilogue's heaviest), and every other gate launch
    (SiLU and tanh-GELU, the lighter prologue gradient, ...) on the first config; elsewhere
    the first config on the heaviest. test_no_register_spills then holds each to zero."""
    level = static_report.depth(cc)
    every = level == static_report.EVERY_CONFIG
    for ragged in (False, True):
        configs = static_report.gemm_configs_for(cc, ragged=ragged)
        for cfg in configs if every else configs[:1]:
            for v in static_report.pointer_heaviest(cc, cfg, ragged, public=not every):
                assert (static_report.pointer_case(cfg, v).name, cc) in compiled, (cc, cfg, v)
        names = {case for case, t in compiled if t == cc and case.startswith("matmul[")}
        labels = {name.split(",", 1)[1] for name in names}
        if every:  # every gate launch on some config: SiLU's and tanh-GELU's forwards too
            others = static_report.pointer_others(cc, configs[0], ragged)
            assert {static_report.pointer_case(configs[0], v).name for v in others} <= names, cc
            for label in ("bias+silu+preact", "silu+preact", "bias+gelu_tanh+preact", "gelu_tanh+preact"):
                assert f"bf16->bf16,NT,{label}{',ragged' if ragged else ''}]" in labels, (cc, label)
    if static_report.spec_of(cc).tma:
        configs = static_report.gemm_configs_for(cc, tma=True)
        for cfg in configs if every else configs[:1]:
            for v in static_report.tma_heaviest(cc, cfg):
                assert (static_report.tma_case(cfg, v).name, cc) in compiled, (cc, cfg, v)
    if every:  # the wgrad adding into a flat gradient buffer (C +=), with and without its prologue
        # (dbias added into the bias's view beside it: sum+=)
        assert ("matmul[128x128x64/s3w8,bf16->bf16,TN,none,A'=sum+=fp32,C+=]", cc) in compiled
        assert ("matmul[128x64x32/s4w4,bf16->bf16,TN,none,A'=relu'+sum+=bf16,C+=]", cc) in compiled
        assert ("matmul_tma[128x128x64/s3w8,bf16->bf16,TN,none,C+=]", cc) in compiled
        # and a Conv1D weight's through its transposed view (C^T), on some config of each kernel
        names = {n for n, t in compiled if t == cc}
        for v in static_report.CONV1D_WGRAD_INTO:
            assert any(n.startswith("matmul[") and n.endswith(f",{v.label}]") for n in names), (cc, v.label)
        for v in static_report.TMA_CONV1D_WGRAD_INTO:
            assert any(n.startswith("matmul_tma[") and n.endswith(f",{v.label}]") for n in names), (
                cc,
                v.label,
            )


def test_the_one_pass_step_reduces_its_statistics_in_pass_1s_layouts(rows):
    # bit for bit the two-pass step's statistics (tests/test_optim_one_pass.py) on a GPU too:
    # the one-pass kernel runs pass 1's and the finalize's code, and its reductions must have
    # their layouts (a reduction's order of additions follows from its layout); every one-pass
    # and grid-wide step the gate compiles (the grid's programs each reduce every row after
    # the barrier: the same code), against pass 1 of its dtype
    # (each row's reduce_layouts: read from its TTGIR where the rows compiled it)
    steps = [r for r in rows if r["case"].endswith((",one-pass]", ",grid]"))]
    assert {r["target"] for r in steps} == set(RUN)
    layouts = {(r["case"], r["target"]): r["reduce_layouts"] for r in rows if r["compiled"]}
    for r in steps:
        dtype, cc = r["case"].split("[")[1].split(",")[0], r["target"]
        pass_1 = layouts[f"grad_stats[{dtype}]", cc] + layouts["finalize_stats", cc]
        assert len(pass_1) == 6 and layouts[r["case"], cc] == pass_1, _name(r)
    # the rows' layouts are reduce_layouts' (which compiles the case again, from Triton's cache)
    r = steps[0]
    assert static_report.reduce_layouts(r["case"], r["target"]) == layouts[r["case"], r["target"]]


#: The grid-wide steps whose barrier the memory-order checks read: adam's and sgd's heaviest
#: flags in bf16, compiled on every target
GRID_STEPS = ("adam[bf16,decoupled,amsgrad,clip,grid]", "sgd[bf16,momentum,nesterov,clip,grid]")


def test_the_grid_barrier_keeps_its_memory_order():
    # the grid-wide one-pass step's barrier (tkern/kernels/grid_sync.py) as PTX: one thread
    # per program arrives (acq_rel) and takes the finishing ticket (acq_rel), the last arrival
    # releases, the waiters spin on volatile loads and then acquire -- nothing folded away
    for name in GRID_STEPS:
        for cc in NVIDIA:
            ops = static_report.ordered_accesses(name, cc)
            guarded = [op.split()[-1] for op in ops if op.startswith("@")]  # one thread's
            assert [op for op in guarded if ".acq_rel.add" in op] == [
                "atom.global.gpu.acq_rel.add.u32"
            ] * 2, ops
            assert any(".release.add" in op for op in guarded), ops
            assert any(".acquire" in op and ".release" not in op for op in guarded), ops
            assert any(op.startswith("ld.volatile.global") for op in ops), ops


def _amdgcn_order(ops: list[str]) -> dict[str, int]:
    """The atomics of an AMDGCN listing (``aot_compile.ordered_accesses_amdgcn``) by the
    order LLVM gave them at agent scope (AMDGPUUsage, "Memory Model GFX942"): ``acq_rel`` (an
    L2 write-back, ``buffer_wbl2``, before it and an invalidate, ``buffer_inv``, after its
    return), ``release`` (the write-back only), ``acquire`` (the invalidate only: an atomic
    RMW's, or an atomic load's, ``sc1``, which is what LLVM makes of an idempotent acquire
    RMW, an ``atomic_add`` of 0); ``volatile``: the other loads past the caches (``sc0 sc1``)."""
    ops = [op for op in ops if not op.startswith("s_waitcnt")]  # the waits order them; skip
    out = dict(acq_rel=0, release=0, acquire=0, volatile=0)
    for i, op in enumerate(ops):
        before = i > 0 and ops[i - 1].startswith("buffer_wbl2")
        after = i + 1 < len(ops) and ops[i + 1].startswith("buffer_inv")
        if "_load_" in op:
            if after:  # an atomic load with acquire
                out["acquire"] += 1
            elif " sc0 sc1" in op:
                out["volatile"] += 1
            continue
        if "_atomic_" not in op:
            continue
        kind = {(True, True): "acq_rel", (True, False): "release", (False, True): "acquire"}.get(
            (before, after)
        )
        if kind:
            out[kind] += 1
    return out


def test_the_grid_barrier_keeps_its_memory_order_in_amdgcn():
    # the same barrier for gfx942 and gfx950: LLVM's AMDGPU memory model at agent scope writes
    # L2 back before a release (buffer_wbl2 sc1) and invalidates after an acquire (buffer_inv
    # sc1), each around an atomic whose return it waits for (s_waitcnt vmcnt(0)): the two
    # arrivals (the barrier's, the finishing ticket's) acq_rel, the last arrival's release, the
    # waiters' acquire read, their spin on volatile (sc0 sc1) loads -- nothing folded away
    for name in GRID_STEPS:
        for target in AMD:
            ops = static_report.ordered_accesses_amdgcn(name, target)
            order = _amdgcn_order(ops)
            assert order["acq_rel"] == 2 and order["release"] >= 1 and order["acquire"] >= 1, (target, ops)
            assert order["volatile"] >= 1, (target, ops)
            # planted: without the write-back before it the arrival is an acquire only; without
            # the invalidates no acquire is left; a spin on plain loads has no volatile one
            dropped = [op for op in ops if not op.startswith("buffer_wbl2")]
            assert _amdgcn_order(dropped)["acq_rel"] == 0
            assert _amdgcn_order([op for op in ops if not op.startswith("buffer_inv")])["acquire"] == 0
            assert _amdgcn_order([op.replace(" sc0 sc1", "") for op in ops])["volatile"] == 0


def test_norm_kernels_compile_for_every_dtype_without_spills(rows):
    # LayerNorm and RMSNorm, forward (with the residual) and backward (with dh, dweight
    # and dbias): a 1024-wide row, the widest one-block row (MAX_BLOCK over 16 warps) and
    # chunked rows; LayerNorm's bf16 on every target, every dtype and RMSNorm where every
    # variant is compiled
    from tkern.kernels.norm import MAX_BLOCK

    norms = [r for r in rows if r["kernel"] in ("_norm_fwd_kernel", "_norm_bwd_kernel")]
    for cc in RUN:
        names = {r["case"] for r in norms if r["target"] == cc and r["compiled"] and not r["spill_bytes"]}
        for kernel, extra in (("fwd", ",res"), ("bwd", ",dh")):
            for dtype in ("fp16", "bf16", "fp32") if every_variant(cc) else ("bf16",):
                for norm in ("ln", "rms") if every_variant(cc) else ("ln",):
                    for width in ("1024", f"{MAX_BLOCK}", f"chunks of {MAX_BLOCK}"):
                        assert f"norm_{kernel}[{dtype},{norm}{extra},{width}]" in names, (cc, names)


def test_norm_param_grads_compile_without_spills(rows):
    # the dweight / dbias reduction, added into the flat buffer, at both column blocks: fp32
    # and bf16 params on every target, fp16 too where every variant is compiled
    from tkern.kernels.norm import REDUCE_MAX_COLS, REDUCE_MIN_COLS

    grads = [r for r in rows if r["kernel"] == "_norm_param_grads_kernel"]
    for cc in RUN:
        names = {r["case"] for r in grads if r["target"] == cc and r["compiled"] and not r["spill_bytes"]}
        for dtype in ("fp32", "bf16", "fp16") if every_variant(cc) else ("fp32", "bf16"):
            for cols in (REDUCE_MIN_COLS, REDUCE_MAX_COLS):
                assert f"norm_param_grads[{dtype},ln,acc,{cols} cols]" in names, (cc, names)


def test_everything_compiles(rows):
    failed = [f"{_name(r)}: {r['error']}" for r in rows if not r["compiled"]]
    assert not failed, "\n".join(failed)


def test_no_register_spills(rows):
    spilled = [f"{_name(r)}: {r['spill_bytes']} B" for r in rows if r["compiled"] and r["spill_bytes"]]
    assert not spilled, "spills:\n" + "\n".join(spilled)


def test_no_offered_config_exceeds_shared_memory(rows):
    over = [
        f"{_name(r)}: {r['smem']} B > {static_report.smem_limit(r['target'])} B"
        for r in rows
        if r["compiled"] and r["smem"] > static_report.smem_limit(r["target"])
    ]
    assert not over, "configs that can never launch are offered:\n" + "\n".join(over)


def test_tma_gelu_on_a_ragged_output_offers_only_configs_that_do_not_spill(rows):
    _needs("sm_90")
    # gemm_configs.prune_configs: with GELU and a ragged output (scalar stores of C and the
    # pre-activation) the TMA kernel's 128x256x64 tiles spilled 772-776 B on sm_90 under
    # triton 3.6 (the demo's 784 -> 1000 GELU layer); they leave the offered set there, and
    # every config still offered compiles without spills on tkern.linear's heaviest forwards
    from tkern.kernels.activation import ACTIVATIONS

    gelu = ACTIVATIONS["gelu"]
    offered = static_report.gemm_configs_for(90, tma=True, ragged=True, activation=gelu)
    names = {static_report.cfg_name(c.kwargs, c) for c in offered}
    assert names and not any(n.startswith("128x256x64") for n in names)
    aligned = {static_report.cfg_name(c.kwargs, c) for c in static_report.gemm_configs_for(90, tma=True)}
    assert {"128x256x64/s3w8", "128x256x64/s4w8"} <= aligned  # still offered to aligned outputs
    compiled = {r["case"]: r for r in rows if r["target"] == "sm_90"}
    for cfg in offered if every_config("sm_90") else offered[:1]:  # (Triton 3.6: the first)
        for launch in static_report.TMA_RAGGED_GATE_LAUNCHES:
            case = static_report.tma_case(cfg, launch).name
            assert case in compiled and compiled[case]["compiled"] and not compiled[case]["spill_bytes"], case


def test_tma_configs_over_the_limit_are_not_offered():
    # the pruning itself: the 128-wide K tiles on 256 columns need 288-416 KB
    names = {static_report.cfg_name(c.kwargs, c) for c in static_report.gemm_configs_for(90, tma=True)}
    assert "128x256x128/s3w8" not in names and "128x256x128/s4w8" not in names
    assert "128x128x64/s3w8" in names


def test_every_gemm_uses_its_targets_tensor_core_instruction(rows):
    # mma.sync on sm_80/86/89/120, wgmma on sm_90, tcgen05 on sm_100, v_mfma on gfx942/950
    # (MMA_FIELD), on every GEMM row of every target
    gemms = _of(rows, "gemm")
    assert {r["target"] for r in gemms} == set(RUN)
    missing = [_name(r) for r in gemms if r["compiled"] and not _mma(r)]
    assert not missing, "no tensor-core instruction of the target:\n" + "\n".join(missing)


def test_the_tensor_core_check_sees_a_gemm_without_its_instruction(rows):
    _needs("sm_90")
    # the check above can fail: an sm_90 GEMM's row read as sm_100's has wgmma, no tcgen05
    row = next(r for r in _of(rows, "gemm", target="sm_90") if r["compiled"])
    assert _mma(row) and not _mma({**row, "target": "sm_100"})


def test_pointer_gemm_pipelines_with_16_byte_async_copies(rows):
    bad = [
        f"{_name(r)}: {r['cp_async_16']} of {r['cp_async']}"
        for r in _of(rows, "gemm", gated=True)
        if r["kernel"] == "_matmul_kernel"
        and r["target"] in NVIDIA  # AMD's loads go through registers to LDS
        and r["compiled"]
        and (not r["cp_async"] or r["cp_async_16"] != r["cp_async"])
    ]
    assert not bad, "cp.async missing or narrower than 16 bytes:\n" + "\n".join(bad)


def test_tma_kernel_loads_through_descriptors(rows):
    _needs("sm_90", "sm_100", "sm_120")
    tma = [r for r in rows if r["kernel"] == "_matmul_tma_kernel"]
    assert tma and all(r["tma_loads"] > 0 for r in tma if r["compiled"])


def test_split_k_compiles_pipelined_without_spills(rows):
    # gemm_split.py: every config its autotuner offers, as tkern.linear's wgrad launches it
    # (dZ^T read transposed, dbias summed per K range or not): 16-byte cp.async loads, wgmma
    # on Hopper, 128-bit stores of the fp32 partials; the ordered reduction's partial loads
    # and C stores at 128 bits
    split = [r for r in rows if r["kernel"] == "_matmul_split_k_kernel"]
    reduce = [r for r in rows if r["kernel"] == "_split_k_reduce_kernel"]
    assert {r["target"] for r in split} == {r["target"] for r in reduce} == set(RUN)
    for r in split:
        assert r["compiled"] and not r["spill_bytes"] and _mma(r), _name(r)
        if r["target"] in AMD:  # no cp.async, no PTX access widths
            continue
        assert r["cp_async"] and r["cp_async_16"] == r["cp_async"], _name(r)
        assert set(r["global_access_bits"]["ws_ptr"]) == {128}, _name(r)
    for r in reduce:
        assert r["compiled"] and not r["spill_bytes"], _name(r)
        if r["target"] in AMD:
            continue
        assert set(r["global_access_bits"]["ws_ptr"]) == {128}, _name(r)
        assert set(r["global_access_bits"]["c_ptr"]) == {128}, _name(r)


def test_tma_kernel_stores_c_through_descriptors_where_the_launcher_does(rows):
    _needs("sm_90")
    # the TMA-store epilogue (gemm_epilogue.epilogue_tma): C with aligned rows and no
    # pre-activation beside it (the wgrad into a flat buffer, forwards without one) is
    # stored by bulk tensor copies: the wgrad into a flat buffer on every config offered,
    # the forwards on the first; a pre-activation keeps the pointer epilogue
    by_name = {r["case"]: r for r in rows if r["target"] == "sm_90"}
    configs = static_report.gemm_configs_for(90, tma=True)
    launches = [(cfg, static_report.TMA_WGRAD_INTO) for cfg in configs if every_config("sm_90")]
    launches += [(configs[0], v) for v in static_report.TMA_STORE_GATE_LAUNCHES if every_config("sm_90")]
    launches = launches or [(configs[0], static_report.TMA_WGRAD_INTO)]  # (Triton 3.6: the first)
    for cfg, launch in launches:
        r = by_name[static_report.tma_case(cfg, launch).name]
        assert r["compiled"] and not r["spill_bytes"] and r["tma_stores"] > 0, _name(r)
    preact = [r for r in by_name.values() if r["kernel"] == "_matmul_tma_kernel" and "preact" in r["case"]]
    assert preact and all(r["tma_stores"] == 0 for r in preact if r["compiled"])


def test_streaming_kernels_use_full_width_vector_accesses(rows):
    # Each thread owns `per_thread` contiguous elements of every array and must
    # move them in one access of min(per_thread * element size, 16) bytes:
    # 128-bit for fp32 and for halves at 8 per thread; 64-bit for halves next
    # to fp32 arrays at 4 per thread (the update kernels, see tkern.kernels.sgd).
    # (NVIDIA's PTX; on AMD the loads are buffer/global instructions of other widths)
    bad = []
    streaming = [r for r in _of(rows, "streaming", gated=True) if r["target"] in NVIDIA]
    assert {r["target"] for r in streaming} == set(NVIDIA)
    for r in streaming:
        if not r["compiled"]:
            continue
        for array, bits in r["expected_bits"].items():
            seen = set(r["global_access_bits"].get(array, []))
            if seen != {bits}:
                bad.append(f"{_name(r)}: {array} accessed as {sorted(seen)} bits, expected {bits}")
        # every array is held to its full width above: 128 bits for fp32 at 4 per thread, 64
        # for 16-bit arrays (a kernel of only those: a split or no master with bf16/8-bit state)
        assert r["expected_bits"], f"{_name(r)}: no array to check"
    assert not bad, "\n".join(bad)


#: The most elements a streaming kernel may move between layouts in one conversion: the
#: 8-bit state's per-block absmax (BLOCK / 256 = 4 per program), never an element array.
MAX_CONVERTED_ELEMENTS = 4


def test_streaming_kernels_have_no_layout_conversions(rows):
    bad = [
        f"{_name(r)}: {r['convert_layout']} ({r['convert_layout_elements']} elements)"
        for r in _of(rows, "streaming")
        if any(n > MAX_CONVERTED_ELEMENTS for n in r["convert_layout_elements"])
        or len(r["convert_layout_elements"]) != r["convert_layout"]
    ]
    assert not bad, "layout conversions (shuffles through shared memory):\n" + "\n".join(bad)


def test_streaming_kernels_keep_half_the_warp_slots(rows):
    bad = [
        f"{_name(r)}: {r['occupancy_pct']}% ({r['regs']} registers, limited by {r['limiter']})"
        for r in _of(rows, "streaming")
        if r["compiled"] and r["occupancy_pct"] < MIN_STREAMING_OCCUPANCY
    ]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- cross-entropy (issue 28)


def test_cross_entropy_kernel_compiles_without_spills(rows):
    """tkern.cross_entropy's and linear_cross_entropy's launches (static_report.cross_entropy_cases:
    fp16/bf16/fp32 logits, the forward, the backward from lse, the fused linear launch, the
    plainest and every option on) for every target: every one compiles with no spills.
    They are in all_cases too (the report and the fixture's gate set)."""

    cases = static_report.cross_entropy_cases()
    assert {c.name for c in cases} >= {
        "cross_entropy_fwd[bf16]",
        "linear_cross_entropy[fp32->bf16,weight,smoothing,z]",
        "cross_entropy_target_stats[i64,weight,mean]",
    }
    by = {(r["case"], r["target"]): r for r in rows}
    for cc in RUN:  # every option on in bf16 on every target; all where every variant is compiled
        for case in (c for c in cases if every_variant(cc) or not c.light):
            r = by[case.name, cc]
            assert r["compiled"], f"{case.name} on {cc}: {r.get('error')}"
            assert r["spill_bytes"] == 0, f"{case.name} spills {r['spill_bytes']} B on {cc}"


# --------------------------------------------------------------------------- health (issue 37 item 7)


def test_underflow_kernel_compiles_without_spills_at_full_width(rows):
    """The sampled zero/subnormal count (``opt.track_underflows``): fp16, bf16 and fp32
    gradients and a ragged tail, for every target; every one compiles with no spills,
    the aligned ones read the gradients in full-width (128-bit) loads and keep at least
    half the warp slots busy. They are in all_cases too (the fixture's gate set)."""

    cases = [c for c in static_report._stats_cases() if c.name.startswith("grad_underflow[")]
    assert {c.name for c in cases} == {
        "grad_underflow[fp16]", "grad_underflow[bf16]", "grad_underflow[fp32]", "grad_underflow[fp16,tail]"
    }  # fmt: skip
    by = {(r["case"], r["target"]): r for r in rows}
    for cc in RUN:  # bf16 on every target; fp16's, fp32's and the tail where every variant is
        for case in (c for c in cases if every_variant(cc) or not c.light):
            r = by[case.name, cc]
            where = f"{case.name} on {cc}"
            assert r["compiled"], f"{where}: {r.get('error')}"
            assert r["spill_bytes"] == 0, f"{where} spills {r['spill_bytes']} B"
            if case.gated and cc in NVIDIA:
                assert set(r["global_access_bits"]["grad_ptr"]) == {128}, (where, r["global_access_bits"])
                assert r["occupancy_pct"] >= MIN_STREAMING_OCCUPANCY, (where, r["regs"], r["occupancy_pct"])
