"""tkern's GEMM against torch.matmul (cuBLAS), fp16 and bf16.

Cases: square sizes 512..8192; transformer shapes with M = 8192 tokens and
(N, K) in {(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)}; the
linear forward and forward+backward; the fused linear + bias + GELU against
torch's unfused ``F.gelu(F.linear(...))`` under autocast, against torch's own
fused ``torch._addmm_activation(bias, x, W^T, use_gelu=True)`` (cuBLASLt's GELU
epilogue; forward only: it has no autograd formula) and, in section
``gelu_compiled`` (not in smoke mode: a compile per shape), against the unfused
recipe under ``torch.compile`` on the first transformer shape. Each case is
checked against torch before it is timed. Targets on H100/H200: geometric-mean
ratio to cuBLAS >= 0.95 over square sizes >= 2048 and over the transformer
shapes; fused bias+GELU >= 1.1x the unfused path.

fp8 (section ``fp8``, issue 30): ``tkern.scaled_mm`` on the transformer shapes,
x (tokens, K) times W^T (W (N, K) read in place), for e4m3 x e4m3 and e5m2 x
e4m3 operands cast by ``tkern.to_float8``, with tensorwise, rowwise and
DeepSeek-V3 block scales (1x128 for x, 128x128 for W), against
``torch._scaled_mm`` (tensorwise, rowwise) or ``torch.nn.functional.scaled_mm``
(``BlockWise1x128`` x ``BlockWise128x128``, where the installed torch takes it:
a refusal is recorded as the row's ``skipped`` reason) and against a bf16 cuBLAS
GEMM of the same shape. Each result is checked against the dequantized operands'
fp32 product first (``FP8_TOL``). Target: >= 0.95x torch's fp8 GEMM with the same
accumulation (every fp8 row says which in ``accum``, :data:`ACCUM`):

* ``fast``: fp8 products summed in the tensor core's own accumulator along all of
  K. tkern's tensorwise and rowwise paths (``tl.dot`` on sm_90 accumulates fp8 this
  way by default; tkern has no precise variant of them), and torch's
  ``torch._scaled_mm(..., use_fast_accum=True)`` (impl ``torch fast accum``);
* ``precise``: partial sums promoted to fp32 at least every 128 of K. tkern's
  blockwise kernel (gemm_blockwise.py: one ``tl.dot`` per 128-wide scale block,
  promoted with its scales in one fused multiply-add) and torch's
  default (impl ``torch``, ``use_fast_accum=False``), the only one its blockwise
  GEMM offers.

The precise torch rows of tensorwise and rowwise are recorded beside, without a
tkern peer.

Training layouts (sections ``layouts`` and ``fp8_layouts``, issues 42.5 and 43.7):
the three GEMMs of every linear layer with the operands' strides as
``tkern.linear`` launches them in training -- forward ``x @ W^T`` (W read in
place), dgrad ``dY @ W``, wgrad ``dY^T @ X`` (dY read transposed in place) -- at
GPT-2 small's shapes (16384 tokens; qkv, attention projection, MLP up and down, LM
head over 50257 classes, whose dlogits are copied once with aligned rows where
``gemm.tma_aligned_rows`` does so: that copy is its own row) and Llama-2-7B's (8192
tokens), against ``torch.mm`` in the same layouts. ``tkern`` runs the GEMM as
planned (``gemm_plan.plan_gemm``: each row records its ``plan``, ``split_k``,
``tiles`` and ``waves``); with ``--alternatives`` the other kernels run the same
case as ``tkern pointer`` / ``tkern tma`` (to confirm or move the rule's
constants). fp8 (issue 43): ``tkern.scaled_mm`` on the GEMMs Float8Linear launches,
forward ``x @ W^T``, dgrad ``dY @ W``, wgrad ``dY^T @ X``, each operand cast K-major as
its casts write them (x and x^T, W and W^T, dY and dY^T; e4m3 forward, e5m2 gradients,
e4m3 throughout for blockwise) and with its ``use_fast_accum`` (forward fast, the
gradient GEMMs promoted: ``FORWARD_FAST_ACCUM`` / ``GRADIENT_FAST_ACCUM`` of
tkern/ops/float8.py), tensorwise, rowwise (scales along each operand's non-K
dimension) and blockwise (each row's ``kernel`` naming the one scaled_mm ran:
``blockwise`` for gemm_blockwise.py), against ``torch._scaled_mm`` (or torch's
blockwise ``scaled_mm``) on the same operands with the same accumulation, and a
bf16 cuBLAS GEMM (``torch.mm``) of the same layout. Every fp8 row records its TFLOP/s,
MFU (at the device's dense fp8 peak; bf16 rows at the bf16 peak) and ``rel_err``
against the float64 product of the same fp8 operands; tkern's its ratio against the
best peer of the same run (``vs_best_peer``, ``best_peer``) and against bf16
(``vs_bf16``). Targets (GPU): >= 0.95x cuBLAS in every layout; fp8 >= 1.5x bf16
(blockwise 1.3x). ``--layouts fwd,dgrad,wgrad`` and ``--shapes gpt2,llama`` pick what
these sections run; given without ``--sections`` they run these sections alone (and
``mx_layouts``: the MXFP8 GEMMs in the same layouts, bench_gemm_mx.py's docstring).

``--sections`` picks what runs (default: fp8, transformer, square, linear,
gelu_compiled, layouts, fp8_layouts, mx_layouts).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemm_layouts as layouts_sections  # noqa: E402  (sections layouts, fp8_layouts)
import bench_gemm_mx as mx_section  # noqa: E402  (section mx_layouts)
from gemm_checks import (  # noqa: E402
    ACCUM,
    CHECK_TOL,
    FP8_FORMATS,
    FP8_SCALINGS,
    FP8_TOL,
    TORCH_FP8,
    checked_torch_fp8_mm,
    dequantize,
    rel,
    rounded,
)
from harness import Results, bench, error_line, geomean, setup  # noqa: E402

import tkern  # noqa: E402
from tkern.kernels.gemm import matmul_tma_persistent  # noqa: E402

SQUARE = (512, 1024, 2048, 4096, 8192)
TRANSFORMER = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
TOKENS = 8192
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# tkern's two GEMM schedules: the default (one tile per program, pointer loads)
# and the persistent one with tensor-descriptor (TMA) loads, not yet the default
GEMMS = {"tkern": tkern.matmul, "tkern tma": matmul_tma_persistent}
SECTIONS = ("fp8", "transformer", "square", "linear", "gelu_compiled", "layouts", "fp8_layouts", "mx_layouts")


def bench_linear(record, mode, tokens: int, n: int, k: int) -> None:
    """tkern.linear (plain and with the fused bias + GELU) against torch's
    F.linear and unfused F.gelu(F.linear) under autocast, forward and forward + backward."""
    dev = mode.device
    x = torch.randn(tokens, k, device=dev, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(n, k, device=dev) / k**0.5).half().requires_grad_()
    b = torch.randn(n, device=dev, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.float16)
    flops = 2 * tokens * n * k
    shape = f"{tokens}x{n}x{k}"

    def fwd_bwd(f):
        return lambda: f().backward(dy)

    def unfused():
        with torch.autocast(dev.type, dtype=torch.float16, enabled=not mode.smoke):
            return F.gelu(F.linear(x, w, b))

    def addmm_gelu():  # torch's fused GEMM + bias + GELU (cuBLASLt epilogue), forward only
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)

    variants = {
        "tkern": (lambda: tkern.linear(x, w, b), lambda: tkern.linear(x, w, b, "gelu")),
        "torch": (lambda: F.linear(x, w, b), unfused),
    }
    if mode.smoke:
        variants.pop("torch")
    else:
        assert rel(tkern.linear(x, w, b, "gelu"), unfused()) < CHECK_TOL[torch.float16]
    for impl, (plain, gelu) in variants.items():
        record(f"linear fwd {shape}", impl, plain, flops)
        record(f"linear fwd+bwd {shape}", impl, fwd_bwd(plain), 3 * flops)
        record(f"bias+gelu fwd {shape}", impl, gelu, flops)
        record(f"bias+gelu fwd+bwd {shape}", impl, fwd_bwd(gelu), 3 * flops)
    if not mode.smoke:  # cuBLASLt's epilogue; the CPU has no fp16 GEMM worth timing
        # its GELU is the tanh approximation on some builds: within a few fp16 roundings
        assert rel(addmm_gelu(), unfused()) < 4 * CHECK_TOL[torch.float16]
        record(f"bias+gelu fwd {shape}", "torch addmm_activation", addmm_gelu, flops)


def bench_gelu_compiled(record, mode, tokens: int, n: int, k: int) -> None:
    """The unfused recipe ``F.gelu(F.linear(x, W, b))`` under ``torch.compile``
    (Inductor fuses the GELU into the GEMM's epilogue or a following kernel), forward
    and forward + backward, beside tkern's fused linear on the same shape. One
    shape: each compile takes a GPU session tens of seconds."""
    dev = mode.device
    x = torch.randn(tokens, k, device=dev, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(n, k, device=dev) / k**0.5).half().requires_grad_()
    b = torch.randn(n, device=dev, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.float16)
    flops, shape = 2 * tokens * n * k, f"{tokens}x{n}x{k}"
    compiled = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), dynamic=False)
    # checked with grad on, as it is timed: one compile serves the check and both rows
    assert rel(compiled(x, w, b).detach(), tkern.linear(x, w, b, "gelu").detach()) < CHECK_TOL[torch.float16]
    record(f"bias+gelu fwd {shape}", "torch compiled", lambda: compiled(x, w, b), flops)
    record(f"bias+gelu fwd+bwd {shape}", "torch compiled", lambda: compiled(x, w, b).backward(dy), 3 * flops)


def bench_fp8(res: Results, record, mode, tokens: int, shapes) -> None:
    """tkern.scaled_mm against torch's fp8 GEMM and a bf16 cuBLAS GEMM, every
    format and scaling, on x (tokens, K) @ W^T."""
    dev = mode.device
    for n, k in shapes:
        x = torch.randn(tokens, k, device=dev)
        w = torch.randn(n, k, device=dev) / k**0.5
        flops = 2 * tokens * n * k
        shape = f"{tokens}x{n}x{k}"
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        if not mode.smoke:  # cuBLAS bf16; the CPU has no bf16 matmul worth timing
            record(f"fp8 bf16 baseline {shape}", "torch bf16", lambda xb=xb, wb=wb: xb @ wb.t(), flops)
        for fmt, (dtype_a, dtype_b) in FP8_FORMATS.items():
            for scaling, (gran_a, gran_b) in FP8_SCALINGS.items():
                case = f"fp8 {fmt} {scaling} {shape}"
                a, sa = tkern.to_float8(x, dtype_a, gran_a)
                wq, sw = tkern.to_float8(w, dtype_b, gran_b)
                b = wq.t()  # (K, N), column-major: W read in place, as torch._scaled_mm wants
                sb = sw if sw.dim() == 0 else sw.t()
                ref = dequantize(a, sa) @ dequantize(wq, sw).t()
                mine = functools.partial(  # tkern's accumulation as the row's ``accum`` names it
                    tkern.scaled_mm, a, b, sa, sb, out_dtype=torch.bfloat16,
                    use_fast_accum=ACCUM[scaling] == "fast",
                )  # fmt: skip
                err = rel(mine(), ref)
                if not err < FP8_TOL:
                    res.meta["failed"].append(
                        {"case": case, "impl": "tkern", "error": f"rel error {err:.3g}"}
                    )
                    continue
                record(case, "tkern", mine, flops, fmt=fmt, scaling=scaling, accum=ACCUM[scaling])
                # torch with tkern's accumulation first (the target's peer), then the other
                peers = [ACCUM[scaling]] + [a_ for a_ in TORCH_FP8 if a_ != ACCUM[scaling]]
                for accum in peers if scaling != "blockwise" else ["precise"]:
                    impl = TORCH_FP8[accum]
                    try:
                        theirs = checked_torch_fp8_mm(scaling, a, b, sa, sb, accum, ref)
                    except Exception as exc:  # noqa: BLE001 - the baseline is missing, say why
                        res.add(
                            case, impl, None, fmt=fmt, scaling=scaling, accum=accum, skipped=error_line(exc)
                        )
                        continue
                    record(case, impl, theirs, flops, fmt=fmt, scaling=scaling, accum=accum)
        res.save()


def fp8_summary(res: Results, tokens: int, shapes) -> list[str]:
    """Geomean over the shapes of tkern's speed against torch's fp8 GEMM and
    against bf16 cuBLAS, per format and scaling, into ``res.meta``."""
    lines = []
    for fmt in FP8_FORMATS:
        for scaling in FP8_SCALINGS:
            accum = ACCUM[scaling]
            peer = TORCH_FP8[accum]  # like with like: torch with tkern's accumulation
            vs_torch = geomean(
                [res.ratio(f"fp8 {fmt} {scaling} {tokens}x{n}x{k}", "tkern", peer) for n, k in shapes]
            )
            vs_bf16 = geomean(
                [
                    res.ratio(
                        f"fp8 {fmt} {scaling} {tokens}x{n}x{k}",
                        "tkern",
                        "torch bf16",
                        baseline_case=f"fp8 bf16 baseline {tokens}x{n}x{k}",
                    )
                    for n, k in shapes
                ]
            )
            for key, value in (
                (f"fp8_{fmt}_{scaling}_vs_torch_same_accum", vs_torch),
                (f"fp8_{fmt}_{scaling}_vs_bf16", vs_bf16),
            ):
                res.meta[key] = round(value, 3) if value == value else None
            res.meta[f"fp8_{scaling}_accum"] = accum
            lines.append(
                f"fp8 {fmt} {scaling}: {vs_torch:.3f}x torch's fp8 GEMM, both {accum} accumulation "
                f"(target >= 0.95), {vs_bf16:.3f}x bf16 cuBLAS"
            )
    return lines


def main(argv: list[str] | None = None) -> Results:
    mode, args = setup("gemm", __doc__, argv, add_arguments=layouts_sections.arguments, sections=SECTIONS)
    layouts, models = layouts_sections.chosen(args, sys.argv[1:] if argv is None else argv)
    # a subset of the sections adds its rows to the file (a GPU session splits them across calls)
    res = Results("gemm", mode, metric="tflops", merge=tuple(args.sections) != SECTIONS)
    res.meta["failed"] = []
    square = (64,) if mode.smoke else SQUARE
    shapes = ((96, 64),) if mode.smoke else TRANSFORMER
    fp8_shapes = ((128, 128),) if mode.smoke else TRANSFORMER  # a block's K extent is a multiple of 128
    tokens = 32 if mode.smoke else TOKENS
    record = _recorder(res, mode)
    for section in args.sections:
        if section == "fp8":
            bench_fp8(res, record, mode, tokens, fp8_shapes)
        elif section == "square":
            for tag, dtype in DTYPES.items():
                for n in square:
                    a, b = (torch.randn(n, n, device=mode.device).to(dtype) for _ in range(2))
                    record_mm(record, mode, f"{tag} square {n}", a, b)
        elif section == "transformer":
            for tag, dtype in DTYPES.items():
                for n, k in shapes:
                    x = torch.randn(tokens, k, device=mode.device).to(dtype)
                    w = (torch.randn(n, k, device=mode.device) / k**0.5).to(dtype)
                    record_mm(record, mode, f"{tag} mm {tokens}x{n}x{k}", x, w.t())  # x @ W^T, W in place
        elif section == "layouts":
            layouts_sections.bench_layouts(res, record, mode, models, layouts, args.alternatives)
        elif section == "fp8_layouts":
            layouts_sections.bench_fp8_layouts(res, record, mode, models, layouts)
        elif section == "mx_layouts":
            mx_section.bench_mx_layouts(res, record, mode, models, layouts)
        elif section == "gelu_compiled":
            if mode.smoke:  # a compile per shape: minutes on a CPU, nothing to learn there
                print("gelu_compiled: skipped in smoke mode (torch.compile)")
            else:
                bench_gelu_compiled(record, mode, tokens, *shapes[0])
        else:  # linear forward / forward+backward and the fused bias+GELU epilogue, fp16
            for n, k in shapes:
                bench_linear(record, mode, tokens, n, k)
        res.save()  # after every section: a timeout loses only the section in progress
    summary = fp8_summary(res, tokens, fp8_shapes)
    summary += layouts_sections.layouts_summary(res, models, layouts, mode.smoke)
    summary += mx_section.mx_summary(res, layouts, mode.smoke)
    if not mode.smoke:
        summary += gemm_summary(res, tokens, square, shapes) + gelu_summary(res, tokens, shapes)
    summary += [f"FAILED {f['case']} {f['impl']}: {f['error']}" for f in res.meta["failed"]]
    res.save(plot=True)
    res.print_table(["ms", "tflops"], summary)
    return res


def _recorder(res: Results, mode):
    """``record(case, impl, fn, flops, **extra)``: ``fn`` timed into ``res`` with its TFLOP/s;
    returns the row."""

    def record(case, impl, fn, flops, **extra):
        ms, lo, hi = bench(fn, mode)
        tflops = round(flops / (ms * 1e-3) / 1e12, 2)
        return res.add(case, impl, ms, tflops=tflops, ms_p20=round(lo, 5), ms_p80=round(hi, 5), **extra)

    return record


def record_mm(record, mode, case: str, a, b) -> None:
    """Every implementation of a @ b on one case, each checked against torch first."""
    ref = a.float() @ b.float()
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    for impl, fn in GEMMS.items():
        assert rel(fn(a, b), ref) < CHECK_TOL[a.dtype], (case, impl)
        record(case, impl, lambda fn=fn: fn(a, b), flops)
    if not mode.smoke:  # cuBLAS; the CPU has no fp16/bf16 matmul worth timing
        record(case, "torch", lambda: a @ b, flops)


def gemm_summary(res: Results, tokens: int, square, shapes) -> list[str]:
    """The square and transformer-shape geomeans against cuBLAS into ``res.meta``, and their lines."""
    lines = []
    for tag in DTYPES:
        for impl in GEMMS:
            sq = geomean([res.ratio(f"{tag} square {n}", impl, "torch") for n in square if n >= 2048])
            tr = geomean([res.ratio(f"{tag} mm {tokens}x{n}x{k}", impl, "torch") for n, k in shapes])
            prefix = tag if impl == "tkern" else f"{tag}_tma"
            res.meta[f"{prefix}_square_ge2048_vs_cublas"] = round(sq, 3)
            res.meta[f"{prefix}_transformer_vs_cublas"] = round(tr, 3)
            lines.append(
                f"{tag} {impl}: /cuBLAS geomean, square >= 2048: {sq:.3f}x; "
                f"transformer shapes: {tr:.3f}x (target >= 0.95)"
            )
    return lines


def gelu_summary(res: Results, tokens: int, shapes) -> list[str]:
    """The fused bias + GELU's ratios against each peer into ``res.meta``, and their lines."""
    gelu = geomean([res.ratio(f"bias+gelu fwd {tokens}x{n}x{k}", "tkern", "torch") for n, k in shapes])
    gelu_bwd = geomean(
        [res.ratio(f"bias+gelu fwd+bwd {tokens}x{n}x{k}", "tkern", "torch") for n, k in shapes]
    )
    res.meta["fused_bias_gelu_fwd_speedup"] = round(gelu, 3)
    res.meta["fused_bias_gelu_fwd_bwd_speedup"] = round(gelu_bwd, 3)
    gelu_addmm = geomean(
        [res.ratio(f"bias+gelu fwd {tokens}x{n}x{k}", "tkern", "torch addmm_activation") for n, k in shapes]
    )
    res.meta["fused_bias_gelu_fwd_vs_addmm_activation"] = rounded(gelu_addmm)
    first = f"{tokens}x{shapes[0][0]}x{shapes[0][1]}"
    for key, case in (("fwd", "bias+gelu fwd"), ("fwd_bwd", "bias+gelu fwd+bwd")):
        res.meta[f"fused_bias_gelu_{key}_vs_compiled"] = rounded(
            res.ratio(f"{case} {first}", "tkern", "torch compiled")
        )
    return [
        f"fused bias+GELU forward: {gelu_addmm:.3f}x torch._addmm_activation(use_gelu=True); on {first} "
        f"{res.meta['fused_bias_gelu_fwd_vs_compiled']}x / "
        f"{res.meta['fused_bias_gelu_fwd_bwd_vs_compiled']}x the unfused recipe compiled (fwd / fwd+bwd)",
        f"fused bias+GELU vs unfused autocast: forward {gelu:.3f}x, "
        f"forward+backward {gelu_bwd:.3f}x (target >= 1.1)",
    ]


if __name__ == "__main__":
    main()
