"""Norm layers in fp32 from 16-bit tensors (issue 28): tkern's layer_norm,
rms_norm and their fused residual forms against torch and Liger-Kernel.

Cases: bf16 activations of 8192 tokens at hidden 768 (GPT-2 small), 4096
(Llama-7B) and 8192, fp32 weight (and bias), forward and forward + backward
(``torch.autograd.grad`` of the output with a fixed upstream gradient, for x and
the params). Implementations:

* ``tkern``: ``tkern.layer_norm`` / ``tkern.rms_norm`` (16-bit in and out, fp32
  statistics and params); ``tkern add_*``: ``tkern.add_layer_norm`` /
  ``add_rms_norm`` against torch's ``x + residual`` followed by the norm;
* ``torch autocast``: ``F.layer_norm`` / ``F.rms_norm`` under ``torch.autocast``
  (bf16): autocast runs them in fp32 and returns fp32, as a torch AMP user gets;
* ``torch fp32 upcast``: ``F.layer_norm(x.float(), ...).to(x.dtype)``, what
  ``convert_network`` did before issue 28 (an fp32 copy of x saved for backward);
* ``liger``: Liger-Kernel's ``LigerLayerNorm`` / ``LigerRMSNorm`` where importable
  (a wheel on the GPU machine: see gpu_check.sh), else a row saying why not.

Each implementation is checked against the fp32 reference first (``CHECK_TOL``).
GB/s counts the fewest bytes: forward reads x and writes y (2 + 2 B per element,
the residual form also reads the residual and writes the sum: + 4); forward +
backward adds reading x and dy and writing dx (+ 6; the per-row statistics and
the params are small beside them). No target is set yet: the figures are
recorded (``layer_norm_fwd_bwd_vs_torch``, ``rms_norm_fwd_bwd_vs_torch``: tkern's
speed over torch autocast's, geomean over the hidden sizes) for the report.

While tkern lacks these functions (before issue 28 is merged) the tkern rows are
recorded with ``skipped`` naming the missing API, and the others still run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench, error_line, geomean, missing_api, peak_mib, setup  # noqa: E402

import tkern  # noqa: E402

TOKENS, HIDDEN = 8192, (768, 4096, 8192)
SMOKE_TOKENS, SMOKE_HIDDEN = 64, (96,)
EPS = 1e-5
DTYPE = torch.bfloat16
#: max relative error against the fp32 reference: one bf16 rounding of the
#: output (2^-8 relative, norm-wise well under it) with fp32 statistics
CHECK_TOL = 8e-3
#: the tkern API each norm needs (issue 28)
NEEDS = {
    "layer_norm": ["layer_norm", "add_layer_norm"],
    "rms_norm": ["rms_norm", "add_rms_norm"],
}


def _liger(norm: str, hidden: int, device: torch.device) -> Callable:
    """Liger-Kernel's module for ``norm`` with fp32 params (ImportError if absent)."""
    from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

    module = LigerLayerNorm(hidden, eps=EPS) if norm == "layer_norm" else LigerRMSNorm(hidden, eps=EPS)
    module = module.to(device)
    return lambda x, *params: module(x)


def implementations(norm: str, hidden: int, device: torch.device) -> dict[str, Callable | str]:
    """name -> f(x, *params) giving the normalized x, or the reason it cannot run."""
    shape = (hidden,)
    if norm == "layer_norm":

        def torch_fp32(x, w, b):
            return F.layer_norm(x.float(), shape, w, b, EPS).to(x.dtype)

        def torch_autocast(x, w, b):
            with torch.autocast(device.type, dtype=DTYPE):
                return F.layer_norm(x, shape, w, b, EPS)

    else:

        def torch_fp32(x, w):
            return F.rms_norm(x.float(), shape, w, EPS).to(x.dtype)

        def torch_autocast(x, w):
            with torch.autocast(device.type, dtype=DTYPE):
                return F.rms_norm(x, shape, w, EPS)

    impls: dict[str, Callable | str] = {"torch autocast": torch_autocast, "torch fp32 upcast": torch_fp32}
    missing = missing_api(tkern, NEEDS[norm])
    if missing:
        impls["tkern"] = f"not in this tkern: {', '.join(missing)} (issue 28)"
    else:
        fn = getattr(tkern, norm)
        impls["tkern"] = lambda x, *params: fn(x, shape, *params, EPS)
    try:
        impls["liger"] = _liger(norm, hidden, device)
    except ImportError as exc:
        impls["liger"] = f"Liger-Kernel is not importable ({exc})"
    return impls


def residual_implementations(norm: str, hidden: int) -> dict[str, Callable | str]:
    """name -> f(x, residual, *params) giving (norm(x + residual), x + residual)."""
    shape = (hidden,)
    plain = F.layer_norm if norm == "layer_norm" else F.rms_norm

    def torch_fp32(x, r, *params):
        s = x + r
        return plain(s.float(), shape, *params, EPS).to(x.dtype), s

    impls: dict[str, Callable | str] = {"torch fp32 upcast": torch_fp32}
    missing = missing_api(tkern, NEEDS[norm])
    if missing:
        impls["tkern"] = f"not in this tkern: {', '.join(missing)} (issue 28)"
    else:
        fn = getattr(tkern, f"add_{norm}")
        impls["tkern"] = lambda x, r, *params: fn(x, r, shape, *params, EPS)
    return impls


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_shape(res: Results, record: Callable, norm: str, tokens: int, hidden: int, dev, g) -> None:
    """Every implementation of ``norm`` (and its residual form) on (tokens, hidden)."""
    x = torch.randn(tokens, hidden, generator=g).to(dev, DTYPE).requires_grad_()
    r = torch.randn(tokens, hidden, generator=g).to(dev, DTYPE)
    dy = torch.randn(tokens, hidden, generator=g).to(dev, DTYPE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dev).requires_grad_()
    b = (0.1 * torch.randn(hidden, generator=g)).to(dev).requires_grad_()
    params = (w, b) if norm == "layer_norm" else (w,)
    ref = (F.layer_norm if norm == "layer_norm" else F.rms_norm)(x.float(), (hidden,), *params, EPS)
    n = tokens * hidden

    def forward(fn: Callable) -> Callable:
        return lambda: fn(x, *params)

    def backward(fn: Callable, inputs: tuple) -> Callable:
        return lambda: torch.autograd.grad(fn(x, *params), inputs, dy)

    for impl, fn in implementations(norm, hidden, dev).items():
        for kind in ("fwd", "fwd+bwd"):
            case = f"{norm} {kind} {tokens}x{hidden}"
            if isinstance(fn, str):
                res.add(case, impl, None, skipped=fn)
                continue
            try:
                err = rel(fn(x, *params), ref)
                if not err < CHECK_TOL:
                    raise AssertionError(f"relative error {err:.3g} against the fp32 reference")
                if kind == "fwd":
                    record(case, impl, forward(fn), 4 * n)
                else:  # Liger's module holds its own params: the gradient of x alone
                    record(case, impl, backward(fn, (x, *params) if impl != "liger" else (x,)), 10 * n)
            except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                res.meta["failed"].append({"case": case, "impl": impl, "error": error_line(exc)})
    for impl, fn in residual_implementations(norm, hidden).items():
        case = f"add_{norm} fwd+bwd {tokens}x{hidden}"
        if isinstance(fn, str):
            res.add(case, impl, None, skipped=fn)
            continue
        try:
            record(
                case,
                impl,
                lambda fn=fn: torch.autograd.grad(fn(x, r, *params), (x, *params), (dy, dy)),
                18 * n,
            )
        except Exception as exc:  # noqa: BLE001
            res.meta["failed"].append({"case": case, "impl": impl, "error": error_line(exc)})


def main(argv: list[str] | None = None) -> Results:
    mode, _ = setup("norm", __doc__, argv)
    dev = mode.device
    res = Results("norm", mode, metric="gbps")
    res.meta["failed"] = []
    tokens, hiddens = (SMOKE_TOKENS, SMOKE_HIDDEN) if mode.smoke else (TOKENS, HIDDEN)
    g = torch.Generator().manual_seed(0)

    def record(case, impl, fn, nbytes, memory: Callable | None = None) -> None:
        ms, lo, hi = bench(fn, mode)
        res.add(
            case,
            impl,
            ms,
            gbps=round(nbytes / (ms * 1e-3) / 1e9, 1),
            peak_mib=peak_mib(memory or fn, mode),
            ms_p20=round(lo, 5),
            ms_p80=round(hi, 5),
        )

    for norm in NEEDS:
        for hidden in hiddens:
            bench_shape(res, record, norm, tokens, hidden, dev, g)
            res.save()
    summary = []
    for norm in NEEDS:
        ratio = geomean(
            [res.ratio(f"{norm} fwd+bwd {tokens}x{h}", "tkern", "torch autocast") for h in hiddens]
        )
        res.meta[f"{norm}_fwd_bwd_vs_torch"] = round(ratio, 3) if ratio == ratio else None
        summary.append(f"{norm} forward + backward: tkern {ratio:.3f}x torch autocast (geomean)")
    summary += [f"FAILED {f['case']} {f['impl']}: {f['error']}" for f in res.meta["failed"]]
    res.save(plot=True)
    res.print_table(["ms", "gbps", "peak_mib", "skipped"], summary)
    return res


if __name__ == "__main__":
    main()
