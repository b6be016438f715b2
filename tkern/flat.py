"""Flat buffers: many parameters in one contiguous, padded allocation.

A :class:`FlatParams` holds the parameters of one param group that share a
device and a dtype. It is the one layout the fused optimizers, the compiled
kernels and the sharded (ZeRO-2) optimizer all build on:

Layout
    Every param starts at a multiple of :data:`ALIGN` (16) elements and takes
    ``ceil(numel / 16) * 16`` slots; the buffer's length is a multiple of
    ``16 * world_size``. So every param, every launch range and every shard
    starts and ends on a 16-element boundary (32 B for fp16, 64 B for fp32)
    and the streaming kernels get 128-bit accesses with no ragged edge.
    Padding slots are zero in every buffer and stay zero: their gradient is
    never written (no param's view covers it), so they add nothing to the
    gradient norm, and every update rule maps (param 0, grad 0, state 0) to 0.

Views with their own storage
    ``param.data`` and ``param.grad`` become *aliases* of their slots (tensors
    over the same memory with a storage object of their own, made through
    DLPack). Writes through them land in the flat buffer, yet
    ``torch.save(submodule.state_dict())`` or safetensors see one param's
    bytes, not the whole buffer, and each param keeps its own version counter.

Who owns the truth
    The params are the truth; the fp32 master is their shadow. Every in-place
    write to a param from outside the optimizer (``model.load_state_dict``,
    DDP's initial broadcast, ``p.mul_(0.5)`` under no_grad) bumps that param's
    version counter; :meth:`plan` compares the counters with the ones it saw
    last (one list comparison per step) and, if any moved, the master takes
    the param's value wherever ``param != round(master)`` and keeps its extra
    bits wherever they agree. Writes through ``param.data`` bypass the
    counter: call :meth:`reconcile` (``optimizer.refresh_master()``) after those.

Per-param step counts, "no grad, no update"
    A param has a gradient this step when its gradient view was written since
    the last ``zero_grad(set_to_none=True)``: autograd accumulates into the
    view in place, which bumps the view's version counter (so does any
    ``p.grad.copy_(g)``), or ``.grad`` is another tensor (copied in then).
    ``zero_grad(set_to_none=False)`` makes every param count, as torch's zero
    tensors would. A post-accumulate-grad hook puts the flat view back as
    ``.grad`` when autograd made a new tensor (after ``model.zero_grad()``), and
    without a copy when that tensor is over the view's own memory: a backward
    that put its gradient into the view in place (:func:`take_grad_view`;
    ``tkern.linear``'s weight gradient, by its GEMM). Params that share a history
    share a step-count tensor on the device (a *cohort*): normally one per
    buffer, so one launch covers the buffer; a param that sat out a step
    moves to a cohort of its own history, and launches split at cohort
    boundaries. In the steady state :meth:`plan` costs three C-speed list
    scans per step and returns a cached plan.

Storage the buffer does not own
    A param whose memory belongs to someone else (FSDP2's local shard of a
    DTensor param, which FSDP2 all-gathers from its own padded buffer) is
    described by a :class:`ParamStorage` with ``owns_storage = False``: the
    buffer holds a copy of the param's local tensor, :meth:`FlatParams.plan`
    copies it in again whenever the param's version counter moved, and
    :meth:`FlatParams.write_back` copies the updated values out after each step.
    ``.grad`` is then what :meth:`ParamStorage.wrap` makes of the gradient
    view (a DTensor over it), so that in-place accumulation still lands in
    the flat buffer.

Shards
    With ``world_size = W`` the buffer splits into W equal shards of
    ``len / W`` elements (multiples of 16); rank r's fp32 master and state
    cover only ``[r * len / W, (r + 1) * len / W)``, the slice reduce-scatter
    leaves it and all-gather reads from it. ``W = 1`` is the plain optimizer.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable

import torch

from tkern.kernels._update import (
    ABSMAX_EPS,
    MASTER_MODES,
    PARAM_DTYPES,
    QBLOCK,
    SIGNED_STATE,
    STATE_DTYPES,
    UpdateBuffers,
    state_from_fp32,
    state_to_fp32,
    zero_code,
)

#: Every param, launch range and shard starts on a multiple of this many elements
#: (of QBLOCK = 256 in a buffer with block-quantized uint8 state: whole blocks).
ALIGN = 16

# C-speed getters for the per-step scans over every param.
_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")


def check_modes(master: str, state_dtype: torch.dtype, param_dtype: torch.dtype | None = None) -> None:
    """Raise ``ValueError`` naming the argument unless ``master`` and ``state_dtype``
    are modes a flat buffer of ``param_dtype`` params can keep."""
    if master not in MASTER_MODES:
        raise ValueError(f'master must be "fp32", "split" or "none", got {master!r}')
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be torch.float32, torch.bfloat16 or torch.uint8, got {state_dtype!r}"
        )
    if master == "split" and param_dtype == torch.float16:
        raise ValueError(
            'master="split" keeps the fp32 master as a bf16 param plus 16 low bits: it needs bf16 '
            'params, got float16 (use master="fp32", or bf16 params)'
        )


def describe_param(group: int, index: int, p: torch.Tensor) -> str:
    """How error messages name a parameter: its group, index, shape and dtype."""
    return f"param {index} of param group {group} (shape {tuple(p.shape)}, dtype {p.dtype})"


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 master as ``(param, remainder)``: the bf16 param (the master rounded to
    nearest, ties away from zero) and the int16 remainder with
    ``master == join_master(param, remainder)`` bit for bit (the update kernels'
    ``store_master`` in split mode, on the host)."""
    bits = master.contiguous().view(torch.int32)
    rounded = (bits + 0x8000) & -65536
    return (rounded >> 16).to(torch.int16).view(torch.bfloat16), (bits - rounded).to(torch.int16)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 ``param`` and its int16 ``remainder`` hold (a new tensor)."""
    high = param.contiguous().view(torch.int16).to(torch.int32)
    return ((high << 16) + remainder.to(torch.int32)).view(torch.float32)


#: ``id(param)`` -> weak references to the param and its gradient view (the view lives
#: as long as its FlatParams or the param's ``.grad``): what :func:`take_grad_view` and
#: :func:`grad_is_flat_view` look up; an entry leaves with its param. Plain dicts keyed
#: by id and checked by identity (tensors compare elementwise): a lookup costs ~0.1 us,
#: where torch's WeakIdKeyDictionary costs ~0.9.
_VIEW_OF: dict[int, tuple[weakref.ref, weakref.ref]] = {}
#: ``id(view)`` -> a weak reference to each view :func:`take_grad_view` handed out whose
#: hook has not yet adopted it back; an entry leaves with its view (an optimizer dropped
#: while its view was taken: no hook runs any more).
_TAKEN: dict[int, weakref.ref] = {}


def _dropper(table: dict, key: int, index: int | None = None) -> Callable[[weakref.ref], None]:
    """A weakref callback removing ``table[key]`` if that entry (or its element
    ``index``) is still the reference that died (an id can be reused meanwhile)."""

    def drop(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and (entry if index is None else entry[index]) is ref:
            del table[key]

    return drop


def _register_view(param: torch.Tensor, view: torch.Tensor) -> None:
    key = id(param)
    _VIEW_OF[key] = (weakref.ref(param, _dropper(_VIEW_OF, key, 0)), weakref.ref(view))


def _view_of(param: torch.Tensor) -> torch.Tensor | None:
    entry = _VIEW_OF.get(id(param))
    return None if entry is None or entry[0]() is not param else entry[1]()


def _taken(view: torch.Tensor) -> bool:
    ref = _TAKEN.get(id(view))
    return ref is not None and ref() is view


def grad_is_flat_view(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is its gradient view into a :class:`FlatParams`
    buffer (the ``.grad`` a fused optimizer keeps)."""
    g = param.grad
    return g is not None and g is _view_of(param)


def has_grad_view(param: torch.Tensor) -> bool:
    """Whether a :class:`FlatParams` keeps a gradient view for ``param`` (its
    params are those of a fused optimizer): a cheap test before :func:`take_grad_view`."""
    return _view_of(param) is not None


def take_grad_view(param: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """For a backward that puts ``param``'s gradient straight into its flat view
    and hands autograd a tensor over that memory (``tkern.linear``'s weight
    gradient, by its GEMM): ``(view, accumulate)``, or None where it cannot.

    ``accumulate``: ``.grad`` is the view, the gradient is added into it; False:
    ``.grad`` is None (``model.zero_grad()``), the gradient is written (autograd
    would start from nothing). None: ``param`` has no view, its ``.grad`` is
    another tensor, or the view was taken in this backward and not yet adopted
    back (a second use of a shared weight: it returns its gradient as usual and
    autograd sums the two). The view counts as taken until the post-accumulate-grad
    hook adopts the tensor over its memory (no copy) or :meth:`FlatParams.zero_grad`."""
    view, g = _view_of(param), param.grad
    if view is None or (g is not None and g is not view) or _taken(view):
        return None
    accumulate = g is not None
    _TAKEN[id(view)] = weakref.ref(view, _dropper(_TAKEN, id(view)))
    return view, accumulate


def alias(flat: torch.Tensor, start: int, numel: int, shape: torch.Size) -> torch.Tensor:
    """``flat[start:start + numel]`` shaped ``shape``, as a tensor with a storage of its own
    over the same memory (it keeps ``flat`` alive)."""
    return torch.from_dlpack(flat.narrow(0, start, numel).detach()).view(shape)


class _AdoptGrad:
    """Post-accumulate-grad hook: keeps param ``index``'s ``.grad`` the flat view
    (copying in a gradient autograd made as a new tensor). A module-level
    object holding a weak reference, so it never keeps an optimizer alive
    (hooks are neither pickled nor deep-copied by torch)."""

    __slots__ = ("flat", "index")

    def __init__(self, flat: FlatParams, index: int) -> None:
        self.flat = weakref.ref(flat)
        self.index = index

    def __call__(self, p: torch.Tensor) -> None:
        flat = self.flat()
        if flat is not None:
            flat.adopt_grad(self.index, p)


class ParamStorage:
    """How a :class:`FlatParams` holds its params: this default makes each
    param's ``.data`` its view of the flat buffer (the buffer owns the memory)
    and its ``.grad`` the gradient view itself. A subclass describes params
    whose memory stays elsewhere (see "Storage the buffer does not own" above).

    Attributes:
        owns_storage: whether ``param.data`` becomes the flat view.
        stats_group: the process group over which the step's statistics of
            these params' gradients are summed (each rank holds a shard of
            them), or None (the gradients are whole on every rank).
    """

    owns_storage: bool = True
    stats_group: object = None

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the flat buffer holds for ``param`` (same shape, dtype and values)."""
        return param

    def wrap(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (shaped like :meth:`local`: the gradient view that becomes ``.grad``, a
        state entry in ``state_dict()``) as a tensor of ``param``'s kind: itself here."""
        return local

    def unwrap(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The part of ``value`` (shaped like ``param``: a ``.grad``, a loaded state entry)
        that the buffer holds, shaped like :meth:`local`: ``value`` itself here."""
        return value


#: The storage of plain params.
OWNED = ParamStorage()


class FlatParams:
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
        align = QBLOCK if state_dtype == torch.uint8 else ALIGN
        self.params = params
        self.indices = indices
        self.group = group
        self.dtype, self.device = first.dtype, first.device
        self.storage = storage
        local = [storage.local(p) for p in params]
        #: Each param's shape in the buffer (its local shard's, for params held elsewhere).
        self.shapes = [t.shape for t in local]
        self.numels = [t.numel() for t in local]
        self.offsets = [0, *itertools.accumulate(round_up(n, align) for n in self.numels)]
        self.world_size, self.rank = world_size, rank
        total = round_up(self.offsets[-1], align * world_size)
        self.shard_size = total // world_size
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size

        self.param = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.param_views: list[torch.Tensor] = []
        self.grad_views: list[torch.Tensor | None] = []
        with torch.no_grad():
            for i, p in enumerate(params):
                self.param_views.append(self._alias(self.param, i))
                self.param_views[i].copy_(local[i])
                if p.requires_grad:
                    self.grad_views.append(self._alias(self.grad, i))
                    if storage.owns_storage:
                        _register_view(p, self.grad_views[i])
                    if p.grad is not None:
                        self.grad_views[i].copy_(storage.unwrap(p, p.grad))
                else:
                    self.grad_views.append(None)
                if storage.owns_storage:
                    p.data = self.param_views[i]
        self._wrap_grads()
        shard = self.param[self.lo : self.hi]
        self.master: torch.Tensor | None = None  # "none"
        if self.master_mode == "self":
            self.master = shard
        elif self.master_mode == "fp32":
            self.master = shard.float()
        elif self.master_mode == "split":  # remainders 0: the master is the param
            self.master = torch.zeros(self.shard_size, dtype=torch.int16, device=self.device)
        self._plan: list[UpdateBuffers] | None = None
        #: Bumped whenever :meth:`plan` hands out new launches (views, step counts).
        self.plan_version = 0
        #: Bumped whenever state buffers or step-count tensors are added or replaced.
        self.layout_version = 0
        self.state: dict[str, torch.Tensor] = {}
        self.absmax: dict[str, torch.Tensor] = {}
        self.ensure_state(state_names)
        # The gradient views' versions at the last zero_grad(set_to_none=True); a view
        # whose version moved since has a gradient. -1: counts from the start.
        self._trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self._views = [self.grad_views[i] for i in self._trainable]
        self._zero_versions = [
            -1 if params[i].grad is not None else v._version
            for i, v in zip(self._trainable, self._views, strict=True)
        ]
        self._all_active = False
        #: cohort[i]: index into steps of param i's step-count tensor.
        self.cohort = [0] * len(params)
        self.steps = [torch.zeros(1, dtype=torch.float32, device=self.device)]
        self._ptrs = [p.data_ptr() for p in params] if storage.owns_storage else []
        self._versions: list[int] | None = [p._version for p in params]
        self._attach()

    # ------------------------------------------------------------- layout

    def _alias(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return alias(flat, self.offsets[i], self.numels[i], self.shapes[i])

    def _wrap_grads(self) -> None:
        #: What each param's ``.grad`` is kept as: its gradient view, or the storage's wrapper of it.
        self.grad_handles = [
            None if v is None else self.storage.wrap(p, v)
            for p, v in zip(self.params, self.grad_views, strict=True)
        ]

    def local(self, i: int) -> torch.Tensor:
        """Param ``i`` as the buffer holds it: the param, or its local shard (see :class:`ParamStorage`)."""
        return self.storage.local(self.params[i])

    def shard_view(self, buf: torch.Tensor, i: int) -> torch.Tensor | None:
        """Param ``i``'s part of a shard-sized buffer (master or state), shaped
        like the param; None unless the param lies wholly in this rank's shard."""
        s = self.offsets[i]
        if s < self.lo or s + self.numels[i] > self.hi:
            return None
        return buf[s - self.lo : s - self.lo + self.numels[i]].view(self.shapes[i])

    def copy_into_shard(self, buf: torch.Tensor, i: int, value: torch.Tensor) -> None:
        """Copy the part of param ``i``'s full-size ``value`` that lies in this rank's
        shard into the shard-sized buffer ``buf`` (all of it when unsharded)."""
        s = self.offsets[i]
        a, b = max(s, self.lo), min(s + self.numels[i], self.hi)
        if b > a:
            buf[a - self.lo : b - self.lo].copy_(value.reshape(-1)[a - s : b - s])

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

    # ------------------------------------------------------------- master and state in fp32

    @property
    def keeps_master(self) -> bool:
        """Whether a master is kept beside the params (fp32 or split)."""
        return self.master_mode in ("fp32", "split")

    def master_fp32(self) -> torch.Tensor | None:
        """This shard's fp32 master: the live buffer (fp32 master, or fp32 params'
        own shard), a rebuilt copy (split), or None (no master)."""
        if self.master_mode == "split":
            return join_master(self.param[self.lo : self.hi], self.master)
        return self.master

    def set_master_fp32(self, values: torch.Tensor) -> None:
        """Store ``values`` (this shard's fp32 master) as the master; the params are
        never changed. An fp32 master is then reconciled with the params before the
        next step (see :meth:`mark_dirty`; loading one before or after the model
        gives the same run); a split master keeps the values' remainders (the
        master is exact where a param is the value rounded, and always rounds to
        its param). Nothing for fp32 params or no master."""
        with torch.no_grad():
            if self.master_mode == "fp32":
                if values is not self.master:
                    self.master.copy_(values)
                self.mark_dirty()
            elif self.master_mode == "split":
                self.master.copy_(split_master(values)[1])

    def state_fp32(self, name: str) -> torch.Tensor:
        """This shard's state ``name`` in fp32: the live buffer if it is fp32, else a
        converted copy."""
        buf = self.state[name]
        if buf.dtype == torch.float32:
            return buf
        return state_to_fp32(buf, self.absmax.get(name), name in SIGNED_STATE)

    def set_state_fp32(self, name: str, values: torch.Tensor) -> None:
        """Store this shard's fp32 ``values`` as state ``name`` (rounded or quantized
        as the update kernel stores it)."""
        buf = self.state[name]
        if values is not buf:
            state_from_fp32(values.contiguous(), buf, self.absmax.get(name), name in SIGNED_STATE)

    def export_fp32(self, gather=None) -> dict[str, torch.Tensor]:
        """The master (fp32 or split; not fp32 params' own nor none) and every state
        buffer in fp32: this shard's, or with ``gather`` (a function from a shard
        buffer to the full buffer of every rank's shards, in rank order) the whole
        buffer's. Buffers kept in fp32 come back as they are (live, when not gathered)."""
        g = gather if gather is not None else (lambda t: t)
        out: dict[str, torch.Tensor] = {}
        if self.master_mode == "fp32":
            out["master"] = g(self.master)
        elif self.master_mode == "split":
            low = g(self.master)
            param = self.param if low.numel() == self.param.numel() else self.param[self.lo : self.hi]
            out["master"] = join_master(param, low)
        for name, buf in self.state.items():
            if buf.dtype == torch.float32:
                out[name] = g(buf)
            else:
                out[name] = state_to_fp32(g(buf), g(self.absmax[name]) if name in self.absmax else None,
                                          name in SIGNED_STATE)  # fmt: skip
        return out

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

    def _attach(self) -> None:
        """Register the gradient hooks and make the flat views the params' ``.grad``."""
        for i, p in enumerate(self.params):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_AdoptGrad(self, i))
                p.grad = self.grad_handles[i]

    def adopt_grad(self, i: int, p: torch.Tensor) -> None:
        """Called by the hook after autograd accumulated param ``i``'s gradient: a
        tensor over the view's own memory (a backward that put its gradient into
        the view, see :func:`take_grad_view`) is replaced by the view, anything
        else copied into it."""
        g, view = p.grad, self.grad_views[i]
        if _TAKEN:  # (empty unless a backward is putting gradients into views)
            _TAKEN.pop(id(view), None)
        if g is self.grad_handles[i] or g is None:
            return
        same = (  # (a DTensor .grad of a param held elsewhere is never the view's memory)
            self.storage.owns_storage
            and g.data_ptr() == view.data_ptr()
            and g.stride() == view.stride()
            and g.shape == view.shape
        )
        if same and g.dtype == view.dtype:
            p.grad = view  # the same memory, already holding the gradient
        else:
            self._adopt_grad(i, g)

    def _adopt_grad(self, i: int, g: torch.Tensor) -> None:
        """Copy a gradient tensor that is not the flat view into it, and put the view back."""
        p = self.params[i]
        if g.layout != torch.strided:
            raise TypeError(f"{self._describe(i)}: sparse gradients are not supported (layout {g.layout})")
        if g.shape != p.shape:
            raise ValueError(
                f"{self._describe(i)}: .grad has shape {tuple(g.shape)}, expected {tuple(p.shape)}"
            )
        with torch.no_grad():
            self.grad_views[i].copy_(self.storage.unwrap(p, g))
        p.grad = self.grad_handles[i]

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the flat gradient buffer in place and put the views back as ``.grad``.
        With ``set_to_none`` no param counts as having a gradient until backward
        gives it one (its ``.grad`` still reads zeros)."""
        self.check_storage()
        self.grad.zero_()
        for p, view, handle in zip(self.params, self.grad_views, self.grad_handles, strict=True):
            if p.grad is not handle:
                p.grad = handle
            if _TAKEN:  # a backward that failed before its hooks ran
                _TAKEN.pop(id(view), None)
        self._zero_versions = [v._version for v in self._views]
        self._all_active = not set_to_none

    # ------------------------------------------------------------- the step's plan

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

    def plan(self) -> list[UpdateBuffers]:
        """The launches of this step: the :class:`UpdateBuffers` (views of every
        buffer, the step count, the random stream's offset; ``stats`` and
        ``inv_scale`` left for the step to set) of each range of params that have
        a gradient, clipped to this rank's shard, split where the step counts differ.

        Also brings the master up to date with params written from outside
        (see the module docstring), copies in gradients that are not the flat
        views, and moves params that sit this step out into cohorts of their own.
        """
        params = self.params
        self.check_storage()
        versions = list(map(_VERSION, params))
        if versions != self._versions:
            self.reconcile()
            self._versions = versions
        if (
            self._plan is not None
            and all(map(operator.is_, map(_GRAD, params), self.grad_handles))
            and (self._all_active or all(map(operator.ne, map(_VERSION, self._views), self._zero_versions)))
        ):
            return self._plan  # the steady state: nothing changed since the last step
        active = [False] * len(params)
        for k, i in enumerate(self._trainable):
            g, view = params[i].grad, self._views[k]
            if g is None:
                continue
            if g is not self.grad_handles[i]:
                self._adopt_grad(i, g)
                self._zero_versions[k] = -1
            active[i] = self._all_active or view._version != self._zero_versions[k]
        self._split_cohorts(active)
        launches = [self._buffers(s, e, step) for s, e, step in self._ranges(active)]
        self.plan_version += 1  # new launches: a captured step (tkern.optim.fused.StepGraph) is stale
        if all(active[i] for i in self._trainable):
            self._plan = launches
        return launches

    def _buffers(self, s: int, e: int, step: torch.Tensor) -> UpdateBuffers:
        """The views of ``[s, e)`` (in ``param`` coordinates, within this shard)."""
        a, b = s - self.lo, e - self.lo
        return UpdateBuffers(
            param=self.param[s:e],
            grad=self.grad[s:e],
            master=None if self.master is None else self.master[a:b],
            stats=None,
            inv_scale=None,
            step=step,
            state={k: v[a:b] for k, v in self.state.items()},
            absmax={k: v[a // QBLOCK : b // QBLOCK] for k, v in self.absmax.items()},
            seed=self.seed,
            offset=s,
        )

    def _split_cohorts(self, active: list[bool]) -> None:
        """Give the active members of a cohort that also has inactive members a
        new cohort (a copy of the step count), so only they count this step."""
        members: dict[int, list[int]] = {}
        for i, c in enumerate(self.cohort):
            if self.grad_views[i] is not None:
                members.setdefault(c, []).append(i)
        for c, idx in members.items():
            on = [i for i in idx if active[i]]
            if on and len(on) < len(idx):
                self.steps.append(self.steps[c].clone())
                for i in on:
                    self.cohort[i] = len(self.steps) - 1
                self._changed()

    def _ranges(self, active: list[bool]) -> list[tuple[int, int, torch.Tensor]]:
        runs: list[list[int]] = []  # [start, end, cohort]
        for i, on in enumerate(active):
            if not on:
                continue
            start, end, c = self.offsets[i], self.offsets[i + 1], self.cohort[i]
            if runs and runs[-1][1] == start and runs[-1][2] == c:
                runs[-1][1] = end
            else:
                runs.append([start, end, c])
        if runs and runs[-1][1] == self.offsets[-1]:
            runs[-1][1] = self.param.numel()  # the tail padding rides along
        out = []
        for start, end, c in runs:
            s, e = max(start, self.lo), min(end, self.hi)
            # an empty run of an unsharded buffer (params whose local shards are empty on this
            # rank) still counts the step: no launch, but every rank's step counts agree
            if e > s or (self.world_size == 1 and e == s):
                out.append((s, e, self.steps[c]))
        return out

    def set_cohorts(self, steps: list[float]) -> None:
        """Set each param's step count (from a loaded state): params with equal
        counts share one step tensor."""
        by_value: dict[float, int] = {}
        cohort = []
        for value in steps:
            cohort.append(by_value.setdefault(value, len(by_value)))
        self.steps = [torch.full((1,), v, dtype=torch.float32, device=self.device) for v in by_value]
        self.cohort = cohort
        self._changed()

    def set_param_step(self, i: int, value: float) -> None:
        """Give param ``i`` a step count of its own."""
        self.steps.append(torch.full((1,), value, dtype=torch.float32, device=self.device))
        self.cohort[i] = len(self.steps) - 1
        self._changed()

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
            with torch.no_grad():
                torch._foreach_copy_(self.param_views, [self.local(i) for i in range(len(self.params))])
        if self.master_mode != "fp32":
            return
        with torch.no_grad():
            p = self.param[self.lo : self.hi]
            torch.where(self.master.to(self.dtype) == p, self.master, p.float(), out=self.master)

    def write_back(self) -> None:
        """After a step: copy the updated params into storage the buffer does not own
        (FSDP2's local shards, which its next all-gather reads); nothing otherwise."""
        if self.storage.owns_storage:
            return
        with torch.no_grad():
            torch._foreach_copy_([self.local(i) for i in range(len(self.params))], self.param_views)
        self._versions = list(map(_VERSION, self.params))

    # ------------------------------------------------------------- copies

    def __getstate__(self) -> dict:
        state = {
            k: v for k, v in self.__dict__.items() if k not in ("param_views", "grad_views", "grad_handles")
        }
        state["_plan"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        """After a deep copy or unpickling: the (copied) params become views of the
        (copied) buffers again, with their hooks."""
        self.__dict__.update(state)
        self.param_views, self.grad_views = [], []
        for i, p in enumerate(self.params):
            self.param_views.append(self._alias(self.param, i))
            self.grad_views.append(self._alias(self.grad, i) if p.requires_grad else None)
            if self.storage.owns_storage:
                p.data = self.param_views[i]
        self._wrap_grads()
        self._ptrs = [p.data_ptr() for p in self.params] if self.storage.owns_storage else []
        self._versions = [p._version for p in self.params]
        self._attach()
