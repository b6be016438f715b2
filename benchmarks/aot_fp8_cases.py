"""The fp8 launches static_report compiles: scaled_mm's GEMMs as Float8Linear launches
them (tensorwise and rowwise scales, the emitting epilogue, the blockwise recipe's
kernel) and the casts that quantize into fp8 (the standalone casts and the norms'
fp8 outputs).
"""

from __future__ import annotations

from aot_gemm_cases import POINTER_KERNEL, _gemm_case, _gemm_sig, gemm_configs_for
from aot_targets import REPORT, Case, _ptr, _tl, _tl_fp8, cfg_name, launch_configs, offered_configs

#: The fp8 GEMMs Float8Linear launches (issue 43), as (name, a format, b format, scale
#: kind (1 tensor, 3 block), bias, ``C +=``, PRECISE_ACC, the epilogue's activation (None,
#: or one with the pre-activation stored: an MLP's first layer, tkern.nn.fusion)): every one
#: with both operands K-major ("NT": A (M, K) and B (K, N) with unit stride along K), since each cast writes
#: the layout its GEMMs read. Forward x @ W^T (fast accumulation, the bias in the
#: epilogue); dgrad dY @ W (W^T's cast); wgrad dY^T @ X (dY^T's and X^T's casts) adding
#: into a fused optimizer's bf16 gradient buffer; blockwise forward and wgrad (block scales
#: on both operands: on Hopper the recipe's blockwise GEMMs run on gemm_blockwise.py's kernel,
#: :data:`BLOCKWISE_LAUNCHES`; these serve Ada and the block shapes and operands it does not take).
FP8_GEMM_LAUNCHES = (
    ("forward", "fp8e4nv", "fp8e4nv", 1, True, False, False, None),
    ("dgrad", "fp8e5", "fp8e4nv", 1, False, False, True, None),
    ("wgrad", "fp8e5", "fp8e4nv", 1, False, True, True, None),
    ("forward", "fp8e4nv", "fp8e4nv", 3, True, False, False, None),
    ("wgrad", "fp8e4nv", "fp8e4nv", 3, False, True, True, None),
    # GPT-2's c_fc (gelu_new: the tanh form) and an erf-GELU MLP's first layer (issue 43 item 3)
    ("forward", "fp8e4nv", "fp8e4nv", 1, True, False, False, "gelu_tanh"),
    ("forward", "fp8e4nv", "fp8e4nv", 1, True, False, False, "gelu"),
)
#: (The lighter launches of each kind, a GEMM without the bias or without ``C +=`` (a wgrad
#: outside a fused optimizer, blockwise dgrad), are not compiled apart: tests/
#: test_float8_passes.py checks that every scaled_mm launch of the recipes is one of these
#: or a lighter epilogue of one.)
#: Of those, the ones that set a config's spill bound (aot_gemm_sweep: every offered config
#: where the gate compiles every config; the others on the first): the forward with per-tensor
#: scales (the only one offered the 128-value tiles), with block scales, with tanh-GELU and its
#: pre-activation, the block-scaled wgrad. Measured (triton 3.9): on every config offered to
#: both, the promoted dgrad and wgrad with per-tensor scales need fewer registers than the
#: tanh-GELU forward (sm_90 182 vs 235-246, sm_100 89-156 vs 166-238), erf GELU's too.
FP8_HEAVIEST = tuple(FP8_GEMM_LAUNCHES[i] for i in (0, 3, 4, 5))


def fp8_configs_for(
    cc: int, scale: int, precise: bool, activation: str | None = None, emit_delayed: bool = False
) -> list:
    """The configs scaled_mm's autotuner offers on ``cc`` to a launch with this scale kind
    (1 tensor, 3 block), accumulation and epilogue activation; ``emit_delayed``: the emitting
    epilogue's delayed cast (:data:`FP8_EMIT_LAUNCHES`)."""
    from tkern.kernels.activation import ACTIVATIONS

    return gemm_configs_for(
        cc, activation=ACTIVATIONS[activation], fp8=True, two_accumulators=precise or scale == 3,
        block_scales=scale == 3, emit_delayed=emit_delayed,
    )  # fmt: skip


def emit_configs_for(cc: int, scaling: str) -> list:
    """The configs scaled_mm(emit_fp8=...)'s autotuner offers on ``cc`` to a forward with
    tanh-GELU emitting with ``scaling`` ("delayed" or "tensorwise")."""
    return fp8_configs_for(cc, 1, False, "gelu_tanh", emit_delayed=scaling == "delayed")


def fp8_case_name(cfg, launch: tuple) -> str:
    """The gate's name of scaled_mm's case for ``cfg`` and one of :data:`FP8_GEMM_LAUNCHES`."""
    role, a_dtype, b_dtype, scale, bias, into, precise, activation = launch
    epi = ",".join(
        [{1: "tensor", 3: "block"}[scale] + " scales"]
        + (["bias"] if bias else [])
        + ["precise" if precise else "fast"]
        + (["C+="] if into else [])
        + ([activation, "preact"] if activation else [])
    )
    return f"scaled_mm[{cfg_name(cfg.kwargs, cfg)},{a_dtype}x{b_dtype}->bf16,NT,{role},{epi}]"


def _fp8_gemm_cases(cc, level: str = REPORT) -> list[Case]:
    """scaled_mm (sm_89 and newer): the configs offered (:func:`fp8_configs_for`) to each of
    :data:`FP8_GEMM_LAUNCHES` at ``level`` (every one in the report; :data:`FP8_HEAVIEST`
    on every config and the others on the first where the gate compiles every config)."""
    tl = _tl()
    cases = []
    from tkern.kernels.activation import ACTIVATIONS

    for launch in FP8_GEMM_LAUNCHES:
        role, a_dtype, b_dtype, scale, bias, into, precise, activation = launch
        configs = fp8_configs_for(cc, scale, precise, activation)
        for cfg in launch_configs(configs, level, launch in FP8_HEAVIEST):
            kw = cfg.kwargs
            sig = _gemm_sig("fp16", "bf16", "bf16", False)
            sig.update(a_ptr=_ptr(a_dtype), b_ptr=_ptr(b_dtype))
            unit = ("stride_ak", "stride_bk")  # both operands K-major
            const = dict(
                HAS_BIAS=bias, ACTIVATION=ACTIVATIONS[activation], STORE_PREACT=activation is not None,
                OUT_DTYPE=tl.bfloat16,
                PREACT_DTYPE=tl.bfloat16, UPCAST=False, EVEN_K=True, SCALE_A=scale, SCALE_B=scale,
                A_T=False, B_T=True, stride_cn=1, stride_bias=1, **kw,
                A_ACT=0, STORE_A=False, SUM_A=False, ACCUMULATE=into, PRECISE_ACC=precise,
                **dict.fromkeys(unit, 1),
            )  # fmt: skip
            strided = ("stride_am", "stride_bn")
            for name in (*strided, "stride_cm"):
                sig[name] = "i32"
            for k in const:
                sig[k] = "constexpr"
            aligned = ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "M", "N", "K", *strided, "stride_cm")
            # gated=False: their own tests in test_compiled_fp8.py (the fp8 facts)
            name = fp8_case_name(cfg, launch)
            cases.append(_gemm_case(name, POINTER_KERNEL, cfg, sig, const, aligned, gated=False))
    return cases


EMIT_KERNEL = "tkern.kernels.gemm:_matmul_emit_kernel"
#: scaled_mm(emit_fp8=...)'s launches (issue 43 item 3: GPT-2's c_fc writing c_proj's e4m3
#: input): the forward with the bias, gelu_new (tanh form) and its pre-activation stored, as
#: (scaling, x^T's cast too (training)). "delayed" casts C and C^T in the epilogue and rolls
#: the history (and a cached weight's) in the last program; "tensorwise" records max |C| only.
FP8_EMIT_LAUNCHES = (("delayed", True), ("delayed", False), ("tensorwise", True))


def _fp8_emit_cases(cc, level: str = REPORT) -> list[Case]:
    """The emitting entry kernel (``gemm._matmul_emit_kernel``: ``_matmul_kernel``'s program
    body, the emitting epilogue) on every config scaled_mm's autotuner offers to a forward
    with gelu_tanh (:func:`fp8_configs_for`), for each of :data:`FP8_EMIT_LAUNCHES`: named
    ``scaled_mm_emit[...]``, held to the fp8 GEMM's facts (test_compiled.py)."""
    import torch

    from tkern.kernels import float8 as f8
    from tkern.kernels.activation import ACTIVATIONS

    tl = _tl()
    cases = []
    const8 = f8.fp8_constants(torch.float8_e4m3fn)
    const8["DTYPE8"] = const8.pop("DTYPE")
    for scaling, store_t in FP8_EMIT_LAUNCHES:
        delayed = scaling == "delayed"
        # C^T's cast beside C's: the heavier epilogue (delayed 141-182 registers vs 100-176
        # without C^T on sm_90, triton 3.9); the tensorwise emit has configs of its own
        for cfg in launch_configs(emit_configs_for(cc, scaling), level, store_t):
            kw = cfg.kwargs
            sig = {
                k: v
                for k, v in _gemm_sig("fp16", "bf16", "bf16", False).items()
                if not k.startswith(("z_", "a_"))
            }
            sig.update(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", preact_ptr="*bf16")
            sig.update(data_ptr="*fp8e4nv", data_t_ptr="*fp8e4nv", counter_ptr="*i32", margin_factor="fp32")
            for name in ("scale", "partials", "amax", "history", "roll2", "roll2_amax"):
                sig[f"{name}_ptr"] = "*fp32"
            sig.update(H="i32", H2="i32", count2="i32")
            const = dict(
                HAS_BIAS=True, ACTIVATION=ACTIVATIONS["gelu_tanh"], STORE_PREACT=True, OUT_DTYPE=tl.bfloat16,
                PREACT_DTYPE=tl.bfloat16, UPCAST=False, EVEN_K=True, SCALE_A=1, SCALE_B=1, A_T=False,
                B_T=True, stride_cn=1, stride_bias=1, stride_ak=1, stride_bk=1, **kw, PRECISE_ACC=False,
                DELAYED=delayed, STORE_T=store_t, COUNT=True, ROLL2=delayed, **const8,
                CHUNK=1024, HBLOCK=16, PBLOCK2=1024,
            )  # fmt: skip
            for name in ("stride_am", "stride_bn", "stride_cm"):
                sig[name] = "i32"
            for k in const:
                sig[k] = "constexpr"
            aligned = ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "preact_ptr", "data_ptr", "data_t_ptr")
            aligned += ("M", "N", "K", "stride_am", "stride_bn", "stride_cm")
            epi = f"tensor scales,bias,fast,gelu_tanh,preact,emit {scaling}{',C^T' if store_t else ''}"
            name = f"scaled_mm_emit[{cfg_name(kw, cfg)},fp8e4nvxfp8e4nv->bf16,NT,forward,{epi}]"
            cases.append(_gemm_case(name, EMIT_KERNEL, cfg, sig, const, aligned, gated=False))
    return cases


BLOCKWISE_KERNEL = "tkern.kernels.gemm_blockwise:_scaled_mm_blockwise_kernel"
#: The blockwise recipe's GEMMs on Hopper (issue 43 item 5: gemm_blockwise.py, where
#: scaled_mm routes them), as (name, B's scale block along N (128: a weight's 128x128 blocks;
#: 1: X's 128x1 columns), bias, ``C +=``, the scale strides the recipe's casts give
#: (stride_sam, stride_sak, stride_sbk, stride_sbn; None: a run-time value)): forward
#: x @ W^T with the bias, dgrad dY @ W (W's own scale grid), wgrad dY^T @ X adding into a
#: fused optimizer's bf16 gradient buffer. A's 1x128 tiles' scales are K-block-major (unit
#: stride along the rows) in all three.
BLOCKWISE_LAUNCHES = (
    ("forward", 128, True, False, (1, None, 1, None)),
    ("dgrad", 128, False, False, (1, None, None, 1)),
    ("wgrad", 1, False, True, (1, None, None, 1)),
)


def blockwise_configs_for(cc: int, column_scales: bool, accumulate: bool = False) -> list:
    """The configs the blockwise kernel's autotuner offers on ``cc`` (its pruning counts
    fp8 tiles at one byte an element, and C's old tile with ``C +=``)."""
    from tkern.kernels import gemm_configs

    table = gemm_configs.blockwise_configs(column_scales)
    rules = dict(tma=True, elem_bytes=1, column_scales=column_scales, accumulate=accumulate)
    return offered_configs(table, cc, **rules)


def blockwise_cases(cc, level: str = REPORT) -> list[Case]:
    """The blockwise kernel (sm_90 and newer: tensor descriptors) on every config offered
    to each of :data:`BLOCKWISE_LAUNCHES`, C stored through a descriptor (bf16, aligned rows)."""
    from tkern.kernels.gemm_epilogue import epilogue_parts

    tl = _tl()
    cases = []
    for launch in BLOCKWISE_LAUNCHES:  # each its own configs' heaviest
        role, scale_bn, bias, into, strides = launch
        for cfg in launch_configs(blockwise_configs_for(cc, scale_bn == 1, into), level, True):
            kw = cfg.kwargs
            bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
            width = bn // epilogue_parts(kw["EPI_SPLIT"], 0, into)
            sig = dict(
                a_desc=f"tensordesc<fp8e4nv[{bm}, {bk}]>", b_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>",
                c_desc=f"tensordesc<bf16[{bm}, {width}]>", c_ptr="*bf16", bias_ptr="*bf16",
                scale_a_ptr="*fp32", scale_b_ptr="*fp32", M="i32", N="i32", K="i32", stride_cm="i32",
            )  # fmt: skip
            const = dict(
                stride_cn=1, stride_bias=1, HAS_BIAS=bias, OUT_DTYPE=tl.bfloat16, UPCAST=False, SCALE_BM=1,
                SCALE_BN=scale_bn, NUM_SMS=132, C_TMA=True, ACCUMULATE=into, **kw,
            )  # fmt: skip
            names = ("stride_sam", "stride_sak", "stride_sbk", "stride_sbn")
            for name, stride in zip(names, strides, strict=True):
                if stride is None:
                    sig[name] = "i32"
                else:
                    const[name] = stride
            for k in const:
                sig[k] = "constexpr"
            aligned = ("c_ptr", "bias_ptr", "scale_a_ptr", "scale_b_ptr", "M", "N", "K", "stride_cm")
            aligned += tuple(n for n, v in zip(names, strides, strict=True) if v is None)
            epi = ",".join(
                (["bias"] if bias else []) + (["C+="] if into else []) + [f"B scales 128x{scale_bn}"]
            )
            name = f"blockwise_mm[{cfg_name(kw, cfg)},fp8e4nvxfp8e4nv->bf16,{role},{epi}]"
            # gated=False: their own tests in test_compiled_fp8.py (the blockwise facts)
            cases.append(_gemm_case(name, BLOCKWISE_KERNEL, cfg, sig, const, aligned, gated=False))
    return cases


def fp8_cast_cases() -> list[Case]:
    """tkern's fp8 casts (issues 17 and 43): the per-tensor cast's amax pass, its cast writing
    x and x^T (current scaling), dY's cast writing dY, dY^T and the bias gradient, the delayed
    cast rolling its history (and a cached weight's) in its own launch, the block cast
    (DeepSeek-V3's 1x128 tiles and 128x128 blocks, the weight's writing W^T too) and the
    history roll, from bf16 to e4m3 and e5m2. Compiled for sm_89 and newer, where the fp8
    casts are instructions; they are not part of the streaming family's checks (2-D tiles
    at any strides). Where fp8 is planned the gate compiles them, e5m2's on the targets it
    compiles every config on (``light``: the same code with e5m2's constants) and elsewhere
    e4m3's heaviest of each kernel (the delayed casts, the blocks writing W^T)."""
    import torch
    import triton

    from tkern.kernels import float8 as f8

    cases = []
    warps = 4  # triton's default: the launchers pass none
    kernel = "tkern.kernels.float8:_cast_2d_kernel"
    flags = ("AMAX_ONLY", "DELAYED", "STORE", "STORE_T", "RECORD", "ROLL", "ROLL2", "COL_SUM")
    variants = {  # name -> the flags on
        "amax": {"AMAX_ONLY", "RECORD"},
        "current,x+x^T": {"STORE", "STORE_T"},
        "current,dY+dY^T+dbias": {"STORE", "STORE_T", "COL_SUM"},
        "delayed,x+x^T,roll+roll W": {"DELAYED", "STORE", "STORE_T", "RECORD", "ROLL", "ROLL2"},
        "delayed,dY+dY^T+dbias,roll": {"DELAYED", "STORE", "STORE_T", "RECORD", "ROLL", "COL_SUM"},
        "delayed,W+W^T,deferred": {"DELAYED", "STORE", "STORE_T", "RECORD"},
    }
    for dtype, tag in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
        const8 = f8.fp8_constants(dtype)
        for label, on in variants.items():
            sig = {
                a: "*fp32" for a in ("amax_ptr", "scale_ptr", "partials_ptr", "roll2_ptr", "roll2_amax_ptr")
            }
            sig.update(x_ptr="*bf16", data_ptr="*" + _tl_fp8(dtype), data_t_ptr="*" + _tl_fp8(dtype))
            sig.update(colsum_ptr="*bf16", counter_ptr="*i32", margin_factor="fp32")
            sig.update(dict.fromkeys(("M", "K", "stride_xm", "count", "count2", "H2"), "i32"))
            const = {f: f in on for f in flags}
            const.update(**const8, TM=f8.CAST_TM, TK=f8.CAST_TK, PBLOCK=1024, HBLOCK=16, stride_xk=1)
            sig.update(dict.fromkeys(const, "constexpr"))
            aligned = ("x_ptr", "data_ptr", "data_t_ptr", "colsum_ptr", "M", "K", "stride_xm")
            light = tag == "e5m2" or "DELAYED" not in on  # elsewhere: e4m3's delayed casts
            cases.append(Case(f"float8 cast[bf16->{tag},{label}]", "fp8cast", kernel, sig, const, aligned,
                              warps, light=light))  # fmt: skip
        for bm, bk, store_t in ((1, 128, False), (128, 128, True), (1, 4096, False)):  # tiles, W blocks, rows
            sig = {"x_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32",
                   "data_ptr": "*" + _tl_fp8(dtype), "data_t_ptr": "*" + _tl_fp8(dtype), "scale_ptr": "*fp32",
                   "bm": "i32", "bk": "i32", "stride_sm": "i32", "stride_sk": "i32"}  # fmt: skip
            # the tile the launcher picks for (bm, bk) blocks
            tm = min(triton.next_power_of_2(bm), f8.TILE_M)
            tk = min(triton.next_power_of_2(bk), f8.TILE_K)
            const = dict(**const8, TM=tm, TK=tk, STORE_T=store_t)
            sig.update(dict.fromkeys(const, "constexpr"))
            label = f"{bm}x{bk}" + (",+T" if store_t else "")
            cases.append(Case(f"to_float8 blocks[bf16->{tag},{label}]", "fp8cast",
                              "tkern.kernels.float8:_cast_blocks_kernel", sig, const,
                              ("x_ptr", "data_ptr", "data_t_ptr", "K", "M", "stride_xm"), warps,
                              light=tag == "e5m2" or not store_t))  # fmt: skip
    return cases + _tile_cast_cases() + _norm_fp8_cases()


def _tile_cast_cases() -> list[Case]:
    """The blockwise recipe's x / dY cast (1x128 tiles of x and of x^T, wgrad's; dY's with
    dbias: the heaviest, compiled everywhere fp8 is planned) and the history roll."""
    import torch

    from tkern.kernels import float8 as f8

    cases = []
    const8 = f8.fp8_constants(torch.float8_e4m3fn)
    for label, store_t, col_sum in (
        ("x", False, False),
        ("x+x^T", True, False),
        ("dY+dY^T+dbias", True, True),
    ):
        sig = {"x_ptr": "*bf16", "data_ptr": "*fp8e4nv", "data_t_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
               "scale_t_ptr": "*fp32", "partial_sum_ptr": "*fp32"}  # fmt: skip
        sig.update(
            dict.fromkeys(("M", "K", "stride_xm", "stride_sm", "stride_sk", "stride_tk", "stride_tm"), "i32")
        )
        const = dict(**const8, TILE=f8.SCALE_TILE, STORE_T=store_t, COL_SUM=col_sum, stride_xk=1)
        sig.update(dict.fromkeys(const, "constexpr"))
        cases.append(Case(f"float8 tiles[bf16->e4m3,1x128,{label}]", "fp8cast",
                          "tkern.kernels.float8:_cast_tiles_kernel", sig, const,
                          ("x_ptr", "data_ptr", "data_t_ptr", "partial_sum_ptr", "M", "K", "stride_xm"),
                          f8.CAST_TILES_WARPS, light=not col_sum))  # fmt: skip
    sig = {"history_ptr": "*fp32", "H": "i32", "partials_ptr": "*fp32", "count": "i32",
           "HBLOCK": "constexpr", "PBLOCK": "constexpr"}  # fmt: skip
    cases.append(Case("to_float8 roll history", "fp8cast", "tkern.kernels.float8:_roll_history_kernel", sig,
                      {"HBLOCK": 16, "PBLOCK": 1024}, (), 4))  # fmt: skip
    return cases


def _norm_fp8_cases() -> list[Case]:
    """The norm that writes the next GEMM's fp8 input (issue 43 item 3,
    ``norm.norm_forward_float8``): bf16 rows to e4m3, LayerNorm and RMSNorm; delayed
    (y and y^T cast in the launch, y's amax and five more histories rolled: Llama's q, k, v
    sharing one cast with their cached weights) and tensorwise (y's amax recorded only), at
    GPT-2's 768 (a 1024 block) and the widest row it takes (4096, Llama-7B's)."""
    import torch

    from tkern.kernels import float8 as f8
    from tkern.kernels import norm

    tl = _tl()
    fn = norm._norm_fwd_fp8_kernel
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    const8 = f8.fp8_constants(torch.float8_e4m3fn)
    const8["DTYPE8"] = const8.pop("DTYPE")
    cases = []
    variants = {  # name -> (DELAYED, ROLL, N_ROLLS)
        "delayed,y+y^T,roll+5": (True, True, norm.MAX_ROLLS),
        "tensorwise,amax": (False, False, 0),
    }
    for block in (1024, norm.FP8_MAX_BLOCK):  # (wider rows take the norm, then the cast)
        for rms in (False, True):
            for label, (delayed, roll, n_rolls) in variants.items():
                sig = {}
                for name in fn.arg_names:
                    if name in constexprs:
                        sig[name] = "constexpr"
                    elif name in ("x_ptr", "y_ptr"):
                        sig[name] = "*bf16"
                    elif name in ("data_ptr", "data_t_ptr"):
                        sig[name] = "*fp8e4nv"
                    elif name == "counter_ptr":
                        sig[name] = "*i32"
                    elif name.endswith("_ptr"):
                        sig[name] = "*fp32"
                    else:
                        sig[name] = "fp32" if name in ("eps", "margin_factor") else "i32"
                const = dict(
                    IS_RMS=rms, HAS_WEIGHT=True, HAS_BIAS=not rms, DTYPE=tl.bfloat16, BLOCK=block,
                    DELAYED=delayed, STORE_T=delayed, RECORD=True, ROLL=roll,
                    N_ROLLS=n_rolls, **const8, ROWS=norm.FP8_ROWS,
                    NORM_ROWS=norm.tile_rows(norm.FP8_ROWS, block), TK=norm.FP8_TK, PBLOCK=1024, HBLOCK=16,
                )  # fmt: skip
                aligned = tuple(k for k in sig if k.endswith("_ptr") or k in ("M", "N", "stride_x"))
                cases.append(
                    Case(
                        f"norm fp8[bf16->e4m3,{'rms' if rms else 'ln'},{label},{block}]",
                        "fp8cast",
                        f"tkern.kernels.norm:{fn.__name__}",
                        sig,
                        const,
                        aligned,
                        norm.num_warps(block),
                        light=not delayed or rms,  # elsewhere: LayerNorm's delayed cast (y^T, the rolls)
                    )  # fmt: skip
                )
    return cases


MX_KERNEL = "tkern.kernels.gemm_mx:_scaled_mm_mx_kernel"


def mx_gemm_cases() -> list[Case]:
    """The MX GEMM (``tl.dot_scaled`` on e4m3 with e8m0 block scales, gemm_mx.py) on every
    config its autotuner offers (``mx_configs``), as the mxfp8 recipe's forward launches it:
    the bias in the epilogue, bf16 out. Planned where the target multiplies MX natively
    (``spec.mx``: sm_100, gfx950); tests/test_compiled_mx.py holds it to the native
    block-scaled MMA."""
    from tkern.kernels import gemm_mx

    tl = _tl()
    fn = gemm_mx._scaled_mm_mx_kernel.fn
    cases = []
    for cfg in gemm_mx.mx_configs():
        sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", bias_ptr="*bf16", preact_ptr="*bf16",
                   scale_a_ptr="*u8", scale_b_ptr="*u8")  # fmt: skip
        sig.update({a: "i32" for a in fn.arg_names if a in ("M", "N", "K") or a.startswith("stride_")})
        const = dict(A_FMT="e4m3", B_FMT="e4m3", HAS_BIAS=True, ACTIVATION=0, STORE_PREACT=False,
                     OUT_DTYPE=tl.bfloat16, PREACT_DTYPE=tl.bfloat16, **cfg.kwargs)  # fmt: skip
        sig.update(dict.fromkeys(const, "constexpr"))
        name = f"mx_mm[{cfg_name(cfg.kwargs, cfg)},e4m3xe4m3->bf16,NT,forward,e8m0 scales,bias]"
        aligned = [a for a in sig if a.endswith("_ptr")]  # torch's allocations
        cases.append(_gemm_case(name, MX_KERNEL, cfg, sig, const, aligned, gated=False))
    return cases


def mx_cast_cases() -> list[Case]:
    """The MX cast (mx.py, ``_to_mx_kernel``) as the mxfp8 recipe launches it: the one-pass
    pair (blocks along C and along R, ``ALONG_R``) on the launcher's tile, bf16 to e4m3, for a
    weight with RCEIL scales (the longer arithmetic) and for dY with FLOOR scales (the
    recipe's) and the column sums of its bias gradient (``COL_SUM``). Compiled where fp8 is
    planned."""
    from tkern.kernels import mx

    tl = _tl()
    fn = mx._to_mx_kernel
    ptrs = ("x_ptr", "data_ptr", "scale_ptr", "data_r_ptr", "scale_r_ptr", "partial_sum_ptr")
    sig = dict(zip(ptrs, ("*bf16", "*u8", "*u8", "*u8", "*u8", "*fp32"), strict=True))
    sig.update({a: "i32" for a in fn.arg_names if a in ("R", "C") or (a.startswith("s") and a not in sig)})
    cases = []
    launches = (("RCEIL,along C and R", 1, False), ("FLOOR,along C and R,column sums", 0, True))
    for label, mode, col_sum in launches:
        const = dict(MODE=mode, FP8_MAX=448.0, MAX_POW2=8, DTYPE=tl.float8e4nv, BLOCK=32, TR=mx.TILE_R,
                     TC=mx.TILE_C, ALONG_R=True, COL_SUM=col_sum)  # fmt: skip
        case_sig = {**sig, **dict.fromkeys(const, "constexpr")}
        cases.append(Case(f"mx cast[bf16->e4m3,{label}]", "fp8cast", "tkern.kernels.mx:_to_mx_kernel",
                          case_sig, const, ptrs, 4))  # fmt: skip
    return cases


#: Triton's OCP fp8 type names and their FNUZ forms (gfx942's: ``tl.float8e4b8``, ``tl.float8e5b16``).
_FNUZ_TYPES = {"fp8e4nv": "fp8e4b8", "fp8e5": "fp8e5b16"}


def fnuz_name(text: str) -> str:
    """A case's name or a signature type with its fp8 in the FNUZ formats (``fp8e4nv`` ->
    ``fp8e4b8``, ``->e4m3,`` -> ``->e4m3fnuz,``): what :func:`in_fnuz` makes of it."""
    import re

    text = re.sub(r"->(e4m3|e5m2),", r"->\1fnuz,", text)  # the casts' names
    return re.sub(r"fp8e4nv|fp8e5(?!b16)", lambda m: _FNUZ_TYPES[m.group(0)], text)


def in_fnuz(case: Case) -> Case:
    """``case`` with its fp8 in the FNUZ formats, as tkern launches it on a gfx942
    (``float8.native_formats``): fp8 pointers ``*fp8e4b8`` / ``*fp8e5b16``, the casts' DTYPE
    and their constants (FP8_MAX 240 for e4m3fnuz) the FNUZ format's; a case with no fp8
    unchanged."""
    import dataclasses

    import torch

    from tkern.kernels import float8 as f8

    signature = {k: fnuz_name(v) for k, v in case.signature.items()}
    if signature == case.signature:
        return case
    constexprs = dict(case.constexprs)
    tl = _tl()
    for key, ocp, dtype in (
        ("DTYPE", tl.float8e4nv, torch.float8_e4m3fnuz),
        ("DTYPE", tl.float8e5, torch.float8_e5m2fnuz),
        ("DTYPE8", tl.float8e4nv, torch.float8_e4m3fnuz),
    ):
        if constexprs.get(key) == ocp:
            const = f8.fp8_constants(dtype)
            const[key] = const.pop("DTYPE")
            constexprs.update((k, v) for k, v in const.items() if k in constexprs)
    return dataclasses.replace(case, name=fnuz_name(case.name), signature=signature, constexprs=constexprs)
