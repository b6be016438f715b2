"""The fused optimizers' checkpoint format, apart from their step: torch.optim's
``{"state": {index: {...}}, "param_groups": [...]}`` with every entry in fp32, out
(:func:`export_state`) and in (:func:`read_state` checks everything, then
:func:`write_state` changes the buffers), and ``optimizer.state[p]`` as a view of the
flat buffers (:class:`ParamState`).

A compact buffer (split master, bf16 or 8-bit state) leaves and enters as fp32: the
conversion runs once per buffer (``FlatParams.export_fp32`` / ``set_state_fp32``),
never per param. What differs between optimizer classes (their state names, their
group checks) comes in as a :class:`GroupRules` the optimizer builds from its own
methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tkern.flat import FlatParams, describe_param

__all__ = [
    "SCHEDULER_KEYS",
    "TORCH_BOOKKEEPING",
    "GroupRules",
    "LoadedState",
    "ParamState",
    "export_state",
    "flat_seed",
    "loaded_step",
    "read_state",
    "write_state",
]

#: Group keys torch.optim's own optimizers keep for bookkeeping; a loaded
#: state_dict may carry them (they do not change tkern's arithmetic).
TORCH_BOOKKEEPING = frozenset(
    {"foreach", "capturable", "differentiable", "fused", "maximize", "param_names", "decoupled_weight_decay"}
)
#: Group keys torch's lr schedulers add.
SCHEDULER_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr", "base_lr"}
)

#: The state_dict's key for the stochastic rounding's seed (``master="none"``): with
#: the step counts it fixes the rounding stream, so a resumed run draws what the
#: uninterrupted one would. torch.optim ignores it.
SEED_KEY = "seed"


def flat_seed(seed: int, flats_before: int, index: int) -> int:
    """The rounding seed of a group's ``index``-th flat buffer when ``flats_before``
    buffers precede the group: the optimizer's ``seed`` spread by a golden-ratio step,
    so buffers draw independent streams."""
    return (seed + 0x9E3779B1 * flats_before + index) & 0x7FFFFFFF


#: What ParamState stores for an entry it converts when read (a compact buffer).
_CONVERTED = object()


class ParamState(dict):
    """``optimizer.state[p]``: p's step count, fp32 master and state. Entries kept
    in fp32 are live views of the buffers the kernels use; compact ones (a split
    master, bf16 or uint8 state) read as fp32 copies converted when read.
    Assigning an entry (``opt.state[p]["exp_avg"] = t``) writes the value into
    the kernels' buffer, as assigning into torch.optim's state takes effect."""

    def __init__(self, flat: FlatParams, index: int) -> None:
        super().__init__()
        self._flat, self._index = flat, index
        self.refresh()

    def refresh(self) -> None:
        flat, i = self._flat, self._index
        dict.clear(self)
        dict.__setitem__(self, "step", flat.steps[flat.cohort[i]])
        buffers = dict(flat.state)
        if flat.keeps_master:
            buffers = {"master": flat.master, **buffers}
        for name, buf in buffers.items():
            view = flat.shard_view(buf, i)
            if view is not None:
                dict.__setitem__(self, name, view if buf.dtype == torch.float32 else _CONVERTED)

    def converted(self, key: str) -> bool:
        """Whether entry ``key`` is a compact buffer read as an fp32 copy."""
        return dict.get(self, key) is _CONVERTED

    def _read(self, key: str) -> torch.Tensor:
        flat = self._flat
        full = flat.master_fp32() if key == "master" else flat.state_fp32(key)
        return flat.shard_view(full, self._index)

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        return self._read(key) if value is _CONVERTED else value

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if dict.__contains__(self, key) else default

    def items(self):
        return [(k, self[k]) for k in self]

    def values(self):
        return [self[k] for k in self]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "step":
            self._flat.set_param_step(self._index, float(torch.as_tensor(value).reshape(-1)[0]))
            self.refresh()
            return
        dest = self.get(key)
        if not isinstance(dest, torch.Tensor):
            dict.__setitem__(self, key, value)
            return
        value = torch.as_tensor(value)
        if value.numel() != dest.numel():
            raise ValueError(
                f"state {key!r}: got a tensor of shape {tuple(value.shape)}, expected {tuple(dest.shape)}"
            )
        flat = self._flat
        with torch.no_grad():
            if not self.converted(key):
                dest.copy_(value.reshape(dest.shape))
                return
            full = flat.master_fp32() if key == "master" else flat.state_fp32(key)
            flat.copy_into_shard(full, self._index, value)
            if key == "master":
                flat.set_master_fp32(full)
            else:
                flat.set_state_fp32(key, full)


# --------------------------------------------------------------------------- out


def export_state(
    param_groups: list[dict],
    flat_buffers: list[list[FlatParams]],
    state: dict,
    export: Callable[[FlatParams], dict[str, torch.Tensor]],
    entry: Callable[[FlatParams, torch.Tensor, int], torch.Tensor],
    seed: int | None = None,
) -> dict[str, Any]:
    """torch.optim's state_dict of an optimizer's ``param_groups`` over ``flat_buffers``
    (one list per group). Each param's state holds its own ``step`` (a float32 scalar
    tensor, as torch's), the fp32 ``master`` for half-precision params and the state
    buffers in fp32 shaped like the param. ``export(flat)`` gives a buffer's master and
    state in fp32 and ``entry(flat, full, i)`` param ``i``'s part of one (the sharded
    optimizers gather there). Entries of ``state`` under keys that are not params (a
    hook's, a user's) travel under their own key, as torch.optim carries them. ``seed``
    (the stochastic rounding's) travels under :data:`SEED_KEY`."""
    index: dict[int, int] = {}
    groups = []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
        groups.append(packed)
    out: dict[Any, dict[str, Any]] = {}
    for flats in flat_buffers:
        for flat in flats:
            steps = [s.detach().to("cpu").reshape(()) for s in flat.steps]
            full = export(flat)  # compact buffers in fp32, converted once per buffer
            for i, p in enumerate(flat.params):
                item = {k: v for k, v in dict.items(state[p]) if k not in full}
                # (FSDP2's params: each entry a DTensor of the param's layout, for DCP)
                item.update((k, flat.storage.wrap(p, entry(flat, v, i))) for k, v in full.items())
                item["step"] = steps[flat.cohort[i]].clone()
                out[index[id(p)]] = item
    out.update((k, v) for k, v in state.items() if not isinstance(k, torch.Tensor))
    result: dict[str, Any] = {"state": out, "param_groups": groups}
    if seed is not None:
        result[SEED_KEY] = seed
    return result


# --------------------------------------------------------------------------- in


@dataclass(frozen=True)
class GroupRules:
    """What an optimizer class says about its param groups and state, for loading."""

    #: the optimizer's class name, for messages
    owner: str
    #: ``group -> keys`` a loaded group may hold
    allowed_keys: Callable[[dict], set[str]]
    #: ``(saved group, index)``: raise if it cannot be this optimizer's
    check_group: Callable[[dict, int], None]
    #: ``(group, index)``: validate the hyperparameters (raises)
    validate_group: Callable[[dict, int], Any]
    #: ``group -> names of its state buffers``
    state_names: Callable[[dict], tuple[str, ...]]
    #: state a loaded param's entry must hold once it holds any (Adam's moments)
    required_state: tuple[str, ...] = ()
    #: SGD: a param without a momentum buffer restarts its step count
    fresh_state_restarts_count: bool = False


@dataclass
class LoadedState:
    """A checked state_dict, ready to write: the new param groups, each param's
    loaded buffers ``(id(flat), name, i) -> value``, each flat buffer's steps, the
    entries under keys that are not params, and the rounding seed (None: not saved,
    as in torch.optim's state_dicts)."""

    groups: list[dict]
    values: dict[tuple[int, str, int], torch.Tensor]
    steps: dict[int, list[float]]
    extra: dict[Any, Any]
    seed: int | None = None


def loaded_step(src: dict, group: int, index: int, p: torch.Tensor) -> float:
    """A loaded entry's ``step`` as a float (0 when absent), or a ValueError naming the param."""
    value = src.get("step", 0.0)
    try:
        return float(torch.as_tensor(value).reshape(-1)[0]) if value is not None else 0.0
    except (TypeError, ValueError, IndexError):
        raise ValueError(
            f"loaded 'step' of {describe_param(group, index, p)} is not a number: {value!r}"
        ) from None


def _check_groups(saved_groups: list[dict], param_groups: list[dict], rules: GroupRules) -> list[dict]:
    """The loaded groups merged into the live ones, every key and hyperparameter checked."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} param groups, this optimizer has {len(param_groups)}"
        )
    new_groups = []
    for gi, (mine, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        if len(mine["params"]) != len(saved["params"]):
            raise ValueError(
                f"param group {gi} has {len(mine['params'])} params, "
                f"the loaded one has {len(saved['params'])}"
            )
        unknown = sorted(set(saved) - rules.allowed_keys(mine) - {"params"})
        if unknown:
            raise ValueError(
                f"loaded param group {gi} has keys {rules.owner} does not understand: {unknown} "
                "(a state dict of another optimizer?)"
            )
        rules.check_group(saved, gi)
        group = {**mine, **{k: v for k, v in saved.items() if k != "params"}}
        rules.validate_group(group, gi)
        new_groups.append(group)
    return new_groups


def read_state(
    state_dict: dict[str, Any],
    param_groups: list[dict],
    flat_buffers: list[list[FlatParams]],
    rules: GroupRules,
) -> LoadedState:
    """Check a state_dict (of this optimizer class or of torch.optim's counterpart) against
    the live ``param_groups`` and collect what :func:`write_state` writes. Raises before
    anything changes."""
    groups = state_dict["param_groups"]
    new_groups = _check_groups(groups, param_groups, rules)
    seed = state_dict.get(SEED_KEY)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"loaded {SEED_KEY!r} must be an int >= 0, got {seed!r}")
    saved_state = state_dict["state"]
    values: dict[tuple[int, str, int], torch.Tensor] = {}
    steps: dict[int, list[float]] = {}
    for gi, (mine, saved) in enumerate(zip(param_groups, groups, strict=True)):
        names = rules.state_names(new_groups[gi])
        by_param = dict(zip(mine["params"], saved["params"], strict=True))
        for flat in flat_buffers[gi]:
            flat_steps = []
            for i, p in enumerate(flat.params):
                src = saved_state.get(by_param[p]) or {}
                where = describe_param(gi, flat.indices[i], p)
                step = loaded_step(src, gi, flat.indices[i], p)
                if rules.fresh_state_restarts_count and src.get("momentum_buffer") is None:
                    step = 0.0  # SGD: a missing buffer starts as the next gradient
                flat_steps.append(step)
                for name in (*names, "master"):
                    if src and name in rules.required_state and name not in src:
                        raise KeyError(f"loaded state of {where} lacks {name!r}")
                    value = src.get(name)
                    if value is None or (name == "master" and flat.master_mode in ("self", "none")):
                        continue  # zero state; the master follows the params (or there is none)
                    value = torch.as_tensor(value)
                    if value.numel() != p.numel():
                        raise ValueError(
                            f"loaded {name!r} of {where} has shape {tuple(value.shape)}, "
                            f"expected {tuple(p.shape)}"
                        )
                    values[id(flat), name, i] = flat.storage.unwrap(p, value)  # (FSDP2: this rank's part)
            steps[id(flat)] = flat_steps
    param_ids = {i for g in groups for i in g["params"]}
    extra = {k: v for k, v in saved_state.items() if k not in param_ids}
    return LoadedState(new_groups, values, steps, extra, seed)


def write_state(
    loaded: LoadedState,
    param_groups: list[dict],
    flat_buffers: list[list[FlatParams]],
    state_names: Callable[[dict], tuple[str, ...]],
) -> None:
    """Write a :func:`read_state` result into the live groups and flat buffers. The
    params' values are never changed: where no master was saved it follows the param;
    missing state starts at zero; a saved seed reseeds every buffer's rounding
    (:func:`flat_seed`)."""
    flats_before = 0
    with torch.no_grad():
        for mine, group in zip(param_groups, loaded.groups, strict=True):
            mine.update(group)
        for gi, flats in enumerate(flat_buffers):
            names = state_names(param_groups[gi])
            for j, flat in enumerate(flats):
                if loaded.seed is not None:
                    flat.seed = flat_seed(loaded.seed, flats_before, j)
                flat.ensure_state(names)
                for name in (*names, "master") if flat.keeps_master else names:
                    # Each param's part of this rank's shard is written once, from the loaded
                    # value (which may be this very view, as in
                    # opt.load_state_dict(opt.state_dict())), into an fp32 staging shard (the
                    # live buffer when it is fp32), stored once per buffer.
                    full = flat.master_fp32() if name == "master" else flat.state_fp32(name)
                    for i in range(len(flat.params)):
                        value = loaded.values.get((id(flat), name, i))
                        if value is None:  # no master saved: it follows the param; no state: zero
                            p = flat.local(i)
                            value = (
                                p.detach() if name == "master" else torch.zeros_like(p, dtype=torch.float32)
                            )
                        flat.copy_into_shard(full, i, value)
                    if name == "master":
                        flat.set_master_fp32(full)
                    else:
                        flat.set_state_fp32(name, full)
                flat.set_cohorts(loaded.steps[id(flat)])
                flat.mark_dirty()
            flats_before += len(flats)
