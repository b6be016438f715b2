"""Fused optimizers on fp32 master weights: FusedSGD, FusedAdam, FusedAdamW.

Each ``step()`` is two passes over flat buffers (see :mod:`tkern.flat`), with
no host synchronization:

1. one read of every gradient gives ``grad_stats`` = [found_inf, sum of
   squares, max |g|] of the unscaled gradients, as a device tensor;
2. one fused update per flat buffer reads that flag and returns at once if it
   is set (a skipped step writes nothing: params, master, state and step count
   are unchanged); otherwise it unscales, clips, updates the fp32 master and
   state in fp32 and writes the master, rounded to nearest, into the fp16/bf16
   params.

Interface with loss scalers: ``step(inv_scale=t)`` takes ``1 / loss scale`` as
a (1,) fp32 device tensor; after the step, ``optimizer.grad_stats`` holds the
statistics of that step (``grad_stats[0]`` is found_inf), which
:mod:`tkern.amp` reads to update the scale. When ``torch.distributed`` is
initialized, the statistics are all-reduced (max) over the default process
group before the update, so every rank skips the same steps (under DDP every
rank holds the same all-reduced gradients, so the max of the sums of squares
is that sum itself; sharded gradients would need a sum, and are not supported).

Differences from torch.optim worth knowing:

* params become views into the flat buffer: build the optimizer after moving
  or casting the model; if you load weights into the model in place
  afterwards, call :meth:`refresh_master`;
* a param's ``.grad`` is a view that ``zero_grad()`` zeroes in place (even
  with ``set_to_none=True``), so a param that requires grad but took no part
  in backward has a zero gradient, not None; set its ``.grad`` to None before
  ``step()`` to leave it alone;
* the step count is kept per param group (as in apex), on the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from tkern.flat import FlatParams, describe_param
from tkern.kernels._update import UpdateBuffers
from tkern.kernels.adam import adam_update
from tkern.kernels.overflow import FOUND_INF, grad_stats
from tkern.kernels.sgd import sgd_update

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]


def _check_nonneg(group: dict, index: int, key: str, label: str) -> None:
    if not group[key] >= 0.0:
        raise ValueError(f"Invalid {label}: {group[key]} (param group {index})")


class _FusedOptimizer(torch.optim.Optimizer):
    """What FusedSGD/FusedAdam/FusedAdamW share: flat buffers, the two passes,
    the state_dict. Subclasses name their state buffers, validate their
    hyperparameters and launch their update kernel."""

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        self._flat: list[list[FlatParams]] = []
        self._steps: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._one: torch.Tensor | None = None
        #: (3,) fp32 statistics of the last step's gradients, on the device.
        self.grad_stats: torch.Tensor | None = None
        super().__init__(params, defaults)

    # ----------------------------------------------------------- construction

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        """Names of the fp32 state buffers the subclass's kernel needs for ``group``."""
        raise NotImplementedError

    def _validate_group(self, group: dict, index: int) -> None:
        _check_nonneg(group, index, "lr", "learning rate")
        _check_nonneg(group, index, "weight_decay", "weight_decay value")
        norm = group.get("max_grad_norm")
        if norm is not None and not norm > 0:
            raise ValueError(
                f"Invalid max_grad_norm value: {norm} (param group {index}); expected > 0 or None"
            )

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, moving its params into flat buffers (one per dtype)."""
        gi = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        group_ids: set[int] = set()
        for pi, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param {pi} of param group {gi} is a {type(p).__name__}, not a Tensor")
            name = describe_param(gi, pi, p)
            if not p.is_leaf:
                raise ValueError(f"{name} is not a leaf tensor; can't optimize a non-leaf Tensor")
            if p.is_sparse:
                raise TypeError(f"{name} is sparse; sparse params are not supported")
            if id(p) in group_ids:
                raise ValueError(f"{name} is passed more than once")
            if id(p) in seen:
                raise ValueError(f"{name} already belongs to another param group")
            group_ids.add(id(p))
            if p.device != params[0].device:
                raise ValueError(
                    f"{name} is on {p.device}, but the group's first param is on {params[0].device}"
                )
            if self._device is not None and p.device != self._device:
                raise ValueError(
                    f"{name} is on {p.device}, but earlier params are on {self._device}; "
                    "a tkern optimizer keeps all its params on one device"
                )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._validate_group(group, gi)
        if not params:
            raise ValueError(f"param group {gi} is empty")
        self._device = params[0].device

        by_dtype: dict[torch.dtype, list[int]] = {}
        for pi, p in enumerate(group["params"]):
            by_dtype.setdefault(p.dtype, []).append(pi)
        names = self._group_state_names(group)
        flats = [FlatParams([group["params"][i] for i in idx], idx, gi, names) for idx in by_dtype.values()]
        step = torch.zeros(1, dtype=torch.float32, device=self._device)
        for flat in flats:
            for i, p in enumerate(flat.params):
                state = {"step": step}
                if flat.master is not flat.param:
                    state["master"] = flat.view(flat.master, i)
                state.update({k: flat.view(buf, i) for k, buf in flat.state.items()})
                self.state[p] = state
        self._flat.append(flats)
        self._steps.append(step)

    # ----------------------------------------------------------- the step

    def _launch(self, group: dict, buffers: UpdateBuffers) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: torch.Tensor | None = None):
        """One optimizer step (two launches per flat buffer, no host sync).

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            inv_scale: (1,) fp32 tensor on the params' device, 1 / loss scale;
                default 1. Steps whose gradients hold inf/nan are skipped either way.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if inv_scale is None:
            if self._one is None:
                self._one = torch.ones(1, dtype=torch.float32, device=self._device)
            inv_scale = self._one
        elif not (
            isinstance(inv_scale, torch.Tensor)
            and inv_scale.dtype == torch.float32
            and inv_scale.numel() == 1
            and inv_scale.device == self._device
        ):
            got = (
                inv_scale
                if not isinstance(inv_scale, torch.Tensor)
                else f"{inv_scale.dtype} {tuple(inv_scale.shape)} on {inv_scale.device}"
            )
            raise TypeError(f"inv_scale must be a one-element float32 tensor on {self._device}, got {got}")

        work = []  # (group index, flat, [(start, end)])
        for gi, flats in enumerate(self._flat):
            for flat in flats:
                ranges = flat.active_ranges()
                if ranges:
                    work.append((gi, flat, ranges))
        grads = [flat.grad[s:e] for _, flat, ranges in work for s, e in ranges]
        stats = grad_stats(grads, inv_scale)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        self.grad_stats = stats
        if not work:
            return loss

        for gi, flat, ranges in work:
            for s, e in ranges:
                buffers = UpdateBuffers(
                    param=flat.param[s:e],
                    grad=flat.grad[s:e],
                    master=flat.master[s:e],
                    state={k: v[s:e] for k, v in flat.state.items()},
                    stats=stats,
                    inv_scale=inv_scale,
                    step=self._steps[gi],
                )
                self._launch(self.param_groups[gi], buffers)
        applied = 1.0 - stats[FOUND_INF : FOUND_INF + 1]
        for gi in sorted({gi for gi, _, _ in work}):
            self._steps[gi].add_(applied)
        return loss

    # ----------------------------------------------------------- grads and state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every flat gradient buffer in place; the views stay attached
        whatever ``set_to_none`` says (params that do not require grad get
        None when ``set_to_none``)."""
        for flats in self._flat:
            for flat in flats:
                flat.zero_grad()
                if set_to_none:
                    for p in flat.params:
                        if not p.requires_grad:
                            p.grad = None

    def refresh_master(self) -> None:
        """Copy the params into the fp32 master (after loading weights into the
        model in place, e.g. with ``model.load_state_dict``)."""
        with torch.no_grad():
            for flats in self._flat:
                for flat in flats:
                    flat.copy_params_to_master()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict made by :meth:`state_dict` of the same optimizer
        class over the same params: hyperparameters, the fp32 master, the
        state buffers and the step counts are copied in exactly, and the
        params are rewritten from the master."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups, strict=True)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(
                    f"param group {gi} has {len(mine['params'])} params, "
                    f"the loaded one has {len(saved['params'])}"
                )
        # Check everything before changing anything: a bad state dict leaves
        # this optimizer as it was.
        saved_state = state_dict["state"]
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, value)
        new_groups = []
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups, strict=True)):
            group = {**mine, **{k: v for k, v in saved.items() if k != "params"}}
            self._validate_group(group, gi)
            new_groups.append(group)
            step_loaded = False
            for pi, (p, key) in enumerate(zip(mine["params"], saved["params"], strict=True)):
                if key not in saved_state:
                    continue
                src = saved_state[key]
                for name, dest in self.state[p].items():
                    if name not in src:
                        raise KeyError(f"loaded state of {describe_param(gi, pi, p)} lacks {name!r}")
                    value = torch.as_tensor(src[name])
                    if name == "step":
                        if not step_loaded:  # one step count per group
                            copies.append((dest, value.reshape(1)))
                            step_loaded = True
                        continue
                    if value.shape != dest.shape:
                        raise ValueError(
                            f"loaded {name!r} of {describe_param(gi, pi, p)} has shape "
                            f"{tuple(value.shape)}, expected {tuple(dest.shape)}"
                        )
                    copies.append((dest, value))
        with torch.no_grad():
            for dest, value in copies:
                dest.copy_(value)
            for mine, group in zip(self.param_groups, new_groups, strict=True):
                mine.update(group)
            for flats in self._flat:
                for flat in flats:
                    flat.copy_master_to_params()


class FusedSGD(_FusedOptimizer):
    """SGD with momentum, as ``torch.optim.SGD``, fused on fp32 master weights.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate.
        momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        max_grad_norm: clip by the global L2 norm of all unscaled gradients of
            the optimizer (as ``clip_grad_norm_`` would), or None.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] > 0 else ()

    def _validate_group(self, group: dict, index: int) -> None:
        super()._validate_group(group, index)
        _check_nonneg(group, index, "momentum", "momentum value")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                f"Nesterov momentum requires a momentum and zero dampening (param group {index})"
            )

    def _launch(self, group: dict, buffers: UpdateBuffers) -> None:
        if group["momentum"] > 0 and "momentum_buffer" not in buffers.state:
            raise ValueError(
                "momentum was switched on after the optimizer was built; build it with momentum > 0"
            )
        sgd_update(
            buffers,
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=group["weight_decay"],
            nesterov=group["nesterov"],
            max_grad_norm=group["max_grad_norm"],
        )


class FusedAdam(_FusedOptimizer):
    """Adam with L2 weight decay, as ``torch.optim.Adam``, fused on fp32 master weights.

    Args:
        params: iterable of params or of param-group dicts.
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.Adam``.
        max_grad_norm: clip by the global L2 norm of the unscaled gradients, or None.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _validate_group(self, group: dict, index: int) -> None:
        super()._validate_group(group, index)
        _check_nonneg(group, index, "eps", "epsilon value")
        for i, beta in enumerate(group["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta} (param group {index})")

    def _launch(self, group: dict, buffers: UpdateBuffers) -> None:
        beta1, beta2 = group["betas"]
        if group["amsgrad"] and "max_exp_avg_sq" not in buffers.state:
            raise ValueError(
                "amsgrad was switched on after the optimizer was built; build it with amsgrad=True"
            )
        adam_update(
            buffers,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=self._decoupled,
            amsgrad=group["amsgrad"],
            max_grad_norm=group["max_grad_norm"],
        )


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default 1e-2), as ``torch.optim.AdamW``,
    fused on fp32 master weights. Arguments as :class:`FusedAdam`."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, max_grad_norm)
