"""The gradient reduce-scatter of the sharded (ZeRO-2) optimizers, one bucket at a
time: :class:`GradSync` issues each bucket's collective from the backward hooks
(``overlap_grad_sync``) or inside ``step()``, and writes this rank's shard of the
mean gradient (see :mod:`tkern.optim.distributed`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from tkern.flat import ALIGN, FlatParams, describe_param

__all__ = ["BucketHook", "GradSync", "all_gather", "bucket_runs", "reduce_scatter", "shared_seed"]

# torch renamed the tensor collectives (all_gather_into_tensor -> all_gather_single); take
# whichever this torch has.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shared_seed(seed: int, group: Any = None) -> int:
    """Rank 0's ``seed`` on every rank of ``group`` (None: the default group), by one
    broadcast: a collective every rank of the group calls. ``seed`` itself where
    torch.distributed is not initialized or the group has one rank.

    Stochastic rounding draws from the seed: ranks that seed torch differently would
    otherwise round their replicas (DDP) differently and save different state dicts."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return seed
    group = group if group is not None else dist.group.WORLD
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())


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


class BucketHook:
    """Post-accumulate-grad hook of param ``index`` of a bucket: tells the
    :class:`GradSync` (held weakly: a hook never keeps an optimizer alive)."""

    __slots__ = ("sync", "flat", "index")

    def __init__(self, sync: GradSync, flat: FlatParams, index: int) -> None:
        self.sync, self.flat, self.index = weakref.ref(sync), weakref.ref(flat), index

    def __call__(self, p: torch.Tensor) -> None:
        sync, flat = self.sync(), self.flat()
        if sync is not None and flat is not None:
            sync.grad_ready(flat, self.index)


class GradSync:
    """The gradient reduce-scatter of a sharded optimizer, one bucket (one flat
    buffer) at a time, so that this rank's shard of each bucket ends up holding
    the mean gradient over the ranks.

    With ``overlap`` a bucket's collective is issued (``async_op=True``) from the
    post-accumulate-grad hook of the last of its params to get its gradient, while
    backward goes on with the earlier layers. Buckets are issued in one order on
    every rank (collectives must match), a bucket waiting for the ones before it:
    at first the last params' first, then the order in which their gradients
    completed in the first backward with hooks (rank 0's, broadcast once in the
    next :meth:`finish`), so a bucket that completes late (fp32 norms spread over
    every block of a converted model) holds up no bucket that completed before it.
    At the end of that backward (a callback
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
        #: the completion order seen in this step's backward (bucket indices), and
        #: whether it is still to be learned (until the first finish() after add())
        self._learning = False
        self._reset()

    def _reset(self) -> None:
        self._seen: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0  # buckets[:_next] are reduced (or in flight) for this step
        self._completed: list[int] = []  # buckets in the order their gradients completed
        self._pending: list[tuple[FlatParams, list]] = []
        self._queued = False  # the end-of-backward callback of this backward

    def add(self, flats: list[FlatParams]) -> None:
        """Take the buckets of a new param group (between steps) and hook their params."""
        self.discard()
        self.buckets = flats[::-1] + self.buckets
        self._index = {id(f): k for k, f in enumerate(self.buckets)}
        self._members = [sum(p.requires_grad for p in f.params) for f in self.buckets]
        self._learning = True
        self._reset()
        if self.overlap and self.world > 1:
            for flat in flats:  # after the flat buffer's own hooks, which put .grad back as the view
                for i, p in enumerate(flat.params):
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(BucketHook(self, flat, i))

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
        if len(self._seen[k]) == self._members[k]:
            self._completed.append(k)
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
            work = reduce_scatter(recv, send, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return [(work, recv, 0, size)]
        rows = flat.grad.view(w, size)
        chunk = max(ALIGN, self.bucket_bytes // (4 * w) // ALIGN * ALIGN)
        pieces = []
        for a in range(0, size, chunk):
            b = min(size, a + chunk)
            send = torch.empty((w, b - a), dtype=torch.float32, device=flat.device)
            send.copy_(rows[:, a:b])
            recv = torch.empty(b - a, dtype=torch.float32, device=flat.device)
            work = reduce_scatter(recv, send.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
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
        if self._learning and self.overlap:
            self._learn_order()
        self._reset()

    def _learn_order(self) -> None:
        """Reorder the buckets as their gradients completed in this step's backward
        (rank 0's order, broadcast: a collective every rank makes at the same step)."""
        n = len(self.buckets)
        seen = list(dict.fromkeys(self._completed))
        order = seen + [k for k in range(n) if k not in seen]
        order = torch.tensor(order, dtype=torch.int64, device=self.buckets[0].device)  # NCCL: on the device
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(order, src=src, group=self.group)
        self.buckets = [self.buckets[k] for k in order.tolist()]
        self._members = [self._members[k] for k in order.tolist()]
        self._index = {id(f): k for k, f in enumerate(self.buckets)}
        self._learning = False

    def __getstate__(self) -> dict[str, Any]:
        """A copy is inert: its params carry no hooks and process groups do not travel."""
        state = dict(self.__dict__)
        state.update(group=None, world=1, _pending=[])
        return state
