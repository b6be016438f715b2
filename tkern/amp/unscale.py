"""A loss scaler's own unscale-and-check path, for optimizers other than tkern's fused
ones: gradients divided by S in place, checked for inf/nan, their statistics combined
over ``process_group`` (whole gradients) or over their mesh (FSDP2's DTensor shards)."""

from __future__ import annotations

from typing import Any

import torch

from tkern.kernels.overflow import AMAX, FOUND_INF, N_STATS, SUMSQ, combine_stats, reduce_stats
from tkern.optim.fsdp import split_by_mesh

__all__ = ["local_stats", "unscale_grads", "unscaled_stats"]


def unscale_grads(
    params: list[torch.Tensor], inv_scale: torch.Tensor, device: torch.device
) -> dict[Any, torch.Tensor]:
    """Multiply every ``p.grad`` of ``params`` by ``inv_scale`` in place (sparse ones
    coalesced first, replacing ``.grad``) and flag inf/nan: ``{group -> (1,) found_inf}``,
    one per process group the gradients' statistics are combined over (None: whole
    gradients; a mesh's :class:`~tkern.optim.fsdp.MeshGroups`: FSDP2's local shards)."""
    found: dict[Any, torch.Tensor] = {}
    with torch.no_grad():
        grads = []
        for p in params:
            g = p.grad
            if g.is_sparse:
                # coalesce: duplicate indices summed, so that the check and
                # the statistics see the gradient's true values
                if not g.is_coalesced():
                    p.grad = g = g.coalesce()
                g = g._values()
            grads.append(g)
        for key, local in split_by_mesh(grads).items():  # FSDP2's DTensors: their local shards
            found[key] = torch.zeros(1, dtype=torch.float32, device=device)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in local:
                by_dtype.setdefault(g.dtype, []).append(g)
            for group in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, found[key], inv_scale)
    return found


def unscaled_stats(
    optimizer: torch.optim.Optimizer, found: dict[Any, torch.Tensor], process_group: Any
) -> torch.Tensor:
    """The (N_STATS,) statistics of ``optimizer``'s gradients, already unscaled by
    :func:`unscale_grads` (``found``: its result): whole gradients combined over
    ``process_group`` (max), FSDP2's shards summed over their mesh by every rank,
    empty shards included (HSDP's: summed over the shard dim, agreed on over the replicate dim)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    values = [g._values() if g.is_sparse else g for g in grads]
    with torch.no_grad():
        parts = [
            combine_stats(local_stats(local, found[key]), process_group)
            if key is None
            else key.combine(local_stats(local, found[key]))
            for key, local in split_by_mesh(values).items()
        ]
        return parts[0] if len(parts) == 1 else reduce_stats(torch.stack(parts))


def local_stats(values: list[torch.Tensor], found: torch.Tensor) -> torch.Tensor:
    """(N_STATS,) fp32 ``[found, sum of squares, max |g|]`` of unscaled gradients, accumulated
    in fp32 without copies (on an overflowing step they are inf/nan, but that step is skipped
    and the scalers do not read them then); empty tensors count for nothing."""
    stats = torch.zeros(N_STATS, dtype=torch.float32, device=found.device)
    stats[FOUND_INF] = found[0]
    values = [v for v in values if v.numel() > 0]
    if values:
        norm = torch.linalg.vector_norm
        stats[AMAX] = torch.stack([norm(v, float("inf"), dtype=torch.float32) for v in values]).max()
        stats[SUMSQ] = torch.stack([norm(v, 2, dtype=torch.float32) ** 2 for v in values]).sum()
    return stats
