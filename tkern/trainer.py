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

import errno
import hashlib
import os
import random
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tkern.amp import LossScaler
from tkern.kernels.scale import SCALE

__all__ = ["CheckpointError", "Trainer"]


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

            name, keys, pos, has_gauss, cached = np.random.get_state()
            # as a tensor and plain numbers: loadable with torch.load(weights_only=True)
            state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
        except ImportError:  # numpy is a dependency, but keep checkpoints loadable without it
            pass
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def _process_group(self) -> tuple[Any, int, int]:
        """(group, rank, world size) of a sharded optimizer's process group
        (:mod:`tkern.optim.distributed`), or (None, 0, 1) for any other optimizer."""
        group = getattr(self.optimizer, "shard_group", None)
        if group is None or not dist.is_available() or not dist.is_initialized():
            return None, 0, 1
        return group, dist.get_rank(group), dist.get_world_size(group)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save model, optimizer (fp32 master and state), scaler, scheduler,
        epoch, step, history and RNG states.

        The file is written to a temporary file in the same folder, synced
        and renamed over ``path``, so an interrupted save never replaces a
        good checkpoint; temporary files that killed saves left behind are
        removed. A symbolic link is followed: its target is rewritten and the
        link kept. A new file gets the permissions the umask allows (0644
        under 022); an existing one keeps its own. The payload carries a
        SHA-256 digest that :meth:`load_checkpoint` checks, and loads with
        ``torch.load(path, weights_only=True)``. A failed write (a full disk)
        raises ``OSError`` naming ``path``.

        With a sharded optimizer (:class:`~tkern.optim.DistributedFusedAdamW`
        and its kin) this is a collective: every rank of the optimizer's process
        group must call it (it gathers the full optimizer state and every rank's
        RNG state), rank 0 of the group writes the file, the others do not, and
        no rank returns before the file is complete; a failed write raises on
        every rank (``OSError`` naming ``path``). The history saved is rank 0's
        (each rank's losses are those of its own micro-batches).
        """
        path = os.fspath(path)
        group, rank, world = self._process_group()
        payload = self._payload(group, world)  # a collective with a sharded optimizer
        if group is None:
            self._write_checkpoint(payload, path)
            return
        error: BaseException | None = None
        if rank == 0:
            try:
                self._write_checkpoint(payload, path)
            except BaseException as e:  # told to the other ranks, then raised here
                error = e
        # rank 0's outcome; also the barrier after which the file is complete for every rank
        outcome: list[Any] = [None if error is None else (getattr(error, "errno", None), str(error))]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
        if error is not None:
            raise error
        if outcome[0] is not None:
            code, message = outcome[0]
            raise OSError(code, f"rank 0 could not save the checkpoint: {message}", path)

    def _payload(self, group: Any, world: int) -> dict[str, Any]:
        """The checkpoint's contents with its digest. With a process group every
        rank's RNG state is gathered too (``rng_ranks``): ranks may draw different
        shuffles and dropout masks."""
        payload: dict[str, Any] = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
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
            "rng": self._rng_state(),
        }
        if group is not None:
            ranks: list[Any] = [None] * world
            dist.all_gather_object(ranks, payload["rng"], group=group)
            payload["rng_ranks"] = ranks
        payload["sha256"] = _digest(payload)  # also checks that weights_only can load every entry
        return payload

    def _write_checkpoint(self, payload: dict[str, Any], path: str) -> None:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "the checkpoint path is a directory", path)
        target = os.path.realpath(path)
        folder, base = os.path.split(target)
        _remove_stale_temporaries(folder, base)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        try:
            fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(base) + f"{os.getpid()}-", dir=folder)
        except OSError as e:
            raise OSError(e.errno, f"cannot save the checkpoint: {e.strerror or e}", path) from e
        try:
            with os.fdopen(fd, "wb") as f:
                sink = _RecordingWriter(f)
                try:
                    torch.save(payload, sink)
                except RuntimeError as e:  # torch reports a failed write as a RuntimeError
                    if sink.error is None:
                        raise
                    raise sink.error from e
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            if isinstance(e, OSError):
                raise OSError(e.errno, f"could not save the checkpoint: {e.strerror or e}", path) from e
            raise

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
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint {path!r} does not exist")
        try:
            payload = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise CheckpointError(
                f"checkpoint {path!r} cannot be read (corrupt, or not a tkern checkpoint): "
                f"{type(e).__name__}: {first}"
            ) from e
        self._check_payload(payload, path)
        # validated: nothing above changed the trainer
        self.optimizer.load_state_dict(payload["optimizer"])
        self.model.load_state_dict(payload["model"])
        if self.scaler is not None:
            self.scaler.load_state_dict(payload["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        self.epoch, self.step = payload["epoch"], payload["step"]
        self.history, self.epochs = payload["history"], payload["epochs"]
        rng = payload["rng"]
        group, rank, world = self._process_group()
        ranks = payload.get("rng_ranks")
        if group is not None and isinstance(ranks, list) and len(ranks) == world:
            rng = ranks[rank]
        torch.set_rng_state(rng["torch"].cpu())
        random.setstate(rng["python"])
        if "numpy" in rng:
            import numpy as np

            name, keys, pos, has_gauss, cached = rng["numpy"]
            np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])

    def _check_payload(self, payload: Any, path: str) -> None:
        """Raise CheckpointError unless ``payload`` is an intact checkpoint that fits this trainer."""

        def fail(why: str) -> None:
            raise CheckpointError(f"checkpoint {path!r} {why}")

        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            fail("is not a tkern Trainer checkpoint (or was written by an older tkern)")
        if payload.get("version") != CHECKPOINT_VERSION:
            fail(f"has format version {payload.get('version')!r}; this tkern reads {CHECKPOINT_VERSION}")
        body = {k: v for k, v in payload.items() if k != "sha256"}
        try:
            intact = payload.get("sha256") == _digest(body)
        except TypeError:
            intact = False
        if not intact:
            fail("is corrupt: its SHA-256 digest does not match its contents")
        missing = [k for k in _PAYLOAD_KEYS if k not in payload]
        if missing:
            fail(f"lacks {', '.join(missing)}")
        # the model: same keys, same shapes
        mine, saved = self.model.state_dict(), payload["model"]
        if not isinstance(saved, dict):
            fail("has no model state dict")
        extra, lacking = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
        if extra or lacking:
            fail(f"does not fit this model: unexpected keys {extra[:3]}, missing keys {lacking[:3]}")
        for key, value in mine.items():
            other = saved[key]
            if isinstance(value, torch.Tensor) and (
                not isinstance(other, torch.Tensor) or other.shape != value.shape
            ):
                got = tuple(other.shape) if isinstance(other, torch.Tensor) else type(other).__name__
                fail(f"does not fit this model: {key} is {got} in the checkpoint, {tuple(value.shape)} here")
        # the optimizer: same class, same groups
        opt_class = type(self.optimizer).__name__
        if _optimizer_kind(payload["optimizer_class"]) != _optimizer_kind(opt_class):
            fail(f"holds a {payload['optimizer_class']} optimizer's state, not a {opt_class}'s")
        groups = payload["optimizer"].get("param_groups") if isinstance(payload["optimizer"], dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.optimizer.param_groups):
            fail(f"does not fit this {opt_class}: its param groups differ")
        for gi, (g, h) in enumerate(zip(self.optimizer.param_groups, groups, strict=True)):
            if not isinstance(h, dict) or len(h.get("params", ())) != len(g["params"]):
                fail(f"does not fit this {opt_class}: param group {gi} has a different number of params")
        # scaler and scheduler: present in both or neither, same class, loadable contents
        for what, obj in (("scaler", self.scaler), ("scheduler", self.scheduler)):
            saved_class = payload[f"{what}_class"]
            if (saved_class is None) != (obj is None) or (payload[what] is None) != (obj is None):
                has = "has no" if saved_class is None else f"has a {saved_class}"
                fail(f"{has} {what}, this trainer has {'none' if obj is None else 'a ' + type(obj).__name__}")
            if obj is not None and saved_class != type(obj).__name__:
                fail(f"has a {saved_class} {what}, this trainer a {type(obj).__name__}")
        if isinstance(self.scaler, LossScaler) and self.scaler.is_enabled():
            try:
                self.scaler._parse_state_dict(payload["scaler"])
            except (ValueError, TypeError, RuntimeError) as e:
                fail(f"has a bad scaler state: {e}")
        for what, obj in (("scaler", self.scaler), ("scheduler", self.scheduler)):
            if obj is None or isinstance(obj, LossScaler):
                continue
            keys, saved_keys = set(obj.state_dict()), payload[what]
            if not isinstance(saved_keys, dict) or (saved_keys and set(saved_keys) != keys):
                fail(f"has a {what} state that does not fit this {type(obj).__name__}")
        for key in ("epoch", "step"):
            value = payload[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(f"has a bad {key}: {value!r}")
        if not isinstance(payload["history"], list) or not isinstance(payload["epochs"], list):
            fail("has a bad history")
        rng = payload["rng"]
        if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor) or "python" not in rng:
            fail("has a bad RNG state")
        ranks = payload.get("rng_ranks")
        if ranks is not None and not (
            isinstance(ranks, list)
            and all(isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in ranks)
        ):
            fail("has a bad per-rank RNG state")


CHECKPOINT_FORMAT = "tkern.Trainer checkpoint"
CHECKPOINT_VERSION = 2
_PAYLOAD_KEYS = (
    "model",
    "optimizer_class",
    "optimizer",
    "scaler_class",
    "scaler",
    "scheduler_class",
    "scheduler",
    "epoch",
    "step",
    "history",
    "epochs",
    "rng",
)


def _optimizer_kind(name: Any) -> Any:
    """A sharded optimizer's checkpoint holds the full state in its single-process
    kin's format: ``DistributedFusedAdamW`` and ``FusedAdamW`` are one kind."""
    if isinstance(name, str) and name.startswith("DistributedFused"):
        return name.removeprefix("Distributed")
    return name


class CheckpointError(ValueError):
    """A checkpoint that is corrupt, not a tkern checkpoint, or does not fit the trainer."""


def _temp_prefix(base: str) -> str:
    return f".{base}.tkern-tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove_stale_temporaries(folder: str, base: str) -> None:
    """Remove the temporary files of saves of ``base`` whose process is gone (killed mid-save)."""
    prefix = _temp_prefix(base)
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        with suppress(OSError):
            os.remove(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


class _RecordingWriter:
    """A file wrapper for torch.save that keeps the OSError of a failed write
    (torch reports it as a RuntimeError without the cause)."""

    def __init__(self, f) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def _digest(payload: Any) -> str:
    """SHA-256 of a checkpoint payload: its structure, every value and every
    tensor's dtype, shape and bytes. Raises TypeError naming an entry that
    ``torch.load(weights_only=True)`` could not load."""
    h = hashlib.sha256()
    _feed(h, payload, "checkpoint")
    return h.hexdigest()


def _feed(h, obj: Any, where: str) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)};".encode())
        for key, value in obj.items():
            _feed(h, key, where)
            _feed(h, value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)};".encode())
        for i, value in enumerate(obj):
            _feed(h, value, f"{where}[{i}]")
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(
            f"{where} is a {type(obj).__name__}, which torch.load(weights_only=True) cannot load; "
            "a checkpoint holds tensors, numbers, strings and lists/tuples/dicts of them"
        )
