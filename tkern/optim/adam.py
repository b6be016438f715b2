"""FusedAdam and FusedAdamW: ``torch.optim.Adam`` / ``AdamW`` on fp32 master weights,
one fused pass per flat buffer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tkern.kernels._update import UpdateBuffers
from tkern.kernels.adam import adam_update
from tkern.optim.fused import FusedOptimizer, check_nonneg, document_options, group_scalar

__all__ = ["FusedAdam", "FusedAdamW"]


@document_options
class FusedAdam(FusedOptimizer):
    """Adam with L2 weight decay, as ``torch.optim.Adam``, fused on fp32 master weights.

    Args:
        params: iterable of params, of ``(name, param)`` pairs, or of param-group dicts.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.Adam``
            (``lr`` and each beta may be a 1-element tensor).
        {options}
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
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            max_grad_norm=max_grad_norm,
            maximize=maximize,
        )
        super().__init__(params, defaults, **options)

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _validate_group(self, group: dict, index: int) -> dict[str, Any]:
        args = super()._validate_group(group, index)
        args["eps"] = check_nonneg(group, index, "eps", "epsilon value")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(
                f"Invalid betas: {betas!r}; expected a pair (beta1, beta2) (param group {index})"
            )
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            # torch.optim.Adam's check and words
            raise ValueError(f"betas must be either both floats or both Tensors (param group {index})")
        for i in range(2):
            beta = group_scalar({"b": betas[i]}, "b", index, f"beta parameter at index {i}")
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta} (param group {index})")
            args[f"beta{i + 1}"] = beta
        args["amsgrad"] = bool(group["amsgrad"])
        args["decoupled"] = self._decoupled
        return args

    _required_state = ("exp_avg", "exp_avg_sq")

    def _check_loaded_group(self, saved: dict, index: int) -> None:
        if "decoupled_weight_decay" in saved and bool(saved["decoupled_weight_decay"]) != self._decoupled:
            raise ValueError(
                f"loaded param group {index} has decoupled_weight_decay={saved['decoupled_weight_decay']}, "
                f"but {type(self).__name__} uses {self._decoupled}"
            )

    def _launch(self, args: dict[str, Any], buffers: UpdateBuffers, **one_pass: Any) -> None:
        adam_update(buffers, prechecked=True, **args, **one_pass)  # the plan's buffers: built right


@document_options
class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default 1e-2), as ``torch.optim.AdamW``, fused on
    fp32 master weights.

    Args:
        params: iterable of params, of ``(name, param)`` pairs, or of param-group dicts.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``
            (``lr`` and each beta may be a 1-element tensor).
        {options}
    """

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
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, max_grad_norm, **kwargs)
