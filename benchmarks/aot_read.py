"""Reading a compiled kernel's artifacts: the cubin's resource usage (``cuobjdump``), its
SASS (``nvdisasm``), the PTX's instructions and the width of every global access per
kernel argument, the TTGIR's layout conversions: :func:`analyse` gives one case's facts.
"""

from __future__ import annotations

import collections
import math
import re
import subprocess
import tempfile
from pathlib import Path

from aot_targets import Case, _kernel_fn, occupancy

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


def _ir_facts(kernel) -> dict:
    """The facts read from the TTGIR and TTIR, alike for every target."""
    ttgir, ttir = kernel.asm["ttgir"], kernel.asm.get("ttir", "")
    return dict(
        convert_layout=ttgir.count("ttg.convert_layout"),
        # tt.dot's maxNumImpreciseAcc per dot (scaled_mm's PRECISE_ACC: the K tile; 0: the default)
        imprecise_acc=[int(v) for v in re.findall(r"maxNumImpreciseAcc = (\d+)", ttir)],
        # elements of each converted tensor: a streaming kernel may move per-block values (the 8-bit
        # state's absmax, BLOCK / 256 per program) between layouts, never its element arrays
        convert_layout_elements=[
            math.prod(int(d) for d in shape.split("x"))
            for shape in re.findall(r"ttg\.convert_layout [^:]*: tensor<((?:\d+x)*\d+)x\w+", ttgir)
        ],
    )


def analyse_amdgcn(kernel, case: Case, cc) -> dict:
    """The facts of ``case`` compiled for an AMD target, from its AMDGCN and the hsaco's
    metadata in it: VGPRs (``.vgpr_count``), spills (the scratch a wave uses:
    ``.private_segment_fixed_size`` and the ``ScratchSize`` comment, and ``.vgpr_spill_count``,
    4 bytes each; ``.sgpr_spill_count`` apart, as ``sgpr_spills``: LLVM spills SGPRs into
    VGPR lanes, ``v_writelane``, no memory and no lost VGPR budget unless scratch shows it),
    LDS (Triton's ``shared`` plus the static
    ``.group_segment_fixed_size``), MFMA instructions (fp8 ones: ``v_mfma_*f8*`` /
    ``v_mfma_scale_*``); NVIDIA-only facts (wgmma, cp.async, TMA, PTX access widths) are 0 / empty."""
    asm = kernel.asm["amdgcn"]

    def meta(key: str) -> int:
        return max((int(v) for v in re.findall(rf"^\s*\.?{key}:?\s+(\d+)", asm, re.M)), default=0)

    scratch = max(meta("private_segment_fixed_size"), *map(int, re.findall(r"ScratchSize: (\d+)", asm)), 0)
    spills = meta("vgpr_spill_count")
    smem = kernel.metadata.shared + meta("group_segment_fixed_size")
    regs = max((int(v) for v in re.findall(r"; TotalNumVgprs: (\d+)", asm)), default=meta("vgpr_count"))
    occ, limiter = occupancy(regs, smem, case.num_warps, cc)
    mfma = re.findall(r"\bv_mfma_\w+", asm)
    mx_mma = len(re.findall(_MX_MMA_AMD, asm))
    return dict(
        regs=regs, spill_bytes=scratch + 4 * spills, stack=scratch, sgpr_spills=meta("sgpr_spill_count"),
        spill_instructions=None, smem=smem,
        occupancy_pct=occ, limiter=limiter, wgmma=0, wgmma_waits=[], mma_sync=0, tcgen05=0, mfma=len(mfma),
        fp8_mma=sum(1 for m in mfma if re.search(r"f8|fp8|bf8|scale", m)), mx_mma=mx_mma, cp_async_16=0,
        cp_async=0,
        tma_loads=0, tma_stores=0, sass_instructions=None, global_access_bits={}, **_ir_facts(kernel),
    )  # fmt: skip


#: An MMA on fp8 operands in PTX: e4m3/e5m2 ``mma.sync`` and ``wgmma``, tcgen05's kind::f8f6f4
_FP8_MMA = r"(?:wgmma\.mma_async|\bmma\.sync)[^;\n]*\.e[45]m[23]|tcgen05\.mma\S*f8f6f4"
#: A native block-scaled (MX) MMA: sm_100's ``tcgen05.mma ... kind::mxf8f6f4.block_scale`` (as
#: Triton 3.9 writes it), gfx950's ``v_mfma_scale_*``; an emulated ``tl.dot_scaled`` has neither
_MX_MMA_PTX = r"tcgen05\.mma[\w.:]*kind::mxf8f6f4\.block_scale"
_MX_MMA_AMD = r"\bv_mfma_scale_\w+"


def analyse(kernel, case: Case, cc, sass: bool = True) -> dict:
    """The facts of a compiled ``case`` (an AMD target's: :func:`analyse_amdgcn`);
    ``sass=False`` skips disassembling the cubin (~0.8 s a GEMM): the SASS counts (``spill_instructions``,
    ``sass_instructions``) are then None, every other fact is unchanged."""
    if "amdgcn" in kernel.asm:
        return analyse_amdgcn(kernel, case, cc)
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
    ptx = asm["ptx"]
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
        tcgen05=len(re.findall(r"\btcgen05\.mma", ptx)),
        mfma=0,
        # fp8 operands: e4m3/e5m2 mma.sync and wgmma; tcgen05's kind::f8f6f4 (sm_100)
        fp8_mma=len(re.findall(_FP8_MMA, ptx)),
        mx_mma=len(re.findall(_MX_MMA_PTX, ptx)),
        cp_async_16=len(
            re.findall(
                r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)?\s+\[[^\]]+\],\s*\[[^\]]+\],\s*0x10", ptx
            )
        ),
        cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::\w+", ptx)),
        sass_instructions=sum(ops.values()) if sass else None,
        global_access_bits=ptx_accesses(ptx, nonconst),
        **_ir_facts(kernel),
    )
