"""The compile gate's cases for the rotary family (tkern/kernels/rotary.py): q and k rotated
(``_rotary_kernel``) and the cos / sin tables (``_rotary_tables_kernel``), each as its
launcher specialises it."""

from __future__ import annotations

from aot_targets import _TL_NAME, Case, _ptr, _tl, light_dtype


def _rotary_aligned(arg: str) -> bool:
    """The rotary kernel's arguments divisible by 16 on its launcher's contiguous tensors:
    the pointers, head_dim and the outer strides (multiples of head_dim or R)."""
    return arg.endswith("_ptr") or arg == "head_dim" or arg[0] == "s" and arg != "seq"


def rotary_cases() -> list[Case]:
    """tkern.rotary_embedding's launch (tkern/kernels/rotary.py) as its launcher makes it for
    contiguous q, k and tables (the head-dim strides 1, which Triton specialises as
    constants): head_dim 128 with full rotary (Llama) and a quarter of it (GPT-NeoX's
    partial rotary, 96 columns passed through), forward and backward (``INVERSE``), fp16 and
    bf16. A "rowwise" family: its rows are strided, its accesses per half row."""
    from tkern.kernels import rotary as ro

    tl = _tl()
    fn = ro._rotary_kernel
    unit = ("sq_d", "sk_d", "sqo_d", "sko_d", "sc_d", "ss_d")
    cases = []
    for dtype in ("fp16", "bf16"):
        for rot in (128, 32):
            for inverse in (False, True):
                bh, bp = ro.next_power_of_2(rot // 2), ro.next_power_of_2(128 - rot)
                const = dict(HALF=rot // 2, INVERSE=inverse, DTYPE=getattr(tl, _TL_NAME[dtype]))
                const.update(ROWS=ro.ELEMENTS // max(bh, bp), BLOCK_HALF=bh, BLOCK_PASS=bp)
                const.update(dict.fromkeys(unit, 1))
                sig = {a: (_ptr(dtype) if a.endswith("_ptr") else "constexpr" if a in const else "i32")
                       for a in fn.arg_names}  # fmt: skip
                cases.append(
                    Case(
                        name=f"rotary[{dtype},{'bwd' if inverse else 'fwd'},R={rot}/128]",
                        family="rowwise",
                        kernel="tkern.kernels.rotary:_rotary_kernel",
                        signature=sig,
                        constexprs=const,
                        aligned=tuple(a for a in sig if sig[a] != "constexpr" and _rotary_aligned(a)),
                        num_warps=ro.NUM_WARPS,
                        light=light_dtype(dtype) or rot == 128,  # elsewhere: the partial rotary
                    )
                )
    return cases


def rotary_table_cases() -> list[Case]:
    """tkern's cos / sin tables (``rotary_tables``) as its launcher makes them for HF's
    position ids (int64, the seq stride 1, a constant to Triton) and a contiguous inv_freq:
    head_dim 128 (64 frequencies) and GPT-NeoX's quarter rotary of 128 (16), fp16 / bf16 /
    fp32 tables. A "rowwise" family: a program writes ROWS rows of both tables."""
    from tkern.kernels import rotary as ro

    tl = _tl()
    fn = ro._rotary_tables_kernel
    cases = []
    for dtype in ("fp16", "bf16", "fp32"):
        for half in (64, 16):
            block = ro.next_power_of_2(half)
            const = dict(HALF=half, DTYPE=getattr(tl, _TL_NAME[dtype]), BLOCK_HALF=block)
            const.update(ROWS=ro.TABLE_ELEMENTS // block, s_f=1, sp_s=1)
            ptrs = {
                "inv_freq_ptr": _ptr("fp32"),
                "pos_ptr": _ptr("i64"),
                "cos_ptr": _ptr(dtype),
                "sin_ptr": _ptr(dtype),
            }
            sig = {a: ptrs.get(a, "constexpr" if a in const else "fp32" if a == "scaling" else "i32")
                   for a in fn.arg_names}  # fmt: skip
            cases.append(
                Case(
                    name=f"rotary_tables[{dtype},half={half}]",
                    family="rowwise",
                    kernel="tkern.kernels.rotary:_rotary_tables_kernel",
                    signature=sig,
                    constexprs=const,
                    aligned=tuple(ptrs),
                    num_warps=ro.NUM_WARPS,
                    light=light_dtype(dtype) or half != 64,  # elsewhere: bf16, 64 frequencies
                )
            )
    return cases
