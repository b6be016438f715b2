"""The trainer's epoch: :class:`EpochMixin` runs the optimizer steps of one pass over a
loader (with its progress bar), reads the epoch's losses and scales from the device
once, records them, and logs the epoch's skipped steps and a loss scale that is
likely too low, from the optimizer's overflow report.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from tkern.amp import LossScaler
from tkern.optim import FusedOptimizer
from tkern.optim.report import SUBNORMAL_WARN

__all__ = ["EpochMixin"]

logger = logging.getLogger("tkern.train.trainer")


class EpochMixin:
    """One epoch of a :class:`tkern.Trainer` (``_train_epoch``) and its overflow log.

    Needs the trainer's ``train_step``, ``_current_scale``, ``_activations``,
    ``accumulation_steps``, ``progress``, ``log_every``, ``scaler``, ``optimizer``,
    ``device``, and its records ``step``, ``epoch``, ``history`` and ``epochs``."""

    step: int
    epoch: int
    history: list[dict[str, float]]
    epochs: list[dict[str, float]]
    scaler: Any
    optimizer: torch.optim.Optimizer
    device: torch.device

    def _progress_bar(self, loader: Iterable, epochs: int) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=len(loader) if hasattr(loader, "__len__") else None,
            desc=f"epoch {self.epoch + 1}/{epochs}",
            leave=False,
        )

    def _train_epoch(self, loader: Iterable, epochs: int) -> None:
        bar = self._progress_bar(loader, epochs)
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
            losses.append(self.train_step(pending, measure=self._activations.bytes == 0))
            scales.append(self._current_scale())
            pending = []
            if bar is not None and self.step % self.log_every == 0:
                self._show(bar, losses[-1], scales[-1], samples / (time.perf_counter() - start))
        if pending:  # the epoch's last, shorter accumulation: its loss is averaged over what is there
            losses.append(self.train_step(pending))
            scales.append(self._current_scale())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        self._record_epoch(losses, scales, samples, elapsed)

    def _show(self, bar: Any, loss: torch.Tensor, scale: torch.Tensor | None, rate: float) -> None:
        """The progress bar's postfix (one read of the loss and the scale from the device)."""
        postfix = {"loss": f"{loss.item():.4f}", "samples/s": f"{rate:.0f}"}
        if scale is not None:
            postfix["scale"] = f"{scale.item():g}"
        if isinstance(self.scaler, LossScaler):
            postfix["skipped"] = self.scaler.skipped_steps
        bar.set_postfix(postfix)

    def _record_epoch(self, losses: list, scales: list, samples: int, elapsed: float) -> None:
        """The epoch's steps into ``history`` (one read from the device), its summary into
        ``epochs``, its skipped steps into the log."""
        first = self.step - len(losses) + 1
        loss_values = torch.stack(losses).tolist() if losses else []
        has_scale = bool(scales) and scales[0] is not None
        scale_values = torch.stack(scales).tolist() if has_scale else [None] * len(losses)
        for i, (loss, scale) in enumerate(zip(loss_values, scale_values, strict=True)):
            self.history.append({"step": first + i, "epoch": self.epoch + 1, "loss": loss, "scale": scale})
        self._log_overflows(first)
        self.epoch += 1
        self.epochs.append(
            {
                "epoch": self.epoch,
                "train_loss": sum(loss_values) / max(len(loss_values), 1),
                "step_time_s": elapsed / max(len(losses), 1),
                "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            }
        )

    def _log_overflows(self, first: int) -> None:
        """Log the skipped steps of this epoch (from ``first`` on) whose gradients held
        inf or nan, with the tensors that did: one read of the optimizer's overflow
        report per epoch, beside the epoch's read of its losses. Each tensor is
        named at the last step it overflowed in (earlier skips it took part in are
        not named again). With the optimizer's gradients sampled
        (``optimizer.track_underflows(every=k)``), warn when the epoch's last sampled
        step says the loss scale is likely too low
        (:meth:`~tkern.optim.report.OverflowReport.scale_too_low`: 1% or more of a
        tensor's gradient subnormal in 16 bits while the scale could double), naming
        the tensors, their subnormal shares and the scale."""
        opt = self.optimizer
        if not isinstance(opt, FusedOptimizer) or not opt.track_overflows or not len(self.history):
            return
        report = opt.overflow_report()
        by_step: dict[int, list[str]] = {}
        for name, opt_step in report.last_overflow.items():
            step = self.step - (report.step - opt_step)  # one optimizer step per trainer step
            if step >= first:
                by_step.setdefault(step, []).append(name)
        for step in sorted(by_step):
            logger.warning("step %d skipped: inf/nan in %s", step, ", ".join(by_step[step]))
        low = report.scale_too_low()
        sampled = None if report.sampled_step is None else self.step - (report.step - report.sampled_step)
        if low and sampled >= first:  # a Python warning (pytest.warns, -W error), not a log line
            warnings.warn(
                f"step {sampled}: loss scale {report.sampled_scale:g} is likely too low: gradients "
                "subnormal in 16 bits: "
                + ", ".join(f"{name} {report.subnormal_fraction[name]:.1%}" for name in low)
                + f" ({100 * SUBNORMAL_WARN:g}% or more of a tensor, and the scale could grow "
                f"{report.headroom:.3g}x before any gradient overflows)",
                RuntimeWarning,
                stacklevel=4,
            )
