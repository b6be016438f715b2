"""A fused optimizer's ``state_dict()`` / ``load_state_dict()`` in torch.optim's
format (the format itself, its export and its checks: :mod:`tkern.optim.state`)."""

from __future__ import annotations

from typing import Any

import torch

from tkern.flat import FlatParams
from tkern.optim.state import (
    SCHEDULER_KEYS,
    TORCH_BOOKKEEPING,
    GroupRules,
    export_state,
    read_state,
    write_state,
)

__all__ = ["TorchStateDict"]


class TorchStateDict:
    """One concern of a fused optimizer (mixed into :class:`tkern.optim.FusedOptimizer`):
    its state_dict in torch.optim's format, saved and loaded over its flat buffers
    (``flat_buffers``). The optimizer supplies its facts through the hooks
    ``_group_state_names``, ``_validate_group``, ``_refresh_state`` and
    ``_fresh_state_restarts_count``."""

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: ``{"state": {index: {...}}, "param_groups": [...]}``.
        Each param's state holds its own ``step`` (a float32 scalar tensor, as
        torch's), the fp32 ``master`` for half-precision params, and the state
        buffers (views of the live buffers, shaped like the param). It loads
        into torch.optim.SGD/Adam/AdamW as well as into this class
        (:mod:`tkern.optim.state`)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = export_state(
            self.param_groups, self.flat_buffers, self.state, self._export, self._entry, seed=self.seed
        )
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def _export(self, flat: FlatParams) -> dict[str, torch.Tensor]:
        """``flat``'s master (unless fp32 params or none) and state in fp32, shard-sized
        (live views of buffers kept in fp32)."""
        return flat.export_fp32()

    def _entry(self, flat: FlatParams, full: torch.Tensor, i: int) -> torch.Tensor:
        """Param ``i``'s part of an exported buffer, shaped like it."""
        return flat.shard_view(full, i)

    def extra_state(self) -> dict[Any, Any]:
        """The entries of ``optimizer.state`` whose key is not a param (put there
        by a hook or a user): ``state_dict()`` carries them under their own key
        and ``load_state_dict`` restores them, as torch.optim does."""
        return {k: v for k, v in self.state.items() if not isinstance(k, torch.Tensor)}

    def _allowed_group_keys(self, group: dict) -> set[str]:
        return set(self.defaults) | set(group) | TORCH_BOOKKEEPING | SCHEDULER_KEYS

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class, or of torch.optim's counterpart (SGD,
        Adam, AdamW), over the same params. Everything is checked before
        anything changes. The params' values are never changed: the loaded
        master is kept where a param equals it rounded and follows the param
        elsewhere (so model-then-optimizer and optimizer-then-model both resume
        bit-exactly). State a torch optimizer never created (a param it never
        stepped) starts at zero with step 0."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = read_state(state_dict, self.param_groups, self.flat_buffers, self._group_rules())
        if loaded.seed is not None:  # the rounding stream resumes where it was
            self.seed = loaded.seed & 0x7FFFFFFF
        for key in self.extra_state():  # as torch: the loaded state replaces the old
            del self.state[key]
        self.state.update(loaded.extra)
        write_state(loaded, self.param_groups, self.flat_buffers, self._group_state_names)
        for flats in self.flat_buffers:
            for flat in flats:
                self._refresh_state(flat)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _group_rules(self) -> GroupRules:
        """This class's facts about its param groups, for :mod:`tkern.optim.state`."""
        return GroupRules(
            owner=type(self).__name__,
            allowed_keys=self._allowed_group_keys,
            check_group=self._check_loaded_group,
            validate_group=self._validate_group,
            state_names=self._group_state_names,
            required_state=self._required_state,
            fresh_state_restarts_count=self._fresh_state_restarts_count,
        )

    #: State a loaded param's entry must hold once it holds any (Adam's moments).
    _required_state: tuple[str, ...] = ()

    def _check_loaded_group(self, saved: dict, index: int) -> None:
        """Raise if a loaded param group cannot be this optimizer's (a subclass's facts)."""
