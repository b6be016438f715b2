"""A thin trainer: the mixed-precision loop a user would otherwise write.

One optimizer step::

    out = model(x)                         # fp16 forward (tkern layers), or under autocast
    loss = loss_fn(out.float(), y) / k     # the loss in fp32, averaged over k micro-batches
    scaler.scale(loss).backward()          # k times (gradient accumulation)
    scaler.step(optimizer); scaler.update(); scheduler.step()

The loop itself never waits for the device: per-step metrics are kept as
device tensors and read once per epoch (and every ``log_every`` steps for the
progress bar).

With ``cuda_graph=True`` a step of one micro-batch is captured as a CUDA graph
per batch shape and replayed (:class:`tkern.graphs.StepGraphs`), after warm-up steps; where
:func:`graph_blocker` gives a reason it cannot be, the trainer warns once and
runs eager.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from tkern.amp import LossScaler
from tkern.graphs import (
    CAPTURE,
    EAGER,
    REPLAY,
    CaptureError,
    CudaGraphCapture,
    GraphCapture,
    StepGraphs,
    capture_failed,
    device_blocker,
    key_value,
)
from tkern.kernels import INTERPRET
from tkern.optim import FusedOptimizer
from tkern.optim.report import SUBNORMAL_WARN
from tkern.train.checkpoint import CheckpointError
from tkern.train.trainer_checkpoint import CheckpointMixin
from tkern.train.trainer_memory import ActivationMeter, memory_report

__all__ = [
    "MAX_GRAPHS",
    "WARMUP_STEPS",
    "CheckpointError",
    "CudaGraphCapture",
    "GraphCapture",
    "StepGraphs",
    "Trainer",
    "graph_blocker",
    "graph_stamp",
]


logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- CUDA graphs

#: Eager runs of a batch shape before its step is captured. Everything a step builds
#: lazily must exist before capture, where nothing may synchronise with the host or
#: allocate-and-initialise state that later replays would re-initialise: the optimizer's
#: moments and master, the loss scale, the gradients, cuBLAS workspaces, and Triton's
#: autotuning for that shape (it times configs, waiting for the device). Three is
#: ``torch.cuda.make_graphed_callables``' ``num_warmup_iters``.
WARMUP_STEPS = 3
#: Batch shapes that get a graph of their own: an epoch's full batch and its last,
#: smaller one. Batches of any further shape (dynamic shapes) run eager: a graph per
#: shape holds its own activation memory, and capture costs warm-up steps.
MAX_GRAPHS = 2


def graph_blocker(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    accumulation_steps: int,
    scheduler: Any,
    device: torch.device,
    capture_device_type: str = "cuda",
    interpreted: bool = False,
) -> str | None:
    """Why a trainer with these parts cannot capture its whole step as one graph
    (one line), or None when it can. Looks only at its arguments.

    ``capture_device_type``: the device type the capture seam records (CUDA's).
    ``interpreted``: tkern's kernels run through Triton's interpreter, on the host,
    while the model is on that device.
    """
    opt = type(optimizer).__name__
    reason = device_blocker(device, "the model is", device_type=capture_device_type, interpreted=interpreted)
    if reason is not None:
        return reason
    if accumulation_steps > 1:
        return f"accumulation_steps={accumulation_steps}: only a step of one forward and backward is captured"
    if scheduler is not None:
        return (
            f"a {type(scheduler).__name__} changes the learning rate every step, and a captured "
            "step replays the hyperparameters it was captured with"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "a DistributedDataParallel model: its gradient all-reduce hooks are not captured"
    if getattr(optimizer, "shard_group", None) is not None:
        return f"{opt} is sharded: its collectives are not captured"
    if isinstance(scaler, torch.amp.GradScaler):
        if scaler.is_enabled() and not getattr(optimizer, "_step_supports_amp_scaling", False):
            return (
                f"torch.amp.GradScaler with {opt} reads found_inf on the host every step "
                "(only an optimizer with _step_supports_amp_scaling takes it on the device)"
            )
    elif isinstance(scaler, LossScaler):
        if scaler.is_enabled() and not isinstance(optimizer, FusedOptimizer):
            return (
                f"a {type(scaler).__name__} with {opt}, which is not a tkern fused optimizer, "
                "reads found_inf on the host every step"
            )
    elif scaler is not None:
        return f"a {type(scaler).__name__} loss scaler is not known to be free of host syncs"
    if isinstance(optimizer, FusedOptimizer):
        for i, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key == "lr" and isinstance(value, torch.Tensor) and value.device == device:
                    continue  # read by the kernels on the device
                if key != "params" and isinstance(value, torch.Tensor):
                    return (
                        f"{opt} has a tensor {key} (param group {i}), which its step reads on the host; "
                        f"give it as a number{' or a tensor on ' + str(device) if key == 'lr' else ''}"
                    )
    elif not all(g.get("capturable", False) for g in optimizer.param_groups):
        return f"{opt} is not built with capturable=True, and torch refuses to capture its step without it"
    return None


def graph_stamp(optimizer: torch.optim.Optimizer, scaler: Any) -> tuple:
    """What a captured step bakes in that may change between steps: each param
    group's hyperparameters (tkern's kernels take them as arguments, so a graph
    replays the values of its capture; a tensor lr on the device by identity, read
    in place: :func:`tkern.graphs.key_value`) and its number of params, and the
    address of the loss scaler's state. A different stamp means capturing again."""
    groups = tuple(
        (len(g["params"]), tuple((k, key_value(v)) for k, v in g.items() if k != "params"))
        for g in optimizer.param_groups
    )
    state = scaler.state if isinstance(scaler, LossScaler) else None
    return groups, None if state is None else state.data_ptr()


def _batch_key(x: torch.Tensor, y: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in (x, y))


class Trainer(CheckpointMixin):
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
        cuda_graph: capture the whole step (gradients zeroed in place, forward, loss,
            scaled backward, scaler step and update, optimizer step) as a CUDA graph
            per batch shape and replay it (see :class:`StepGraphs`): one launch per
            step instead of dozens. Needs parts that never wait for the device
            (a tkern fused optimizer with a tkern scaler or GradScaler, or a torch
            optimizer with ``capturable=True``), ``accumulation_steps=1`` and no
            scheduler; where :func:`graph_blocker` finds a reason it cannot, the
            trainer warns once with it and runs eager, exactly as ``cuda_graph=False``.
            The gradients are zeroed in place (never set to None) on every step,
            eager ones included. After a replay the host-side give-up check of a
            tkern scaler (``max_overflows_at_min``) and its update count do not run;
            eager steps keep them.
        graph_capture: the capture seam (default :class:`CudaGraphCapture`);
            only with ``cuda_graph=True``.
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
        cuda_graph: bool = False,
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
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        if graph_capture is not None and not cuda_graph:
            raise ValueError("graph_capture is used only with cuda_graph=True")
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
        #: the whole-step graphs when ``cuda_graph=True`` can capture, else None (eager steps)
        self.graphs: StepGraphs | None = None
        #: why ``cuda_graph=True`` runs eager (None when it captures, or was not asked for)
        self.graph_fallback: str | None = None
        self._warned_shapes = False
        #: per graph: the optimizer's grad_stats as captured (a static output every replay rewrites)
        self._captured_stats: dict = {}
        if isinstance(optimizer, FusedOptimizer):  # overflow reports name the model's layers
            optimizer.name_params(model)
        if cuda_graph:
            capture = CudaGraphCapture() if graph_capture is None else graph_capture
            self.graph_fallback = graph_blocker(
                model=model,
                optimizer=optimizer,
                scaler=scaler,
                accumulation_steps=accumulation_steps,
                scheduler=scheduler,
                device=self.device,
                capture_device_type=capture.device_type,
                interpreted=INTERPRET and self.device.type == "cuda",
            )
            if self.graph_fallback is None:
                self.graphs = StepGraphs(capture, warmup_steps=WARMUP_STEPS, max_graphs=MAX_GRAPHS)
                if getattr(optimizer, "underflow_every", None) is not None:
                    warnings.warn(
                        "Trainer(cuda_graph=True): the steps of the whole-step graph are not sampled for "
                        "zero and subnormal gradients (optimizer.track_underflows): the report will hold "
                        "no fractions from them and no 'scale likely too low' warning",
                        stacklevel=2,
                    )
            else:
                warnings.warn(f"Trainer(cuda_graph=True) runs eager: {self.graph_fallback}", stacklevel=2)

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
            total = self._graphed_step(x, y, measure)
        else:  # in place, as the graphs: their gradient buffers must stay where they were captured
            total = self._steps_through(micro_batches, set_to_none=False, measure=measure)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        return total

    @property
    def graph_counts(self) -> Counter[str]:
        """How the steps ran with ``cuda_graph=True``: ``warmup``, ``capture``
        (captured, then replayed), ``replay``, ``eager`` (empty without graphs)."""
        return Counter() if self.graphs is None else self.graphs.counts

    def _graphed_step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        """One whole step through :attr:`graphs`: the batch is copied into its shape's
        static buffers, then warmed up, captured or replayed (or run eager, for a
        shape beyond the first ``MAX_GRAPHS``). A failed capture raises: its step
        ran part of its Python (the scaler's bookkeeping) and cannot be retaken."""
        try:
            loss, how = self.graphs.run(
                lambda sx, sy: self._steps_through([(sx, sy)], set_to_none=False, measure=measure),
                (x, y),
                lambda: graph_stamp(self.optimizer, self.scaler),
                _batch_key(x, y),
            )
        except CaptureError as e:
            why = capture_failed(f"the step for batches of shape {tuple(x.shape)}", e)
            raise RuntimeError(f"Trainer(cuda_graph=True): {why}; train with cuda_graph=False") from e
        if how == EAGER and not self._warned_shapes:
            self._warned_shapes = True
            warnings.warn(
                f"Trainer(cuda_graph=True): batches of shape {tuple(x.shape)} run eager; graphs "
                f"are kept for the first {MAX_GRAPHS} batch shapes only",
                stacklevel=4,
            )
        if how in (CAPTURE, REPLAY):  # the graph's outputs are static: the next replay rewrites them
            self._own_grad_stats(how, _batch_key(x, y))
            return loss.clone()
        return loss

    def _own_grad_stats(self, how: str, key) -> None:
        """After a capture or replay, the optimizer's ``grad_stats`` (where it has one)
        is this step's own copy, as after an eager step: a replay runs no Python, so
        it would otherwise keep naming the captured graph's static output, which
        every later replay rewrites."""
        if how == CAPTURE:
            self._captured_stats[key] = getattr(self.optimizer, "grad_stats", None)
        static = self._captured_stats.get(key)
        if isinstance(static, torch.Tensor):
            self.optimizer.grad_stats = static.clone()

    def _steps_through(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], set_to_none: bool, measure: bool
    ) -> torch.Tensor:
        """Zero the gradients, forward and scaled backward of every micro-batch, then
        the scaler's (or the optimizer's) step and update; the mean loss."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        total = torch.zeros((), device=self.device)
        k = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._activations.measure(self.model) if measure and i == 0 else nullcontext():
                loss = self.loss_fn(self._forward(x).float(), y) / k
            # a sharded optimizer reduces the gradients once, after the last micro-batch
            no_sync = getattr(self.optimizer, "no_sync", None)
            with no_sync() if no_sync is not None and i < k - 1 else nullcontext():
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
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
            losses.append(self.train_step(pending, measure=self._activations.bytes == 0))
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
                stacklevel=3,
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
        return memory_report(self.model, self.optimizer, self.device, self._activations.bytes)
