"""What a process holds in tensors, measured from the outside: the union of the address
ranges of the storages of every live tensor (found by walking the garbage collector's
objects, with the tensors they keep alive: a view's base, a DTensor's local tensor, a
``.grad``). Independent of what tkern's own ``memory_report()`` believes."""

from __future__ import annotations

import gc

import torch


def _held(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``t`` keeps alive besides its own storage."""
    out = [t.grad] if t.grad is not None else []
    if type(t) is torch.Tensor:
        return [*out, *([t._base] if t._base is not None else [])]
    if hasattr(t, "__tensor_flatten__"):  # DTensor's local tensor, other wrapper subclasses
        out += [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [h for h in out if isinstance(h, torch.Tensor)]


def live_tensor_bytes() -> int:
    """Bytes of the union of ``[data_ptr, data_ptr + nbytes)`` over the storages of every
    live tensor of this process (storages that overlap, views and slots of one buffer,
    count once; empty and meta storages not at all)."""
    gc.collect()
    # type(), not isinstance(): some module proxies warn when asked for their __class__
    stack = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    seen: set[int] = set()
    ranges: dict[int, int] = {}
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack += _held(t)
        if type(t) is not torch.Tensor or t.is_meta:
            continue  # a wrapper subclass has no storage of its own
        storage = t.untyped_storage()
        if storage.data_ptr():
            ranges[storage.data_ptr()] = max(ranges.get(storage.data_ptr(), 0), storage.nbytes())
    total, end = 0, 0
    for start, n in sorted(ranges.items()):
        total += max(start + n, end) - max(start, end)
        end = max(end, start + n)
    return total
