"""The flat buffer of one param group: :class:`FlatParams` (the layout, the views,
the step's plan and the master's reconciliation; see :mod:`tkern.flat`)."""

from __future__ import annotations

import operator

import torch

from tkern.flat.fp32 import Fp32Views
from tkern.flat.layout import ALIGN, FlatLayout, alias, check_modes, describe_param
from tkern.flat.plan import StepPlan
from tkern.flat.storage import OWNED, ParamStorage
from tkern.flat.views import GradViews, register_view, release_views
from tkern.kernels._update import (
    ABSMAX_EPS,
    PARAM_DTYPES,
    QBLOCK,
    SIGNED_STATE,
    UpdateBuffers,
    zero_code,
)

# C-speed getters for the per-step scans over every param.
_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")


class FlatParams(FlatLayout, GradViews, Fp32Views, StepPlan):
    """The parameters of one param group on one device with one dtype.

    Args:
        params: the parameters, in order; each a leaf tensor.
        indices: each param's index within its param group (for messages).
        group: the param group's index (for messages).
        state_names: names of the state buffers to allocate, zeroed.
        world_size, rank: shard the master and state (ZeRO); 1, 0 for none.
        master: ``"fp32"``, ``"split"`` (bf16 params) or ``"none"``: how the
            master is kept (see :mod:`tkern.kernels._update`); fp32 params are
            their own master whatever it says.
        state_dtype: the state buffers' dtype: fp32, bf16, or uint8 (block-quantized;
            params then start on 256-element boundaries).
        seed: the stochastic rounding's seed (``master="none"``).
        storage: how the params are held (:class:`ParamStorage`); default: the
            buffer owns them.

    Attributes:
        param, grad: the flat param and gradient buffers (the params' dtype).
        master: this rank's shard of the master: fp32 (for fp32 params, the
            shard of ``param`` itself), the int16 remainders of a split master,
            or None.
        state: name -> buffer of this rank's shard (``state_dtype``).
        absmax: name -> fp32 block absmax of each uint8 state buffer.
        offsets: ``offsets[i]`` is where param i starts in ``param``/``grad``.
        lo, hi: this rank's shard, ``[lo, hi)`` in ``param``/``grad``.

    Built from four parts, each its own concern: :class:`~tkern.flat.FlatLayout` (where
    each param lies, the shard), :class:`~tkern.flat.GradViews` (``.grad`` kept as the
    gradient view), :class:`~tkern.flat.Fp32Views` (master and state read and
    written in fp32) and :class:`~tkern.flat.plan.StepPlan` (which ranges a step launches on,
    with which step counts).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        indices: list[int],
        group: int,
        state_names: tuple[str, ...],
        *,
        world_size: int = 1,
        rank: int = 0,
        master: str = "fp32",
        state_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        storage: ParamStorage = OWNED,
    ) -> None:
        first = params[0]
        if first.dtype not in PARAM_DTYPES:
            raise TypeError(
                f"{describe_param(group, indices[0], first)}: dtype must be one of {PARAM_DTYPES}"
            )
        check_modes(master, state_dtype, first.dtype)
        self.master_mode = "self" if first.dtype == torch.float32 else master
        self.state_dtype = state_dtype
        self.seed = seed & 0x7FFFFFFF
        self.params = params
        self.indices = indices
        self.group = group
        self.dtype, self.device = first.dtype, first.device
        self.storage = storage
        local = [storage.local(p) for p in params]
        shared = storage.shared_slots(params)
        #: Why the params' owner keeps storage of its own that each step copies into (a
        #: message), or None (plain params, or an owner whose storage is the flat buffer).
        self.alias_fallback = shared if isinstance(shared, str) else None
        slots = None if shared is None or isinstance(shared, str) else shared[0]
        align = QBLOCK if state_dtype == torch.uint8 else ALIGN
        FlatLayout.__init__(self, [t.shape for t in local], align, world_size, rank, slots)
        self.param = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        self._make_views()
        self._copy_in(local)
        #: Whether params held elsewhere live in the flat buffer (their owner's storage
        #: points into it): then nothing is copied in or out around a step.
        self.aliased = slots is not None
        if self.aliased:
            shared[1]([alias(self.param, self.offsets[i], n, (n,)) for i, n in enumerate(slots)])
        self._make_master()
        self._plan: list[UpdateBuffers] | None = None
        #: Bumped whenever :meth:`plan` hands out new launches (views, step counts).
        self.plan_version = 0
        #: Bumped whenever state buffers or step-count tensors are added or replaced.
        self.layout_version = 0
        self.state: dict[str, torch.Tensor] = {}
        self.absmax: dict[str, torch.Tensor] = {}
        self.ensure_state(state_names)
        self._start_counting()
        self._bind_params()

    #: What :meth:`_make_views` and :meth:`_bind_params` make: views of the buffers and
    #: lists keyed by the params' identity, never copied (a copy of a view is not a view
    #: of the copied buffer; see :meth:`__getstate__`).
    _BOUND = (
        "param_views",
        "grad_views",
        "grad_handles",
        "_trainable",
        "_views",
        "_ptrs",
        "_versions",
        "_zero_versions",
    )

    def _make_views(self) -> None:
        """Each param's views of the flat buffers: :attr:`param_views` and :attr:`grad_views`
        (None for a param that needs no gradient), and :attr:`_views`, the gradient
        views whose version counters say which params have a gradient."""
        self.param_views: list[torch.Tensor] = [
            self.param_alias(self.param, i) for i in range(len(self.params))
        ]
        self.grad_views: list[torch.Tensor | None] = [
            self.param_alias(self.grad, i) if p.requires_grad else None for i, p in enumerate(self.params)
        ]
        self._trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self._views = [self.grad_views[i] for i in self._trainable]

    def _copy_in(self, local: list[torch.Tensor]) -> None:
        """Copy the params (``local``: as :meth:`local` gives them) and any gradients they
        have into the flat buffers."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.param_views[i].copy_(local[i])
                if self.grad_views[i] is not None and p.grad is not None:
                    self.grad_views[i].copy_(self.storage.unwrap(p, p.grad))

    def _bind_params(self) -> None:
        """Make the params live in the views (``param.data``, when the buffer owns the
        storage; ``.grad``, with the hooks that keep it so) and record what the step's
        checks compare with (the params' addresses and version counters). The one place
        that ties params to buffers: the constructor and :meth:`__setstate__` call it."""
        for i, p in enumerate(self.params):
            if self.storage.owns_storage:
                if self.grad_views[i] is not None:
                    register_view(p, self.grad_views[i])
                p.data = self.param_views[i]
        self.wrap_grads()
        self._ptrs = [p.data_ptr() for p in self.params] if self.storage.owns_storage else []
        self._versions: list | None = self.storage.versions(self.params)
        self.attach_grads()

    def _make_master(self) -> None:
        """This shard's master, as :attr:`master_mode` keeps it."""
        shard = self.param[self.lo : self.hi]
        self.master: torch.Tensor | None = None  # "none"
        if self.master_mode == "self":
            self.master = shard
        elif self.master_mode == "fp32":
            self.master = shard.float()
        elif self.master_mode == "split":  # remainders 0: the master is the param
            self.master = torch.zeros(self.shard_size, dtype=torch.int16, device=self.device)

    # ------------------------------------------------------------- layout and state

    def local(self, i: int) -> torch.Tensor:
        """Param ``i`` as the buffer holds it: the param, or its local shard (see :class:`ParamStorage`)."""
        return self.storage.local(self.params[i])

    def ensure_state(self, names: tuple[str, ...]) -> bool:
        """Allocate (zeroed) any of the state buffers ``names`` not there yet;
        True if one was added."""
        added = False
        for name in names:
            if name not in self.state:
                self.state[name] = torch.zeros(self.shard_size, dtype=self.state_dtype, device=self.device)
                if self.state_dtype == torch.uint8:
                    # zero state as the kernel stores it: every block's absmax clamped to
                    # ABSMAX_EPS and the code of 0.0 (not code 0, which is -1 in the signed map)
                    self.state[name].fill_(zero_code(name in SIGNED_STATE))
                    self.absmax[name] = torch.full(
                        (self.shard_size // QBLOCK,), ABSMAX_EPS, dtype=torch.float32, device=self.device
                    )
                added = True
        if added:
            self._changed()
        return added

    def nbytes(self) -> dict[str, int]:
        """Bytes of each kind of buffer: ``param``, ``grad`` (full size), ``master`` and
        ``state`` (this shard; block absmax included; 0 for fp32 params' master)."""
        state = sum(b.numel() * b.element_size() for b in (*self.state.values(), *self.absmax.values()))
        master = 0 if self.master is None or self.master_mode == "self" else self.master.numel()
        return {
            "param": self.param.numel() * self.param.element_size(),
            "grad": self.grad.numel() * self.grad.element_size(),
            "master": master * (self.master.element_size() if master else 0),
            "state": state,
        }

    def _changed(self) -> None:
        self._plan = None
        self.layout_version += 1

    def _describe(self, i: int) -> str:
        return describe_param(self.group, self.indices[i], self.params[i])

    # ------------------------------------------------------------- gradients

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the flat gradient buffer in place and put the views back as ``.grad``.
        With ``set_to_none`` no param counts as having a gradient until backward
        gives it one (its ``.grad`` still reads zeros)."""
        self.check_storage()
        self.grad.zero_()
        if not self._grads_are_views():
            for p, handle in zip(self.params, self.grad_handles, strict=True):
                if p.grad is not handle:
                    p.grad = handle
        release_views(self.grad_views)  # a backward that failed before its hooks ran
        self._zero_versions = list(map(_VERSION, self._views))
        self._all_active = not set_to_none

    def _grads_are_views(self) -> bool:
        """Whether every param's ``.grad`` is what the buffer keeps there (one C-speed scan)."""
        return all(map(operator.is_, map(_GRAD, self.params), self.grad_handles))

    # ------------------------------------------------------------- storage checks (the plan: tkern.flat.plan)

    def check_storage(self) -> None:
        """Raise if a param's ``.data`` was replaced (``.to()``, ``.float()``, assignment);
        nothing for params held elsewhere (their current local tensor is copied in and out)."""
        if self.storage.owns_storage and list(map(torch.Tensor.data_ptr, self.params)) != self._ptrs:
            for i, p in enumerate(self.params):
                if p.data_ptr() != self._ptrs[i]:
                    raise RuntimeError(
                        f"{self._describe(i)} no longer lives in the optimizer's flat buffer: its .data "
                        "was replaced (by .to(), .float(), .half() or an assignment) after the optimizer "
                        "was built; build the optimizer after moving or casting the model"
                    )

    # ------------------------------------------------------------- master and params

    def mark_dirty(self) -> None:
        """Reconcile master and params before the next step (after loading a master)."""
        self._versions = None

    def reconcile(self) -> None:
        """Where a param differs from its rounded master, the master takes the
        param's value; elsewhere the master keeps its extra bits. (A split master
        always rounds to its param, and there is nothing to reconcile without one.)
        Params held elsewhere are first copied into the buffer."""
        if not self.storage.owns_storage:
            local = [self.local(i) for i in range(len(self.params))]
            if self.aliased and any(
                t.data_ptr() != v.data_ptr()
                for t, v in zip(local, self.param_views, strict=True)
                if v.numel()
            ):
                # the owner re-pointed its storage (load_state_dict(assign=True)): copy from now on
                self.aliased = False
                self.alias_fallback = (
                    "the owner's storage of a param was replaced after the optimizer was built"
                )
            if not self.aliased:
                with torch.no_grad():
                    torch._foreach_copy_(self.param_views, local)
        if self.master_mode != "fp32":
            return
        with torch.no_grad():
            p = self.param[self.lo : self.hi]
            torch.where(self.master.to(self.dtype) == p, self.master, p.float(), out=self.master)

    def write_back(self) -> None:
        """After a step: copy the updated params into storage the buffer does not own
        (FSDP2's local shards, which its next all-gather reads) unless it is the flat
        buffer itself (:attr:`aliased`); nothing otherwise."""
        if self.storage.owns_storage or self.aliased:
            return
        with torch.no_grad():
            torch._foreach_copy_([self.local(i) for i in range(len(self.params))], self.param_views)
        self._versions = self.storage.versions(self.params)

    # ------------------------------------------------------------- copies

    def __getstate__(self) -> dict:
        """What a deep copy or pickle carries: the buffers, the layout, the step counts
        and what the next step needs to know of the params' history, but none of
        :attr:`_BOUND` (views and counters of these params, rebuilt by
        :meth:`__setstate__` over the copied buffers and params)."""
        state = {k: v for k, v in self.__dict__.items() if k not in self._BOUND}
        state["_plan"] = None
        if self.master_mode == "self":  # fp32 params' master is their buffer (a pickle would part them)
            state["master"] = None
        # which params have a gradient since the last zero_grad, and whether the params
        # were written from outside since the last step (the master follows them)
        state["_has_grad"] = [v._version != z for v, z in zip(self._views, self._zero_versions, strict=True)]
        state["_dirty"] = self._versions is None or self.storage.versions(self.params) != self._versions
        return state

    def __setstate__(self, state: dict) -> None:
        """After a deep copy or unpickling: the (copied) params become views of the
        (copied) buffers again, with their hooks, as the constructor makes them; a
        param keeps whether it has a gradient this step, and the master whether it
        must follow the params."""
        has_grad, dirty = state["_has_grad"], state["_dirty"]
        self.__dict__.update((k, v) for k, v in state.items() if k not in ("_has_grad", "_dirty"))
        if self.master_mode == "self":
            self.master = self.param[self.lo : self.hi]
        self._make_views()
        self._bind_params()
        self._zero_versions = [-1 if on else v._version for v, on in zip(self._views, has_grad, strict=True)]
        if dirty:
            self.mark_dirty()
