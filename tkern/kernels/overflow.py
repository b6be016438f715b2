"""Pass 1 of an optimizer step: one read of the flat gradients.

Produces the step's statistics vector ``stats`` (3 fp32 values on the device):

* ``stats[FOUND_INF]``: 1.0 if any gradient is inf or nan, or if ``inv_scale``
  itself is (a step must then change nothing), else 0.0;
* ``stats[SUMSQ]``: sum of squares of the finite unscaled gradients ``g * inv_scale``;
* ``stats[AMAX]``: max |g * inv_scale| over the finite gradients.

Each program of :func:`_grad_stats_kernel` writes one row of partial results;
:func:`_finalize_stats_kernel` reduces the rows in a fixed order. No float
atomics, so the sums (and so every clipped update) are bit-reproducible.

The update kernels read ``stats`` through :func:`grad_factor`, so this file is
the one place that knows its layout.

Which tensors overflowed (opt-in per launch: :class:`OverflowFlags`): a program
whose share held a non-finite gradient reads that share again (only then: a
step that overflows is skipped anyway); in each chunk of BLOCK elements that
held one it finds the first param the chunk overlaps (a scalar binary search of
the params' start offsets) and, for each param the chunk overlaps, stores the
step's number into that param's slot of a small int32 buffer if one of its
elements there is inf or nan. No extra launch and no extra pass on the steps
that do not overflow; the compiled kernel's registers rise (sm_90: 38 to 54,
occupancy 75% to 50%) for the rare path's code.

How many gradients underflow (:func:`grad_underflow`, a launch of its own on the
steps the optimizer samples): per param, the elements of the gradients as stored
(scaled, in their 16-bit dtype) that are exactly zero, that are subnormal (compared
as bits against the dtype's smallest normal, so no flush-to-zero hides them), and
how many were counted, added into a small int64 buffer with integer atomics (exact
in any order), using the same params' start offsets as the overflow flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tkern.kernels._common import INTERPRET, aligned_slices, cdiv, check_tensor
from tkern.kernels.grid_sync import grid_barrier

FOUND_INF: int = 0
SUMSQ: int = 1
AMAX: int = 2
N_STATS: int = 3

#: Elements per program per loop iteration (interpreter: few, large programs).
#: 2048 over 8 warps: 8 values per thread, one 16-byte load of halves; at 4096
#: the three running vectors took 70-80 registers and occupancy fell to 37.5%.
BLOCK = 65536 if INTERPRET else 2048
#: At most this many programs per launch, each looping over its share; enough
#: to fill every SM of an H100/H200 several times, few enough that the final
#: reduction over the partial rows costs next to nothing.
MAX_PROGRAMS = 4 if INTERPRET else 1024
#: Rows the finalize reduces per iteration. A width no other vector of pass 1 or of the
#: update kernels has (their BLOCKs: 2048, 1024): the compiler gives tensors connected
#: through one ``tl.arange`` one layout, so with 1024 the one-pass kernel summed the rows
#: in its update tiles' layout (4 per thread), not the finalize's (1): another order.
_FINALIZE_BLOCK = 512
_ROWS_BLOCK: tl.constexpr = tl.constexpr(_FINALIZE_BLOCK)

# The same offsets, visible inside @triton.jit functions.
_FOUND_INF: tl.constexpr = tl.constexpr(FOUND_INF)
_SUMSQ: tl.constexpr = tl.constexpr(SUMSQ)
_AMAX: tl.constexpr = tl.constexpr(AMAX)
_N_STATS: tl.constexpr = tl.constexpr(N_STATS)
_NUM_WARPS = 8
#: Warps of pass 1's launches (both kernels): the one-pass step launches with as many, so that
#: its reductions (the same code, :func:`one_pass_stats`) lay out and sum their vectors alike.
NUM_WARPS = _NUM_WARPS


@triton.jit
def _param_at(starts_ptr, x, n_params, search_steps):
    """The param whose slot holds element ``x`` (in ``starts_ptr``'s coordinates: (n_params,)
    int64 ascending slot starts, starts[0] <= x): the last j with starts[j] <= x, found by
    ``search_steps`` halvings of [0, n_params) (invariant: starts[lo] <= x < starts[hi])."""
    lo = 0
    hi = n_params
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        if tl.load(starts_ptr + mid) <= x:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _store_row(grad_ptr, n, inv_scale, partials_ptr, pid, nprog, BLOCK: tl.constexpr):
    """Row ``pid`` (an int64) of the partial statistics (of ``nprog``): the elements of (n,) ``grad_ptr``
    in chunks ``pid, pid + nprog, ...`` of BLOCK, stored at ``partials_ptr + pid * N_STATS``.
    Returns its non-finite flag. Pass 1's programs and the one-pass step
    (:func:`one_pass_stats`) share it, so their rows are the same bits."""
    nonfinite = tl.zeros((BLOCK,), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK,), dtype=tl.float32)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        g = tl.load(grad_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        # x != x is NaN; |x| == inf is +-inf (libdevice isnan/isinf are not interpretable).
        bad = (g != g) | (tl.abs(g) == float("inf"))
        nonfinite = tl.maximum(nonfinite, bad.to(tl.float32))
        g = tl.where(bad, 0.0, g) * inv_scale
        sumsq += g * g
        amax = tl.maximum(amax, tl.abs(g))
    row = partials_ptr + pid * _N_STATS
    any_bad = tl.max(nonfinite, axis=0)
    tl.store(row + _FOUND_INF, any_bad)
    tl.store(row + _SUMSQ, tl.sum(sumsq, axis=0))
    tl.store(row + _AMAX, tl.max(amax, axis=0))
    return any_bad


# the step's number and where a range lies change every step: one compiled variant for all
@triton.jit(do_not_specialize=["n_params", "base", "stamp", "search_steps"])
def _grad_stats_kernel(
    grad_ptr,  # (n,) fp16/bf16/fp32 gradients, scaled by the loss scale
    n,
    inv_scale_ptr,  # (1,) fp32: 1 / loss scale
    partials_ptr,  # (num_programs, N_STATS) fp32: this launch's rows
    starts_ptr,  # (n_params,) int64: where each param starts, in grad_ptr's coordinates + base
    flags_ptr,  # (n_params,) int32: a param with a non-finite gradient gets ``stamp``
    n_params,
    base,  # where grad_ptr[0] lies in the coordinates of starts_ptr
    stamp,  # int32 > 0: this step's number
    search_steps,  # iterations of the binary search: n_params.bit_length()
    BLOCK: tl.constexpr,
    TRACK: tl.constexpr,  # False: the last six arguments are not read
):
    """Pass 1 over n gradients: each program writes its row of partial statistics
    (non-finite flag, sum of squares, max |g| of g * inv_scale). Shapes above.
    With TRACK, a program that met a non-finite gradient also marks the params
    it lay in (see the module docstring)."""
    pid = tl.program_id(0).to(tl.int64)  # int64: buffers may hold 2^31 elements or more
    nprog = tl.num_programs(0)
    # reduced and stored before the rare path, so its loop holds no BLOCK-wide accumulators
    # (held across it, they spilled 16 B on sm_90 under triton 3.6)
    any_bad = _store_row(grad_ptr, n, tl.load(inv_scale_ptr), partials_ptr, pid, nprog, BLOCK)
    if TRACK:  # noqa: SIM102 (a constexpr: Triton compiles the branch away)
        if any_bad != 0.0:  # rare: read this program's share again, marking the params
            # chunk by chunk, as the main loop (full-width loads); in a chunk that held one, each
            # param the chunk overlaps (the first found by a scalar binary search) is checked
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                rel = tl.arange(0, BLOCK)
                offs = start + rel
                g = tl.load(grad_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
                bad = (g != g) | (tl.abs(g) == float("inf"))
                if tl.max(bad.to(tl.int32), axis=0) != 0:
                    bad_at = tl.where(bad, rel, -1)  # where in the chunk; -1: a finite one
                    x0 = start + base  # the chunk's first element, in starts' coordinates
                    j = _param_at(starts_ptr, x0, n_params, search_steps)
                    at = tl.load(starts_ptr + j) - x0  # param j's start, relative to the chunk
                    while (j < n_params) & (at < BLOCK):
                        end = tl.load(starts_ptr + j + 1, mask=j + 1 < n_params, other=BLOCK + x0) - x0
                        inside = (bad_at >= tl.maximum(at, 0)) & (bad_at < end)
                        hit = tl.max(inside.to(tl.int32), axis=0)
                        tl.store(flags_ptr + j, stamp, mask=hit != 0)
                        j += 1
                        at = end


@triton.jit
def _finalize_stats_kernel(
    partials_ptr,  # (n_rows, N_STATS) fp32
    n_rows,
    inv_scale_ptr,  # (1,) fp32: a non-finite 1 / loss scale is an overflow too
    stats_ptr,  # (N_STATS,) fp32 output
    BLOCK: tl.constexpr,
):
    """Reduce the n_rows partial rows in a fixed order into the (N_STATS,) statistics
    (bit-reproducible: no float atomics)."""
    _reduce_rows(partials_ptr, n_rows, inv_scale_ptr, stats_ptr, 0.0, BLOCK)


@triton.jit
def _reduce_rows(partials_ptr, n_rows, inv_scale_ptr, stats_ptr, found, BLOCK: tl.constexpr):
    """The finalize's reduction (shapes as :func:`_finalize_stats_kernel`'s), ``found`` (0 or
    1: an overflow reported from elsewhere) maxed into found_inf; shared with the one-pass
    step so that both reduce the rows in one order."""
    nonfinite = tl.zeros((BLOCK,), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK,), dtype=tl.float32)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < n_rows
        row = partials_ptr + rows * _N_STATS
        nonfinite = tl.maximum(nonfinite, tl.load(row + _FOUND_INF, mask=mask, other=0.0))
        sumsq += tl.load(row + _SUMSQ, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.load(row + _AMAX, mask=mask, other=0.0))
    inv_scale = tl.load(inv_scale_ptr)
    bad_scale = ((inv_scale != inv_scale) | (tl.abs(inv_scale) == float("inf"))).to(tl.float32)
    tl.store(stats_ptr + _FOUND_INF, tl.maximum(tl.maximum(tl.max(nonfinite, axis=0), bad_scale), found))
    tl.store(stats_ptr + _SUMSQ, tl.sum(sumsq, axis=0))
    tl.store(stats_ptr + _AMAX, tl.max(amax, axis=0))


def _aligned_pieces(g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    runs = aligned_slices(g.numel())
    return tuple(g[s] for s in runs) if len(runs) == 2 else (g,)


def _programs_for(n: int) -> int:
    return max(1, min(cdiv(n, BLOCK), MAX_PROGRAMS))


def stats_rows(n: int) -> int:
    """How many partial rows :func:`grad_stats` writes for a 1-D gradient of ``n`` elements
    whose length is a multiple of 16 (one piece): the ``n_rows`` a one-pass step
    (:func:`one_pass_stats`) gives its statistics, so that they are the same bits."""
    return _programs_for(n)


@dataclass(frozen=True)
class OverflowFlags:
    """Where :func:`grad_stats` records which params of one gradient tensor overflowed.

    Attributes:
        starts: (P,) int64 on the gradients' device, ascending: where each of P
            params starts (params lie back to back; padding between them is finite).
        flags: (P,) int32: param i's slot is set to ``stamp`` when an element of
            the gradient in ``[starts[i], starts[i + 1])`` is inf or nan, and left
            as it was otherwise.
        base: where the gradient tensor's element 0 lies in ``starts``' coordinates.
    """

    starts: torch.Tensor
    flags: torch.Tensor
    base: int = 0


def grad_stats(
    grads: list[torch.Tensor],
    inv_scale: torch.Tensor,
    track: list[OverflowFlags | None] | None = None,
    stamp: int = 1,
) -> torch.Tensor:
    """Statistics of all of ``grads`` together: one launch per tensor plus one
    tiny reduction, no host synchronization.

    Args:
        grads: 1-D contiguous fp16/bf16/fp32 tensors (flat gradient buffers or
            slices of them), all on one device.
        inv_scale: (1,) fp32 tensor on that device, 1 / loss scale; nan or inf
            there reports an overflow (``found_inf`` = 1), so the step is skipped.
        track: None, or one :class:`OverflowFlags` (or None) per tensor of
            ``grads``: where to mark the params whose gradients hold inf or nan.
        stamp: the value marked params get (an int in [1, 2**31)).

    Returns:
        A new (3,) fp32 tensor: ``[found_inf, sum of squares, max |g|]`` of the
        unscaled gradients (see the module docstring).
    """
    check_tensor("inv_scale", inv_scale, dtypes=(torch.float32,))
    if inv_scale.numel() != 1:
        raise ValueError(f"inv_scale must hold one value, got shape {tuple(inv_scale.shape)}")
    for i, g in enumerate(grads):
        check_tensor(f"grads[{i}]", g, ndim=1, dtypes=(torch.float16, torch.bfloat16, torch.float32))
        if not g.is_contiguous() or g.device != inv_scale.device:
            raise ValueError(f"grads[{i}] must be contiguous and on {inv_scale.device}")
    if track is None:
        track = [None] * len(grads)
    if len(track) != len(grads):
        raise ValueError(f"track must hold one entry per gradient ({len(grads)}), got {len(track)}")
    if isinstance(stamp, bool) or not isinstance(stamp, int) or not 0 < stamp < 2**31:
        raise ValueError(f"stamp must be an int in [1, 2**31), got {stamp!r}")
    for i, t in enumerate(track):
        if t is not None:
            check_tensor(f"track[{i}].starts", t.starts, ndim=1, dtypes=(torch.int64,))
            check_tensor(f"track[{i}].flags", t.flags, ndim=1, dtypes=(torch.int32,))
            if t.starts.numel() != t.flags.numel() or not t.starts.numel():
                raise ValueError(f"track[{i}]: starts and flags must be one non-empty length")
    # A length that is not a multiple of 16 would make every load scalar: its
    # last n % 16 elements get a launch of their own.
    pieces = []
    for g, t in zip(grads, track, strict=True):
        at = 0
        for piece in _aligned_pieces(g):
            pieces.append((piece, t, 0 if t is None else t.base + at))
            at += piece.numel()
    programs = [_programs_for(g.numel()) for g, _, _ in pieces]
    partials = torch.zeros((max(1, sum(programs)), N_STATS), dtype=torch.float32, device=inv_scale.device)
    row = 0
    for (g, t, base), p in zip(pieces, programs, strict=True):
        if g.numel():
            # untracked: the flag arguments are not read (partials stands in for their pointers)
            starts, flags, n_params = (
                (partials, partials, 0) if t is None else (t.starts, t.flags, t.flags.numel())
            )
            _grad_stats_kernel[(p,)](
                g, g.numel(), inv_scale, partials[row : row + p],
                starts, flags, n_params, base, stamp, n_params.bit_length(),
                BLOCK=BLOCK, TRACK=t is not None, num_warps=_NUM_WARPS,
            )  # fmt: skip
        row += p
    stats = torch.empty(N_STATS, dtype=torch.float32, device=inv_scale.device)
    _finalize_stats_kernel[(1,)](
        partials, partials.shape[0], inv_scale, stats, BLOCK=_FINALIZE_BLOCK, num_warps=_NUM_WARPS
    )
    return stats


@triton.jit
def one_pass_stats(
    grad_ptr, n, n_rows, inv_scale_ptr, found_ptr, partials_ptr, stats_ptr, barrier_ptr,
    HAS_FOUND: tl.constexpr, GRID: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Pass 1 inside the update's launch (a one-pass step, whose update then reads
    ``stats_ptr``): the statistics of (n,) ``grad_ptr`` as :func:`grad_stats` computes them
    for a length that is a multiple of 16, bit for bit -- the same ``n_rows`` rows
    (:func:`stats_rows`) written by the same code (:func:`_store_row`) into (n_rows, N_STATS)
    ``partials_ptr``, reduced by the finalize's code into (N_STATS,) ``stats_ptr``, with (1,)
    ``found_ptr`` (a GradScaler's found_inf, read when HAS_FOUND) maxed into found_inf as the
    optimizer does after pass 1. Launch with :data:`NUM_WARPS` warps and BLOCK =
    :data:`BLOCK`: the vectors then have the layouts (and so the summation trees) of pass 1's
    launches.

    One program (GRID False) writes every row; with GRID, program q of P writes rows q,
    q + P, ..., all meet at :func:`tkern.kernels.grid_sync.grid_barrier` (``barrier_ptr``, its
    workspace), and then every program reduces all the rows, in the same fixed order, and
    stores the same bits into ``stats_ptr``: no float atomics, so the statistics (the clip's
    norm) are deterministic and pass 1's. Barriers order the rows and the statistics before
    the program reads them back."""
    inv_scale = tl.load(inv_scale_ptr)
    if GRID:
        first = tl.program_id(0).to(tl.int64)  # the rows' numbers as int64, as pass 1's program ids
        for r in range(first, n_rows, tl.num_programs(0)):
            _store_row(grad_ptr, n, inv_scale, partials_ptr, r, n_rows, BLOCK)
        grid_barrier(barrier_ptr, GRID)  # every program's rows stored before any reduction reads them
    else:
        first = tl.full((), 0, tl.int64)
        for r in range(0, n_rows):
            _store_row(grad_ptr, n, inv_scale, partials_ptr, first + r, n_rows, BLOCK)
        tl.debug_barrier()  # every row stored before the reduction reads them
    found = 0.0
    if HAS_FOUND:
        found = tl.load(found_ptr)
    _reduce_rows(partials_ptr, n_rows, inv_scale_ptr, stats_ptr, found, _ROWS_BLOCK)
    tl.debug_barrier()  # the statistics stored before the update reads them


@triton.jit
def grad_factor(stats_ptr, inv_scale_ptr, max_grad_norm, CLIP: tl.constexpr):
    """What the update kernels multiply each gradient by: ``inv_scale`` times
    torch's ``clip_grad_norm_`` coefficient ``min(1, max_norm / (norm + 1e-6))``."""
    factor = tl.load(inv_scale_ptr)
    if CLIP:
        norm = tl.sqrt(tl.load(stats_ptr + _SUMSQ))
        factor = factor * tl.minimum(max_grad_norm / (norm + 1e-6), 1.0)
    return factor


@triton.jit
def found_inf(stats_ptr):
    """True when the step must be skipped."""
    return tl.load(stats_ptr + _FOUND_INF) != 0.0


@triton.jit
def grad_amax(stats_ptr):
    """max |g * inv_scale| over the finite gradients."""
    return tl.load(stats_ptr + _AMAX)


# ----------------------------------------------------------------------------- underflow

#: Columns of an :class:`UnderflowCounts` row: elements exactly zero, elements subnormal
#: (nonzero, below the dtype's smallest normal), elements counted.
ZEROS: int = 0
SUBNORMALS: int = 1
COUNTED: int = 2
N_COUNTS: int = 3
#: The bit pattern of each gradient dtype's smallest normal magnitude: a gradient whose
#: magnitude bits are nonzero and below it is subnormal (fp16: 2^-14 = 6.1035e-05; bf16
#: and fp32: 2^-126 = 1.1755e-38). Compared as integers, so no flush-to-zero can hide them.
MIN_NORMAL_BITS: dict[torch.dtype, int] = {
    torch.float16: 0x0400,
    torch.bfloat16: 0x0080,
    torch.float32: 0x0080_0000,
}
_ZEROS: tl.constexpr = tl.constexpr(ZEROS)
_SUBNORMALS: tl.constexpr = tl.constexpr(SUBNORMALS)
_COUNTED: tl.constexpr = tl.constexpr(COUNTED)
_N_COUNTS: tl.constexpr = tl.constexpr(N_COUNTS)
#: the slot end of the last param: past any share
_NO_END: tl.constexpr = tl.constexpr(2**62)


# where a share lies changes with the tensor: one compiled variant for all
@triton.jit(do_not_specialize=["n_params", "base", "search_steps", "chunks"])
def _grad_underflow_kernel(
    grad_ptr,  # (n,) fp16/bf16/fp32 gradients as stored (scaled by the loss scale)
    n,
    starts_ptr,  # (n_params,) int64, ascending: where each param's slot starts (grad_ptr's coords + base)
    ends_ptr,  # (n_params,) int64: where each param's elements end (its slot's padding after them)
    counts_ptr,  # (n_params, N_COUNTS) int64: each param's zeros, subnormals and counted elements, added to
    n_params,
    base,  # where grad_ptr[0] lies in the coordinates of starts_ptr and ends_ptr
    search_steps,  # iterations of the binary search: n_params.bit_length()
    chunks,  # chunks of BLOCK elements per program
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,  # the gradient dtype's width: 16 or 32
    MIN_NORMAL: tl.constexpr,  # the bits of its smallest normal magnitude (MIN_NORMAL_BITS)
):
    """Count, per param, the gradient elements of this program's share (``chunks`` chunks
    of BLOCK from ``pid * chunks * BLOCK``) that are exactly zero and that are subnormal,
    and add them (with the number counted) to that param's row of ``counts_ptr`` (shapes
    above). The share is read chunk by chunk; a param's counts stay in one BLOCK-wide
    vector (zeros in the low 16 bits, subnormals in the high: a lane sees one element per
    chunk, far fewer than 2^15 per share) while the chunks lie in it, and are reduced and
    added (integer atomics: exact, in any order) when its slot ends or the share does;
    its slot's padding is not counted."""
    pid = tl.program_id(0).to(tl.int64)  # int64: buffers may hold 2^31 elements or more
    lo = pid * chunks * BLOCK  # a multiple of BLOCK: the loads stay full-width vectors
    hi = tl.minimum(lo + chunks * BLOCK, n)
    x0 = lo + base  # the share's first element, in starts' coordinates
    j = _param_at(starts_ptr, x0, n_params, search_steps)
    first = tl.load(starts_ptr + j) - base  # param j's elements: [first, last), relative to grad_ptr
    last = tl.load(ends_ptr + j) - base
    # where param j's slot ends (the last param's: never, within this share)
    nxt = tl.load(starts_ptr + j + 1, mask=j + 1 < n_params, other=_NO_END) - base
    packed = tl.zeros((BLOCK,), dtype=tl.int32)  # zeros + subnormals << 16, per lane
    # lanes as int32 offsets within the chunk, compared with bounds clamped to [0, BLOCK] (the
    # same comparisons as on int64 element offsets: 8 fewer 64-bit values a thread, so ptxas
    # keeps the kernel under its 40-register occupancy step instead of spilling to reach it)
    lanes = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        # 1.0 past n: neither zero nor subnormal
        g = tl.load(grad_ptr + start + lanes, mask=lanes < _in_chunk(n, start, BLOCK), other=1.0)
        if BITS == 16:
            mag = g.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
        else:
            mag = g.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        # 1 for a zero, 1 << 16 for a subnormal
        hit = tl.where(mag == 0, 1, tl.where(mag < MIN_NORMAL, 1 << 16, 0))
        chunk_end = tl.minimum(start + BLOCK, hi)
        while nxt <= chunk_end:  # param j's slot ends in this chunk: its counts are complete here
            packed += tl.where(_lanes_in(lanes, first, last, start, BLOCK), hit, 0)
            _add_counts(counts_ptr + j * _N_COUNTS, packed, first, last, lo, hi)
            packed = tl.zeros((BLOCK,), dtype=tl.int32)
            j += 1
            first = nxt
            last = tl.load(ends_ptr + j) - base
            nxt = tl.load(starts_ptr + j + 1, mask=j + 1 < n_params, other=_NO_END) - base
        packed += tl.where(_lanes_in(lanes, first, last, start, BLOCK), hit, 0)
    # the param the share ends in (its slot goes on past the share, or is the last one)
    _add_counts(counts_ptr + j * _N_COUNTS, packed, first, last, lo, hi)


@triton.jit
def _in_chunk(bound, start, BLOCK: tl.constexpr):
    """``bound`` (an element offset) relative to a chunk starting at ``start``, clamped to
    [0, BLOCK] as int32: ``lane < result`` exactly where ``start + lane < bound``."""
    return tl.minimum(tl.maximum(bound - start, 0), BLOCK).to(tl.int32)


@triton.jit
def _lanes_in(lanes, first, last, start, BLOCK: tl.constexpr):
    """Which lanes of the chunk at ``start`` hold elements ``[first, last)``."""
    return (lanes >= _in_chunk(first, start, BLOCK)) & (lanes < _in_chunk(last, start, BLOCK))


@triton.jit
def _add_counts(row_ptr, packed, first, last, lo, hi):
    """Add one param's counts (``packed``: zeros + subnormals << 16 per lane) and the number
    of its elements ``[first, last)`` in the share ``[lo, hi)`` to its row; nothing when none."""
    counted = tl.maximum(tl.minimum(last, hi) - tl.maximum(first, lo), 0)
    # both counts in one reduction, zeros in the low 32 bits and subnormals in the high (each
    # sum stays below 2^31: BLOCK lanes of under 2^15); two tl.sum kept more values live across
    # the share's loop (8 B spilled on sm_100 under triton 3.9, at ptxas's 40-register step)
    wide = packed.to(tl.int64)
    both = tl.sum((wide & 0xFFFF) | ((wide >> 16) << 32), axis=0)
    zeros = both & 0xFFFFFFFF
    subnormals = both >> 32
    tl.atomic_add(row_ptr + _ZEROS, zeros, mask=counted > 0, sem="relaxed")
    tl.atomic_add(row_ptr + _SUBNORMALS, subnormals, mask=counted > 0, sem="relaxed")
    tl.atomic_add(row_ptr + _COUNTED, counted.to(tl.int64), mask=counted > 0, sem="relaxed")


@dataclass(frozen=True)
class UnderflowCounts:
    """Where :func:`grad_underflow` adds the counts of one gradient tensor's params.

    Attributes:
        starts: (P,) int64 on the gradients' device, ascending: where each of P params'
            slots starts (the same offsets as :class:`OverflowFlags`).
        ends: (P,) int64: where each param's elements end (``starts[i] + numel``; the
            slot's padding, up to ``starts[i + 1]``, is not counted).
        counts: (P, N_COUNTS) int64, contiguous: row i gets param i's zeros, subnormals
            and counted elements added.
        base: where the gradient tensor's element 0 lies in ``starts``' coordinates.
    """

    starts: torch.Tensor
    ends: torch.Tensor
    counts: torch.Tensor
    base: int = 0


def grad_underflow(grads: list[torch.Tensor], into: list[UnderflowCounts]) -> None:
    """Count, per param, the elements of ``grads`` (as stored: the 16-bit gradients
    before unscaling) that are exactly zero and that are subnormal in their dtype, and
    add them to ``into``: one launch per tensor, no host synchronization.

    Args:
        grads: 1-D contiguous fp16/bf16/fp32 tensors (flat gradient buffers or slices of
            them), all on one device.
        into: one :class:`UnderflowCounts` per tensor of ``grads``.
    """
    if len(into) != len(grads):
        raise ValueError(f"into must hold one entry per gradient ({len(grads)}), got {len(into)}")
    for i, (g, c) in enumerate(zip(grads, into, strict=True)):
        check_tensor(f"grads[{i}]", g, ndim=1, dtypes=tuple(MIN_NORMAL_BITS))
        check_tensor(f"into[{i}].starts", c.starts, ndim=1, dtypes=(torch.int64,))
        check_tensor(f"into[{i}].ends", c.ends, ndim=1, dtypes=(torch.int64,))
        check_tensor(f"into[{i}].counts", c.counts, ndim=2, dtypes=(torch.int64,))
        p = c.starts.numel()
        if not p or c.ends.shape != (p,) or c.counts.shape != (p, N_COUNTS):
            raise ValueError(
                f"into[{i}]: starts and ends must be (P,) and counts (P, {N_COUNTS}) with P > 0, got "
                f"{tuple(c.starts.shape)}, {tuple(c.ends.shape)}, {tuple(c.counts.shape)}"
            )
        if not g.is_contiguous() or not c.counts.is_contiguous():
            raise ValueError(f"grads[{i}] and into[{i}].counts must be contiguous")
        if any(t.device != g.device for t in (c.starts, c.ends, c.counts)) or g.device != grads[0].device:
            raise ValueError(f"grads[{i}] and into[{i}]'s tensors must all be on {grads[0].device}")
        if isinstance(c.base, bool) or not isinstance(c.base, int) or c.base < 0:
            raise ValueError(f"into[{i}].base must be an int >= 0, got {c.base!r}")
    for g, c in zip(grads, into, strict=True):
        at = 0
        for piece in _aligned_pieces(g):  # a ragged tail gets a launch of its own
            n = piece.numel()
            if n:
                chunks = cdiv(n, BLOCK)
                per_program = cdiv(chunks, min(chunks, MAX_PROGRAMS))
                p = c.starts.numel()
                _grad_underflow_kernel[(cdiv(chunks, per_program),)](
                    piece, n, c.starts, c.ends, c.counts, p, c.base + at, p.bit_length(), per_program,
                    BLOCK=BLOCK, BITS=8 * piece.element_size(), MIN_NORMAL=MIN_NORMAL_BITS[piece.dtype],
                    num_warps=_NUM_WARPS,
                )  # fmt: skip
            at += n


def combine_stats(stats: torch.Tensor, group=None, *, sharded: bool = False) -> torch.Tensor:
    """The statistics every rank of ``group`` steps with; the one place that
    knows how ranks combine them.

    Args:
        stats: (N_STATS,) fp32 statistics of this rank's gradients.
        group: a torch.distributed process group, or None (single process:
            ``stats`` is returned as it is).
        sharded: False when every rank read the same (replicated) gradients:
            the ranks agree on the elementwise max, in place. True when each
            rank read its own shard (ZeRO-2): one all-gather of the (W, N_STATS)
            rows, reduced in rank order (found_inf and max|g| by max, the sum
            of squares summed), so every rank computes bit-identical values.

    Returns:
        (N_STATS,) fp32 statistics, identical on every rank.
    """
    if group is None:
        return stats
    if not sharded:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        return stats
    world = dist.get_world_size(group)
    if world == 1:
        return stats
    rows = torch.empty((world, N_STATS), dtype=torch.float32, device=stats.device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(rows.view(-1), stats, group=group)
    return reduce_stats(rows)


def reduce_stats(rows: torch.Tensor) -> torch.Tensor:
    """The statistics of the union of the gradients whose statistics are the rows of
    ``rows`` ((k, N_STATS) fp32; disjoint sets of gradients: ranks' shards, or sharded
    and whole params), reduced in row order: found_inf and max|g| by max, the sum of
    squares summed. A new (N_STATS,) tensor, no host synchronization."""
    out = torch.empty(N_STATS, dtype=torch.float32, device=rows.device)
    out[FOUND_INF] = rows[:, FOUND_INF].amax()
    out[SUMSQ] = rows[:, SUMSQ].sum()
    out[AMAX] = rows[:, AMAX].amax()
    return out
