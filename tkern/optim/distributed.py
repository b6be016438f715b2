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
``overlap_comm``, apex's ``overlap_grad_sync``), in one fixed order on every
rank, the last params' first; when backward ends they are waited for and the
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
this rank's shard (same world size) for models too large to gather.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tkern.flat import ALIGN, FlatParams, alias, describe_param, round_up
from tkern.kernels._update import QBLOCK
from tkern.kernels.overflow import combine_stats
from tkern.optim.adam import FusedAdam, FusedAdamW
from tkern.optim.fused import FusedOptimizer, full_signature
from tkern.optim.sgd import FusedSGD

__all__ = [
    "DistributedFusedAdam",
    "DistributedFusedAdamW",
    "DistributedFusedSGD",
    "run_local_processes",
    "teardown_process_group",
]

# torch renamed the tensor collectives (all_gather_into_tensor -> all_gather_single); take
# whichever this torch has.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def teardown_process_group() -> None:
    """Leave the default process group on every rank, cleanly.

    Garbage that still holds the group (an optimizer or DDP wrapper in a
    reference cycle) is collected first, the ranks wait for each other, the group
    is destroyed, and garbage is collected again. So gloo's C++ objects (its
    worker threads and the work they hold) are destroyed now, while the
    interpreter is alive: left to the interpreter's finalization, gloo can abort
    the process with "terminate called without an active exception", depending
    on when the collector happened to run (about one run in five on a 2-core
    machine). Call it once per process, after the last collective."""
    gc.collect()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def _local_process(
    rank: int, world: int, port: int, backend: str, pg_timeout_s: float, fn: Callable, args: tuple
) -> None:
    """One process of :func:`run_local_processes`: join the group through the
    parent's store, run ``fn``, leave the group cleanly."""
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if backend == "nccl":
        import torch.cuda

        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    del store  # the process group holds it
    try:
        fn(rank, world, *args)
    finally:
        teardown_process_group()


def run_local_processes(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout_s: float | None = None,
    pg_timeout_s: float = 600.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` spawned local processes,
    each a member of one default process group (``backend``: ``"gloo"``, or
    ``"nccl"`` with one GPU per rank).

    The parent hosts the group's TCPStore on a port the OS assigns when it
    binds (no free-port guess another process could take first) and keeps it
    until every process has exited, so no rank ever outlives the store it tears
    down through. Each process leaves the group with
    :func:`teardown_process_group`. ``fn`` must be picklable (a module-level
    function). Every process is joined; with ``timeout_s``, one still alive
    after it is killed by PID and :class:`TimeoutError` raised. ``pg_timeout_s``
    is the group's own timeout for a collective. A process that raised or
    died raises here (torch.multiprocessing's ``ProcessRaisedException`` /
    ``ProcessExitedException``) after the others are stopped."""
    import torch.multiprocessing as mp

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timeout)
    ctx = mp.start_processes(
        _local_process,
        args=(nprocs, store.port, backend, pg_timeout_s, fn, tuple(args)),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} local processes still running after {timeout_s:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        del store  # only now: every process has exited


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
) -> None:
    """For a sharded optimizer ``opt`` being built or given a param group: one
    all_gather_object of every rank's param shapes/dtypes/devices and of
    its local ``error``; a mismatch or an error on any rank raises on every
    rank (the rank that had the error raises it; the others a ValueError
    naming that rank)."""
    problem = _local_problem(groups, first_group)
    if problem is None and error is not None:
        problem = f"{type(error).__name__}: {error}"
    mine = {"params": [[_describe_entry(p) for p in g] for g in groups], "problem": problem}
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


def bucket_runs(sizes: list[int], capacity: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[a, b)`` of ``sizes`` whose sum stays within ``capacity``
    (a single size above it is a run of its own)."""
    runs, start, filled = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and filled + n > capacity:
            runs.append((start, i))
            start, filled = i, 0
        filled += n
    runs.append((start, len(sizes)))
    return runs


class _BucketHook:
    """Post-accumulate-grad hook of param ``index`` of a bucket: tells the
    :class:`_GradSync` (held weakly: a hook never keeps an optimizer alive)."""

    __slots__ = ("sync", "flat", "index")

    def __init__(self, sync: _GradSync, flat: FlatParams, index: int) -> None:
        self.sync, self.flat, self.index = weakref.ref(sync), weakref.ref(flat), index

    def __call__(self, p: torch.Tensor) -> None:
        sync, flat = self.sync(), self.flat()
        if sync is not None and flat is not None:
            sync.grad_ready(flat, self.index)


class _GradSync:
    """The gradient reduce-scatter of a sharded optimizer, one bucket (one flat
    buffer) at a time, so that this rank's shard of each bucket ends up holding
    the mean gradient over the ranks.

    With ``overlap`` a bucket's collective is issued (``async_op=True``) from the
    post-accumulate-grad hook of the last of its params to get its gradient, while
    backward goes on with the earlier layers; buckets are issued in one fixed
    order (the last params' first, as backward reaches them) on every rank, a
    bucket waiting for the ones before it. At the end of that backward (a callback
    queued on autograd's engine, as DDP's) every collective is waited for and its
    result written into this rank's shard: when backward returns the shards hold
    the mean, as DDP's gradients do, so what is done to ``.grad`` between
    backward and step (``GradScaler.unscale_``, an edit) acts on the mean.
    :meth:`finish` (at the start of ``step()``) reduces what the hooks did not
    (buckets with a param that got no gradient; gradients written by hand).
    Without ``overlap`` every bucket is issued in :meth:`finish`: the same
    collectives on the same data, so the same bits.
    """

    def __init__(self, group: Any, world: int, bucket_bytes: int, sync_fp32: bool, overlap: bool) -> None:
        self.group, self.world = group, world
        self.bucket_bytes, self.sync_fp32, self.overlap = bucket_bytes, sync_fp32, overlap
        #: ``no_sync()`` depth: backward hooks only accumulate while it is positive
        self.paused = 0
        #: the buckets in the order they are reduced: the last-built (the last params) first
        self.buckets: list[FlatParams] = []
        self._index: dict[int, int] = {}
        self._members: list[int] = []
        self._reset()

    def _reset(self) -> None:
        self._seen: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0  # buckets[:_next] are reduced (or in flight) for this step
        self._pending: list[tuple[FlatParams, list]] = []
        self._queued = False  # the end-of-backward callback of this backward

    def add(self, flats: list[FlatParams]) -> None:
        """Take the buckets of a new param group (between steps) and hook their params."""
        self.discard()
        self.buckets = flats[::-1] + self.buckets
        self._index = {id(f): k for k, f in enumerate(self.buckets)}
        self._members = [sum(p.requires_grad for p in f.params) for f in self.buckets]
        self._reset()
        if self.overlap and self.world > 1:
            for flat in flats:  # after the flat buffer's own hooks, which put .grad back as the view
                for i, p in enumerate(flat.params):
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(_BucketHook(self, flat, i))

    def grad_ready(self, flat: FlatParams, i: int) -> None:
        """Param ``i`` of ``flat`` has its gradient of this backward."""
        k = self._index.get(id(flat))
        if k is None:
            return
        if k < self._next:
            raise RuntimeError(
                f"{describe_param(flat.group, flat.indices[i], flat.params[i])}: a second backward reached "
                "gradients that were reduce-scattered when the first one ended (overlap_grad_sync=True); "
                "accumulate micro-batches with `with opt.no_sync():` around all but the last backward, or "
                "pass overlap_grad_sync=False"
            )
        if self.paused:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._complete)
            self._queued = True
        self._seen[k].add(i)
        while self._next < len(self.buckets) and len(self._seen[self._next]) == self._members[self._next]:
            self._issue(self._next)

    def _issue(self, k: int) -> None:
        with torch.no_grad():
            self._pending.append((self.buckets[k], self._start(self.buckets[k])))
        self._next = k + 1

    def _start(self, flat: FlatParams) -> list[tuple[Any, torch.Tensor, int, int]]:
        """Issue ``flat``'s reduce-scatter (async): ``(work, received, a, b)`` per piece,
        ``received`` the sum of the ranks' shards for ``[lo + a, lo + b)`` (already
        divided by W where each rank's gradient was). The gradient buffer is only read."""
        w, size = self.world, flat.shard_size
        if not self.sync_fp32 or flat.dtype == torch.float32:
            # 16-bit gradients summed in their own dtype are divided by W first: each share
            # <= max / W, so the sum cannot overflow where they are finite
            send = flat.grad if flat.dtype == torch.float32 else flat.grad / w
            recv = torch.empty(size, dtype=flat.dtype, device=flat.device)
            work = _reduce_scatter(recv, send, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return [(work, recv, 0, size)]
        rows = flat.grad.view(w, size)
        chunk = max(ALIGN, self.bucket_bytes // (4 * w) // ALIGN * ALIGN)
        pieces = []
        for a in range(0, size, chunk):
            b = min(size, a + chunk)
            send = torch.empty((w, b - a), dtype=torch.float32, device=flat.device)
            send.copy_(rows[:, a:b])
            recv = torch.empty(b - a, dtype=torch.float32, device=flat.device)
            work = _reduce_scatter(recv, send.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            pieces.append((work, recv, a, b))
        return pieces

    def discard(self) -> None:
        """Wait for what is in flight and drop it (``zero_grad``, a new param group)."""
        for _, pieces in self._pending:
            for work, *_ in pieces:
                work.wait()
        self._reset()

    def _complete(self) -> None:
        """Wait for the collectives in flight and write each rank's shard of the mean
        into the gradient buffers."""
        self._queued = False
        with torch.no_grad():
            for flat, pieces in self._pending:
                for work, recv, a, b in pieces:
                    work.wait()
                    if recv.dtype == torch.float32:
                        recv.div_(self.world)
                    flat.grad[flat.lo + a : flat.lo + b].copy_(recv)
        self._pending = []

    def finish(self) -> None:
        """Reduce every bucket the hooks did not and wait (a collective)."""
        if self.world == 1:
            return
        while self._next < len(self.buckets):
            self._issue(self._next)
        self._complete()
        self._reset()

    def __getstate__(self) -> dict[str, Any]:
        """A copy is inert: its params carry no hooks and process groups do not travel."""
        state = dict(self.__dict__)
        state.update(group=None, world=1, _pending=[])
        return state


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
        probe = lambda p: fused(p, *args, **kwargs)  # noqa: E731
        if not isinstance(overlap_grad_sync, bool):
            raise TypeError(f"overlap_grad_sync must be a bool, got {overlap_grad_sync!r}")
        params = self._setup(params, process_group, bucket_mb, grad_sync_dtype, probe)
        self._grads = _GradSync(self._zero_group, self._world, self._bucket_bytes, self._sync_fp32,
                                overlap_grad_sync)  # fmt: skip
        fused.__init__(self, params, *args, **kwargs)
        self._finish_setup()

    # Set by _setup before the fused optimizer's constructor runs.
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
        self._more_buckets: dict[int, list[FlatParams]] = {}
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
        _check_ranks_agree(self, lists, error=error)
        return params

    def _make_flat(self, params, indices, group, names, modes) -> FlatParams:
        """The fused optimizer asks for one flat buffer per kind of param; the sharded one
        keeps one per bucket of consecutive params (at most ``bucket_mb`` of fp32, a bigger
        param alone), so that a bucket's reduce-scatter is one contiguous collective whose
        pieces land in each rank's shard of it. The first is returned; the others wait in
        ``_more_buckets`` until :meth:`add_param_group` puts them after it."""
        align = QBLOCK if modes["state_dtype"] == torch.uint8 else ALIGN
        runs = bucket_runs([round_up(p.numel(), align) for p in params], self._bucket_bytes // 4)
        flats = [
            FlatParams(params[a:b], indices[a:b], group, names, world_size=self._world, rank=self._rank,
                       **{**modes, "seed": (modes["seed"] + 0x9E3779B1 * j) & 0x7FFFFFFF})
            for j, (a, b) in enumerate(runs)
        ]  # fmt: skip
        self._more_buckets[id(flats[0])] = flats[1:]
        return flats[0]

    def _place_buckets(self) -> None:
        """Put the last param group's extra buckets after their first, and hand them all to
        the gradient sync."""
        firsts = self._flat[-1]
        self._flat[-1] = [f for first in firsts for f in (first, *self._more_buckets.pop(id(first)))]
        for flat in self._flat[-1]:
            if all(flat is not f for f in firsts):
                self._refresh_state(flat)
        self._grads.add(self._flat[-1])

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
            self._place_buckets()
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
        self._place_buckets()
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
                _all_gather(flat.param, flat.param[flat.lo : flat.hi], group=self._zero_group)

    # ----------------------------------------------------------- checkpoints

    def _gather(self, buf: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of ``buf``, in rank order (integer buffers travel as bytes)."""
        if self._world == 1:
            return buf
        send = buf if buf.is_floating_point() else buf.view(torch.uint8)
        full = torch.empty(send.numel() * self._world, dtype=send.dtype, device=buf.device)
        _all_gather(full, send, group=self._zero_group)
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


class DistributedFusedSGD(_Sharded, FusedSGD):
    """:class:`~tkern.optim.FusedSGD` sharded across the ranks of a process group
    (ZeRO-2; see :mod:`tkern.optim.distributed`).

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov, max_grad_norm,
            maximize, master, state_dtype, seed: as :class:`~tkern.optim.FusedSGD`
            (``max_grad_norm`` clips by the global norm of the mean gradient;
            the shards hold the compact master and state).
        process_group: the ranks to shard over; None (default) for the default group.
        bucket_mb: the gradient buckets' size: at most this many MiB of fp32 (a param
            bigger than that is a bucket of its own, reduced in pieces of this size).
        grad_sync_dtype: ``torch.float32`` (default): the gradients are summed in fp32;
            None: in their own dtype, each pre-divided by W (half the bytes on the wire
            for fp16/bf16; each rank's share is rounded once, and shares below the
            dtype's smallest subnormal times W flush to zero).
        overlap_grad_sync: True (default): reduce-scatter each bucket from the backward
            hooks as soon as its gradients are complete, overlapping the communication
            with the rest of backward; False: every bucket inside ``step()``. The same
            results, bit for bit.
    """


class DistributedFusedAdam(_Sharded, FusedAdam):
    """:class:`~tkern.optim.FusedAdam` sharded across the ranks of a process group
    (ZeRO-2; see :mod:`tkern.optim.distributed`). Arguments: those of
    :class:`~tkern.optim.FusedAdam` and the sharding's own, ``process_group``,
    ``bucket_mb``, ``grad_sync_dtype`` and ``overlap_grad_sync``, as
    :class:`DistributedFusedSGD`."""


class DistributedFusedAdamW(_Sharded, FusedAdamW):
    """:class:`~tkern.optim.FusedAdamW` sharded across the ranks of a process group
    (ZeRO-2; see :mod:`tkern.optim.distributed`). Arguments as
    :class:`DistributedFusedAdam` (``weight_decay`` defaults to 1e-2)."""


for _cls in (DistributedFusedSGD, DistributedFusedAdam, DistributedFusedAdamW):
    _cls.__signature__ = _sharded_signature(_cls)
del _cls
