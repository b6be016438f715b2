"""FusedSGD: ``torch.optim.SGD`` on fp32 master weights, one fused pass per flat buffer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tkern.kernels._update import UpdateBuffers
from tkern.kernels.sgd import sgd_update
from tkern.optim.fused import FusedOptimizer, check_nonneg, document_options, group_scalar

__all__ = ["FusedSGD"]


@document_options
class FusedSGD(FusedOptimizer):
    """SGD with momentum, as ``torch.optim.SGD``, fused on fp32 master weights.

    Args:
        params: iterable of params, of ``(name, param)`` pairs, or of param-group dicts.
        lr: learning rate (a float, or a 1-element tensor).
        momentum, dampening, weight_decay, nesterov, maximize: as ``torch.optim.SGD``.
        {options}
    """

    _fresh_state_restarts_count = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        max_grad_norm: float | None = None,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            max_grad_norm=max_grad_norm,
            maximize=maximize,
        )
        super().__init__(params, defaults, **options)

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group_scalar(group, "momentum", 0) > 0 else ()

    def _validate_group(self, group: dict, index: int) -> dict[str, Any]:
        args = super()._validate_group(group, index)
        args["momentum"] = check_nonneg(group, index, "momentum", "momentum value")
        args["dampening"] = group_scalar(group, "dampening", index)
        args["nesterov"] = bool(group["nesterov"])
        if args["nesterov"] and (args["momentum"] <= 0 or args["dampening"] != 0):
            raise ValueError(
                f"Nesterov momentum requires a momentum and zero dampening (param group {index})"
            )
        return args

    def _launch(self, args: dict[str, Any], buffers: UpdateBuffers, **one_pass: Any) -> None:
        sgd_update(buffers, prechecked=True, **args, **one_pass)  # the plan's buffers: built right
