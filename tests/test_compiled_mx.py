"""The MX kernels compiled ahead of time (no GPU): the GEMM becomes Blackwell's block-scaled
``tcgen05.mma`` and MI355X's ``v_mfma_scale`` on every target whose spec has native MX (sm_100,
gfx950), the casts compile for every target fp8 is planned on; none spills.

Compiled mode only, no GPU, and the gate's own rows: tests/test_compiled.py's marks and cases
(aot_fp8_cases.mx_gemm_cases, mx_cast_cases in static_report.all_cases)::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled_mx.py
"""

from __future__ import annotations

import pytest
import test_compiled
from test_compiled import RUN, _name, _needs, static_report

# compiled mode, no GPU: the compile gate's own marks
pytestmark = test_compiled.pytestmark


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return list(test_compiled.gate_rows())


def test_mx_gemm_is_native_block_scaled(rows):
    # sm_100's tcgen05.mma ... kind::mxf8f6f4.block_scale, gfx950's v_mfma_scale_*: on every
    # config the MX autotuner offers (gemm_mx.mx_configs), where the spec has native MX
    _needs("sm_100", "gfx950")
    from tkern.kernels.gemm_mx import mx_configs

    mx = [r for r in rows if r["kernel"] == "_scaled_mm_mx_kernel"]
    native = {t for t in RUN if static_report.spec_of(t).mx}
    assert {r["target"] for r in mx} == native == {"sm_100", "gfx950"} & set(RUN)
    for cc in native:
        assert len([r for r in mx if r["target"] == cc]) == len(mx_configs()), cc
    for r in mx:
        assert r["compiled"], f"{_name(r)}: {r.get('error')}"
        assert r["mx_mma"] > 0, f"{_name(r)}: no native block-scaled MMA"
        assert r["spill_bytes"] == 0, f"{_name(r)} spills {r['spill_bytes']} B"


def test_mx_casts_compile_without_spills(rows):
    # the one-pass pair (blocks along C and along R, the weight's two MX casts), RCEIL (the
    # longer arithmetic), the launcher's tile: on every target fp8 is planned on
    _needs("sm_89", "sm_90", "sm_100", "sm_120", "gfx950")
    casts = [r for r in rows if r["kernel"] == "_to_mx_kernel"]
    assert {r["target"] for r in casts} == {t for t in RUN if static_report.fp8_planned(t)}
    for r in casts:
        assert r["compiled"], f"{_name(r)}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{_name(r)} spills {r['spill_bytes']} B"
