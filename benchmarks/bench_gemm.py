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
  blockwise path (one ``tl.dot`` per K tile, promoted with its scales) and torch's
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
constants). fp8: ``tkern.scaled_mm`` in the same three layouts (e4m3 forward, e5m2
gradients; e4m3 throughout for blockwise, as Float8Linear casts them), tensorwise,
rowwise (scales along each operand's non-K dimension) and blockwise, the operands'
fp8 data in the 16-bit layouts, against ``torch._scaled_mm`` (handed the
row-major x column-major operands it requires, transposed copies made untimed)
and a bf16 cuBLAS GEMM of the same layout. Targets (GPU): >= 0.95x cuBLAS in every
layout; fp8 >= 1.5x bf16 (blockwise 1.3x). ``--layouts fwd,dgrad,wgrad`` and
``--shapes gpt2,llama`` pick what these sections run; given without
``--sections`` they run these two sections alone.

``--sections`` picks what runs (default: fp8, transformer, square, linear,
gelu_compiled, layouts, fp8_layouts).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench, error_line, geomean, setup  # noqa: E402

import tkern  # noqa: E402
from tkern.kernels import gemm  # noqa: E402
from tkern.kernels.gemm import matmul_tma_persistent  # noqa: E402
from tkern.kernels.gemm_plan import POINTER, TMA, GemmPlan  # noqa: E402

SQUARE = (512, 1024, 2048, 4096, 8192)
TRANSFORMER = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
TOKENS = 8192
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# max relative error against torch before a case is timed: both accumulate in
# fp32 and round once, so they differ by about one output rounding
CHECK_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# tkern's two GEMM schedules: the default (one tile per program, pointer loads)
# and the persistent one with tensor-descriptor (TMA) loads, not yet the default
GEMMS = {"tkern": tkern.matmul, "tkern tma": matmul_tma_persistent}
SECTIONS = ("fp8", "transformer", "square", "linear", "gelu_compiled", "layouts", "fp8_layouts")
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
#: how an fp8 GEMM accumulates (the module docstring): tkern's per scaling, and torch's impls
ACCUM = {"tensorwise": "fast", "rowwise": "fast", "blockwise": "precise"}
TORCH_FP8 = {"fast": "torch fast accum", "precise": "torch"}
#: (a's dtype, b's dtype) of the fp8 rows: forward (e4m3 x e4m3) and dgrad (e5m2 gradient x e4m3 weight)
FP8_FORMATS = {
    "e4m3xe4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "e5m2xe4m3": (torch.float8_e5m2, torch.float8_e4m3fn),
}
#: scale granularity -> (x's, W's) as tkern.to_float8 takes it
FP8_SCALINGS = {
    "tensorwise": ("tensor", "tensor"),
    "rowwise": ("row", "row"),
    "blockwise": ((1, 128), (128, 128)),
}
#: max relative error of an fp8 GEMM against the fp32 product of its dequantized
#: operands: both accumulate in fp32 and round once to bf16 (2^-8 relative), so
#: the norm-wise error is well under one bf16 rounding
FP8_TOL = 8e-3


def _rounded(x: float) -> float | None:
    """``x`` to 3 decimals; None when it is not a number (a row not measured)."""
    return round(x, 3) if x == x and abs(x) != float("inf") else None


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data.float() * scale`` with any of to_float8's scales (0-dim, per row,
    per block) expanded to data's shape."""
    if scale.dim() == 0:
        return data.float() * scale
    (m, k), (sm, sk) = data.shape, scale.shape
    bm, bk = -(-m // sm), -(-k // sk)
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    return data.float() * full


def torch_fp8_mm(scaling: str, a, b, sa, sb, accum: str = "precise") -> Callable[[], torch.Tensor]:
    """torch's fp8 GEMM for ``scaling`` as a callable: ``torch._scaled_mm`` for
    tensorwise and rowwise scales (``use_fast_accum`` when ``accum`` is "fast"); for
    blocks ``F.scaled_mm`` with BlockWise1x128 / BlockWise128x128 (precise only),
    whose scale layouts are tried in the forms torch documents (as given, or
    outer-dimension-major). Raises what torch raises if none works."""
    if scaling != "blockwise":
        fast = accum == "fast"
        return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    if accum != "precise":
        raise ValueError("torch's blockwise fp8 GEMM is offered with precise accumulation only")
    from torch.nn.functional import ScalingType, scaled_mm

    def outer_major(t):
        return t.t().contiguous().t()

    errors = []
    for sa_, sb_ in ((sa, sb), (outer_major(sa), sb), (outer_major(sa), sb.t().contiguous())):
        fn = functools.partial(
            scaled_mm, a, b, sa_, ScalingType.BlockWise1x128, sb_, ScalingType.BlockWise128x128
        )
        try:
            fn(output_dtype=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - the next layout, then the row's recorded reason
            errors.append(error_line(exc, 120))
            continue
        return functools.partial(fn, output_dtype=torch.bfloat16)
    raise RuntimeError("torch's blockwise scaled_mm refused every scale layout: " + " | ".join(errors))


def checked_torch_fp8_mm(scaling: str, a, b, sa, sb, accum: str, ref) -> Callable[[], torch.Tensor]:
    """:func:`torch_fp8_mm`, checked against ``ref`` (the dequantized operands' product)
    within ``FP8_TOL``; raises what torch raises, or RuntimeError on a wrong result."""
    theirs = torch_fp8_mm(scaling, a, b, sa, sb, accum)
    err = rel(theirs(), ref)
    if not err < FP8_TOL:
        raise RuntimeError(f"torch's result differs from the reference: rel error {err:.3g}")
    return theirs


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
                assert rel(fn(), ref) < CHECK_TOL[dtype], (case, "tkern")
                record(case, "tkern", fn, 2 * m * n * k, **extra, **_plan_fields(plan))
                if alternatives and not mode.smoke:
                    for impl, kernel in ALTERNATIVES.items():
                        if kernel == plan.kernel or (kernel == TMA and not gemm.device_gemm_info(dev)[1]):
                            continue
                        forced = plan._replace(kernel=kernel, split_k=1, k_chunk=k)
                        fn = functools.partial(gemm.run_plan, forced, a, b, m, n, k, None, None, dtype, None)
                        assert rel(fn(), ref) < CHECK_TOL[dtype], (case, impl)
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


def _like(data: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``data`` copied into ``ref``'s memory layout (strides), so an fp8 operand is laid
    out as the 16-bit one it replaces."""
    return torch.empty_strided(ref.shape, ref.stride(), dtype=data.dtype, device=data.device).copy_(data)


def quantize_operands(scaling: str, layout: str, a, b):
    """``(aq, bq, sa, sb, block_a, block_b)``: ``a`` (M, K) and ``b`` (K, N) cast to fp8 in
    their own layouts with scales for ``tkern.scaled_mm``: tensorwise; rowwise along each
    operand's non-K dimension ((M, 1), (1, N)); blockwise 1x128 for a, 128x128 for a
    weight b and 128x1 for the wgrad's X (Float8Linear's tiles)."""
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
    block_a = (1, 128) if scaling == "blockwise" else None
    block_b = (128, gran_b[0]) if scaling == "blockwise" else None
    return _like(aq, a), _like(bq_t.t(), b), sa, sb, block_a, block_b


def bench_fp8_layouts(res: Results, record, mode, models, layouts) -> None:
    """tkern.scaled_mm in the training layouts against torch._scaled_mm and bf16 cuBLAS."""
    dev = mode.device
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
                if not mode.smoke:
                    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)  # the same strides
                    record(base, "torch bf16", lambda ab=ab, bb=bb: ab @ bb, flops, **extra)
                for scaling in FP8_SCALINGS:
                    case = f"fp8 {scaling} {layout} {model} {layer} {shape}"
                    aq, bq, sa, sb, block_a, block_b = quantize_operands(scaling, layout, a, b)
                    ref = dequantize(aq, sa) @ dequantize(bq.t(), sb.t() if sb.dim() else sb).t()
                    mine = functools.partial(
                        tkern.scaled_mm,
                        aq,
                        bq,
                        sa,
                        sb,
                        out_dtype=torch.bfloat16,
                        block_a=block_a,
                        block_b=block_b,
                        use_fast_accum=ACCUM[scaling] == "fast",
                    )
                    err = rel(mine(), ref)
                    if not err < FP8_TOL:
                        res.meta["failed"].append(
                            {"case": case, "impl": "tkern", "error": f"rel error {err:.3g}"}
                        )
                        continue
                    record(case, "tkern", mine, flops, scaling=scaling, accum=ACCUM[scaling], **extra)
                    if scaling == "blockwise":
                        why = "torch's blockwise GEMM is not timed in the training layouts"
                        res.add(case, "torch", None, scaling=scaling, skipped=why, **extra)
                        continue
                    # torch._scaled_mm takes a row-major and b column-major: transposed copies, untimed
                    ta, tb = aq.contiguous(), bq.t().contiguous().t()
                    accum = ACCUM[scaling]
                    try:
                        theirs = checked_torch_fp8_mm(scaling, ta, tb, sa, sb, accum, ref)
                    except Exception as exc:  # noqa: BLE001 - the baseline is missing, say why
                        res.add(case, TORCH_FP8[accum], None, scaling=scaling, accum=accum,
                                skipped=error_line(exc), **extra)  # fmt: skip
                        continue
                    record(case, TORCH_FP8[accum], theirs, flops, scaling=scaling, accum=accum, **extra)
            res.save()


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
            res.meta[key] = _rounded(vs)
            if not smoke:
                lines.append(f"fp16 {layout} at {model} shapes: {vs:.3f}x cuBLAS (target >= 0.95)")
    for layout in layouts:  # fp8 over every model's shapes: one figure per scaling and layout
        cases = sorted(c for model in models for c in by_case.get((model, layout), ()))
        for scaling in FP8_SCALINGS:
            ratios = [
                res.ratio(c, "tkern", "torch bf16", baseline_case="fp8 layout bf16 " + c.split(" ", 2)[2])
                for c in cases
                if c.startswith(f"fp8 {scaling} ")
            ]
            vs = geomean(ratios)
            res.meta[f"fp8_{scaling}_{layout}_vs_bf16"] = _rounded(vs)
            if not smoke:
                bound = 1.3 if scaling == "blockwise" else 1.5
                lines.append(f"fp8 {scaling} {layout}: {vs:.3f}x bf16 cuBLAS (target >= {bound})")
    return lines


def main(argv: list[str] | None = None) -> Results:
    mode, args = setup("gemm", __doc__, argv, add_arguments=_arguments, sections=SECTIONS)
    dev = mode.device
    layouts, models = (
        _choice(args.layouts, LAYOUTS, "--layouts"),
        _choice(args.shapes, MODEL_SHAPES, "--shapes"),
    )
    given = sys.argv[1:] if argv is None else argv
    if (args.layouts or args.shapes) and not any(a.startswith("--sections") for a in given):
        args.sections = ["layouts", "fp8_layouts"]  # the flags name these sections' cases
    # a subset of the sections adds its rows to the file (a GPU session splits them across calls)
    res = Results("gemm", mode, metric="tflops", merge=tuple(args.sections) != SECTIONS)
    res.meta["failed"] = []
    square = (64,) if mode.smoke else SQUARE
    shapes = ((96, 64),) if mode.smoke else TRANSFORMER
    fp8_shapes = ((128, 128),) if mode.smoke else TRANSFORMER  # a block's K extent is a multiple of 128
    tokens = 32 if mode.smoke else TOKENS

    def record(case, impl, fn, flops, **extra):
        ms, lo, hi = bench(fn, mode)
        res.add(
            case,
            impl,
            ms,
            tflops=round(flops / (ms * 1e-3) / 1e12, 2),
            ms_p20=round(lo, 5),
            ms_p80=round(hi, 5),
            **extra,
        )

    def record_mm(case, a, b):
        """Every implementation of a @ b on one case, each checked against torch first."""
        ref = a.float() @ b.float()
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        for impl, fn in GEMMS.items():
            assert rel(fn(a, b), ref) < CHECK_TOL[a.dtype], (case, impl)
            record(case, impl, lambda fn=fn: fn(a, b), flops)
        if not mode.smoke:  # cuBLAS; the CPU has no fp16/bf16 matmul worth timing
            record(case, "torch", lambda: a @ b, flops)

    for section in args.sections:
        if section == "fp8":
            bench_fp8(res, record, mode, tokens, fp8_shapes)
        elif section == "square":
            for tag, dtype in DTYPES.items():
                for n in square:
                    record_mm(
                        f"{tag} square {n}",
                        torch.randn(n, n, device=dev).to(dtype),
                        torch.randn(n, n, device=dev).to(dtype),
                    )
        elif section == "transformer":
            for tag, dtype in DTYPES.items():
                for n, k in shapes:
                    x = torch.randn(tokens, k, device=dev).to(dtype)
                    w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
                    record_mm(f"{tag} mm {tokens}x{n}x{k}", x, w.t())  # x @ W^T, W read in place
        elif section == "layouts":
            bench_layouts(res, record, mode, models, layouts, args.alternatives)
        elif section == "fp8_layouts":
            bench_fp8_layouts(res, record, mode, models, layouts)
        elif section == "gelu_compiled":
            if mode.smoke:  # a compile per shape: minutes on a CPU, nothing to learn there
                print("gelu_compiled: skipped in smoke mode (torch.compile)")
            else:
                bench_gelu_compiled(record, mode, tokens, *shapes[0])
        else:  # linear forward / forward+backward and the fused bias+GELU epilogue, fp16
            for n, k in shapes:
                bench_linear(record, mode, tokens, n, k)
        res.save()  # after every section: a timeout loses only the section in progress

    summary = fp8_summary(res, tokens, fp8_shapes) + layouts_summary(res, models, layouts, mode.smoke)
    if not mode.smoke:
        for tag in DTYPES:
            for impl in GEMMS:
                sq = geomean([res.ratio(f"{tag} square {n}", impl, "torch") for n in square if n >= 2048])
                tr = geomean([res.ratio(f"{tag} mm {tokens}x{n}x{k}", impl, "torch") for n, k in shapes])
                prefix = tag if impl == "tkern" else f"{tag}_tma"
                res.meta[f"{prefix}_square_ge2048_vs_cublas"] = round(sq, 3)
                res.meta[f"{prefix}_transformer_vs_cublas"] = round(tr, 3)
                summary.append(
                    f"{tag} {impl}: /cuBLAS geomean, square >= 2048: {sq:.3f}x; "
                    f"transformer shapes: {tr:.3f}x (target >= 0.95)"
                )
        gelu = geomean([res.ratio(f"bias+gelu fwd {tokens}x{n}x{k}", "tkern", "torch") for n, k in shapes])
        gelu_bwd = geomean(
            [res.ratio(f"bias+gelu fwd+bwd {tokens}x{n}x{k}", "tkern", "torch") for n, k in shapes]
        )
        res.meta["fused_bias_gelu_fwd_speedup"] = round(gelu, 3)
        res.meta["fused_bias_gelu_fwd_bwd_speedup"] = round(gelu_bwd, 3)
        gelu_addmm = geomean(
            [
                res.ratio(f"bias+gelu fwd {tokens}x{n}x{k}", "tkern", "torch addmm_activation")
                for n, k in shapes
            ]
        )
        res.meta["fused_bias_gelu_fwd_vs_addmm_activation"] = _rounded(gelu_addmm)
        first = f"{tokens}x{shapes[0][0]}x{shapes[0][1]}"
        for key, case in (("fwd", "bias+gelu fwd"), ("fwd_bwd", "bias+gelu fwd+bwd")):
            res.meta[f"fused_bias_gelu_{key}_vs_compiled"] = _rounded(
                res.ratio(f"{case} {first}", "tkern", "torch compiled")
            )
        summary.append(
            f"fused bias+GELU forward: {gelu_addmm:.3f}x torch._addmm_activation(use_gelu=True); on {first} "
            f"{res.meta['fused_bias_gelu_fwd_vs_compiled']}x / "
            f"{res.meta['fused_bias_gelu_fwd_bwd_vs_compiled']}x the unfused recipe compiled (fwd / fwd+bwd)"
        )
        summary.append(
            f"fused bias+GELU vs unfused autocast: forward {gelu:.3f}x, "
            f"forward+backward {gelu_bwd:.3f}x (target >= 1.1)"
        )
    summary += [f"FAILED {f['case']} {f['impl']}: {f['error']}" for f in res.meta["failed"]]
    res.save(plot=True)
    res.print_table(["ms", "tflops"], summary)
    return res


def _arguments(parser) -> None:
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


def _choice(value: str | None, options, flag: str) -> tuple[str, ...]:
    """The comma-separated ``value`` of ``flag`` checked against ``options`` (all when None)."""
    if value is None:
        return tuple(options)
    chosen = tuple(v for v in value.split(",") if v)
    unknown = sorted(set(chosen) - set(options))
    if unknown:
        raise SystemExit(f"bench_gemm.py: {flag}: unknown {unknown}; choose from {list(options)}")
    return chosen


if __name__ == "__main__":
    main()
