"""How a flat buffer holds its params: as their memory (the default, :data:`OWNED`),
or as a copy of memory that belongs to someone else (FSDP2's local shards; see
:mod:`tkern.flat`, "Storage the buffer does not own")."""

from __future__ import annotations

import operator

import torch

_VERSION = operator.attrgetter("_version")


class ParamStorage:
    """How a :class:`~tkern.flat.FlatParams` holds its params: this default makes each
    param's ``.data`` its view of the flat buffer (the buffer owns the memory)
    and its ``.grad`` the gradient view itself. A subclass describes params
    whose memory stays elsewhere (see "Storage the buffer does not own" in :mod:`tkern.flat`).

    Attributes:
        owns_storage: whether ``param.data`` becomes the flat view.
        stats_group: the process group over which the step's statistics of
            these params' gradients are summed (each rank holds a shard of
            them), or None (the gradients are whole on every rank).
    """

    owns_storage: bool = True
    stats_group: object = None

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the flat buffer holds for ``param`` (same shape, dtype and values)."""
        return param

    def wrap(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (shaped like :meth:`local`: the gradient view that becomes ``.grad``, a
        state entry in ``state_dict()``) as a tensor of ``param``'s kind: itself here."""
        return local

    def unwrap(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The part of ``value`` (shaped like ``param``: a ``.grad``, a loaded state entry)
        that the buffer holds, shaped like :meth:`local`: ``value`` itself here."""
        return value

    def versions(self, params: list[torch.Tensor]) -> list:
        """What moves when ``params`` are written in place (the next step then copies
        them in and reconciles the master): their version counters here."""
        return list(map(_VERSION, params))


#: The storage of plain params.
OWNED = ParamStorage()
