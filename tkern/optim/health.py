"""Mixed-precision health of a fused optimizer's gradients, recorded by the step on the
device and read on demand: which tensors held inf or nan (opt-in overflow tracking, in the
statistics pass), and the sampled fraction of each tensor's gradient that is zero or
subnormal in 16 bits. :class:`GradHealth` is the part of
:class:`~tkern.optim.fused.FusedOptimizer` that keeps these records and reports them
(:meth:`~GradHealth.overflow_report`, :mod:`tkern.optim.report` formats them)."""

from __future__ import annotations

import warnings

import torch

from tkern.flat import FlatParams
from tkern.graphs import in_graph_step
from tkern.kernels._update import UpdateBuffers
from tkern.kernels.overflow import N_COUNTS, OverflowFlags, UnderflowCounts, grad_underflow
from tkern.optim.report import OverflowReport, overflow_report

__all__ = ["GradHealth"]


class GradHealth:
    """The overflow and underflow records of a fused optimizer: where the statistics pass
    marks the params whose gradients overflow (:attr:`track_overflows`), the sampled
    zero/subnormal counts (:meth:`track_underflows`), the params' names, and the report.

    Uses the optimizer's flat buffers (``_flat``), ``param_groups``, step number
    (``_steps_run``), statistics (``grad_stats``), device and the step's planned flat
    buffers (``_plan_flats``); :meth:`_init_health` sets its own attributes."""

    _flat: list[list[FlatParams]]
    _plan_flats: dict[int, FlatParams]
    _steps_run: int
    _device: torch.device | None
    grad_stats: torch.Tensor | None
    param_groups: list[dict]

    def _init_health(self) -> None:
        """No records, tracking off (the constructor's)."""
        #: Which params overflowed: per flat buffer (by id) its layout version, the params'
        #: start offsets and their int32 flags (see :meth:`overflow_report`).
        self._overflow_flags: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # flags: (2, P)
        self._param_names: dict[tuple[int, int], str] = {}
        #: Whether the statistics pass records which params' gradients overflow (for
        #: :meth:`overflow_report`). Off by default, so a step pays nothing for it;
        #: :meth:`name_params` turns it on, as may a user (``opt.track_overflows = True``).
        self.track_overflows = False
        #: Every how many steps the gradients are sampled for zeros and subnormals (None:
        #: never; see :meth:`track_underflows`); per flat buffer (by id) its layout version,
        #: the params' ends and their (P, N_COUNTS) int64 counts; the last sampled step's
        #: number and (4,) fp32 statistics and inv_scale.
        self._underflow_every: int | None = None
        self._underflow_counts: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._underflow_meta: tuple[int, torch.Tensor] | None = None

    def _copied_health(self, state: dict) -> None:
        """For a copy's ``__getstate__``: the records keyed by the flat buffers' ids are
        allocated anew (the copy's buffers have other ids)."""
        state["_overflow_flags"] = {}
        state["_underflow_counts"] = {}
        state["_underflow_meta"] = None

    def _tracking(self, work: list) -> list[OverflowFlags] | None:
        """Where pass 1 marks the overflowing params of each planned range of whole
        gradients (``work``: the step's (args, plan, stats group) triples), or None when
        :attr:`track_overflows` is off."""
        if not self.track_overflows:
            return None
        # a captured step would replay this step's stamp: graphs mark a scratch buffer (the
        # same launch as the warm-ups', so the capture compiles nothing) and record no overflows
        scratch = in_graph_step()
        return [self._track(plan, b, scratch) for _, plan, g in work if g is None for b in plan]

    def _sample_underflows(self, work: list, inv_scale: torch.Tensor) -> None:
        """After a step: count the zeros and subnormals if this step is sampled (not inside
        another graph; eager or replayed, it leaves the gradients as they were)."""
        every = self._underflow_every
        if every is not None and self._steps_run % every == 0 and not in_graph_step():
            self._count_underflows(work, self.grad_stats, inv_scale)

    def _stamp(self) -> int:
        """The number the overflow flags of this step get: the step's, in [1, 2**31)."""
        return (self._steps_run - 1) % (2**31 - 1) + 1

    def _segments(self, flat: FlatParams) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``flat``'s layout version, its params' (P,) int64 start offsets and their (2, P)
        int32 overflow flags, allocated once per layout."""
        held = self._overflow_flags.get(id(flat))
        if held is None or held[0] != flat.layout_version:
            starts = torch.tensor(flat.offsets[: len(flat.params)], dtype=torch.int64, device=self._device)
            flags = torch.zeros((2, len(flat.params)), dtype=torch.int32, device=self._device)
            held = self._overflow_flags[id(flat)] = (flat.layout_version, starts, flags)
        return held

    def _track(self, plan: list, b: UpdateBuffers, scratch: bool) -> OverflowFlags:
        """Where pass 1 marks the params of ``b`` (a range of ``plan``'s flat buffer)
        whose gradients overflow: the flat buffer's flags (``scratch``: a buffer nobody
        reads)."""
        held = self._segments(self._plan_flats[id(plan)])
        return OverflowFlags(starts=held[1], flags=held[2][int(scratch)], base=b.offset)

    def _count_underflows(self, work: list, stats: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """A sampled step, after its device work: count the zeros and subnormals of every
        planned range's gradients (whole ones; FSDP2's shards are not sampled) per param,
        into counts zeroed first, and keep the step's statistics and inv_scale beside them
        (device copies, no sync). Launched eagerly after the step's graph replays too, so
        the graph stays the same whether or not a step is sampled."""
        for held in self._underflow_counts.values():
            held[2].zero_()  # a buffer out of this step's plan reports nothing counted
        grads, into = [], []
        for _, plan, group in work:
            if group is not None:
                continue
            flat = self._plan_flats[id(plan)]
            starts = self._segments(flat)[1]
            held = self._underflow_counts.get(id(flat))
            if held is None or held[0] != flat.layout_version:
                n = len(flat.params)
                ends = [o + k for o, k in zip(flat.offsets[:n], flat.numels, strict=True)]
                held = self._underflow_counts[id(flat)] = (
                    flat.layout_version,
                    torch.tensor(ends, dtype=torch.int64, device=self._device),
                    torch.zeros((n, N_COUNTS), dtype=torch.int64, device=self._device),
                )
            for b in plan:
                grads.append(b.grad)
                into.append(UnderflowCounts(starts=starts, ends=held[1], counts=held[2], base=b.offset))
        grad_underflow(grads, into)
        self._underflow_meta = (self._steps_run, torch.cat([stats, inv_scale.reshape(1)]))

    def name_params(self, model: torch.nn.Module) -> None:
        """Name the params after ``model.named_parameters()``, for
        :meth:`overflow_report` (without it a param is named by its group, index
        and shape), and turn :attr:`track_overflows` on. Params of ``model`` the
        optimizer does not hold are ignored."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"name_params takes a torch.nn.Module, got {type(model).__name__}")
        self.track_overflows = True
        where = {
            id(p): (gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
        }
        for name, p in model.named_parameters():
            if id(p) in where:
                self._param_names[where[id(p)]] = name

    def track_underflows(self, every: int | None) -> None:
        """Sample the gradients every ``every`` steps (the steps whose number is a
        multiple of it; None: never, the default) for the fraction of each tensor's
        gradient that is exactly zero and that is subnormal in its 16-bit dtype, as
        stored (scaled, before unscaling: what loss scaling protects). A sampled step
        adds one launch per planned range after its device work (a read of the 16-bit
        gradients, 2 B a param for fp16/bf16; a CUDA-graphed step replays its graph as
        before and the launches follow it), and a few tiny ones (zeroing the counts,
        copying the step's statistics); the other steps pay one integer test. Steps
        inside another graph (``Trainer(cuda_graph=True)``) and FSDP2's sharded params
        are not sampled (a warning says so when that leaves nothing to sample). A step
        after a scaler's ``unscale_`` (to clip by hand) samples unscaled gradients and
        the report reads them as carrying a scale of 1: clip with ``max_grad_norm=``
        instead (it leaves the stored gradients scaled).
        :meth:`overflow_report` reads the last sampled step's fractions
        (``zero_fraction``, ``subnormal_fraction``) and
        :meth:`~tkern.optim.report.OverflowReport.scale_too_low`. Turns
        :attr:`track_overflows` on (the report needs it).

        Raises:
            TypeError, ValueError: ``every`` is not None or an int >= 1 (nothing changes).
        """
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)):
            raise TypeError(f"track_underflows: every must be an int >= 1 or None, got {every!r}")
        if every is not None and every < 1:
            raise ValueError(f"track_underflows: every must be an int >= 1 or None, got {every!r}")
        self._underflow_every = every
        if every is not None:
            self.track_overflows = True
            flats = [f for group in self._flat for f in group]
            if flats and all(f.storage.stats_group is not None for f in flats):
                warnings.warn(
                    "track_underflows: every param of this optimizer is an FSDP2 shard, and shards are "
                    "not sampled: the report will hold no zero or subnormal fractions",
                    stacklevel=2,
                )

    @property
    def underflow_every(self) -> int | None:
        """Every how many steps the gradients are sampled for zeros and subnormals (None:
        never); set by :meth:`track_underflows`."""
        return self._underflow_every

    def overflow_report(self) -> OverflowReport:
        """Which tensors' gradients held inf or nan: in the last step (and whether
        it was skipped), and the last step each tensor ever did; with
        :meth:`track_underflows`, the fraction of each tensor's gradient that was zero
        and that was subnormal at the last sampled step, and whether the loss scale is
        likely too low (:meth:`~tkern.optim.report.OverflowReport.scale_too_low`).
        Recorded on the device by the step's statistics pass at no cost while nothing
        overflows; this call reads it in one device-to-host copy (a sync: call it when
        a step was skipped or now and then, not every step). Names come from
        the params' names the optimizer was given (``FusedAdamW(model.named_parameters())``)
        or from :meth:`name_params`; unnamed params are named by group, index and shape.
        Under a sharded optimizer each rank reports its own
        shard's tensors; steps replayed from a CUDA graph record nothing. Needs
        :attr:`track_overflows` on (:meth:`name_params` turns it on) before the
        steps it reports."""
        if not self.track_overflows:
            raise RuntimeError(
                "overflow_report: overflow tracking is off; call opt.name_params(model) "
                "(or set opt.track_overflows = True) before the steps to report on"
            )
        tracked = []
        for flats in self._flat:
            for flat in flats:
                held = self._overflow_flags.get(id(flat))
                if held is not None and held[0] == flat.layout_version:
                    tracked.append((flat, held[2][0]))
        sampled = None
        if self._underflow_meta is not None:
            counted = []
            for flats in self._flat:
                for flat in flats:
                    held = self._underflow_counts.get(id(flat))
                    if held is not None and held[0] == flat.layout_version:
                        counted.append((flat, held[2]))
            sampled = (*self._underflow_meta, counted)
        return overflow_report(
            self._steps_run, self.grad_stats, tracked, self._report_names(), self._stamp(), sampled
        )

    def _report_names(self) -> dict[tuple[int, int], str]:
        """(group, index in group) -> name: the names the optimizer was given with its
        params (``named_parameters()``: each group's ``param_names``), overridden by
        :meth:`name_params`'."""
        names = {
            (gi, pi): name
            for gi, group in enumerate(self.param_groups)
            for pi, name in enumerate(group.get("param_names", ()))
        }
        names.update(self._param_names)
        return names
