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
version tkern supports, with ``benchmarks/ci_compile_gate.sh``. Every offered GEMM config
is compiled on sm_90 and sm_100 (``device_report.COMPILED_EVERY_CONFIG``), the first one per family
and layout on the other targets and under Triton 3.6 (``aot_targets.swept``)::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled.py
"""

from __future__ import annotations

import os
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

#: One target per architecture of tkern.device.SPECS (test_the_targets_are_the_specs_architectures)
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
#: TKERN_GATE_TARGETS="gfx942 sm_86": a local run over those targets only (CI runs them all)
RUN = tuple(t for t in TARGETS if t in os.environ.get("TKERN_GATE_TARGETS", " ".join(TARGETS)).split())
NVIDIA = tuple(t for t in RUN if t.startswith("sm_"))
AMD = tuple(t for t in RUN if t.startswith("gfx"))
#: The tensor-core instruction each target's GEMMs must use (a row's count of it)
MMA_FIELD = {"sm_90": "wgmma", "sm_100": "tcgen05", **dict.fromkeys(AMD, "mfma")}
#: Streaming kernels keep at least half the SM's warp slots busy: they are
#: bandwidth-bound and hide memory latency with resident warps.
MIN_STREAMING_OCCUPANCY = 50.0


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    import static_report

    return static_report.run(RUN, full=False)


def _mma(r: dict) -> int:
    """The row's count of its target's tensor-core instruction (:data:`MMA_FIELD`;
    mma.sync on sm_80/86/89/120)."""
    return r[MMA_FIELD.get(r["target"], "mma_sync")]


def _swept(target: str) -> bool:
    import static_report

    return len(static_report.swept([0, 1], target)) == 2


def test_the_targets_are_the_specs_architectures():
    # the gate compiles for what tkern plans for: every architecture tkern.device names, once
    import static_report

    from tkern.device import SPECS

    assert TARGETS == tuple(dict.fromkeys(s.arch for s in SPECS.values())) == static_report.GATE_TARGETS
    assert {static_report.spec_of(t).arch for t in TARGETS} == set(TARGETS)


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


def test_every_kernel_and_target_is_covered(rows):
    import static_report

    kernels = {(r["kernel"], r["target"]) for r in rows}
    expected = {
        "_sgd_kernel", "_adam_kernel", "_grad_stats_kernel", "_finalize_stats_kernel",
        "_grad_underflow_kernel", "_activation_grad_kernel", "_update_scale_kernel", "_matmul_kernel",
        "_norm_fwd_kernel", "_norm_bwd_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel",
        "_rotary_kernel", "_cross_entropy_kernel", "_matmul_split_k_kernel", "_split_k_reduce_kernel",
    }  # fmt: skip
    for cc in RUN:
        assert {k for k, t in kernels if t == cc} >= expected, cc
        # the TMA kernels where the target has TMA (Hopper and newer NVIDIA), never on AMD
        has_tma = static_report.spec_of(cc).tma
        assert (("_matmul_tma_kernel", cc) in kernels) == has_tma, cc
        assert (("_scaled_mm_blockwise_kernel", cc) in kernels) == has_tma, cc
    # every config each autotuner offers on each target, on the most register-hungry
    # launches of tkern.linear, which test_no_register_spills then holds to zero spills
    compiled = {(r["case"], r["target"]) for r in rows if r["compiled"]}
    for cc in RUN:
        expected = set()
        for ragged in (False, True):
            for act in static_report.transcendental():  # every activation computed with exp/erf
                offered_act = static_report.gemm_configs_for(cc, ragged=ragged, activation=act)
                act_ok = {static_report.cfg_name(c.kwargs, c) for c in offered_act}
                for cfg in static_report.swept(static_report.gemm_configs_for(cc, ragged=ragged), cc):
                    for launch in static_report.gate_launches(ragged):
                        if launch.act != act and launch.act in static_report.transcendental():
                            continue
                        offered = static_report.cfg_name(cfg.kwargs, cfg) in act_ok
                        launch = static_report.offered_launch(launch, offered)  # ReLU where pruned
                        expected.add((static_report.pointer_case(cfg, launch).name, cc))
            # the backward GEMMs' operand prologue (dZ stored, dbias summed, act' applied)
            for cfg in static_report.swept(static_report.gemm_configs_for(cc, ragged=ragged), cc):
                for launch in static_report.prologue_gate_launches(cc, cfg, ragged):
                    expected.add((static_report.pointer_case(cfg, launch).name, cc))
        if has_tma := static_report.spec_of(cc).tma:
            for cfg in static_report.swept(static_report.gemm_configs_for(cc, tma=True), cc):
                for launch in (*static_report.gate_launches(), static_report.TMA_WGRAD_INTO):
                    expected.add((static_report.tma_case(cfg, launch).name, cc))
        assert expected <= compiled, sorted(expected - compiled)
        names = " ".join(case for case, target in expected if target == cc)
        # every layout (NT forward, NN dgrad, TN wgrad) on every target, swept or not
        for layout in ("NT", "NN", "TN"):
            assert f",{layout}," in names, (cc, layout)
        assert has_tma == ("matmul_tma[" in names), cc
        if not _swept(cc):
            continue
        # the new activations' forwards are among them, on the pointer and the TMA kernel
        for label in ("bias+silu+preact", "silu+preact", "bias+gelu_tanh+preact", "gelu_tanh+preact"):
            assert f"matmul[128x64x32/s4w4,bf16->bf16,NT,{label}]" in names
        # the wgrad adding into a flat gradient buffer (C +=), with and without its prologue
        assert "matmul[128x64x32/s4w4,bf16->bf16,TN,none,A'=sum fp32,C+=]" in names
        assert "matmul_tma[128x128x64/s3w8,bf16->bf16,TN,none,C+=]" in names
    # the one-pass optimizer step, in one program and grid-wide: adam and sgd, fp16 and bf16,
    # plainest and heaviest flags, none spilling (test_no_register_spills holds every row to it)
    for way in ("one-pass", "grid"):
        ok = {(r["case"], r["target"]) for r in rows if r["case"].endswith(f",{way}]") and r["compiled"]}
        assert len(ok) == 8 * len(RUN), sorted(ok)
        assert not any(r["spill_bytes"] for r in rows if r["case"].endswith(f",{way}]")), way
    activation_grads = {r["case"] for r in rows if r["kernel"] == "_activation_grad_kernel"}
    for name in ("relu", "gelu", "silu", "gelu_tanh"):
        assert {f"activation_grad[fp16,{name}]", f"activation_grad[bf16,{name}]"} <= activation_grads


def test_the_one_pass_step_reduces_its_statistics_in_pass_1s_layouts():
    # bit for bit the two-pass step's statistics (tests/test_optim_one_pass.py) on a GPU too:
    # the one-pass kernel runs pass 1's and the finalize's code, and its reductions must have
    # their layouts (a reduction's order of additions follows from its layout)
    import static_report

    # (the grid-wide step's programs each reduce every row after the barrier: the same code)
    for dtype, one_pass in (
        ("fp16", "adam[fp16,decoupled,amsgrad,clip,one-pass]"),
        ("bf16", "sgd[bf16,plain,one-pass]"),
        ("fp16", "adam[fp16,decoupled,amsgrad,clip,grid]"),
        ("bf16", "sgd[bf16,plain,grid]"),
    ):
        for cc in RUN:
            pass_1 = static_report.reduce_layouts(f"grad_stats[{dtype}]", cc)
            pass_1 += static_report.reduce_layouts("finalize_stats", cc)
            assert len(pass_1) == 6 and static_report.reduce_layouts(one_pass, cc) == pass_1, (one_pass, cc)


def test_the_grid_barrier_keeps_its_memory_order():
    # the grid-wide one-pass step's barrier (tkern/kernels/grid_sync.py) as PTX: one thread
    # per program arrives (acq_rel) and takes the finishing ticket (acq_rel), the last arrival
    # releases, the waiters spin on volatile loads and then acquire -- nothing folded away
    import static_report

    for name in ("adam[fp16,decoupled,amsgrad,clip,grid]", "sgd[bf16,plain,grid]"):
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
    order LLVM gave them at agent scope: ``acq_rel`` (an L2 write-back, ``buffer_wbl2``,
    before it and an invalidate, ``buffer_inv``, after its return), ``release`` (the
    write-back only), ``acquire`` (the invalidate only); ``volatile``: loads past the caches."""
    ops = [op for op in ops if not op.startswith("s_waitcnt")]  # the waits order them; skip
    out = dict(acq_rel=0, release=0, acquire=0, volatile=sum("_load_" in op for op in ops))
    for i, op in enumerate(ops):
        if "_atomic_" not in op:
            continue
        before = i > 0 and ops[i - 1].startswith("buffer_wbl2")
        after = i + 1 < len(ops) and ops[i + 1].startswith("buffer_inv")
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
    import static_report

    for name in ("adam[fp16,decoupled,amsgrad,clip,grid]", "sgd[bf16,plain,grid]"):
        for target in AMD:
            ops = static_report.ordered_accesses_amdgcn(name, target)
            order = _amdgcn_order(ops)
            assert order["acq_rel"] == 2 and order["release"] >= 1 and order["acquire"] >= 1, (target, ops)
            assert order["volatile"] >= 1, (target, ops)
            # planted: without the write-back before it the arrival is an acquire only
            dropped = [op for op in ops if not op.startswith("buffer_wbl2")]
            assert _amdgcn_order(dropped)["acq_rel"] == 0


def test_norm_kernels_compile_for_every_dtype_without_spills(rows):
    # LayerNorm and RMSNorm, forward (with the residual) and backward (with dh, dweight
    # and dbias): a 1024-wide row, the widest one-block row (MAX_BLOCK over 16 warps) and
    # chunked rows
    from tkern.kernels.norm import MAX_BLOCK

    norms = [r for r in rows if r["kernel"] in ("_norm_fwd_kernel", "_norm_bwd_kernel")]
    for cc in RUN:
        names = {r["case"] for r in norms if r["target"] == cc and r["compiled"] and not r["spill_bytes"]}
        for kernel, extra in (("fwd", ",res"), ("bwd", ",dh")):
            for dtype in ("fp16", "bf16", "fp32"):
                for norm in ("ln", "rms"):
                    for width in ("1024", f"{MAX_BLOCK}", f"chunks of {MAX_BLOCK}"):
                        assert f"norm_{kernel}[{dtype},{norm}{extra},{width}]" in names, (cc, names)


def test_everything_compiles(rows):
    failed = [f"{_name(r)}: {r['error']}" for r in rows if not r["compiled"]]
    assert not failed, "\n".join(failed)


def test_no_register_spills(rows):
    spilled = [f"{_name(r)}: {r['spill_bytes']} B" for r in rows if r["compiled"] and r["spill_bytes"]]
    assert not spilled, "spills:\n" + "\n".join(spilled)


def test_no_offered_config_exceeds_shared_memory(rows):
    import static_report

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
    import static_report

    from tkern.kernels.activation import ACTIVATIONS

    gelu = ACTIVATIONS["gelu"]
    offered = static_report.gemm_configs_for(90, tma=True, ragged=True, activation=gelu)
    names = {static_report.cfg_name(c.kwargs, c) for c in offered}
    assert names and not any(n.startswith("128x256x64") for n in names)
    aligned = {static_report.cfg_name(c.kwargs, c) for c in static_report.gemm_configs_for(90, tma=True)}
    assert {"128x256x64/s3w8", "128x256x64/s4w8"} <= aligned  # still offered to aligned outputs
    compiled = {r["case"]: r for r in rows if r["target"] == "sm_90"}
    for cfg in offered:
        for launch in static_report.TMA_RAGGED_GATE_LAUNCHES:
            case = static_report.tma_case(cfg, launch).name
            assert case in compiled and compiled[case]["compiled"] and not compiled[case]["spill_bytes"], case


def test_tma_configs_over_the_limit_are_not_offered():
    # the pruning itself: the 128-wide K tiles on 256 columns need 288-416 KB
    import static_report

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
    # stored by bulk tensor copies, on every config offered; a pre-activation keeps the
    # pointer epilogue
    import static_report

    by_name = {r["case"]: r for r in rows if r["target"] == "sm_90"}
    for cfg in static_report.gemm_configs_for(90, tma=True):
        for launch in (static_report.TMA_WGRAD_INTO, *static_report.TMA_STORE_GATE_LAUNCHES):
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


def test_fp8_gemm_runs_on_fp8_tensor_cores_without_spills(rows):
    """scaled_mm's kernel (the pointer GEMM with fp8 operands; issues 17 and 43): wgmma on
    e4m3/e5m2 operands on sm_90 for every config offered to fp8 operands and every GEMM
    Float8Linear launches (static_report.FP8_GEMM_LAUNCHES: forward, dgrad, wgrad adding
    into a fused optimizer's gradient buffer, blockwise; FP8_EMIT_LAUNCHES: the emitting
    epilogue's entry kernel, c_fc writing c_proj's e4m3 input), no spills; it is not offered
    before sm_89 (scaled_mm refuses those GPUs by name)."""
    _needs("sm_89", "sm_90", "sm_100", "sm_120", "gfx950")
    import static_report

    fp8 = [r for r in rows if r["case"].startswith("scaled_mm")]
    # every target whose tensor cores take OCP e4m3: sm_89, sm_90, sm_100, sm_120, gfx950
    planned = {t for t in RUN if static_report.fp8_planned(t)}
    assert (
        {r["target"] for r in fp8} == planned == {"sm_89", "sm_90", "sm_100", "sm_120", "gfx950"} & set(RUN)
    )
    for cc in planned:
        launches = static_report.FP8_GEMM_LAUNCHES
        offered = [static_report.fp8_configs_for(cc, v[3], v[6], v[7]) for v in launches]
        # and the emitting epilogue's entry kernel (scaled_mm(emit_fp8=...)) on a gelu_tanh forward's configs
        offered += [
            static_report.fp8_configs_for(cc, 1, False, "gelu_tanh") for _ in static_report.FP8_EMIT_LAUNCHES
        ]
        of_cc = [r for r in fp8 if r["target"] == cc]
        assert len(of_cc) == sum(len(static_report.swept(o, cc)) for o in offered) and all(offered), cc
    assert {r["kernel"] for r in fp8 if r["case"].startswith("scaled_mm_emit[")} == {"_matmul_emit_kernel"}
    assert any(r["case"].endswith("fp8e5xfp8e4nv->bf16,NT,wgrad,tensor scales,precise,C+=]") for r in fp8)
    for r in fp8:
        assert r["compiled"], f"{_name(r)}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{_name(r)} spills {r['spill_bytes']} B"
        assert _mma(r) > 0 and r["fp8_mma"] > 0, f"{_name(r)}: no fp8 tensor-core instruction"


def test_the_plan_refuses_fp8_on_gfx942():
    # MI300X multiplies the FNUZ formats; tkern casts to OCP e4m3/e5m2 only: its fp8 GEMMs are
    # refused there (float8.fp8_refusal), so the gate plans none (and no TMA on any AMD target)
    import static_report
    import torch

    from tkern.kernels.float8 import fp8_refusal
    from tkern.kernels.gemm_tma import has_tma

    reason = fp8_refusal(static_report.spec_of("gfx942"), "scaled_mm", (torch.float8_e4m3fn,))
    assert reason and "OCP" in reason
    assert not static_report.fp8_planned("gfx942") and static_report.fp8_planned("gfx950")
    assert not any(
        c.name.startswith(("scaled_mm", "blockwise")) for c in static_report.all_cases("gfx942", False)
    )
    for t in AMD:
        assert not has_tma(static_report.spec_of(t))
        assert not any("tma" in c.kernel for c in static_report.all_cases(t, full=False)), t


def test_every_fp8_gemm_loads_both_operands_k_major_through_pipelined_async_copies(rows):
    """Issue 43 item 1: Hopper's fp8 wgmma reads both operands K-major from shared memory;
    an operand that is not is loaded into registers and stored by the threads (no cp.async,
    one stage). Every fp8 GEMM variant the recipes launch (all K-major: the casts write
    each GEMM's layout) loads A and B only through 16-byte cp.async, in >= 3 stages (no
    ld.global of either operand), within the shared memory counted at one byte an element."""
    _needs("sm_89", "sm_90", "sm_100", "sm_120")
    fp8 = [r for r in rows if r["case"].startswith("scaled_mm") and r["compiled"] and r["target"] in NVIDIA]
    assert fp8
    bad = [
        f"{_name(r)}: cp.async {r['cp_async_16']}/{r['cp_async']}, stages {r['num_stages']}, "
        f"ld.global {sorted(set(r['global_access_bits']) & {'a_ptr', 'b_ptr'})}"
        for r in fp8
        if not r["cp_async"]
        or r["cp_async_16"] != r["cp_async"]
        or r["num_stages"] < 3
        or {"a_ptr", "b_ptr"} & set(r["global_access_bits"])
    ]
    assert not bad, "fp8 operands not pipelined through cp.async:\n" + "\n".join(bad)


def test_the_fp8_gradient_gemms_promote_their_accumulators_every_k_tile(rows):
    """Issue 43 item 4: dgrad and wgrad with per-tensor scales compile with
    ``maxNumImpreciseAcc`` = BLOCK_K (<= 128): wgmma's partial sums are added into the fp32
    accumulator every K tile; the forward keeps the fast accumulation (Triton's default on
    sm_90); block scales promote every K tile in the kernel's own code either way."""
    for r in rows:
        if not (r["case"].startswith("scaled_mm") and r["compiled"]) or "tensor scales" not in r["case"]:
            continue
        block_k = int(r["case"].split("[")[1].split("/")[0].split("x")[2])
        if ",precise" in r["case"]:
            assert r["imprecise_acc"] == [block_k] and block_k <= 128, (_name(r), r["imprecise_acc"])
        elif r["target"] == "sm_90":  # the fast accumulation: wgmma's, Triton's default there
            assert all(v > 128 for v in r["imprecise_acc"]), (_name(r), r["imprecise_acc"])


def _blockwise(rows) -> list[dict]:
    return [r for r in rows if r["case"].startswith("blockwise_mm[")]


def test_blockwise_fp8_gemm_compiles_for_hopper_on_tma_without_spills(rows):
    """Issue 43 item 5: the blockwise kernel (gemm_blockwise.py) on every config offered to
    each GEMM of the blockwise recipe (static_report.BLOCKWISE_LAUNCHES: forward with the
    bias, dgrad, wgrad adding into a bf16 gradient buffer): fp8 wgmma, 128-deep K steps
    (one per scale block), both operands through TMA (no cp.async, no ld.global of an
    operand: descriptors) in >= 2 stages, C stored through TMA, no spills, within the
    shared memory; compiled for sm_90 only (descriptors: Hopper)."""
    _needs("sm_90", "sm_100", "sm_120")
    import static_report

    bw = _blockwise(rows)
    tma = {t for t in RUN if static_report.spec_of(t).tma}
    assert {r["target"] for r in bw} == tma == {"sm_90", "sm_100", "sm_120"} & set(RUN)
    for cc in tma:
        launches = static_report.BLOCKWISE_LAUNCHES
        offered = [
            static_report.swept(static_report.blockwise_configs_for(cc, v[1] == 1), cc) for v in launches
        ]
        assert len([r for r in bw if r["target"] == cc]) == sum(map(len, offered)) and all(offered), cc
    for r in bw:
        assert r["compiled"], f"{_name(r)}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{_name(r)} spills {r['spill_bytes']} B"
        assert _mma(r) > 0 and r["fp8_mma"] == _mma(r), f"{_name(r)}: no fp8 tensor-core instruction"
        assert "x128/" in r["case"], f"{_name(r)}: K tile is not the 128-wide scale block"
        assert r["tma_loads"] > 0 and r["cp_async"] == 0 and r["num_stages"] >= 2, _name(r)
        assert not {"a_desc", "b_desc"} & set(r["global_access_bits"]), _name(r)
        assert r["tma_stores"] > 0, _name(r)
        assert r["smem"] <= static_report.smem_limit(r["target"]), _name(r)


def test_accumulator_chaining_gemms_keep_a_wgmma_group_in_flight(rows):
    """What the wgmma wait count shows: Triton makes a loop's ``wgmma`` properly
    asynchronous only when its result is read in the loop as the next dot's accumulator
    (WGMMAPipeline.cpp, dotCanBeProperlyAsync); it then waits with
    ``wgmma.wait_group 1`` inside the K loop (one group in flight while the next one's
    operands arrive) and with 0 after it. scaled_mm's fp8 GEMMs with per-tensor scales
    (fast or promoted accumulation) chain that way; the pointer kernel's block-scaled
    variants (a fresh product scaled per K tile) wait with 0 only."""
    _needs("sm_90")
    fp8 = [r for r in rows if r["case"].startswith("scaled_mm[") and r["compiled"] and r["target"] == "sm_90"]
    tensor = [r for r in fp8 if "tensor scales" in r["case"]]
    block = [r for r in fp8 if "block scales" in r["case"]]
    assert tensor and block
    for r in tensor:
        assert r["wgmma_waits"] and max(r["wgmma_waits"]) >= 1, (_name(r), r["wgmma_waits"])
    for r in block:
        assert set(r["wgmma_waits"]) == {0}, (_name(r), r["wgmma_waits"])


@pytest.mark.xfail(
    strict=True,
    reason="triton 3.9 waits for a wgmma whose result the loop reads other than as the next "
    "dot's accumulator (dotCanBeProperlyAsync): part = dot(a, b) followed by the FMA gets "
    "wgmma.wait_group 0 right after the dot, so no group stays in flight (docs/fp8.md)",
)
def test_blockwise_fp8_gemm_keeps_a_wgmma_group_in_flight(rows):
    """Issue 43 item 5's target: a ``wgmma.wait_group N`` with N >= 1 in every blockwise
    variant (the next block's product running while the threads promote the last one).
    Expected to fail until the compiler (or a warp-specialized kernel) allows it; strict, so
    that a Triton that does keeps a group in flight turns this into a failure to update."""
    _needs("sm_90")
    bw = [r for r in _blockwise(rows) if r["compiled"] and r["target"] == "sm_90"]
    assert bw
    for r in bw:
        assert max(r["wgmma_waits"]) >= 1, (_name(r), r["wgmma_waits"])


def test_fp8_gemm_on_ada_uses_fp8_mma_sync():
    """sm_89 (Ada: fp8 tensor cores without wgmma): scaled_mm's kernel, on the configs it is
    offered there, compiles to ``mma.sync`` on e4m3 operands (each of Float8Linear's GEMMs on
    the first offered config, the forward on the largest) with no spills (issue 17)."""
    import static_report

    cases = static_report._fp8_gemm_cases(89)
    first = {}  # each launch's first offered config
    for case in cases:
        first.setdefault(case.name.split(",", 1)[1], case)
    assert len(first) == len(static_report.FP8_GEMM_LAUNCHES)
    largest = max(cases, key=lambda c: c.constexprs["BLOCK_M"] * c.constexprs["BLOCK_N"])
    for case in [*first.values(), largest]:
        r = static_report.compile_case(case, 89, sass=False)
        assert r["compiled"], f"{case.name}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{case.name} spills {r['spill_bytes']} B on sm_89"
        assert r["mma_sync"] > 0 and r["fp8_mma"] > 0 and r["wgmma"] == 0, f"{case.name}: no fp8 mma.sync"


def test_fp8_cast_kernels_compile_without_spills():
    """tkern's fp8 casts (issues 17 and 43) for sm_90 and sm_89: bf16 to e4m3 and e5m2, the
    per-tensor cast's amax pass and its one pass writing x and x^T (dY: and the bias
    gradient), delayed scaling rolling its histories in the same launch, 1x128 tiles and
    128x128 blocks (W and W^T), the history roll; every one compiles with no spills."""
    import static_report

    for cc in (90, 89):
        for case in static_report.fp8_cast_cases():
            r = static_report.compile_case(case, cc, sass=False)
            assert r["compiled"], f"{case.name} on sm_{cc}: {r.get('error')}"
            assert r["spill_bytes"] == 0, f"{case.name} spills {r['spill_bytes']} B on sm_{cc}"


# --------------------------------------------------------------------------- cross-entropy (issue 28)


def test_cross_entropy_kernel_compiles_without_spills(rows):
    """tkern.cross_entropy's and linear_cross_entropy's launches (static_report.cross_entropy_cases:
    fp16/bf16/fp32 logits, the forward, the backward from lse, the fused linear launch, the
    plainest and every option on) for every target: every one compiles with no spills.
    They are in all_cases too (the report and the fixture's gate set)."""
    import static_report

    cases = static_report.cross_entropy_cases()
    assert {c.name for c in cases} >= {
        "cross_entropy_fwd[bf16]",
        "linear_cross_entropy[fp32->bf16,weight,smoothing,z]",
    }
    by = {(r["case"], r["target"]): r for r in rows}
    for cc in RUN:
        for case in cases:
            r = by[case.name, cc]
            assert r["compiled"], f"{case.name} on {cc}: {r.get('error')}"
            assert r["spill_bytes"] == 0, f"{case.name} spills {r['spill_bytes']} B on {cc}"


# --------------------------------------------------------------------------- health (issue 37 item 7)


def test_underflow_kernel_compiles_without_spills_at_full_width(rows):
    """The sampled zero/subnormal count (``opt.track_underflows``): fp16, bf16 and fp32
    gradients and a ragged tail, for every target; every one compiles with no spills,
    the aligned ones read the gradients in full-width (128-bit) loads and keep at least
    half the warp slots busy. They are in all_cases too (the fixture's gate set)."""
    import static_report

    cases = [c for c in static_report._stats_cases() if c.name.startswith("grad_underflow[")]
    assert {c.name for c in cases} == {
        "grad_underflow[fp16]", "grad_underflow[bf16]", "grad_underflow[fp32]", "grad_underflow[fp16,tail]"
    }  # fmt: skip
    by = {(r["case"], r["target"]): r for r in rows}
    for cc in RUN:
        for case in cases:
            r = by[case.name, cc]
            where = f"{case.name} on {cc}"
            assert r["compiled"], f"{where}: {r.get('error')}"
            assert r["spill_bytes"] == 0, f"{where} spills {r['spill_bytes']} B"
            if case.gated and cc in NVIDIA:
                assert set(r["global_access_bits"]["grad_ptr"]) == {128}, (where, r["global_access_bits"])
                assert r["occupancy_pct"] >= MIN_STREAMING_OCCUPANCY, (where, r["regs"], r["occupancy_pct"])
