"""A thin trainer: the mixed-precision loop a user would otherwise write.

One optimizer step::

    out = model(x)                         # fp16 forward (tkern layers), or under autocast
    loss = loss_fn(out.float(), y) / k     # the loss in fp32, averaged over k micro-batches
    scaler.scale(loss).backward()          # k times (gradient accumulation)
    scaler.step(optimizer); scaler.update(); scheduler.step()

The loop itself never waits for the device: per-step metrics are kept as
device tensors and read once per epoch (and every ``log_every`` steps for the
progress bar).

The class is made of rooms, one concern each: the whole-step CUDA graph and the
``cuda_graph="auto"`` choice (:mod:`tkern.train.trainer_graph`), the epoch loop and
its overflow log (:mod:`tkern.train.trainer_epoch`), checkpoints
(:mod:`tkern.train.trainer_checkpoint`) and the memory report
(:mod:`tkern.train.trainer_memory`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from tkern.amp import LossScaler
from tkern.graphs import CudaGraphCapture, GraphCapture, StepGraphs
from tkern.optim import FusedOptimizer
from tkern.train.checkpoint import CheckpointError
from tkern.train.trainer_checkpoint import CheckpointMixin
from tkern.train.trainer_epoch import EpochMixin
from tkern.train.trainer_graph import (
    HOST_BOUND_SHARE,
    MAX_GRAPHS,
    OBSERVED_STEPS,
    WARMUP_STEPS,
    GraphMixin,
    graph_blocker,
    graph_stamp,
)
from tkern.train.trainer_memory import ActivationMeter, memory_report

__all__ = [
    "HOST_BOUND_SHARE",
    "MAX_GRAPHS",
    "OBSERVED_STEPS",
    "WARMUP_STEPS",
    "CheckpointError",
    "CudaGraphCapture",
    "GraphCapture",
    "StepGraphs",
    "Trainer",
    "graph_blocker",
    "graph_stamp",
]


class Trainer(GraphMixin, EpochMixin, CheckpointMixin):
    """Train ``model`` with ``optimizer`` on ``loss_fn``, in mixed precision.

    Args:
        model: the model, usually converted by :func:`tkern.convert_network`.
        optimizer: a tkern fused optimizer, or any ``torch.optim.Optimizer``.
        loss_fn: ``loss_fn(output.float(), target)`` -> scalar loss.
        scaler: a tkern loss scaler, a ``torch.amp.GradScaler``, or None.
        accumulation_steps: micro-batches per optimizer step (an epoch's last step
            takes what is left, its loss averaged over those).
        scheduler: an lr scheduler stepped after every optimizer step.
        autocast_dtype: run the forward under ``torch.autocast`` with this dtype
            (for the plain-torch AMP baseline); None for tkern models.
        progress: show a tqdm progress bar per epoch.
        log_every: optimizer steps between progress-bar refreshes (each reads
            the loss from the device once).
        callbacks: called as ``callback(trainer, epoch_metrics)`` after every epoch.
        cuda_graph: ``"auto"`` (the default), True or False: the whole step (gradients
            zeroed in place, forward, loss, scaled backward, scaler step and update,
            optimizer step) captured as a CUDA graph per batch shape and replayed
            (:class:`StepGraphs`), one launch per step instead of dozens. Needs parts
            that never wait for the device (a tkern fused optimizer with a tkern
            scaler or GradScaler, or a torch optimizer with ``capturable=True``),
            ``accumulation_steps=1`` and no scheduler; where :func:`graph_blocker`
            finds a reason it cannot, the trainer runs eager, exactly as
            ``cuda_graph=False`` (True warns once; ``"auto"`` logs it). True captures
            every batch shape after :data:`WARMUP_STEPS` warm-ups (up to
            :data:`MAX_GRAPHS`); ``"auto"`` captures a shape that came
            :data:`OBSERVED_STEPS` steps in a row, ran the same ops in them and is
            bound by the host (:mod:`tkern.train.trainer_graph` states the rule), and
            runs the others eager, saying which and why in :attr:`graph_status` and
            one log line per shape. With graphs possible the gradients are zeroed in
            place (never set to None) on every step, eager ones included. After a
            replay the host-side give-up check of a tkern scaler
            (``max_overflows_at_min``) and its update count do not run; eager steps
            keep them.
        graph_capture: the capture seam (default :class:`CudaGraphCapture`); not
            with ``cuda_graph=False``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scaler: LossScaler | torch.amp.GradScaler | None = None,
        *,
        accumulation_steps: int = 1,
        scheduler: Any = None,
        autocast_dtype: torch.dtype | None = None,
        progress: bool = True,
        log_every: int = 10,
        callbacks: Iterable[Callable[[Trainer, dict], None]] = (),
        cuda_graph: bool | str = "auto",
        graph_capture: GraphCapture | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
        if not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive int, got {log_every!r}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.accumulation_steps = accumulation_steps
        self.scheduler = scheduler
        self.autocast_dtype = autocast_dtype
        self.progress = progress
        self.log_every = log_every
        self.callbacks = list(callbacks)
        #: epochs and optimizer steps completed
        self.epoch = 0
        self.step = 0
        #: one dict per optimizer step: step, epoch, loss, scale
        self.history: list[dict[str, float]] = []
        #: one dict per epoch: epoch, train_loss, val_loss, val_accuracy, step_time_s, samples_per_s
        self.epochs: list[dict[str, float]] = []
        #: the bytes the first step's forward saved for backward (the CPU's activation figure)
        self._activations = ActivationMeter()
        self._init_graphs(cuda_graph, graph_capture, scheduler)
        if isinstance(optimizer, FusedOptimizer):  # overflow reports name the model's layers
            optimizer.name_params(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ steps

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output, under autocast when the trainer has an autocast dtype."""
        if self.autocast_dtype is None:
            return self.model(x)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.model(x)

    def _current_scale(self) -> torch.Tensor | None:
        """The scale as a device tensor (no sync), if the scaler has one."""
        if isinstance(self.scaler, LossScaler):
            return self.scaler.scale_tensor()
        if isinstance(self.scaler, torch.amp.GradScaler) and self.scaler.is_enabled():
            # GradScaler's public API has no sync-free getter (get_scale() waits for the
            # device); scale() of a one returns S as a device tensor, changing nothing.
            return self.scaler.scale(torch.ones((), device=self.device)).detach()
        return None

    def train_step(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], measure: bool = False
    ) -> torch.Tensor:
        """One optimizer step over ``micro_batches``; returns the mean loss (device
        tensor). With graphs, a step of one micro-batch goes through :attr:`graphs`."""
        self.model.train()
        if self.graphs is None:
            total = self._steps_through(micro_batches, set_to_none=True, measure=measure)
        elif len(micro_batches) == 1:
            x, y = (t.to(self.device, non_blocking=True) for t in micro_batches[0])
            total = self._one_batch_step(x, y, measure)
        else:  # in place, as the graphs: their gradient buffers must stay where they were captured
            total = self._steps_through(micro_batches, set_to_none=False, measure=measure)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        return total

    def _steps_through(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], set_to_none: bool, measure: bool
    ) -> torch.Tensor:
        """Zero the gradients, forward and scaled backward of every micro-batch, then
        the scaler's (or the optimizer's) step and update; the mean loss."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        total = None
        k = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._activations.measure(self.model) if measure and i == 0 else nullcontext():
                loss = self.loss_fn(self._forward(x).float(), y)
                if k > 1:  # one micro-batch: no division forward and backward (two launches)
                    loss = loss / k
            # a sharded optimizer reduces the gradients once, after the last micro-batch
            no_sync = getattr(self.optimizer, "no_sync", None)
            with no_sync() if no_sync is not None and i < k - 1 else nullcontext():
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return torch.zeros((), device=self.device) if total is None else total

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> dict[str, float]:
        """Mean loss and (for integer class targets) accuracy over ``loader``."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        n = 0
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            out = self._forward(x)
            loss_sum += self.loss_fn(out.float(), y) * len(y)
            if not y.is_floating_point() and out.dim() == 2:
                correct += (out.argmax(1) == y).sum()
            n += len(y)
        return {"val_loss": loss_sum.item() / max(n, 1), "val_accuracy": correct.item() / max(n, 1)}

    def fit(
        self,
        train_loader: Iterable,
        epochs: int,
        val_loader: Iterable | None = None,
        checkpoint_path: str | os.PathLike | None = None,
    ) -> list[dict[str, float]]:
        """Train until ``epochs`` epochs are done in all (a resumed trainer
        continues from its epoch), saving a checkpoint after each epoch if
        ``checkpoint_path`` is given. Returns the per-epoch metrics."""
        if not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative int, got {epochs!r}")
        while self.epoch < epochs:
            self._train_epoch(train_loader, epochs)
            metrics = self.epochs[-1]
            if val_loader is not None:
                metrics.update(self.evaluate(val_loader))
            for callback in self.callbacks:
                callback(self, metrics)
            if checkpoint_path is not None:
                self.save_checkpoint(checkpoint_path)
        return self.epochs

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for overflow so far (with a tkern scaler
        its exact count; with GradScaler, the number of scale decreases)."""
        if isinstance(self.scaler, LossScaler):
            return self.scaler.skipped_steps
        scales = [h["scale"] for h in self.history if h["scale"] is not None]
        return sum(1 for a, b in zip(scales, scales[1:], strict=False) if b < a)

    # ------------------------------------------------------------------ memory

    def memory_report(self) -> dict[str, int]:
        """Bytes used: ``model`` (params and buffers), ``optimizer`` (fp32
        master and state), ``grads``, ``graphs`` (the CUDA graphs' memory pools:
        the whole step's and the fused optimizer's step graph, :meth:`graph_bytes`),
        ``activations`` (peak on CUDA, from ``torch.cuda.max_memory_allocated``, less
        the rest, the graphs' pools by their allocated bytes; on CPU the tensors saved
        for backward in the first step's forward) and ``total``."""
        graphs = self.graph_usage()
        return memory_report(
            self.model,
            self.optimizer,
            self.device,
            self._activations.bytes,
            graph_bytes=graphs.reserved,
            graph_allocated=graphs.allocated,
        )
