"""The fused optimizers' step as a CUDA graph (:mod:`tkern.graphs`): :class:`GraphedStep`
runs the device part of a step eager or through :class:`tkern.graphs.StepGraphs`
(captured when a step's stamp, :func:`step_stamp`, repeats the last one's, replayed
while it stays), and keeps the account of how the steps ran."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from tkern.graphs import (
    EAGER,
    WARMUP,
    CaptureError,
    CudaGraphCapture,
    GraphCapture,
    StepGraphs,
    capture_failed,
    key_value,
)

__all__ = ["GraphedStep", "step_stamp"]


def step_stamp(opt: Any, args: list[dict], found_inf: torch.Tensor | None) -> tuple:
    """What the step's graph bakes in: the groups' hyperparameters as the kernels take
    them (a device lr by the tensor the group holds, which replays read in place:
    :func:`tkern.graphs.key_value`), the planned ranges, whether a GradScaler hands
    over found_inf, the size up to which the step runs in one program and the one-pass mode."""

    def frozen(group: dict, key: str, value: Any) -> Any:
        return key_value(group[key] if isinstance(value, torch.Tensor) else value)

    hyper = tuple(
        tuple(sorted((k, frozen(g, k, v)) for k, v in a.items()))
        for g, a in zip(opt.param_groups, args, strict=True)
    )
    plans = tuple(flat.plan_version for flats in opt.flat_buffers for flat in flats)
    one_pass = (getattr(opt, "one_pass_max_elements", None), getattr(opt, "one_pass", None))
    return hyper, plans, found_inf is not None, one_pass


class GraphedStep:
    """One concern of a fused optimizer (mixed into :class:`tkern.optim.FusedOptimizer`):
    whether and how its step runs as a CUDA graph. ``cuda_graph``,
    ``graph_fallback``, ``graph_capture``, ``graph_runner`` and ``graph_counts`` are
    the optimizer's public attributes."""

    def _init_graphs(self, cuda_graph: bool | None) -> None:
        if cuda_graph not in (None, True, False):
            raise TypeError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
        #: Replay the step as one CUDA graph (None: wherever it can be, i.e. on CUDA).
        self.cuda_graph = cuda_graph
        #: Why the last step was not a replay of its graph (None if it was). After a
        #: failed capture it stays that failure's reason for every later step (the
        #: graphs are off from then on), never the bare "cuda_graph=False".
        self.graph_fallback: str | None = None
        #: Why a capture of this optimizer's step failed (None while none has): the
        #: first failure, kept for good, whatever later steps say.
        self.graph_failure: str | None = None
        #: What captures and replays the step (:class:`tkern.graphs.CudaGraphCapture`).
        self.graph_capture: GraphCapture = CudaGraphCapture()
        self._graph = self._new_graphs()

    @staticmethod
    def _new_graphs() -> StepGraphs:
        # one graph (a new stamp drops it); one warm-up: the step that first brings a
        # stamp runs eager, through the static inputs; the next one with it captures
        return StepGraphs(CudaGraphCapture(), warmup_steps=1, max_graphs=1)

    @property
    def graph_runner(self) -> GraphCapture:
        """:attr:`graph_capture` under its former name."""
        return self.graph_capture

    @graph_runner.setter
    def graph_runner(self, seam: GraphCapture) -> None:
        self.graph_capture = seam

    @property
    def graph_pool_bytes(self) -> int:
        """The memory the step's CUDA graph holds in its pool (0 while none is captured)."""
        return self._graph.pool_bytes

    @property
    def graph_counts(self) -> Counter[str]:
        """How the steps ran: ``warmup`` (a new stamp: eager, through the graph's static
        inputs), ``capture`` (captured, then replayed), ``replay``, ``eager`` (not
        graphed: :attr:`graph_fallback` says why)."""
        return self._graph.counts

    def _graph_blocker(self, collectives: bool, device: torch.device | None) -> str | None:
        """Why this step runs eager rather than as a CUDA graph (None: it may be graphed);
        ``collectives``: whether the step runs any (process_group, ZeRO-2, FSDP2's mesh).
        The statistics' collectives run inside the graph where the seam can capture them
        (NCCL's, :meth:`tkern.graphs.CudaGraphCapture.collectives_blocker`); ZeRO-2's
        reduce-scatter before the step and all-gather after it run eager around it."""
        if self.cuda_graph is False:
            # the graphs turned off by a failed capture: that failure is the reason
            return getattr(self, "graph_failure", None) or "cuda_graph=False"
        seam = self.graph_runner
        if collectives:
            check = getattr(seam, "collectives_blocker", None)
            reason = (
                "the step's collectives (process_group, ZeRO-2, FSDP2's mesh) run eager"
                if check is None
                else check(self.collective_groups())
            )
            if reason is not None:
                return reason
        return seam.blocker(device)

    def collective_groups(self) -> list:
        """The process groups the step's statistics are combined over (empty: none)."""
        groups = [getattr(self, "_process_group", None), getattr(self, "shard_group", None)]
        storage = getattr(self, "_dtensor_storage", None)
        if storage is not None:
            groups += list(storage.groups.groups)
        return [g for g in groups if g is not None]

    def _run_step(
        self,
        device_step: Callable[..., torch.Tensor],
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor | None,
        stamp: Callable[[], tuple],
        blocker: str | None,
    ) -> torch.Tensor:
        """``device_step(inv_scale[, found_inf])`` (everything the step does on the
        device; returns the statistics) eager where ``blocker`` says why, else through
        the step's graph (:class:`tkern.graphs.StepGraphs`): captured when a step's
        ``stamp()`` repeats the last one's, replayed while it stays. 1 / loss scale and
        found_inf are copied into static buffers for every step, the eager warm-up
        included, so the capture launches what the warm-up ran. A capture that fails
        warns once and turns the graphs off for this optimizer; its reason stays in
        :attr:`graph_failure` and :attr:`graph_fallback` (``TKERN_GRAPH_STRICT=1``
        re-raises it).

        The statistics returned after a capture or replay are a copy of the graph's
        static output, made on the device after the replay (three fp32 values): each
        step's ``grad_stats`` is its own tensor, which a later replay does not
        overwrite, as in an eager step."""
        if blocker is not None:
            self.graph_fallback = blocker
            self._graph.counts[EAGER] += 1
            return device_step(inv_scale, found_inf)
        inputs = (inv_scale,) if found_inf is None else (inv_scale, found_inf)
        graphs = self._graph
        graphs.seam = self.graph_capture
        try:
            stats, how = graphs.run(device_step, inputs, stamp)
        except CaptureError as e:  # any capture failure: eager from now on
            self.cuda_graph = False
            self.graph_fallback = f"{capture_failed('the step', e)}; running eager"
            if getattr(self, "graph_failure", None) is None:
                self.graph_failure = self.graph_fallback
            warnings.warn(f"{type(self).__name__}: {self.graph_fallback}", stacklevel=4)
            graphs.reset()
            graphs.counts[EAGER] += 1
            return device_step(inv_scale, found_inf)
        if how == WARMUP:
            self.graph_fallback = (
                "the step's launches changed since the last step (it is captured when they repeat)"
            )
            return stats
        self.graph_fallback = None
        # the graph's output is static (every replay rewrites it): the step's own copy
        return stats.clone()
