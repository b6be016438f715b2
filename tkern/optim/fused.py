"""Fused optimizers on fp32 master weights: FusedSGD, FusedAdam, FusedAdamW.

Each ``step()`` is two passes over flat buffers (see :mod:`tkern.flat`), with
no host synchronization (a small step is both in one launch: see below):

1. one read of every gradient gives ``grad_stats`` = [found_inf, sum of
   squares, max |g|] of the unscaled gradients, as a device tensor;
2. one fused update per flat buffer (per run of params with one step count)
   reads that flag and returns at once if it is set (a skipped step writes
   nothing: params, master, state and step counts are unchanged); otherwise it
   unscales, clips, updates the fp32 master and state in fp32 and writes the
   master, rounded to nearest, into the fp16/bf16 params.

A step whose work is one range (one param group of one dtype, every param with a
gradient, no process group, ZeRO-2 or FSDP2, no overflow tracking) can run both passes
and the step count in ONE launch, with bit for bit the results of the two passes;
:attr:`FusedOptimizer.one_pass` picks how (:func:`tkern.kernels._update.step_path`):

* ``"auto"`` (the default) and ``"single"``: one program, for a range of at most
  :attr:`FusedOptimizer.one_pass_max_elements` elements (by default
  :data:`~tkern.kernels._update.ONE_PASS_MAX_ELEMENTS`); two passes above;
* ``"grid"``: one launch of up to one program per SM for a range of at most
  :data:`~tkern.kernels._update.GRID_MAX_ELEMENTS` elements: each program computes its
  share of the statistics, all meet at a grid barrier (:mod:`tkern.kernels.grid_sync`), each
  updates its share. CUDA only (one program under Triton's interpreter); a cooperative
  launch. Not the default: no GPU has measured it yet (bench_optimizer ``--sections grid``);
* ``"off"``: always two passes.

:attr:`FusedOptimizer.step_path` says which path the last step took and why.

Interface with loss scalers: ``step(inv_scale=t)`` takes ``1 / loss scale`` as
a (1,) fp32 device tensor; after the step, ``optimizer.grad_stats`` holds the
statistics of that step (``grad_stats[0]`` is found_inf), which
:mod:`tkern.amp` reads to update the scale. A non-finite ``inv_scale`` makes
the step a skipped one. ``torch.amp.GradScaler`` drives these optimizers
through torch's ``_step_supports_amp_scaling`` protocol (it hands over its
scale and found_inf; the step unscales and skips on the device). The
``.grad`` tensors are left multiplied by the loss scale after such a step
(torch's fused Adam writes them back unscaled; tkern saves those 2 B/param):
``scaler.unscale_(optimizer)`` before the step gives unscaled gradients.

Semantics as torch.optim, with these differences worth knowing:

* params become views into a flat buffer: build the optimizer after moving
  or casting the model. Writes to the params from outside (loading weights,
  DDP's broadcast, in-place edits) are picked up by the next step: the master
  follows the params (see :mod:`tkern.flat`); writes through ``param.data``
  are invisible to the version counter: call :meth:`refresh_master` then;
* a param's ``.grad`` is a view that ``zero_grad()`` zeroes in place, so it
  reads zeros rather than None after ``zero_grad(set_to_none=True)``; a param
  that then receives no gradient in backward is still left untouched by
  ``step()`` (no weight decay, no momentum, its step count stays), as in torch;
* ``optimizer.load_state_dict`` never changes the params' values: the loaded
  master is kept where the params equal it rounded (a consistent checkpoint,
  in either load order) and follows the params elsewhere;
* no collective by default under ``torch.distributed`` (under DDP the
  gradients are already identical); ``process_group=`` all-reduces the
  statistics (max) so every rank skips the same steps;
* params that ``fully_shard`` (FSDP2) made DTensors are stepped on their local
  shards, with the statistics summed over their mesh (see :mod:`tkern.optim.fsdp`);
  the statistics of plain groups beside them are agreed on over the mesh (max).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from tkern.flat import FlatParams, check_modes
from tkern.graphs import HostCounters
from tkern.kernels._update import MIN_8BIT_SIZE, UpdateBuffers
from tkern.kernels.overflow import (
    FOUND_INF,
    N_STATS,
    combine_stats,
    grad_stats,
    reduce_stats,
)
from tkern.ops.float8 import Float8WeightCache, float8_weight_cache
from tkern.optim.distributed_sync import shared_seed
from tkern.optim.fsdp import DTensorShards, param_storage
from tkern.optim.graph_step import GraphedStep, step_stamp
from tkern.optim.health import GradHealth
from tkern.optim.hparams import (
    OPTIONS_DOC,
    SHARDING_OPTIONS_DOC,
    check_nonneg,
    check_params,
    common_args,
    group_scalar,
    param_group_dict,
)
from tkern.optim.one_pass import OnePassStep
from tkern.optim.report import MemoryReport, memory_report
from tkern.optim.state import ParamState, flat_seed
from tkern.optim.state_io import TorchStateDict

__all__ = [
    "OPTIONS_DOC",
    "FusedOptimizer",
    "check_nonneg",
    "document_options",
    "full_signature",
    "group_scalar",
]


def full_signature(cls: type, extra: tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """An optimizer class's whole signature for ``help()`` and ``inspect.signature``:
    its positional arguments and the keyword-only ones of every class its
    ``**options`` reach (each named once, where it is defined), then ``extra``."""
    positional: list[inspect.Parameter] = []
    keyword: dict[str, inspect.Parameter] = {}
    for c in cls.__mro__:
        if "__init__" not in vars(c) or not issubclass(c, FusedOptimizer):
            continue
        params = [p for name, p in inspect.signature(c.__init__).parameters.items() if name != "self"]
        if not positional:
            positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        for p in params:
            if p.kind == p.KEYWORD_ONLY and p.name not in {e.name for e in extra}:
                keyword.setdefault(p.name, p)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return inspect.Signature([*positional, *keyword.values(), *extra])


class FlatGroups(HostCounters):
    """What a fused optimizer's flat storage is, seen from the optimizer: its flat buffers
    per param group (``_flat``), how they are made and tied to ``self.state``, the params'
    device and modes, and what acts on every buffer at once (``zero_grad``,
    :meth:`refresh_master`). :class:`FusedOptimizer`'s first part."""

    _HOST_COUNTERS = {"steps": "_steps_run"}  # the steps taken (HostCounters)
    _flat: list[list[FlatParams]]
    _device: torch.device | None
    _master: str
    _state_dtype: torch.dtype
    _layout_seen: dict[int, int]
    state: dict

    @property
    def device(self) -> torch.device | None:
        """The device of the params (and of every buffer the step uses); None
        while the optimizer holds no params."""
        return self._device

    @property
    def shard_group(self) -> Any:
        """The process group the optimizer's state is sharded over (ZeRO-2,
        :mod:`tkern.optim.distributed`); None for an optimizer whose state is
        whole on every rank."""
        return None

    @property
    def flat_buffers(self) -> list[list[FlatParams]]:
        """The flat buffers, per param group (see :mod:`tkern.flat`)."""
        return self._flat

    @property
    def master(self) -> str:
        """How the fp32 master is kept: ``"fp32"``, ``"split"`` or ``"none"``."""
        return self._master

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the state buffers (params below 4096 elements keep fp32
        state when it is torch.uint8)."""
        return self._state_dtype

    def _make_flats(
        self, params: list[torch.Tensor], indices: list[int], group: int, names: tuple[str, ...], modes: dict
    ) -> list[FlatParams]:
        """The flat buffers of one kind of param (one dtype and state dtype) of param
        group ``group``: one here; the sharded optimizers keep one per gradient bucket."""
        return [FlatParams(params, indices, group, names, **modes)]

    def _refresh_state(self, flat: FlatParams) -> None:
        """Point ``self.state`` at ``flat``'s params' entries (after a layout change)."""
        for i, p in enumerate(flat.params):
            self.state[p] = ParamState(flat, i)
        self._layout_seen[id(flat)] = flat.layout_version

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every flat gradient buffer in place (the views stay attached, so
        ``.grad`` reads zeros). With ``set_to_none`` (the default) a param that
        then gets no gradient in backward is left untouched by the next step,
        as torch's ``None`` gradient would be."""
        for flats in self._flat:
            for flat in flats:
                flat.zero_grad(set_to_none)

    def memory_report(self) -> MemoryReport:
        """What the optimizer allocates (on this rank), in bytes: the flat buffers'
        param, grad, master and state bytes, their total and per-param shares
        (:func:`tkern.optim.report.memory_report` says what each counts)."""
        return memory_report(self)

    def refresh_master(self) -> None:
        """Bring the fp32 master up to date with the params now. Not needed after
        in-place writes to the params (the next step notices them); needed after
        writes through ``param.data``, which torch does not count."""
        for flats in self._flat:
            for flat in flats:
                flat.check_storage()
                flat.reconcile()


class FusedOptimizer(GraphedStep, GradHealth, OnePassStep, FlatGroups, TorchStateDict, torch.optim.Optimizer):
    """What FusedSGD/FusedAdam/FusedAdamW share: flat buffers, the two passes,
    the state_dict (:class:`~tkern.optim.state_io.TorchStateDict`; the step's CUDA
    graph: :class:`~tkern.optim.graph_step.GraphedStep`; one launch or two passes:
    :class:`~tkern.optim.one_pass.OnePassStep`; the gradients' overflow and
    underflow records: :class:`~tkern.optim.health.GradHealth`; the flat buffers:
    :class:`FlatGroups`).
    Subclasses name their state buffers, validate their hyperparameters and launch
    their update kernel."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands over grad_scale and found_inf
    #: SGD's only use of the step count is "first step: the buffer starts as the gradient",
    #: so a momentum buffer allocated late (momentum switched on) starts the count afresh.
    _fresh_state_restarts_count = False

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        process_group: Any = None,
        master: str = "fp32",
        state_dtype: torch.dtype = torch.float32,
        seed: int | None = None,
        cuda_graph: bool | None = None,
    ) -> None:
        check_modes(master, state_dtype)
        self._init_graphs(cuda_graph)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        self._master, self._state_dtype = master, state_dtype
        #: The stochastic rounding's seed (master="none"); by default torch's initial seed,
        #: rank 0's on every rank (see :meth:`_share_seed`).
        self.seed = (torch.initial_seed() if seed is None else seed) & 0x7FFFFFFF
        self._seed_shared = seed is not None
        self._flat: list[list[FlatParams]] = []
        #: fp8 weights (tensorwise or delayed Float8Linear) whose cast the step writes after updating them
        self._float8_caches: list[Float8WeightCache] = []
        self._device: torch.device | None = None
        self._one: torch.Tensor | None = None
        self._process_group = process_group
        #: (3,) fp32 statistics of the last step's gradients, on the device.
        self.grad_stats: torch.Tensor | None = None
        self._layout_seen: dict[int, int] = {}
        self._steps_run = 0
        self._init_one_pass()
        self._init_health()
        #: How FSDP2's DTensor params are held (None while there are none), and the flat
        #: buffers over them (their updated params are copied out after each step).
        self._dtensor_storage: DTensorShards | None = None
        self._held_elsewhere: list[FlatParams] = []
        if master == "none":  # DDP's replicas round alike: one broadcast, at construction
            self._share_seed(process_group)
        super().__init__(params, defaults)

    # ----------------------------------------------------------- construction

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        """Names of the fp32 state buffers the subclass's kernel needs for ``group``."""
        raise NotImplementedError

    def _validate_group(self, group: dict, index: int) -> dict[str, Any]:
        """Check ``group``'s hyperparameters; return them as the kernel takes them."""
        return common_args(group, index, self._device)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, moving its params into flat buffers (one per dtype).
        Everything is checked first: a rejected group leaves nothing behind."""
        gi = len(self.param_groups)
        param_group = param_group_dict(param_group, self.param_groups)
        params = param_group["params"]
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        check_params(params, gi, seen, self._device, self._master, self._state_dtype)
        storage = param_storage(params, gi, self._dtensor_storage, zero=self.shard_group is not None)
        for key, default in self.defaults.items():
            param_group.setdefault(key, default)
        self._validate_group(param_group, gi)
        if isinstance(storage, DTensorShards):  # FSDP2's ranks: one seed, one state_dict
            self._share_seed(*storage.groups.groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if params:
            self._device = params[0].device

        # one flat buffer per dtype and state dtype (uint8 state only for params of
        # MIN_8BIT_SIZE elements or more, as bitsandbytes: the rest keep fp32 state)
        by_kind: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
        for pi, p in enumerate(group["params"]):
            small = self._state_dtype == torch.uint8 and p.numel() < MIN_8BIT_SIZE
            by_kind.setdefault((p.dtype, torch.float32 if small else self._state_dtype), []).append(pi)
        names = self._group_state_names(group)
        flats: list[FlatParams] = []
        for kind, ((_, state_dtype), idx) in enumerate(by_kind.items()):
            seed = flat_seed(self.seed, sum(map(len, self._flat)), kind)
            modes = {"master": self._master, "state_dtype": state_dtype, "seed": seed, "storage": storage}
            flats += self._make_flats([group["params"][i] for i in idx], idx, gi, names, modes)
        self._flat.append(flats)
        if isinstance(storage, DTensorShards):
            self._dtensor_storage = storage
            self._held_elsewhere += flats
        for flat in flats:
            self._refresh_state(flat)
        self._float8_caches += [c for p in group["params"] if (c := float8_weight_cache(p)) is not None]

    def _share_seed(self, *groups: Any) -> None:
        """A default seed becomes rank 0's of ``groups`` (None: the default group; of several,
        rank 0's of the first, then of the next: HSDP's shard dim, then replicate dim) on every
        rank, once (a broadcast per group; nothing without torch.distributed): with
        ``master="none"`` at construction, and for FSDP2's DTensor params when their
        first group is added. Buffers already built are reseeded as a loaded seed
        reseeds them. A seed given to the constructor is kept as it is."""
        if self._seed_shared:
            return
        for group in groups:
            self.seed = shared_seed(self.seed, group)
        self._seed_shared = True
        for before, flats in enumerate(self._flat):
            for j, flat in enumerate(flats):
                flat.seed = flat_seed(self.seed, sum(map(len, self._flat[:before])), j)

    # ----------------------------------------------------------- the step

    def _launch(self, args: dict[str, Any], buffers: UpdateBuffers, **one_pass: Any) -> None:
        """Launch the update kernel on ``buffers`` with ``args`` (the group's, as
        :meth:`_validate_group` gives them); ``one_pass``: the launcher's ``one_pass``,
        ``found_inf`` and ``barrier`` (the whole step in one launch)."""
        raise NotImplementedError

    def _ones(self) -> torch.Tensor:
        """A (1,) fp32 one on the device, made once: the default 1 / loss scale, and what
        a step subtracts found_inf from (a tensor operand: a Python scalar costs more host time)."""
        if self._one is None:
            self._one = torch.ones(1, dtype=torch.float32, device=self._device)
        return self._one

    def _inv_scale(self, inv_scale: torch.Tensor | None) -> torch.Tensor:
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        if grad_scale is not None:
            if inv_scale is not None:
                raise ValueError("pass either inv_scale or a GradScaler's grad_scale, not both")
            return torch.reciprocal(grad_scale.detach().reshape(1).to(torch.float32))
        if inv_scale is None:
            return self._ones()
        if not (
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
        return inv_scale

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: torch.Tensor | None = None):
        """One optimizer step (two launches per flat buffer, no host sync).

        Every group is checked before the first launch: a bad group raises and
        leaves every param and state as it was.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            inv_scale: (1,) fp32 tensor on the params' device, 1 / loss scale;
                default 1. Steps whose gradients hold inf/nan (or whose
                ``inv_scale`` is not finite) are skipped either way. The
                ``.grad`` tensors stay scaled.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._device is None:  # no params at all
            return loss
        inv_scale = self._inv_scale(inv_scale)
        args = [self._validate_group(g, gi) for gi, g in enumerate(self.param_groups)]

        self._steps_run += 1
        work = []  # (args, plan, the group its statistics are summed over or None)
        self._plan_flats: dict[int, FlatParams] = {}
        for gi, flats in enumerate(self._flat):
            names = self._group_state_names(self.param_groups[gi])
            for flat in flats:
                if flat.ensure_state(names) and self._fresh_state_restarts_count:
                    flat.set_cohorts([0.0] * len(flat.params))
                plan = flat.plan()
                if self._layout_seen.get(id(flat)) != flat.layout_version:
                    self._refresh_state(flat)
                if plan:
                    work.append((args[gi], plan, flat.storage.stats_group))
                    self._plan_flats[id(plan)] = flat
        self._sync_grads()
        found_inf = getattr(self, "found_inf", None)  # set by torch.amp.GradScaler.step
        if found_inf is not None:
            found_inf = found_inf.detach().reshape(1).to(torch.float32)
        collectives = (self.shard_group, self._process_group, self._dtensor_storage)
        self.grad_stats = self._run_step(
            lambda inv, found=None: self._device_step(work, inv, found),
            inv_scale,
            found_inf,
            lambda: step_stamp(self, args, found_inf),
            self._graph_blocker(any(c is not None for c in collectives), self._device),
        )
        self._sample_underflows(work, inv_scale)
        self._sync_params()
        for flat in self._held_elsewhere:  # FSDP2's local shards: its next all-gather reads them
            flat.write_back()
        for cache in self._float8_caches:  # the fp8 weights' casts, once per step (not per forward)
            cache.refresh()
        return loss

    def _device_step(
        self, work: list, inv_scale: torch.Tensor, found_inf: torch.Tensor | None
    ) -> torch.Tensor:
        """Everything a step does on the device, with no host work between the
        launches (what a CUDA graph captures): pass 1, the statistics' combination,
        pass 2 of every planned range, the step counts -- or all of it in one launch
        (:meth:`_one_pass`). Returns the statistics."""
        one = self._one_pass(work)
        if one is not None:
            single, barrier = one
            stats = torch.empty(N_STATS, dtype=torch.float32, device=self._device)
            single.stats, single.inv_scale = stats, inv_scale
            self._launch(_fp32_lr(work[0][0]), single, one_pass=True, found_inf=found_inf, barrier=barrier)
            return stats
        stats = self._step_stats(work, inv_scale, found_inf)
        applied = torch.sub(self._ones(), stats[FOUND_INF : FOUND_INF + 1])
        for group_args, plan, _ in work:
            group_args = _fp32_lr(group_args)
            for buffers in plan:
                buffers.stats, buffers.inv_scale = stats, inv_scale
                if buffers.param.numel():  # (empty: local shards empty on this rank; the step counts)
                    self._launch(group_args, buffers)
        for _, plan, _ in work:
            for step in {id(b.step): b.step for b in plan}.values():
                step.add_(applied)
        return stats

    def _collectives(self) -> bool:
        return (
            self._process_group is not None
            or self.shard_group is not None
            or self._dtensor_storage is not None
        )

    def _step_stats(
        self, work: list, inv_scale: torch.Tensor, found_inf: torch.Tensor | None
    ) -> torch.Tensor:
        """Pass 1 and the statistics every rank steps with: those of whole gradients
        (agreed on by :meth:`_sync_stats`) joined with those of FSDP2's shards (summed
        over their mesh by every rank, whether or not it holds gradients this step)."""
        whole = [b.grad for _, plan, group in work if group is None for b in plan]
        track = self._tracking(work)
        stats = None
        # plain groups beside FSDP2's: held on every rank of the mesh, whether or not planned
        mixed = self._dtensor_storage is not None and len(self._held_elsewhere) < sum(map(len, self._flat))
        if mixed or self._dtensor_storage is None:
            stats = grad_stats(whole, inv_scale, track, self._stamp())
            if found_inf is not None:
                torch.maximum(stats[:1], found_inf, out=stats[:1])
            stats = self._sync_stats(stats)
            mesh = self._dtensor_storage.groups if mixed else None
            if mesh is not None and mesh != (self._process_group, None):
                # each rank's own plain gradients: the ranks of the mesh (both of HSDP's dims) agree
                # on their max, as for replicas, so every rank clips by one norm and skips the same steps
                stats = mesh.combine(stats, sharded=False)
        if self._dtensor_storage is not None:
            shards = [b.grad for _, plan, group in work if group is not None for b in plan]
            sharded = grad_stats(shards, inv_scale)
            if found_inf is not None and stats is None:
                torch.maximum(sharded[:1], found_inf, out=sharded[:1])
            sharded = self._dtensor_storage.groups.combine(sharded)  # (HSDP: summed over the shard dim)
            stats = sharded if stats is None else reduce_stats(torch.stack([stats, sharded]))
        return stats

    # Hooks of the sharded optimizers (tkern.optim.distributed); here they do
    # nothing but agree on the statistics when a process_group was given.

    def _sync_grads(self) -> None:
        """Before pass 1: make this rank's gradients the ones to step on."""

    def _sync_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """After pass 1: the statistics every rank steps with."""
        return combine_stats(stats, self._process_group)

    def _sync_params(self) -> None:
        """After pass 2 and the step counts: bring every rank's params up to date."""

    # ----------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_extra_state"] = self.extra_state()
        state.pop("state", None)  # rebuilt from the flat buffers
        state["_process_group"] = None  # process groups do not travel
        state["_layout_seen"] = {}
        self._copied_health(state)
        state.pop("_plan_flats", None)
        state["_float8_caches"] = []  # weak references: found again from the params
        self._copied_one_pass(state)
        state["_graph"] = self._new_graphs()  # a graph holds device memory and addresses: captured anew
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        extra = state.pop("_extra_state", {})
        super().__setstate__(state)
        self.state = defaultdict(dict)
        self.state.update(extra)
        for flats in self._flat:
            for flat in flats:
                self._refresh_state(flat)
        params = [p for g in self.param_groups for p in g["params"]]
        self._float8_caches = [c for p in params if (c := float8_weight_cache(p)) is not None]


def _fp32_lr(group_args: dict[str, Any]) -> dict[str, Any]:
    """A group's kernel arguments with a tensor lr as fp32 (what the kernels read)."""
    lr = group_args["lr"]
    if isinstance(lr, torch.Tensor) and lr.dtype != torch.float32:
        return {**group_args, "lr": lr.to(torch.float32)}
    return group_args


def document_options(cls: type, signature: inspect.Signature | None = None) -> type:
    """Class decorator: put :data:`OPTIONS_DOC` into ``cls``'s docstring at ``{options}``
    (and :data:`SHARDING_OPTIONS_DOC`, the sharded optimizers' own arguments, at
    ``{sharding_options}``) and give ``cls`` its whole signature (``signature``, by
    default :func:`full_signature`), so ``help(cls)`` names every argument it takes."""
    doc = cls.__doc__.replace("{options}", OPTIONS_DOC)
    cls.__doc__ = doc.replace("{sharding_options}", SHARDING_OPTIONS_DOC)
    cls.__signature__ = full_signature(cls) if signature is None else signature
    return cls
