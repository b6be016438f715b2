"""Sharded fused optimizers (ZeRO-2) on ``torch.distributed``.

:class:`DistributedFusedAdamW`, :class:`DistributedFusedAdam` and
:class:`DistributedFusedSGD` are :class:`~tkern.optim.FusedAdamW`,
:class:`~tkern.optim.FusedAdam` and :class:`~tkern.optim.FusedSGD` whose fp32
master weights and optimizer state exist only for this rank's 1/W of each flat
buffer (see :mod:`tkern.flat`, "Shards"). The model is *not* wrapped in DDP:
the optimizer owns gradient synchronisation. Every rank keeps the full fp16/bf16
(or fp32) params and gradients, so per rank the optimizer allocates, for AdamW
on half-precision params, ``2 + 2 + 12 / W`` bytes per parameter instead of 16
(see :meth:`memory_report`).

Gradients are reduced in **buckets**: each param group's params are kept in flat
buffers of at most ``bucket_mb`` MiB of fp32 each (consecutive params; a bigger
param alone), each buffer padded to ``16 * W`` elements and split W ways, so that
a bucket's reduce-scatter is one contiguous collective whose output is this
rank's shard of it. With ``overlap_grad_sync=True`` (the default) a bucket is
reduce-scattered (``async_op=True``) as soon as backward has produced the
gradients of all its params, from their post-accumulate-grad hooks, while
backward goes on with the earlier layers (DDP's buckets, DeepSpeed's
``overlap_comm``, apex's ``overlap_grad_sync``), in one order on every rank:
the last params' first in the first step, then the order in which the buckets'
gradients completed in it (rank 0's, broadcast once, as DDP rebuilds its
buckets), so a bucket that completes late (the fp32 norms of a converted model)
holds up none that completed before it; when backward ends they are waited for and the
shards hold the mean gradient (as DDP's ``.grad`` after backward; what is done
to ``.grad`` before the step acts on it). The results are bit for bit those of
``overlap_grad_sync=False``, which issues the same collectives inside ``step()``.

One ``step()``, all on the device, no host synchronisation:

1. finish the reduce-scatter of every bucket, so this rank's shard holds the
   mean gradient over the ranks. By default the sum is taken in **fp32**
   (fp16/bf16 gradients are staged in fp32, the sum divided by W in fp32 and
   rounded once to the gradients' dtype): an fp16 sum of W finite, loss-scaled
   gradients can overflow, and pre-dividing each rank's gradient by W rounds
   every share (and flushes the smallest to zero) before the sum. The price is
   twice the bytes of the reduce-scatter for 16-bit gradients;
   ``grad_sync_dtype=None`` pre-divides instead (into a temporary) and reduces
   in the gradients' own dtype (no overflow either: each share is at most
   max / W). Outside its shard, a rank's ``.grad`` is left holding its local
   gradient. While a bucket is in flight its send buffer (the bucket, staged in
   fp32) and the received shard are alive;
2. pass 1 (``grad_stats``) on the shard, then ONE all-gather of the three
   statistics (W x 3 floats), reduced the same way on every rank: found_inf
   max, sum of squares summed (so ``max_grad_norm`` clips by the global norm of
   the mean gradient), max |g| max. An inf/nan on any rank skips the step on
   every rank;
3. pass 2 on the shard: the update of the fp32 master and state;
4. all-gather the updated shards into every rank's full param buffer, so the
   params are bit-identical on every rank after every step.

Requirements as for DDP without ``find_unused_parameters``: every rank calls
``step()``, ``zero_grad()``, ``state_dict()`` and ``add_param_group()`` in the
same order, and every rank's backward gives gradients to the same params.
Gradient accumulation: ``with opt.no_sync():`` around all but the last
micro-batch (the gradients accumulate in the flat buffer and nothing is
reduced; ``step()`` must not be called inside ``no_sync``). With the overlap on,
a second backward before the step without ``no_sync`` raises ``RuntimeError``
(its buckets were reduced when the first ended); with ``overlap_grad_sync=False``
it is right and reduces once, in ``step()``.

Checkpoints: :meth:`state_dict` is a collective that returns the **full**,
unsharded state in exactly :class:`~tkern.optim.FusedAdamW`'s format on
**every** rank (so any rank, usually rank 0, can save it), and
:meth:`load_state_dict` loads such a full state (from any world size, or from a
single-process tkern or torch optimizer) without communicating: train on 2
ranks, resume on 3, or on one process with the plain optimizer, and back.
:meth:`sharded_state_dict` / :meth:`load_sharded_state_dict` save and load only
this rank's shard (same world size) for models too large to gather. Without
``seed=``, every rank takes rank 0's default rounding seed (agreed on in the
construction's collective), so the state dict is one on every rank.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tkern.flat import ALIGN, FlatParams, alias, describe_param, round_up
from tkern.kernels._update import QBLOCK
from tkern.kernels.overflow import combine_stats
from tkern.optim.adam import FusedAdam, FusedAdamW
from tkern.optim.distributed_sync import GradSync, all_gather, bucket_runs
from tkern.optim.fused import FusedOptimizer, document_options, full_signature
from tkern.optim.local_processes import run_local_processes, teardown_process_group
from tkern.optim.sgd import FusedSGD

__all__ = [
    "DistributedFusedAdam",
    "DistributedFusedAdamW",
    "DistributedFusedSGD",
    "run_local_processes",
    "teardown_process_group",
]


def _param_list(params: Any) -> list:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set")
    return list(params)  # (name, param) pairs stay pairs: add_param_group takes them


def _describe_entry(p: Any) -> tuple:
    """What ranks must agree on for one param: shape, dtype, device type."""
    if isinstance(p, tuple) and len(p) == 2:
        p = p[1]
    if not isinstance(p, torch.Tensor):
        return ("not a tensor", type(p).__name__)
    return (tuple(p.shape), str(p.dtype).removeprefix("torch."), p.device.type)


def _local_problem(groups: list[list], first_group: int) -> str | None:
    """A problem this rank alone may have (mixed devices): reported by every rank."""
    devices = []
    for gi, params in enumerate(groups, start=first_group):
        for pi, p in enumerate(params):
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p
            if isinstance(p, torch.Tensor):
                if devices and p.device != devices[0][0]:
                    d0, g0, i0 = devices[0]
                    return (
                        f"{describe_param(gi, pi, p)} is on {p.device}, but param {i0} of param group "
                        f"{g0} is on {d0}; a tkern optimizer keeps all its params on one device"
                    )
                devices.append((p.device, gi, pi))
    return None


def _check_ranks_agree(
    opt: Any, groups: list[list], first_group: int = 0, error: Exception | None = None
) -> int:
    """For a sharded optimizer ``opt`` being built or given a param group: one
    all_gather_object of every rank's param shapes/dtypes/devices, of
    its local ``error`` and of its default rounding seed; a mismatch or an error on any rank
    raises on every rank (the rank that had the error raises it; the others a ValueError
    naming that rank). Returns rank 0's default seed (``torch.initial_seed()``), the
    one every rank takes when no ``seed`` is given."""
    problem = _local_problem(groups, first_group)
    if problem is None and error is not None:
        problem = f"{type(error).__name__}: {error}"
    mine = {
        "params": [[_describe_entry(p) for p in g] for g in groups],
        "problem": problem,
        "seed": torch.initial_seed() & 0x7FFFFFFF,
    }
    everyone: list[Any] = [None] * opt._world
    dist.all_gather_object(everyone, mine, group=opt._zero_group)
    name = type(opt).__name__
    if error is not None:
        raise error
    for r, theirs in enumerate(everyone):
        if theirs["problem"] is not None:
            raise ValueError(f"{name}: on rank {r}: {theirs['problem']}")
    ref = everyone[0]["params"]
    for r, theirs in enumerate(everyone[1:], start=1):
        sig = theirs["params"]
        if len(sig) != len(ref):
            raise ValueError(
                f"{name}: ranks disagree on the number of param groups: rank 0 passed {len(ref)}, "
                f"rank {r} passed {len(sig)}"
            )
        for gi, (a, b) in enumerate(zip(ref, sig, strict=True), start=first_group):
            for pi in range(max(len(a), len(b))):
                x = a[pi] if pi < len(a) else "nothing"
                y = b[pi] if pi < len(b) else "nothing"
                if x != y:
                    raise ValueError(
                        f"{name}: ranks disagree on param {pi} of param group {gi}: rank 0 passed "
                        f"{_fmt(x)}, rank {r} passed {_fmt(y)}; every rank must pass the same params "
                        "in the same order"
                    )
    return everyone[0]["seed"]


class _Sharded:
    """The ZeRO-2 machinery, mixed in before a fused optimizer class (so its hooks
    override the fused optimizer's). The sharded class takes the fused class's
    arguments as they are, plus the sharding's own (keyword-only)."""

    def __init__(
        self,
        params: Iterable,
        *args: Any,
        process_group: Any = None,
        bucket_mb: float = 32.0,
        grad_sync_dtype: torch.dtype | None = torch.float32,
        overlap_grad_sync: bool = True,
        **kwargs: Any,
    ) -> None:
        fused = _fused_class(type(self))
        # the stand-in gets a seed: it must not agree on one (that is _setup's collective)
        stand_in_seed = {"seed": 0} if kwargs.get("seed") is None else {}
        probe = lambda p: fused(p, *args, **{**kwargs, **stand_in_seed})  # noqa: E731
        if not isinstance(overlap_grad_sync, bool):
            raise TypeError(f"overlap_grad_sync must be a bool, got {overlap_grad_sync!r}")
        params = self._setup(params, process_group, bucket_mb, grad_sync_dtype, probe)
        if kwargs.get("seed") is None:  # one seed on every rank: one state_dict, one rounding
            kwargs = {**kwargs, "seed": self._rank0_seed}
        self._grads = GradSync(self._zero_group, self._world, self._bucket_bytes, self._sync_fp32,
                                overlap_grad_sync)  # fmt: skip
        fused.__init__(self, params, *args, **kwargs)
        self._finish_setup()

    # Set by _setup before the fused optimizer's constructor runs.
    _rank0_seed: int
    _zero_group: Any
    _world: int
    _rank: int

    @property
    def shard_group(self) -> Any:
        """The process group the optimizer's state is sharded over."""
        return self._zero_group

    def _setup(
        self, params: Any, process_group: Any, bucket_mb: float, grad_sync_dtype: Any, probe: Callable
    ) -> list:
        """Resolve the group, check that every rank passed the same params and valid
        hyperparameters (one collective) and return the params with every iterator
        made a list. ``probe(groups)`` builds the single-process optimizer with the
        same arguments over stand-in params: it raises what the real one would
        raise on this rank, before anything collective can hang on it."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment)"
            )
        if not bucket_mb > 0:
            raise ValueError(f"Invalid bucket_mb: {bucket_mb}; expected > 0")
        group = process_group if process_group is not None else dist.group.WORLD
        self._zero_group = group
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        if self._rank < 0:
            raise ValueError(f"{type(self).__name__}: this process is not a member of process_group")
        if grad_sync_dtype not in (torch.float32, None):
            raise ValueError(f"Invalid grad_sync_dtype: {grad_sync_dtype}; expected torch.float32 or None")
        self._bucket_bytes = int(bucket_mb * 2**20)
        self._sync_fp32 = grad_sync_dtype is not None
        self._constructed = False

        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, "
                f"but got {torch.typename(params)}"
            )
        params = list(params)
        grouped = bool(params) and isinstance(params[0], dict)
        if grouped:
            params = [{**g, "params": _param_list(g["params"])} for g in params]
            lists = [g["params"] for g in params]
        else:
            params = _param_list(params)
            lists = [params]
        error = None
        try:

            def stand_in():
                return [torch.zeros(1, requires_grad=True)]

            probe([{**g, "params": stand_in()} for g in params] if grouped else stand_in())
        except Exception as e:  # raised on every rank below, after the one collective
            error = e
        self._rank0_seed = _check_ranks_agree(self, lists, error=error)
        return params

    def _make_flats(
        self, params: list[torch.Tensor], indices: list[int], group: int, names: tuple[str, ...], modes: dict
    ) -> list[FlatParams]:
        """One flat buffer per bucket of consecutive params (at most ``bucket_mb`` of fp32,
        a bigger param alone), so that a bucket's reduce-scatter is one contiguous
        collective whose pieces land in each rank's shard of it."""
        align = QBLOCK if modes["state_dtype"] == torch.uint8 else ALIGN
        runs = bucket_runs([round_up(p.numel(), align) for p in params], self._bucket_bytes // 4)
        return [
            FlatParams(params[a:b], indices[a:b], group, names, world_size=self._world, rank=self._rank,
                       **{**modes, "seed": (modes["seed"] + 0x9E3779B1 * j) & 0x7FFFFFFF})
            for j, (a, b) in enumerate(runs)
        ]  # fmt: skip

    def _finish_setup(self) -> None:
        for flats in self._flat:
            for flat in flats:
                self._broadcast(flat)
        self._constructed = True

    def _broadcast(self, flat: FlatParams) -> None:
        """Every rank starts from rank 0's params (and a master that matches them)."""
        if self._world > 1:
            src = dist.get_global_rank(self._zero_group, 0)
            dist.broadcast(flat.param, src=src, group=self._zero_group)
        with torch.no_grad():
            flat.set_master_fp32(flat.param[flat.lo : flat.hi].float())  # the master is the param

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (a collective after construction: every rank adds the
        same params; rank 0's values are broadcast)."""
        if not getattr(self, "_constructed", False):
            super().add_param_group(param_group)
            self._grads.add(self._flat[-1])
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group = {**param_group, "params": _param_list(param_group["params"])}
        error = None
        try:
            self._validate_group({**self.defaults, **param_group}, len(self.param_groups))
        except Exception as e:
            error = e
        _check_ranks_agree(self, [param_group["params"]], first_group=len(self.param_groups), error=error)
        super().add_param_group(param_group)
        self._grads.add(self._flat[-1])
        for flat in self._flat[-1]:
            self._broadcast(flat)

    # ----------------------------------------------------------- gradient accumulation

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over micro-batches without synchronising, as
        ``DistributedDataParallel.no_sync``: use it around the backward of every
        micro-batch but the last. ``step()`` inside it raises."""
        self._grads.paused += 1
        try:
            yield
        finally:
            self._grads.paused -= 1

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: torch.Tensor | None = None):
        """One sharded step (see the module docstring); a collective: every rank
        calls it. Arguments as :meth:`tkern.optim.FusedAdamW.step`."""
        if self._grads.paused:
            raise RuntimeError(
                f"{type(self).__name__}.step() was called inside no_sync(): the gradients of the "
                "micro-batches would never be averaged across ranks; leave no_sync() for the last "
                "micro-batch's backward and step after it"
            )
        # The fused step itself, not FusedAdamW.step: torch wraps each optimizer class's step
        # with its hooks once that class is instantiated, and they must run once per step.
        return FusedOptimizer.step(self, closure, inv_scale=inv_scale)

    # ----------------------------------------------------------- the step's collectives

    def _sync_grads(self) -> None:
        """Reduce-scatter every flat gradient buffer not yet reduced while backward ran,
        and wait: this rank's shard gets the mean (see the module docstring)."""
        self._grads.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`tkern.optim.FusedAdamW.zero_grad`; reductions of the gradients
        being zeroed that are still in flight are waited for and dropped."""
        self._grads.discard()
        super().zero_grad(set_to_none)

    def _sync_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """Each rank read its own shard: combine the ranks' rows in rank order."""
        if self._world == 1:
            return stats
        return combine_stats(stats, self._zero_group, sharded=True)

    def _sync_params(self) -> None:
        """All-gather every rank's updated shard into the full param buffers (in place)."""
        if self._world == 1:
            return
        for flats in self._flat:
            for flat in flats:
                all_gather(flat.param, flat.param[flat.lo : flat.hi], group=self._zero_group)

    # ----------------------------------------------------------- checkpoints

    def _gather(self, buf: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of ``buf``, in rank order (integer buffers travel as bytes)."""
        if self._world == 1:
            return buf
        send = buf if buf.is_floating_point() else buf.view(torch.uint8)
        full = torch.empty(send.numel() * self._world, dtype=send.dtype, device=buf.device)
        all_gather(full, send, group=self._zero_group)
        return full.view(buf.dtype)

    def _export(self, flat: FlatParams) -> dict[str, torch.Tensor]:
        """The whole buffers, gathered from every rank's shard (a collective)."""
        return flat.export_fp32(self._gather)

    def _entry(self, flat: FlatParams, full: torch.Tensor, i: int) -> torch.Tensor:
        if self._world == 1:
            return flat.shard_view(full, i)
        return alias(full, flat.offsets[i], flat.numels[i], flat.params[i].shape)

    def _packed_groups(self) -> tuple[list[dict], dict[int, int]]:
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        return groups, index

    def state_dict(self) -> dict[str, Any]:
        """The FULL, unsharded state in :class:`~tkern.optim.FusedAdamW`'s (and
        torch.optim's) format, on EVERY rank: a collective (one all-gather per
        buffer), so every rank must call it. For W > 1 the tensors are fresh
        copies, not views of the live state. It loads into this class at any world
        size, into the single-process tkern optimizers and into torch.optim's
        SGD/Adam/AdamW."""
        return FusedOptimizer.state_dict(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard only (no communication): ``param_groups`` as in
        :meth:`state_dict`, and per flat buffer its layout, each param's step
        count, and the fp32 master/state shards (copies). Loads with
        :meth:`load_sharded_state_dict` on the same rank of the same world size
        over the same params."""
        groups, _ = self._packed_groups()
        shards = []
        for gi, flats in enumerate(self._flat):
            for flat in flats:
                shards.append(
                    {
                        "group": gi,
                        "dtype": str(flat.dtype).removeprefix("torch."),
                        "length": flat.param.numel(),
                        "lo": flat.lo,
                        "hi": flat.hi,
                        "step": [float(flat.steps[c]) for c in flat.cohort],
                        "master": flat.master.detach().clone() if flat.keeps_master else None,
                        "state": {k: v.detach().clone() for k, v in flat.state.items()},
                        "absmax": {k: v.detach().clone() for k, v in flat.absmax.items()},
                    }
                )
        return {"world_size": self._world, "rank": self._rank, "param_groups": groups, "shards": shards}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` returned on this rank. Everything
        is checked first; as with :meth:`load_state_dict`, the params' values
        are never changed (the loaded master is kept where a param equals it
        rounded and follows the param elsewhere)."""
        name = type(self).__name__
        if state_dict.get("world_size") != self._world or state_dict.get("rank") != self._rank:
            raise ValueError(
                f"{name}: this sharded state dict was saved by rank {state_dict.get('rank')} of "
                f"{state_dict.get('world_size')}, this is rank {self._rank} of {self._world}; "
                "use state_dict()/load_state_dict() to change the world size"
            )
        groups, shards = state_dict["param_groups"], state_dict["shards"]
        flats = [(gi, flat) for gi, fl in enumerate(self._flat) for flat in fl]
        if len(groups) != len(self.param_groups) or len(shards) != len(flats):
            raise ValueError(
                f"{name}: the sharded state dict has {len(groups)} param groups and {len(shards)} flat "
                f"buffers, this optimizer {len(self.param_groups)} and {len(flats)}"
            )
        new_groups = []
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups, strict=True)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"{name}: param group {gi} has {len(mine['params'])} params, "
                    f"the loaded one has {len(saved['params'])}"
                )
            group = {**mine, **{k: v for k, v in saved.items() if k != "params"}}
            self._validate_group(group, gi)
            new_groups.append(group)
        for (gi, flat), shard in zip(flats, shards, strict=True):
            layout = (gi, str(flat.dtype).removeprefix("torch."), flat.param.numel(), flat.lo, flat.hi)
            saved = (shard["group"], shard["dtype"], shard["length"], shard["lo"], shard["hi"])
            if layout != saved or len(shard["step"]) != len(flat.params):
                raise ValueError(f"{name}: flat buffer layout {saved} in the state dict, expected {layout}")
            names = self._group_state_names(new_groups[gi])
            missing = [n for n in names if n not in shard["state"]]
            if missing:
                raise KeyError(f"{name}: the sharded state of param group {gi} lacks {missing}")
            for n, value in shard["state"].items():
                if n in names and (value.numel() != flat.shard_size or value.dtype != flat.state_dtype):
                    raise ValueError(
                        f"{name}: shard {n!r} has {value.numel()} {value.dtype} elements, expected "
                        f"{flat.shard_size} {flat.state_dtype} (a sharded state dict keeps the compact "
                        "state: load it with the same state_dtype, or go through state_dict())"
                    )
            master = shard["master"]
            expected = flat.master if flat.keeps_master else None
            if (master is None) != (expected is None) or (
                master is not None and (master.dtype != expected.dtype or master.numel() != expected.numel())
            ):
                raise ValueError(
                    f"{name}: the sharded state dict's master does not match this optimizer's "
                    f"master={self.master!r}; load it with the same master mode, or go through state_dict()"
                )
        with torch.no_grad():
            for mine, group in zip(self.param_groups, new_groups, strict=True):
                mine.update(group)
            for (gi, flat), shard in zip(flats, shards, strict=True):
                names = self._group_state_names(self.param_groups[gi])
                flat.ensure_state(names)
                for n in names:
                    flat.state[n].copy_(shard["state"][n])
                    if n in flat.absmax:
                        flat.absmax[n].copy_(shard["absmax"][n])
                if shard["master"] is not None:
                    flat.master.copy_(shard["master"])
                flat.set_cohorts(shard["step"])
                flat.mark_dirty()
                self._refresh_state(flat)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_zero_group"] = None  # process groups do not travel
        return state


def _fused_class(cls: type) -> type:
    """The single-process optimizer a sharded class extends (the first fused class
    after _Sharded in its MRO)."""
    return next(c for c in cls.__mro__ if issubclass(c, FusedOptimizer) and not issubclass(c, _Sharded))


def _sharded_signature(cls: type) -> inspect.Signature:
    """The fused class's whole signature with the sharding's own keyword-only arguments."""
    own = inspect.signature(_Sharded.__init__).parameters
    return full_signature(
        _fused_class(cls),
        tuple(own[n] for n in ("process_group", "bucket_mb", "grad_sync_dtype", "overlap_grad_sync")),
    )


def _fmt(entry: Any) -> str:
    if entry == "nothing":
        return "nothing"
    if entry[0] == "not a tensor":
        return f"a {entry[1]}"
    shape, dtype, device = entry
    return f"shape {shape} dtype {dtype} on {device}"


def _sharded_doc(base: str, args: str, note: str = "") -> str:
    """The docstring of the sharded form of ``base`` (whose own arguments are ``args``)."""
    return f""":class:`~tkern.optim.{base}` sharded across the ranks of a process group
    (ZeRO-2; see :mod:`tkern.optim.distributed`).

    Args:
        {args},
            master, state_dtype, seed, cuda_graph: as :class:`~tkern.optim.{base}`
            ({note}``max_grad_norm`` clips by the global norm of the mean gradient;
            the shards hold the compact master and state; the statistics'
            collective is captured in the step's CUDA graph on NCCL; the
            reduce-scatter and all-gather run eager around it).
        {{sharding_options}}
    """


class DistributedFusedSGD(_Sharded, FusedSGD):
    __doc__ = _sharded_doc(
        "FusedSGD", "params, lr, momentum, dampening, weight_decay, nesterov, max_grad_norm, maximize"
    )


class DistributedFusedAdam(_Sharded, FusedAdam):
    __doc__ = _sharded_doc(
        "FusedAdam", "params, lr, betas, eps, weight_decay, amsgrad, max_grad_norm, maximize"
    )


class DistributedFusedAdamW(_Sharded, FusedAdamW):
    __doc__ = _sharded_doc(
        "FusedAdamW",
        "params, lr, betas, eps, weight_decay, amsgrad, max_grad_norm, maximize",
        "``weight_decay`` defaults to 1e-2; ",
    )


for _cls in (DistributedFusedSGD, DistributedFusedAdam, DistributedFusedAdamW):
    document_options(_cls, _sharded_signature(_cls))
del _cls
