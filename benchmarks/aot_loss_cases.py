"""The compile gate's cases of the loss's kernels (tkern.cross_entropy and
tkern.linear_cross_entropy): the cross-entropy kernel's launches and the targets' check
before them; :func:`aot_cases.all_cases` takes them in.
"""

from __future__ import annotations

from aot_targets import _TL_NAME, Case, _ptr, _tl, light_dtype


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
    flags = ("HAS_WEIGHT", "SMOOTHING", "SOFTCAP", "COMPUTE_LSE", "LSE_FROM_STATS", "WRITE_LOSS")
    flags += ("WRITE_GRAD", "HAS_B", "HAS_Q")
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
    # without smoothing and softcap: the lse from the logits GEMM's row statistics (one pass)
    stats = fused - {"SMOOTHING"} | {"LSE_FROM_STATS"}
    launches.append(("linear_cross_entropy[fp32->bf16,row stats,weight,z]", "fp32", "bf16", stats))
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
        slots = ce.block_v(-(-50257 // 32))  # GPT-2's row statistics: 1571 slots
        const.update(stride_lc=1, stride_gc=1, ROWS=ce.rows_per_program(block), BLOCK_V=block)
        const["BLOCK_S"] = min(slots, block)
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
                light=light_dtype(grad) or not on & {"HAS_WEIGHT", "SMOOTHING"},  # elsewhere: every option on
            )
        )
    return cases + target_stats_cases()


def target_stats_cases() -> list[Case]:
    """``_target_stats_kernel`` as :func:`tkern.kernels.cross_entropy.target_stats` launches
    it (one program over the targets): int64 and int32 targets, with and without class
    weights, a mean's coefficients (the heaviest: two reciprocals) and a sum's."""
    from tkern.kernels import cross_entropy as ce

    cases = []
    for tdtype in ("i64", "i32"):
        for weight in (False, True):
            for mean in (True, False):
                sig = {"target_ptr": f"*{tdtype}", "weight_ptr": "*fp32", "stats_ptr": "*fp32"}
                sig.update(n_rows="i32", n_cols="i32", ignore_index="i32", z_loss="fp32")
                sig.update(HAS_WEIGHT="constexpr", MEAN="constexpr", BLOCK="constexpr")
                reduction = "mean" if mean else "sum"
                flags = ",".join(filter(None, (tdtype, "weight" if weight else "", reduction)))
                cases.append(
                    Case(
                        name=f"cross_entropy_target_stats[{flags}]",
                        family="rowwise",
                        kernel="tkern.kernels.cross_entropy:_target_stats_kernel",
                        signature=sig,
                        constexprs={"HAS_WEIGHT": weight, "MEAN": mean, "BLOCK": ce.STATS_BLOCK},
                        aligned=("target_ptr", "weight_ptr", "stats_ptr"),
                        num_warps=ce.STATS_WARPS,
                        light=not (weight and mean and tdtype == "i64"),  # elsewhere: the heaviest
                    )
                )
    return cases
