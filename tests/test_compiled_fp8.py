"""The compile gate's fp8 half: scaled_mm's GEMMs (tensorwise and rowwise scales, the
emitting epilogue), the blockwise kernel and the fp8 casts compiled ahead of time, without a
GPU, for every target whose tensor cores take tkern's OCP e4m3 (sm_89, sm_90, sm_100, sm_120,
gfx950), and their machine code held to Float8Linear's needs (issues 17 and 43).

Compiled mode only, no GPU: tests/test_compiled.py's marks and its rows (one compile of every
target's cases per process)::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled_fp8.py
"""

from __future__ import annotations

import pytest
import test_compiled
from aot_fp8_cases import fnuz_name, in_fnuz
from test_compiled import NVIDIA, RUN, _mma, _name, _needs, every_config, gate_cases, static_report

# compiled mode, no GPU: the compile gate's own marks
pytestmark = test_compiled.pytestmark


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return list(test_compiled.gate_rows())


def test_fp8_gemm_runs_on_fp8_tensor_cores_without_spills(rows):
    """scaled_mm's kernel (the pointer GEMM with fp8 operands; issues 17 and 43): wgmma on
    e4m3/e5m2 operands on sm_90 for every config offered to fp8 operands and every GEMM
    Float8Linear launches (static_report.FP8_GEMM_LAUNCHES: forward, dgrad, wgrad adding
    into a fused optimizer's gradient buffer, blockwise; FP8_EMIT_LAUNCHES: the emitting
    epilogue's entry kernel, c_fc writing c_proj's e4m3 input), no spills; it is not offered
    before sm_89 (scaled_mm refuses those GPUs by name)."""
    _needs("sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
    fp8 = [r for r in rows if r["case"].startswith("scaled_mm")]
    # every target with fp8 tensor cores: sm_89, sm_90, sm_100, sm_120, gfx950 (OCP), gfx942 (FNUZ)
    planned = {t for t in RUN if static_report.fp8_planned(t)}
    assert (
        {r["target"] for r in fp8}
        == planned
        == {"sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950"} & set(RUN)
    )
    for cc in planned:
        of_cc = {r["case"] for r in fp8 if r["target"] == cc}
        assert of_cc == {n for n in gate_cases(cc) if n.startswith("scaled_mm")}, cc
        # the launches that set a config's spill bound on every config offered to them (all
        # of them where every config is compiled), each launch on its first offered config
        for launch in static_report.FP8_GEMM_LAUNCHES:
            offered = static_report.fp8_configs_for(cc, launch[3], launch[6], launch[7])
            if launch in static_report.FP8_HEAVIEST:
                expected = offered if every_config(cc) else offered[:1]
            else:
                expected = offered[:1] if every_config(cc) else []
            as_launched = fnuz_name if cc == "gfx942" else str  # gfx942 multiplies FNUZ
            for cfg in expected:
                assert as_launched(static_report.fp8_case_name(cfg, launch)) in of_cc, (cc, cfg, launch)
        # and the emitting epilogue's entry kernel (scaled_mm(emit_fp8=...)), its tanh-GELU forward's configs
        for scaling, store_t in static_report.FP8_EMIT_LAUNCHES:
            offered = static_report.emit_configs_for(cc, scaling)
            assert offered, (cc, scaling)
            if store_t:
                for cfg in offered if every_config(cc) else offered[:1]:
                    name = f"scaled_mm_emit[{static_report.cfg_name(cfg.kwargs, cfg)},"
                    assert any(n.startswith(name) and f"emit {scaling},C^T]" in n for n in of_cc), (cc, cfg)
    assert {r["kernel"] for r in fp8 if r["case"].startswith("scaled_mm_emit[")} == {"_matmul_emit_kernel"}
    if any(
        every_config(t) for t in planned
    ):  # the promoted wgrad into a gradient buffer: on its first config
        assert any(r["case"].endswith("fp8e5xfp8e4nv->bf16,NT,wgrad,tensor scales,precise,C+=]") for r in fp8)
    for r in fp8:
        assert r["compiled"], f"{_name(r)}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{_name(r)} spills {r['spill_bytes']} B"
        assert _mma(r) > 0 and r["fp8_mma"] > 0, f"{_name(r)}: no fp8 tensor-core instruction"


def test_gfx942_plans_fp8_in_fnuz_and_no_amd_target_plans_tma():
    # MI300X multiplies the FNUZ formats, and tkern casts to them there (float8.native_formats):
    # every fp8 case the gate compiles for gfx942 has FNUZ pointers and constants (aot_fp8_cases.
    # in_fnuz), none an OCP one; its GEMMs' fp8 MFMA is held by the test above
    import torch

    from tkern.kernels.float8 import FP8_MAX
    from tkern.kernels.gemm_tma import has_tma

    assert static_report.fp8_planned("gfx942") and static_report.fp8_planned("gfx950")
    cases = static_report.all_cases("gfx942", False)
    fp8 = [c for c in cases if any("fp8" in v for v in c.signature.values())]
    assert any(c.name.startswith("scaled_mm[") for c in fp8) and any("cast" in c.name for c in fp8)
    assert all("fp8e4nv" not in str(c.signature) and "fp8e5'" not in str(c.signature) for c in fp8)
    assert all(
        c.constexprs.get("FP8_MAX") in (None, FP8_MAX[torch.float8_e4m3fnuz], FP8_MAX[torch.float8_e5m2fnuz])
        for c in fp8
    )
    assert any(c.constexprs.get("FP8_MAX") == 240.0 for c in fp8)
    for t in ("gfx942", "gfx950"):
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
    shared memory; compiled where the target has TMA (descriptors: sm_90 and newer NVIDIA),
    every config where the gate compiles every config, the first elsewhere."""
    _needs("sm_90", "sm_100", "sm_120")
    bw = _blockwise(rows)
    tma = {t for t in RUN if static_report.spec_of(t).tma}
    assert {r["target"] for r in bw} == tma == {"sm_90", "sm_100", "sm_120"} & set(RUN)
    for cc in tma:
        launches = static_report.BLOCKWISE_LAUNCHES
        offered = [static_report.blockwise_configs_for(cc, v[1] == 1, v[3]) for v in launches]
        offered = [o if every_config(cc) else o[:1] for o in offered]
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
    the first offered config, the forward on the largest) with no spills (issue 17); the
    ones the gate's rows lack compiled here on both cores (the others come from Triton's cache)."""
    _needs("sm_89")
    cases = static_report._fp8_gemm_cases(89)
    first = {}  # each launch's first offered config
    for case in cases:
        first.setdefault(case.name.split(",", 1)[1], case)
    assert len(first) == len(static_report.FP8_GEMM_LAUNCHES)
    largest = max(cases, key=lambda c: c.constexprs["BLOCK_M"] * c.constexprs["BLOCK_N"])
    chosen = [*first.values(), largest]
    for case, r in zip(chosen, static_report.compile_all([(c, 89, False) for c in chosen], 2), strict=True):
        assert r["compiled"], f"{case.name}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{case.name} spills {r['spill_bytes']} B on sm_89"
        assert r["mma_sync"] > 0 and r["fp8_mma"] > 0 and r["wgmma"] == 0, f"{case.name}: no fp8 mma.sync"


def test_fp8_cast_kernels_compile_without_spills(rows):
    """tkern's fp8 casts (issues 17 and 43) on every target fp8 is planned on: bf16 to e4m3
    (and e5m2 where every variant is compiled), the per-tensor cast's amax pass and its one
    pass writing x and x^T (dY: and the bias gradient), delayed scaling rolling its histories
    in the same launch, 1x128 tiles and 128x128 blocks (W and W^T), the history roll, the
    norm writing the next GEMM's fp8 input; every one compiles with no spills. They are in
    all_cases (the gate's rows) where fp8 is planned."""
    _needs("sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
    for cc in (t for t in RUN if static_report.fp8_planned(t)):
        as_launched = in_fnuz if cc == "gfx942" else (lambda c: c)  # gfx942 casts to FNUZ
        casts = {(c := as_launched(case)).name: c for case in static_report.fp8_cast_cases()}
        of_cc = {r["case"]: r for r in rows if r["target"] == cc and r["family"] == "fp8cast"}
        expected = {n for n, c in casts.items() if static_report.every_variant(cc) or not c.light}
        assert expected and expected <= set(of_cc), (cc, sorted(expected - set(of_cc)))
        assert any("e5m2" in n for n in expected) == static_report.every_variant(cc), cc
        for name, r in of_cc.items():
            assert r["compiled"], f"{name} on {cc}: {r.get('error')}"
            assert r["spill_bytes"] == 0, f"{name} spills {r['spill_bytes']} B on {cc}"
