"""A thin trainer: the mixed-precision loop a user would otherwise write.

One optimizer step::

    out = model(x)                         # fp16 forward (tkern layers), or under autocast
    loss = loss_fn(out.float(), y) / k     # the loss in fp32, averaged over k micro-batches
    scaler.scale(loss).backward()          # k times (gradient accumulation)
    scaler.step(optimizer); scaler.update(); scheduler.step()

The loop itself never waits for the device: per-step metrics are kept as
device tensors and read once per epoch (and every ``log_every`` steps for the
progress bar).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from tkern.amp import LossScaler
from tkern.kernels.scale import SCALE

__all__ = ["Trainer"]


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``, counting each storage once."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class Trainer:
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
        self._activation_bytes = 0

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
        """The scale as a device tensor (no sync), if the scaler exposes one."""
        if isinstance(self.scaler, LossScaler) and self.scaler.state is not None:
            return self.scaler.state[SCALE].clone()
        scale = getattr(self.scaler, "_scale", None)  # torch.amp.GradScaler keeps it here
        return scale.reshape(()).clone() if isinstance(scale, torch.Tensor) else None

    @contextmanager
    def _measure_activations(self):
        """Count the bytes autograd saves for backward during one forward
        (parameters, which it saves too, are not activations)."""
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._activation_bytes = _tensor_bytes(
            t for t in saved if t.untyped_storage().data_ptr() not in params
        )

    def train_step(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], measure: bool = False
    ) -> torch.Tensor:
        """One optimizer step over ``micro_batches``; returns the mean loss (device tensor)."""
        self.model.train()
        self.optimizer.zero_grad()
        total = torch.zeros((), device=self.device)
        k = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._measure_activations() if measure and i == 0 else nullcontext():
                loss = self.loss_fn(self._forward(x).float(), y) / k
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        return total

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

    def _train_epoch(self, loader: Iterable, epochs: int) -> None:
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=len(loader) if hasattr(loader, "__len__") else None,
                desc=f"epoch {self.epoch + 1}/{epochs}",
                leave=False,
            )
        losses, scales, samples = [], [], 0
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = time.perf_counter()
        for x, y in loader:
            pending.append((x, y))
            samples += len(x)
            if bar is not None:
                bar.update(1)
            if len(pending) < self.accumulation_steps:
                continue
            losses.append(self.train_step(pending, measure=self._activation_bytes == 0))
            scales.append(self._current_scale())
            pending = []
            if bar is not None and self.step % self.log_every == 0:
                elapsed = time.perf_counter() - start
                postfix = {"loss": f"{losses[-1].item():.4f}", "samples/s": f"{samples / elapsed:.0f}"}
                if scales[-1] is not None:
                    postfix["scale"] = f"{scales[-1].item():g}"
                if isinstance(self.scaler, LossScaler):
                    postfix["skipped"] = self.scaler.skipped_steps
                bar.set_postfix(postfix)
        if pending:  # the epoch's last, shorter accumulation: its loss is averaged over what is there
            losses.append(self.train_step(pending))
            scales.append(self._current_scale())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        first = self.step - len(losses) + 1
        # one read from the device per epoch
        loss_values = torch.stack(losses).tolist() if losses else []
        has_scale = bool(scales) and scales[0] is not None
        scale_values = torch.stack(scales).tolist() if has_scale else [None] * len(losses)
        for i, (loss, scale) in enumerate(zip(loss_values, scale_values, strict=True)):
            self.history.append({"step": first + i, "epoch": self.epoch + 1, "loss": loss, "scale": scale})
        self.epoch += 1
        self.epochs.append(
            {
                "epoch": self.epoch,
                "train_loss": sum(loss_values) / max(len(loss_values), 1),
                "step_time_s": elapsed / max(len(losses), 1),
                "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            }
        )

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
        master and state), ``grads``, ``activations`` (peak on CUDA, from
        ``torch.cuda.max_memory_allocated``; on CPU the tensors saved for
        backward in the first step's forward) and ``total``."""
        model = _tensor_bytes(list(self.model.parameters()) + list(self.model.buffers()))
        params = {id(p) for p in self.model.parameters()}
        state = [
            v
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and id(v) not in params
        ]
        optimizer = _tensor_bytes(state)
        grads = _tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            activations = max(peak - model - optimizer - grads, 0)
        else:
            activations = self._activation_bytes
        total = model + optimizer + grads + activations
        return {
            "model": model,
            "optimizer": optimizer,
            "grads": grads,
            "activations": activations,
            "total": total,
        }

    # ------------------------------------------------------------------ checkpoints

    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:  # numpy is a dependency, but keep checkpoints loadable without it
            pass
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save model, optimizer (fp32 master and state), scaler, scheduler,
        epoch, step, history and RNG states. Written to a temporary file in
        the same folder and renamed over ``path``, so an interrupted save
        never replaces a good checkpoint."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        payload = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
            "epochs": self.epochs,
            "rng": self._rng_state(),
        }
        fd, tmp = tempfile.mkstemp(prefix=".tkern-ckpt-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; ``fit`` then
        continues the same trajectory."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint {path!r} does not exist")
        payload = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        if (payload["scaler"] is None) != (self.scaler is None):
            raise ValueError("the checkpoint's scaler and this trainer's do not match (one of them is None)")
        if self.scaler is not None:
            self.scaler.load_state_dict(payload["scaler"])
        if self.scheduler is not None and payload["scheduler"] is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        self.epoch, self.step = payload["epoch"], payload["step"]
        self.history, self.epochs = payload["history"], payload["epochs"]
        rng = payload["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        random.setstate(rng["python"])
        if "numpy" in rng:
            import numpy as np

            np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
