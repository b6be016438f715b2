"""The trainer's checkpoints: one file with everything a run needs to continue the
same trajectory (model, optimizer, scaler, scheduler, counters, history, RNG states),
or, for an FSDP2 model, a ``torch.distributed.checkpoint`` folder of every rank's shards.

:class:`CheckpointMixin` is :class:`tkern.Trainer`'s ``save_checkpoint`` and
``load_checkpoint``; the file's own rules (format, digest, validation, atomic writes)
live in :mod:`tkern.train.checkpoint`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tkern.amp import LossScaler
from tkern.graphs import StepGraphs
from tkern.train import checkpoint

__all__ = ["CheckpointMixin", "is_fsdp2"]


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``torch.distributed.fsdp.fully_shard`` wrapped ``model`` or a submodule."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


class CheckpointMixin:
    """Saving and restoring a :class:`tkern.Trainer`'s whole state.

    Reads and sets the trainer's ``model``, ``optimizer``, ``scaler``, ``scheduler``,
    ``epoch``, ``step``, ``history`` and ``epochs``, and resets its ``graphs`` on a load.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | torch.amp.GradScaler | None
    scheduler: Any
    epoch: int
    step: int
    history: list[dict[str, float]]
    epochs: list[dict[str, float]]
    graphs: StepGraphs | None
    device: torch.device

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save model, optimizer (fp32 master and state), scaler, scheduler,
        epoch, step, history and RNG states.

        The file is written to a temporary file in the same folder, synced
        and renamed over ``path``, so an interrupted save never replaces a
        good checkpoint; temporary files that killed saves left behind are
        removed. A symbolic link is followed: its target is rewritten and the
        link kept. A new file gets the permissions the umask allows (0644
        under 022); an existing one keeps its own. The payload carries a
        SHA-256 digest that :meth:`load_checkpoint` checks (the file's rules live
        in :mod:`tkern.train.checkpoint`), and loads with
        ``torch.load(path, weights_only=True)``. A failed write (a full disk)
        raises ``OSError`` naming ``path``.

        With a sharded optimizer (:class:`~tkern.optim.DistributedFusedAdamW`
        and its kin) this is a collective: every rank of the optimizer's process
        group must call it (it gathers the full optimizer state and every rank's
        RNG state), rank 0 of the group writes the file, the others do not, and
        no rank returns before the file is complete; a failed write raises on
        every rank (``OSError`` naming ``path``). The history saved is rank 0's
        (each rank's losses are those of its own micro-batches).

        With an FSDP2 model (``fully_shard``) ``path`` is a folder written by
        ``torch.distributed.checkpoint`` (see :meth:`_distributed_state`): every
        rank calls it and writes its own shards, and it loads at another world size.
        """
        if is_fsdp2(self.model):
            import torch.distributed.checkpoint as dcp

            dcp.save(self._distributed_state(), checkpoint_id=os.fspath(path))
            return
        group, _, world = checkpoint.shard_group_of(self.optimizer)
        payload = self._payload(group, world)  # a collective with a sharded optimizer
        checkpoint.save(payload, path, group, self._write_checkpoint)

    def _distributed_state(self) -> dict[str, Any]:
        """What ``torch.distributed.checkpoint`` saves for an FSDP2 model: the model's
        and the optimizer's sharded state dicts (``get_state_dict``: DTensors, each
        rank its shards) and the trainer's own state (one pickled object: scaler,
        scheduler, epoch, step, rank 0's history, every rank's RNG state). A collective."""
        import io

        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        rng: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rng, checkpoint.rng_state())
        own = {
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "epoch": self.epoch, "step": self.step, "history": self.history, "epochs": self.epochs,
            "rng_ranks": rng,
        }  # fmt: skip
        shared = [own]
        dist.broadcast_object_list(shared, src=0)  # one object for DCP to keep: rank 0's history
        buffer = io.BytesIO()
        torch.save(shared[0], buffer)
        buffer.seek(0)
        return {"model": model, "optimizer": optimizer, "trainer": buffer}

    def _load_distributed(self, path: str) -> None:
        """:meth:`load_checkpoint` of an FSDP2 model (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._distributed_state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        buffer = state["trainer"]
        buffer.seek(0)
        own = torch.load(buffer, weights_only=True)
        if self.scaler is not None and own["scaler"] is not None:
            self.scaler.load_state_dict(own["scaler"])
        if self.scheduler is not None and own["scheduler"] is not None:
            self.scheduler.load_state_dict(own["scheduler"])
        self.epoch, self.step = own["epoch"], own["step"]
        self.history, self.epochs = own["history"], own["epochs"]
        ranks = own["rng_ranks"]
        rank = dist.get_rank()
        checkpoint.set_rng_state(ranks[rank] if len(ranks) == dist.get_world_size() else ranks[0])

    def _write_checkpoint(self, payload: dict[str, Any], path: str) -> None:
        checkpoint.write_atomic(payload, path)

    def _payload(self, group: Any, world: int) -> dict[str, Any]:
        """The checkpoint's contents with its digest. With a process group every
        rank's RNG state is gathered too (``rng_ranks``): ranks may draw different
        shuffles and dropout masks."""
        payload: dict[str, Any] = {
            "format": checkpoint.CHECKPOINT_FORMAT,
            "version": checkpoint.CHECKPOINT_VERSION,
            "model": self.model.state_dict(),
            "optimizer_class": type(self.optimizer).__name__,
            "optimizer": self.optimizer.state_dict(),
            "scaler_class": None if self.scaler is None else type(self.scaler).__name__,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "scheduler_class": None if self.scheduler is None else type(self.scheduler).__name__,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
            "epochs": self.epochs,
            "rng": checkpoint.rng_state(),
        }
        if group is not None:
            ranks: list[Any] = [None] * world
            dist.all_gather_object(ranks, payload["rng"], group=group)
            payload["rng_ranks"] = ranks
        payload["sha256"] = checkpoint.digest(payload)  # also checks that weights_only can load every entry
        return payload

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; ``fit`` then
        continues the same trajectory.

        The file is read with ``torch.load(weights_only=True)`` and its
        SHA-256 digest checked; then everything is validated (the model's
        keys and shapes, the optimizer's class and groups, the scaler's and
        the scheduler's presence, class and contents) before anything is
        changed: a bad checkpoint raises :class:`CheckpointError` (a
        ``ValueError``) and leaves the trainer as it was.

        With a sharded optimizer every rank calls it and reads the whole file;
        the optimizer keeps its shard of the full state (so a checkpoint saved
        at one world size, or by the single-process optimizer of the same kind,
        resumes at another: ``FusedAdamW`` and ``DistributedFusedAdamW``
        checkpoints load into each other). Each rank restores its own RNG state
        when the checkpoint was saved by as many ranks, else rank 0's.

        With an FSDP2 model ``path`` is the folder :meth:`save_checkpoint` wrote
        through ``torch.distributed.checkpoint`` (``dcp.load``, then
        ``set_state_dict``); every rank calls it. That path does not pre-validate:
        a folder that does not fit the model raises DCP's own error.
        """
        if is_fsdp2(self.model):
            self._load_distributed(os.fspath(path))
            return
        payload = checkpoint.read(path, map_location=self.device)
        checkpoint.validate(
            payload,
            os.fspath(path),
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            scheduler=self.scheduler,
        )
        # validated: nothing above changed the trainer
        if self.graphs is not None:  # the loads below may put state at new addresses
            self.graphs.reset()
        self.optimizer.load_state_dict(payload["optimizer"])
        self.model.load_state_dict(payload["model"])
        if self.scaler is not None:
            self.scaler.load_state_dict(payload["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        self.epoch, self.step = payload["epoch"], payload["step"]
        self.history, self.epochs = payload["history"], payload["epochs"]
        rng = payload["rng"]
        group, rank, world = checkpoint.shard_group_of(self.optimizer)
        ranks = payload.get("rng_ranks")
        if group is not None and isinstance(ranks, list) and len(ranks) == world:
            rng = ranks[rank]
        checkpoint.set_rng_state(rng)
