"""The targets static_report compiles for and the record of one compiled case: each
target's per-SM limits (the occupancy estimate), :class:`Case` (what ``triton.compile``
needs and what the compile gate checks), the signature helpers every case builder
shares, and the kernel a case names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

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


def offered_configs(configs: list, cc: int, **rules) -> list:
    """``configs`` as tkern's autotuner prunes them on target ``cc`` under ``rules``
    (``gemm_configs.prune_configs``' keywords): the one place every case builder names
    the target to the pruning."""
    from tkern.kernels import gemm_configs

    return gemm_configs.prune_configs(configs, cc, **rules)


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
