"""What a fused optimizer allocates: :func:`memory_report`, behind
:meth:`tkern.optim.FusedOptimizer.memory_report`."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["memory_report"]


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
    (``numel`` counts their elements; ``world_size`` stays 1, tkern shards
    them no further); FSDP2's own storage of the shards is not counted.
    """
    group = opt.shard_group
    report: dict[str, Any] = {
        "world_size": 1 if group is None else torch.distributed.get_world_size(group),
        "rank": 0 if group is None else torch.distributed.get_rank(group),
        "master_mode": opt.master,
        "state_dtype": opt.state_dtype,
        "numel": 0,
        "padded_numel": 0,
    }
    sizes = dict.fromkeys(("param", "grad", "master", "state"), 0)
    for flats in opt.flat_buffers:
        for flat in flats:
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
