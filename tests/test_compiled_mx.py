"""The MX kernels compiled ahead of time (no GPU): the GEMM becomes Blackwell's block-scaled
``tcgen05.mma`` and MI355X's ``v_mfma_scale``, the casts compile for every fp8 target; none spills.

Compiled mode only (``TRITON_INTERPRET=0``), skipped on a GPU machine, as tests/test_compiled.py::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled_mx.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import triton.language as tl

import tkern

pytestmark = [
    pytest.mark.compiled,
    pytest.mark.skipif(
        tkern.INTERPRET,
        reason="the compile gate needs compiled mode: TRITON_INTERPRET=0 (benchmarks/ci_compile_gate.sh)",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="the compile gate is CI's, run without a GPU (benchmarks/ci_compile_gate.sh)",
    ),
]

CUDA, HIP = "cuda", "hip"


def _target(target: tuple):
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*target)


def compile_kernel(fn, signature: dict, constexprs: dict, target: tuple, num_warps: int, num_stages: int = 3):
    """``triton.compile`` of jit function ``fn`` for ``target``: (asm dict, metadata)."""
    import triton
    from triton.compiler import ASTSource

    sig = {a: signature.get(a, "constexpr") for a in fn.arg_names}
    const = {(fn.arg_names.index(a),): v for a, v in constexprs.items()}
    src = ASTSource(fn, sig, const)
    kernel = triton.compile(
        src, target=_target(target), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    return kernel.asm, kernel.metadata


def spills(asm: dict, metadata) -> int:
    """Spilled bytes: the cubin's stack frame and local memory (cuobjdump, shipped in the triton
    wheel) on NVIDIA, the scratch (private segment) size on AMD."""
    if "amdgcn" in asm:
        found = re.search(r"\.private_segment_fixed_size:\s*(\d+)", asm["amdgcn"])
        return int(found.group(1)) if found else 0
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(asm["cubin"])
        res = subprocess.run(
            [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True
        ).stdout
    found = re.search(r"STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", res)
    assert found, res
    return int(found.group(1)) + int(found.group(2))


def _gemm(config):
    """The MX GEMM's signature and constexprs for one of its configs."""
    from tkern.kernels import gemm_mx

    fn = gemm_mx._scaled_mm_mx_kernel.fn
    ptrs = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "bias_ptr": "*bf16",
            "preact_ptr": "*bf16", "scale_a_ptr": "*u8", "scale_b_ptr": "*u8"}  # fmt: skip
    ints = [a for a in fn.arg_names if a in ("M", "N", "K") or a.startswith("stride_")]
    sig = {**ptrs, **dict.fromkeys(ints, "i32")}
    const = dict(A_FMT="e4m3", B_FMT="e4m3", HAS_BIAS=True, ACTIVATION=0, STORE_PREACT=False,
                 OUT_DTYPE=tl.bfloat16, PREACT_DTYPE=tl.bfloat16, **config.kwargs)  # fmt: skip
    return fn, sig, const


#: The native block-scaled MMA of each MX target (sm_100's, as Triton 3.9 writes it:
#: ``tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32``).
NATIVE_MX = {
    (CUDA, 100, 32): r"tcgen05\.mma[\w.:]*kind::mxf8f6f4\.block_scale",
    (HIP, "gfx950", 64): r"v_mfma_scale",
}


@pytest.mark.parametrize(("target", "instruction"), list(NATIVE_MX.items()))
def test_mx_gemm_is_native_block_scaled(target, instruction):
    from tkern.kernels.gemm_mx import mx_configs

    for config in mx_configs():  # every config offered
        fn, sig, const = _gemm(config)
        asm, meta = compile_kernel(fn, sig, const, target, config.num_warps, config.num_stages)
        code = asm.get("ptx") or asm["amdgcn"]
        assert re.search(instruction, code), f"no {instruction} in the {target} code"
        assert spills(asm, meta) == 0, config


@pytest.mark.parametrize(
    "target", [(CUDA, 89, 32), (CUDA, 90, 32), (CUDA, 100, 32), (CUDA, 120, 32), (HIP, "gfx950", 64)]
)
def test_mx_casts_compile_without_spills(target):
    from tkern.kernels import mx

    fn = mx._to_mx_kernel
    ints = [a for a in fn.arg_names if a in ("R", "C") or a.startswith("s")]
    ptrs = {
        "x_ptr": "*bf16",
        "data_ptr": "*u8",
        "scale_ptr": "*u8",
        "data_r_ptr": "*u8",
        "scale_r_ptr": "*u8",
    }
    sig = {**ptrs, **{a: "i32" for a in ints if a not in ptrs}}
    # the one-pass pair (ALONG_R): the single cast's code and the second cast's, the tile
    # the launcher uses compiled; RCEIL, whose scale has the longer arithmetic
    const = dict(MODE=1, FP8_MAX=448.0, MAX_POW2=8, DTYPE=tl.float8e4nv, BLOCK=32, TR=mx.TILE_R,
                 TC=mx.TILE_C, ALONG_R=True)  # fmt: skip
    asm, meta = compile_kernel(fn, sig, const, target, num_warps=4)
    assert spills(asm, meta) == 0, target
