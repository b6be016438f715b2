"""Compiler facts about every tkern kernel, for NVIDIA targets, on any machine.

Triton's compiler runs without a GPU: each kernel is compiled ahead of time with
``triton.compile`` for Hopper (``GPUTarget("cuda", 90, 32)``) and Ampere
(``("cuda", 80, 32)``), and its artifacts are read with the ``cuobjdump`` and
``nvdisasm`` shipped in the triton wheel: registers, local memory (spills),
shared memory, an occupancy estimate, wgmma / mma.sync / cp.async / TMA use,
layout conversions left in the TTGIR, and the width of every global access per
kernel argument (traced through the PTX). These are compiler facts, not
timings: they say what the GPU would run, not how fast.

The cases mirror what the launchers pass (the same block sizes, warps, configs
and constexpr flags, read from the kernel modules): the signatures Triton
would specialise for tkern's flat layout (every buffer 16-byte aligned, every
length a multiple of 16 elements, see tkern/flat/) and for the tails and
ragged GEMMs the launchers also produce. ``tests/test_compiled.py`` asserts on
the same records (the compile gate); this script writes them to
``benchmarks/results/static/`` as JSON and a Markdown table.

Usage (compiled mode: tkern must not switch on the interpreter)::

    TRITON_INTERPRET=0 python benchmarks/static_report.py [--targets 90 80] [--only adam] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "static"

# --------------------------------------------------------------------------- hardware model

#: Per-SM limits for the occupancy estimate (H100/H200 for sm_90, A100 for sm_80).
HW = {
    90: dict(
        name="H100/H200", regs=65536, smem_sm=233472, smem_block=232448, reserved=1024, warps=64, blocks=32
    ),
    80: dict(name="A100", regs=65536, smem_sm=167936, smem_block=166912, reserved=1024, warps=64, blocks=32),
    # Ada (L4, L40, RTX 4090): the fp8 GEMM's mma.sync target (issue 17); CUDA's compute capability table
    89: dict(
        name="L40/L4", regs=65536, smem_sm=102400, smem_block=101376, reserved=1024, warps=48, blocks=24
    ),  # noqa: E501
}


def smem_limit(cc: int) -> int:
    """Largest dynamic shared memory one program may use on target ``cc``."""
    return HW[cc]["smem_block"]


def occupancy(regs: int, smem: int, warps: int, cc: int) -> tuple[float, str]:
    """(resident warps / maximum warps in %, the limiting resource)."""
    hw = HW[cc]
    if smem > hw["smem_block"]:
        return 0.0, "smem over the per-block limit"
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256  # registers are allocated 256 per warp
    limits = {
        "warps": hw["warps"] // warps,
        "blocks": hw["blocks"],
        "smem": hw["smem_sm"] // (smem + hw["reserved"]),
        "registers": (hw["regs"] // per_warp) // warps,
    }
    limiter = min(limits, key=lambda k: (limits[k], k != "warps"))
    return round(100.0 * limits[limiter] * warps / hw["warps"], 1), limiter


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Case:
    """One kernel specialisation: what ``triton.compile`` needs and what the gate checks."""

    name: str
    family: str  # "streaming" (per-element kernels), "rowwise" (a row per program: norms),
    # "scalar" (one program, a few values), "gemm"
    kernel: str  # "module:function"
    signature: dict  # argument -> triton type string, or "constexpr"
    constexprs: dict  # constexpr argument -> value
    aligned: tuple  # arguments specialised as divisible by 16 (pointers: 16-byte aligned)
    num_warps: int
    num_stages: int = 3
    arrays: tuple = ()  # streaming: the per-element arrays, each accessed as (elements per thread) vectors
    per_thread: int = 0  # streaming: contiguous elements per thread
    gated: bool = True  # the aligned case the layout guarantees (tails and ragged shapes only must compile)


def _tl():
    import triton.language as tl

    return tl


def _ptr(dtype: str) -> str:
    return f"*{dtype}"


_TL_NAME = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4, "i16": 2, "u8": 1}


def _with_tail(keys, tail_key) -> Iterator[tuple]:
    """``(key, tail)`` for a per-element kernel's cases: each key's aligned launch
    (tail False), and after ``tail_key``'s its tail launch (tail True) too."""
    for key in keys:
        yield key, False
        if key == tail_key:
            yield key, True


def _streaming_case(name, kernel, sig, constexprs, *, aligned, num_warps, block, arrays, tail) -> Case:
    """A per-element kernel's case ``name[...]`` (``name`` without its closing bracket):
    its aligned launch (``n`` divisible by 16 too; gated) or its tail (only compiled)."""
    return Case(
        name=f"{name}{',tail' if tail else ''}]",
        family="streaming",
        kernel=kernel,
        signature=sig,
        constexprs=constexprs,
        aligned=aligned + (() if tail else ("n",)),
        num_warps=num_warps,
        arrays=arrays,
        per_thread=block // (32 * num_warps),
        gated=not tail,
    )


#: The update kernels' memory modes (issue 18) compiled beside the default fp32 master and
#: fp32 state: (param dtype, MASTER, state kind) -- a split master with 8-bit state, no
#: master (stochastic rounding) with bf16 state, and fp16 stochastic rounding.
_MODE_CASES = (("bf16", "split", "u8"), ("bf16", "none", "bf16"), ("fp16", "none", "fp32"))
_MASTER = {"self": 0, "fp32": 1, "split": 2, "none": 3}
_KIND = {"fp32": 0, "bf16": 1, "u8": 2}


def _update_cases(opt: str, full: bool = True) -> list[Case]:
    from tkern.kernels import adam, sgd
    from tkern.kernels import overflow as ov

    mod = adam if opt == "adam" else sgd
    tl = _tl()
    cases = []
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
        sig, const = {}, {}
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
        const.update(f, MASTER=_MASTER[master], PARAM_DTYPE=getattr(tl, _TL_NAME[dtype]), BLOCK=mod.BLOCK)
        const.update(ONE_PASS=single, HAS_FOUND=single and f is heaviest, GRID=grid, STATS_BLOCK=ov.BLOCK)
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
                        const.update(BLOCK=block, CHUNKED=chunked)
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
) -> list:
    """The configs tkern's autotuner offers on target ``cc`` (after its own pruning),
    for launches whose epilogue applies ``activation`` (an ACTIVATIONS code), with
    the operand ``prologue`` (an ``A_ACT`` code) or none; ``fp8``: scaled_mm's
    (gemm_configs.fp8_gemm_configs, one byte an element), ``two_accumulators`` for
    its launches promoting every K tile (PRECISE_ACC or block scales)."""
    from tkern.kernels import gemm_configs

    if fp8:
        fp8_configs = gemm_configs.fp8_gemm_configs()
        return gemm_configs.prune_configs(
            fp8_configs,
            cc,
            ragged=ragged,
            activation=activation,
            elem_bytes=1,
            two_accumulators=two_accumulators,
            block_scales=block_scales,
        )
    configs = gemm_configs.tma_configs() if tma else gemm_configs.gemm_configs()
    return gemm_configs.prune_configs(
        configs, cc, tma=tma, ragged=ragged, activation=activation, prologue=prologue
    )


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

    @property
    def label(self) -> str:
        epi = ("bias+" if self.bias else "") + activation_names()[self.act]
        epi += "+preact" if self.preact else ""
        bias = f",{self.bias} bias" if self.bias and self.bias != self.dtype else ""
        label = f"{self.dtype}->{self.out},{self.layout},{epi}{bias}" + (",ragged" if self.ragged else "")
        return label + self.prologue_label + (",C+=" if self.accumulate else "")

    @property
    def prologue_label(self) -> str:
        """``",A'=..."`` naming the operand prologue, empty without one."""
        act = {1: "relu'", 2: "gelu'"}.get(self.a_act, f"act{self.a_act}'")
        parts = ([act] if self.a_act else []) + (["store"] if self.store_a else [])
        parts += [f"sum {self.sum_a}"] if self.sum_a else []
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


#: The launches the compile gate compiles for every offered config: the most
#: register-hungry of :func:`linear_launches`, so a config that does not spill on
#: them does not spill on the lighter ones. Measured (triton 3.9, every offered
#: config, sm_90 and sm_80): GELU with the pre-activation saved needs the most
#: registers next to the accumulator, but which output and bias cost most depends
#: on the tile: without a bias, bf16 out reaches 255 registers on sm_90's large
#: tiles (197 with a bias), fp32 out needs up to 30 more than a half one elsewhere,
#: a bias adds up to 32 on 128x64 tiles; so the forward is compiled four ways (bf16
#: or fp32 out, with or without a bias), for every activation computed with exp/erf
#: (GELU here; :func:`gate_launches` adds SiLU and tanh-GELU the same four ways: their
#: temporaries differ from erf's, so none stands for the others). On aligned operands
#: the backward GEMMs (plain epilogue) stay below the forward; on ragged operands the
#: scalar loads dominate and dgrad (NN) or wgrad (TN) is the heaviest (up to 255
#: registers), so those get both too.
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


#: The TMA kernel's forwards with the TMA-store epilogue (no pre-activation stored: an
#: inference forward, a GELU whose gradient is not needed, tkern.matmul): the heaviest
#: epilogues, bias + GELU in bf16 and into fp32, for every config offered.
TMA_STORE_GATE_LAUNCHES = (
    GemmLaunch("bf16", "bf16", "bf16", 2, False, "NT"),
    GemmLaunch("fp16", "fp32", "fp32", 2, False, "NT"),
)


def offered_launch(v: GemmLaunch, offered: bool) -> GemmLaunch:
    """``v`` if its config is ``offered`` to ``v``'s activation, else the heaviest
    launch like ``v`` that the config is still offered to (pruned for an activation
    computed with exp/erf: gemm_configs.ACT_MAX_ACC): ReLU in its place."""
    return v if offered or v.act not in transcendental() else dataclasses.replace(v, act=1)


def gate_launches(ragged: bool = False) -> tuple[GemmLaunch, ...]:
    """What the compile gate compiles each offered config for (see :data:`FORWARD_HEAVIEST`):
    the heaviest forwards for every activation computed with exp/erf."""
    forward = tuple(
        dataclasses.replace(v, act=act) for act in sorted(transcendental()) for v in FORWARD_HEAVIEST
    )
    launches = forward + (BACKWARD if ragged else ())
    return tuple(dataclasses.replace(v, ragged=ragged) for v in launches)


def pointer_gate_launches(cc: int, cfg, ragged: bool = False) -> list[GemmLaunch]:
    """:func:`gate_launches` as the pointer kernel's autotuner offers ``cfg`` to them on
    target ``cc``: each launch whose activation prunes ``cfg`` replaced by
    :func:`offered_launch`'s (duplicates dropped)."""
    name = cfg_name(cfg.kwargs, cfg)
    out = []
    for v in gate_launches(ragged):
        offered = {cfg_name(c.kwargs, c) for c in gemm_configs_for(cc, ragged=ragged, activation=v.act)}
        out.append(offered_launch(v, name in offered))
    return list(dict.fromkeys(out))


def prologue_gate_launches(cc: int, cfg, ragged: bool = False) -> list[GemmLaunch]:
    """The backward GEMMs with an operand prologue (gemm.matmul_backward) the gate
    compiles ``cfg`` for on target ``cc``, the heaviest of each kind it is offered
    to: wgrad summing a stored dZ (no prologue: offered every config); dgrad storing
    dZ and wgrad summing dbias with ReLU's gradient (a select) and GELU's (erf and
    exp, the most registers), where gemm_configs' prologue rules offer ``cfg``."""
    name = cfg_name(cfg.kwargs, cfg)
    wgrad = GemmLaunch("bf16", "bf16", layout="TN", ragged=ragged, sum_a="fp32")
    launches = [wgrad, dataclasses.replace(wgrad, accumulate=True)]
    for act in (1, 2):
        if name in {cfg_name(c.kwargs, c) for c in gemm_configs_for(cc, ragged=ragged, prologue=act)}:
            wgrad = GemmLaunch("bf16", "bf16", layout="TN", ragged=ragged, a_act=act, sum_a="bf16")
            launches += [
                GemmLaunch("bf16", "bf16", layout="NN", ragged=ragged, a_act=act, store_a=True),
                wgrad,
                dataclasses.replace(wgrad, accumulate=True),
            ]
    return launches


def _gemm_case(name, kernel, cfg, sig, const, aligned, gated=True) -> Case:
    return Case(
        name=name,
        family="gemm",
        kernel=kernel,
        signature=_order(sig, kernel),
        constexprs=const,
        aligned=tuple(aligned),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        gated=gated,
    )


def pointer_case(cfg, v: GemmLaunch, gated: bool = True) -> Case:
    """``_matmul_kernel`` under ``cfg`` as the launcher specialises it for ``v``."""
    tl = _tl()
    kw = cfg.kwargs
    sig = _gemm_sig(v.dtype, v.out, v.bias, v.preact, sum_dtype=v.sum_a)
    const = dict(
        HAS_BIAS=v.bias is not None, ACTIVATION=v.act, STORE_PREACT=v.preact,
        OUT_DTYPE=getattr(tl, _TL_NAME[v.out]), PREACT_DTYPE=getattr(tl, _TL_NAME[v.dtype]),
        UPCAST=False, EVEN_K=not v.ragged, SCALE_A=0, SCALE_B=0,
        A_T=v.layout[0] == "T", B_T=v.layout[1] == "T", **kw,
        A_ACT=v.a_act, STORE_A=v.store_a, SUM_A=v.sum_a is not None, ACCUMULATE=v.accumulate,
        PRECISE_ACC=False,
    )  # fmt: skip
    # strides: the unit ones are specialised to the constant 1, as Triton's launcher does
    strides = ("stride_am", "stride_ak", "stride_bk", "stride_bn")
    unit = (
        {"N": "stride_ak", "T": "stride_am"}[v.layout[0]],
        {"N": "stride_bn", "T": "stride_bk"}[v.layout[1]],
    )
    const.update({s: 1 for s in unit}, stride_cn=1, stride_bias=1)
    for s in (*strides, "stride_cm", "stride_cn", "stride_bias"):
        sig[s] = "constexpr" if s in const else "i32"
    for k in const:
        sig[k] = "constexpr"
    aligned = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "preact_ptr", "stride_cm", "M", "N"]
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
        v.dtype, v.out, v.bias, v.preact, tma=(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], a_t, b_t)
    )
    # the TMA-store epilogue where the launcher takes it: C row-major with aligned rows
    # (not ragged) and no pre-activation stored beside it (gemm_tma.launch_tma)
    c_tma = not v.preact and not v.ragged
    const = dict(
        HAS_BIAS=v.bias is not None, ACTIVATION=v.act, STORE_PREACT=v.preact,
        OUT_DTYPE=getattr(tl, _TL_NAME[v.out]), PREACT_DTYPE=getattr(tl, _TL_NAME[v.dtype]), UPCAST=False,
        A_T=a_t, B_T=b_t, NUM_SMS=132, stride_cn=1, stride_bias=1, ACCUMULATE=v.accumulate, C_TMA=c_tma, **kw,
    )  # fmt: skip
    if c_tma:
        from tkern.kernels.gemm_epilogue import epilogue_parts

        width = kw["BLOCK_N"] // epilogue_parts(kw["EPI_SPLIT"], v.act, v.accumulate)
        sig["c_desc"] = f"tensordesc<{v.out}[{kw['BLOCK_M']}, {width}]>"
    sig.update(stride_cm="i32")
    for k in const:
        sig[k] = "constexpr"
    aligned = ("c_ptr", "bias_ptr", "preact_ptr") + (() if v.ragged else ("M", "N", "K", "stride_cm"))
    return _gemm_case(f"matmul_tma[{cfg_name(kw, cfg)},{v.label}]", TMA_KERNEL, cfg, sig, const, aligned)


def _gemm_cases(cc: int, full: bool = True) -> list[Case]:
    """Every config each GEMM autotuner offers on target ``cc`` (after its own
    pruning), compiled for :func:`gate_launches`: the pointer kernel's aligned
    configs, its ragged configs on ragged operands, and (sm_90 only) the TMA
    kernel's configs (which serve ragged operands there), plus the TMA kernel's
    other layout and ragged operands once; the pointer kernel's configs also for
    :func:`prologue_gate_launches`. With ``full``, every launch of
    :func:`linear_launches` on the first aligned config of each kernel offered to it."""
    cases = []
    for ragged in (False, True):
        for cfg in gemm_configs_for(cc, ragged=ragged):
            launches = pointer_gate_launches(cc, cfg, ragged)
            cases += [pointer_case(cfg, v, gated=not ragged) for v in launches]
            cases += [pointer_case(cfg, v, gated=not ragged) for v in prologue_gate_launches(cc, cfg, ragged)]
    if full:
        cases += [
            pointer_case(gemm_configs_for(cc, activation=v.act, prologue=v.a_act)[0], v)
            for v in linear_launches()
            if v not in gate_launches()
        ]
    cases += split_k_cases(cc)
    if cc >= 89:
        cases += _fp8_gemm_cases(cc)
        cases += _fp8_emit_cases(cc)
    if cc >= 90:
        cases += blockwise_cases(cc)
        configs = gemm_configs_for(cc, tma=True)
        for cfg in configs:
            cases += [tma_case(cfg, v) for v in (*gate_launches(), TMA_WGRAD_INTO, *TMA_STORE_GATE_LAUNCHES)]
        # the other layout once: it changes the loads, not the epilogue
        heavy = FORWARD_HEAVIEST[0]
        cases.append(tma_case(configs[0], dataclasses.replace(heavy, layout="TN")))
        # a ragged output (scalar stores of C and the pre-activation): every config offered
        # to GELU there (gemm_configs.prune_configs drops the 128x256 tiles that spill), on
        # tkern.linear's forwards (half outputs; TMA_RAGGED_GATE_LAUNCHES says why not fp32)
        for cfg in gemm_configs_for(cc, tma=True, ragged=True, activation=heavy.act):  # GELU
            cases += [tma_case(cfg, v) for v in TMA_RAGGED_GATE_LAUNCHES]
        if full:
            cases += [tma_case(configs[0], v) for v in linear_launches() if v not in gate_launches()]
    return cases


SPLIT_K_KERNEL = "tkern.kernels.gemm_split:_matmul_split_k_kernel"
SPLIT_K_REDUCE = "tkern.kernels.gemm_split:_split_k_reduce_kernel"


def split_k_cases(cc: int) -> list[Case]:
    """Split-K (gemm_split.py) as tkern.linear's wgrad launches it (``dZ^T @ X``: A read
    transposed, "TN"), with and without dbias summed per K range, for every config its
    autotuner offers on ``cc``; and its reduction pass into a half C (written, or added
    into a flat gradient buffer with the row sums) and into fp32."""
    from tkern.kernels import gemm_configs, gemm_split

    tl = _tl()
    cases = []
    for cfg in gemm_configs.prune_configs(gemm_configs.split_k_configs(), cc):
        kw = cfg.kwargs
        for dtype, sum_a in (("bf16", True), ("fp16", False)):
            sig = dict(a_ptr=_ptr(dtype), b_ptr=_ptr(dtype), ws_ptr="*fp32", sums_ptr="*fp32",
                       M="i32", N="i32", K="i32", K_CHUNK="i32", stride_am="constexpr", stride_ak="i32",
                       stride_bk="i32", stride_bn="constexpr")  # fmt: skip
            const = dict(stride_am=1, stride_bn=1, UPCAST=False, A_T=True, B_T=False, SUM_A=sum_a,
                         EVEN_K=True, **kw)  # fmt: skip
            sig.update({k: "constexpr" for k in const})
            aligned = (
                "a_ptr",
                "b_ptr",
                "ws_ptr",
                "sums_ptr",
                "M",
                "N",
                "K",
                "K_CHUNK",
                "stride_ak",
                "stride_bk",
            )
            name = f"matmul_split_k[{cfg_name(kw, cfg)},{dtype},TN{',A sum' if sum_a else ''}]"
            cases.append(_gemm_case(name, SPLIT_K_KERNEL, cfg, sig, const, aligned))
    for out, accumulate, sum_a in (("bf16", False, False), ("bf16", True, True), ("fp32", False, False)):
        sig = dict(ws_ptr="*fp32", c_ptr=_ptr(out), sums_ptr="*fp32", a_sum_ptr="*fp32", SPLITS="i32",
                   M="i32", N="i32", stride_cm="i32", stride_cn="constexpr")  # fmt: skip
        const = dict(stride_cn=1, OUT_DTYPE=getattr(tl, _TL_NAME[out]), ACCUMULATE=accumulate, SUM_A=sum_a,
                     BLOCK_M=gemm_split.REDUCE_BLOCK_M, BLOCK_N=gemm_split.REDUCE_BLOCK_N)  # fmt: skip
        sig.update({k: "constexpr" for k in const})
        label = f"{out}{',C+=' if accumulate else ''}{',A sum' if sum_a else ''}"
        cases.append(
            Case(
                name=f"split_k_reduce[{label}]", family="rowwise", kernel=SPLIT_K_REDUCE,
                signature=_order(sig, SPLIT_K_REDUCE), constexprs=const,
                aligned=("ws_ptr", "c_ptr", "sums_ptr", "a_sum_ptr", "M", "N", "stride_cm"),
                num_warps=gemm_split.REDUCE_WARPS, num_stages=1,
            )
        )  # fmt: skip
    return cases


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


def fp8_configs_for(cc: int, scale: int, precise: bool, activation: str | None = None) -> list:
    """The configs scaled_mm's autotuner offers on ``cc`` to a launch with this scale kind
    (1 tensor, 3 block), accumulation and epilogue activation."""
    from tkern.kernels.activation import ACTIVATIONS

    return gemm_configs_for(
        cc, activation=ACTIVATIONS[activation], fp8=True, two_accumulators=precise or scale == 3,
        block_scales=scale == 3,
    )  # fmt: skip


def _fp8_gemm_cases(cc: int) -> list[Case]:
    """scaled_mm (sm_89 and newer): every config offered (:func:`fp8_configs_for`) to
    each of :data:`FP8_GEMM_LAUNCHES`."""
    tl = _tl()
    cases = []
    from tkern.kernels.activation import ACTIVATIONS

    for role, a_dtype, b_dtype, scale, bias, into, precise, activation in FP8_GEMM_LAUNCHES:
        for cfg in fp8_configs_for(cc, scale, precise, activation):
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
            epi = ",".join(
                [{1: "tensor", 3: "block"}[scale] + " scales"]
                + (["bias"] if bias else [])
                + ["precise" if precise else "fast"]
                + (["C+="] if into else [])
                + ([activation, "preact"] if activation else [])
            )
            name = f"scaled_mm[{cfg_name(kw, cfg)},{a_dtype}x{b_dtype}->bf16,NT,{role},{epi}]"
            # gated=False: their own tests in test_compiled.py (the fp8 facts)
            cases.append(_gemm_case(name, POINTER_KERNEL, cfg, sig, const, aligned, gated=False))
    return cases


EMIT_KERNEL = "tkern.kernels.gemm:_matmul_emit_kernel"
#: scaled_mm(emit_fp8=...)'s launches (issue 43 item 3: GPT-2's c_fc writing c_proj's e4m3
#: input): the forward with the bias, gelu_new (tanh form) and its pre-activation stored, as
#: (scaling, x^T's cast too (training)). "delayed" casts C and C^T in the epilogue and rolls
#: the history (and a cached weight's) in the last program; "tensorwise" records max |C| only.
FP8_EMIT_LAUNCHES = (("delayed", True), ("delayed", False), ("tensorwise", True))


def _fp8_emit_cases(cc: int) -> list[Case]:
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
        for cfg in fp8_configs_for(cc, 1, False, "gelu_tanh"):
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


def blockwise_configs_for(cc: int, column_scales: bool) -> list:
    """The configs the blockwise kernel's autotuner offers on ``cc`` (its pruning counts
    fp8 tiles at one byte an element)."""
    from tkern.kernels import gemm_configs

    return gemm_configs.prune_configs(
        gemm_configs.blockwise_configs(column_scales), cc, tma=True, elem_bytes=1
    )


def blockwise_cases(cc: int) -> list[Case]:
    """The blockwise kernel (sm_90 and newer: tensor descriptors) on every config offered
    to each of :data:`BLOCKWISE_LAUNCHES`, C stored through a descriptor (bf16, aligned rows)."""
    from tkern.kernels.gemm_epilogue import epilogue_parts

    tl = _tl()
    cases = []
    for role, scale_bn, bias, into, strides in BLOCKWISE_LAUNCHES:
        for cfg in blockwise_configs_for(cc, scale_bn == 1):
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
            # gated=False: their own tests in test_compiled.py (the blockwise facts)
            cases.append(_gemm_case(name, BLOCKWISE_KERNEL, cfg, sig, const, aligned, gated=False))
    return cases


def fp8_cast_cases() -> list[Case]:
    """tkern's fp8 casts (issues 17 and 43): the per-tensor cast's amax pass, its cast writing
    x and x^T (current scaling), dY's cast writing dY, dY^T and the bias gradient, the delayed
    cast rolling its history (and a cached weight's) in its own launch, the block cast
    (DeepSeek-V3's 1x128 tiles and 128x128 blocks, the weight's writing W^T too) and the
    history roll, from bf16 to e4m3 and e5m2. Compiled for sm_89 and newer, where the fp8
    casts are instructions; they are not part of the streaming family's checks (2-D tiles
    at any strides)."""
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
            cases.append(
                Case(f"float8 cast[bf16->{tag},{label}]", "fp8cast", kernel, sig, const, aligned, warps)
            )
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
                              ("x_ptr", "data_ptr", "data_t_ptr", "K", "M", "stride_xm"), warps))  # fmt: skip
    # the blockwise recipe's x / dY cast: 1x128 tiles of x and of x^T (wgrad's), dY's with dbias
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
                          f8.CAST_TILES_WARPS))  # fmt: skip
    sig = {"history_ptr": "*fp32", "H": "i32", "partials_ptr": "*fp32", "count": "i32",
           "HBLOCK": "constexpr", "PBLOCK": "constexpr"}  # fmt: skip
    cases.append(Case("to_float8 roll history", "fp8cast", "tkern.kernels.float8:_roll_history_kernel", sig,
                      {"HBLOCK": 16, "PBLOCK": 1024}, (), 4))  # fmt: skip
    return cases + _norm_fp8_cases()


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
                    N_ROLLS=n_rolls, **const8, ROWS=norm.FP8_ROWS, TK=norm.FP8_TK, PBLOCK=1024, HBLOCK=16,
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
                    )  # fmt: skip
                )
    return cases


def _tl_fp8(dtype) -> str:
    import torch

    return {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}[dtype]


def cfg_name(kw, cfg):
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}/s{cfg.num_stages}w{cfg.num_warps}"


def _kernel_fn(spec: str):
    import importlib

    mod, name = spec.split(":")
    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(mod), name)
    while not isinstance(fn, JITFunction):  # unwrap Autotuner / Heuristics
        fn = fn.fn
    return fn


def _order(sig: dict, spec: str) -> dict:
    fn = _kernel_fn(spec)
    missing = [a for a in fn.arg_names if a not in sig]
    if missing:
        raise KeyError(f"{spec}: no type for {missing}")
    return {a: sig[a] for a in fn.arg_names}


def _fit(case: Case, fn) -> Case:
    """``case`` restricted to the arguments ``fn`` takes (an older tkern's kernel
    lacks the newer flags, which then stand at their defaults)."""
    sig = {a: case.signature.get(a, "constexpr") for a in fn.arg_names}
    const = {k: v for k, v in case.constexprs.items() if k in fn.arg_names}
    aligned = tuple(a for a in case.aligned if a in fn.arg_names)
    return dataclasses.replace(case, signature=sig, constexprs=const, aligned=aligned)


# --------------------------------------------------------------------------- cross-entropy (issue 28)


def cross_entropy_cases() -> list[Case]:
    """The launches tkern.cross_entropy and linear_cross_entropy make on a GPU (one row per
    program, ``block_v`` of a large vocabulary): cross_entropy's forward (loss and lse) and
    backward (the gradient from lse, per-row coefficients), and the fused launch of
    linear_cross_entropy (fp32 logits, 16-bit gradient) with every option on. A "rowwise"
    family: its reductions across a row are not streaming accesses."""
    from tkern.kernels import cross_entropy as ce

    tl = _tl()
    fn = ce._cross_entropy_kernel
    block = ce.block_v(50257)  # GPT-2's vocabulary: the largest chunk
    flags = ("HAS_WEIGHT", "SMOOTHING", "SOFTCAP", "COMPUTE_LSE", "WRITE_LOSS", "WRITE_GRAD")
    flags += ("HAS_B", "HAS_Q")
    passes = {"fwd": {"COMPUTE_LSE", "WRITE_LOSS"}, "bwd,z": {"WRITE_GRAD", "HAS_B"}}
    options = {"": set(), "weight,smoothing,softcap": {"HAS_WEIGHT", "SMOOTHING", "SOFTCAP"}}
    launches = [  # (name, logits dtype, grad dtype, flags on)
        (
            f"cross_entropy_{p.split(',')[0]}[{','.join(filter(None, (d, o, *p.split(',')[1:])))}]",
            d,
            d,
            on | opt,
        )
        for d in ("fp16", "bf16", "fp32")
        for p, on in passes.items()
        for o, opt in options.items()
    ]
    fused = {"COMPUTE_LSE", "WRITE_LOSS", "WRITE_GRAD", "HAS_WEIGHT", "SMOOTHING", "HAS_Q"}
    for grad in ("fp16", "bf16"):
        launches.append((f"linear_cross_entropy[fp32->{grad},weight,smoothing,z]", "fp32", grad, fused))
    cases = []
    for name, dtype, grad, on in launches:
        sig = {}
        for arg in fn.arg_names:
            if arg == "logits_ptr":
                sig[arg] = _ptr(dtype)
            elif arg == "grad_ptr":
                sig[arg] = _ptr(grad)
            elif arg == "target_ptr":
                sig[arg] = "*i64"
            elif arg.endswith("_ptr"):
                sig[arg] = "*fp32"
            elif arg in ("smoothing", "softcap"):
                sig[arg] = "fp32"
            elif arg.isupper() or arg in ("stride_lc", "stride_gc"):
                sig[arg] = "constexpr"
            else:
                sig[arg] = "i32"
        const = {f: f in on for f in flags}
        const.update(stride_lc=1, stride_gc=1, ROWS=ce.rows_per_program(block), BLOCK_V=block)
        const["GRAD_DTYPE"] = getattr(tl, _TL_NAME[grad])
        cases.append(
            Case(
                name=name,
                family="rowwise",
                kernel="tkern.kernels.cross_entropy:_cross_entropy_kernel",
                signature=sig,
                constexprs=const,
                aligned=tuple(k for k in sig if k.endswith("_ptr")),
                num_warps=ce.num_warps(block),
                num_stages=ce.NUM_STAGES,
            )
        )
    return cases


def all_cases(cc: int, full: bool = True) -> list[Case]:
    """Every case for target ``cc``; ``full=False``: the compile gate's
    representative set (every dtype of every kernel; the plainest, the
    heaviest and the newest flag combinations of the update kernels; every
    config each GEMM autotuner offers, aligned and ragged, on the most
    register-hungry launches of tkern.linear (:func:`gate_launches`); every
    other launch only in the full report)."""
    cases = _update_cases("sgd", full) + _update_cases("adam", full) + _stats_cases() + _activation_cases()
    cases += cross_entropy_cases() + _swiglu_cases()
    return cases + _norm_cases(full) + _scale_cases() + _gemm_cases(cc, full)


# --------------------------------------------------------------------------- compile and read


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


_PTX_OP = re.compile(r"^(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);?$")


def _access_bits(op: str) -> int:
    vec, bits = 1, 32
    for part in op.split("."):
        if m := re.fullmatch(r"v(\d+)", part):
            vec = int(m.group(1))
        elif m := re.fullmatch(r"[bfsu](\d+)", part):
            bits = int(m.group(1))
    return vec * bits


def ptx_accesses(ptx: str, arg_names: list[str]) -> dict[str, list[int]]:
    """Width in bits of every ld/st.global, keyed by the kernel argument whose
    address it uses (traced through the 64-bit registers), '?' when unknown."""
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    params = re.findall(r"(\w+_param_(\d+))", entry.group(1)) if entry else []
    names = {p: (arg_names[int(i)] if int(i) < len(arg_names) else "?") for p, i in params}
    prov: dict[str, set] = collections.defaultdict(set)
    out = collections.defaultdict(list)
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    for _ in range(3):  # loops carry addresses backwards: a few passes reach the fixpoint
        for line in lines:
            m = _PTX_OP.match(line)
            if not m:
                continue
            op, ops = m.group(2), [o.strip() for o in m.group(3).split(",")]
            if op.startswith("ld.param") and len(ops) == 2:
                pm = re.search(r"\[(\w+)\]", ops[1])
                if pm and pm.group(1) in names:
                    prov[ops[0]].add(names[pm.group(1)])
            elif op.startswith(("ld.global", "st.global", "ld.", "st.")):
                continue
            elif ops and re.fullmatch(r"%rd\d+", ops[0]):
                for o in ops[1:]:
                    for r in re.findall(r"%rd\d+", o):
                        prov[ops[0]] |= prov[r]
    for line in lines:
        m = _PTX_OP.match(line)
        if not m or not m.group(2).startswith(("ld.global", "st.global")):
            continue
        addr = re.search(r"\[\s*(%rd\d+)", m.group(3))
        args = sorted(prov[addr.group(1)]) if addr else []
        for a in args or ["?"]:
            out[a].append(_access_bits(m.group(2)))
    return {k: sorted(v) for k, v in out.items()}


def analyse(kernel, case: Case, cc: int, sass: bool = True) -> dict:
    """The facts of a compiled ``case``; ``sass=False`` skips disassembling the
    cubin (~0.8 s a GEMM): the SASS counts (``spill_instructions``,
    ``sass_instructions``) are then None, every other fact is unchanged."""
    asm = kernel.asm
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(asm["cubin"])
        res = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        disasm = ""
        if sass:
            disasm = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True)
            disasm = disasm.stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", res)
    regs, stack, static_smem, local = (int(x) for x in m.groups()) if m else (0, 0, 0, 0)
    ops = collections.Counter(
        re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)", disasm)
    )
    heads = collections.Counter()
    for op, n in ops.items():
        heads[op.split(".")[0]] += n
    smem = kernel.metadata.shared + static_smem
    occ, limiter = occupancy(regs, smem, case.num_warps, cc)
    ptx, ttgir = asm["ptx"], asm["ttgir"]
    ttir = asm.get("ttir", "")
    fn = _kernel_fn(case.kernel)
    nonconst = [a for a in fn.arg_names if case.signature[a] != "constexpr"]
    return dict(
        regs=regs,
        spill_bytes=stack + local,  # ptxas's stack frame holds the spilled registers
        stack=stack,
        spill_instructions=heads["STL"] + heads["LDL"] if sass else None,
        smem=smem,
        occupancy_pct=occ,
        limiter=limiter,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        # wgmma groups each wait leaves in flight (``wgmma.wait_group N``), in program order
        wgmma_waits=[int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        fp8_mma=len(re.findall(r"(?:wgmma\.mma_async|\bmma\.sync)[^;\n]*\.e[45]m[23]", ptx)),
        cp_async_16=len(
            re.findall(
                r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)?\s+\[[^\]]+\],\s*\[[^\]]+\],\s*0x10", ptx
            )
        ),
        cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::\w+", ptx)),
        convert_layout=ttgir.count("ttg.convert_layout"),
        # tt.dot's maxNumImpreciseAcc per dot (scaled_mm's PRECISE_ACC: the K tile; 0: the default)
        imprecise_acc=[int(v) for v in re.findall(r"maxNumImpreciseAcc = (\d+)", ttir)],
        # elements of each converted tensor: a streaming kernel may move per-block values (the 8-bit
        # state's absmax, BLOCK / 256 per program) between layouts, never its element arrays
        convert_layout_elements=[
            math.prod(int(d) for d in shape.split("x"))
            for shape in re.findall(r"ttg\.convert_layout [^:]*: tensor<((?:\d+x)*\d+)x\w+", ttgir)
        ],
        sass_instructions=sum(ops.values()) if sass else None,
        global_access_bits=ptx_accesses(ptx, nonconst),
    )


def compile_case(case: Case, cc: int, sass: bool = True) -> dict:
    """Compile ``case`` for ``GPUTarget("cuda", cc, 32)`` and read its facts (:func:`analyse`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_fn(case.kernel)
    case = _fit(case, fn)
    index = {a: i for i, a in enumerate(fn.arg_names)}
    attrs = {(index[a],): [["tt.divisibility", 16]] for a in case.aligned}
    t0 = time.perf_counter()
    row = dict(case=case.name, kernel=case.kernel.split(":")[1], family=case.family, target=f"sm_{cc}",
               gated=case.gated, num_warps=case.num_warps, num_stages=case.num_stages)  # fmt: skip
    try:
        src = ASTSource(fn, case.signature, case.constexprs, attrs)
        kernel = triton.compile(
            src,
            target=GPUTarget("cuda", cc, 32),
            options=dict(num_warps=case.num_warps, num_stages=case.num_stages),
        )
        row.update(analyse(kernel, case, cc, sass), compiled=True)
    except Exception as exc:  # recorded; the gate fails on it
        row.update(compiled=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    if case.family == "streaming":
        size = {a: _SIZE[case.signature[a].lstrip("*")] for a in case.arrays}
        row["expected_bits"] = {a: min(case.per_thread * s, 16) * 8 for a, s in size.items()}
        row["per_thread"] = case.per_thread
    return row


def _compiled(name: str, cc: int):
    """The compile gate's case ``name`` compiled for sm_cc (Triton's compiled kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    case = next(c for c in all_cases(cc, full=False) if c.name == name)
    fn = _kernel_fn(case.kernel)
    case = _fit(case, fn)
    index = {a: i for i, a in enumerate(fn.arg_names)}
    attrs = {(index[a],): [["tt.divisibility", 16]] for a in case.aligned}
    return triton.compile(
        ASTSource(fn, case.signature, case.constexprs, attrs),
        target=GPUTarget("cuda", cc, 32),
        options=dict(num_warps=case.num_warps, num_stages=case.num_stages),
    )


def ordered_accesses(name: str, cc: int = 90) -> list[str]:
    """The PTX memory operations with an ordering (``atom``/``red``/``ld`` with acquire,
    release, acq_rel or relaxed semantics, and volatile loads) of the compile gate's case
    ``name`` compiled for sm_cc, in program order, each as its opcode with its guard
    (``@%p3 atom.global.gpu.acq_rel.add.u32``): what a grid barrier's correctness rests on,
    which a compiler may fold away (triton 3.6 dropped an acquire whose value went unused)."""
    ptx = _compiled(name, cc).asm["ptx"]
    op = r"(?:@!?%\w+\s+)?(?:atom|red|ld)\.[\w.:]*(?:acquire|release|acq_rel|relaxed|volatile)[\w.:]*"
    return re.findall(op, ptx)


def reduce_layouts(name: str, cc: int = 90) -> list[tuple[str, str]]:
    """``(shape, layout)`` of each fp32 reduction (``tt.reduce``), in program order, of the
    compile gate's case ``name`` compiled for sm_cc: a reduction's order of additions
    follows from its layout, so two kernels that must sum alike (pass 1 and the one-pass
    step) must reduce in the same layouts."""
    ir = _compiled(name, cc).asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, re.M))
    found = re.finditer(r"\}\) : \(tensor<([^,>]*), (#\w+)>\) -> f32", ir)
    return [(m.group(1), aliases.get(m.group(2), m.group(2))) for m in found]


def _compile_star(args):
    return compile_case(*args)


def run(targets=(90, 80), only: str | None = None, workers: int = 2, full: bool = True) -> list[dict]:
    """Compile every case for every target (``workers`` processes); return the rows.
    The gate's set (``full=False``) skips the SASS counts, which it does not check."""
    cases = [(c, cc) for cc in targets for c in all_cases(cc, full) if not only or re.search(only, c.name)]
    jobs = [(c, cc, full) for c, cc in cases]
    jobs.sort(key=lambda j: j[0].family != "gemm")  # the long compiles first: the pool ends together
    if workers <= 1:
        return [compile_case(*j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_compile_star, jobs, chunksize=2))


# --------------------------------------------------------------------------- output


def _widths(row: dict) -> str:
    acc = row.get("global_access_bits") or {}
    arrays = row.get("expected_bits") or {}
    if arrays:
        return " ".join(
            f"{a.removesuffix('_ptr')}:{'/'.join(map(str, sorted(set(acc.get(a, [])))))}" for a in arrays
        )
    return ""


def markdown(rows: list[dict], meta: dict) -> str:
    out = [
        "# Static report: what the compiler produces for each tkern kernel",
        "",
        "Compiler facts, not timings: registers per thread, local-memory spills, shared memory, an",
        "occupancy estimate from those (H100/H200 limits for sm_90, A100 for sm_80), tensor-core and",
        "copy instructions, layout conversions left in the TTGIR and the global access widths (bits) per",
        "array. Produced by `benchmarks/static_report.py` without a GPU.",
        "",
        f"triton {meta['triton']}, {meta['n_rows']} compiled variants, {meta['seconds']} s.",
        "",
        "| kernel case | target | warps | regs | spill B | smem B | occupancy | wgmma | cp.async 16B | TMA | "
        "convert_layout | access bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("compiled"):
            out.append(f"| {r['case']} | {r['target']} | FAILED: {r.get('error', '')[:80]} |||||||||")
            continue
        out.append(
            f"| {r['case']} | {r['target']} | {r['num_warps']} | {r['regs']} | {r['spill_bytes']} | "
            f"{r['smem']} | {r['occupancy_pct']}% ({r['limiter']}) | {r['wgmma']} | {r['cp_async_16']} | "
            f"{r['tma_loads']} | {r['convert_layout']} | {_widths(r)} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--only", help="regex on case names")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for static.json and static.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--gate-set", action="store_true", help="only the compile gate's representative set")
    args = ap.parse_args(argv)
    import triton

    import tkern

    if tkern.INTERPRET:
        sys.exit("static_report compiles for GPUs: run it with TRITON_INTERPRET=0")
    t0 = time.perf_counter()
    rows = run(tuple(args.targets), args.only, args.workers, full=not args.gate_set)
    meta = dict(triton=triton.__version__, n_rows=len(rows), seconds=round(time.perf_counter() - t0, 1))
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "triton-" + triton.__version__
        (args.out / f"{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        (args.out / f"{tag}.md").write_text(markdown(rows, meta))
        print(f"wrote {args.out / tag}.json and .md")
    failed = [r for r in rows if not r.get("compiled")]
    print(f"{len(rows)} variants in {meta['seconds']} s, {len(failed)} failed to compile")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
