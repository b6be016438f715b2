"""How a flat buffer holds its params: as their memory (the default, :data:`OWNED`),
or over memory that belongs to someone else (FSDP2's local shards: pointed into the
buffer, or copied; see :mod:`tkern.flat`, "Storage the buffer does not own")."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

#: What :meth:`ParamStorage.shared_slots` offers: each param's slot size (elements), and
#: the function that points the owner's storage at the slots (1-D views of the flat buffer).
SharedSlots = tuple[list[int], Callable[[list[torch.Tensor]], None]]

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

    def shared_slots(self, params: list[torch.Tensor]) -> SharedSlots | str | None:
        """For storage the buffer does not own: the slots through which the owner's
        storage of ``params`` can become the flat buffer itself (no copy), or why it
        cannot (a message; the buffer then holds a copy). None here: nothing to share."""
        return None

    def held_bytes(self, params: list[torch.Tensor], buffer: torch.Tensor) -> dict[int, int]:
        """The storages the params' owner keeps for ``params`` besides ``buffer`` (the flat
        param buffer), address -> bytes (so that buffers that share one are counted once):
        none here, where the params are views of the buffer."""
        return {}

    def versions(self, params: list[torch.Tensor]) -> list:
        """What moves when ``params`` are written in place (the next step then copies
        them in and reconciles the master): their version counters here."""
        return list(map(_VERSION, params))


#: The storage of plain params.
OWNED = ParamStorage()
