"""The dgrad epilogue's act' (issue 54 item 5: ``GRAD_ACT``) compiled ahead of time, without a
GPU, on every target's GEMMs (the pointer kernel; the TMA kernel where the target has TMA):
every config tkern's autotuner offers such a launch (gemm_configs.prune_configs, the ``GRAD_ACT``
code counted as an epilogue activation) compiles without spilling registers and on the
target's tensor cores, every config where the gate compiles every config, the first elsewhere.

The launch is the dgrad of an MLP's second layer (``dY (M, 768) @ W (768, 3072)``, aligned)
writing dZ over the stored pre-activation, with W row-major (``nn.Linear``'s weight) and, for
GPT-2's tanh-GELU, column-major too (Conv1D's (in, out) weight read transposed in place):
aot_gemm_cases.DGRAD_EPILOGUE_LAUNCHES, compiled in the gate's rows (aot_gemm_sweep). The
gated unit's (``GRAD_GLU``: down's dgrad reading gate and up and writing both gradients,
aot_gemm_cases.GLU_DGRAD_LAUNCHES) is compiled on the same configs as the heaviest act', and
the residual stream's add in the block's last GEMM (``ADD_RESIDUAL``, RESIDUAL_LAUNCHES) on
the first config of each kernel, as is the fused loss's logits GEMM writing its row statistics
(``ROW_STATS``, ROW_STATS_LAUNCHES). The gated unit's forward in the up GEMM (``GLU_FWD``: up
stored beside the gate, the gate read, h stored; GLU_FWD_LAUNCHES) is SwiGLU's on the same
configs as GRAD_GLU, with and without a bias, and GeGLU's on the first.
Compiled mode only (``TRITON_INTERPRET=0``), as tests/test_compiled.py::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled_dact.py
"""

from __future__ import annotations

import pytest
import test_compiled
from test_compiled import RUN, _mma, _name, every_config, every_variant, static_report

# compiled mode, no GPU: the compile gate's own marks
pytestmark = test_compiled.pytestmark

#: The dgrad epilogue's case labels (GemmLaunch.label's suffix)
DACT = ",dZ=dY*"
#: The residual add's (ADD_RESIDUAL) case labels
RESIDUAL = ",+residual"
#: The gated unit's forward's (GLU_FWD) case labels
GLU_FWD = "(G)*U]"
#: The logits GEMM's row statistics' (ROW_STATS) case labels
ROW_STATS = ",row stats]"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return list(test_compiled.gate_rows())


def test_dgrad_epilogue_variants_compile_without_spills(rows):
    dact = [r for r in rows if any(label in r["case"] for label in (DACT, RESIDUAL, GLU_FWD, ROW_STATS))]
    assert {r["target"] for r in dact} == set(RUN)
    for r in dact:
        assert r["compiled"], f"{_name(r)}: {r.get('error')}"
        assert r["spill_bytes"] == 0, f"{_name(r)} spills {r['spill_bytes']} B"
        assert _mma(r) > 0, f"{_name(r)}: no tensor-core instruction of the target"  # wgmma on Hopper


def test_every_offered_config_takes_the_heaviest_dgrad_epilogue(rows):
    # erf GELU's act' where its tile rule offers the config, tanh-GELU's elsewhere, on every
    # config (the first elsewhere); every other variant (W column-major: Conv1D's) on the first
    compiled = {(r["case"], r["target"]) for r in rows if r["compiled"]}
    for cc in RUN:
        kinds = [("pointer", static_report.pointer_case, static_report.gemm_configs_for(cc))]
        if static_report.spec_of(cc).tma:
            kinds.append(("tma", static_report.tma_case, static_report.gemm_configs_for(cc, tma=True)))
        for kind, case, configs in kinds:
            tma = kind == "tma"
            for cfg in configs if every_config(cc) else configs[:1]:
                candidates = static_report.DGRAD_EPILOGUE_LAUNCHES[:2]
                heaviest = [v for v in candidates if static_report.offered(cc, cfg, v, tma)][:1]
                assert heaviest and (case(cfg, heaviest[0]).name, cc) in compiled, (cc, kind, cfg)
                # the gated unit's backward and SwiGLU's forward, on every config too
                for v in (*static_report.GLU_DGRAD_LAUNCHES, *static_report.GLU_FWD_LAUNCHES[:2]):
                    if static_report.offered(cc, cfg, v, tma):
                        assert (case(cfg, v).name, cc) in compiled, (cc, kind, cfg, v.label)
            if every_config(cc):
                names = [n for n, t in compiled if t == cc and DACT in n]
                for v in static_report.DGRAD_EPILOGUE_LAUNCHES:
                    assert any(n.endswith(v.label + "]") for n in names), (cc, v)
            rest = (*static_report.RESIDUAL_LAUNCHES, *static_report.ROW_STATS_LAUNCHES)
            for v in rest if every_variant(cc) else ():  # first config
                assert (case(configs[0], v).name, cc) in compiled, (cc, kind, v.label)
            if every_config(cc):  # GeGLU's forward on the first config offered to it
                v = static_report.GLU_FWD_LAUNCHES[2]
                first = next(c for c in configs if static_report.offered(cc, c, v, tma))
                assert (case(first, v).name, cc) in compiled, (cc, kind, v.label)
