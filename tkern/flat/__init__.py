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
    scans per step (the params' addresses, their version counters, their
    ``.grad``) and returns a cached plan; the gradient views' counters are
    scanned once more only until every view has been written since the last
    ``zero_grad`` (a counter never goes back, so that holds until the next one).

Storage the buffer does not own
    A param whose memory belongs to someone else (FSDP2's local shard of a
    DTensor param, which FSDP2 all-gathers from its own padded buffer) is
    described by a :class:`ParamStorage` with ``owns_storage = False``. If its
    :meth:`ParamStorage.shared_slots` offers them, the owner's storage is pointed
    into the buffer (slots as large as the owner asks, the rest zeros) and
    nothing is copied (:attr:`FlatParams.aliased`). Otherwise the buffer holds
    a copy of the param's local tensor, :meth:`FlatParams.plan` copies it in
    again whenever the param's version counter moved, and
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

from tkern.flat.fp32 import Fp32Views
from tkern.flat.layout import (
    ALIGN,
    FlatLayout,
    alias,
    check_modes,
    describe_param,
    join_master,
    round_up,
    split_master,
)
from tkern.flat.params import FlatParams
from tkern.flat.storage import OWNED, ParamStorage
from tkern.flat.views import GradViews, grad_is_flat_view, has_grad_view, take_grad_view

__all__ = [
    "ALIGN",
    "OWNED",
    "FlatLayout",
    "FlatParams",
    "Fp32Views",
    "GradViews",
    "ParamStorage",
    "alias",
    "check_modes",
    "describe_param",
    "grad_is_flat_view",
    "has_grad_view",
    "join_master",
    "round_up",
    "split_master",
    "take_grad_view",
]
