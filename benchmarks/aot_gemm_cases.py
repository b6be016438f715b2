"""The GEMM launches tkern's public API makes, as static_report compiles them: the
configs each autotuner offers on a target, the launches of tkern.linear and its
backward (:class:`GemmLaunch`), the compile gate's heaviest ones, and the pointer,
TMA and split-K kernels' cases for them.
"""

from __future__ import annotations

import dataclasses

from aot_targets import (
    _TL_NAME,
    REPORT,
    Case,
    _kernel_fn,
    _order,
    _ptr,
    _tl,
    cfg_name,
    launch_configs,
    offered_configs,
)


def _gemm_sig(dtype, out, bias_dtype, preact, tma=None, sum_dtype=None):
    sig = {}
    if tma:
        bm, bn, bk, a_t, b_t = tma
        sig["a_desc"] = f"tensordesc<{dtype}[{bk}, {bm}]>" if a_t else f"tensordesc<{dtype}[{bm}, {bk}]>"
        sig["b_desc"] = f"tensordesc<{dtype}[{bn}, {bk}]>" if b_t else f"tensordesc<{dtype}[{bk}, {bn}]>"
        sig["c_desc"] = _ptr(out)  # tma_case makes it a descriptor for the TMA-store epilogue
    else:
        sig.update(a_ptr=_ptr(dtype), b_ptr=_ptr(dtype))
    sig.update(c_ptr=_ptr(out), bias_ptr=_ptr(bias_dtype or out), preact_ptr=_ptr(dtype if preact else out))
    sig.update(M="i32", N="i32", K="i32")
    if not tma:  # the fp8 scales' arguments (unused unless SCALE_A / SCALE_B say otherwise)
        sig.update(scale_a_ptr="*fp32", scale_b_ptr="*fp32")
        for name in ("stride_sam", "stride_sak", "stride_sbk", "stride_sbn"):
            sig[name] = "i32"
        for name in ("block_am", "block_ak", "block_bk", "block_bn"):
            sig[name] = "i32"
        # the operand prologue's pointers (unused unless A_ACT / STORE_A / SUM_A)
        sig.update(z_ptr=_ptr(dtype), a_out_ptr=_ptr(dtype), a_sum_ptr=_ptr(sum_dtype or "fp32"))
    return sig


def _c_strides(out_t: bool) -> tuple[str, str]:
    """``(the unit stride, the other)`` of C's two: ``stride_cn`` is 1 for a row-major C, and
    ``stride_cm`` for a column-major one (``out_t``: a Conv1D weight's transposed flat view),
    specialised to the constant 1 as Triton's launcher does."""
    return ("stride_cm", "stride_cn") if out_t else ("stride_cn", "stride_cm")


POINTER_KERNEL = "tkern.kernels.gemm:_matmul_kernel"
TMA_KERNEL = "tkern.kernels.gemm_tma:_matmul_tma_kernel"


def gemm_configs_for(
    cc: int,
    tma: bool = False,
    ragged: bool = False,
    activation: int = 0,
    prologue: int = 0,
    fp8: bool = False,
    two_accumulators: bool = False,
    block_scales: bool = False,
    emit_delayed: bool = False,
    sum_a: bool = False,
    accumulate: bool = False,
    store_preact: bool = False,
    out_bytes: int = 2,
) -> list:
    """The configs tkern's autotuner offers on target ``cc`` (after its own pruning),
    for launches whose epilogue applies ``activation`` (an ACTIVATIONS code), with
    the operand ``prologue`` (an ``A_ACT`` code) or none; ``fp8``: scaled_mm's
    (gemm_configs.fp8_gemm_configs, one byte an element), ``two_accumulators`` for
    its launches promoting every K tile (PRECISE_ACC or block scales)."""
    from tkern.kernels import gemm_configs

    if fp8:
        fp8_configs = gemm_configs.fp8_gemm_configs()
        return offered_configs(
            fp8_configs,
            cc,
            ragged=ragged,
            activation=activation,
            elem_bytes=1,
            two_accumulators=two_accumulators,
            block_scales=block_scales,
            emit_delayed=emit_delayed,
        )
    configs = gemm_configs.tma_configs() if tma else gemm_configs.gemm_configs()
    rules = dict(tma=tma, ragged=ragged, activation=activation, prologue=prologue, sum_a=sum_a)
    rules.update(accumulate=accumulate, store_preact=store_preact, out_bytes=out_bytes)
    return offered_configs(configs, cc, **rules)


def activation_names() -> dict[int, str]:
    """ACTIVATIONS code -> name ("none" for 0), as the cases' labels spell them."""
    from tkern.kernels.activation import ACTIVATIONS

    return {code: name or "none" for name, code in ACTIVATIONS.items()}


def transcendental() -> frozenset:
    """The activation codes computed with exp/erf (activation.TRANSCENDENTAL)."""
    from tkern.kernels.activation import TRANSCENDENTAL

    return TRANSCENDENTAL


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """What a GEMM launch specialises on besides its config: operand dtype,
    output dtype, bias dtype (None: no bias), activation code (0 none, 1 relu,
    2 gelu, 3 silu, 4 gelu_tanh: activation.ACTIVATIONS), whether the
    pre-activation is saved, the operand layout (``"NT"``: A row-major, B
    column-major, i.e. ``x @ W^T``; ``"NN"``, ``"TN"``) and whether the
    operands are ragged (M, N, K and strides not multiples of 16)."""

    dtype: str = "fp16"
    out: str = "fp16"
    bias: str | None = None
    act: int = 0
    preact: bool = False
    layout: str = "NT"
    ragged: bool = False
    # the operand prologue (the linear backward, gemm.matmul_backward): the activation
    # code whose gradient multiplies A, A' stored, A' row sums stored in this dtype
    a_act: int = 0
    store_a: bool = False
    sum_a: str | None = None
    # the epilogue adds the product to C (``ACCUMULATE``: the wgrad into a flat gradient buffer)
    accumulate: bool = False
    # the epilogue multiplies the product by act'(Z), Z read at preact_ptr (``GRAD_ACT``: the
    # dgrad of an MLP's second layer writing dZ, ops/mlp.py)
    grad_act: int = 0
    # with grad_act: a gated unit's two gradients (``GRAD_GLU``: down's dgrad writing
    # [d(gate) | d(up)] from the stored [gate | up], gemm.matmul_grad_glu)
    glu: bool = False
    # the epilogue adds the (M, N) tensor at preact_ptr (``ADD_RESIDUAL``: the block's last
    # layer writing the residual stream, ops/mlp.py's ``residual``)
    residual: bool = False
    # with sum_a and accumulate: the row sums added into a_sum (``ADD_SUM``: dbias into the
    # bias's flat gradient view beside dW into the weight's)
    add_sum: bool = False
    # C column-major (``stride_cm`` 1): dW written through the transposed flat view of a weight
    # stored (in, out), GPT-2's Conv1D (ops.common.flat_wgrad)
    out_t: bool = False
    # the gate's activation code: the up GEMM of a gated unit storing up beside the gate at
    # preact_ptr and C = h = act(gate) * up (``GLU_FWD``, gemm.matmul_glu_prechecked)
    glu_fwd: int = 0
    # the epilogue writes C's softmax statistics per 32 columns at preact_ptr (``ROW_STATS``:
    # the fused loss's logits GEMM, gemm.matmul_row_stats_prechecked)
    row_stats: bool = False

    @property
    def label(self) -> str:
        epi = ("bias+" if self.bias else "") + activation_names()[self.act]
        epi += "+preact" if self.preact else ""
        bias = f",{self.bias} bias" if self.bias and self.bias != self.dtype else ""
        label = f"{self.dtype}->{self.out},{self.layout},{epi}{bias}" + (",ragged" if self.ragged else "")
        grad = f",dZ=dY*{activation_names()[self.grad_act]}'(Z)" if self.grad_act else ""
        grad = grad.replace("'(Z)", "'(G)*U,dU") if self.glu else grad
        grad += ",+residual" if self.residual else ""
        grad += f",H={activation_names()[self.glu_fwd]}(G)*U" if self.glu_fwd else ""
        grad += ",row stats" if self.row_stats else ""
        into = (",C^T" if self.out_t else "") + (",C+=" if self.accumulate else "")
        return label + self.prologue_label + into + grad

    @property
    def prologue_label(self) -> str:
        """``",A'=..."`` naming the operand prologue, empty without one."""
        act = {1: "relu'", 2: "gelu'"}.get(self.a_act, f"act{self.a_act}'")
        parts = ([act] if self.a_act else []) + (["store"] if self.store_a else [])
        parts += [f"sum{'+=' if self.add_sum else ' '}{self.sum_a}"] if self.sum_a else []
        return f",A'={'+'.join(parts)}" if parts else ""


HALF = ("fp16", "bf16")


def linear_launches() -> list[GemmLaunch]:
    """Every GEMM launch ``tkern.linear`` makes (and ``tkern.matmul``'s fp32
    output beside them), aligned: the forward ``x @ W^T`` (NT) with or without
    a bias (the operands' dtype or fp32), every activation (none, ReLU, GELU,
    SiLU, tanh-GELU), the pre-activation saved when training (eager saves ReLU's output
    instead, activation.GRAD_FROM_OUTPUT; the traced door saves it for all); dgrad ``dZ @ W`` (NN) and wgrad
    ``dZ^T @ X`` (TN) with a plain epilogue, every wgrad also accumulating into a
    fused optimizer's flat gradient buffer (``C +=``). tests/test_functional.py checks
    that tkern.linear launches nothing outside this list."""
    forward = [
        GemmLaunch(d, out, bias, act, preact, "NT")
        for d in HALF
        for out in (d, "fp32")
        for bias in (None, d, "fp32")
        for act in activation_names()
        for preact in ((False, True) if act else (False,))
    ]
    backward = [GemmLaunch(d, d, layout=layout) for d in HALF for layout in ("NN", "TN")]
    backward += backward_prologue_launches()
    wgrad_into = [dataclasses.replace(v, accumulate=True) for v in backward if v.layout == "TN"]
    # dbias added into the bias's flat view too; dW through a Conv1D weight's transposed view
    wgrad_into += [dataclasses.replace(v, add_sum=True) for v in wgrad_into if v.sum_a]
    wgrad_into += [dataclasses.replace(v, out_t=True) for v in wgrad_into]
    return forward + backward + wgrad_into


def backward_prologue_launches() -> list[GemmLaunch]:
    """The backward GEMMs of ``tkern.linear`` with an operand prologue
    (gemm.matmul_backward), aligned: dgrad ``dY @ W`` (NN) applying act'(Z) to dY
    (for functional.PROLOGUE_ACTIVATIONS), storing dZ when wgrad or dbias needs it;
    wgrad ``dZ^T @ X`` (TN) summing dbias (the bias's dtype, the operands' or fp32)
    and, when dX is not needed, applying act'(Z^T) itself."""
    from tkern.functional import PROLOGUE_ACTIVATIONS
    from tkern.kernels.activation import ACTIVATIONS

    acts = sorted(ACTIVATIONS[a] for a in PROLOGUE_ACTIVATIONS)
    dgrad = [GemmLaunch(d, d, layout="NN", a_act=act, store_a=store)
             for d in HALF for act in acts for store in (False, True)]  # fmt: skip
    wgrad = [GemmLaunch(d, d, layout="TN", a_act=act, sum_a=sum_a)
             for d in HALF for act in (0, *acts) for sum_a in (None, d, "fp32") if act or sum_a]  # fmt: skip
    return dgrad + wgrad


#: The forwards that set a pointer-kernel config's spill bound (aot_gemm_sweep: compiled
#: on every offered config where the gate compiles every config): GELU with the
#: pre-activation saved needs the most registers next to the accumulator, but which output
#: and bias cost most depends on the tile: without a bias, bf16 out reaches 255 registers on
#: sm_90's large tiles (197 with a bias), fp32 out needs up to 30 more than a half one
#: elsewhere, a bias adds up to 32 on 128x64 tiles; so the forward is compiled four ways
#: (bf16 or fp32 out, with or without a bias). With GELU (ReLU where GELU's tile rule prunes
#: the config) these four reach within 2 registers of the most that any activation needs on
#: every offered config (triton 3.9: sm_90 126-128 for SiLU and tanh-GELU vs 128-164 for GELU
#: on 128x128x64/s3w8; sm_100 98-134 vs ReLU's 214-234 on 128x256x64), so SiLU and tanh-GELU
#: are compiled on the first config (aot_gemm_sweep.pointer_others). On ragged operands
#: the scalar loads dominate and dgrad (NN) or wgrad (TN) is the heaviest (up to 255
#: registers), so those get both too (:data:`BACKWARD`).
FORWARD_HEAVIEST = (
    GemmLaunch("bf16", "bf16", "bf16", 2, True, "NT"),
    GemmLaunch("bf16", "bf16", None, 2, True, "NT"),
    GemmLaunch("fp16", "fp32", "fp32", 2, True, "NT"),
    GemmLaunch("fp16", "fp32", None, 2, True, "NT"),
)
BACKWARD = (GemmLaunch("bf16", "bf16", layout="NN"), GemmLaunch("bf16", "bf16", layout="TN"))
#: The TMA kernel's GELU forwards compiled on a ragged output for every config offered
#: there: tkern.linear's (half outputs). tkern.matmul's fp32 output with an fp32 bias is
#: left out: under triton 3.6 it spills 160-168 B on sm_90 even at 128x128 (the smallest
#: TMA tile; triton 3.9 does not), a known gap of the raw matmul, not of tkern.linear.
TMA_RAGGED_GATE_LAUNCHES = tuple(
    dataclasses.replace(v, ragged=True) for v in FORWARD_HEAVIEST if v.out == v.dtype
)
#: The TMA kernel's one launch with ``C +=`` (large wgrads into a flat gradient buffer on
#: Hopper): compiled for every config it is offered, as the forwards are.
TMA_WGRAD_INTO = GemmLaunch("bf16", "bf16", layout="TN", accumulate=True)
#: The wgrad of a weight stored (in, out) (GPT-2's Conv1D) into its flat view through the
#: transpose (C column-major, the pointer epilogue): the pointer kernel's with dbias added into
#: the bias's view, the TMA kernel's plain; on the first config (C's strides change the stores'
#: layout, not the tile's registers).
CONV1D_WGRAD_INTO = (
    GemmLaunch("bf16", "bf16", layout="TN", sum_a="bf16", accumulate=True, add_sum=True, out_t=True),
)
TMA_CONV1D_WGRAD_INTO = (dataclasses.replace(TMA_WGRAD_INTO, out_t=True),)


#: The TMA kernel's forwards with the TMA-store epilogue (no pre-activation stored: an
#: inference forward, a GELU whose gradient is not needed, tkern.matmul): the heaviest
#: epilogues, bias + GELU in bf16 and into fp32.
TMA_STORE_GATE_LAUNCHES = (
    GemmLaunch("bf16", "bf16", "bf16", 2, False, "NT"),
    GemmLaunch("fp16", "fp32", "fp32", 2, False, "NT"),
)
#: The dgrad epilogue's act' (``GRAD_ACT``, ops/mlp.py: ``dZ = (dY @ W2) * act'(Z)``, the
#: dgrad of an MLP's second layer writing dZ over the stored pre-activation), heaviest first:
#: erf GELU (the most registers), tanh-GELU (GPT-2's), and tanh-GELU with W read
#: column-major (Conv1D's (in, out) weight read transposed in place: "NT").
DGRAD_EPILOGUE_LAUNCHES = (
    GemmLaunch("bf16", "bf16", layout="NN", grad_act=2),
    GemmLaunch("bf16", "bf16", layout="NN", grad_act=4),
    GemmLaunch("bf16", "bf16", layout="NT", grad_act=4),
)
#: The gated unit's dgrad epilogue (``GRAD_GLU``, ops/mlp.py's linear_glu_linear: down's dgrad
#: reading gate and up and writing both gradients), SwiGLU's (SiLU) with down's (hidden,
#: intermediate) weight row-major as dgrad reads it.
GLU_DGRAD_LAUNCHES = (GemmLaunch("bf16", "bf16", layout="NN", grad_act=3, glu=True),)
#: The gated unit's forward in the up GEMM's epilogue (``GLU_FWD``, ops/mlp.py's linear_glu_linear:
#: up stored beside the gate, the gate read, h = act(gate) * up stored), ``x @ W_up^T`` with
#: nn.Linear's weight read in place: SwiGLU's (SiLU) without a bias (Llama's) and with one, on
#: every config; GeGLU's tanh-GELU with a bias on the first.
GLU_FWD_LAUNCHES = (
    GemmLaunch("bf16", "bf16", layout="NT", glu_fwd=3),
    GemmLaunch("bf16", "bf16", "bf16", layout="NT", glu_fwd=3),
    GemmLaunch("bf16", "bf16", "bf16", layout="NT", glu_fwd=4),
)
#: The residual stream's add in the block's last GEMM (``ADD_RESIDUAL``: GPT-2's c_proj with
#: its bias, Llama's down_proj without), the forward with ``nn.Linear``'s weight read in place.
RESIDUAL_LAUNCHES = (GemmLaunch("bf16", "bf16", "bf16", layout="NT", residual=True),)
#: The fused loss's logits GEMM writing each row's softmax statistics (``ROW_STATS``): ``x @
#: W^T`` with the head's weight read in place into fp32 logits, with a bias and without
#: (GPT-2's and Llama's heads have none; linear_cross_entropy takes one).
ROW_STATS_LAUNCHES = (
    GemmLaunch("bf16", "fp32", layout="NT", row_stats=True),
    GemmLaunch("bf16", "fp32", "bf16", layout="NT", row_stats=True),
)


def gate_launches(ragged: bool = False) -> tuple[GemmLaunch, ...]:
    """The forwards the gate compiles (:data:`FORWARD_HEAVIEST` with every activation
    computed with exp/erf) and on ragged operands the plain backward GEMMs: the launches of
    :func:`linear_launches` that the full report does not add on their own."""
    forward = tuple(
        dataclasses.replace(v, act=act) for act in sorted(transcendental()) for v in FORWARD_HEAVIEST
    )
    launches = forward + (BACKWARD if ragged else ())
    return tuple(dataclasses.replace(v, ragged=ragged) for v in launches)


def _gemm_case(name, kernel, cfg, sig, const, aligned, gated=True) -> Case:
    """A GEMM's case; the kernel's constexpr flags with a default that ``const`` does not
    name (a newer epilogue's, e.g. GRAD_ACT, off) stand at their defaults; the config's
    keywords that are no argument of the kernel (AMD's ``waves_per_eu``, ...) are compile
    options, as Triton's launcher passes them."""
    fn = _kernel_fn(kernel)
    defaults = {
        p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in sig
    }
    options = {k: v for k, v in cfg.kwargs.items() if k not in fn.arg_names}
    return Case(
        name=name,
        family="gemm",
        kernel=kernel,
        signature=_order({**sig, **dict.fromkeys(defaults, "constexpr")}, kernel),
        constexprs={**defaults, **const},
        aligned=tuple(aligned),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        gated=gated,
        options=options,
    )


def pointer_case(cfg, v: GemmLaunch, gated: bool = True) -> Case:
    """``_matmul_kernel`` under ``cfg`` as the launcher specialises it for ``v``."""
    tl = _tl()
    kw = cfg.kwargs
    sig = _gemm_sig(v.dtype, v.out, v.bias, v.preact or bool(v.glu_fwd), sum_dtype=v.sum_a)
    const = dict(
        HAS_BIAS=v.bias is not None, ACTIVATION=v.act, STORE_PREACT=v.preact,
        OUT_DTYPE=getattr(tl, _TL_NAME[v.out]), PREACT_DTYPE=getattr(tl, _TL_NAME[v.dtype]),
        UPCAST=False, EVEN_K=not v.ragged, SCALE_A=0, SCALE_B=0,
        A_T=v.layout[0] == "T", B_T=v.layout[1] == "T", **kw,
        A_ACT=v.a_act, STORE_A=v.store_a, SUM_A=v.sum_a is not None, ACCUMULATE=v.accumulate,
        PRECISE_ACC=False, GRAD_ACT=v.grad_act, GRAD_GLU=v.glu, ADD_RESIDUAL=v.residual, ADD_SUM=v.add_sum,
        GLU_FWD=v.glu_fwd, ROW_STATS=v.row_stats,
    )  # fmt: skip
    # strides: the unit ones are specialised to the constant 1, as Triton's launcher does
    strides = ("stride_am", "stride_ak", "stride_bk", "stride_bn")
    unit = (
        {"N": "stride_ak", "T": "stride_am"}[v.layout[0]],
        {"N": "stride_bn", "T": "stride_bk"}[v.layout[1]],
    )
    c_unit, c_rows = _c_strides(v.out_t)
    const.update({s: 1 for s in unit}, stride_bias=1, **{c_unit: 1})
    for s in (*strides, "stride_cm", "stride_cn", "stride_bias"):
        sig[s] = "constexpr" if s in const else "i32"
    for k in const:
        sig[k] = "constexpr"
    aligned = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "preact_ptr", c_rows, "M", "N"]
    aligned += ["z_ptr", "a_out_ptr", "a_sum_ptr"]  # new tensors (torch allocates them aligned)
    if not v.ragged:
        aligned += ["K"] + [s for s in strides if s not in const]
    return _gemm_case(
        f"matmul[{cfg_name(kw, cfg)},{v.label}]", POINTER_KERNEL, cfg, sig, const, aligned, gated
    )


def tma_case(cfg, v: GemmLaunch) -> Case:
    """``_matmul_tma_kernel`` under ``cfg`` as its launcher specialises it for ``v`` (132 SMs)."""
    tl = _tl()
    kw = cfg.kwargs
    a_t, b_t = v.layout[0] == "T", v.layout[1] == "T"
    sig = _gemm_sig(
        v.dtype,
        v.out,
        v.bias,
        v.preact or bool(v.glu_fwd),
        tma=(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], a_t, b_t),
    )
    # the TMA-store epilogue where the launcher takes it: C row-major with aligned rows
    # (not ragged) and no pre-activation stored beside it (gemm_tma.launch_tma)
    c_tma = not (v.preact or v.ragged or v.grad_act or v.residual or v.out_t or v.glu_fwd or v.row_stats)
    c_unit, c_rows = _c_strides(v.out_t)
    const = dict(
        HAS_BIAS=v.bias is not None, ACTIVATION=v.act, STORE_PREACT=v.preact,
        OUT_DTYPE=getattr(tl, _TL_NAME[v.out]), PREACT_DTYPE=getattr(tl, _TL_NAME[v.dtype]), UPCAST=False,
        A_T=a_t, B_T=b_t, NUM_SMS=132, stride_bias=1, ACCUMULATE=v.accumulate, C_TMA=c_tma,
        GRAD_ACT=v.grad_act, GRAD_GLU=v.glu, ADD_RESIDUAL=v.residual, GLU_FWD=v.glu_fwd,
        ROW_STATS=v.row_stats, **kw,
        **{c_unit: 1},
    )  # fmt: skip
    if c_tma:
        from tkern.kernels.gemm_epilogue import epilogue_parts

        width = kw["BLOCK_N"] // epilogue_parts(kw["EPI_SPLIT"], v.act, v.accumulate)
        sig["c_desc"] = f"tensordesc<{v.out}[{kw['BLOCK_M']}, {width}]>"
    sig[c_rows] = "i32"
    for k in const:
        sig[k] = "constexpr"
    aligned = ("c_ptr", "bias_ptr", "preact_ptr") + (() if v.ragged else ("M", "N", "K", c_rows))
    return _gemm_case(f"matmul_tma[{cfg_name(kw, cfg)},{v.label}]", TMA_KERNEL, cfg, sig, const, aligned)


SPLIT_K_KERNEL = "tkern.kernels.gemm_split:_matmul_split_k_kernel"
SPLIT_K_REDUCE = "tkern.kernels.gemm_split:_split_k_reduce_kernel"


def split_k_cases(cc, level: str = REPORT) -> list[Case]:
    """Split-K (gemm_split.py) as tkern.linear's wgrad launches it (``dZ^T @ X``: A read
    transposed, "TN"), summing dbias per K range in bf16 (the heavier: every config its
    autotuner offers on ``cc`` at ``level``, :func:`aot_targets.sweep`) and plain in fp16
    (the first config); and its reduction pass into a half C (written, or added into a flat
    gradient buffer with the row sums) and into fp32."""
    from tkern.kernels import gemm_configs, gemm_split

    tl = _tl()
    cases = []
    table = gemm_configs.split_k_configs()
    pairs = [
        (cfg, ("bf16", True)) for cfg in launch_configs(offered_configs(table, cc, sum_a=True), level, True)
    ]
    pairs += [(cfg, ("fp16", False)) for cfg in launch_configs(offered_configs(table, cc), level, False)]
    for cfg, (dtype, sum_a) in pairs:
        kw = cfg.kwargs
        sig = dict(a_ptr=_ptr(dtype), b_ptr=_ptr(dtype), ws_ptr="*fp32", sums_ptr="*fp32",
                   M="i32", N="i32", K="i32", K_CHUNK="i32", stride_am="constexpr", stride_ak="i32",
                   stride_bk="i32", stride_bn="constexpr")  # fmt: skip
        const = dict(stride_am=1, stride_bn=1, UPCAST=False, A_T=True, B_T=False, SUM_A=sum_a,
                     EVEN_K=True, **kw)  # fmt: skip
        sig.update({k: "constexpr" for k in const})
        aligned = ("a_ptr", "b_ptr", "ws_ptr", "sums_ptr", "M", "N", "K", "K_CHUNK", "stride_ak", "stride_bk")
        name = f"matmul_split_k[{cfg_name(kw, cfg)},{dtype},TN{',A sum' if sum_a else ''}]"
        cases.append(_gemm_case(name, SPLIT_K_KERNEL, cfg, sig, const, aligned))
    # (out, C +=, row sums, sums added into a bias's view, C column-major: a Conv1D's weight)
    reduce = [
        ("bf16", False, False, False, False),
        ("bf16", True, True, False, False),
        ("bf16", True, True, True, False),
        ("bf16", True, True, True, True),
        ("fp32", False, False, False, False),
    ]
    for out, accumulate, sum_a, add_sum, out_t in reduce:
        c_unit, c_rows = _c_strides(out_t)
        sums = _ptr(out if add_sum else "fp32")  # a bias's view (its dtype), or a new fp32 buffer
        sig = dict(ws_ptr="*fp32", c_ptr=_ptr(out), sums_ptr="*fp32", a_sum_ptr=sums, SPLITS="i32",
                   M="i32", N="i32", stride_cm="i32", stride_cn="i32")  # fmt: skip
        const = {c_unit: 1, "OUT_DTYPE": getattr(tl, _TL_NAME[out]), "ACCUMULATE": accumulate,
                 "SUM_A": sum_a, "BLOCK_M": gemm_split.REDUCE_BLOCK_M,
                 "BLOCK_N": gemm_split.REDUCE_BLOCK_N, "ADD_SUM": add_sum}  # fmt: skip
        sig.update({k: "constexpr" for k in const})
        label = f"{out}{',C^T' if out_t else ''}{',C+=' if accumulate else ''}{',A sum' if sum_a else ''}"
        label += "+=" if add_sum else ""
        cases.append(
            Case(
                name=f"split_k_reduce[{label}]", family="rowwise", kernel=SPLIT_K_REDUCE,
                signature=_order(sig, SPLIT_K_REDUCE), constexprs=const,
                aligned=("ws_ptr", "c_ptr", "sums_ptr", "a_sum_ptr", "M", "N", c_rows),
                num_warps=gemm_split.REDUCE_WARPS_C_T if out_t else gemm_split.REDUCE_WARPS, num_stages=1,
            )
        )  # fmt: skip
    return cases
