"""Which GEMM launches the compile gate compiles on a target, and on which configs.

Each GEMM family's launches are split in two: the heaviest, the ones that set a config's
spill bound (measured: the most registers of any launch of their kind on every offered
config), and the others. Where the gate compiles every config (:data:`aot_targets.EVERY_CONFIG`:
sm_90 and sm_100 under Triton 3.7+) every offered config is compiled on the heaviest and the
first config on the others too; elsewhere, and under Triton 3.6, the first config on the
heaviest (:func:`aot_targets.sweep`); the full report compiles every config on both. A
launch whose tile rule prunes a config (gemm_configs.prune_configs) is replaced by the
heaviest of its kind the config is still offered to.
"""

from __future__ import annotations

import dataclasses

from aot_gemm_cases import (
    BACKWARD,
    CONV1D_WGRAD_INTO,
    DGRAD_EPILOGUE_LAUNCHES,
    FORWARD_HEAVIEST,
    GLU_DGRAD_LAUNCHES,
    GLU_FWD_LAUNCHES,
    RESIDUAL_LAUNCHES,
    ROW_STATS_LAUNCHES,
    TMA_CONV1D_WGRAD_INTO,
    TMA_RAGGED_GATE_LAUNCHES,
    TMA_STORE_GATE_LAUNCHES,
    TMA_WGRAD_INTO,
    GemmLaunch,
    gate_launches,
    gemm_configs_for,
    linear_launches,
    pointer_case,
    tma_case,
)
from aot_targets import _SIZE, FIRST_CONFIG, REPORT, Case, cfg_name, sweep


def _code(name: str) -> int:
    from tkern.kernels.activation import ACTIVATIONS

    return ACTIVATIONS[name]


def offered(cc, cfg, v: GemmLaunch, tma: bool = False) -> bool:
    """Whether tkern's autotuner offers ``cfg`` to launch ``v`` on target ``cc``."""
    act = v.act or v.grad_act or v.glu_fwd  # an epilogue's act' (or act(gate)) is pruned as an activation is
    rules = dict(tma=tma, ragged=v.ragged, activation=act, prologue=v.a_act, sum_a=v.sum_a is not None)
    rules.update(accumulate=v.accumulate, store_preact=v.preact, out_bytes=_SIZE[v.out])
    configs = gemm_configs_for(cc, **rules)
    return cfg_name(cfg.kwargs, cfg) in {cfg_name(c.kwargs, c) for c in configs}


def _first_offered(cc, cfg, candidates, tma: bool = False) -> list[GemmLaunch]:
    """The first of ``candidates`` (heaviest first) offered ``cfg``, as a list (empty: none)."""
    return next(([v] for v in candidates if offered(cc, cfg, v, tma)), [])


def _replace(launches, **changes) -> list[GemmLaunch]:
    return [dataclasses.replace(v, **changes) for v in launches]


def prologue_launches(cc, cfg, ragged: bool = False, public: bool = False) -> tuple[list, list]:
    """The backward GEMMs with an operand prologue (gemm.matmul_backward) as (heaviest,
    others) for ``cfg``. The heaviest: wgrad summing a stored dZ in fp32, with ``C +=`` (the
    most registers of the two where they near the limit: 237-239 on sm_90's 128x128x64/s4w4
    and 256x128x64), and for the heaviest gradient ``cfg`` is offered (GELU': erf and exp on
    every element of A, before ReLU': a select) wgrad summing dbias in bf16 with ``C +=`` and
    dgrad storing dZ (the ragged dgrad's 255 registers on sm_90's 64x32x32). The others, on
    the first config: the two wgrads without ``C +=``, the lighter gradient's three. Each
    where the autotuner offers ``cfg`` to it. ``public``: ReLU's gradient alone, the one
    tkern.linear applies in the prologue (ops.linear.PROLOGUE_ACTIVATIONS; GELU's is
    gemm.matmul_backward's)."""
    wgrad = GemmLaunch("bf16", "bf16", layout="TN", ragged=ragged, sum_a="fp32")
    codes = (_code("relu"),) if public else (_code("gelu"), _code("relu"))
    grads = [a for a in codes if offered(cc, cfg, dataclasses.replace(wgrad, a_act=a))]

    def with_grad(act: int) -> list[GemmLaunch]:
        w = GemmLaunch("bf16", "bf16", layout="TN", ragged=ragged, a_act=act, sum_a="bf16")
        return [dataclasses.replace(w, accumulate=True, add_sum=True), GemmLaunch("bf16", "bf16", layout="NN",
                ragged=ragged, a_act=act, store_a=True), w]  # fmt: skip

    # with C += the row sums are added into the bias's flat view too (ADD_SUM: one load more)
    sums = [dataclasses.replace(wgrad, accumulate=True, add_sum=True), wgrad]
    heavy, light = [sums[0], *with_grad(grads[0])[:2]] if grads else sums[:1], [sums[1]]
    light += with_grad(grads[0])[2:] if grads else []
    light += [v for a in grads[1:] for v in with_grad(a)]
    return [v for v in heavy if offered(cc, cfg, v)], [v for v in light if offered(cc, cfg, v)]


def dgrad_epilogue_launches(cc, cfg, tma: bool = False) -> tuple[list, list]:
    """The dgrad epilogue's act' (:data:`DGRAD_EPILOGUE_LAUNCHES`) as (heaviest, others) for
    ``cfg``: erf GELU's where its tile rule offers ``cfg`` (an epilogue's act' is pruned as an
    activation is), else tanh-GELU's, and the gated unit's (:data:`GLU_DGRAD_LAUNCHES`: two
    tiles read and two stored; 242-251 registers on sm_90's 128x256 and 4-warp 128x128 tiles,
    triton 3.9); the rest on the first config, with the residual add's forward
    (:data:`RESIDUAL_LAUNCHES`: one tile more read, 40-188 registers on every sm_90 / sm_100
    config) and the fused loss's logits GEMM writing its row statistics
    (:data:`ROW_STATS_LAUNCHES`)."""
    heaviest = _first_offered(cc, cfg, DGRAD_EPILOGUE_LAUNCHES[:2], tma)
    heaviest += [v for v in GLU_DGRAD_LAUNCHES if offered(cc, cfg, v, tma)]
    rest = (*DGRAD_EPILOGUE_LAUNCHES, *RESIDUAL_LAUNCHES, *ROW_STATS_LAUNCHES)
    return heaviest, [v for v in rest if v not in heaviest]


def glu_forward_launches(cc, cfg, tma: bool = False) -> tuple[list, list]:
    """The gated unit's forward in the up GEMM (:data:`GLU_FWD_LAUNCHES`: one tile read and two
    stored) as (heaviest, others) for ``cfg``: SwiGLU's with and without a bias where the
    autotuner offers ``cfg`` to them; GeGLU's on the first config."""
    heaviest = [v for v in GLU_FWD_LAUNCHES[:2] if offered(cc, cfg, v, tma)]
    return heaviest, [v for v in GLU_FWD_LAUNCHES[2:] if offered(cc, cfg, v, tma)]


#: The forwards of :data:`FORWARD_HEAVIEST` that set a pointer-kernel config's spill bound
#: (bf16 out with a bias, fp32 out without one; the other two on the first config): with GELU
#: they reach the most registers of the four, or within 2-24 of it far from the limit (sm_90,
#: triton 3.9: the 254-255 of the ragged tiles, 222-224 of the 128-value ones; 134 vs 158 on
#: 128x64x32), and on the first configs of sm_100, gfx942 and gfx950 alike.
FORWARD_SPILL_BOUND = (FORWARD_HEAVIEST[0], FORWARD_HEAVIEST[3])


def pointer_heaviest(cc, cfg, ragged: bool = False, public: bool = False) -> list[GemmLaunch]:
    """The pointer kernel's launches that set ``cfg``'s spill bound on ``cc``:
    :data:`FORWARD_SPILL_BOUND` with GELU (ReLU where GELU's rule prunes ``cfg``), on ragged
    operands the plain backward GEMMs, the prologue's heaviest (``public``: of tkern.linear's,
    :func:`prologue_launches`), the dgrad epilogue's."""
    relu = _code("relu")
    forward = [
        v
        for f in FORWARD_SPILL_BOUND
        for v in _first_offered(cc, cfg, _replace([f, _replace([f], act=relu)[0]], ragged=ragged))
    ]
    backward = _replace(BACKWARD, ragged=True) if ragged else []
    dact = [] if ragged else [*dgrad_epilogue_launches(cc, cfg)[0], *glu_forward_launches(cc, cfg)[0]]
    return [*forward, *backward, *prologue_launches(cc, cfg, ragged, public)[0], *dact]


def pointer_others(cc, cfg, ragged: bool = False) -> list[GemmLaunch]:
    """The pointer kernel's other gate launches: the two other GELU forwards, SiLU's and
    tanh-GELU's four, the prologue's others, the other dgrad epilogues, a Conv1D weight's
    wgrad into its transposed flat view (:data:`CONV1D_WGRAD_INTO`)."""
    relu = _code("relu")
    gelu = [f for f in FORWARD_HEAVIEST if f not in FORWARD_SPILL_BOUND]
    forward = [
        v
        for f in gelu
        for v in _first_offered(cc, cfg, _replace([f, _replace([f], act=relu)[0]], ragged=ragged))
    ]
    for act in ("silu", "gelu_tanh"):
        forward += _replace(FORWARD_HEAVIEST, act=_code(act), ragged=ragged)
    dact = [] if ragged else [*dgrad_epilogue_launches(cc, cfg)[1], *glu_forward_launches(cc, cfg)[1]]
    conv1d = [] if ragged else [v for v in CONV1D_WGRAD_INTO if offered(cc, cfg, v)]
    return [*forward, *prologue_launches(cc, cfg, ragged)[1], *dact, *conv1d]


def tma_heaviest(cc, cfg) -> list[GemmLaunch]:
    """The TMA kernel's launches that set ``cfg``'s spill bound: the GELU forwards without a
    bias (bf16 and fp32 out: the most registers on every offered config, sm_90 triton 3.9,
    the bias 4-5 fewer), the wgrad adding into a flat buffer (through the TMA-store
    epilogue), the dgrad epilogue's heaviest act'."""
    forward = [v for v in FORWARD_HEAVIEST if v.bias is None and offered(cc, cfg, v, tma=True)]
    into = _first_offered(cc, cfg, [TMA_WGRAD_INTO], tma=True)  # C's old tile staged: where it fits
    glu = glu_forward_launches(cc, cfg, tma=True)[0]
    return [*forward, *into, *dgrad_epilogue_launches(cc, cfg, tma=True)[0], *glu]


def tma_others(cc, cfg) -> list[GemmLaunch]:
    """The TMA kernel's other gate launches: the GELU forwards with a bias, the TMA-store
    forwards, SiLU and tanh-GELU (bf16, no bias: their epilogue is the pointer kernel's,
    compiled there in every variant), the TN layout once, the other dgrad epilogues, a Conv1D
    weight's wgrad into its transposed flat view (the pointer epilogue)."""
    acts = [dataclasses.replace(FORWARD_HEAVIEST[1], act=_code(a)) for a in ("silu", "gelu_tanh")]
    bias = [v for v in FORWARD_HEAVIEST if v.bias is not None and offered(cc, cfg, v, tma=True)]
    layout = dataclasses.replace(FORWARD_HEAVIEST[0], layout="TN")  # it changes the loads, not the epilogue
    conv1d = [v for v in TMA_CONV1D_WGRAD_INTO if offered(cc, cfg, v, tma=True)]
    dact = [*dgrad_epilogue_launches(cc, cfg, tma=True)[1], *glu_forward_launches(cc, cfg, tma=True)[1]]
    return [*bias, *TMA_STORE_GATE_LAUNCHES, *acts, layout, *dact, *conv1d]


def pointer_cases(cc, level: str) -> list[Case]:
    """The pointer kernel's gate cases on ``cc`` at ``level``, aligned and ragged (:func:`sweep`);
    in the report also every other launch of tkern.linear on the first config offered to it."""
    cases, public = [], level == FIRST_CONFIG  # one config per launch: what tkern.linear launches
    for ragged in (False, True):
        pairs = sweep(
            gemm_configs_for(cc, ragged=ragged),
            level,
            lambda c, r=ragged: pointer_heaviest(cc, c, r, public),
            lambda c, r=ragged: pointer_others(cc, c, r),
        )
        cases += [pointer_case(cfg, v, gated=not ragged) for cfg, v in pairs]
    if level == REPORT:
        cases += [
            pointer_case(gemm_configs_for(cc, activation=v.act, prologue=v.a_act)[0], v)
            for v in linear_launches()
            if v not in gate_launches()
        ]
    return cases


def tma_cases(cc, level: str) -> list[Case]:
    """The TMA kernel's gate cases on ``cc`` (a target with TMA) at ``level``: aligned
    (:func:`tma_heaviest`, :func:`tma_others`) and a ragged output (every config offered to
    GELU there: gemm_configs.prune_configs drops the 128x256 tiles that spill, on
    tkern.linear's forwards, :data:`TMA_RAGGED_GATE_LAUNCHES`)."""
    configs = gemm_configs_for(cc, tma=True)
    pairs = sweep(configs, level, lambda c: tma_heaviest(cc, c), lambda c: tma_others(cc, c))
    ragged = gemm_configs_for(cc, tma=True, ragged=True, activation=_code("gelu"))
    pairs += sweep(ragged, level, lambda c: TMA_RAGGED_GATE_LAUNCHES)
    cases = [tma_case(cfg, v) for cfg, v in pairs]
    if level == REPORT:
        cases += [tma_case(configs[0], v) for v in linear_launches() if v not in gate_launches()]
    return cases
