"""The arguments every pass-2 (update) kernel takes, and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tkern.kernels._common import aligned_slices, check_tensor
from tkern.kernels.overflow import N_STATS

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class UpdateBuffers:
    """One contiguous run of a flat parameter buffer and its companions.

    Attributes:
        param: (n,) fp16/bf16/fp32 model parameters, written in place.
        grad: (n,) gradients of ``param``'s dtype, scaled by the loss scale.
        master: (n,) fp32 master weights; for fp32 params, ``param`` itself
            (the same memory), which is then its own master.
        state: name -> (n,) fp32 optimizer state (momentum, exp_avg, ...).
        stats: (3,) fp32 pass-1 statistics from :func:`tkern.kernels.overflow.grad_stats`.
        inv_scale: (1,) fp32, 1 / loss scale.
        step: (1,) fp32 count of applied steps before this one.
    """

    param: torch.Tensor
    grad: torch.Tensor
    master: torch.Tensor
    stats: torch.Tensor
    inv_scale: torch.Tensor
    step: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_master(self) -> bool:
        """Whether the param is half precision with a separate fp32 master."""
        return self.param.dtype != torch.float32


def check_update_buffers(b: UpdateBuffers, state_names: tuple[str, ...]) -> None:
    """Raise ``TypeError``/``ValueError`` naming the buffer that is wrong."""
    check_tensor("param", b.param, ndim=1, dtypes=PARAM_DTYPES)
    n = b.param.numel()
    named = {"grad": (b.grad, b.param.dtype), "master": (b.master, torch.float32)}
    named.update({name: (b.state.get(name), torch.float32) for name in state_names})
    for name, (t, dtype) in named.items():
        if t is None:
            raise ValueError(f"state buffer {name!r} is missing")
        check_tensor(name, t, ndim=1, dtypes=(dtype,))
        if t.numel() != n or not t.is_contiguous() or t.device != b.param.device:
            raise ValueError(
                f"{name} must be a contiguous ({n},) tensor on {b.param.device} like param, "
                f"got shape {tuple(t.shape)} on {t.device}"
            )
    if not b.has_master and b.master.data_ptr() != b.param.data_ptr():
        raise ValueError("an fp32 param is its own master: pass the same memory as param and master")
    for name, t, size in (
        ("stats", b.stats, N_STATS),
        ("inv_scale", b.inv_scale, 1),
        ("step", b.step, 1),
    ):
        check_tensor(name, t, dtypes=(torch.float32,))
        if t.numel() != size or t.device != b.param.device:
            raise ValueError(
                f"{name} must hold {size} value(s) on {b.param.device}, got shape {tuple(t.shape)}"
            )


def check_lr(lr: float | torch.Tensor, device: torch.device) -> tuple[float | torch.Tensor, bool]:
    """``(lr, on_device)`` for a kernel's ``lr`` argument: a Python number, or a
    (1,) fp32 tensor on ``device`` that the kernel reads itself (no host sync)."""
    if isinstance(lr, torch.Tensor):
        check_tensor("lr", lr, dtypes=(torch.float32,))
        if lr.numel() != 1 or lr.device != device:
            raise ValueError(
                f"a tensor lr must hold one fp32 value on {device}, "
                f"got shape {tuple(lr.shape)} on {lr.device}"
            )
        return lr, True
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"lr must be a float or a (1,) fp32 tensor, got {type(lr).__name__}")
    return float(lr), False


def aligned_parts(b: UpdateBuffers) -> list[tuple[UpdateBuffers, int]]:
    """``b`` as (part, length) runs: a head whose length is a multiple of 16
    elements (the kernel vectorises it) and, when the length is not, a tail of
    fewer than 16 elements on offset views of every buffer."""
    n = b.param.numel()
    runs = aligned_slices(n)
    if len(runs) < 2:
        return [(b, n)] if n else []
    return [
        (replace(b, param=b.param[s], grad=b.grad[s], master=b.master[s],
                 state={k: v[s] for k, v in b.state.items()}), s.stop - s.start)
        for s in runs
    ]  # fmt: skip
