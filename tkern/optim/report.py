"""What a fused optimizer allocates: :func:`memory_report`, behind
:meth:`tkern.optim.FusedOptimizer.memory_report`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OverflowReport", "memory_report", "overflow_report", "param_name"]


def memory_report(opt: Any) -> dict[str, Any]:
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
    where FSDP2 is in a mode that forbids that, ``alias_fallback`` says why and
    ``fsdp_storage`` counts FSDP2's own copy of the shards (in ``total``; 0 otherwise).
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
    sizes = dict.fromkeys(("param", "grad", "master", "state", "fsdp_storage"), 0)
    for flats in opt.flat_buffers:
        for flat in flats:
            if not flat.storage.owns_storage and not flat.aliased:
                sizes["fsdp_storage"] += sum(flat.numels) * flat.param.element_size()
                report["alias_fallback"] = report["alias_fallback"] or flat.alias_fallback
            report["numel"] += sum(flat.numels)
            report["padded_numel"] += flat.param.numel()
            for k, v in flat.nbytes().items():
                sizes[k] += v
    report.update(sizes)
    report["total"] = sum(sizes.values())
    numel = report["numel"]
    report["bytes_per_param"] = report["total"] / numel if numel else 0.0
    report["per_param"] = {k: v / numel if numel else 0.0 for k, v in sizes.items()}
    return report


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
    """

    step: int
    skipped: bool
    nonfinite: list[str]
    last_overflow: dict[str, int]


def param_name(names: dict[tuple[int, int], str], group: int, index: int, p: torch.Tensor) -> str:
    """A param's name: the one given for (group, index in group), else its place and shape."""
    return names.get((group, index)) or f"group {group} param {index} {tuple(p.shape)}"


def overflow_report(
    step: int,
    stats: torch.Tensor | None,
    tracked: list[tuple[Any, torch.Tensor]],
    names: dict[tuple[int, int], str],
    stamp: int,
) -> OverflowReport:
    """The report of ``tracked`` ((flat buffer, its (P,) int32 flags) pairs: a flag
    holds the stamp of the last step whose gradient of that param was non-finite),
    read from the device in one copy. ``stamp`` is the last step's."""
    parts = [flags.to(torch.int64) for _, flags in tracked]
    if stats is not None:
        parts.append(stats[:1].to(torch.int64))
    values = torch.cat(parts).tolist() if parts else []  # the one device -> host copy
    skipped = bool(values[-1]) if stats is not None else False
    nonfinite, last = [], {}
    at = 0
    for flat, flags in tracked:
        for i, p in enumerate(flat.params):
            s = values[at + i]
            if s:
                name = param_name(names, flat.group, flat.indices[i], p)
                last[name] = step - (stamp - s) % (2**31 - 1)
                if s == stamp:
                    nonfinite.append(name)
        at += flags.numel()
    return OverflowReport(step=step, skipped=skipped, nonfinite=nonfinite, last_overflow=last)
