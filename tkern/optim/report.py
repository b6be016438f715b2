"""What a fused optimizer allocates: :func:`memory_report`, behind
:meth:`tkern.optim.FusedOptimizer.memory_report`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "SUBNORMAL_WARN",
    "MemoryReport",
    "OverflowReport",
    "memory_report",
    "overflow_report",
    "param_name",
]

#: :meth:`OverflowReport.scale_too_low`'s threshold: the fraction of a tensor's gradient
#: that, subnormal in its 16-bit dtype at a sampled step, makes the loss scale likely too low.
SUBNORMAL_WARN = 0.01


_MIB = 2**20


class MemoryReport(dict):
    """What ``memory_report()`` returns (the optimizer's and :meth:`tkern.Trainer.memory_report`):
    a dict whose byte counts are ints in bytes, under the keys :attr:`byte_keys` names, beside
    other entries (counts, modes, bytes per param). ``str()`` (so ``print``) gives one line per
    entry, byte counts in MiB with the bytes beside them::

        param            0.02 MiB (16640 B)
        ...
        bytes_per_param  16.00 B/param

    Args:
        entries: the report's entries, in the order they print.
        byte_keys: which of them are byte counts.
    """

    def __init__(self, entries: dict[str, Any], byte_keys: tuple[str, ...]) -> None:
        super().__init__(entries)
        #: The keys whose values are byte counts (ints, in bytes).
        self.byte_keys = byte_keys

    def __str__(self) -> str:
        width = max(map(len, self), default=0)
        lines = []
        for key, value in self.items():
            if key in self.byte_keys:
                text = f"{value / _MIB:.2f} MiB ({value} B)"
            elif key == "bytes_per_param":
                text = f"{value:.2f} B/param"
            elif key == "per_param":
                text = ", ".join(f"{k} {v:.2f}" for k, v in value.items()) + " B/param"
            else:
                text = str(value)
            lines.append(f"{key:<{width}}  {text}")
        return "\n".join(lines)

    def __reduce__(self) -> tuple:
        return (MemoryReport, (dict(self), self.byte_keys))


#: The optimizer report's byte counts (:func:`memory_report`).
OPTIMIZER_BYTES = ("param", "grad", "master", "state", "fsdp_storage", "graph_pool", "total")


def memory_report(opt: Any) -> MemoryReport:
    """What the optimizer allocates (on this rank), in bytes.

    ``param`` and ``grad`` are the flat buffers the model's params and
    gradients live in (full size on every rank); ``master`` (half-precision
    params only: fp32 params are their own master; 2 B/param for a split
    master, 0 for none) and ``state`` (with the 8-bit state's block absmax)
    cover this rank's shard. ``numel`` counts the params' elements;
    ``padded_numel`` the flat buffers' slots: each param is padded to a
    multiple of 16 elements (256 with uint8 state) and each buffer to a
    multiple of that times ``world_size``. ``bytes_per_param`` is
    ``total / numel`` and ``per_param`` each buffer's share: for AdamW on
    bf16 params 16 (fp32 master and state), 14 (split master), 10 (uint8
    moments), 8 (split + uint8), 6 (none + uint8), plus padding and 4/256 B
    of absmax per 8-bit element; sharded over W ranks, master and state
    divide by W. Not counted: the step-count tensors (4 B per run of params
    with one step count) and what a step allocates while it runs (the
    statistics; for the sharded optimizers the reduce-scatter's staging).
    Over FSDP2's DTensor params every buffer covers this rank's local shards
    (``numel`` counts their elements, so ``bytes_per_param`` is per param per rank:
    times ``world_size``, FSDP2's mesh size, it is per param of the model; under HSDP
    ``world_size`` and ``rank`` are the shard dim's, and each replica holds those bytes). The param
    buffer is FSDP2's shard storage itself (:func:`tkern.optim.fsdp.fsdp_shard_storage`);
    where FSDP2 is in a mode that forbids that, ``alias_fallback`` says why.
    ``fsdp_storage`` counts the storage FSDP2 holds for the shards besides the flat buffers
    (in ``total``): read from FSDP2's tensors and the tensors they are views of
    (:func:`tkern.optim.fsdp.fsdp_storage_bytes`), so 0 where the buffer is its storage, and
    its padded copy of the shards on the copy path. ``graph_pool`` is the memory the step's
    CUDA graph holds of its own (its private pool; the optimizer's ``graph_pool_bytes`` where it
    reports one, else 0). A :class:`MemoryReport`: every byte count in bytes; ``print`` gives MiB.
    """
    group = opt.shard_group
    if group is None:  # FSDP2's params: the mesh they are sharded over
        group = next(
            (f.storage.stats_group for fs in opt.flat_buffers for f in fs if f.storage.stats_group), None
        )
    report: dict[str, Any] = {
        "world_size": 1 if group is None else torch.distributed.get_world_size(group),
        "rank": 0 if group is None else torch.distributed.get_rank(group),
        "master_mode": opt.master,
        "state_dtype": opt.state_dtype,
        "numel": 0,
        "padded_numel": 0,
        "alias_fallback": None,
    }
    sizes = dict.fromkeys(OPTIMIZER_BYTES[:-1], 0)
    held: dict[int, int] = {}  # the owner's storages outside the flat buffers, by address
    for flats in opt.flat_buffers:
        for flat in flats:
            held.update(flat.storage.held_bytes(flat.params, flat.param))
            if not flat.storage.owns_storage and not flat.aliased:
                report["alias_fallback"] = report["alias_fallback"] or flat.alias_fallback
            report["numel"] += sum(flat.numels)
            report["padded_numel"] += flat.param.numel()
            for k, v in flat.nbytes().items():
                sizes[k] += v
    sizes["fsdp_storage"] = sum(held.values())
    sizes["graph_pool"] = int(getattr(opt, "graph_pool_bytes", 0))
    report.update(sizes)
    report["total"] = sum(sizes.values())
    numel = report["numel"]
    report["bytes_per_param"] = report["total"] / numel if numel else 0.0
    report["per_param"] = {k: v / numel if numel else 0.0 for k, v in sizes.items()}
    return MemoryReport(report, OPTIMIZER_BYTES)


@dataclass(frozen=True)
class OverflowReport:
    """What :meth:`tkern.optim.FusedOptimizer.overflow_report` returns.

    Attributes:
        step: how many times ``step()`` has run (the last step's number; 0 before any).
        skipped: whether that step was skipped (a gradient held inf or nan, the
            loss scaler reported an overflow, or another rank's gradients did).
        nonfinite: the names of the tensors whose gradients held inf or nan in that
            step (empty when the step was skipped for a reason outside this rank's
            gradients, or was replayed from a CUDA graph, where nothing is recorded).
        last_overflow: name -> the number of the last step in which that tensor's
            gradient held inf or nan, for every tensor that ever did (this rank's).
        sampled_step: the number of the last step whose gradients were sampled for
            zeros and subnormals (:meth:`~tkern.optim.FusedOptimizer.track_underflows`),
            or None (none sampled yet, or sampling off). The fields below are that step's.
        zero_fraction: name -> the fraction of that tensor's gradient (as stored: scaled,
            in its 16-bit dtype; this rank's part of it) that was exactly zero.
        subnormal_fraction: name -> the fraction that was subnormal: nonzero and below the
            dtype's smallest normal (fp16: 2^-14 = 6.1035e-05; bf16 and fp32: 2^-126).
        sampled_skipped: whether the sampled step was skipped.
        sampled_scale: the loss scale the sampled step's gradients carried (1 / its inv_scale).
        headroom: how many times larger the sampled step's largest gradient could have been
            (as stored) before it overflowed the smallest-range dtype of the sampled
            gradients (inf when they were all zero): the factor the scale could grow by.
    """

    step: int
    skipped: bool
    nonfinite: list[str]
    last_overflow: dict[str, int]
    sampled_step: int | None = None
    zero_fraction: dict[str, float] = field(default_factory=dict)
    subnormal_fraction: dict[str, float] = field(default_factory=dict)
    sampled_skipped: bool = False
    sampled_scale: float | None = None
    headroom: float | None = None

    def scale_too_low(self, threshold: float = SUBNORMAL_WARN) -> list[str]:
        """The tensors whose gradients say the loss scale is likely too low, from the last
        sampled step: the step was not skipped, at least ``threshold`` (default 1%) of the
        tensor's gradient was subnormal in its 16-bit dtype (its values had lost precision,
        and the ones below the subnormals, flushed to zero, are lost), and the scale could
        have doubled without any gradient overflowing (``headroom >= 2``), which would have
        moved them up a binade. Zeros are reported but do not count: an exact zero is most
        often structural (an embedding row no token of the batch used, a dead ReLU unit)
        and no scale changes it. Empty when no step was sampled (and so for bf16
        gradients, whose range is fp32's, in practice always)."""
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if self.sampled_step is None or self.sampled_skipped or not (self.headroom or 0.0) >= 2.0:
            return []
        return [name for name, f in self.subnormal_fraction.items() if f >= threshold]


def param_name(names: dict[tuple[int, int], str], group: int, index: int, p: torch.Tensor) -> str:
    """A param's name: the one given for (group, index in group), else its place and shape."""
    return names.get((group, index)) or f"group {group} param {index} {tuple(p.shape)}"


def overflow_report(
    step: int,
    stats: torch.Tensor | None,
    tracked: list[tuple[Any, torch.Tensor]],
    names: dict[tuple[int, int], str],
    stamp: int,
    sampled: tuple[int, torch.Tensor, list[tuple[Any, torch.Tensor]]] | None = None,
) -> OverflowReport:
    """The report of ``tracked`` ((flat buffer, its (P,) int32 flags) pairs: a flag
    holds the stamp of the last step whose gradient of that param was non-finite) and
    of ``sampled`` (the sampled step's number, its (4,) fp32 statistics and inv_scale,
    and (flat buffer, its (P, N_COUNTS) int64 underflow counts) pairs), read from the
    device in one copy. ``stamp`` is the last step's."""
    from tkern.kernels.overflow import AMAX, COUNTED, FOUND_INF, N_COUNTS, N_STATS, SUBNORMALS, ZEROS

    parts = [flags for _, flags in tracked]
    if stats is not None:
        parts.append(stats[:1])
    if sampled is not None:
        parts += [sampled[1], *(counts.view(-1) for _, counts in sampled[2])]
    # the one device -> host copy (float64 holds int32 flags and counts below 2^53 exactly)
    values = torch.cat([p.to(torch.float64) for p in parts]).tolist() if parts else []
    at = 0
    nonfinite, last = [], {}
    for flat, flags in tracked:
        for i, p in enumerate(flat.params):
            s = int(values[at + i])
            if s:
                name = param_name(names, flat.group, flat.indices[i], p)
                last[name] = step - (stamp - s) % (2**31 - 1)
                if s == stamp:
                    nonfinite.append(name)
        at += flags.numel()
    skipped = False
    if stats is not None:
        skipped, at = bool(values[at]), at + 1
    if sampled is None:
        return OverflowReport(step=step, skipped=skipped, nonfinite=nonfinite, last_overflow=last)
    meta, at = values[at : at + N_STATS + 1], at + N_STATS + 1
    zeros, subnormals = {}, {}
    for flat, counts in sampled[2]:
        for i, p in enumerate(flat.params):
            row = values[at + i * N_COUNTS : at + (i + 1) * N_COUNTS]
            if row[COUNTED]:
                name = param_name(names, flat.group, flat.indices[i], p)
                zeros[name] = row[ZEROS] / row[COUNTED]
                subnormals[name] = row[SUBNORMALS] / row[COUNTED]
        at += counts.numel()
    inv_scale, amax = meta[N_STATS], meta[AMAX]
    limit = min((torch.finfo(flat.dtype).max for flat, _ in sampled[2]), default=math.inf)
    largest = amax / inv_scale if inv_scale else math.inf  # the largest gradient as stored
    return OverflowReport(
        step=step,
        skipped=skipped,
        nonfinite=nonfinite,
        last_overflow=last,
        sampled_step=sampled[0],
        zero_fraction=zeros,
        subnormal_fraction=subnormals,
        sampled_skipped=bool(meta[FOUND_INF]),
        sampled_scale=1.0 / inv_scale if inv_scale else math.inf,
        headroom=limit / largest if largest else math.inf,
    )
