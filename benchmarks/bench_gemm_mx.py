"""``bench_gemm.py``'s section ``mx_layouts`` (issue 53 item 6): the MXFP8 GEMMs of a
linear layer's three training layouts, ready for a Blackwell GPU.

Each GEMM is ``tkern.scaled_mm`` with e8m0 scales (gemm_mx.py) on the operands as the
``"mxfp8"`` recipe casts them (tkern/ops/float8_mx.py): forward ``x @ W^T`` scaled along
in_features, dgrad ``dY @ W`` along out_features, wgrad ``dY^T @ X`` along the tokens; e4m3
throughout (the recipe's default), one scale per 32 of each GEMM's K, both operands
K-major. Peers: ``torch._scaled_mm`` with e8m0 scales (cuBLAS's MXFP8; its scales in the
swizzled layout cuBLAS reads, torchao's ``to_blocked``, as torchao's ``mx_mm`` passes
them) and bf16 cuBLAS (``torch.mm``) in the same layout. Where a GEMM is refused (tkern's
and cuBLAS's MX GEMMs need Blackwell; torch's on a CPU) the row records the refusal in
its ``skipped``, as the fp8 rows record torch's blockwise refusal. Target (Blackwell):
MX >= 1.8x bf16 cuBLAS in every layout (``mx_<layout>_vs_bf16``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_checks as checks  # noqa: E402
from bench_gemm_layouts import BF16_PEER, MODEL_SHAPES, layout_operands  # noqa: E402
from harness import Results, error_line, geomean  # noqa: E402

import tkern  # noqa: E402

#: the MX block: every GEMM's K (and so every converted layer's features) a multiple of it
MX_BLOCK = 32
#: smoke sizes: every extent a multiple of 32 (the interpreter's time: one layer)
MX_SMOKE_SHAPES = (64, (("proj", 32, 64),))
TORCH_MX = "torch mx (cuBLAS)"
#: Blackwell's bound on each layout's geomean over bf16 cuBLAS
MX_BOUND = 1.8


def mx_operands(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """``(aq, bq, sa, sb)``: ``a`` (M, K) and ``b`` (K, N) cast to MX along K, K-major
    (``bq`` the transpose of a contiguous (N, K) cast), scales (M, K/32) and (N, K/32)."""
    aq, sa = tkern.to_mx(a.contiguous(), dtype)
    bq_t, sb = tkern.to_mx(b.t().contiguous(), dtype)
    return aq, bq_t.t(), sa, sb


def mx_fp64_product(aq, bq, sa, sb) -> torch.Tensor:
    """The float64 product of the MX operands, each element times its block's 2^(scale - 127)."""

    def full(data, scale):
        exps = scale.view(torch.uint8).double() - 127
        return data.double() * torch.exp2(exps).repeat_interleave(MX_BLOCK, dim=-1)

    return full(aq, sa) @ full(bq.t(), sb).t()


def torch_mx_mm(aq, bq, sa, sb):
    """cuBLAS's MXFP8 GEMM as a callable: ``torch._scaled_mm`` with the e8m0 scales
    swizzled as cuBLAS reads them; raises what torch raises (a CPU, a pre-Blackwell GPU)."""
    from torchao.prototype.mx_formats.utils import to_blocked

    sa_b, sb_b = (to_blocked(s.view(torch.uint8)).view(torch.float8_e8m0fnu) for s in (sa, sb))
    fn = functools.partial(torch._scaled_mm, aq, bq, sa_b, sb_b, out_dtype=torch.bfloat16)
    fn()
    return fn


def bench_mx_layouts(res: Results, record, mode, models, layouts) -> None:
    """The section (module docstring): per model, layer and layout a bf16 cuBLAS case and
    an MX case (tkern, then torch's MX GEMM), each checked against the float64 product."""
    dev = mode.device
    for model in models:
        tokens, layers = MX_SMOKE_SHAPES if mode.smoke else MODEL_SHAPES[model]
        for layer, n_out, k_in in layers:
            if n_out % MX_BLOCK or k_in % MX_BLOCK:  # the recipe leaves such a layer (GPT-2's head) bf16
                continue
            x = torch.randn(tokens, k_in, device=dev)
            w = torch.randn(n_out, k_in, device=dev) / k_in**0.5
            dy = torch.randn(tokens, n_out, device=dev)
            for layout in layouts:
                a, b = layout_operands(layout, x, w, dy)
                (m, k), n = a.shape, b.shape[1]
                shape, flops = f"{m}x{n}x{k}", 2 * m * n * k
                extra = dict(layout=layout, model=model, layer=layer, scaling="mxfp8")
                if not mode.smoke:
                    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
                    record(f"mx layout bf16 {layout} {model} {layer} {shape}", BF16_PEER,
                           lambda ab=ab, bb=bb: ab @ bb, flops, **extra)  # fmt: skip
                _mx_case(res, record, mode, f"mx {layout} {model} {layer} {shape}", a, b, flops, extra)
            res.save()


def _mx_case(res: Results, record, mode, case: str, a, b, flops: int, extra: dict) -> None:
    """tkern's MX GEMM and torch's on one case, each refusal recorded as the row's ``skipped``."""
    aq, bq, sa, sb = mx_operands(a, b)
    ref = mx_fp64_product(aq, bq, sa, sb)
    mine = functools.partial(tkern.scaled_mm, aq, bq, sa, sb, out_dtype=torch.bfloat16)
    try:
        err = checks.rel_err(mine(), ref)
    except RuntimeError as exc:  # no native MX on this device: said so
        res.add(case, "tkern", None, skipped=error_line(exc), **extra)
    else:
        if not err < checks.FP8_TOL:
            res.meta["failed"].append({"case": case, "impl": "tkern", "error": f"rel error {err:.3g}"})
        else:
            record(case, "tkern", mine, flops, rel_err=float(f"{err:.3g}"), **extra)
    if mode.smoke:
        return
    try:
        theirs = torch_mx_mm(aq, bq, sa, sb)
        err = checks.rel_err(theirs(), ref)
        if not err < checks.FP8_TOL:
            raise RuntimeError(f"torch's result differs from the reference: rel error {err:.3g}")
    except Exception as exc:  # noqa: BLE001 - the peer is missing, say why
        res.add(case, TORCH_MX, None, skipped=error_line(exc), **extra)
    else:
        record(case, TORCH_MX, theirs, flops, rel_err=float(f"{err:.3g}"), **extra)


def mx_summary(res: Results, layouts, smoke: bool) -> list[str]:
    """``mx_<layout>_vs_bf16`` (tkern / bf16 cuBLAS, geomean over the cases timed) and
    ``mx_<layout>_vs_torch_mx`` into ``res.meta``; None where nothing was timed."""
    lines = []
    for layout in layouts:
        cases = sorted({r["case"] for r in res.rows if r["case"].startswith(f"mx {layout} ")})
        bf16 = [res.ratio(c, "tkern", BF16_PEER, baseline_case="mx layout bf16 " + c[3:]) for c in cases]
        vs_torch = [res.ratio(c, "tkern", TORCH_MX) for c in cases]
        res.meta[f"mx_{layout}_vs_bf16"] = checks.rounded(geomean(bf16))
        res.meta[f"mx_{layout}_vs_torch_mx"] = checks.rounded(geomean(vs_torch))
        if not smoke:
            lines.append(
                f"mx {layout}: {res.meta[f'mx_{layout}_vs_bf16']}x bf16 cuBLAS (target >= {MX_BOUND})"
            )
    return lines
