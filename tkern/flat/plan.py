"""The step's plan of a flat buffer: which ranges of params a step launches on, with which
step counts. :class:`StepPlan` is the part of :class:`~tkern.flat.FlatParams` that decides,
each step, which params have a gradient (from the gradient views' version counters, with no
per-param work in the steady state), gives params that sit a step out step counts of their
own (cohorts), and hands out the :class:`~tkern.kernels._update.UpdateBuffers` of each range."""

from __future__ import annotations

import operator

import torch

from tkern.kernels._update import QBLOCK, UpdateBuffers

_VERSION = operator.attrgetter("_version")

__all__ = ["StepPlan"]


class StepPlan:
    """The per-step bookkeeping of a :class:`~tkern.flat.FlatParams`: the "has a gradient"
    record (the gradient views' versions at the last ``zero_grad``), the cohorts of params
    that share a step count (:attr:`cohort`, :attr:`steps`), and :meth:`plan`.

    Uses the buffer's params, views, shard (``lo``) and buffers, and its
    ``check_storage``, ``reconcile``, ``_grads_are_views``, ``_adopt_grad``, ``ranges``
    and ``_changed``; :meth:`_start_counting` sets its own attributes."""

    def _start_counting(self) -> None:
        """The per-param "has a gradient" bookkeeping and one cohort of step count 0."""
        params = self.params
        # The gradient views' versions at the last zero_grad(set_to_none=True); a view
        # whose version moved since has a gradient. -1: counts from the start.
        self._zero_versions = [
            -1 if params[i].grad is not None else v._version
            for i, v in zip(self._trainable, self._views, strict=True)
        ]
        # Every param counts as having a gradient until the next zero_grad: after
        # zero_grad(set_to_none=False), or once every gradient view was seen written.
        self._all_active = False
        #: cohort[i]: index into steps of param i's step-count tensor.
        self.cohort = [0] * len(params)
        self.steps = [torch.zeros(1, dtype=torch.float32, device=self.device)]

    def plan(self) -> list[UpdateBuffers]:
        """The launches of this step: the :class:`UpdateBuffers` (views of every
        buffer, the step count, the random stream's offset; ``stats`` and
        ``inv_scale`` left for the step to set) of each range of params that have
        a gradient, clipped to this rank's shard, split where the step counts differ.

        Also brings the master up to date with params written from outside
        (see the module docstring), copies in gradients that are not the flat
        views, and moves params that sit this step out into cohorts of their own.
        """
        params = self.params
        self.check_storage()
        versions = self.storage.versions(params)
        if versions != self._versions:
            self.reconcile()
            self._versions = versions
        if self._plan is not None and self._grads_are_views():
            if not self._all_active:
                # every gradient view written since zero_grad stays so until the next one (version
                # counters only grow): once seen, no step scans the views again until then
                self._all_active = all(map(operator.ne, map(_VERSION, self._views), self._zero_versions))
            if self._all_active:
                return self._plan  # the steady state: nothing changed since the last step
        active = [False] * len(params)
        for k, i in enumerate(self._trainable):
            g, view = params[i].grad, self._views[k]
            if g is None:
                continue
            if g is not self.grad_handles[i]:
                self._adopt_grad(i, g)
                self._zero_versions[k] = -1
            active[i] = self._all_active or view._version != self._zero_versions[k]
        self._split_cohorts(active)
        launches = [self._buffers(s, e, self.steps[c]) for s, e, c in self.ranges(active, self.cohort)]
        self.plan_version += 1  # new launches: a captured step (tkern.graphs.StepGraphs) is stale
        if all(active[i] for i in self._trainable):
            self._plan = launches
        return launches

    def _buffers(self, s: int, e: int, step: torch.Tensor) -> UpdateBuffers:
        """The views of ``[s, e)`` (in ``param`` coordinates, within this shard)."""
        a, b = s - self.lo, e - self.lo
        return UpdateBuffers(
            param=self.param[s:e],
            grad=self.grad[s:e],
            master=None if self.master is None else self.master[a:b],
            stats=None,
            inv_scale=None,
            step=step,
            state={k: v[a:b] for k, v in self.state.items()},
            absmax={k: v[a // QBLOCK : b // QBLOCK] for k, v in self.absmax.items()},
            seed=self.seed,
            offset=s,
        )

    def _split_cohorts(self, active: list[bool]) -> None:
        """Give the active members of a cohort that also has inactive members a
        new cohort (a copy of the step count), so only they count this step."""
        members: dict[int, list[int]] = {}
        for i, c in enumerate(self.cohort):
            if self.grad_views[i] is not None:
                members.setdefault(c, []).append(i)
        for c, idx in members.items():
            on = [i for i in idx if active[i]]
            if on and len(on) < len(idx):
                self.steps.append(self.steps[c].clone())
                for i in on:
                    self.cohort[i] = len(self.steps) - 1
                self._changed()

    def set_cohorts(self, steps: list[float]) -> None:
        """Set each param's step count (from a loaded state): params with equal
        counts share one step tensor."""
        by_value: dict[float, int] = {}
        cohort = []
        for value in steps:
            cohort.append(by_value.setdefault(value, len(by_value)))
        self.steps = [torch.full((1,), v, dtype=torch.float32, device=self.device) for v in by_value]
        self.cohort = cohort
        self._changed()

    def set_param_step(self, i: int, value: float) -> None:
        """Give param ``i`` a step count of its own."""
        self.steps.append(torch.full((1,), value, dtype=torch.float32, device=self.device))
        self.cohort[i] = len(self.steps) - 1
        self._changed()
