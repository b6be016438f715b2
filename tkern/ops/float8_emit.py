"""The producer half of an fp8 GEMM -> fp8 GEMM hand-off: a Float8Linear's forward GEMM
whose epilogue writes the next fp8 layer's input cast (``float8_linear(emit_fp8=...)``,
:func:`tkern.scaled_mm`'s ``emit_fp8``), as a norm writes its consumer's
(:func:`tkern.ops.norm.norm_float8`).

Eager only, as the norm's: the emitted cast is not traced. Under ``torch.compile`` (or for
meta tensors, tensor subclasses) ``float8_linear`` refuses ``emit_fp8``; the module hand-off
(:mod:`tkern.nn.float8_emit`) does not ask for it there, and the consumer casts its input.
"""

from __future__ import annotations

import torch

from tkern.kernels._common import HALF_DTYPES, INTERPRET
from tkern.kernels.gemm import scaled_mm
from tkern.kernels.gemm_emit import Float8Emit, check_emit
from tkern.ops.common import is_compiling
from tkern.ops.float8_args import CACHED_SCALINGS, Float8Input

__all__ = ["Float8Emit", "check_emit_args", "emitted_pair", "scaled_mm_emit"]


def _eager(x: torch.Tensor) -> bool:
    return type(x) is torch.Tensor and not x.is_meta and not is_compiling() and (INTERPRET or x.is_cuda)


def check_emit_args(emit_fp8, x: torch.Tensor, weight: torch.Tensor, scaling: str) -> None:
    """``float8_linear``'s ``emit_fp8``: None, or a :class:`Float8Emit` for a per-tensor layer
    of bf16 / fp16 output, in an eager call."""
    if emit_fp8 is None:
        return
    if scaling not in CACHED_SCALINGS:
        raise ValueError(
            f'emit_fp8: the producing layer\'s GEMM takes per-tensor scales ("tensorwise" or '
            f'"delayed"), its scaling is "{scaling}"'
        )
    if weight.dtype not in HALF_DTYPES:
        raise ValueError(f"emit_fp8: the producing layer must be bf16 or fp16, got {weight.dtype}")
    check_emit(emit_fp8, weight.dtype, False, None, x)
    if not _eager(x):
        raise RuntimeError(
            "float8_linear's emit_fp8 runs eagerly only (the emitted cast is not traced): under "
            "torch.compile, for meta tensors or tensor subclasses let the next fp8 layer cast"
        )


def scaled_mm_emit(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, activation, store_preact, emit):
    """The forward GEMM of :class:`~tkern.ops.float8._Float8Linear` with ``emit``:
    ``(y, pre-activation or None, Float8Input)``."""
    preact = None
    if store_preact:
        preact = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    # the forward's own casts of what float8_linear checked (emit: check_emit_args), so the
    # GEMM checks nothing again
    y, emitted = scaled_mm(
        a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        activation=activation, preact=preact, emit_fp8=emit, prechecked=True,
    )  # fmt: skip
    return y, preact, Float8Input(*emitted)


def emitted_pair(out: tuple, emit: Float8Emit) -> tuple[torch.Tensor, Float8Input]:
    """``(y, Float8Input)`` from the autograd function's outputs ``(y, data, data_t, scale)``
    (``data_t`` empty without ``emit.store_t``)."""
    y, data, data_t, scale = out
    return y, Float8Input(data, data_t if emit.store_t else None, scale)
