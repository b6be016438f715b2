"""The fused optimizers' arguments: the checks of a param group (its
hyperparameters, its params) before anything is built, and the text of the
arguments every fused optimizer (and every sharded one) takes beside its torch
counterpart's, which each class's own docstring lists (see
:func:`tkern.optim.fused.document_options`)."""

from __future__ import annotations

from typing import Any

import torch

from tkern.flat import check_modes, describe_param
from tkern.kernels._update import PARAM_DTYPES

__all__ = [
    "OPTIONS_DOC",
    "SHARDING_OPTIONS_DOC",
    "check_nonneg",
    "check_params",
    "common_args",
    "group_scalar",
    "param_group_dict",
]


def group_scalar(group: dict, key: str, index: int, label: str | None = None) -> float:
    """A hyperparameter as a float: Python/numpy scalars and 1-element tensors;
    anything else raises ValueError naming it."""
    value = group[key]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            # torch's own words first (torch.optim.Adam: "Tensor lr must be 1-element")
            raise ValueError(
                f"Tensor {key} must be 1-element: got shape {tuple(value.shape)} "
                f"({label or key}, param group {index})"
            )
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Invalid {label or key}: {value!r} (param group {index})") from None


def check_nonneg(group: dict, index: int, key: str, label: str) -> float:
    """``group[key]`` as a float (:func:`group_scalar`), raising unless it is >= 0."""
    value = group_scalar(group, key, index, label)
    if not value >= 0.0:
        raise ValueError(f"Invalid {label}: {value} (param group {index})")
    return value


def common_args(group: dict, index: int, device: torch.device | None) -> dict[str, Any]:
    """The hyperparameters every fused optimizer takes (lr, weight_decay,
    max_grad_norm, maximize), checked, as the kernels take them; ``device`` is the
    params' (a 1-element lr tensor there is read by the kernels in place)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device == device and lr.numel() == 1:
        # Read by the kernel where it lies (a view: in-place writes reach the step,
        # and its graph), with no host sync, so its value is not checked here.
        lr = lr.detach().reshape(1)
    else:
        lr = check_nonneg(group, index, "lr", "learning rate")
    args = {
        "lr": lr,
        "weight_decay": check_nonneg(group, index, "weight_decay", "weight_decay value"),
    }
    norm = group.get("max_grad_norm")
    if norm is not None:
        norm = group_scalar(group, "max_grad_norm", index)
        if not norm > 0:
            raise ValueError(
                f"Invalid max_grad_norm value: {norm} (param group {index}); expected > 0 or None"
            )
    args["max_grad_norm"] = norm
    if group.get("maximize", False):
        args["maximize"] = True
    return args


def param_group_dict(param_group: Any, param_groups: list[dict]) -> dict:
    """A copy of ``param_group`` with its params a list (named params split into
    ``param_names``), checked as torch.optim checks it against ``param_groups``
    (the optimizer's groups so far)."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    gi = len(param_groups)
    param_group = dict(param_group)
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set")
    params = list(params)
    named = [isinstance(p, tuple) and len(p) == 2 for p in params]
    if params and all(named):  # named_parameters()
        param_group["param_names"] = [name for name, _ in params]
        params = [p for _, p in params]
    elif any(named):  # torch.optim.Optimizer.add_param_group's check and words
        raise ValueError(
            "all optimizer params should be with/without names. Some param names are missing "
            f"(param group {gi})"
        )
    if param_groups and ("param_names" in param_group) != ("param_names" in param_groups[0]):
        raise ValueError(
            "all optimizer param groups should be with/without names. cannot add param group "
            f"{'with' if 'param_names' in param_group else 'without'} names to the optimizer"
        )
    param_group["params"] = params
    return param_group


def check_params(
    params: list, gi: int, seen: set[int], device: torch.device | None, master: str, state_dtype: torch.dtype
) -> None:
    """Raise if a param of group ``gi`` cannot be stepped: not a leaf tensor, sparse,
    on meta, of another dtype than ``PARAM_DTYPES`` or one the ``master`` and
    ``state_dtype`` modes do not take, passed twice, in ``seen`` (another group's),
    or on another device than ``device`` (default: the first param's)."""
    group_ids: set[int] = set()
    for pi, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"param {pi} of param group {gi} is a {type(p).__name__}, not a Tensor")
        name = describe_param(gi, pi, p)
        if not p.is_leaf:
            raise ValueError(f"{name} is not a leaf tensor; can't optimize a non-leaf Tensor")
        if p.is_sparse:
            raise TypeError(f"{name} is sparse; sparse params are not supported")
        if p.is_meta:
            raise ValueError(
                f"{name} is on meta: materialize the model (to_empty() and initialise it) "
                "before building the optimizer"
            )
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"{name}: dtype must be one of {PARAM_DTYPES}")
        try:
            check_modes(master, state_dtype, p.dtype)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if id(p) in group_ids:
            raise ValueError(f"{name} is passed more than once")
        if id(p) in seen:
            raise ValueError(f"{name} already belongs to another param group")
        group_ids.add(id(p))
        device = device if device is not None else params[0].device
        if p.device != device:
            raise ValueError(
                f"{name} is on {p.device}, but earlier params are on {device}; "
                "a tkern optimizer keeps all its params on one device"
            )


#: The arguments every fused optimizer takes beside its torch counterpart's, as each
#: class's own docstring lists them (``{options}`` in it; see
#: :func:`tkern.optim.fused.document_options`).
OPTIONS_DOC = """max_grad_norm: clip by the global L2 norm of all unscaled gradients of the
            optimizer (as ``clip_grad_norm_`` would), or None.
        process_group: all-reduce the step's statistics over this group, so every rank
            skips the same steps (needed only where ranks' gradients differ); None
            (default) for none.
        master: how the fp32 master of fp16/bf16 params is kept:
            ``"fp32"`` (default; 4 B/param); ``"split"`` (bf16 params only: the param is
            the master rounded to nearest, ties away from zero, plus a 16-bit remainder,
            so the master is rebuilt bit for bit what ``"fp32"`` holds; the forward sees
            the same round-to-nearest weights except on exact ties, 1 value in 65536;
            2 B/param); or ``"none"`` (no master: the fp32 update is written to the param
            with stochastic rounding, unbiased, seeded per step and element; 0 B/param).
            fp32 params are their own master in every mode.
        state_dtype: ``torch.float32`` (default), ``torch.bfloat16`` (rounded to nearest
            even) or ``torch.uint8`` (8-bit block-wise quantized with bitsandbytes'
            dynamic code maps, blocks of 256; params under 4096 elements keep fp32
            state). ``state_dict()`` converts to and from torch's fp32 format in every mode.
        seed: the stochastic rounding's seed (``master="none"``); default
            ``torch.initial_seed()``, so ``torch.manual_seed`` makes runs repeat. Under
            ``torch.distributed`` the default is rank 0's on every rank, so replicas
            round alike and every rank saves one state_dict: the ZeRO-2 optimizers
            agree on it in their construction collective, FSDP2's DTensor params and
            ``master="none"`` (DDP) by one broadcast at construction, which every rank
            of the group (``process_group``, else the default one) then joins; pass
            ``seed=`` to build one on some ranks only.
        cuda_graph: replay the step as one CUDA graph (see :mod:`tkern.graphs`): None
            (default) wherever it can be (CUDA params, no collectives, not inside another
            graph's warm-up or capture), True the same, False never. A step that brings
            new hyperparameters or planned ranges runs eager (a warm-up), the next one
            with the same is captured, the rest replay; an ``lr`` given as a 1-element
            tensor on the params' device is read by the kernels, so writing into it in
            place keeps the graph. ``graph_fallback`` says why the last step was not a
            replay, ``graph_counts`` how the steps ran."""

#: The arguments a sharded (ZeRO-2) optimizer takes beside its fused class's
#: (:mod:`tkern.optim.distributed`; ``{sharding_options}`` in its docstring).
SHARDING_OPTIONS_DOC = """process_group: the ranks to shard over; None (default) for the default group.
        bucket_mb: the gradient buckets' size: at most this many MiB of fp32 (a param
            bigger than that is a bucket of its own, reduced in pieces of this size).
        grad_sync_dtype: ``torch.float32`` (default): the gradients are summed in fp32;
            None: in their own dtype, each pre-divided by W (half the bytes on the wire
            for fp16/bf16; each rank's share is rounded once, and shares below the
            dtype's smallest subnormal times W flush to zero).
        overlap_grad_sync: True (default): reduce-scatter each bucket from the backward
            hooks as soon as its gradients are complete, overlapping the communication
            with the rest of backward; False: every bucket inside ``step()``. The same
            results, bit for bit."""
