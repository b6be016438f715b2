"""What tkern's linear-like ops share: shapes, and the seam that puts a weight's
gradient straight into a fused optimizer's flat gradient buffer.

:func:`flat_wgrad` and :func:`hand_over` are the one place that decides whether
a backward may write dW into the weight's view in the flat buffer (the wgrad
GEMM's ``C +=``) and hands that memory to autograd's AccumulateGrad. Every op
with a weight GEMM (``linear``, ``float8_linear``, ``linear_cross_entropy``)
calls them through this module (``common.flat_wgrad``), so a test can switch the
path off in one place.
"""

from __future__ import annotations

import math

import torch

from tkern.flat import has_grad_view, take_grad_view

__all__ = [
    "as_2d",
    "check_in_features",
    "flat_grads",
    "flat_targets",
    "flat_wgrad",
    "hand_over",
    "is_compiling",
    "launches_directly",
    "sums_into",
]

is_compiling = torch.compiler.is_compiling  # bound once: the fast checks run on every call
# Whether the running backward will execute an autograd node; raises for a leaf's
# AccumulateGrad under autograd.grad(), which captures that gradient instead.
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)
_increment_version = torch.autograd.graph.increment_version
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def launches_directly(t: torch.Tensor) -> bool:
    """Whether a pass over ``t`` may call tkern's launchers themselves: a plain tensor or
    Parameter (not meta, not a subclass such as a FakeTensor or a DTensor) outside
    torch.compile's tracing. Elsewhere the custom ops run (opaque ops with known shapes);
    eagerly their Python dispatch costs tens of us of host time per call and hides the
    launches from a dispatch mode's view."""
    return type(t) in _PLAIN and not t.is_meta and not is_compiling()


def as_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (..., K) as (M, K); also for K == 0, where ``reshape(-1, 0)`` is ambiguous."""
    return x.reshape(-1, k) if k else x.reshape(math.prod(x.shape[:-1]), 0)


def check_in_features(x: torch.Tensor, weight: torch.Tensor) -> None:
    """x (..., K) against weight (N, K), as both linears take them."""
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must have shape (..., {weight.shape[1]}) to match weight of shape "
            f"{tuple(weight.shape)} (N, K), got shape {tuple(x.shape)}"
        )


def next_function_slots(*inputs) -> tuple[int | None, ...]:
    """For each of a Function's ``inputs``, its index in the node's ``next_functions``
    (autograd lists the tensor inputs only: a None bias before a weight moves the weight's
    index down), None for an input that is not a tensor: what :func:`flat_wgrad`'s
    ``index`` is for a Function whose inputs may be None."""
    slots, slot = [], 0
    for t in inputs:
        slots.append(slot if isinstance(t, torch.Tensor) else None)
        slot += isinstance(t, torch.Tensor)
    return tuple(slots)


def flat_wgrad(ctx, dtype: torch.dtype, weight: torch.Tensor | None = None, index: int = 1) -> tuple | None:
    """``(weight, view, accumulate)`` when this backward may put dW straight into
    the weight's gradient view in a fused optimizer's flat buffer (the wgrad
    GEMM adds into it, ``C +=``, when ``.grad`` is the view, or writes into it
    when ``.grad`` is None), else None. ``weight``: input ``index`` of the Function whose
    backward runs, if the caller has it (a cheap refusal first); ``index``: which input of
    ``next_functions`` entry the weight is (1; a Function over two layers has two, whose
    indexes :func:`next_function_slots` gives).

    The Function's input may also be the transpose of the leaf (``W.t()``: GPT-2's
    ``Conv1D`` stores its weight (in, out)): ``view`` is then the flat view transposed,
    the (N, K) strides the GEMM writes dW with, and the tensor :func:`hand_over` returns
    goes back through autograd's transpose as the leaf's own (K, N) memory.

    Autograd's AccumulateGrad adds whatever backward returns into ``.grad``: a
    fresh (N, K) dW costs that allocation and one more pass over the gradient.
    Instead the GEMM puts dW into the view and :func:`hand_over` gives autograd
    a tensor over the view's memory with ``.grad`` set to None: AccumulateGrad,
    finding no ``.grad``, adopts it as it is (no copy, no add: nothing else refers
    to it), its hooks (DDP's, ZeRO-2's, the flat buffer's, the user's
    post-accumulate ones) fire as before, and the flat buffer's hook puts the
    view back. A second use of the weight in the same graph (tied weights) finds
    the view taken (flat.take_grad_view) and returns its share as usual, which
    autograd sums with the first before accumulating. Only where that is exactly
    AccumulateGrad's result: a leaf weight of ``dtype`` with a flat view, no tensor
    hook that would rewrite the gradient before it is accumulated, and a backward
    that accumulates into ``.grad`` (not ``autograd.grad()``, which captures the
    gradient, nor one that does not reach this weight)."""
    if weight is not None and not _may_have_view(weight):
        return None  # the common refusal first, before any autograd lookup (host time)
    node = ctx.next_functions[index][0]
    transposed = node is not None and node.name() == _TRANSPOSE_NODE
    if transposed:  # W.t() of a leaf: its one input is the leaf's AccumulateGrad
        node = node.next_functions[0][0]
    weight = getattr(node, "variable", None)  # AccumulateGrad's leaf; None: not a leaf
    if weight is None or weight.dtype != dtype or weight._backward_hooks or _will_engine_execute_node is None:
        return None
    if is_compiling():
        return None
    try:
        if not _will_engine_execute_node(node):
            return None
    except RuntimeError:  # autograd.grad() captures the gradient: it must not land in .grad
        return None
    taken = take_grad_view(weight)
    if taken is None:
        return None
    view, accumulate = taken
    return weight, view.t() if transposed else view, accumulate


#: The autograd node of ``W.t()`` (a 2-D transpose), through which :func:`flat_wgrad`
#: finds a transposed leaf weight.
_TRANSPOSE_NODE = "TBackward0"


def _may_have_view(weight: torch.Tensor) -> bool:
    """Whether ``weight``, a leaf or a view of one (``W.t()``), may have a flat gradient view."""
    if weight.is_leaf:
        return has_grad_view(weight)
    base = weight._base
    return base is not None and base.is_leaf and has_grad_view(base)


def hand_over(target: tuple) -> torch.Tensor:
    """What backward returns for a weight whose dW the GEMM put into its flat
    view (:func:`flat_wgrad`'s ``target``): the view's memory, for AccumulateGrad to adopt."""
    weight, view, _ = target
    _increment_version(view)  # the kernel wrote it: "has a gradient" (flat.FlatParams)
    weight.grad = None
    return view.detach()


def sums_into(dw_target, db_target) -> tuple | None:
    """Where the wgrad GEMM's row sums (db) go: ``(view, add)`` into the bias's flat view
    beside dW into the weight's, where the launch allows (adding needs dW added too: the
    launch that adds is the one whose autotuner restores what it adds into), else None."""
    if dw_target is None or db_target is None or (db_target[2] and not dw_target[2]):
        return None
    return db_target[1], db_target[2]


def flat_targets(ctx, needs, weight, bias_dtype, w_index=1, b_index=2) -> tuple:
    """``(dw_target, db_target)`` (:func:`flat_wgrad`) of a layer whose ``weight`` (as the
    GEMMs read it: the leaf or ``W.t()``) is the Function's input ``w_index`` and bias
    ``b_index``: dW and db straight into a fused optimizer's flat gradient views where they
    may go (None each where not)."""
    dw_target = flat_wgrad(ctx, weight.dtype, weight, w_index) if needs[1] else None
    if dw_target is None or not needs[2] or bias_dtype is None or b_index is None:
        return dw_target, None
    return dw_target, flat_wgrad(ctx, bias_dtype, None, b_index)


def flat_grads(dw, db, dw_target, db_target) -> tuple:
    """``(dw, db)`` as backward returns them: each one written into its flat view
    (:func:`flat_targets`) handed over to autograd (:func:`hand_over`)."""
    if dw_target is not None:
        dw = hand_over(dw_target)
    if db_target is not None and db is db_target[1]:
        db = hand_over(db_target)
    return dw, db
