"""Fused optimizers on fp32 master weights: FusedSGD, FusedAdam, FusedAdamW.

Each ``step()`` is two passes over flat buffers (see :mod:`tkern.flat`), with
no host synchronization:

1. one read of every gradient gives ``grad_stats`` = [found_inf, sum of
   squares, max |g|] of the unscaled gradients, as a device tensor;
2. one fused update per flat buffer (per run of params with one step count)
   reads that flag and returns at once if it is set (a skipped step writes
   nothing: params, master, state and step counts are unchanged); otherwise it
   unscales, clips, updates the fp32 master and state in fp32 and writes the
   master, rounded to nearest, into the fp16/bf16 params.

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
  shards, with the statistics summed over their mesh (see :mod:`tkern.optim.fsdp`).
"""

from __future__ import annotations

import inspect
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from tkern.flat import FlatParams, check_modes, describe_param
from tkern.graphs import (
    EAGER,
    WARMUP,
    CaptureError,
    CudaGraphCapture,
    GraphCapture,
    StepGraphs,
    capture_failed,
    key_value,
)
from tkern.kernels._update import MIN_8BIT_SIZE, PARAM_DTYPES, UpdateBuffers
from tkern.kernels.overflow import FOUND_INF, combine_stats, grad_stats, reduce_stats
from tkern.ops.float8 import Float8WeightCache, float8_weight_cache
from tkern.optim.fsdp import DTensorShards, param_storage
from tkern.optim.state import (
    SCHEDULER_KEYS,
    TORCH_BOOKKEEPING,
    GroupRules,
    ParamState,
    export_state,
    flat_seed,
    read_state,
    write_state,
)

__all__ = [
    "OPTIONS_DOC",
    "FusedOptimizer",
    "check_nonneg",
    "document_options",
    "full_signature",
    "group_scalar",
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
    value = group_scalar(group, key, index, label)
    if not value >= 0.0:
        raise ValueError(f"Invalid {label}: {value} (param group {index})")
    return value


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


#: The optimizer's capture seam under its former name.
CudaGraphRunner = CudaGraphCapture


def _step_stamp(opt: FusedOptimizer, args: list[dict], found_inf: torch.Tensor | None) -> tuple:
    """What the step's graph bakes in: the groups' hyperparameters as the kernels take
    them (a device lr by the tensor the group holds, which replays read in place:
    :func:`tkern.graphs.key_value`), the planned ranges, whether a GradScaler hands
    over found_inf."""

    def frozen(group: dict, key: str, value: Any) -> Any:
        return key_value(group[key] if isinstance(value, torch.Tensor) else value)

    hyper = tuple(
        tuple(sorted((k, frozen(g, k, v)) for k, v in a.items()))
        for g, a in zip(opt.param_groups, args, strict=True)
    )
    plans = tuple(flat.plan_version for flats in opt.flat_buffers for flat in flats)
    return hyper, plans, found_inf is not None


class FusedOptimizer(torch.optim.Optimizer):
    """What FusedSGD/FusedAdam/FusedAdamW share: flat buffers, the two passes,
    the state_dict. Subclasses name their state buffers, validate their
    hyperparameters and launch their update kernel."""

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
        if cuda_graph not in (None, True, False):
            raise TypeError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
        #: Replay the step as one CUDA graph (None: wherever it can be, i.e. on CUDA).
        self.cuda_graph = cuda_graph
        #: Why the last step was not a replay of its graph (None if it was).
        self.graph_fallback: str | None = None
        #: What captures and replays the step (:class:`tkern.graphs.CudaGraphCapture`).
        self.graph_capture: GraphCapture = CudaGraphCapture()
        self._graph = self._new_graphs()
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        self._master, self._state_dtype = master, state_dtype
        #: The stochastic rounding's seed (master="none"); torch's initial seed by default.
        self.seed = (torch.initial_seed() if seed is None else seed) & 0x7FFFFFFF
        self._flat: list[list[FlatParams]] = []
        #: fp8 weights (tensorwise or delayed Float8Linear) whose cast the step writes after updating them
        self._float8_caches: list[Float8WeightCache] = []
        self._device: torch.device | None = None
        self._one: torch.Tensor | None = None
        self._process_group = process_group
        #: (3,) fp32 statistics of the last step's gradients, on the device.
        self.grad_stats: torch.Tensor | None = None
        self._layout_seen: dict[int, int] = {}
        #: How FSDP2's DTensor params are held (None while there are none), and the flat
        #: buffers over them (their updated params are copied out after each step).
        self._dtensor_storage: DTensorShards | None = None
        self._held_elsewhere: list[FlatParams] = []
        super().__init__(params, defaults)

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

    # ----------------------------------------------------------- construction

    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        """Names of the fp32 state buffers the subclass's kernel needs for ``group``."""
        raise NotImplementedError

    def _validate_group(self, group: dict, index: int) -> dict[str, Any]:
        """Check ``group``'s hyperparameters; return them as the kernel takes them."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device == self._device and lr.numel() == 1:
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

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, moving its params into flat buffers (one per dtype).
        Everything is checked first: a rejected group leaves nothing behind."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        gi = len(self.param_groups)
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
        if self.param_groups and ("param_names" in param_group) != ("param_names" in self.param_groups[0]):
            raise ValueError(
                "all optimizer param groups should be with/without names. cannot add param group "
                f"{'with' if 'param_names' in param_group else 'without'} names to the optimizer"
            )
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
            if p.is_meta:
                raise ValueError(
                    f"{name} is on meta: materialize the model (to_empty() and initialise it) "
                    "before building the optimizer"
                )
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(f"{name}: dtype must be one of {PARAM_DTYPES}")
            try:
                check_modes(self._master, self._state_dtype, p.dtype)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            if id(p) in group_ids:
                raise ValueError(f"{name} is passed more than once")
            if id(p) in seen:
                raise ValueError(f"{name} already belongs to another param group")
            group_ids.add(id(p))
            device = self._device if self._device is not None else params[0].device
            if p.device != device:
                raise ValueError(
                    f"{name} is on {p.device}, but earlier params are on {device}; "
                    "a tkern optimizer keeps all its params on one device"
                )
        storage = param_storage(params, gi, self._dtensor_storage, zero=self.shard_group is not None)
        for key, default in self.defaults.items():
            param_group.setdefault(key, default)
        self._validate_group(param_group, gi)
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
        flats = []
        for (_, state_dtype), idx in by_kind.items():
            seed = flat_seed(self.seed, sum(map(len, self._flat)), len(flats))
            modes = {"master": self._master, "state_dtype": state_dtype, "seed": seed, "storage": storage}
            flats.append(self._make_flat([group["params"][i] for i in idx], idx, gi, names, modes))
        self._flat.append(flats)
        if isinstance(storage, DTensorShards):
            self._dtensor_storage = storage
            self._held_elsewhere += flats
        for flat in flats:
            self._refresh_state(flat)
        self._float8_caches += [c for p in group["params"] if (c := float8_weight_cache(p)) is not None]

    def _make_flat(self, params, indices, group, names, modes) -> FlatParams:
        return FlatParams(params, indices, group, names, **modes)

    def _refresh_state(self, flat: FlatParams) -> None:
        for i, p in enumerate(flat.params):
            self.state[p] = ParamState(flat, i)
        self._layout_seen[id(flat)] = flat.layout_version

    # ----------------------------------------------------------- the step

    def _launch(self, args: dict[str, Any], buffers: UpdateBuffers) -> None:
        raise NotImplementedError

    def _inv_scale(self, inv_scale: torch.Tensor | None) -> torch.Tensor:
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        if grad_scale is not None:
            if inv_scale is not None:
                raise ValueError("pass either inv_scale or a GradScaler's grad_scale, not both")
            return torch.reciprocal(grad_scale.detach().reshape(1).to(torch.float32))
        if inv_scale is None:
            if self._one is None:
                self._one = torch.ones(1, dtype=torch.float32, device=self._device)
            return self._one
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

        work = []  # (args, plan, the group its statistics are summed over or None)
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
        self._sync_grads()
        found_inf = getattr(self, "found_inf", None)  # set by torch.amp.GradScaler.step
        if found_inf is not None:
            found_inf = found_inf.detach().reshape(1).to(torch.float32)
        reason = self._graph_blocker()
        if reason is None:
            self.grad_stats = self._graphed_step(work, args, inv_scale, found_inf)
        else:
            self.graph_fallback = reason
            self._graph.counts[EAGER] += 1
            self.grad_stats = self._device_step(work, inv_scale, found_inf)
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
        pass 2 of every planned range, the step counts. Returns the statistics."""
        stats = self._step_stats(work, inv_scale, found_inf)
        applied = 1.0 - stats[FOUND_INF : FOUND_INF + 1]
        for group_args, plan, _ in work:
            lr = group_args["lr"]
            if isinstance(lr, torch.Tensor) and lr.dtype != torch.float32:  # the kernels read fp32
                group_args = {**group_args, "lr": lr.to(torch.float32)}
            for buffers in plan:
                buffers.stats, buffers.inv_scale = stats, inv_scale
                if buffers.param.numel():  # (empty: local shards empty on this rank; the step counts)
                    self._launch(group_args, buffers)
        for _, plan, _ in work:
            for step in {id(b.step): b.step for b in plan}.values():
                step.add_(applied)
        return stats

    def _step_stats(
        self, work: list, inv_scale: torch.Tensor, found_inf: torch.Tensor | None
    ) -> torch.Tensor:
        """Pass 1 and the statistics every rank steps with: those of whole gradients
        (agreed on by :meth:`_sync_stats`) joined with those of FSDP2's shards (summed
        over their mesh by every rank, whether or not it holds gradients this step)."""
        whole = [b.grad for _, plan, group in work if group is None for b in plan]
        stats = None
        if whole or self._dtensor_storage is None:
            stats = grad_stats(whole, inv_scale)
            if found_inf is not None:
                torch.maximum(stats[:1], found_inf, out=stats[:1])
            stats = self._sync_stats(stats)
        if self._dtensor_storage is not None:
            shards = [b.grad for _, plan, group in work if group is not None for b in plan]
            sharded = grad_stats(shards, inv_scale)
            if found_inf is not None and stats is None:
                torch.maximum(sharded[:1], found_inf, out=sharded[:1])
            sharded = combine_stats(sharded, self._dtensor_storage.stats_group, sharded=True)
            stats = sharded if stats is None else reduce_stats(torch.stack([stats, sharded]))
        return stats

    # ----------------------------------------------------------- the step's graph

    @staticmethod
    def _new_graphs() -> StepGraphs:
        # one graph (a new stamp drops it); one warm-up: the step that first brings a
        # stamp runs eager, through the static inputs; the next one with it captures
        return StepGraphs(CudaGraphCapture(), warmup_steps=1, max_graphs=1)

    @property
    def graph_runner(self) -> GraphCapture:
        """:attr:`graph_capture` under its former name."""
        return self.graph_capture

    @graph_runner.setter
    def graph_runner(self, seam: GraphCapture) -> None:
        self.graph_capture = seam

    @property
    def graph_counts(self) -> Counter[str]:
        """How the steps ran: ``warmup`` (a new stamp: eager, through the graph's static
        inputs), ``capture`` (captured, then replayed), ``replay``, ``eager`` (not
        graphed: :attr:`graph_fallback` says why)."""
        return self._graph.counts

    def _graph_blocker(self) -> str | None:
        """Why this step runs eager rather than as a CUDA graph (None: it may be graphed)."""
        if self.cuda_graph is False:
            return "cuda_graph=False"
        collectives = (self.shard_group, self._process_group, self._dtensor_storage)
        if any(c is not None for c in collectives):
            return "the step's collectives (process_group, ZeRO-2, FSDP2's mesh) run eager"
        return self.graph_runner.blocker(self._device)

        if self.shard_group is not None or self._process_group is not None:
            return "the step's collectives (process_group, ZeRO-2) run eager"
        return self.graph_capture.blocker(self._device)

    def _graphed_step(
        self, work: list, args: list[dict], inv_scale: torch.Tensor, found_inf: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`_device_step` through the step's graph (:class:`tkern.graphs.StepGraphs`):
        captured when a step's stamp repeats the last one's, replayed while it stays.
        1 / loss scale and found_inf are copied into static buffers for every step,
        the eager warm-up included, so the capture launches what the warm-up ran. A
        capture that fails warns once and turns the graphs off for this optimizer
        (``TKERN_GRAPH_STRICT=1`` re-raises it)."""
        inputs = (inv_scale,) if found_inf is None else (inv_scale, found_inf)
        graphs = self._graph
        graphs.seam = self.graph_capture
        try:
            stats, how = graphs.run(
                lambda inv, found=None: self._device_step(work, inv, found),
                inputs,
                lambda: _step_stamp(self, args, found_inf),
            )
        except CaptureError as e:  # any capture failure: eager from now on
            self.cuda_graph = False
            self.graph_fallback = f"{capture_failed('the step', e)}; running eager"
            warnings.warn(f"{type(self).__name__}: {self.graph_fallback}", stacklevel=4)
            graphs.reset()
            graphs.counts[EAGER] += 1
            return self._device_step(work, inv_scale, found_inf)
        self.graph_fallback = (
            "the step's launches changed since the last step (it is captured when they repeat)"
            if how == WARMUP
            else None
        )
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

    # ----------------------------------------------------------- grads and state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every flat gradient buffer in place (the views stay attached, so
        ``.grad`` reads zeros). With ``set_to_none`` (the default) a param that
        then gets no gradient in backward is left untouched by the next step,
        as torch's ``None`` gradient would be."""
        for flats in self._flat:
            for flat in flats:
                flat.zero_grad(set_to_none)

    def refresh_master(self) -> None:
        """Bring the fp32 master up to date with the params now. Not needed after
        in-place writes to the params (the next step notices them); needed after
        writes through ``param.data``, which torch does not count."""
        for flats in self._flat:
            for flat in flats:
                flat.check_storage()
                flat.reconcile()

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
            self.param_groups, self._flat, self.state, self._export, self._entry, seed=self.seed
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

    def memory_report(self) -> dict[str, Any]:
        """What the optimizer allocates (on this rank), in bytes.

        ``param`` and ``grad`` are the flat buffers the model's params and
        gradients live in (full size on every rank); ``master`` (half-precision
        params only: fp32 params are their own master; 2 B/param for a split
        master, 0 for none) and ``state`` (with the 8-bit state's block absmax)
        cover this rank's shard. ``numel`` counts the params' elements;
        ``padded_numel`` the flat buffers' slots: each param is padded to a
        multiple of 16 elements (256 with uint8 state) and each buffer to a
        multiple of that times ``world_size``. ``bytes_per_param`` is
        ``total / numel`` and ``per_param`` each buffer's share: for AdamW on
        bf16 params 16 (fp32 master and state), 14 (split master), 10 (uint8
        moments), 8 (split + uint8), 6 (none + uint8), plus padding and 4/256 B
        of absmax per 8-bit element; sharded over W ranks, master and state
        divide by W. Not counted: the step-count tensors (4 B per run of params
        with one step count) and what a step allocates while it runs (the
        statistics; for the sharded optimizers the reduce-scatter's staging).
        Over FSDP2's DTensor params every buffer covers this rank's local shards
        (``numel`` counts their elements; ``world_size`` stays 1, tkern shards
        them no further); FSDP2's own storage of the shards is not counted.
        """
        group = self.shard_group
        report: dict[str, Any] = {
            "world_size": 1 if group is None else torch.distributed.get_world_size(group),
            "rank": 0 if group is None else torch.distributed.get_rank(group),
            "master_mode": self._master,
            "state_dtype": self._state_dtype,
            "numel": 0,
            "padded_numel": 0,
        }
        sizes = dict.fromkeys(("param", "grad", "master", "state"), 0)
        for flats in self._flat:
            for flat in flats:
                report["numel"] += sum(flat.numels)
                report["padded_numel"] += flat.param.numel()
                for k, v in flat.nbytes().items():
                    sizes[k] += v
        report.update(sizes)
        report["total"] = sum(sizes.values())
        numel = report["numel"]
        report["bytes_per_param"] = report["total"] / numel if numel else 0.0
        report["per_param"] = {k: v / numel if numel else 0.0 for k, v in sizes.items()}
        return report

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
        loaded = read_state(state_dict, self.param_groups, self._flat, self._group_rules())
        if loaded.seed is not None:  # the rounding stream resumes where it was
            self.seed = loaded.seed & 0x7FFFFFFF
        for key in self.extra_state():  # as torch: the loaded state replaces the old
            del self.state[key]
        self.state.update(loaded.extra)
        write_state(loaded, self.param_groups, self._flat, self._group_state_names)
        for flats in self._flat:
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

    # ----------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_extra_state"] = self.extra_state()
        state.pop("state", None)  # rebuilt from the flat buffers
        state["_process_group"] = None  # process groups do not travel
        state["_layout_seen"] = {}
        state["_float8_caches"] = []  # weak references: found again from the params
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


#: The arguments every fused optimizer takes beside its torch counterpart's, as each
#: class's own docstring lists them (``{options}`` in it; see :func:`document_options`).
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
            ``torch.initial_seed()``, so ``torch.manual_seed`` makes runs repeat.
        cuda_graph: replay the step as one CUDA graph (see :mod:`tkern.graphs`): None
            (default) wherever it can be (CUDA params, no collectives, not inside another
            graph's warm-up or capture), True the same, False never. A step that brings
            new hyperparameters or planned ranges runs eager (a warm-up), the next one
            with the same is captured, the rest replay; an ``lr`` given as a 1-element
            tensor on the params' device is read by the kernels, so writing into it in
            place keeps the graph. ``graph_fallback`` says why the last step was not a
            replay, ``graph_counts`` how the steps ran."""


def document_options(cls: type) -> type:
    """Class decorator: put :data:`OPTIONS_DOC` into ``cls``'s docstring at ``{options}``
    and give ``cls`` its whole signature (:func:`full_signature`), so ``help(cls)`` names
    every argument it takes."""
    cls.__doc__ = cls.__doc__.replace("{options}", OPTIONS_DOC)
    cls.__signature__ = full_signature(cls)
    return cls
