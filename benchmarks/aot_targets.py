"""The targets static_report compiles for and the record of one compiled case: each
target's per-SM limits (the occupancy estimate), :class:`Case` (what ``triton.compile``
needs and what the compile gate checks), the signature helpers every case builder
shares, and the kernel a case names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

# --------------------------------------------------------------------------- targets

#: The compile gate's targets: one per architecture tkern plans for (tkern.device.SPECS,
#: so the gate and the specs agree), as each spec's ``arch``.
GATE_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
#: (the targets whose every offered config the gate compiles, under Triton 3.7 and newer:
#: ``tkern.train.device_report.COMPILED_EVERY_CONFIG``, sm_90 and sm_100; the others, and
#: every target under 3.6, the GPU machines' version: the first config per family and layout)


def spec_of(target):
    """``target`` (a :class:`tkern.device.DeviceSpec`, an arch string ``"sm_90"`` /
    ``"gfx942"``, or an NVIDIA compute capability ``90``) as the first named spec of
    its arch in ``tkern.device.SPECS`` (the capability's own spec where none is named)."""
    from tkern import device as tkdev

    if isinstance(target, tkdev.DeviceSpec):
        return target
    arch = f"sm_{target}" if isinstance(target, int) else target
    spec = next((s for s in tkdev.SPECS.values() if s.arch == arch), None)
    return spec or tkdev.spec_for_cc(int(arch.removeprefix("sm_")))


def arch_of(target) -> str:
    return spec_of(target).arch


def swept(configs: list, target) -> list:
    """``configs`` as the compile gate compiles them on ``target``: all on
    ``device_report.COMPILED_EVERY_CONFIG`` (under Triton 3.7 and newer), else the first one."""
    import triton

    from tkern.train.device_report import COMPILED_EVERY_CONFIG

    newer = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)
    return list(configs) if newer and arch_of(target) in COMPILED_EVERY_CONFIG else list(configs[:1])


def offered_configs(configs: list, cc, **rules) -> list:
    """``configs`` as tkern's autotuner prunes them on target ``cc`` under ``rules``
    (``gemm_configs.prune_configs``' keywords): the one place every case builder names
    the target to the pruning."""
    from tkern.kernels import gemm_configs

    return gemm_configs.prune_configs(configs, spec_of(cc), **rules)


def smem_limit(cc) -> int:
    """Largest dynamic shared memory (LDS) one program may use on target ``cc``."""
    return spec_of(cc).smem_per_block


def _hw(cc) -> dict:
    """Per-SM (CU) limits for the occupancy estimate: registers (32-bit, all threads),
    shared memory, resident warps (waves) and blocks; the allocation granule of a warp's
    registers. NVIDIA from CUDA's capability table (48 warps on sm_86/89/120); AMD CDNA3/4:
    4 SIMDs of 512 VGPRs x 64 lanes, 8 waves each, LDS 64 KB (gfx942) / 160 KB (gfx950)."""
    spec = spec_of(cc)
    if spec.is_amd:
        return dict(
            regs=4 * 512 * 64, smem_sm=spec.smem_per_block, reserved=0, warps=32, blocks=32, granule=8
        )  # noqa: E501
    warps = 64 if spec.cc in (80, 90, 100) else 48
    return dict(
        regs=65536, smem_sm=spec.smem_per_block + 1024, reserved=1024, warps=warps, blocks=32, granule=8
    )  # noqa: E501


def occupancy(regs: int, smem: int, warps: int, cc) -> tuple[float, str]:
    """(resident warps / maximum warps in %, the limiting resource)."""
    hw, lanes = _hw(cc), spec_of(cc).warp_size
    if smem > smem_limit(cc):
        return 0.0, "smem over the per-block limit"
    per_warp = math.ceil(max(regs, 1) / hw["granule"]) * hw["granule"] * lanes
    limits = {
        "warps": hw["warps"] // warps,
        "blocks": hw["blocks"],
        "smem": hw["smem_sm"] // (smem + hw["reserved"]) if smem + hw["reserved"] else hw["blocks"],
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
