"""Checkpoint files: what a training run writes to resume exactly.

This module owns the file and its rules, so :class:`tkern.Trainer` only says
what goes in and what comes out:

* :func:`write_atomic`: temporary file, fsync, rename; stale temporaries of
  killed saves removed; symlinks followed; permissions kept.
* :func:`digest`: a SHA-256 over the payload's structure and every tensor's
  bytes, which also proves ``torch.load(weights_only=True)`` can load it.
* :func:`save`: the collective save of a sharded optimizer's checkpoint (every
  rank gathers, rank 0 writes, its outcome is broadcast: the barrier after which
  the file is complete, and the way a failed write raises on every rank).
* :func:`read` and :func:`validate`: load with ``weights_only=True``, check the
  format, version and digest, and that the payload fits the model, optimizer,
  scaler and scheduler, before anything is changed.
* :func:`rng_state` / :func:`set_rng_state`: torch, CUDA, Python and numpy RNGs.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
import tempfile
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tkern.amp import LossScaler

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "PAYLOAD_KEYS",
    "CheckpointError",
    "digest",
    "optimizer_kind",
    "read",
    "rng_state",
    "save",
    "set_rng_state",
    "shard_group_of",
    "validate",
    "write_atomic",
]

CHECKPOINT_FORMAT = "tkern.Trainer checkpoint"
CHECKPOINT_VERSION = 2
PAYLOAD_KEYS = (
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


def optimizer_kind(name: Any) -> Any:
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


def digest(payload: Any) -> str:
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


def rng_state() -> dict[str, Any]:
    """Every RNG a training run draws from: torch (CPU and every CUDA device),
    Python's ``random`` and numpy's global generator, as tensors and plain values
    that ``torch.load(weights_only=True)`` loads."""
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


def shard_group_of(optimizer: Any) -> tuple[Any, int, int]:
    """(group, rank, world size) of a sharded optimizer's process group
    (:mod:`tkern.optim.distributed`, its public ``shard_group``), or (None, 0, 1)
    for any other optimizer."""
    group = getattr(optimizer, "shard_group", None)
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def write_atomic(payload: dict[str, Any], path: str) -> None:
    """Write ``payload`` with ``torch.save`` to ``path`` atomically: a temporary
    file in the same folder, synced, then renamed over ``path`` (so an
    interrupted save never replaces a good file). Temporary files of killed saves
    are removed first; a symbolic link is followed (its target rewritten, the link
    kept); a new file gets the permissions the umask allows, an existing one keeps
    its own. A failed write (a full disk) raises ``OSError`` naming ``path``."""
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


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA only where this machine has it)."""
    torch.set_rng_state(rng["torch"].cpu())
    random.setstate(rng["python"])
    if "numpy" in rng:
        import numpy as np

        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])


def save(
    payload: dict[str, Any],
    path: str | os.PathLike,
    group: Any = None,
    write: Callable[[dict[str, Any], str], None] = write_atomic,
) -> None:
    """Write a checkpoint: with no process ``group``, ``write(payload, path)``;
    with one (a sharded optimizer's), a collective every rank of ``group`` calls:
    rank 0 of the group writes, the others do not, and no rank returns before the
    file is complete. A failed write raises on every rank (``OSError`` naming
    ``path``)."""
    path = os.fspath(path)
    if group is None:
        write(payload, path)
        return
    error: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            write(payload, path)
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


def read(path: str | os.PathLike, map_location: Any = None) -> Any:
    """The payload of the checkpoint at ``path``, loaded with
    ``torch.load(weights_only=True)``; a file that cannot be read raises
    :class:`CheckpointError`, a missing one ``FileNotFoundError``. Not yet
    validated: call :func:`validate`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read (corrupt, or not a tkern checkpoint): "
            f"{type(e).__name__}: {first}"
        ) from e


def validate(
    payload: Any,
    path: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any = None,
    scheduler: Any = None,
) -> None:
    """Raise :class:`CheckpointError` unless ``payload`` is an intact checkpoint
    (format, version, SHA-256 digest, every entry present) that fits ``model``,
    ``optimizer``, ``scaler`` and ``scheduler`` (keys and shapes, optimizer kind
    and groups, the scaler's and scheduler's presence, class and contents).
    Changes nothing."""

    def fail(why: str) -> None:
        raise CheckpointError(f"checkpoint {path!r} {why}")

    _check_envelope(payload, fail)
    _check_model(payload["model"], model, fail)
    _check_optimizer(payload, optimizer, fail)
    _check_scaler_and_scheduler(payload, scaler, scheduler, fail)
    _check_counters(payload, fail)


def _check_envelope(payload: Any, fail: Callable[[str], None]) -> None:
    """Format, version, digest and every entry present."""
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        fail("is not a tkern Trainer checkpoint (or was written by an older tkern)")
    if payload.get("version") != CHECKPOINT_VERSION:
        fail(f"has format version {payload.get('version')!r}; this tkern reads {CHECKPOINT_VERSION}")
    body = {k: v for k, v in payload.items() if k != "sha256"}
    try:
        intact = payload.get("sha256") == digest(body)
    except TypeError:
        intact = False
    if not intact:
        fail("is corrupt: its SHA-256 digest does not match its contents")
    missing = [k for k in PAYLOAD_KEYS if k not in payload]
    if missing:
        fail(f"lacks {', '.join(missing)}")


def _check_model(saved: Any, model: nn.Module, fail: Callable[[str], None]) -> None:
    """The model's state: same keys, same shapes."""
    mine = model.state_dict()
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


def _check_optimizer(payload: dict, optimizer: torch.optim.Optimizer, fail: Callable[[str], None]) -> None:
    """The optimizer: same kind, same groups of the same sizes."""
    opt_class = type(optimizer).__name__
    if optimizer_kind(payload["optimizer_class"]) != optimizer_kind(opt_class):
        fail(f"holds a {payload['optimizer_class']} optimizer's state, not a {opt_class}'s")
    groups = payload["optimizer"].get("param_groups") if isinstance(payload["optimizer"], dict) else None
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        fail(f"does not fit this {opt_class}: its param groups differ")
    for gi, (g, h) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        if not isinstance(h, dict) or len(h.get("params", ())) != len(g["params"]):
            fail(f"does not fit this {opt_class}: param group {gi} has a different number of params")


def _check_scaler_and_scheduler(
    payload: dict, scaler: Any, scheduler: Any, fail: Callable[[str], None]
) -> None:
    """Present in both or neither, of the same class, with loadable contents."""
    for what, obj in (("scaler", scaler), ("scheduler", scheduler)):
        saved_class = payload[f"{what}_class"]
        if (saved_class is None) != (obj is None) or (payload[what] is None) != (obj is None):
            has = "has no" if saved_class is None else f"has a {saved_class}"
            fail(f"{has} {what}, this trainer has {'none' if obj is None else 'a ' + type(obj).__name__}")
        if obj is not None and saved_class != type(obj).__name__:
            fail(f"has a {saved_class} {what}, this trainer a {type(obj).__name__}")
    if isinstance(scaler, LossScaler) and scaler.is_enabled():
        try:
            scaler.validate_state_dict(payload["scaler"])
        except (ValueError, TypeError, RuntimeError) as e:
            fail(f"has a bad scaler state: {e}")
    for what, obj in (("scaler", scaler), ("scheduler", scheduler)):
        if obj is None or isinstance(obj, LossScaler):
            continue
        keys, saved_keys = set(obj.state_dict()), payload[what]
        if not isinstance(saved_keys, dict) or (saved_keys and set(saved_keys) != keys):
            fail(f"has a {what} state that does not fit this {type(obj).__name__}")


def _check_counters(payload: dict, fail: Callable[[str], None]) -> None:
    """Epoch and step counts, the history and the RNG states."""
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
