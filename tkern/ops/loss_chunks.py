"""The chunked pass of :func:`tkern.linear_cross_entropy`: the rows in chunks, per chunk
its fp32 logits by tkern's GEMM in :data:`LOGITS_SPLIT` parts (one reused buffer), each
part through the cross-entropy kernel for its loss terms and its rows of the chunk's
logit gradient (one launch, into a buffer reused by every chunk), then the chunk's dgrad
and its wgrad, the wgrad accumulated in an fp32 (V, H) buffer across the chunks and
rounded once at the end (Liger PR 1391: bf16 accumulation over many chunks loses digits
with the chunk count).

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
    "LOGITS_SPLIT",
    "MIN_PART_ROWS",
    "default_chunk_rows",
    "denominators",
    "fused_forward",
    "logits_rows",
    "recompute_grads",
]

#: The fewest rows a default chunk has (all the rows where there are fewer): each chunk
#: runs three GEMMs whose row count is the chunk's (the logits' and dgrad's M, the weight
#: gradient's K), plus a kernel launch; far below ~64 rows they are launch-bound (1-row
#: chunks: one launch per token). Only batches under 256 rows (16 chunks' worth of a
#: quarter, :func:`default_chunk_rows`) get chunks this short.
MIN_CHUNK_ROWS = 64

#: A chunk's fp32 logits are computed in this many parts (:func:`logits_rows`), each into
#: one reused buffer and through the cross-entropy kernel into its rows of the chunk's
#: 16-bit gradient, which the chunk's dgrad and wgrad GEMMs then read once: the fp32
#: logits buffer is 1/4 of a chunk's fp32 logits (the chunk's largest tensor, its gradient,
#: half of them), and the weight-side GEMMs run once per chunk, not per part.
LOGITS_SPLIT = 4

#: The fewest rows a logits part has (all the chunk's where it has fewer): the logits GEMM's
#: M, its smallest tile's rows (its N, the vocabulary, keeps the GPU busy).
MIN_PART_ROWS = 16

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
    """Rows per chunk: :data:`LOGITS_SPLIT` times the power of two nearest the head's
    ``in_features`` H, capped at the power of two at most a quarter of ``n_rows`` (so at
    least four chunks), never below :data:`MIN_CHUNK_ROWS` nor above ``n_rows`` rounded up
    to a power of two.

    The rule, by bytes against memory, for V = ``n_classes``. A chunk of C rows runs one
    dgrad and one wgrad GEMM over its 16-bit logit gradient and its logits GEMMs in
    :data:`LOGITS_SPLIT` parts of C / 4 rows (:func:`logits_rows`). On the weight's side
    each logits part reads the 16-bit weight (2 V H bytes), each chunk's dgrad reads it
    too and its wgrad reads and writes the fp32 (V, H) weight-gradient sum (10 V H); per
    row, 14 V bytes whatever the chunks (fp32 logits written and read back, the 16-bit
    gradient written and read by dgrad and wgrad). With C ~ 4 H the weight's side adds
    (4 x 2 + 10) V H / (4 H) = 4.5 V per row, 0.32 of the rows' own traffic, where chunks
    of ~H rows whose logits were one part (the previous rule) added 12 V, 0.86. The
    memory it costs is the chunk's buffers, 3 C V bytes (its 16-bit gradient, 2 C V, and
    one part's fp32 logits, C V), 3x the fp32 weight-gradient sum (4 V H) the pass holds
    anyway at C ~ 4 H (the previous rule: 1.5x). V cancels out of both, so it does not move
    the rule.

    The quarter bounds the memory against the logits the pass never makes: the chunk's
    largest tensor, its 16-bit gradient, is at most 1/8 of all the rows' fp32 logits
    (from 256 rows up; below, :data:`MIN_CHUNK_ROWS`), one part's fp32 logits 1/16. It
    binds only on batches of fewer than 16 H rows, at a price on the weight's side: Llama
    3 8B (4096 into 128256) at 8192 tokens takes 4 chunks of 2048 rows, 0.8 GB of buffers
    where one chunk of 8192 held 3.2 GB, and its weight side moves 37.8 GB where one chunk
    moved 9.5 (``chunk_size=8192`` takes that trade back). GPT-2 small (16384 tokens of 768
    into 50257, the step ledger): 4096 rows, 4 chunks of 4 logits parts of 1024 rows; the
    LM head's GEMMs and loss move 14.8 GB where chunks of 1024 rows moved 19.6 GB, for 630
    MB of chunk buffers instead of 322 MB."""
    rows = LOGITS_SPLIT << round(math.log2(max(in_features, 1)))
    quarter = 1 << (max(n_rows // LOGITS_SPLIT, 1).bit_length() - 1)
    rows = max(min(rows, quarter), MIN_CHUNK_ROWS)
    return max(1, min(rows, 1 << max(n_rows - 1, 0).bit_length()))


def logits_rows(chunk: int) -> int:
    """Rows per logits part of a ``chunk``-row chunk: ``chunk / LOGITS_SPLIT`` (rounded
    up), but at least :data:`MIN_PART_ROWS` (a chunk of at most that many rows in one part)."""
    return max(-(-chunk // LOGITS_SPLIT), min(chunk, MIN_PART_ROWS))


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
    ``b``: per chunk its logits in :func:`logits_rows` parts (fp32, one reused buffer),
    each part through the kernel into its rows of the chunk's gradient (a reused buffer of
    the input's dtype), then the chunk's dgrad and wgrad from that gradient.

    With 16-bit operands and neither label smoothing nor softcap, the forward's logits GEMM
    also writes each row's softmax statistics per 32 columns (``ROW_STATS``, a reused
    (rows, V / 32, 2) fp32 buffer, 1/4 of a logits row's bytes), from which the kernel takes
    the lse: it reads each chunk's fp32 logits once, not twice (GPT-2 small: 3.3 GB a step
    fewer)."""

    def __init__(
        self, x: Tensor, w: Tensor, b: Tensor | None, target: Tensor, weight: Tensor | None, opts: LossOptions
    ) -> None:
        self.x, self.w, self.b, self.target, self.weight, self.opts = x, w, b, target, weight, opts
        n, v = x.shape[0], w.shape[0]
        self.chunk = min(opts.chunk, n)  # a chunk_size above the rows: one chunk of them all, in parts
        self.part = logits_rows(self.chunk)
        self.logits = torch.empty(self.part, v, dtype=torch.float32, device=x.device)
        self.grad = None
        fusable = x.dtype in HALF_DTYPES and opts.smoothing == 0 and opts.softcap is None
        slots = row_stats_slots(v)
        self.stats = None
        if fusable:
            self.stats = torch.empty(self.part, slots, 2, dtype=torch.float32, device=x.device)

    def spans(self) -> list[tuple[int, int]]:
        """The chunks' ``[s, e)`` row spans."""
        n, chunk = self.x.shape[0], self.opts.chunk
        return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

    def parts(self, s: int, e: int) -> list[tuple[int, int]]:
        """The logits parts' ``[a, b)`` row spans of the chunk ``[s, e)``."""
        return [(a, min(a + self.part, e)) for a in range(s, e, self.part)]

    def logits_of(self, s: int, e: int, stats: Tensor | None = None) -> Tensor:
        """Rows ``[s, e)``'s fp32 logits (at most one part's rows); with ``stats`` (a slice of
        ``self.stats``) their softmax statistics written beside them by the same GEMM."""
        out = self.logits[: e - s]
        if stats is None:
            _mm_into(self.x[s:e], self.w.t(), self.b, out, False)
        else:
            matmul_row_stats_prechecked(self.x[s:e], self.w.t(), self.b, out, stats)
        return out

    def grad_buffer(self, rows: int) -> Tensor:
        """The first ``rows`` rows of the chunk's logit-gradient buffer (made on first use)."""
        if self.grad is None:
            self.grad = torch.empty(self.chunk, self.w.shape[0], dtype=self.x.dtype, device=self.x.device)
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
            for ps, pe in self.parts(s, e):
                stats = None if self.stats is None else self.stats[: pe - ps]
                cross_entropy_forward(
                    self.logits_of(ps, pe, stats),
                    self.target[ps:pe],
                    self.weight,
                    ignore_index=o.ignore_index,
                    label_smoothing=o.smoothing,
                    softcap=o.softcap,
                    grad=None if grad is None else grad[ps - s : pe - s],
                    a=a if want else None,
                    q=q if want else None,
                    check_target=False,
                    loss_out=rows[ps:pe],
                    lse_out=lses[ps:pe],
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
            grad = self.grad_buffer(e - s)
            for ps, pe in self.parts(s, e):
                cross_entropy_backward(
                    self.logits_of(ps, pe),
                    self.target[ps:pe],
                    lse[ps:pe],
                    grad_rows[ps:pe],
                    None if grad_lse is None else grad_lse[ps:pe],
                    self.weight,
                    ignore_index=o.ignore_index,
                    label_smoothing=o.smoothing,
                    softcap=o.softcap,
                    grad=grad[ps - s : pe - s],
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
