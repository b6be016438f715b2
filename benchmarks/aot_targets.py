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


def gate_targets() -> tuple[str, ...]:
    """The compile gate's targets: one per architecture tkern plans for (tkern.device.SPECS),
    as each spec's ``arch``: ``device_report.COMPILED_IN_CI``, the list docs/devices.md's
    "compiled in CI" column is printed from (read when asked: tkern is imported late)."""
    from tkern.train.device_report import COMPILED_IN_CI

    return COMPILED_IN_CI


#: How much of a target the gate compiles (:func:`depth`): ``REPORT`` (static_report's
#: tables) every offered config on every launch; ``EVERY_CONFIG`` every offered config on its
#: kernel's heaviest launches, the first one on every launch, every variant of the other
#: kernels; ``FIRST_CONFIG`` the first config on the heaviest launches, the other kernels'
#: heaviest variants.
REPORT, EVERY_CONFIG, FIRST_CONFIG = "report", "every config", "first config"


def depth(target, full: bool = False) -> str:
    """:data:`REPORT` for the full report (``full``); for the gate :data:`EVERY_CONFIG` on
    ``device_report.COMPILED_EVERY_CONFIG`` (sm_90 and sm_100) under Triton 3.7 and newer,
    else :data:`FIRST_CONFIG` (the other targets, and every target under 3.6, the GPU
    machines' version: one config per GEMM family and layout, the CI budget's share)."""
    import triton

    from tkern.train.device_report import COMPILED_EVERY_CONFIG

    if full:
        return REPORT
    newer = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)
    return EVERY_CONFIG if newer and arch_of(target) in COMPILED_EVERY_CONFIG else FIRST_CONFIG


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


def sweep(configs: list, level: str, heaviest, others=None) -> list[tuple]:
    """The ``(config, launch)`` pairs a GEMM family's cases compile at ``level``
    (:func:`depth`), ``heaviest(config)`` being the launches that set the config's spill
    bound and ``others(config)`` the rest: every config on both (:data:`REPORT`); every
    config on its heaviest and each other launch on the first config offered to it
    (:data:`EVERY_CONFIG`); each heaviest launch on the first config offered to it
    (:data:`FIRST_CONFIG`: one config per family and layout)."""
    pairs, seen = [], set()
    for cfg in configs:
        every = [] if level == FIRST_CONFIG else heaviest(cfg)
        first = heaviest(cfg) if level == FIRST_CONFIG else others(cfg) if others else []
        if level == REPORT:
            every, first = [*every, *first], []
        launches = [*every, *(v for v in first if v not in seen)]
        seen.update(first)
        pairs += [(cfg, v) for v in dict.fromkeys(launches)]
    return pairs


#: The targets whose every variant of the other kernels the gate compiles (fp16's and fp32's,
#: the tails, the plainest flags: ``Case.light``) where it compiles every config: Hopper's,
#: where tkern's kernels are measured (H100, H200). A lighter variant's code differs from its
#: kernel's heaviest in conversions and flags, not by target: elsewhere the heaviest stand.
EVERY_VARIANT = ("sm_90",)


def every_variant(target) -> bool:
    """Whether the gate compiles every variant of the other kernels on ``target``
    (:data:`EVERY_VARIANT`, at :data:`EVERY_CONFIG` depth), else their heaviest."""
    return depth(target) == EVERY_CONFIG and arch_of(target) in EVERY_VARIANT


def launch_configs(configs: list, level: str, heaviest: bool) -> list:
    """The configs of one launch (``configs``: the ones offered to it) compiled at ``level``
    (:func:`sweep`), as a launch that sets its configs' spill bound (``heaviest``) or not."""
    if heaviest:
        return [cfg for cfg, _ in sweep(configs, level, lambda c: [0])]
    return [cfg for cfg, _ in sweep(configs, level, lambda c: [], lambda c: [0])]


def offered_configs(configs: list, cc, **rules) -> list:
    """``configs`` as tkern's autotuner offers them on target ``cc`` under ``rules``
    (``gemm_configs.offered_configs``: on AMD its MFMA configs, then the pruning's
    keywords): the one place every case builder names the target to the plan."""
    from tkern.kernels import gemm_configs

    return gemm_configs.offered_configs(configs, spec_of(cc), **rules)


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
    light: bool = False  # a lighter variant of its kernel: compiled where the depth is EVERY_CONFIG or REPORT
    options: dict = dataclasses.field(default_factory=dict)  # the backend's knobs a config carries (AMD's)


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


def light_dtype(dtype: str) -> bool:
    """Whether a kernel's ``dtype`` variant is a lighter one (``Case.light``: compiled where
    the gate compiles every config): every one but bf16's, the training dtype on every GPU
    tkern plans for (fp16's is its code with other conversions, fp32's the same arithmetic
    on wider loads)."""
    return dtype != "bf16"


def _streaming_case(name, kernel, sig, constexprs, *, aligned, num_warps, block, arrays, tail, dtype) -> Case:
    """A per-element kernel's case ``name[...]`` (``name`` without its closing bracket):
    its aligned launch (``n`` divisible by 16 too; gated) or its tail (only compiled; light,
    as fp16's is: :func:`light_dtype`)."""
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
        light=tail or light_dtype(dtype),
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
