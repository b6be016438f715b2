"""The training-layout sections of ``bench_gemm.py`` (``layouts``, ``fp8_layouts``; the
module docstring there says what they time) and the flags that pick their cases
(``--layouts``, ``--shapes``, ``--alternatives``)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_checks as checks  # noqa: E402  (how a case is checked; torch's fp8 GEMM)
from harness import Results, device_name, device_spec, error_line, geomean  # noqa: E402

import tkern  # noqa: E402
from tkern.kernels import gemm  # noqa: E402
from tkern.kernels.gemm_blockwise import blockwise_eligible  # noqa: E402
from tkern.kernels.gemm_plan import POINTER, TMA, GemmPlan  # noqa: E402
from tkern.ops.float8 import FORWARD_FAST_ACCUM, GRADIENT_FAST_ACCUM  # noqa: E402

#: The training layouts of a linear layer's three GEMMs (--layouts).
LAYOUTS = ("fwd", "dgrad", "wgrad")
#: Models whose layers' shapes the layout sections time (--shapes): tokens, and each
#: layer's (name, out features, in features).
MODEL_SHAPES = {
    "gpt2": (  # GPT-2 small, seq 1024 x batch 16
        16384,
        (("qkv", 2304, 768), ("attn_proj", 768, 768), ("mlp_up", 3072, 768), ("mlp_down", 768, 3072),
         ("lm_head", 50257, 768)),
    ),
    "llama": (  # Llama-2-7B's block at 8192 tokens (q/k/v and gate/up fused)
        8192,
        (("qkv", 12288, 4096), ("o_proj", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)),
    ),
}  # fmt: skip
#: Smoke sizes (a CPU, the interpreter): an odd "vocabulary" keeps the aligned-rows copy in play.
SMOKE_SHAPES = (128, (("proj", 48, 128), ("head", 101, 32)))
#: The forced alternatives of --alternatives: the kernels the plan may choose between.
ALTERNATIVES = {"tkern pointer": POINTER, "tkern tma": TMA}


def layout_operands(layout: str, x, w, dy):
    """``(a, b)`` of ``layout``'s GEMM as tkern.linear launches it: forward ``x @ W^T``
    (W^T a view), dgrad ``dY @ W``, wgrad ``dY^T @ X`` (dY^T a view)."""
    return {"fwd": (x, w.t()), "dgrad": (dy, w), "wgrad": (dy.t(), x)}[layout]


def _plan_fields(plan: GemmPlan) -> dict:
    return {"plan": plan.kernel, "split_k": plan.split_k, "tiles": plan.tiles, "waves": round(plan.waves, 2)}


def bench_layouts(res: Results, record, mode, models, layouts, alternatives: bool) -> None:
    """The 16-bit training layouts (module docstring), fp16, against torch.mm."""
    dev, dtype = mode.device, torch.float16
    for model in models:
        tokens, layers = SMOKE_SHAPES if mode.smoke else MODEL_SHAPES[model]
        for layer, n_out, k_in in layers:
            x = torch.randn(tokens, k_in, device=dev).to(dtype)
            w = (torch.randn(n_out, k_in, device=dev) / k_in**0.5).to(dtype)
            dy = torch.randn(tokens, n_out, device=dev).to(dtype)
            dz = gemm.tma_aligned_rows(dy)  # what tkern.linear's backward hands both GEMMs
            if dz is not dy:
                pad = functools.partial(gemm.tma_aligned_rows, dy)
                record(f"fp16 pad {model} {layer} {tokens}x{n_out}", "tkern", pad, 0, layout="dgrad+wgrad",
                       model=model, layer=layer)  # fmt: skip
            for layout in layouts:
                a, b = layout_operands(layout, x, w, dz)
                (m, k), n = a.shape, b.shape[1]
                case = f"fp16 {layout} {model} {layer} {m}x{n}x{k}"
                extra = dict(layout=layout, model=model, layer=layer, padded=dz is not dy and layout != "fwd")
                ref = a.float() @ b.float()
                plan = gemm.plan_for(a, b, m, n, k)
                # the launch tkern.linear makes (checked once, planned once): no per-call checks timed
                fn = functools.partial(gemm.run_plan, plan, a, b, m, n, k, None, None, dtype, None)
                assert checks.rel(fn(), ref) < checks.CHECK_TOL[dtype], (case, "tkern")
                record(case, "tkern", fn, 2 * m * n * k, **extra, **_plan_fields(plan))
                if alternatives and not mode.smoke:
                    for impl, kernel in ALTERNATIVES.items():
                        if kernel == plan.kernel or (kernel == TMA and not gemm.device_gemm_info(dev)[1]):
                            continue
                        forced = plan._replace(kernel=kernel, split_k=1, k_chunk=k)
                        fn = functools.partial(gemm.run_plan, forced, a, b, m, n, k, None, None, dtype, None)
                        assert checks.rel(fn(), ref) < checks.CHECK_TOL[dtype], (case, impl)
                        record(case, impl, fn, 2 * m * n * k, **extra, **_plan_fields(forced))
                if not mode.smoke:  # cuBLAS, the same layout (dY unpadded: torch's own)
                    ta, tb = layout_operands(layout, x, w, dy)
                    record(case, "torch", lambda ta=ta, tb=tb: ta @ tb, 2 * m * n * k, **extra)
            res.save()


#: fp8 formats of each layout's (a, b) as Float8Linear casts them (e5m2 gradients;
#: blockwise casts every operand to e4m3).
FP8_LAYOUT_DTYPES = {
    "fwd": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "dgrad": (torch.float8_e5m2, torch.float8_e4m3fn),
    "wgrad": (torch.float8_e5m2, torch.float8_e4m3fn),
}
#: ``use_fast_accum`` of each layout's GEMM as Float8Linear launches it: the forward's
#: products summed in the tensor cores' accumulator, the gradients' promoted every K tile
FP8_LAYOUT_FAST_ACCUM = {
    "fwd": FORWARD_FAST_ACCUM,
    "dgrad": GRADIENT_FAST_ACCUM,
    "wgrad": GRADIENT_FAST_ACCUM,
}
#: the peers of an fp8 layout row: bf16 cuBLAS in the same layout (its own case, ``fp8 layout
#: bf16 ...``) and torch's fp8 GEMM with the row's accumulation (gemm_checks.TORCH_FP8)
BF16_PEER = "torch bf16"


def fp8_accum(scaling: str, layout: str) -> str:
    """How ``layout``'s fp8 GEMM accumulates under ``scaling`` (gemm_checks.TORCH_FP8's keys):
    block scales are promoted every 128 of K whatever ``use_fast_accum`` says."""
    return "fast" if scaling != "blockwise" and FP8_LAYOUT_FAST_ACCUM[layout] else "precise"


def quantize_operands(scaling: str, layout: str, a, b):
    """``(aq, bq, sa, sb, block_a, block_b)``: ``a`` (M, K) and ``b`` (K, N) cast to fp8
    K-major, as Float8Linear's casts write them (x and x^T, W and W^T, dY and dY^T: ``aq``
    contiguous, ``bq`` the transpose of a contiguous (N, K) cast), with scales for
    ``tkern.scaled_mm``: tensorwise; rowwise along each operand's non-K dimension ((M, 1),
    (1, N)); blockwise 1x128 for a, 128x128 for a weight b and 128x1 for the wgrad's X."""
    da, db = FP8_LAYOUT_DTYPES[layout]
    if scaling == "blockwise":
        da = db = torch.float8_e4m3fn
    gran_a, gran_b = {
        "tensorwise": ("tensor", "tensor"),
        "rowwise": ("row", "row"),
        "blockwise": ((1, 128), (1, 128) if layout == "wgrad" else (128, 128)),
    }[scaling]
    aq, sa = tkern.to_float8(a.contiguous(), da, gran_a)
    bq_t, sb_t = tkern.to_float8(b.t().contiguous(), db, gran_b)  # b's columns as rows
    sb = sb_t if sb_t.dim() == 0 else sb_t.t()
    blocks = ((1, 128), (128, gran_b[0])) if scaling == "blockwise" else (None, None)
    return aq, bq_t.t(), sa, sb, *blocks


def bench_fp8_layouts(res: Results, record, mode, models, layouts) -> None:
    """tkern.scaled_mm in the training layouts against torch._scaled_mm and bf16 cuBLAS:
    every row with its TFLOP/s, MFU (at the device's dense fp8 / bf16 peak), its
    ``rel_err`` against the float64 product of the same fp8 operands, and tkern's with its
    ratio against the best peer of the same run (``vs_best_peer``, ``best_peer``)."""
    dev = mode.device
    spec = device_spec(device_name())
    for model in models:
        tokens, layers = SMOKE_SHAPES if mode.smoke else MODEL_SHAPES[model]
        for layer, n_out, k_in in layers[:1] if mode.smoke else layers:  # smoke: the interpreter's time
            x = torch.randn(tokens, k_in, device=dev)
            w = torch.randn(n_out, k_in, device=dev) / k_in**0.5
            dy = torch.randn(tokens, n_out, device=dev)
            for layout in layouts:
                a, b = layout_operands(layout, x, w, dy)
                (m, k), n = a.shape, b.shape[1]
                shape, flops = f"{m}x{n}x{k}", 2 * m * n * k
                extra = dict(layout=layout, model=model, layer=layer)
                base = f"fp8 layout bf16 {layout} {model} {layer} {shape}"
                bf16_row = None
                if not mode.smoke:  # cuBLAS in the same layout: x @ W^T, dY @ W, dY^T @ X as views
                    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)  # the same strides
                    bf16_row = record(base, BF16_PEER, lambda ab=ab, bb=bb: ab @ bb, flops, **extra)
                    _mfu(bf16_row, spec, torch.bfloat16)
                for scaling in checks.FP8_SCALINGS:
                    case = f"fp8 {scaling} {layout} {model} {layer} {shape}"
                    _fp8_layout_case(res, record, case, scaling, layout, a, b, flops, extra, spec, bf16_row)
            res.save()


def _fp8_layout_case(res, record, case, scaling, layout, a, b, flops, extra, spec, bf16_row) -> None:
    """One scaling of one layout: tkern checked against the float64 product and timed,
    then torch's fp8 GEMM with the same accumulation, then tkern's ratio to the best peer."""
    aq, bq, sa, sb, block_a, block_b = quantize_operands(scaling, layout, a, b)
    ref = checks.fp64_product(aq, bq, sa, sb)
    accum = fp8_accum(scaling, layout)
    fields = dict(scaling=scaling, accum=accum, use_fast_accum=FP8_LAYOUT_FAST_ACCUM[layout], **extra)
    mine = functools.partial(
        tkern.scaled_mm, aq, bq, sa, sb, out_dtype=torch.bfloat16, block_a=block_a, block_b=block_b,
        use_fast_accum=FP8_LAYOUT_FAST_ACCUM[layout],
    )  # fmt: skip
    err = checks.rel_err(mine(), ref)
    if not err < checks.FP8_TOL:
        res.meta["failed"].append({"case": case, "impl": "tkern", "error": f"rel error {err:.3g}"})
        return
    # which kernel scaled_mm runs it on (the blockwise rows: gemm_blockwise.py)
    blockwise = block_a is not None and blockwise_eligible(aq, bq, block_a, block_b)
    row = record(case, "tkern", mine, flops, kernel="blockwise" if blockwise else "pointer",
                 rel_err=_sig(err), **fields)  # fmt: skip
    _mfu(row, spec, aq.dtype)
    peers = [bf16_row] if bf16_row is not None else []
    impl = checks.TORCH_FP8[accum]
    if bf16_row is not None:  # torch._scaled_mm takes a row-major and b column-major: K-major, as given
        b_blocks = "BlockWise1x128" if layout == "wgrad" else "BlockWise128x128"
        try:
            theirs = checks.checked_torch_fp8_mm(scaling, aq, bq, sa, sb, accum, ref, b_blocks)
        except Exception as exc:  # noqa: BLE001 - the peer is missing, say why
            res.add(case, impl, None, skipped=error_line(exc), **fields)
        else:
            peer = record(case, impl, theirs, flops, rel_err=_sig(checks.rel_err(theirs(), ref)), **fields)
            peers.append(_mfu(peer, spec, aq.dtype))
    if peers:
        best = min(peers, key=lambda r: r["ms"])
        row.update(best_peer=best["impl"], vs_best_peer=round(best["ms"] / row["ms"], 3))
        row["vs_bf16"] = round(bf16_row["ms"] / row["ms"], 3)


def _mfu(row: dict, spec, dtype: torch.dtype) -> dict:
    """``row`` with its ``mfu``: its TFLOP/s over the device's dense peak for ``dtype``
    (None off the devices :data:`harness.DEVICES` knows, a CPU)."""
    row["mfu"] = None if spec is None else round(row["tflops"] / spec.peak_tflops(dtype), 4)
    return row


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def layouts_summary(res: Results, models, layouts, smoke: bool) -> list[str]:
    """Geomeans into ``res.meta``: tkern / cuBLAS per model and layout (16-bit), and fp8 /
    bf16 cuBLAS per scaling and layout over the models' shapes."""
    lines = []
    by_case = {}
    for r in res.rows:
        if "layout" in r and r.get("model") in models and r["layout"] in layouts:
            by_case.setdefault((r["model"], r["layout"]), set()).add(r["case"])
    for model in models:
        for layout in layouts:
            cases = sorted(by_case.get((model, layout), ()))
            vs = geomean([res.ratio(c, "tkern", "torch") for c in cases if c.startswith("fp16 ")])
            key = f"fp16_{layout}_{model}_vs_cublas"
            res.meta[key] = checks.rounded(vs)
            if not smoke:
                lines.append(f"fp16 {layout} at {model} shapes: {vs:.3f}x cuBLAS (target >= 0.95)")
    for layout in layouts:  # fp8 over every model's shapes: one figure per scaling and layout
        cases = sorted(c for model in models for c in by_case.get((model, layout), ()))
        for scaling in checks.FP8_SCALINGS:
            ratios = [
                res.ratio(c, "tkern", "torch bf16", baseline_case="fp8 layout bf16 " + c.split(" ", 2)[2])
                for c in cases
                if c.startswith(f"fp8 {scaling} ")
            ]
            vs = geomean(ratios)
            res.meta[f"fp8_{scaling}_{layout}_vs_bf16"] = checks.rounded(vs)
            tkern_rows = [
                r
                for r in res.rows
                if r["impl"] == "tkern" and r["case"] in cases and r.get("scaling") == scaling
            ]
            best = geomean([r.get("vs_best_peer") or float("nan") for r in tkern_rows])
            res.meta[f"fp8_{scaling}_{layout}_vs_best_peer"] = checks.rounded(best)
            mfus = [r["mfu"] for r in tkern_rows if r.get("mfu")]
            res.meta[f"fp8_{scaling}_{layout}_mfu"] = checks.rounded(geomean(mfus)) if mfus else None
            if not smoke:
                bound = 1.3 if scaling == "blockwise" else 1.5
                lines.append(
                    f"fp8 {scaling} {layout}: {vs:.3f}x bf16 cuBLAS (target >= {bound}), {best:.3f}x the "
                    f"best peer, MFU {res.meta[f'fp8_{scaling}_{layout}_mfu']}"
                )
    return lines


def arguments(parser) -> None:
    parser.add_argument(
        "--layouts", default=None, help=f"comma-separated, of {','.join(LAYOUTS)} (default all)"
    )
    parser.add_argument(
        "--shapes", default=None, help=f"comma-separated models, of {','.join(MODEL_SHAPES)} (default all)"
    )
    parser.add_argument(
        "--alternatives",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the kernels the plan did not choose (tkern pointer / tkern tma)",
    )


def chosen(args, given: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(layouts, models)`` that ``--layouts`` and ``--shapes`` pick (all by default); given
    without ``--sections``, they pick these sections alone (``args.sections`` set so)."""
    layouts, models = (
        choice(args.layouts, LAYOUTS, "--layouts"),
        choice(args.shapes, MODEL_SHAPES, "--shapes"),
    )
    if (args.layouts or args.shapes) and not any(a.startswith("--sections") for a in given):
        args.sections = ["layouts", "fp8_layouts", "mx_layouts"]  # the flags name these sections' cases
    return layouts, models


def choice(value: str | None, options, flag: str) -> tuple[str, ...]:
    """The comma-separated ``value`` of ``flag`` checked against ``options`` (all when None)."""
    if value is None:
        return tuple(options)
    chosen = tuple(v for v in value.split(",") if v)
    unknown = sorted(set(chosen) - set(options))
    if unknown:
        raise SystemExit(f"bench_gemm.py: {flag}: unknown {unknown}; choose from {list(options)}")
    return chosen
