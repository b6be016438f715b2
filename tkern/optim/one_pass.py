"""Which launches a fused optimizer's step takes (:class:`OnePassStep`): the two passes, or,
when the step's work is one range, the whole step in one launch -- of one program or of up
to one program per SM meeting at a grid barrier -- with the same bits either way."""

from __future__ import annotations

from typing import Any

import torch

from tkern.kernels._update import ONE_PASS_MAX_ELEMENTS, ONE_PASS_MODES, StepPath, UpdateBuffers, step_path
from tkern.kernels.grid_sync import GridBarrier, device_programs, new_grid_barrier

__all__ = ["OnePassStep"]

# why a step is two-pass before its length is looked at
_SEVERAL_RANGES = StepPath("two-pass", 0, "more than one range (param groups, dtypes or step counts)")
_TRACKED = StepPath("two-pass", 0, "track_overflows")
_COLLECTIVE = StepPath("two-pass", 0, "a collective between the passes (process_group, ZeRO-2, FSDP2)")


class OnePassStep:
    """One concern of a fused optimizer (mixed into :class:`tkern.optim.FusedOptimizer`):
    whether its step runs in one launch, and how. ``one_pass``, ``one_pass_max_elements``
    and ``step_path`` are the optimizer's public attributes."""

    _device: torch.device | None
    track_overflows: bool
    # class-level defaults: an optimizer pickled before these existed unpickles with them
    _one_pass_mode = "auto"
    _grid_barrier: GridBarrier | None = None
    step_path: StepPath | None = None

    def _init_one_pass(self) -> None:
        #: Steps whose work is one range of at most this many elements (and no collective
        #: or overflow tracking) run in one program (``one_pass`` "auto" or "single"; see
        #: :mod:`tkern.optim.fused`); 0: never.
        self.one_pass_max_elements = ONE_PASS_MAX_ELEMENTS
        self._one_pass_mode = "auto"
        #: The path the last step took (:class:`tkern.kernels._update.StepPath`: "single",
        #: "grid" or "two-pass", its programs and why); None before the first step.
        self.step_path: StepPath | None = None
        self._grid_barrier: GridBarrier | None = None

    @property
    def one_pass(self) -> str:
        """How a step whose work is one range runs in one launch: ``"auto"`` (the default:
        today ``"single"``'s rule), ``"single"`` (one program, up to
        :attr:`one_pass_max_elements`), ``"grid"`` (one launch of up to one program per SM,
        meeting at a grid barrier, up to :data:`~tkern.kernels._update.GRID_MAX_ELEMENTS`;
        CUDA and the interpreter only) or ``"off"`` (two passes). Every path gives the same
        bits; :attr:`step_path` says which the last step took."""
        return self._one_pass_mode

    @one_pass.setter
    def one_pass(self, mode: str) -> None:
        if mode not in ONE_PASS_MODES:
            raise ValueError(f"one_pass must be one of {ONE_PASS_MODES}, got {mode!r}")
        self._one_pass_mode = mode

    @property
    def grid_barrier(self) -> GridBarrier | None:
        """The grid-wide step's barrier (:class:`tkern.kernels.grid_sync.GridBarrier`: its
        (2,) int32 workspace and the most programs a launch has), made by the first grid
        step; None before."""
        return self._grid_barrier

    def _collectives(self) -> bool:
        """Whether a collective runs between the passes (the optimizer says)."""
        raise NotImplementedError

    def _one_pass(self, work: list) -> tuple[UpdateBuffers, GridBarrier | None] | None:
        """``(range, barrier)`` when the whole step can run in one launch (``barrier``: the
        grid-wide step's workspace, None for one program), else None; :attr:`step_path` set
        to the path and why: one planned range (one flat buffer with one step count), no
        collective (process_group, ZeRO-2, FSDP2) between the passes, no overflow tracking,
        and then :func:`tkern.kernels._update.step_path`'s rule for its length (a multiple of
        16, so pass 1 reads it as one piece and the one launch computes the same statistics)
        and :attr:`one_pass`."""
        if len(work) != 1 or len(work[0][1]) != 1:
            self.step_path = _SEVERAL_RANGES
        elif self.track_overflows:
            self.step_path = _TRACKED
        elif self._collectives():
            self.step_path = _COLLECTIVE
        else:
            b = work[0][1][0]
            programs = device_programs(self._device) if self._one_pass_mode == "grid" else 0
            self.step_path = step_path(
                b.param.numel(),
                self._one_pass_mode,
                device_programs=programs,
                single_max=self.one_pass_max_elements,
            )
            if self.step_path.path == "single":
                return b, None
            if self.step_path.path == "grid":
                return b, self._barrier()
        return None

    def _barrier(self) -> GridBarrier:
        """The grid-wide step's barrier workspace (made on the first grid step, eagerly:
        a graph's warm-up step precedes its capture; it resets itself at every step)."""
        if self._grid_barrier is None or self._grid_barrier.word.device != self._device:
            self._grid_barrier = new_grid_barrier(self._device, self.step_path.programs)
        return self._grid_barrier

    def _copied_one_pass(self, state: dict[str, Any]) -> None:
        """A copy's (pickled) state: a workspace per optimizer, the copy makes its own."""
        state["_grid_barrier"] = None
