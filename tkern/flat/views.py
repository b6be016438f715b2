"""Gradient views: the registry that finds a param's gradient view into its flat
buffer (for a backward that writes its gradient there, :func:`take_grad_view`), and
the post-accumulate-grad hook that keeps each param's ``.grad`` that view (see
:mod:`tkern.flat`, "Per-param step counts")."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from tkern.flat.layout import describe_param
from tkern.flat.storage import ParamStorage

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


def register_view(param: torch.Tensor, view: torch.Tensor) -> None:
    """Record ``view`` as ``param``'s gradient view (weakly: the entry leaves with ``param``)."""
    key = id(param)
    _VIEW_OF[key] = (weakref.ref(param, _dropper(_VIEW_OF, key, 0)), weakref.ref(view))


def _view_of(param: torch.Tensor) -> torch.Tensor | None:
    entry = _VIEW_OF.get(id(param))
    return None if entry is None or entry[0]() is not param else entry[1]()


def _taken(view: torch.Tensor) -> bool:
    ref = _TAKEN.get(id(view))
    return ref is not None and ref() is view


def release_views(views: list[torch.Tensor | None]) -> None:
    """Count none of ``views`` as taken any more (a backward that failed before its hooks ran)."""
    if _TAKEN:  # (empty unless a backward is putting gradients into views)
        for view in views:
            _TAKEN.pop(id(view), None)


def grad_is_flat_view(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is its gradient view into a :class:`~tkern.flat.FlatParams`
    buffer (the ``.grad`` a fused optimizer keeps)."""
    g = param.grad
    return g is not None and g is _view_of(param)


def has_grad_view(param: torch.Tensor) -> bool:
    """Whether a :class:`~tkern.flat.FlatParams` keeps a gradient view for ``param`` (its
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


class _AdoptGrad:
    """Post-accumulate-grad hook: keeps param ``index``'s ``.grad`` the flat view
    (copying in a gradient autograd made as a new tensor). A module-level
    object holding a weak reference, so it never keeps an optimizer alive
    (hooks are neither pickled nor deep-copied by torch)."""

    __slots__ = ("flat", "index")

    def __init__(self, flat: GradViews, index: int) -> None:
        self.flat = weakref.ref(flat)
        self.index = index

    def __call__(self, p: torch.Tensor) -> None:
        flat = self.flat()
        if flat is not None:
            flat.adopt_grad(self.index, p)


class GradViews:
    """Mixin of :class:`~tkern.flat.FlatParams`: each param's ``.grad`` kept as its
    gradient view (or the storage's wrapper of it) by a post-accumulate-grad hook.
    It uses only the buffer's public attributes, declared here."""

    params: list[torch.Tensor]
    indices: list[int]
    group: int
    storage: ParamStorage
    grad_views: list[torch.Tensor | None]

    def wrap_grads(self) -> None:
        """Make :attr:`grad_handles` from the gradient views."""
        #: What each param's ``.grad`` is kept as: its gradient view, or the storage's wrapper of it.
        self.grad_handles = [
            None if v is None else self.storage.wrap(p, v)
            for p, v in zip(self.params, self.grad_views, strict=True)
        ]

    def attach_grads(self) -> None:
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
            raise TypeError(
                f"{describe_param(self.group, self.indices[i], p)}: sparse gradients are not supported "
                f"(layout {g.layout})"
            )
        if g.shape != p.shape:
            raise ValueError(
                f"{describe_param(self.group, self.indices[i], p)}: .grad has shape {tuple(g.shape)}, "
                f"expected {tuple(p.shape)}"
            )
        with torch.no_grad():
            self.grad_views[i].copy_(self.storage.unwrap(p, g))
        p.grad = self.grad_handles[i]
