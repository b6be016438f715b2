"""The trainer's whole step as a CUDA graph: who may capture it (:func:`graph_blocker`),
what a graph bakes in (:func:`graph_stamp`), and :class:`GraphMixin`, the part of
:class:`tkern.Trainer` that runs a step eager or through its graphs, and chooses
between them with ``cuda_graph="auto"``.

The choice ``"auto"`` makes, per batch shape (:func:`choose`):

1. parts that cannot be captured (:func:`graph_blocker`: a CPU, a scheduler,
   accumulation, DDP, a sharded optimizer, ...): eager for every shape;
2. a batch shape is *observed* while it comes :data:`OBSERVED_STEPS` (4) steps in a
   row, all eager: the first builds lazy state and compiles (left out), the second and
   third are traced (the ops each runs on the device and tkern's kernel launches, each
   with the parameters and buffers it takes, and whether one reads a device value on
   the host), the fourth is timed from an idle device (the seam's ``time``: the
   host's time to launch the step, and the time until the device finished it; untraced,
   so that the trace's own host cost is not counted). A shape that does not come that
   many steps in a row (an epoch's last, smaller batch; dynamic shapes) stays eager;
3. after them it is captured when the two traced steps ran the same ops on the same
   parameters (no data-dependent branch, no weight picked by a host counter) and read
   nothing of the device on the host, and the host's share of the timed step is at
   least :data:`HOST_BOUND_SHARE`; otherwise it stays eager. Under an optimizer's
   ``process_group`` the ranks' choices are all-reduced (:func:`agree`): captured only
   where every rank chose it. The choice is logged once per shape (logger
   ``tkern.train.trainer``) and kept in ``trainer.graph_status``.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tkern.amp import LossScaler
from tkern.graphs import (
    CAPTURE,
    EAGER,
    REPLAY,
    CaptureError,
    CudaGraphCapture,
    GraphCapture,
    PoolUsage,
    StepGraphs,
    capture_failed,
    device_blocker,
    key_value,
    trace_launches,
)
from tkern.kernels import INTERPRET
from tkern.optim import FusedOptimizer
from tkern.train.trainer_checkpoint import is_fsdp2

__all__ = [
    "HOST_BOUND_SHARE",
    "MAX_GRAPHS",
    "OBSERVED_STEPS",
    "TRACED_STEPS",
    "WARMUP_STEPS",
    "GraphMixin",
    "Observation",
    "agree",
    "choose",
    "graph_blocker",
    "graph_stamp",
]

logger = logging.getLogger("tkern.train.trainer")

#: Eager runs of a batch shape before its step is captured (``cuda_graph=True``).
#: Everything a step builds lazily must exist before capture, where nothing may
#: synchronise with the host or allocate-and-initialise state that later replays would
#: re-initialise: the optimizer's moments and master, the loss scale, the gradients,
#: cuBLAS workspaces, and Triton's autotuning for that shape (it times configs, waiting
#: for the device). Three is ``torch.cuda.make_graphed_callables``' ``num_warmup_iters``.
WARMUP_STEPS = 3
#: Batch shapes that get a graph of their own: an epoch's full batch and its last,
#: smaller one. Batches of any further shape (dynamic shapes) run eager: a graph per
#: shape holds its own static inputs, and capture costs warm-up steps.
MAX_GRAPHS = 2
#: ``cuda_graph="auto"``: steps of one batch shape in a row that run eager before the
#: choice: one that builds lazy state and compiles, two traced (their ops must agree),
#: one timed. They are the warm-ups ``WARMUP_STEPS`` asks for; one more, through the
#: graph's static buffers, precedes the capture.
OBSERVED_STEPS = 4
#: Which of the observed steps (counted from 0) are traced; the others after the first are timed.
TRACED_STEPS = (1, 2)
#: ``cuda_graph="auto"`` captures a shape whose host time (launching the step) is at
#: least this share of the step timed to the device's end, from an idle device. A step
#: that the host bounds ends soon after its last launch (the share is near 1): a graph
#: runs it at the device's pace. A step that the device bounds leaves the host waiting
#: (a small share): a graph saves nothing there and adds its input copies. From the
#: H200 figures of issue 45: the 2-layer MLP's eager step is 2.28 ms pipelined (the
#: host's pace) and 1.15 ms as a graph (an upper bound on the device's work), so its
#: share is at least 2.28 / (2.28 + 1.15) = 0.66 even with no overlap at all; GPT-2
#: small is device-bound (79.5 ms a step; its graph is 3% slower), where the host's
#: launches of its ~2,000 ops take a small part of the step. 0.6 sits below the MLP's
#: floor. The shares themselves are in ``graph_status`` for every choice.
HOST_BOUND_SHARE = 0.6


def graph_blocker(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    accumulation_steps: int,
    scheduler: Any,
    device: torch.device,
    capture_device_type: str = "cuda",
    interpreted: bool = False,
    collectives_blocker: Callable[[list], str | None] | None = None,
) -> str | None:
    """Why a trainer with these parts cannot capture its whole step as one graph
    (one line), or None when it can. Looks only at its arguments.

    ``capture_device_type``: the device type the capture seam records (CUDA's).
    ``interpreted``: tkern's kernels run through Triton's interpreter, on the host,
    while the model is on that device. ``collectives_blocker``: the seam's, for an
    optimizer whose step runs collectives (``process_group``); without it they block.
    """
    reason = device_blocker(device, "the model is", device_type=capture_device_type, interpreted=interpreted)
    if reason is not None:
        return reason
    if accumulation_steps > 1:
        return f"accumulation_steps={accumulation_steps}: only a step of one forward and backward is captured"
    if scheduler is not None:
        return (
            f"a {type(scheduler).__name__} changes the learning rate every step, and a captured "
            "step replays the hyperparameters it was captured with"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "a DistributedDataParallel model: its gradient all-reduce hooks are not captured"
    if is_fsdp2(model):
        return "an FSDP2 model (fully_shard): its all-gathers and reduce-scatters (hooks) are not captured"
    if getattr(optimizer, "shard_group", None) is not None:
        return f"{type(optimizer).__name__} is sharded: its collectives are not captured"
    groups = optimizer.collective_groups() if isinstance(optimizer, FusedOptimizer) else []
    if groups:
        check = collectives_blocker or (lambda _: "its collectives are not captured")
        why = check(groups)
        if why is not None:
            return f"{type(optimizer).__name__} has a process_group: {why}"
    return _scaler_blocker(optimizer, scaler) or _hyperparameter_blocker(optimizer, device)


def _scaler_blocker(optimizer: torch.optim.Optimizer, scaler: Any) -> str | None:
    """Why ``scaler`` with ``optimizer`` would read the device on the host every step."""
    opt = type(optimizer).__name__
    if isinstance(scaler, torch.amp.GradScaler):
        if scaler.is_enabled() and not getattr(optimizer, "_step_supports_amp_scaling", False):
            return (
                f"torch.amp.GradScaler with {opt} reads found_inf on the host every step "
                "(only an optimizer with _step_supports_amp_scaling takes it on the device)"
            )
    elif isinstance(scaler, LossScaler):
        if scaler.is_enabled() and not isinstance(optimizer, FusedOptimizer):
            return (
                f"a {type(scaler).__name__} with {opt}, which is not a tkern fused optimizer, "
                "reads found_inf on the host every step"
            )
    elif scaler is not None:
        return f"a {type(scaler).__name__} loss scaler is not known to be free of host syncs"
    return None


def _hyperparameter_blocker(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Why ``optimizer``'s step cannot be captured for what its param groups hold."""
    opt = type(optimizer).__name__
    if not isinstance(optimizer, FusedOptimizer):
        if all(g.get("capturable", False) for g in optimizer.param_groups):
            return None
        return f"{opt} is not built with capturable=True, and torch refuses to capture its step without it"
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "lr" and isinstance(value, torch.Tensor) and value.device == device:
                continue  # read by the kernels on the device
            if key != "params" and isinstance(value, torch.Tensor):
                return (
                    f"{opt} has a tensor {key} (param group {i}), which its step reads on the host; "
                    f"give it as a number{' or a tensor on ' + str(device) if key == 'lr' else ''}"
                )
    return None


def graph_stamp(optimizer: torch.optim.Optimizer, scaler: Any) -> tuple:
    """What a captured step bakes in that may change between steps: each param
    group's hyperparameters (tkern's kernels take them as arguments, so a graph
    replays the values of its capture; a tensor lr on the device by identity, read
    in place: :func:`tkern.graphs.key_value`) and its number of params, and the
    address of the loss scaler's state. A different stamp means capturing again."""
    groups = tuple(
        (len(g["params"]), tuple((k, key_value(v)) for k, v in g.items() if k != "params"))
        for g in optimizer.param_groups
    )
    state = scaler.state if isinstance(scaler, LossScaler) else None
    return groups, None if state is None else state.data_ptr()


def batch_key(x: torch.Tensor, y: torch.Tensor) -> tuple:
    """What a graph is kept per: the batch's shapes, strides, dtypes and devices."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in (x, y))


# ---------------------------------------------------------------------- the auto choice


def _address(t: torch.Tensor) -> int | None:
    try:
        return t.data_ptr()
    except RuntimeError:  # a tensor with no storage of its own (a wrapper subclass)
        return None


class _Trace(TorchDispatchMode):
    """What a step runs on ``device``, in order: each op through the dispatcher (its name,
    its first output's shape) and each launch of a tkern Triton kernel (its name and
    arguments: on a GPU they never pass the dispatcher), each with the parameters and
    buffers among its arguments (``named``: their names by address), so a branch that
    picks between same-shaped weights shows; and whether an op reads a device value on
    the host (``.item()``, a data-dependent shape) on a device of ``capture_type``, the
    type the capture seam records."""

    def __init__(self, device: torch.device, capture_type: str, named: dict[int, str]) -> None:
        super().__init__()
        self.device = device
        self.capture_type = capture_type
        self.named = named
        self.ops: list[tuple] = []
        self.host_read: str | None = None

    def _name(self, t: torch.Tensor) -> str | None:
        return self.named.get(_address(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or first.device != self.device:
            return out  # host-side bookkeeping (a scaler's pinned mirror), not the step's launches
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        values = tree_flatten((args, kwargs or {}))[0]
        params = tuple((i, self._name(v)) for i, v in enumerate(values) if isinstance(v, torch.Tensor))
        self.ops.append((str(func), shape, tuple(p for p in params if p[1] is not None)))
        scalar = func is torch.ops.aten._local_scalar_dense.default
        reads = scalar or torch.Tag.dynamic_output_shape in func.tags
        if reads and self.device.type == self.capture_type and self.host_read is None:
            self.host_read = str(func)
        return out

    def launch(self, kernel: str, args: tuple, kwargs: dict) -> None:
        """A tkern kernel's launch (:func:`tkern.graphs.trace_launches`): its tensors
        (dtype, shape, which parameter or buffer), its flags and modes; of a number only
        its type, since a graph may bake a number in on purpose (the step number with
        which the statistics mark an overflowing parameter), and sizes show in the shapes."""

        def arg(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return (v.dtype, tuple(v.shape), self._name(v))
            return v if isinstance(v, (bool, str, type(None))) else type(v).__name__

        named = tuple((k, arg(v)) for k, v in kwargs.items())
        self.ops.append(("triton", kernel, tuple(map(arg, args)), named))


def _named_tensors(model: nn.Module) -> dict[int, str]:
    """The addresses of ``model``'s parameters and buffers, to their names."""
    named = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        address = _address(t) if t.numel() else None
        if address is not None:
            named.setdefault(address, name)
    return named


@dataclass
class Observation:
    """One eager step of a batch shape, observed by ``cuda_graph="auto"``."""

    host_s: float  # until the step's Python returned
    synced_s: float  # until the device finished the step, from an idle device
    ops: list[tuple] | None = field(default=None, repr=False)  # None: not traced
    host_read: str | None = None

    @property
    def share(self) -> float:
        return self.host_s / self.synced_s if self.synced_s > 0 else 1.0


def choose(observed: list[Observation]) -> tuple[bool, str]:
    """``cuda_graph="auto"``'s choice for a batch shape from its observed steps (the
    first left out; traced ones carry their ops, timed ones None): (capture it, why), by
    the rule of the module docstring."""
    traced = [o for o in observed[1:] if o.ops is not None]
    timed = [o for o in observed[1:] if o.ops is None] or traced
    read = next((o.host_read for o in traced if o.host_read is not None), None)
    if read is not None:
        return False, f"the step reads a device value on the host ({read}), which a graph cannot replay"
    if any(o.ops != traced[0].ops for o in traced[1:]):
        return False, (
            "its steps ran different ops, or the same ops on different parameters (a data-dependent "
            "branch), so one graph cannot replay them"
        )
    fastest = min(timed, key=lambda o: o.synced_s)
    share = f"launching takes {fastest.share:.0%}"
    ms = f"{1e3 * fastest.host_s:.3g} ms of a {1e3 * fastest.synced_s:.3g} ms step"
    if fastest.share >= HOST_BOUND_SHARE:
        return True, f"the host bounds it: {share} ({ms}; >= {HOST_BOUND_SHARE:.0%})"
    return False, f"the device bounds it: {share} ({ms}; < {HOST_BOUND_SHARE:.0%})"


def agree(flag: bool, groups: list, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank of each of the process ``groups``: a MIN
    all-reduce of 0/1 on ``device`` (where the groups' backend runs: NCCL's on CUDA),
    read on the host once. Every rank must call it at the same point."""
    import torch.distributed as dist

    flags = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    for group in groups:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return bool(flags.item())


# ---------------------------------------------------------------------- the mixin


def _shape(key: tuple) -> tuple:
    return key[0][0]


class GraphMixin:
    """The whole-step graph of a :class:`tkern.Trainer`: ``cuda_graph`` (True, False or
    ``"auto"``), ``graphs``, ``graph_fallback``, ``graph_status`` and ``graph_counts``.

    Needs the trainer's ``model``, ``optimizer``, ``scaler``, ``scheduler``,
    ``accumulation_steps``, ``device`` and ``_steps_through``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    device: torch.device

    def _init_graphs(
        self, cuda_graph: bool | str, graph_capture: GraphCapture | None, scheduler: Any
    ) -> None:
        if cuda_graph not in (True, False, "auto") or not isinstance(cuda_graph, (bool, str)):
            raise TypeError(f"cuda_graph must be True, False or 'auto', got {cuda_graph!r}")
        if graph_capture is not None and cuda_graph is False:
            raise ValueError("graph_capture is used only with cuda_graph=True or 'auto'")
        self.cuda_graph = cuda_graph
        #: the whole-step graphs when the step may be captured, else None (eager steps)
        self.graphs: StepGraphs | None = None
        #: why the parts cannot be captured (None when they can, or with cuda_graph=False)
        self.graph_fallback: str | None = None
        #: ``"auto"``: per batch shape, (captured, why)
        self.graph_choices: dict[tuple, tuple[bool, str]] = {}
        self._status = "eager: cuda_graph=False"
        self._observed: tuple[Any, list[Observation]] = (None, [])  # the shape in a row, its steps
        self._short: set[tuple] = set()  # shapes logged for coming too few steps in a row
        self._warned_shapes = False
        #: per graph: the optimizer's grad_stats as captured (a static output every replay rewrites)
        self._captured_stats: dict = {}
        if cuda_graph is False:
            return
        capture = CudaGraphCapture() if graph_capture is None else graph_capture
        self.graph_fallback = graph_blocker(
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            accumulation_steps=self.accumulation_steps,
            scheduler=scheduler,
            device=self.device,
            capture_device_type=capture.device_type,
            interpreted=INTERPRET and self.device.type == "cuda",
            collectives_blocker=getattr(capture, "collectives_blocker", None),
        )
        if self.graph_fallback is not None:
            self._status = f"eager: {self.graph_fallback}"
            if cuda_graph is True:
                warnings.warn(f"Trainer(cuda_graph=True) runs eager: {self.graph_fallback}", stacklevel=3)
            else:
                logger.info("Trainer(cuda_graph='auto'): %s", self._status)
            return
        warmups = WARMUP_STEPS if cuda_graph is True else 1  # auto: its observed steps warmed up
        self.graphs = StepGraphs(capture, warmup_steps=warmups, max_graphs=MAX_GRAPHS)
        self._status = "graphed: no step yet" if cuda_graph is True else "auto: no step yet"
        if cuda_graph is True and getattr(self.optimizer, "underflow_every", None) is not None:
            warnings.warn(
                "Trainer(cuda_graph=True): the steps of the whole-step graph are not sampled for "
                "zero and subnormal gradients (optimizer.track_underflows): the report will hold "
                "no fractions from them and no 'scale likely too low' warning",
                stacklevel=3,
            )

    @property
    def graph_status(self) -> str:
        """How the last step ran and why, in one line: ``"eager: <why>"`` (the parts
        cannot be captured, or ``cuda_graph=False``), or, per batch shape, ``"graphed
        ..."`` / ``"eager ..."`` with the reason ``cuda_graph="auto"`` chose it."""
        return self._status

    @property
    def graph_counts(self) -> Counter[str]:
        """How the steps ran with graphs possible: ``warmup``, ``capture`` (captured,
        then replayed), ``replay``, ``eager`` (observed or chosen eager; empty without graphs)."""
        return Counter() if self.graphs is None else self.graphs.counts

    def _one_batch_step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        """A step of one micro-batch with graphs possible: through its shape's graph,
        or, with ``"auto"``, observed or eager as chosen for its shape."""
        if self.cuda_graph is True:
            return self._graphed_step(x, y, measure)
        key = batch_key(x, y)
        self._streak(key)
        choice = self.graph_choices.get(key)
        if choice is None:
            return self._observe(x, y, key, measure)
        if not choice[0]:
            self._status = f"eager for batches of shape {_shape(key)}: {choice[1]}"
            self.graphs.counts[EAGER] += 1
            return self._steps_through([(x, y)], set_to_none=False, measure=measure)
        saved = None if self.graphs.captured(key) else self._host_counters()
        try:
            out = self._graphed_step(x, y, measure)
        except CaptureError as e:  # raised by _graphed_step for "auto": this shape runs eager from now
            for part, counters in saved or ():  # the capture ran the step's Python: it counts once
                part.restore_host_counters(counters)
            why = capture_failed(f"the step for batches of shape {_shape(key)}", e)
            self._choose(key, False, f"{why}; the step was taken again eager")
            warnings.warn(f"Trainer(cuda_graph='auto'): {why}; batches of this shape run eager", stacklevel=4)
            self.graphs.counts[EAGER] += 1
            return self._steps_through([(x, y)], set_to_none=False, measure=measure)
        self._status = f"graphed for batches of shape {_shape(key)}: {choice[1]}"
        return out

    def _host_counters(self) -> list[tuple[Any, Any]]:
        """The optimizer's and the scaler's host-side counters (``host_counters()``,
        where they have one), for a step that may be captured: a capture runs the
        step's Python, and a failed one is taken again eager."""
        parts = (self.optimizer, self.scaler)
        return [(p, p.host_counters()) for p in parts if hasattr(p, "restore_host_counters")]

    def _streak(self, key: tuple) -> None:
        """``"auto"``: a step of another shape ends the observed shape's steps in a row;
        a shape that ended short is logged once (it stays eager until it comes
        :data:`OBSERVED_STEPS` steps in a row)."""
        last, observed = self._observed
        if key == last:
            return
        if last is not None and last not in self.graph_choices and last not in self._short:
            self._short.add(last)
            logger.info(
                "Trainer(cuda_graph='auto'): batches of shape %s run eager: %d step(s) in a row, "
                "and a shape is captured after %d in a row",
                _shape(last), len(observed), OBSERVED_STEPS,
            )  # fmt: skip
        self._observed = (key, [])

    def _observe(self, x: torch.Tensor, y: torch.Tensor, key: tuple, measure: bool) -> torch.Tensor:
        """``"auto"``: one eager step of a shape not chosen for yet, timed and traced;
        the choice after :data:`OBSERVED_STEPS` of them in a row."""
        observed = self._observed[1]
        seam = self.graphs.seam
        trace = None
        if len(observed) in TRACED_STEPS:
            trace = _Trace(self.device, seam.device_type, _named_tensors(self.model))
        with ExitStack() as traced:
            if trace is not None:
                traced.enter_context(trace)
                traced.enter_context(trace_launches(trace.launch))
            out, host_s, synced_s = seam.time(
                lambda: self._steps_through([(x, y)], set_to_none=False, measure=measure)
            )
        if trace is None:
            observed.append(Observation(host_s, synced_s))
        else:
            observed.append(Observation(host_s, synced_s, trace.ops, trace.host_read))
        self.graphs.counts[EAGER] += 1
        self._status = (
            f"eager for batches of shape {_shape(key)}: "
            f"observed {len(observed)} of {OBSERVED_STEPS} steps in a row"
        )
        if len(observed) == OBSERVED_STEPS:
            self._choose(key, *self._agreed(*self._auto_choice(observed)))
        return out

    def _auto_choice(self, observed: list[Observation]) -> tuple[bool, str]:
        if getattr(self.optimizer, "underflow_every", None) is not None:
            return False, "optimizer.track_underflows samples steps, which a graph's replays would not"
        graphed = sum(1 for captured, _ in self.graph_choices.values() if captured)
        if graphed >= MAX_GRAPHS:
            return False, f"graphs are kept for the first {MAX_GRAPHS} batch shapes only"
        return choose(observed)

    def _agreed(self, capture: bool, why: str) -> tuple[bool, str]:
        """Under a ``process_group``, the choice every rank makes: capture only where
        all ranks chose to (:func:`agree` over the optimizer's collective groups), since
        each decides from its own timing and a graph replays its step's collectives."""
        groups = self.optimizer.collective_groups() if isinstance(self.optimizer, FusedOptimizer) else []
        if not groups or agree(capture, groups, self.device) == capture:
            return capture, why
        return False, "another rank chose eager for it, and the ranks of a process group choose alike"

    def _choose(self, key: tuple, capture: bool, why: str) -> None:
        self.graph_choices[key] = (capture, why)
        self._status = f"{'graphed' if capture else 'eager'} for batches of shape {_shape(key)}: {why}"
        logger.info("Trainer(cuda_graph='auto'): %s", self._status)

    def _graphed_step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        """One whole step through :attr:`graphs`: the batch is copied into its shape's
        static buffers, then warmed up, captured or replayed (or run eager, for a
        shape beyond the first ``MAX_GRAPHS``). With ``cuda_graph=True`` a failed
        capture raises: its step ran part of its Python (the scaler's bookkeeping) and
        cannot be retaken (``"auto"`` takes it again eager, see :meth:`_one_batch_step`)."""
        key = batch_key(x, y)
        try:
            loss, how = self.graphs.run(
                lambda sx, sy: self._steps_through([(sx, sy)], set_to_none=False, measure=measure),
                (x, y),
                lambda: graph_stamp(self.optimizer, self.scaler),
                key,
            )
        except CaptureError as e:
            if self.cuda_graph == "auto":
                raise
            why = capture_failed(f"the step for batches of shape {tuple(x.shape)}", e)
            raise RuntimeError(f"Trainer(cuda_graph=True): {why}; train with cuda_graph=False") from e
        ran = "eager" if how == EAGER else "graphed"
        self._status = f"{ran} for batches of shape {tuple(x.shape)} ({how})"
        if how == EAGER and self.cuda_graph is True and not self._warned_shapes:
            self._warned_shapes = True
            warnings.warn(
                f"Trainer(cuda_graph=True): batches of shape {tuple(x.shape)} run eager; graphs "
                f"are kept for the first {MAX_GRAPHS} batch shapes only",
                stacklevel=5,
            )
        if how in (CAPTURE, REPLAY):  # the graph's outputs are static: the next replay rewrites them
            self._own_grad_stats(how, key)
            return loss.clone()
        return loss

    def _own_grad_stats(self, how: str, key: tuple) -> None:
        """After a capture or replay, the optimizer's ``grad_stats`` (where it has one)
        is this step's own copy, as after an eager step: a replay runs no Python, so
        it would otherwise keep naming the captured graph's static output, which
        every later replay rewrites."""
        if how == CAPTURE:
            self._captured_stats[key] = getattr(self.optimizer, "grad_stats", None)
        static = self._captured_stats.get(key)
        if isinstance(static, torch.Tensor):
            self.optimizer.grad_stats = static.clone()

    def graph_bytes(self) -> int:
        """The memory the CUDA graphs' pools hold (:meth:`graph_usage`'s ``reserved``)."""
        return self.graph_usage().reserved

    def graph_usage(self) -> PoolUsage:
        """The memory the CUDA graphs' pools hold, reserved and allocated: the whole
        step's graphs' and the fused optimizer's own step graph's (the pool of its
        ``graph_capture`` where that seam measures one, else its ``graph_pool_bytes``)."""
        whole = PoolUsage(0, 0) if self.graphs is None else self.graphs.pool_usage()
        seam = getattr(self.optimizer, "graph_capture", None)
        if seam is not None and seam is getattr(self.graphs, "seam", None):
            own = PoolUsage(0, 0)  # one seam, one pool: counted above
        elif hasattr(seam, "pool_usage"):
            own = seam.pool_usage()
        else:
            own = PoolUsage(*[getattr(self.optimizer, "graph_pool_bytes", 0)] * 2)
        return PoolUsage(whole.reserved + own.reserved, whole.allocated + own.allocated)
