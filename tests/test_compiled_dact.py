"""The dgrad epilogue's act' (issue 54 item 5: ``GRAD_ACT``) compiled ahead of time, without a
GPU, for sm_90 (the pointer kernel and the TMA kernel) and sm_80 (the pointer kernel): every
config tkern's autotuner offers such a launch (gemm_configs.prune_configs, the ``GRAD_ACT``
code counted as an epilogue activation) compiles without spilling registers.

The launch is the dgrad of an MLP's second layer (``dY (M, 768) @ W (768, 3072)``, aligned)
writing dZ over the stored pre-activation, with W row-major (``nn.Linear``'s weight) and, for
GPT-2's tanh-GELU, column-major too (Conv1D's (in, out) weight read transposed in place).
Compiled mode only (``TRITON_INTERPRET=0``), as tests/test_compiled.py::

    TRITON_INTERPRET=0 python -m pytest -m compiled tests/test_compiled_dact.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import test_compiled

# compiled mode, no GPU: the compile gate's own marks
pytestmark = test_compiled.pytestmark

#: (target, kernel) pairs: the TMA kernel exists on Hopper only.
TARGETS = [(90, "pointer"), (90, "tma"), (80, "pointer")]
#: (gradient, B column-major): tanh-GELU (GPT-2's, through Conv1D's weight too) and erf GELU
#: (the most registers).
GRADS = [("gelu_tanh", False), ("gelu_tanh", True), ("gelu", False)]


def _jit(kernel):
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):  # unwrap the autotuner and the heuristics
        kernel = kernel.fn
    return kernel


def _case(kind: str, cfg, grad: int, b_t: bool, dtype: str = "bf16"):
    """(jit function, signature, constexprs, aligned arguments) of the dgrad launch under ``cfg``."""
    import triton.language as tl

    from tkern.kernels import gemm, gemm_tma

    kw = cfg.kwargs
    ptr = f"*{dtype}"
    half = tl.bfloat16 if dtype == "bf16" else tl.float16
    const = dict(
        HAS_BIAS=False, ACTIVATION=0, STORE_PREACT=False, OUT_DTYPE=half, PREACT_DTYPE=half, UPCAST=False,
        A_T=False, B_T=b_t, ACCUMULATE=False, GRAD_ACT=grad, stride_cn=1, stride_bias=1, **kw,
    )  # fmt: skip
    sig = dict(c_ptr=ptr, bias_ptr=ptr, preact_ptr=ptr, M="i32", N="i32", K="i32", stride_cm="i32")
    if kind == "tma":
        fn = _jit(gemm_tma._matmul_tma_kernel)
        bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
        b_block = f"[{bn}, {bk}]" if b_t else f"[{bk}, {bn}]"  # B^T's descriptor when B_T
        sig.update(a_desc=f"tensordesc<{dtype}[{bm}, {bk}]>", b_desc=f"tensordesc<{dtype}{b_block}>")
        sig["c_desc"] = ptr  # launch_tma: the pointer epilogue (it reads Z beside C)
        const.update(NUM_SMS=132, C_TMA=False)
        aligned = ["c_ptr", "preact_ptr", "M", "N", "K", "stride_cm"]
    else:
        fn = _jit(gemm._matmul_kernel)
        b_stride = "stride_bn" if b_t else "stride_bk"  # the other one is the constant 1
        sig.update(a_ptr=ptr, b_ptr=ptr, stride_am="i32", scale_a_ptr="*fp32",
                   scale_b_ptr="*fp32", z_ptr=ptr, a_out_ptr=ptr, a_sum_ptr="*fp32")  # fmt: skip
        for name in ("stride_sam", "stride_sak", "stride_sbk", "stride_sbn", "block_am", "block_ak",
                     "block_bk", "block_bn"):  # fmt: skip
            sig[name] = "i32"
        sig[b_stride] = "i32"
        const["stride_bk" if b_t else "stride_bn"] = 1
        const.update(stride_ak=1, EVEN_K=True, SCALE_A=0, SCALE_B=0, A_ACT=0, STORE_A=False,
                     SUM_A=False, PRECISE_ACC=False)  # fmt: skip
        aligned = ["a_ptr", "b_ptr", "c_ptr", "preact_ptr", "M", "N", "K", "stride_am", b_stride, "stride_cm"]
    for k in const:
        sig[k] = "constexpr"
    sig = {a: sig.get(a, "constexpr") for a in fn.arg_names}
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    return fn, sig, const, aligned


def _compile(cc: int, kind: str, cfg, grad: int, b_t: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, const, aligned = _case(kind, cfg, grad, b_t)
    index = {a: i for i, a in enumerate(fn.arg_names)}
    attrs = {(index[a],): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(
        ASTSource(fn, sig, const, attrs),
        target=GPUTarget("cuda", cc, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )


def regs_and_spills(kernel) -> tuple[int, int]:
    """Registers per thread and spilled bytes (stack + local memory) of a compiled kernel, as
    ``cuobjdump -res-usage`` (shipped in the triton wheel) reads its cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs, stack, local = (
        int(x) for x in re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", res).groups()
    )
    return regs, stack + local


def offered(cc: int, kind: str, grad: int) -> list:
    """The configs the autotuner offers the dgrad launch with ``GRAD_ACT`` = ``grad`` on sm_cc."""
    from tkern.kernels import gemm_configs

    configs = gemm_configs.tma_configs() if kind == "tma" else gemm_configs.gemm_configs()
    return gemm_configs.prune_configs(configs, cc, tma=kind == "tma", activation=grad)


def _label(cfg) -> str:
    kw = cfg.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{cfg.num_stages} w{cfg.num_warps}"


@pytest.mark.parametrize(("grad", "b_t"), GRADS)
@pytest.mark.parametrize(("cc", "kind"), TARGETS)
def test_dgrad_epilogue_variants_compile_without_spills(cc, kind, grad, b_t):
    from tkern.kernels.activation import ACTIVATIONS

    code = ACTIVATIONS[grad]
    spilled = {}
    for cfg in offered(cc, kind, code):
        kernel = _compile(cc, kind, cfg, code, b_t)
        assert ("wgmma" in kernel.asm["ptx"]) == (cc == 90)  # Hopper's tensor cores; mma.sync before
        regs, spills = regs_and_spills(kernel)
        if spills:
            spilled[_label(cfg)] = (regs, spills)
    assert spilled == {}
