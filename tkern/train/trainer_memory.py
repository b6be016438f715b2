"""The trainer's memory accounting: the bytes a model, its optimizer's state and its
gradients hold on this rank, and the activations autograd saves for backward.

:meth:`tkern.Trainer.memory_report` is :func:`memory_report` of its parts; the first
training step's forward runs under :class:`ActivationMeter` (on CPU the only measure of
activations: there is no allocator peak to read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tkern.optim.report import MemoryReport

__all__ = ["TRAINER_BYTES", "ActivationMeter", "local_shard", "memory_report", "tensor_bytes"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: an FSDP2 (DTensor) param's local shard, else ``t``."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors`` on this rank, counting each storage once."""
    seen, total = set(), 0
    for t in tensors:
        storage = local_shard(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class ActivationMeter:
    """Counts the bytes autograd saves for backward during one forward of a model
    (its parameters, which autograd saves too, are not activations).

    ``with meter.measure(model): loss = ...`` sets :attr:`bytes`; 0 until a forward was measured.
    """

    def __init__(self) -> None:
        #: bytes the last measured forward saved for backward
        self.bytes = 0

    @contextmanager
    def measure(self, model: nn.Module) -> Iterator[None]:
        """Count what autograd saves for backward inside the ``with`` block."""
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        params = {local_shard(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes = tensor_bytes(t for t in saved if t.untyped_storage().data_ptr() not in params)


#: The trainer report's byte counts, in the order they print.
TRAINER_BYTES = ("model", "optimizer", "grads", "graphs", "activations", "total")


def memory_report(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    activation_bytes: int,
    graph_bytes: int = 0,
    graph_allocated: int | None = None,
) -> MemoryReport:
    """Bytes used: ``model`` (params and buffers), ``optimizer`` (fp32
    master and state), ``grads``, ``graphs`` (``graph_bytes``: what the CUDA graphs'
    memory pools reserve, the optimizer's step graph's included), ``activations`` (peak
    on CUDA, from ``torch.cuda.max_memory_allocated``, less the rest in allocated bytes:
    of the graphs' pools ``graph_allocated``, default ``graph_bytes``; on CPU
    ``activation_bytes``, the tensors saved for backward in a measured forward) and
    ``total``. A :class:`~tkern.optim.report.MemoryReport`: ints in bytes; ``print``
    gives MiB."""
    model_bytes = tensor_bytes(list(model.parameters()) + list(model.buffers()))
    params = {id(p) for p in model.parameters()}
    state = [
        v
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and id(v) not in params
    ]
    optimizer_bytes = tensor_bytes(state)
    grads = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        in_graphs = graph_bytes if graph_allocated is None else graph_allocated
        activations = max(peak - model_bytes - optimizer_bytes - grads - in_graphs, 0)
    else:
        activations = activation_bytes
    sizes = [model_bytes, optimizer_bytes, grads, graph_bytes, activations]
    return MemoryReport(dict(zip(TRAINER_BYTES, [*sizes, sum(sizes)], strict=True)), TRAINER_BYTES)
