"""The arithmetic of a flat buffer: where each param lies, which part is this rank's
shard, and the mode checks, messages and bit tricks every flat buffer shares (see
:mod:`tkern.flat`, "Layout" and "Shards")."""

from __future__ import annotations

import itertools

import torch

from tkern.kernels._update import MASTER_MODES, STATE_DTYPES

#: Every param, launch range and shard starts on a multiple of this many elements
#: (of QBLOCK = 256 in a buffer with block-quantized uint8 state: whole blocks).
ALIGN = 16


def check_modes(master: str, state_dtype: torch.dtype, param_dtype: torch.dtype | None = None) -> None:
    """Raise ``ValueError`` naming the argument unless ``master`` and ``state_dtype``
    are modes a flat buffer of ``param_dtype`` params can keep."""
    if master not in MASTER_MODES:
        raise ValueError(f'master must be "fp32", "split" or "none", got {master!r}')
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be torch.float32, torch.bfloat16 or torch.uint8, got {state_dtype!r}"
        )
    if master == "split" and param_dtype == torch.float16:
        raise ValueError(
            'master="split" keeps the fp32 master as a bf16 param plus 16 low bits: it needs bf16 '
            'params, got float16 (use master="fp32", or bf16 params)'
        )


def describe_param(group: int, index: int, p: torch.Tensor) -> str:
    """How error messages name a parameter: its group, index, shape and dtype."""
    return f"param {index} of param group {group} (shape {tuple(p.shape)}, dtype {p.dtype})"


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 master as ``(param, remainder)``: the bf16 param (the master rounded to
    nearest, ties away from zero) and the int16 remainder with
    ``master == join_master(param, remainder)`` bit for bit (the update kernels'
    ``store_master`` in split mode, on the host)."""
    bits = master.contiguous().view(torch.int32)
    rounded = (bits + 0x8000) & -65536
    return (rounded >> 16).to(torch.int16).view(torch.bfloat16), (bits - rounded).to(torch.int16)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 ``param`` and its int16 ``remainder`` hold (a new tensor)."""
    high = param.contiguous().view(torch.int16).to(torch.int32)
    return ((high << 16) + remainder.to(torch.int32)).view(torch.float32)


def alias(flat: torch.Tensor, start: int, numel: int, shape: torch.Size) -> torch.Tensor:
    """``flat[start:start + numel]`` shaped ``shape``, as a tensor with a storage of its own
    over the same memory (it keeps ``flat`` alive)."""
    return torch.from_dlpack(flat.narrow(0, start, numel).detach()).view(shape)


class FlatLayout:
    """Where each of a flat buffer's params lies, and this rank's shard of it.

    Args:
        shapes: each param's shape in the buffer, in order.
        align: every param starts on a multiple of this many elements.
        world_size, rank: the buffer splits into ``world_size`` equal shards of whole
            ``align`` blocks; this rank keeps shard ``rank``.
        slots: elements to reserve for each param, if more than its own (the rest zeros).

    Attributes:
        shapes, numels: each param's shape and element count in the buffer.
        offsets: ``offsets[i]`` is where param i starts; ``offsets[-1]`` where the last ends.
        total: the buffer's length (a multiple of ``align * world_size``).
        shard_size: ``total // world_size``.
        lo, hi: this rank's shard, ``[lo, hi)`` in buffer coordinates.
    """

    def __init__(
        self, shapes: list[torch.Size], align: int, world_size: int, rank: int, slots: list[int] | None = None
    ) -> None:
        #: Each param's shape in the buffer (its local shard's, for params held elsewhere).
        self.shapes = shapes
        self.numels = [s.numel() for s in shapes]
        # a slot may reserve more than the param (FSDP2's padded shard, whose padding stays zero)
        reserve = self.numels if slots is None else list(map(max, self.numels, slots))
        self.offsets = [0, *itertools.accumulate(round_up(n, align) for n in reserve)]
        self.world_size, self.rank = world_size, rank
        self.total = round_up(self.offsets[-1], align * world_size)
        self.shard_size = self.total // world_size
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size

    def param_alias(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Param ``i``'s slot of the full-size buffer ``flat``, shaped like the param,
        as an :func:`alias` (a storage of its own)."""
        return alias(flat, self.offsets[i], self.numels[i], self.shapes[i])

    def shard_view(self, buf: torch.Tensor, i: int) -> torch.Tensor | None:
        """Param ``i``'s part of a shard-sized buffer (master or state), shaped
        like the param; None unless the param lies wholly in this rank's shard."""
        s = self.offsets[i]
        if s < self.lo or s + self.numels[i] > self.hi:
            return None
        return buf[s - self.lo : s - self.lo + self.numels[i]].view(self.shapes[i])

    def copy_into_shard(self, buf: torch.Tensor, i: int, value: torch.Tensor) -> None:
        """Copy the part of param ``i``'s full-size ``value`` that lies in this rank's
        shard into the shard-sized buffer ``buf`` (all of it when unsharded)."""
        s = self.offsets[i]
        a, b = max(s, self.lo), min(s + self.numels[i], self.hi)
        if b > a:
            buf[a - self.lo : b - self.lo].copy_(value.reshape(-1)[a - s : b - s])

    def ranges(self, active: list[bool], cohort: list[int]) -> list[tuple[int, int, int]]:
        """The launch ranges ``(start, end, cohort)`` of the ``active`` params: runs of
        neighbours in one cohort, clipped to this rank's shard."""
        runs: list[list[int]] = []  # [start, end, cohort]
        for i, on in enumerate(active):
            if not on:
                continue
            start, end, c = self.offsets[i], self.offsets[i + 1], cohort[i]
            if runs and runs[-1][1] == start and runs[-1][2] == c:
                runs[-1][1] = end
            else:
                runs.append([start, end, c])
        if runs and runs[-1][1] == self.offsets[-1]:
            runs[-1][1] = self.total  # the tail padding rides along
        out = []
        for start, end, c in runs:
            s, e = max(start, self.lo), min(end, self.hi)
            # an empty run of an unsharded buffer (params whose local shards are empty on this
            # rank) still counts the step: no launch, but every rank's step counts agree
            if e > s or (self.world_size == 1 and e == s):
                out.append((s, e, c))
        return out
