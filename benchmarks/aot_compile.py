"""Compiling one case ahead of time for a target (``triton.compile`` with a
``GPUTarget``, no GPU needed) and reading its facts (:func:`compile_case`); the
compile gate's questions about one compiled case's PTX and TTGIR (the ordered memory
operations, the reductions' layouts).
"""

from __future__ import annotations

import functools
import re
import time

from aot_cases import all_cases
from aot_read import analyse
from aot_targets import _SIZE, Case, _fit, _kernel_fn, spec_of


def _triton_compile(case: Case, cc):
    """``case`` compiled by ``triton.compile`` for target ``cc`` (any :func:`spec_of`
    target: ``GPUTarget(*spec.target)``, CUDA or HIP)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_fn(case.kernel)
    case = _fit(case, fn)
    index = {a: i for i, a in enumerate(fn.arg_names)}
    attrs = {(index[a],): [["tt.divisibility", 16]] for a in case.aligned}
    return triton.compile(
        ASTSource(fn, case.signature, case.constexprs, attrs),
        target=GPUTarget(*spec_of(cc).target),
        options=dict(num_warps=case.num_warps, num_stages=case.num_stages, **case.options),
    )


def compile_case(case: Case, cc, sass: bool = True) -> dict:
    """Compile ``case`` for target ``cc`` (:func:`_triton_compile`) and read its facts
    (:func:`analyse`); the row's ``target`` is the spec's arch (``sm_90``, ``gfx942``)."""
    case = _fit(case, _kernel_fn(case.kernel))
    t0 = time.perf_counter()
    row = dict(case=case.name, kernel=case.kernel.split(":")[1], family=case.family, target=spec_of(cc).arch,
               gated=case.gated, num_warps=case.num_warps, num_stages=case.num_stages)  # fmt: skip
    try:
        kernel = _triton_compile(case, cc)
        row.update(analyse(kernel, case, cc, sass), compiled=True)
        row["reduce_layouts"] = reduce_layouts_of(kernel.asm["ttgir"])
    except Exception as exc:  # recorded; the gate fails on it
        row.update(compiled=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    if case.family == "streaming":
        size = {a: _SIZE[case.signature[a].lstrip("*")] for a in case.arrays}
        row["expected_bits"] = {a: min(case.per_thread * s, 16) * 8 for a, s in size.items()}
        row["per_thread"] = case.per_thread
    return row


@functools.cache
def _gate_cases(target: str) -> dict[str, Case]:
    return {c.name: c for c in all_cases(target, full=False)}


def _compiled(name: str, cc):
    """The compile gate's case ``name`` compiled for target ``cc`` (Triton's compiled kernel:
    from Triton's cache when the gate's rows compiled it)."""
    return _triton_compile(_gate_cases(spec_of(cc).arch)[name], cc)


def ordered_accesses(name: str, cc: int = 90) -> list[str]:
    """The PTX memory operations with an ordering (``atom``/``red``/``ld`` with acquire,
    release, acq_rel or relaxed semantics, and volatile loads) of the compile gate's case
    ``name`` compiled for sm_cc, in program order, each as its opcode with its guard
    (``@%p3 atom.global.gpu.acq_rel.add.u32``): what a grid barrier's correctness rests on,
    which a compiler may fold away (triton 3.6 dropped an acquire whose value went unused)."""
    ptx = _compiled(name, cc).asm["ptx"]
    op = r"(?:@!?%\w+\s+)?(?:atom|red|ld)\.[\w.:]*(?:acquire|release|acq_rel|relaxed|volatile)[\w.:]*"
    return re.findall(op, ptx)


def ordered_accesses_amdgcn(name: str, target: str = "gfx942") -> list[str]:
    """The AMDGCN a grid barrier's order rests on, of the compile gate's case ``name``
    compiled for ``target``, in program order: the global atomics (``global_atomic_*``,
    ``buffer_atomic_*``, ``flat_atomic_*``; ``sc0``/``sc1``/``nt`` scope bits kept), the cache
    maintenance LLVM emits for release and acquire at agent scope (``buffer_wbl2``: write
    back L2 before a release; ``buffer_inv``: invalidate before an acquire's later loads), the
    loads with a coherence bit (``sc1``: agent scope, an atomic load's, which is what LLVM
    makes of an acquire ``atomic_add`` of 0; ``sc0 sc1``: a volatile load, past the caches)
    and the waits on the atomic's return (``s_waitcnt vmcnt(0)``)."""
    asm = _compiled(name, target).asm["amdgcn"]
    op = r"^\s*((?:global|buffer|flat)_atomic_\w+[^\n;]*|buffer_wbl2[^\n;]*|buffer_inv[^\n;]*"
    op += r"|(?:global|buffer|flat)_load_\w+[^\n;]*\bsc1\b[^\n;]*|s_waitcnt vmcnt\(0\))"
    return [" ".join(m.split()) for m in re.findall(op, asm, re.M)]


def reduce_layouts(name: str, cc: int = 90) -> list[tuple[str, str]]:
    """``(shape, layout)`` of each fp32 reduction (``tt.reduce``), in program order, of the
    compile gate's case ``name`` compiled for sm_cc: a reduction's order of additions
    follows from its layout, so two kernels that must sum alike (pass 1 and the one-pass
    step) must reduce in the same layouts."""
    return reduce_layouts_of(_compiled(name, cc).asm["ttgir"])


def reduce_layouts_of(ir: str) -> list[tuple[str, str]]:
    """:func:`reduce_layouts` of a compiled kernel's TTGIR ``ir`` (every row's
    ``reduce_layouts``, read where the gate compiled it: no second compile)."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, re.M))
    found = re.finditer(r"\}\) : \(tensor<([^,>]*), (#\w+)>\) -> f32", ir)
    return [(m.group(1), aliases.get(m.group(2), m.group(2))) for m in found]


def _compile_star(args):
    return compile_case(*args)
