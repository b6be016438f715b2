"""Flat buffers: many parameters in one contiguous allocation.

A :class:`FlatParams` takes the parameters of one param group that share a
device and dtype, moves them into one flat buffer (each ``param.data``
becomes a view into it), allocates one flat gradient buffer whose views become
the params' ``.grad``, one flat fp32 master copy (for half-precision params;
an fp32 param is its own master) and flat fp32 state buffers. A kernel then
covers every parameter of the set in one launch.
"""

from __future__ import annotations

import itertools

import torch

from tkern.kernels._update import PARAM_DTYPES


def describe_param(group: int, index: int, p: torch.Tensor) -> str:
    """How error messages name a parameter: its group, index, shape and dtype."""
    return f"param {index} of param group {group} (shape {tuple(p.shape)}, dtype {p.dtype})"


class FlatParams:
    """The parameters of one param group on one device with one dtype.

    Args:
        params: the parameters, in order; each must be a leaf tensor.
        indices: each param's index within its param group (for messages).
        group: the param group's index (for messages).
        state_names: names of the fp32 state buffers to allocate, zeroed.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        indices: list[int],
        group: int,
        state_names: tuple[str, ...],
    ) -> None:
        first = params[0]
        if first.dtype not in PARAM_DTYPES:
            raise TypeError(
                f"{describe_param(group, indices[0], first)}: dtype must be one of {PARAM_DTYPES}"
            )
        self.params = params
        self.indices = indices
        self.group = group
        self.dtype, self.device = first.dtype, first.device
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]
        total = self.offsets[-1]

        self.param = torch.empty(total, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(total, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(params):
                self.view(self.param, i).copy_(p)
                if p.grad is not None:
                    self.view(self.grad, i).copy_(p.grad)
                p.data = self.view(self.param, i)
        self.master = self.param if self.dtype == torch.float32 else self.param.float()
        self.state = {
            name: torch.zeros(total, dtype=torch.float32, device=self.device) for name in state_names
        }
        self.attach_grads()

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Param ``i``'s slice of ``flat``, shaped like the param."""
        return flat[self.offsets[i] : self.offsets[i + 1]].view(self.params[i].shape)

    def attach_grads(self) -> None:
        """Make the gradient views the ``.grad`` of every param that requires grad."""
        for i, p in enumerate(self.params):
            if p.requires_grad:
                p.grad = self.view(self.grad, i)

    def _owns(self, t: torch.Tensor, flat: torch.Tensor, i: int) -> bool:
        view = self.view(flat, i)
        return t.data_ptr() == view.data_ptr() and t.shape == view.shape and t.stride() == view.stride()

    def _describe(self, i: int) -> str:
        return describe_param(self.group, self.indices[i], self.params[i])

    def active_ranges(self) -> list[tuple[int, int]]:
        """Element ranges ``[start, end)`` of the params that have a gradient this step.

        A param whose ``.grad`` was replaced by another tensor has it copied
        into the flat buffer (and the view put back); a param whose ``.grad``
        is None is left out, and so left alone by the step.

        Raises:
            RuntimeError: a param's ``.data`` no longer lives in the flat buffer.
            TypeError: a sparse gradient.
        """
        ranges: list[tuple[int, int]] = []
        for i, p in enumerate(self.params):
            if not self._owns(p, self.param, i):
                raise RuntimeError(
                    f"{self._describe(i)} no longer lives in the optimizer's flat buffer: its .data was "
                    "replaced (by .to(), .half() or an assignment) after the optimizer was "
                    "built; build the optimizer after moving or casting the model"
                )
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise TypeError(
                    f"{self._describe(i)}: sparse gradients are not supported (layout {g.layout})"
                )
            if not self._owns(g, self.grad, i):
                if g.shape != p.shape:
                    raise ValueError(f"{self._describe(i)}: .grad has shape {tuple(g.shape)}")
                view = self.view(self.grad, i)
                view.copy_(g)
                p.grad = view
            start, end = self.offsets[i], self.offsets[i + 1]
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            elif end > start:
                ranges.append((start, end))
        return ranges

    def zero_grad(self) -> None:
        """Zero the flat gradient buffer in place and re-attach the views."""
        self.grad.zero_()
        self.attach_grads()

    def copy_master_to_params(self) -> None:
        """Write the fp32 master, rounded to nearest even, into the params."""
        if self.master is not self.param:
            self.param.copy_(self.master)

    def copy_params_to_master(self) -> None:
        """Refresh the fp32 master from the params (after loading weights in place)."""
        if self.master is not self.param:
            self.master.copy_(self.param)
