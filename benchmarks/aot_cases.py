"""The cases static_report compiles for the per-element, row and scalar kernels (the
optimizer updates, gradient statistics, activations, SwiGLU, the norms, the loss
scale, cross-entropy), each as its launcher specialises it, and :func:`all_cases`:
every case of every kernel for one target.
"""

from __future__ import annotations

from aot_fp8_cases import (
    _fp8_emit_cases,
    _fp8_gemm_cases,
    blockwise_cases,
    fp8_cast_cases,
    in_fnuz,
    mx_cast_cases,
    mx_gemm_cases,
)
from aot_gemm_cases import split_k_cases
from aot_gemm_sweep import pointer_cases, tma_cases
from aot_loss_cases import cross_entropy_cases
from aot_rotary_cases import rotary_cases, rotary_table_cases
from aot_targets import (
    _SIZE,
    _TL_NAME,
    REPORT,
    Case,
    _ptr,
    _streaming_case,
    _tl,
    _with_tail,
    depth,
    every_variant,
    light_dtype,
    spec_of,
)

#: The update kernels' memory modes (issue 18) compiled beside the default fp32 master and
#: fp32 state: (param dtype, MASTER, state kind) -- a split master with 8-bit state, no
#: master (stochastic rounding) with bf16 state, and fp16 stochastic rounding.
_MODE_CASES = (("bf16", "split", "u8"), ("bf16", "none", "bf16"), ("fp16", "none", "fp32"))
_MASTER = {"self": 0, "fp32": 1, "split": 2, "none": 3}
_KIND = {"fp32": 0, "bf16": 1, "u8": 2}


def _update_flags(opt: str, full: bool) -> tuple[list[dict], tuple, tuple]:
    """The update kernel's flag combinations the cases compile (``full=False``: the
    plainest, the heaviest and the newest), its state kinds' constexprs and its state
    pointers' name prefixes."""
    if opt == "adam":
        flags = [
            dict(DECOUPLED=d, AMSGRAD=a, CLIP=c, MAXIMIZE=False, LR_ON_DEVICE=False)
            for d in (False, True)
            for a in (False, True)
            for c in (False, True)
        ]
        flags += [dict(DECOUPLED=True, AMSGRAD=False, CLIP=True, MAXIMIZE=True, LR_ON_DEVICE=True)]
        if not full:  # the plainest, the heaviest and the newest flags
            flags = [flags[0], flags[7], flags[8]]
        kinds = ("M_KIND", "V_KIND", "VMAX_KIND")
        prefixes = ("exp_avg_", "exp_avg_sq_", "max_exp_avg_sq_")
    else:
        flags = [
            dict(MOMENTUM=m, NESTEROV=nv, CLIP=c, MAXIMIZE=False, LR_ON_DEVICE=False)
            for m, nv in ((False, False), (True, False), (True, True))
            for c in (False, True)
        ]
        flags += [dict(MOMENTUM=True, NESTEROV=False, CLIP=True, MAXIMIZE=True, LR_ON_DEVICE=True)]
        if not full:
            flags = [flags[0], flags[5], flags[6]]
        kinds = ("MOMENTUM_KIND",)
        prefixes = ("momentum_",)
    return flags, kinds, prefixes


def _update_signature(
    fn, dtype: str, held: str, master: str, kind: str, f: dict, prefixes, grid: bool
) -> dict:
    """The update kernel ``fn``'s argument types for one case."""
    sig = {}
    for name in fn.arg_names:
        if name in ("param_ptr", "grad_ptr"):
            sig[name] = _ptr(held if name == "param_ptr" else dtype)
        elif name == "master_ptr":
            sig[name] = _ptr({"split": "i16", "none": dtype}.get(master, "fp32"))
        elif name.endswith("_absmax_ptr") or name.endswith("_qmap_ptr"):
            sig[name] = "*fp32"
        elif name == "barrier_ptr":  # the grid barrier's int32 words (a placeholder otherwise)
            sig[name] = "*i32" if grid else "*fp32"
        elif name.endswith("_ptr") and name.startswith(prefixes):
            sig[name] = _ptr(kind)
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name in ("n", "n_rows", "seed", "offset"):
            sig[name] = "i32"
        elif name == "lr" and f["LR_ON_DEVICE"]:
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32"
    return sig


def _update_cases(opt: str, full: bool = True, cc="sm_90") -> list[Case]:
    from tkern.kernels import adam, sgd
    from tkern.kernels import grid_sync as gs
    from tkern.kernels import overflow as ov

    mod = adam if opt == "adam" else sgd
    tl = _tl()
    cases = []
    flags, kinds, prefixes = _update_flags(opt, full)
    fn = adam._adam_kernel if opt == "adam" else sgd._sgd_kernel
    per_thread = mod.BLOCK // (32 * mod.NUM_WARPS)
    variants = [(d, "self" if d == "fp32" else "fp32", "fp32", f, t) for d in ("fp16", "bf16", "fp32")
                for f in flags for t in (False, True) if not t or f == flags[0]]  # fmt: skip
    # the memory modes on the heaviest flags (amsgrad + clip; momentum + clip)
    heaviest = next(
        f for f in flags if f.get("AMSGRAD", f.get("MOMENTUM")) and f["CLIP"] and not f["MAXIMIZE"]
    )
    variants += [(d, m, k, heaviest, False) for d, m, k in _MODE_CASES]
    # the one-pass step (statistics, every tile and the step count in one program, issue 45
    # item 3): each 16-bit dtype on the plainest flags and, with a GradScaler's found_inf,
    # on the heaviest (clipping reads the statistics it wrote); the grid-wide step likewise
    one_pass = [
        (d, "fp32", "fp32", f, way)
        for way in ("one-pass", "grid")
        for d in ("fp16", "bf16")
        for f in (flags[0], heaviest)
    ]
    for dtype, master, kind, f, tail in variants + one_pass:
        single = tail in ("one-pass", "grid")
        grid = tail == "grid"
        tail = tail is True
        held = "i16" if master == "split" else dtype  # a split master's param is addressed as int16
        sig = _update_signature(fn, dtype, held, master, kind, f, prefixes, grid)
        const = {}
        const.update(f, MASTER=_MASTER[master], PARAM_DTYPE=getattr(tl, _TL_NAME[dtype]), BLOCK=mod.BLOCK)
        spin = (gs.SPIN_UNCACHED if spec_of(cc).is_amd else gs.SPIN_VOLATILE) if grid else 0  # spin_kind's
        const.update(ONE_PASS=single, HAS_FOUND=single and f is heaviest, GRID=spin, STATS_BLOCK=ov.BLOCK)
        const.update(dict.fromkeys(kinds, _KIND[kind]))
        if opt == "sgd":
            const.pop("DECOUPLED", None)
        arrays = ["grad_ptr", "param_ptr"] + (["master_ptr"] if master in ("fp32", "split") else [])
        if opt == "adam":
            arrays += ["exp_avg_ptr", "exp_avg_sq_ptr"] + (["max_exp_avg_sq_ptr"] if f["AMSGRAD"] else [])
        elif f["MOMENTUM"]:
            arrays += ["momentum_ptr"]
        aligned = tuple(k for k in sig if k.endswith("_ptr") or (k == "n" and not tail) or k == "lr")
        flag_s = ",".join(k.lower() for k, v in f.items() if v) or "plain"
        mode_s = (
            "" if (master, kind) in (("self", "fp32"), ("fp32", "fp32")) else f",master={master},state={kind}"
        )
        # one-pass: one program (grid: one per SM), whose accesses are pass 1's widths and pass 2's,
        # its occupancy moot
        ends = (",tail" if tail else "") + (",grid" if grid else ",one-pass" if single else "")
        cases.append(
            Case(
                name=f"{opt}[{dtype},{flag_s}{mode_s}{ends}]",
                family="scalar" if single else "streaming",
                kernel=f"tkern.kernels.{opt}:{fn.__name__}",
                signature=sig,
                constexprs=const,
                aligned=aligned,
                num_warps=ov.NUM_WARPS if single else mod.NUM_WARPS,
                arrays=() if single else tuple(arrays),
                per_thread=0 if single else per_thread,
                gated=not tail,
                # elsewhere: the heaviest flags in bf16, with the fp32 master and the 8-bit state
                light=tail
                or f is not heaviest
                or light_dtype(dtype)
                or (master, kind) not in (("fp32", "fp32"), ("split", "u8")),
            )
        )
    return cases


def _stats_cases() -> list[Case]:
    from tkern.kernels import overflow as ov

    cases = []
    for dtype, tail in _with_tail(("fp16", "bf16", "fp32"), "fp16"):
        sig = {"grad_ptr": _ptr(dtype), "n": "i32", "inv_scale_ptr": "*fp32", "partials_ptr": "*fp32"}
        # the optimizer's launch: TRACK marks the params that overflowed
        sig |= {"starts_ptr": "*i64", "flags_ptr": "*i32", "n_params": "i32", "base": "i64"}
        sig |= {"stamp": "i32", "search_steps": "i32", "BLOCK": "constexpr", "TRACK": "constexpr"}
        cases.append(
            _streaming_case(
                f"grad_stats[{dtype}",
                "tkern.kernels.overflow:_grad_stats_kernel",
                sig,
                {"BLOCK": ov.BLOCK, "TRACK": True},
                aligned=("grad_ptr", "inv_scale_ptr", "partials_ptr"),
                num_warps=ov._NUM_WARPS,
                block=ov.BLOCK,
                arrays=("grad_ptr",),
                tail=tail,
                dtype=dtype,
            )
        )
    # the sampled zero/subnormal count (opt.track_underflows), per gradient dtype
    import torch

    for dtype, tail in _with_tail(("fp16", "bf16", "fp32"), "fp16"):
        sig = {"grad_ptr": _ptr(dtype), "n": "i32", "starts_ptr": "*i64", "ends_ptr": "*i64"}
        sig |= {"counts_ptr": "*i64", "n_params": "i32", "base": "i64", "search_steps": "i32"}
        sig |= {"chunks": "i32", "BLOCK": "constexpr", "BITS": "constexpr", "MIN_NORMAL": "constexpr"}
        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        const = {"BLOCK": ov.BLOCK, "BITS": 8 * _SIZE[dtype], "MIN_NORMAL": ov.MIN_NORMAL_BITS[torch_dtype]}
        cases.append(
            _streaming_case(
                f"grad_underflow[{dtype}",
                "tkern.kernels.overflow:_grad_underflow_kernel",
                sig,
                const,
                aligned=("grad_ptr", "starts_ptr", "ends_ptr", "counts_ptr"),
                num_warps=ov._NUM_WARPS,
                block=ov.BLOCK,
                arrays=("grad_ptr",),
                tail=tail,
                dtype=dtype,
            )
        )
    sig = {"partials_ptr": "*fp32", "n_rows": "i32", "inv_scale_ptr": "*fp32", "stats_ptr": "*fp32"}
    sig["BLOCK"] = "constexpr"
    cases.append(
        Case(
            name="finalize_stats",
            family="scalar",
            kernel="tkern.kernels.overflow:_finalize_stats_kernel",
            signature=sig,
            constexprs={"BLOCK": ov._FINALIZE_BLOCK},
            aligned=("partials_ptr", "inv_scale_ptr", "stats_ptr"),
            num_warps=ov.NUM_WARPS,  # pass 1's: the one-pass step reduces the rows alike
        )
    )
    return cases


def _activation_cases() -> list[Case]:
    from tkern.kernels import activation as act

    tl = _tl()
    cases = []
    named = [(aname, code) for aname, code in act.ACTIVATIONS.items() if aname is not None]
    cases_of = [(dtype, aname, code) for dtype in ("fp16", "bf16") for aname, code in named]
    for (dtype, aname, code), tail in _with_tail(cases_of, ("fp16", "gelu", act.ACTIVATIONS["gelu"])):
        sig = {"dy_ptr": _ptr(dtype), "z_ptr": _ptr(dtype), "dz_ptr": _ptr(dtype), "n": "i32"}
        sig.update(ACTIVATION="constexpr", DTYPE="constexpr", BLOCK="constexpr")
        cases.append(
            _streaming_case(
                f"activation_grad[{dtype},{aname}",
                "tkern.kernels.activation:_activation_grad_kernel",
                sig,
                dict(ACTIVATION=code, DTYPE=getattr(tl, _TL_NAME[dtype]), BLOCK=act.BLOCK),
                aligned=("dy_ptr", "z_ptr", "dz_ptr"),
                num_warps=getattr(act, "NUM_WARPS", 4),
                block=act.BLOCK,
                arrays=("dy_ptr", "z_ptr", "dz_ptr"),
                tail=tail,
                dtype=dtype,
            )
        )
    return cases


def _swiglu_cases() -> list[Case]:
    """The gated activation (tkern/kernels/swiglu.py) forward and backward as the launchers
    launch them on a GPU: a row of >= MAX_BLOCK_N columns with row strides divisible by 16
    (every model's intermediate size), SiLU and tanh-GELU, fp16 and bf16."""
    from tkern.kernels import swiglu as sw

    tl = _tl()
    cases = []
    kernels = {
        "fwd": (("gate_ptr", "up_ptr", "h_ptr"), ("stride_g", "stride_u", "stride_h"), sw.FWD_ELEMENTS),
        "bwd": (
            ("dh_ptr", "gate_ptr", "up_ptr", "dgate_ptr", "dup_ptr"),
            ("stride_dh", "stride_g", "stride_u", "stride_dg", "stride_du"),
            sw.BWD_ELEMENTS,
        ),
    }
    for dtype in ("fp16", "bf16"):
        for aname in ("silu", "gelu_tanh"):
            for which, (ptrs, strides, elements) in kernels.items():
                blocks = dict(BLOCK_M=elements // sw.MAX_BLOCK_N, BLOCK_N=sw.MAX_BLOCK_N)
                sig = {
                    **{a: _ptr(dtype) for a in ptrs},
                    "M": "i32",
                    "N": "i32",
                    **{a: "i32" for a in strides},
                }
                sig.update(
                    ACTIVATION="constexpr", DTYPE="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr"
                )
                cases.append(
                    Case(
                        name=f"swiglu_{which}[{dtype},{aname}]",
                        family="streaming",
                        kernel=f"tkern.kernels.swiglu:_swiglu_{which}_kernel",
                        signature=sig,
                        constexprs=dict(
                            ACTIVATION=sw.ACTIVATIONS[aname], DTYPE=getattr(tl, _TL_NAME[dtype]), **blocks
                        ),
                        aligned=(*ptrs, "N", *strides),
                        num_warps=sw.NUM_WARPS,
                        arrays=ptrs,
                        per_thread=sw.MAX_BLOCK_N // (32 * sw.NUM_WARPS),
                        light=light_dtype(dtype),
                    )
                )
    return cases


def _norm_cases(full: bool = True) -> list[Case]:
    """LayerNorm / RMSNorm forward and backward (tkern/kernels/norm.py) as the launchers
    launch them: a 1024-wide row (hidden 768 to 1024), the widest one-block row
    (``MAX_BLOCK``) and chunked rows; with every optional input present (residual,
    weight, bias, the gradient of h, dweight and dbias: the most registers).
    The gate's set: every dtype at each width with every optional input; the full
    report adds the plain flags (no residual, no dh)."""
    from tkern.kernels import norm

    tl = _tl()
    cases = []
    # 1024: the widest row on few warps (8 elements a thread spilled there)
    widths = [(norm.MAX_BLOCK, False), (norm.MAX_BLOCK, True), (1024, False)]
    for kernel in ("fwd", "bwd"):
        fn = norm._norm_fwd_kernel if kernel == "fwd" else norm._norm_bwd_kernel
        for dtype in ("fp16", "bf16", "fp32"):
            for rms in (False, True):
                for extra in (True, False) if full else (True,):
                    for block, chunked in widths:
                        sig = {}
                        for name in fn.arg_names:
                            if name in ("w_ptr", "b_ptr"):
                                sig[name] = "*fp32"
                            elif name.endswith("_ptr"):
                                fp32 = name.startswith(("mean", "rstd", "dw", "db"))
                                sig[name] = "*fp32" if fp32 else _ptr(dtype)
                            elif name.isupper() and name not in ("M", "N"):
                                sig[name] = "constexpr"
                            else:
                                sig[name] = "fp32" if name == "eps" else "i32"
                        const = dict(IS_RMS=rms, HAS_WEIGHT=True, DTYPE=getattr(tl, _TL_NAME[dtype]))
                        const.update(BLOCK=block, CHUNKED=chunked, ROWS=norm.tile_rows(1, block))
                        if kernel == "fwd":
                            const.update(HAS_RESIDUAL=extra, HAS_BIAS=not rms)
                        else:
                            const.update(HAS_DH=extra, HAS_DW=True, HAS_DB=not rms)
                        flags = ("rms" if rms else "ln") + (",res" if extra and kernel == "fwd" else "")
                        flags += ",dh" if extra and kernel == "bwd" else ""
                        width = f"chunks of {block}" if chunked else f"{block}"
                        cases.append(
                            Case(
                                name=f"norm_{kernel}[{dtype},{flags},{width}]",
                                family="rowwise",
                                kernel=f"tkern.kernels.norm:{fn.__name__}",
                                signature=sig,
                                constexprs=const,
                                # rows of a multiple of 16 elements, 16-byte aligned
                                aligned=tuple(
                                    k for k in sig if k.endswith("_ptr") or k.startswith(("N", "stride"))
                                ),
                                num_warps=norm.num_warps(block),
                                light=light_dtype(dtype) or rms,  # elsewhere: LayerNorm's bf16 rows
                            )
                        )
    return cases + _norm_grad_cases(full)


def _norm_grad_cases(full: bool = True) -> list[Case]:
    """The norms' dweight / dbias reduction (``_norm_param_grads_kernel``) as
    ``param_grads_prechecked`` launches it on a GPU: the narrowest and the widest column
    block (``REDUCE_MIN_COLS`` / ``REDUCE_MAX_COLS``, ROWS filling ``REDUCE_TILE``), for
    params in fp32 (the mixed-precision rule), bf16 and fp16. The gate's set: LayerNorm's
    (dweight and dbias) added into the flat buffer, fp32 and bf16 on every target (fp16
    where every variant is compiled); the full report adds RMSNorm's and the plain writes."""
    from tkern.kernels import norm

    tl = _tl()
    fn = norm._norm_param_grads_kernel
    cases = []
    for dtype in ("fp32", "bf16", "fp16"):
        for cols in (norm.REDUCE_MIN_COLS, norm.REDUCE_MAX_COLS):
            for rms, acc in ((False, True), (True, True), (False, False)) if full else ((False, True),):
                sig = {
                    a: "*fp32" if a.endswith("part_ptr") else _ptr(dtype)
                    for a in fn.arg_names
                    if a.endswith("_ptr")
                }
                sig.update(P="i32", N="i32")
                sig.update({a: "constexpr" for a in fn.arg_names if a not in sig})
                const = dict(HAS_DW=True, HAS_DB=not rms, ACC_DW=acc, ACC_DB=acc and not rms)
                const.update(DW_DTYPE=getattr(tl, _TL_NAME[dtype]), DB_DTYPE=getattr(tl, _TL_NAME[dtype]))
                const.update(ROWS=norm.REDUCE_TILE // cols, COLS=cols)
                flags = ("rms" if rms else "ln") + (",acc" if acc else "")
                cases.append(
                    Case(
                        name=f"norm_param_grads[{dtype},{flags},{cols} cols]",
                        family="rowwise",
                        kernel=f"tkern.kernels.norm:{fn.__name__}",
                        signature=sig,
                        constexprs=const,
                        aligned=tuple(a for a in sig if a.endswith("_ptr") or a == "N"),  # 16-byte rows
                        num_warps=norm.REDUCE_WARPS,
                        light=dtype == "fp16" or rms or not acc,  # elsewhere: LayerNorm's, added in
                    )
                )
    return cases


def _scale_cases() -> list[Case]:
    from tkern.kernels import scale

    fn = scale._update_scale_kernel
    cases = []
    for scheme, sname in (
        (scale.STATIC, "static"),
        (scale.DYNAMIC, "dynamic"),
        (scale.LOGNORMAL, "lognormal"),
    ):
        sig = {name: ("*fp32" if name.endswith("_ptr") else "fp32") for name in fn.arg_names}
        sig["SCHEME"] = "constexpr"
        # the scaler's state is its own (11,) allocation; stats a fresh (3,) one
        cases.append(
            Case(
                name=f"update_scale[{sname}]",
                family="scalar",
                kernel="tkern.kernels.scale:_update_scale_kernel",
                signature=sig,
                constexprs={"SCHEME": scheme},
                aligned=("state_ptr", "stats_ptr"),
                num_warps=4,
            )
        )
    return cases


def _gemm_cases(cc, level: str) -> list[Case]:
    """Every GEMM family tkern's public API launches on target ``cc``, at ``level``
    (:func:`aot_targets.depth`; the launches and configs: aot_gemm_sweep): the pointer
    kernel aligned and ragged (with the backward prologue and the dgrad epilogue), split-K,
    fp8 where the target's tensor cores take fp8 (:func:`fp8_planned`: scaled_mm, its
    emitting epilogue; in FNUZ on gfx942), the TMA kernels where it has TMA (the 16-bit GEMM,
    the blockwise fp8 GEMM), the MX GEMM where it has native MX MMA."""
    cases = pointer_cases(cc, level) + split_k_cases(cc, level)
    if fp8_planned(cc):
        cases += _fp8_gemm_cases(cc, level) + _fp8_emit_cases(cc, level)
    if spec_of(cc).tma:  # sm_120's TMA with its 99 KB: whatever the TMA autotuner offers there
        cases += blockwise_cases(cc, level) + tma_cases(cc, level)
    if spec_of(cc).mx:
        cases += mx_gemm_cases()
    return cases


def fp8_planned(cc) -> bool:
    """Whether tkern plans fp8 GEMMs on target ``cc``: its tensor cores multiply fp8 (none
    before sm_89); tkern casts to the formats they take (OCP; FNUZ on gfx942: :func:`in_fnuz`)."""
    return spec_of(cc).fp8


def _fnuz(cc) -> bool:
    """Whether target ``cc``'s native fp8 is FNUZ (gfx942): its fp8 cases are compiled so."""
    import torch

    return spec_of(cc).fp8_e4m3 == torch.float8_e4m3fnuz


def all_cases(cc, full: bool = True) -> list[Case]:
    """Every case for target ``cc``; ``full=False``: the compile gate's set at the target's
    :func:`aot_targets.depth`: where it compiles every config, every config each GEMM
    autotuner offers on its heaviest launches (aot_gemm_sweep) and every launch on the first;
    elsewhere (and under Triton 3.6) each GEMM launch on the first config offered to it. The
    other kernels: every variant where :func:`aot_targets.every_variant` (every dtype, the
    plainest, the heaviest and the newest flags of the update kernels), else their heaviest
    (the cases not marked ``light``)."""
    level = depth(cc, full)
    cases = _update_cases("sgd", full, cc) + _update_cases("adam", full, cc)
    cases += _stats_cases() + _activation_cases()
    cases += cross_entropy_cases() + _swiglu_cases() + rotary_cases() + rotary_table_cases()
    cases += _norm_cases(full) + _scale_cases()
    if fp8_planned(cc):  # MX's casts write OCP elements (as bytes) on gfx942 too: in_fnuz keeps them
        cases += fp8_cast_cases() + mx_cast_cases()
    if level != REPORT and not every_variant(cc):
        cases = [c for c in cases if not c.light]
    cases += _gemm_cases(cc, level)
    if _fnuz(cc):
        cases = [in_fnuz(c) for c in cases]
    return list({c.name: c for c in cases}.values())  # a launch reached twice compiles once
