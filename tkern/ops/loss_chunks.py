"""The chunked pass of :func:`tkern.linear_cross_entropy`: the rows in chunks, per chunk
tkern's GEMM for the chunk's fp32 logits, the cross-entropy kernel for its loss terms
and logit gradient (one launch, into a buffer reused by every chunk), then the chunk's
dgrad and its wgrad, the wgrad accumulated in an fp32 (V, H) buffer across the chunks
and rounded once at the end (Liger PR 1391: bf16 accumulation over many chunks loses
digits with the chunk count).

Both doors of ops/cross_entropy.py (the eager ``autograd.Function`` and the custom ops
``tkern::linear_cross_entropy`` / ``tkern::linear_cross_entropy_backward`` that
``torch.compile`` traces) run :func:`fused_forward` and :func:`recompute_grads`; no
tensor larger than one chunk's logits (or than the input, the weight and their
gradients) is created.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.cross_entropy import (
    STAT_A,
    STAT_COUNT,
    STAT_DENOM,
    STAT_Q,
    cross_entropy_backward,
    cross_entropy_forward,
    target_stats,
)
from tkern.kernels.gemm import matmul_prechecked, matmul_row_stats_prechecked
from tkern.kernels.gemm_epilogue import row_stats_slots
from tkern.ops.common import is_compiling

__all__ = [
    "MIN_CHUNK_ROWS",
    "ChunkedLoss",
    "LossOptions",
    "default_chunk_rows",
    "denominators",
    "fused_forward",
    "recompute_grads",
]

#: The fewest rows a default chunk has (all the rows where there are fewer): each chunk
#: runs three GEMMs whose row count is the chunk's (the logits' and dgrad's M, the weight
#: gradient's K), plus a kernel launch; below ~128 rows they are launch-bound and the
#: weight gradient's K too short to fill a 128-wide tile (1-row chunks: one launch per token).
MIN_CHUNK_ROWS = 128

NO_GRADS = (False, False, False)


class LossOptions(NamedTuple):
    """The loss's options as the chunks use them (checked by the caller)."""

    ignore_index: int
    smoothing: float
    softcap: float | None
    z_loss: float
    reduction: str
    chunk: int


def default_chunk_rows(n_rows: int, in_features: int, n_classes: int) -> int:
    """Rows per chunk: the power of two nearest the head's ``in_features`` H, raised to
    :data:`MIN_CHUNK_ROWS` and capped at ``n_rows`` rounded up to a power of two (one chunk
    holds every row).

    The rule, by bytes against memory, for V = ``n_classes``. Each chunk moves 12 V H
    bytes on the weight's side whatever its rows (the 16-bit weight read by its logits
    GEMM and by its dgrad, the fp32 (V, H) weight-gradient sum read and written by its
    wgrad) and 14 V bytes per row (fp32 logits written and read back, the 16-bit logit
    gradient written and read by dgrad and wgrad): with rows ~ H the chunks add about
    6/7 of the rows' own traffic (0.64 at GPT-2 small's 1024 rows), where 256 rows (the
    previous rule, as many logits per chunk as the input's elements) added 2.6 times it.
    The memory it costs is the chunk's buffers, 6 rows V bytes (its fp32 logits and
    16-bit gradient): with rows ~ H about 1.5x the fp32 weight-gradient sum (4 V H) the
    pass holds anyway, and no term in the token count. V cancels out of both, so it does
    not move the rule. GPT-2 small (16384 tokens of 768 into 50257, the step ledger):
    1024 rows, 16 chunks; the LM head's GEMMs move 13.9 GB where 256 rows moved 36.2 GB,
    for 309 MB of chunk buffers instead of 77 MB. Llama 3 8B (4096 into 128256): 4096
    rows, 3.2 GB of buffers beside the 2.1 GB fp32 weight-gradient sum.

    The floor keeps each chunk's GEMMs large enough to keep a GPU busy (and tiny heads
    from one-row chunks); the cap, short batches in one chunk (their rows x V fp32 logits
    once)."""
    rows = max(1 << round(math.log2(max(in_features, 1))), MIN_CHUNK_ROWS)
    return max(1, min(rows, 1 << max(n_rows - 1, 0).bit_length()))


def denominators(
    target: Tensor, weight: Tensor | None, ignore_index: int, n_classes: int
) -> tuple[Tensor, Tensor]:
    """``(the mean's denominator, the non-ignored count)`` as fp32 0-d device
    tensors (no host sync; the targets checked in the same launch,
    :func:`kernels.cross_entropy.target_stats`): the summed class weights of the
    non-ignored targets (torch's weighted mean) or their count, and the count (the
    z-loss's mean). Traced (torch.compile, meta tensors), torch's ops on the same
    formula instead: a Triton launch outside a custom op would break the graph, and the
    compiler fuses these."""
    if is_compiling() or target.is_meta:
        valid = target != ignore_index
        count = valid.sum(dtype=torch.float32)
        if weight is None:
            return count, count
        return (weight[torch.where(valid, target, 0).long()] * valid).sum(), count
    stats = target_stats(target, n_classes, ignore_index, weight)
    return stats[STAT_DENOM], stats[STAT_COUNT]


def _mm_into(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b (+ bias)`` with fp32 accumulation: tkern's GEMM for fp16/bf16
    operands (out of any of fp16/bf16/fp32), torch's for fp32 operands (tkern's GEMM
    takes 16-bit operands only)."""
    if a.dtype in HALF_DTYPES:
        matmul_prechecked(a, b, bias, None, out.dtype, None, out, accumulate)
    elif accumulate:
        out.addmm_(a, b)
    elif bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias.to(out.dtype), a, b, out=out)


def _cast(t: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if t is None or like is None else t.to(like.dtype)


class ChunkedLoss:
    """The chunked pass over the rows of ``x`` (N, H) against the head ``w`` (V, H) and
    ``b``: per chunk the logits (fp32, reused buffer), the kernel, and the chunk's
    dgrad and wgrad from the kernel's gradient (reused buffer of the input's dtype).

    With 16-bit operands and neither label smoothing nor softcap, the forward's logits GEMM
    also writes each row's softmax statistics per 32 columns (``ROW_STATS``, a reused
    (rows, V / 32, 2) fp32 buffer, 1/4 of a logits row's bytes), from which the kernel takes
    the lse: it reads each chunk's fp32 logits once, not twice (GPT-2 small: 3.3 GB a step
    fewer)."""

    def __init__(
        self, x: Tensor, w: Tensor, b: Tensor | None, target: Tensor, weight: Tensor | None, opts: LossOptions
    ) -> None:
        self.x, self.w, self.b, self.target, self.weight, self.opts = x, w, b, target, weight, opts
        rows, v = min(opts.chunk, x.shape[0]), w.shape[0]
        self.logits = torch.empty(rows, v, dtype=torch.float32, device=x.device)
        self.grad = None
        fusable = x.dtype in HALF_DTYPES and opts.smoothing == 0 and opts.softcap is None
        slots = row_stats_slots(v)
        self.stats = torch.empty(rows, slots, 2, dtype=torch.float32, device=x.device) if fusable else None

    def spans(self) -> list[tuple[int, int]]:
        n, chunk = self.x.shape[0], self.opts.chunk
        return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

    def logits_of(self, s: int, e: int, stats: Tensor | None = None) -> Tensor:
        """Rows ``[s, e)``'s fp32 logits; with ``stats`` (a slice of ``self.stats``) their
        softmax statistics written beside them by the same GEMM."""
        out = self.logits[: e - s]
        if stats is None:
            _mm_into(self.x[s:e], self.w.t(), self.b, out, False)
        else:
            matmul_row_stats_prechecked(self.x[s:e], self.w.t(), self.b, out, stats)
        return out

    def grad_buffer(self, rows: int) -> Tensor:
        if self.grad is None:
            self.grad = torch.empty(self.logits.shape, dtype=self.x.dtype, device=self.x.device)
        return self.grad[:rows]

    def grad_outputs(self, needs: tuple[bool, ...]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Uninitialized ``(gx, gW fp32, gb fp32)`` for what ``needs`` (x, W, b) asks."""
        x, w = self.x, self.w
        gx = torch.empty_like(x) if needs[0] else None
        gw32 = torch.empty(w.shape, dtype=torch.float32, device=x.device) if needs[1] else None
        gb32 = torch.empty(w.shape[0], dtype=torch.float32, device=x.device) if needs[2] else None
        return gx, gw32, gb32

    def backprop(self, g: Tensor, s: int, e: int, gx, gw32, gb32, first: bool) -> None:
        """The chunk's share: gx[s:e] = g @ W, gW += g^T @ x (fp32), gb += column sums (fp32)."""
        if gx is not None:
            _mm_into(g, self.w, None, gx[s:e], False)
        if gw32 is not None:
            _mm_into(g.t(), self.x[s:e], None, gw32, not first)
        if gb32 is not None:
            part = g.sum(0, dtype=torch.float32)
            if first:
                gb32.copy_(part)
            else:
                gb32.add_(part)

    def forward_pass(self, a: Tensor | None, q: Tensor | None, needs: tuple[bool, ...]):
        """``(loss terms, lse, gx, gW fp32, gb fp32)`` per row; with ``needs`` (x, W, b)
        the gradients of ``sum_i a * loss_i + q * lse_i^2`` (a, q: (1,) fp32 device tensors)."""
        o, want = self.opts, any(needs)
        gx, gw32, gb32 = self.grad_outputs(needs)
        n = self.x.shape[0]  # each chunk's launch writes its slice of the (N,) rows and lse
        rows = torch.empty(n, dtype=torch.float32, device=self.x.device)
        lses = torch.empty(n, dtype=torch.float32, device=self.x.device)
        for i, (s, e) in enumerate(self.spans()):
            grad = self.grad_buffer(e - s) if want else None
            stats = None if self.stats is None else self.stats[: e - s]
            cross_entropy_forward(
                self.logits_of(s, e, stats),
                self.target[s:e],
                self.weight,
                ignore_index=o.ignore_index,
                label_smoothing=o.smoothing,
                softcap=o.softcap,
                grad=grad,
                a=a if want else None,
                q=q if want else None,
                check_target=False,
                loss_out=rows[s:e],
                lse_out=lses[s:e],
                row_stats=stats,
            )
            if want:
                self.backprop(grad, s, e, gx, gw32, gb32, i == 0)
        return rows, lses, gx, gw32, gb32

    def recompute_pass(
        self, lse: Tensor, grad_rows: Tensor, grad_lse: Tensor | None, needs: tuple[bool, ...]
    ):
        """``reduction="none"``'s backward: the chunks again, with per-row coefficients;
        ``(gx, gW fp32, gb fp32)``."""
        o = self.opts
        gx, gw32, gb32 = self.grad_outputs(needs)
        for i, (s, e) in enumerate(self.spans()):
            grad = cross_entropy_backward(
                self.logits_of(s, e),
                self.target[s:e],
                lse[s:e],
                grad_rows[s:e],
                None if grad_lse is None else grad_lse[s:e],
                self.weight,
                ignore_index=o.ignore_index,
                label_smoothing=o.smoothing,
                softcap=o.softcap,
                grad=self.grad_buffer(e - s),
            )
            self.backprop(grad, s, e, gx, gw32, gb32, i == 0)
        return gx, gw32, gb32


def fused_forward(ch: ChunkedLoss, needs: tuple[bool, ...], round_grads: bool = True):
    """``(loss, lse, gx, gW, gb)``: the loss (0-d for "mean"/"sum", per row for "none"),
    the rows' logsumexp and, for "mean"/"sum" with ``needs`` (x, W, b), the loss's
    gradients (gW and gb rounded once from their fp32 sums into W's and b's dtypes, or
    with ``round_grads=False`` those fp32 sums themselves); None for a gradient not
    computed. The targets are checked first, in the launch that gives the reduction's
    scalars (:func:`target_stats`)."""
    o = ch.opts
    stats = target_stats(
        ch.target, ch.w.shape[0], o.ignore_index, ch.weight, mean=o.reduction == "mean", z_loss=o.z_loss
    )
    if o.reduction == "none":
        rows, lse, *_ = ch.forward_pass(None, None, NO_GRADS)
        return (rows + o.z_loss * lse * lse if o.z_loss else rows), lse, None, None, None
    a, q = stats[STAT_A : STAT_A + 1], stats[STAT_Q : STAT_Q + 1]  # (1,) views, no launch
    rows, lse, gx, gw32, gb32 = ch.forward_pass(a, q if o.z_loss else None, needs)
    loss = (rows.sum() * a[0]).reshape(())
    if o.z_loss:
        loss = loss + (lse * lse).sum() * q[0]
    if not round_grads:
        return loss, lse, gx, gw32, gb32
    return loss, lse, gx, _cast(gw32, ch.w), _cast(gb32, ch.b)


def recompute_grads(
    ch: ChunkedLoss, lse: Tensor, grad_out: Tensor, needs: tuple[bool, ...], round_grads: bool = True
):
    """``reduction="none"``'s ``(gx, gW, gb)`` for the per-row upstream gradient ``grad_out``
    (gW and gb rounded once from their fp32 sums, or those sums with ``round_grads=False``;
    None for a gradient not asked for)."""
    g = grad_out.to(torch.float32).contiguous()
    glse = (2.0 * ch.opts.z_loss) * lse * g if ch.opts.z_loss else None
    gx, gw32, gb32 = ch.recompute_pass(lse, g, glse, needs)
    if not round_grads:
        return gx, gw32, gb32
    return gx, _cast(gw32, ch.w), _cast(gb32, ch.b)
