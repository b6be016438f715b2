"""The GEMM family's tile configurations, the one place they live.

Both GEMM kernels (``_matmul_kernel`` in gemm.py, ``_matmul_tma_kernel`` in
gemm_tma.py) are autotuned over the tables here; the rules that prune a table
for a device (shared memory, register pressure, ragged operands) are named
constants next to the tables, each with the compiler fact it comes from
(``benchmarks/static_report.py`` measures them; ``tests/test_compiled.py``
holds every offered config to them on sm_90 and sm_100, the first of each list on
the other targets of tkern.device.SPECS).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from tkern import device as tkdev
from tkern.device import DeviceSpec
from tkern.kernels import gemm_epilogue, gemm_plan
from tkern.kernels._common import AUTOTUNE, INTERPRET, autotune
from tkern.kernels.activation import ACTIVATIONS, TRANSCENDENTAL

#: Programs that share a band of A rows (grouped tile order, see gemm_epilogue.tile_coords),
#: so that band stays in L2.
GROUP_M = 8


def epi_split(block_m: int, block_n: int, num_warps: int, warp_size: int = 32) -> int:
    """Column slices of an exp/erf epilogue (GELU, SiLU, tanh-GELU): one per 32 accumulator values a thread
    holds, at most 4 (128x256 on 8 warps: 128 values, 4 slices of 32)."""
    return max(1, min(4, acc_per_thread(block_m, block_n, num_warps, warp_size) // 32))


def acc_per_thread(block_m: int, block_n: int, num_warps: int, warp_size: int = 32) -> int:
    """fp32 accumulator values each thread holds for a (block_m, block_n) tile on
    ``num_warps`` warps of ``warp_size`` threads (64 on AMD's waves)."""
    return block_m * block_n // (warp_size * num_warps)


def _config(bm: int, bn: int, bk: int, stages: int, warps: int, pre_hook=None) -> triton.Config:
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M}
    meta["EPI_SPLIT"] = epi_split(bm, bn, warps)
    return triton.Config(meta, num_stages=stages, num_warps=warps, pre_hook=pre_hook)


def gemm_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    """Tiles of the pointer kernel (``_matmul_kernel``).

    The first entry is the only one used under the interpreter, where big tiles
    matter most (each program costs milliseconds on the CPU, the tile size
    almost nothing). The rest are the tile shapes of Triton's matmul tutorial
    for fp16 on Ampere/Hopper plus 64-deep K tiles, which let Hopper's wgmma
    issue fewer, larger instructions. ``interpret=False`` gives a GPU's table on a CPU
    (``tkern info --device``).
    """
    return [
        _config(128, 128, 64, 3, 8) if not interpret else _config(128, 128, 128, 1, 4),
        _config(128, 256, 64, 3, 8),
        _config(256, 128, 64, 3, 8),
        _config(128, 256, 64, 4, 8),
        _config(128, 128, 64, 4, 4),
        _config(128, 128, 32, 4, 4),
        _config(128, 64, 32, 4, 4),
        _config(64, 128, 32, 4, 4),
        _config(64, 64, 64, 4, 4),
        # 4 warps (one warpgroup): with 2 it could not use Hopper's wgmma
        _config(64, 32, 32, 5, 4),
    ]


def split_k_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    """Tiles of the split-K kernel (gemm_split.py): the pointer kernel's 128 x 128
    entries, since ``gemm_plan.plan_gemm`` counts 128 x 128 tiles when it picks the
    number of splits (another tile would change the waves it planned), and 128x128x32 on 8
    warps: on AMD's 64-wide waves (:func:`amd_configs`: 4 of them) the one 128 x 128 tile
    with 64 accumulator values a thread and 32-deep K steps, which sums dbias in its K ranges
    without spilling where 128x128x64 does (:data:`SUM_A_MAX_LOADS`)."""
    tile = (gemm_plan.PLAN_BLOCK_M, gemm_plan.PLAN_BLOCK_N)
    configs = [c for c in gemm_configs(interpret) if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == tile]
    return configs + ([] if interpret else [_config(*tile, 32, 4, 8)])


def fp8_gemm_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    """Tiles of the pointer kernel on fp8 operands (``scaled_mm``): 128-deep K tiles
    (one per 128-wide block scale, four k32 ``wgmma`` steps each), which fp8's one
    byte an element leaves room for; the first is the interpreter's."""
    return [
        _config(128, 128, 128, 3, 8) if not interpret else _config(128, 128, 128, 1, 4),
        _config(128, 256, 128, 3, 8),
        _config(256, 128, 128, 3, 8),
        _config(128, 128, 128, 4, 4),
        _config(128, 64, 128, 4, 4),
        _config(64, 128, 128, 4, 4),
        _config(64, 64, 128, 4, 4),
        _config(128, 128, 64, 4, 8),
    ]


# --------------------------------------------------------------------------- AMD (MFMA)

#: Threads per wave on AMD's GPUs (gfx942, gfx950).
AMD_WARP_SIZE = 64
#: The AMD backend's stream pipeliner: two stages (one tile computing, one loading)
#: is what Triton's AMD matmul tutorial offers on MI300.
AMD_STAGES = 2
#: Compiled on a CPU (triton 3.9, bf16, NT and TN, ``GPUTarget("hip", arch, 64)``): every
#: config offered on gfx942 keeps to 68-222 VGPRs without spilling and 6-32 KB of LDS (two
#: stages there hold one LDS buffer: half of :func:`smem_estimate`); the ones the register
#: rules drop (128 accumulator values a thread: 128x256 and 256x128 on 4 waves, 128x128 on
#: 2) spill 23-83 VGPRs in TN. On gfx950 the offered configs use 12-66 KB (two buffers:
#: 128x128x64 needs 67,520 B, just over the estimate, well under its 160 KB), no spills.
#: Knobs of Triton's AMD matmul tutorial: ``waves_per_eu`` 2 (occupancy hint: two waves
#: per SIMD, so the register budget per wave is what two leave), ``matrix_instr_nonkdim``
#: 16 (16x16 MFMA instructions), ``kpack`` 2 on gfx942 (gfx950 deprecates it: 1).
AMD_KNOBS = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}


@functools.cache
def _amd_backend_knobs() -> frozenset:
    """The :data:`AMD_KNOBS` (and ``kpack``) the installed Triton's AMD backend takes."""
    try:
        from triton.backends.amd.compiler import HIPOptions
    except ImportError:  # a Triton without its AMD backend: none
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(HIPOptions)) & {*AMD_KNOBS, "kpack"}


def amd_configs(configs: list[triton.Config], arch: str = "gfx942") -> list[triton.Config]:
    """The pointer kernel's ``configs`` as they are offered on an AMD GPU (``arch``):
    the same tiles on the same number of threads (64-wide waves: half the warps, at
    least 2), :data:`AMD_STAGES` stages, and the :data:`AMD_KNOBS` the installed Triton
    accepts (never on NVIDIA, whose backend refuses them). Duplicates dropped."""
    accepted = _amd_backend_knobs()
    knobs = {k: v for k, v in AMD_KNOBS.items() if k in accepted}
    if "kpack" in accepted and arch == "gfx942":
        knobs["kpack"] = 2
    out, seen = [], set()
    for c in configs:
        kw = c.kwargs
        tile = (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"])
        warps = max(2, c.num_warps * 32 // AMD_WARP_SIZE)
        stages = min(c.num_stages, AMD_STAGES)
        if (tile, warps, stages) in seen:
            continue
        seen.add((tile, warps, stages))
        meta = {"BLOCK_M": tile[0], "BLOCK_N": tile[1], "BLOCK_K": tile[2], "GROUP_M": kw["GROUP_M"]}
        meta["EPI_SPLIT"] = epi_split(tile[0], tile[1], warps, AMD_WARP_SIZE)
        out.append(triton.Config({**meta, **knobs}, num_stages=stages, num_warps=warps, pre_hook=c.pre_hook))
    return out


def set_tma_block_shapes(nargs: dict) -> None:
    """Pre-hook of every :func:`tma_configs` entry: the descriptors' block
    shapes are the config's tiles (of A or A^T, of B or B^T)."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]
    if nargs.get("C_TMA"):  # the TMA-store epilogue stores C in column slices
        parts = gemm_epilogue.epilogue_parts(nargs["EPI_SPLIT"], nargs["ACTIVATION"], nargs["ACCUMULATE"])
        nargs["c_desc"].block_shape = [bm, bn // parts]


def tma_configs() -> list[triton.Config]:
    """Tiles of the persistent tensor-descriptor kernel (``_matmul_tma_kernel``):
    Triton's persistent matmul tutorial's search space for Hopper, 128-row
    tiles, and 128x64x64 in 3 stages on 8 warps: the one tile with 32 accumulator values a
    thread, which a ragged output with GELU needs where mma.sync keeps its operands in
    registers (sm_120: :data:`TMA_RAGGED_ACT_MAX_ACC`); the pre-hook gives the descriptors
    each config's block shape."""
    tutorial = [(128, bn, bk, stages) for bn in (128, 256) for bk in (64, 128) for stages in (3, 4)]
    return [
        _config(bm, bn, bk, stages, 8, pre_hook=set_tma_block_shapes)
        for bm, bn, bk, stages in [*tutorial, (128, 64, 64, 3)]
    ]


def set_blockwise_block_shapes(nargs: dict) -> None:
    """Pre-hook of every :func:`blockwise_configs` entry: the descriptors' block shapes
    are the config's tiles (A (M, K) and B^T (N, K), both K-major; C in column slices)."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    if nargs.get("C_TMA"):
        parts = gemm_epilogue.epilogue_parts(nargs["EPI_SPLIT"], 0, nargs["ACCUMULATE"])
        nargs["c_desc"].block_shape = [bm, bn // parts]


#: The blockwise kernel's K tile: one 128-wide scale block per step (gemm_blockwise.py).
BLOCKWISE_BLOCK_K = 128


def blockwise_configs(column_scales: bool = False) -> list[triton.Config]:
    """Tiles of the blockwise fp8 kernel (``_scaled_mm_blockwise_kernel``): K steps of one
    128-wide scale block, deep TMA pipelines (fp8 is one byte an element: 32 KB a stage
    for 128x128). The first is the interpreter's.

    ``column_scales``: B's scales are a vector along N (the blockwise wgrad's 128x1
    columns of X) rather than one value per 128x128 block; the software pipeliner holds
    that vector in registers for every stage in flight, next to the block's fresh product
    and the accumulator. Measured (static_report, sm_90, triton 3.9, ``C +=`` into a bf16
    gradient): 128x128 on 8 warps spills 96-240 B with 3-4 stages; 128x64 on 4 warps keeps
    203-204 registers, 64x128 on 4 205, 128x64 on 8 151, no spills. Block scales fit
    128x128 on 8 warps (152-162 registers) and 64x128 / 128x64 on 4 (159-172), no spills."""
    hook = set_blockwise_block_shapes
    bk = BLOCKWISE_BLOCK_K
    if INTERPRET:
        return [_config(128, 128, bk, 1, 4, pre_hook=hook)]
    if column_scales:
        tiles = [(128, 64, 4, 8), (128, 64, 4, 4), (64, 128, 4, 4), (128, 64, 3, 4)]
    else:
        tiles = [(128, 128, 4, 8), (128, 128, 3, 8), (128, 128, 5, 8), (64, 128, 6, 4), (128, 64, 6, 4)]
    return [_config(bm, bn, bk, stages, warps, pre_hook=hook) for bm, bn, stages, warps in tiles]


# --------------------------------------------------------------------------- pruning rules

#: Largest shared memory one program may use, by compute capability (H100/H200
#: and B200: 227 KB; A100 and Orin: 163 KB; sm_86/89/120: 99 KB).
SMEM_LIMIT = {90: 232448, 100: 232448, 103: 232448, 80: 166912, 87: 166912}
_SMEM_DEFAULT = 101376


def smem_limit(cc: int) -> int:
    """:data:`SMEM_LIMIT` for compute capability ``cc`` (e.g. 90); a :class:`DeviceSpec`'s
    is its ``smem_per_block``."""
    return SMEM_LIMIT.get(cc, _SMEM_DEFAULT)


def as_spec(device: DeviceSpec | int | str) -> DeviceSpec:
    """``device`` as a :class:`DeviceSpec`: an int is an NVIDIA compute capability
    (``tkern.device.spec_for_cc``, shared memory from :func:`smem_limit`), a string a
    named GPU; a spec is returned as it is."""
    if isinstance(device, int):
        return dataclasses.replace(tkdev.spec_for_cc(device), smem_per_block=smem_limit(device))
    return tkdev.device_spec(device)


def operands_in_registers(spec: DeviceSpec) -> bool:
    """Whether the tensor-core instruction keeps its operand fragments in registers next
    to the accumulator (``mma.sync``: Ampere, Ada, sm_120; MFMA on AMD), so the
    accumulator gets fewer of them than under wgmma / tcgen05, which read shared memory.
    The rules measured on sm_80 (``PRE_HOPPER_*``, ``BLOCK_SCALES_MAX_ACC``'s) apply."""
    return spec.mma in ("mma.sync", "mfma")


def smem_estimate(cfg: triton.Config, elem_bytes: int = 2) -> int:
    """Shared memory of a config's load pipeline: ``num_stages`` A and B tiles.
    The compiled kernel adds ~1 KB (pointer kernel) to ~34 KB (the TMA
    kernel's epilogue staging); tests/test_compiled.py checks every offered
    config's compiled size against the limit on sm_90 and sm_100 (the first config on
    the other targets)."""
    kw = cfg.kwargs
    return cfg.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * elem_bytes


def c_staging(cfg: triton.Config, out_bytes: int = 2) -> int:
    """Shared memory the blockwise kernel's ``C +=`` epilogue stages C's old tile in: one
    column slice (gemm_epilogue.epilogue_parts) of a 16-bit C. Measured (sm_120, triton 3.9):
    its wgrad's 128x64x128 in 4 stages on 8 warps uses 107,560 B against its pipeline's
    98,304 (over the 101,376 B there); the 16-bit TMA kernel's ``C +=`` stays within
    :func:`smem_estimate` (99,376 B for 128x128x64 in 3 stages, estimated 98,304)."""
    kw = cfg.kwargs
    return kw["BLOCK_M"] * kw["BLOCK_N"] // gemm_epilogue.epilogue_parts(kw["EPI_SPLIT"], 0, True) * out_bytes


#: Largest output tile the pointer kernel is offered on ragged operands: without
#: 16-byte alignment it loads with scalar instructions and no cp.async, and the
#: 128x128 and larger tiles then spill (56 B to 4.3 KB on sm_80); 128x64,
#: 64x128, 64x64 and 64x32 do not (see benchmarks/results/static/).
RAGGED_MAX_TILE = 128 * 64


#: Operand elements a thread loads per K step (A and B tiles together) above
#: which the pointer kernel spills on ragged operands: without 16-byte alignment
#: every element is a scalar load that holds a register until it is written to
#: shared memory, next to the accumulator. 64x64x64 on 4 warps (64 per thread)
#: spills 40 B on sm_90 in wgrad's layout (dZ^T @ X, 255 registers, triton 3.9);
#: 128x64x32, 64x128x32 (48) and 64x32x32 (24) stay at or under 255 without spilling.
RAGGED_MAX_LOADS = 48
#: ... by architecture (``DeviceSpec.arch``) where it is lower. gfx950: the 48-element tiles
#: spill on ragged operands (triton 3.9, 2 waves): 128x64x32 28 B of scratch in dgrad (NN) and
#: 352 B in wgrad summing dbias (TN), 64x128x32 128 B there; 64x32x32 (24) stays at 106-174
#: VGPRs. (gfx942 fits the 48-element ones: 160-226.)
RAGGED_MAX_LOADS_BY_ARCH = {"gfx950": 24}


def loads_per_thread(block_m: int, block_n: int, block_k: int, num_warps: int, warp_size: int = 32) -> int:
    """Elements of the A (block_m, block_k) and B (block_k, block_n) tiles each thread loads per K step."""
    return (block_m + block_n) * block_k // (warp_size * num_warps)


#: Accumulator values per thread above which the pointer kernel spills before
#: Hopper (mma.sync keeps its operand fragments in registers next to the
#: accumulator): 128x256 and 256x128 on 8 warps spill 40 B on sm_80 under
#: triton 3.6 with any epilogue, 16-40 B with GELU even in four column slices.
PRE_HOPPER_MAX_ACC = 64


#: Hopper, pointer kernel, an epilogue applying one of :data:`ACT_MAX_ACC_ACTIVATIONS` (a
#: fused linear + activation, with or without the pre-activation stored for backward): at
#: most this many accumulator values per thread. Measured for GELU (static_report, sm_90,
#: triton 3.6, the GPU machines' version): the tiles holding 128 (128x256 and 256x128 on 8
#: warps, 128x128 on 4) reach 255 registers without a bias and spill 8-24 B (three of five
#: with the pre-activation, all five without it); the 64-value tiles stay at 122-136
#: registers. (Triton 3.9 fits them: the rule follows the older compiler.)
ACT_MAX_ACC = 64
#: The ``ACTIVATION`` codes :data:`ACT_MAX_ACC` applies to: GELU (erf form) only. SiLU and
#: tanh-GELU (one exp and one division each, in the same column slices) fit the 128-value
#: tiles: 168-226 registers and no spills on sm_90 under triton 3.6 and 3.9, with or without
#: a bias and the pre-activation (static_report, the compile gate's heaviest forwards).
ACT_MAX_ACC_ACTIVATIONS = frozenset({ACTIVATIONS["gelu"]})
#: The TMA kernel is held to :data:`ACT_MAX_ACC` for those activations too on a ragged
#: output (N or C's row stride not a multiple of 16: C and the pre-activation are stored
#: with scalar instructions, each holding its registers): measured (aot_report's public
#: cases, sm_90, triton 3.6) on the demo's 512 x 784 -> 1000 GELU layer, 128x256x64 on
#: 8 warps (s3 and s4, 128 accumulator values a thread) spills 772-776 B with the
#: pre-activation, in bf16 and fp16; the 128x128 tiles (64 values) stay at 255 registers
#: without spilling. Aligned outputs (16-byte vector stores) fit every TMA config.

#: The TMA kernel on a ragged output with one of :data:`ACT_MAX_ACC_ACTIVATIONS`, by
#: tensor-core instruction, where the operands sit in registers: at most this many
#: accumulator values per thread. sm_120 (triton 3.9, GELU, the pre-activation stored):
#: 128x128x64 on 8 warps (64 values) spills 32-96 B, 128x64x64 on 8 (32) stays at 122-185
#: registers; sm_100 (tcgen05, the accumulator read out of tensor memory for the scalar
#: stores): every 128x128 tile spills 8-88 B (255 registers with the bias), 128x64x64 stays at
#: 110-120. The 128x64 tile serves these launches alone (:data:`TMA_MIN_BLOCK_N`).
#: The TMA kernel's narrowest tile everywhere else: the tutorial's 128 columns (the 128x64 tile
#: of :func:`tma_configs` spills 16 B on sm_100 in ``C +=`` at 64 registers).
TMA_MIN_BLOCK_N = 128
#: The TMA kernel on an aligned output storing the pre-activation of one of
#: :data:`ACT_MAX_ACC_ACTIVATIONS` beside an fp32 C, by tensor-core instruction: at least this
#: many columns a tile. Measured (sm_100, triton 3.9, fp16 -> fp32, GELU, no bias): ptxas holds
#: the 128x128 tiles (64 accumulator values a thread) at its 128-register step and spills 8 B
#: there (128x128x64 in 3 and 4 stages, 128x128x128 in 3); 128x256x64 in 3 and 4 stages takes
#: 148 registers and spills none. (With an fp32 bias the 128x128 tiles took 156, none spilled:
#: held to the same rule, so one table serves both; bf16 out: 98-134, none spill.)
TMA_FP32_PREACT_MIN_BLOCK_N = {"tcgen05": 256}
#: The pointer kernel's tallest tile, by tensor-core instruction: sm_100 (triton 3.9) spills
#: 80 B on 256x128x64 (255 registers, fp32 out with an fp32 bias), where 128x256x64 stays at
#: 230-234; sm_90's wgmma fits both (199-239).
POINTER_MAX_BLOCK_M = {"tcgen05": 128}
TMA_RAGGED_ACT_MAX_ACC = {"mma.sync": 32, "tcgen05": 32}
#: A kernel summing A's rows (``SUM_A``: the wgrad's dbias, dZ^T read transposed; split-K's
#: and the pointer kernel's prologue), by architecture: at most this many operand elements
#: loaded per thread per K step. gfx950 (triton 3.9, bf16 dbias): split-K's 128x128x64 on 4
#: waves (64) spills 2 VGPRs, 128x128x32 (32) stays at 154.
SUM_A_MAX_LOADS = {"gfx950": 48}

#: fp8 operands (scaled_mm, one byte an element), an epilogue with an exp/erf activation
#: (activation.TRANSCENDENTAL: a Float8Linear's fused MLP activation): at most this many
#: output elements per tile. Measured (static_report, sm_90, triton 3.9) with tanh-GELU, the
#: bias and the pre-activation: 128x256 and 256x128 on 8 warps spill 336 and 8 B; every
#: 128x128 and smaller tile compiles without spills (erf GELU is held to ACT_MAX_ACC anyway).
FP8_ACT_MAX_TILE = 128 * 128


#: Hopper, pointer kernel, an operand prologue (gemm.matmul_backward applying an
#: activation's gradient to A while loading it): A's and Z's tiles pass through
#: registers next to the accumulator. At most this many accumulator values per thread.
#: Measured (static_report, sm_90, triton 3.9, bf16, dgrad NN storing dZ and wgrad TN
#: summing dbias): with ReLU's gradient the 64-value tiles stay at 128-189 registers;
#: the 128-value tiles (128x256 and 256x128 on 8 warps, 128x128 on 4) spill 32-328 B.
PROLOGUE_MAX_ACC = 64
#: The prologue of an activation whose gradient is more than a select (GELU: erf and
#: exp on every element of A): at most this many elements of A's (BLOCK_M, BLOCK_K)
#: tile per thread. Measured (triton 3.9 and 3.6, bf16): 64x128x32 and 64x32x32 on 4 warps
#: (16) do not spill on sm_90 (96-255 registers, ragged operands too); the 32-element
#: tiles spill: 128x64x32 on 4 warps and 128x128x64 on 8 (8-24 B on sm_90), 64x64x64 on
#: 4 (56-496 B on sm_80, where mma.sync holds A's fragments in registers too).
PROLOGUE_ACT_MAX_A = 16
#: ... and before Hopper at most this many accumulator values per thread: 64x128x32 on 4
#: warps (64) spills 8 B on sm_80 under triton 3.6 in dgrad storing dZ; 64x32x32 (16) does not.
PROLOGUE_ACT_PRE_HOPPER_MAX_ACC = 32
#: ... and operand elements loaded per thread per K step (A's, Z's and B's tiles), by
#: architecture. gfx942 (triton 3.9, aligned, bf16, ReLU'): 128x128x64 on 4 waves (96) spills
#: 180 B of scratch in wgrad summing dbias (dZ^T and Z^T read transposed), 64x64x64 on 2 (96)
#: reaches all 256 VGPRs; the tiles loading 80 or fewer stay at 118-238. (gfx950: 104-244.)
PROLOGUE_MAX_LOADS = {"gfx942": 80}
#: ... and warps and stages, by architecture. sm_120 (triton 3.9, ReLU'): 128x128x64 on 8
#: warps spills 64 B in dgrad storing dZ (255 registers; sm_80/86/89 keep it at 186-187), and
#: 64x32x32 in 5 stages 8 B in wgrad (ptxas spills 4 B at 80 registers); the 4-warp tiles in 4
#: stages stay at 142-186.
PROLOGUE_MAX_WARPS = {"sm_120": 4}
PROLOGUE_MAX_STAGES = {"sm_120": 4}
#: Activation codes whose gradient is a select (``dy`` where ``z > 0``): only
#: :data:`PROLOGUE_MAX_ACC` holds for them; every other code is held to
#: :data:`PROLOGUE_ACT_MAX_A` (and :data:`PROLOGUE_ACT_PRE_HOPPER_MAX_ACC`) too.
PROLOGUE_SELECT = frozenset({ACTIVATIONS["relu"]})


#: fp8 with a second accumulator (scaled_mm's PRECISE_ACC: each K tile's wgmma partial sum
#: is added into the fp32 accumulator; block scales: each K tile's product is scaled, then
#: added): at most this many accumulator values per thread. Measured (static_report, sm_90,
#: triton 3.9, Float8Linear's launches): the 128-value tiles (128x256x128 and 256x128x128 on
#: 8 warps, 128x128x128 on 4) reach 255 registers and spill 8-176 B with PRECISE_ACC and
#: 232-448 B with block scales; the 64-value tiles stay at 102-237 registers, no spills. The
#: forward (fast accumulation, per-tensor scales) fits every fp8 tile (72-233 registers).
TWO_ACC_MAX_ACC = 64
#: ... and block scales, by tensor-core instruction (``DeviceSpec.mma``), where each K tile's
#: product sits in registers next to the accumulator to be scaled: mma.sync and MFMA hold their
#: operand fragments there too, tcgen05 loads the product out of tensor memory every K tile. At
#: most this many. Measured (triton 3.9): on sm_89 128x128x128 on 8 warps spills 16 B in the
#: blockwise wgrad and 64x128x128 on 4 warps 8 B, 64x64x128 on 4 (32 values) stays at 183
#: registers; on sm_100 every 64-value tile but 64x128x128 spills 8-112 B (forward with the bias,
#: wgrad adding into C), 64x64x128 stays at 168. (Per-tensor scales promote nothing there.)
BLOCK_SCALES_MAX_ACC = {"mma.sync": 32, "mfma": 32, "tcgen05": 32}
#: fp8 operands (scaled_mm) by tensor-core instruction: at most this many accumulator values per
#: thread. Measured (static_report, sm_100, triton 3.9, Float8Linear's launches): the 128-value
#: tiles spill under tcgen05 (128x256x128/s3w8 72 B and 128x128x128 on 4 warps 56 B with the
#: bias alone, 336 B with tanh-GELU; 256x128x128/s3w8 fits at 208 registers but holds as many),
#: the 64-value tiles with per-tensor scales stay at 72-238 registers. (sm_90's wgmma fits all.)
FP8_MAX_ACC = {"tcgen05": 64}
#: The emitting epilogue with delayed scaling (scaled_mm(emit_fp8=...): C cast with the
#: history's multiplier into C's and C^T's layouts beside the bf16 C and the pre-activation),
#: by tensor-core instruction: at most this many columns a tile. Measured (sm_100, triton 3.9,
#: tanh-GELU, the bias and the pre-activation): every 128-column tile spills 32-360 B, with C^T
#: or without it (128x128x128/s3w8 296 B, 64x128x128 on 4 warps 360 B); 128x64x128 on 4 warps
#: stays at 145-160 registers, 64x64x128 at 96-122. (The tensorwise emit, max |C| only, fits.)
EMIT_DELAYED_MAX_N = {"tcgen05": 64}
#: The blockwise kernel with B's scales a vector along N (the blockwise wgrad: gemm_blockwise.py,
#: its ``column_scales`` table), by tensor-core instruction: at most this many accumulator values
#: a thread times stages in flight (the pipeliner holds each stage's scale vector in registers).
#: Measured (sm_100, triton 3.9, C += into bf16): 128x64x128 on 4 warps spills 80 B with 4
#: stages (256) and fits at 252 registers with 3 (192); 128x64x128 on 8 warps (4 stages, 128)
#: stays at 152. (sm_90's wgmma fits every one: 151-205 registers.)
COLUMN_SCALES_MAX_STAGED_ACC = {"tcgen05": 192}


def _cfg_tile(c: triton.Config) -> int:
    return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]


def _cfg_acc(c: triton.Config, warp: int = 32) -> int:
    return acc_per_thread(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, warp)


def _cfg_loads(c: triton.Config, warp: int = 32, prologue: bool = False) -> int:
    """Operand elements a thread loads per K step; with a ``prologue`` Z's tile beside A's."""
    block_m = c.kwargs["BLOCK_M"] * (2 if prologue else 1)
    return loads_per_thread(block_m, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, warp)


def _cfg_a_values(c: triton.Config, warp: int = 32) -> int:
    """Elements of A's (BLOCK_M, BLOCK_K) tile each thread holds."""
    return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_K"] // (warp * c.num_warps)


def prune_configs(
    configs: list[triton.Config],
    device: DeviceSpec | int | str,
    *,
    tma: bool = False,
    ragged: bool = False,
    activation: int = 0,
    prologue: int = 0,
    elem_bytes: int = 2,
    two_accumulators: bool = False,
    block_scales: bool = False,
    emit_delayed: bool = False,
    column_scales: bool = False,
    sum_a: bool = False,
    accumulate: bool = False,
    store_preact: bool = False,
    out_bytes: int = 2,
) -> list[triton.Config]:
    """The configs worth trying on ``device`` (a :class:`DeviceSpec`; an int is an
    NVIDIA compute capability, e.g. 90, see :func:`as_spec`): those whose shared memory
    fits its ``smem_per_block``; every per-thread count with its ``warp_size``; on
    ``ragged`` operands (see :func:`operands_ragged`) only the tiles whose accumulator
    and scalar operand loads do not spill there (:data:`RAGGED_MAX_TILE`,
    :data:`RAGGED_MAX_LOADS`); where the operands sit in registers
    (:func:`operands_in_registers`: mma.sync, MFMA) only the tiles whose accumulator
    leaves room for them; for the pointer kernel's epilogue applying ``activation`` (an
    ``ACTIVATIONS`` code) in
    :data:`ACT_MAX_ACC_ACTIVATIONS` only :data:`ACT_MAX_ACC` accumulator values per
    thread on Hopper (the TMA kernel's too where its output is ``ragged``: see
    :func:`tma_output_ragged`); with an operand ``prologue`` (the ``A_ACT`` code of
    gemm.matmul_backward) only the tiles whose accumulator leaves room for A's and Z's
    tiles (:data:`PROLOGUE_MAX_ACC`, :data:`PROLOGUE_ACT_MAX_A`,
    :data:`PROLOGUE_ACT_PRE_HOPPER_MAX_ACC`; on ragged operands Z's scalar loads count
    in :data:`RAGGED_MAX_LOADS`); ``elem_bytes``: the operands' element size (1 for
    fp8: :data:`FP8_MAX_ACC` by tensor-core instruction); ``two_accumulators`` (fp8 promoted
    every K tile): :data:`TWO_ACC_MAX_ACC`, and with ``block_scales``
    :data:`BLOCK_SCALES_MAX_ACC` by instruction; fp8 operands with an exp/erf ``activation``:
    :data:`FP8_ACT_MAX_TILE`; ``emit_delayed`` (the emitting epilogue's delayed cast):
    :data:`EMIT_DELAYED_MAX_N`; ``column_scales`` (the blockwise kernel, B's scales along N):
    :data:`COLUMN_SCALES_MAX_STAGED_ACC`; ``sum_a`` (A's rows summed): :data:`SUM_A_MAX_LOADS`;
    ``accumulate`` (``C +=``) on a TMA kernel: C's old tile counted in the shared memory
    (:func:`c_staging`); ``store_preact`` with ``out_bytes`` 4 (the pre-activation stored
    beside an fp32 C) on the 16-bit TMA kernel: :data:`TMA_FP32_PREACT_MIN_BLOCK_N`.
    The per-architecture limits (``*_BY_ARCH``, :data:`PROLOGUE_MAX_LOADS`, ...) come from
    the compile gate. Never empty: the smallest is kept."""
    spec = as_spec(device)
    w, in_registers = spec.warp_size, operands_in_registers(spec)
    staged = tma and accumulate and elem_bytes == 1  # the blockwise kernel's C +=
    fits = [c for c in configs if smem_estimate(c, elem_bytes) + staged * c_staging(c) <= spec.smem_per_block]
    ragged_loads = RAGGED_MAX_LOADS_BY_ARCH.get(spec.arch, RAGGED_MAX_LOADS)
    if ragged and not tma:
        fits = [c for c in fits if _cfg_tile(c) <= RAGGED_MAX_TILE and _cfg_loads(c, w) <= ragged_loads]
    if in_registers:
        fits = [c for c in fits if _cfg_acc(c, w) <= PRE_HOPPER_MAX_ACC]
    if two_accumulators:
        fits = [c for c in fits if _cfg_acc(c, w) <= TWO_ACC_MAX_ACC]
    if elem_bytes == 1 and spec.mma in FP8_MAX_ACC:
        fits = [c for c in fits if _cfg_acc(c, w) <= FP8_MAX_ACC[spec.mma]]
    if block_scales and spec.mma in BLOCK_SCALES_MAX_ACC:
        fits = [c for c in fits if _cfg_acc(c, w) <= BLOCK_SCALES_MAX_ACC[spec.mma]]
    if emit_delayed and spec.mma in EMIT_DELAYED_MAX_N:
        fits = [c for c in fits if c.kwargs["BLOCK_N"] <= EMIT_DELAYED_MAX_N[spec.mma]]
    if column_scales and spec.mma in COLUMN_SCALES_MAX_STAGED_ACC:
        fits = [c for c in fits if c.num_stages * _cfg_acc(c, w) <= COLUMN_SCALES_MAX_STAGED_ACC[spec.mma]]
    if activation in ACT_MAX_ACC_ACTIVATIONS and (ragged or not tma):
        fits = [c for c in fits if _cfg_acc(c, w) <= ACT_MAX_ACC]
    if activation in ACT_MAX_ACC_ACTIVATIONS and ragged and tma and spec.mma in TMA_RAGGED_ACT_MAX_ACC:
        fits = [c for c in fits if _cfg_acc(c, w) <= TMA_RAGGED_ACT_MAX_ACC[spec.mma]]
    elif tma and elem_bytes == 2:  # the 16-bit TMA kernel (tma_configs); the blockwise one's are its own
        fits = [c for c in fits if c.kwargs["BLOCK_N"] >= TMA_MIN_BLOCK_N]
        fp32_preact = activation in ACT_MAX_ACC_ACTIVATIONS and store_preact and out_bytes == 4
        if fp32_preact and spec.mma in TMA_FP32_PREACT_MIN_BLOCK_N:
            fits = [c for c in fits if c.kwargs["BLOCK_N"] >= TMA_FP32_PREACT_MIN_BLOCK_N[spec.mma]]
    if not tma and spec.mma in POINTER_MAX_BLOCK_M:
        fits = [c for c in fits if c.kwargs["BLOCK_M"] <= POINTER_MAX_BLOCK_M[spec.mma]]
    if sum_a and spec.arch in SUM_A_MAX_LOADS:
        fits = [c for c in fits if _cfg_loads(c, w) <= SUM_A_MAX_LOADS[spec.arch]]
    if elem_bytes == 1 and activation in TRANSCENDENTAL:
        fits = [c for c in fits if _cfg_tile(c) <= FP8_ACT_MAX_TILE]
    if prologue and not tma:
        fits = [c for c in fits if _cfg_acc(c, w) <= PROLOGUE_MAX_ACC]
        if prologue not in PROLOGUE_SELECT:
            fits = [c for c in fits if _cfg_a_values(c, w) <= PROLOGUE_ACT_MAX_A]
            if in_registers:
                fits = [c for c in fits if _cfg_acc(c, w) <= PROLOGUE_ACT_PRE_HOPPER_MAX_ACC]
        if ragged:
            fits = [c for c in fits if _cfg_loads(c, w, prologue=True) <= ragged_loads]
        if spec.arch in PROLOGUE_MAX_LOADS:
            fits = [c for c in fits if _cfg_loads(c, w, prologue=True) <= PROLOGUE_MAX_LOADS[spec.arch]]
        fits = [c for c in fits if c.num_warps <= PROLOGUE_MAX_WARPS.get(spec.arch, c.num_warps)]
        fits = [c for c in fits if c.num_stages <= PROLOGUE_MAX_STAGES.get(spec.arch, c.num_stages)]
    return fits or [min(configs, key=smem_estimate)]


def offered_configs(
    configs: list[triton.Config], device: DeviceSpec | int | str, **rules
) -> list[triton.Config]:
    """What the autotuner offers on ``device`` from a pointer-kernel table: on AMD its
    :func:`amd_configs`, then :func:`prune_configs` with ``rules`` (its keywords)."""
    spec = as_spec(device)
    if spec.is_amd and not rules.get("tma"):
        configs = amd_configs(configs, spec.arch)
    return prune_configs(configs, spec, **rules)


# --------------------------------------------------------------------------- operands and devices

#: Elements per 16 bytes of a half-precision operand: the pointer kernel's
#: vector loads (and cp.async) need every dimension and stride a multiple of it.
VECTOR_ELEMS = 16


def _ragged(dims) -> bool:
    return any(d % VECTOR_ELEMS for d in dims)


def operands_ragged(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the pointer kernel loses its vector loads on ``a`` @ ``b``: a
    dimension or a non-unit stride that is not a multiple of 16 elements."""
    return _ragged((*a.shape, b.shape[1], *(s for s in (*a.stride(), *b.stride()) if s != 1)))


def transposed(strides: tuple[int, int]) -> bool:
    """Whether a 2-D operand of these strides is not row-major (no unit stride
    along dim 1): the layout flag (``A_T``, ``B_T``) in the pointer kernel's
    autotune key, since a transposed operand is read along other strides and
    wants other tiles (the TMA kernel's flags say which dimension its
    descriptor runs along)."""
    return strides[1] != 1


def _ragged_args(nargs: dict) -> bool:
    """:func:`operands_ragged` from the pointer kernel's arguments."""
    names = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn")
    return _ragged(nargs[k] for k in names if nargs[k] != 1)


def tma_output_ragged(nargs: dict) -> bool:
    """Whether the TMA kernel stores C (and the pre-activation) without 16-byte vectors:
    N or C's row stride not a multiple of 16 elements (its ``ragged`` for
    :func:`prune_configs`; the operands themselves are read through descriptors)."""
    return _ragged((nargs["N"], nargs["stride_cm"]))


def _device_spec(nargs: dict) -> DeviceSpec:
    """The spec of the device the launch's first tensor argument is on."""
    t = next(v for v in nargs.values() if isinstance(v, torch.Tensor))
    return tkdev.device_spec(t.device)


def gemm_autotune(configs: list[triton.Config], key: list[str], tma: bool = False, restore: tuple = ()):
    """:func:`autotune`, and on a GPU the configs are pruned by :func:`prune_configs`
    for the device and the operands (an autotuner never benchmarks, nor
    compiles, a config that cannot launch or would spill). ``restore``: the
    arguments a launch writes in place (``C +=``), put back after each config
    the autotuner benchmarks."""
    if INTERPRET or not AUTOTUNE:
        return autotune(configs, key)

    def prune(configs, nargs, **kwargs):
        ragged = tma_output_ragged(nargs) if tma else _ragged_args(nargs)
        meta = {**nargs, **kwargs}
        # an epilogue's act' (GRAD_ACT) holds Z's tile and act's temporaries as an activation does,
        # and so does a gated unit's act(gate) (GLU_FWD)
        activation = meta.get("ACTIVATION", 0) or meta.get("GRAD_ACT", 0) or meta.get("GLU_FWD", 0)
        prologue = meta.get("A_ACT", 0)
        a = nargs.get("a_ptr", nargs.get("a_desc"))
        a = getattr(a, "base", a)  # a tensor descriptor's tensor
        elem_bytes = a.element_size() if isinstance(a, torch.Tensor) else 2
        c = nargs.get("c_ptr")
        out_bytes = c.element_size() if isinstance(c, torch.Tensor) else 2
        blocks = meta.get("SCALE_A") == 3 or meta.get("SCALE_B") == 3  # gemm.SCALE_BLOCK
        return offered_configs(
            configs, _device_spec(nargs), tma=tma, ragged=ragged, activation=activation, prologue=prologue,
            elem_bytes=elem_bytes, two_accumulators=bool(meta.get("PRECISE_ACC")) or blocks,
            block_scales=blocks, emit_delayed=bool(meta.get("DELAYED")),
            column_scales=meta.get("SCALE_BN") == 1,  # the blockwise kernel's B scales along N
            sum_a=bool(meta.get("SUM_A")), accumulate=bool(meta.get("ACCUMULATE")),
            store_preact=bool(meta.get("STORE_PREACT")), out_bytes=out_bytes,
        )  # fmt: skip

    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": prune},
        restore_value=list(restore) or None,
    )
