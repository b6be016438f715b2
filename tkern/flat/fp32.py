"""A flat buffer's master and state in fp32, whatever their compact form: the
conversions a checkpoint in torch's fp32 format reads and writes
(:mod:`tkern.optim.state`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tkern.flat.layout import join_master, split_master
from tkern.kernels._update import SIGNED_STATE, state_from_fp32, state_to_fp32


class Fp32Views:
    """Mixin of :class:`~tkern.flat.FlatParams`: its master (fp32, split or none) and
    its state buffers (fp32, bf16 or block-quantized uint8) read and written in fp32.
    It uses only the buffer's public attributes (declared here) and its
    :meth:`~tkern.flat.FlatParams.mark_dirty`."""

    master_mode: str
    param: torch.Tensor
    master: torch.Tensor | None
    state: dict[str, torch.Tensor]
    absmax: dict[str, torch.Tensor]
    lo: int
    hi: int

    @property
    def keeps_master(self) -> bool:
        """Whether a master is kept beside the params (fp32 or split)."""
        return self.master_mode in ("fp32", "split")

    def master_fp32(self) -> torch.Tensor | None:
        """This shard's fp32 master: the live buffer (fp32 master, or fp32 params'
        own shard), a rebuilt copy (split), or None (no master)."""
        if self.master_mode == "split":
            return join_master(self.param[self.lo : self.hi], self.master)
        return self.master

    def set_master_fp32(self, values: torch.Tensor) -> None:
        """Store ``values`` (this shard's fp32 master) as the master; the params are
        never changed. An fp32 master is then reconciled with the params before the
        next step (see :meth:`mark_dirty`; loading one before or after the model
        gives the same run); a split master keeps the values' remainders (the
        master is exact where a param is the value rounded, and always rounds to
        its param). Nothing for fp32 params or no master."""
        with torch.no_grad():
            if self.master_mode == "fp32":
                if values is not self.master:
                    self.master.copy_(values)
                self.mark_dirty()
            elif self.master_mode == "split":
                self.master.copy_(split_master(values)[1])

    def state_fp32(self, name: str) -> torch.Tensor:
        """This shard's state ``name`` in fp32: the live buffer if it is fp32, else a
        converted copy."""
        buf = self.state[name]
        if buf.dtype == torch.float32:
            return buf
        return state_to_fp32(buf, self.absmax.get(name), name in SIGNED_STATE)

    def set_state_fp32(self, name: str, values: torch.Tensor) -> None:
        """Store this shard's fp32 ``values`` as state ``name`` (rounded or quantized
        as the update kernel stores it)."""
        buf = self.state[name]
        if values is not buf:
            state_from_fp32(values.contiguous(), buf, self.absmax.get(name), name in SIGNED_STATE)

    def export_fp32(
        self, gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The master (fp32 or split; not fp32 params' own nor none) and every state
        buffer in fp32: this shard's, or with ``gather`` (a function from a shard
        buffer to the full buffer of every rank's shards, in rank order) the whole
        buffer's. Buffers kept in fp32 come back as they are (live, when not gathered)."""
        g = gather if gather is not None else (lambda t: t)
        out: dict[str, torch.Tensor] = {}
        if self.master_mode == "fp32":
            out["master"] = g(self.master)
        elif self.master_mode == "split":
            low = g(self.master)
            param = self.param if low.numel() == self.param.numel() else self.param[self.lo : self.hi]
            out["master"] = join_master(param, low)
        for name, buf in self.state.items():
            if buf.dtype == torch.float32:
                out[name] = g(buf)
            else:
                out[name] = state_to_fp32(g(buf), g(self.absmax[name]) if name in self.absmax else None,
                                          name in SIGNED_STATE)  # fmt: skip
        return out
