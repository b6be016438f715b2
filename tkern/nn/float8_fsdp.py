"""fp8 all-gather of :class:`tkern.nn.Float8Linear` weights under FSDP2 (``fully_shard``).

With ``Float8Recipe(enable_fsdp_float8_all_gather=True)`` (tensorwise scaling only, as
torchao's ``Float8LinearConfig.enable_fsdp_float8_all_gather``) a layer's weight is a
:class:`Float8AllGatherWeight`: a ``torch.Tensor`` wrapper over the high-precision
weight (bf16/fp16/fp32), which ``fully_shard`` shards like any tensor (each rank's
local shard is a wrapper over its rows). It implements FSDP2's all-gather extension:

* ``fsdp_pre_all_gather`` casts this rank's shard to e4m3 with the scale of the
  **whole** weight (its amax is the max over the shards' amaxes) and hands FSDP2 the
  fp8 bytes (as ``uint8``: gloo all-gathers no float8 dtype), and the scale as metadata;
* ``fsdp_post_all_gather`` wraps the gathered bytes and the scale in a
  :class:`Float8GatheredWeight` (the unsharded param during forward and backward), whose
  fp8 data and scale :func:`tkern.ops.float8.float8_linear` takes as its ``weight_fp8``:
  nothing is cast again.

So the all-gather moves 1 byte per weight element instead of 2 (bf16), and the forward
and backward are bit-identical to a bf16 all-gather followed by the tensorwise cast
of the gathered weight (:func:`tkern.to_float8`): the scale is the same fp32 number
(the max is exact), and each element is cast alone.

The scale: by default each all-gather finds it itself (one all-reduce of one scalar
over the shard's mesh per weight; FSDP2's backward re-gather, under
``reshard_after_forward=True``, finds it again, the same). Calling
:func:`precompute_float8_dynamic_scale_for_fsdp` after each optimizer step (torchao's
name) finds every weight's scale once for the step, in ONE all-reduce for all of them;
the all-gathers then cast with it and reduce nothing. A precomputed scale that no
longer belongs to the weight (the weight was written since: a step, a load, without
a new precompute) is refused with a ``RuntimeError``, never used.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from tkern.kernels.float8 import E4M3_DTYPES, native_e4m3, to_float8_with_amax

__all__ = [
    "Float8AllGatherWeight",
    "Float8GatheredWeight",
    "precompute_float8_dynamic_scale_for_fsdp",
]

_HIGH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _wrapper(cls, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.Tensor._make_wrapper_subclass(
        cls,
        tensor.size(),
        strides=tensor.stride(),
        storage_offset=tensor.storage_offset(),
        dtype=dtype or tensor.dtype,
        layout=tensor.layout,
        device=tensor.device,
        requires_grad=False,
    )


class _ScaleState:
    """A weight's precomputed amax, shared by every wrapper FSDP2 makes of its shard
    (padding, views), with the stamp of the param it was computed from."""

    def __init__(self) -> None:
        self.amax: torch.Tensor | None = None  # (1,) fp32: the whole weight's amax
        self.param: weakref.ref | None = None  # the DTensor param
        self.stamp: tuple[int, ...] | None = None


#: FSDP2 pads and views the local shard with these ops: their results stay wrappers
#: (torchao's list for WeightWithDynamicFloat8CastTensor); every other op sees the
#: high-precision tensor and returns plain tensors.
_PRESERVE = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (or FSDP2's shard of it) that FSDP2 all-gathers in fp8.

    A wrapper subclass over ``tensor`` (bf16, fp16 or fp32): it has the tensor's shape
    and dtype, and every op but the few FSDP2 pads and views the shard with sees the
    tensor itself (an optimizer reads and writes the high-precision values; its results
    are plain tensors). Made by :class:`tkern.nn.Float8Linear` when its recipe has
    ``enable_fsdp_float8_all_gather=True``; see the module docstring for the all-gather.
    """

    _tensor: torch.Tensor
    _state: _ScaleState

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, state: _ScaleState | None = None):
        return _wrapper(cls, tensor)

    def __init__(self, tensor: torch.Tensor, state: _ScaleState | None = None) -> None:
        if type(tensor) is not torch.Tensor or tensor.dtype not in _HIGH_DTYPES:
            raise TypeError(
                f"Float8AllGatherWeight wraps a plain bf16, fp16 or fp32 tensor, got {type(tensor).__name__} "
                f"of dtype {tensor.dtype}"
            )
        self._tensor = tensor
        self._state = state if state is not None else _ScaleState()

    def __repr__(self) -> str:  # noqa: D105
        return f"Float8AllGatherWeight({self._tensor!r})"

    @property
    def data(self) -> torch.Tensor:
        """As ``Tensor.data``: this weight detached (a wrapper over the same tensor)."""
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # ``p.data = t`` (a fused optimizer binding the weight to its flat buffer, a cast by
        # convert_network) moves the wrapper's storage and must move what every op reads too
        torch.Tensor.data.__set__(self, value)
        self._tensor = value._tensor if isinstance(value, Float8AllGatherWeight) else value

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        def unwrap(t):
            return t._tensor

        written = _written(func, args, cls)
        first = args[0] if args else None
        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        for t in written:  # torch's foreach writes (an optimizer's copy) do not count them
            if not t.is_inference():
                torch.autograd.graph.increment_version(t)
        if not isinstance(first, cls) or not (func is torch.ops.aten.detach.default or func in _PRESERVE):
            return out  # (a plain tensor copied from a wrapper stays plain)
        if func is torch.ops.aten.copy_.default:
            return first
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, first._state), out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"])

    def high_precision(self) -> torch.Tensor:
        """The wrapped tensor, differentiably (its gradient flows to this wrapper)."""
        return _HighPrecision.apply(self)

    # ---------------------------------------------------------------- FSDP2's extension

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """This rank's rows cast to e4m3 with the whole weight's scale, padded to FSDP2's
        padded shard size, as uint8; the (0-dim fp32) scale and the e4m3 format (the device's
        native one) as metadata."""
        shard = self._tensor.detach()
        amax = self._state.amax
        if amax is not None:
            param = self._state.param()
            if param is None or self._state.stamp != _stamp(param):
                raise RuntimeError(
                    "the precomputed fp8 scale of a Float8Linear weight is stale: the weight was written "
                    "since precompute_float8_dynamic_scale_for_fsdp; call it after every optimizer step "
                    "(and after loading weights), or never"
                )
        else:
            amax = _local_amax(shard).reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        data, scale = to_float8_with_amax(shard, amax, native_e4m3(shard.device))
        rows = -(-orig_size[0] // mesh.size()) if len(orig_size) else 0
        if data.dim() and data.shape[0] != rows:  # an uneven shard: FSDP2 gathers padded shards
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.shape[0]].copy_(data)
            data = padded
        return (data.view(torch.uint8),), (scale, data.dtype)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        """The gathered e4m3 bytes and the scale as a :class:`Float8GatheredWeight`
        (with ``out``, FSDP2's unsharded param of an earlier gather, refilled in place:
        only its scale is new)."""
        (data,) = all_gather_outputs
        scale, e4m3 = metadata
        if out is not None:
            if not isinstance(out, Float8GatheredWeight):
                raise RuntimeError(
                    f"FSDP2's unsharded param is a {type(out).__name__}, not a Float8GatheredWeight"
                )
            out._scale = scale
            return None
        data = data.view(e4m3)
        return Float8GatheredWeight(data, scale, param_dtype), (data,)


def _written(func, args: tuple, cls: type) -> list[torch.Tensor]:
    """The wrappers among ``args`` that ``func`` writes in place (its schema says)."""
    if not func._schema.is_mutable:
        return []
    out = []
    for spec, arg in zip(func._schema.arguments, args, strict=False):
        if spec.alias_info is not None and spec.alias_info.is_write:
            out += [t for t in pytree.tree_leaves(arg) if isinstance(t, cls)]
    return out


class _HighPrecision(torch.autograd.Function):
    """A Float8AllGatherWeight's wrapped tensor; the gradient passes to the wrapper."""

    @staticmethod
    def forward(ctx, w):
        return w._tensor.view_as(w._tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _stamp(param: torch.Tensor) -> tuple[int, ...]:
    """What changes when a DTensor param's shard is written: through the DTensor
    (``load_state_dict``: its version counter), through its local wrapper (an
    optimizer's copy: the wrapper's, shared with FSDP2's padded views of it), or
    replaced (the storage)."""
    local = _local(param)
    return param._version, local._version, local._tensor.untyped_storage().data_ptr()


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (outside grad mode: no autograd node; for a Parameter a
    view of it, which shares its version counter and, being a wrapper, its scale state)."""
    with torch.no_grad():
        return param.to_local()


def _local_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| in fp32 (exact: a max), 0 for an empty shard."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.abs().amax().float()


class Float8GatheredWeight(torch.Tensor):
    """FSDP2's unsharded Float8Linear weight under fp8 all-gather: e4m3 ``data`` and
    its 0-dim fp32 ``scale`` (``weight ≈ data * scale``), shown as a tensor of the
    layer's dtype and shape.

    Only :class:`tkern.nn.Float8Linear` (and ``Float8Conv1D``) read it, through
    :meth:`fp8` (their forward casts nothing); the views FSDP2 and those layers take
    (``as_strided``, ``view``, ``t``, ``detach``) stay fp8, ``new_empty`` makes a plain
    tensor, and any other op raises ``TypeError`` (there is no high-precision weight to
    compute with).
    """

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        if data.dtype not in E4M3_DTYPES or scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(
                f"Float8GatheredWeight holds e4m3 data and a one-element fp32 scale, got {data.dtype} and "
                f"{scale.dtype} of shape {tuple(scale.shape)}"
            )
        self._data, self._scale = data, scale

    def __repr__(self) -> str:  # noqa: D105
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale!r})"

    _VIEWS = {
        torch.ops.aten.detach.default,
        torch.ops.aten.alias.default,
        torch.ops.aten.view.default,
        torch.ops.aten.as_strided.default,
        torch.ops.aten.t.default,
        torch.ops.aten.transpose.int,
    }

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in cls._VIEWS and isinstance(args[0], cls):
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w.dtype)
        if func is torch.ops.aten.new_empty.default:  # a new tensor on its device: reads nothing
            kwargs = {"dtype": args[0].dtype, "device": args[0].device, **kwargs}
            return torch.empty(args[1], **kwargs)
        raise TypeError(
            f"{func} on a Float8GatheredWeight (FSDP2's fp8-gathered Float8Linear weight, "
            "enable_fsdp_float8_all_gather=True): only tkern's fp8 layers read it"
        )

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return Float8GatheredWeight(inner_tensors["_data"], inner_tensors["_scale"], dtype)

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)``: float8_linear's ``weight_fp8`` for this weight."""
        return self._data, self._scale.reshape(())


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(module: torch.nn.Module) -> int:
    """Find the fp8 scale of every fp8-all-gathered weight of ``module`` for this step:
    each shard's amax, then ONE all-reduce (max) per device mesh for all of them.

    Call it on every rank after each optimizer step (torchao's function of this name,
    same place); the step's all-gathers, forward and backward, then cast with these
    scales and reduce nothing. Until it is first called the all-gathers find the
    scale themselves (one all-reduce per weight and gather); once called, a weight
    written since (the next step, a load) without calling it again makes the next
    all-gather raise ``RuntimeError`` rather than cast with a stale scale.

    Returns:
        How many weights got a scale (0: none are fp8-all-gathered DTensors).
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[Float8AllGatherWeight]] = {}
    params: dict[Any, list[torch.Tensor]] = {}
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, DTensor) and isinstance(_local(w), Float8AllGatherWeight):
            by_mesh.setdefault(w.device_mesh, []).append(_local(w))
            params.setdefault(w.device_mesh, []).append(w)
    count = 0
    for mesh, shards in by_mesh.items():
        tensors = [s._tensor.detach() for s in shards]
        amax = torch.stack([_local_amax(t) for t in tensors])
        # the shard dim's group (HSDP's 2-D mesh: the last dim; its replicas hold the same rows)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(mesh.ndim - 1))
        for p, s, a in zip(params[mesh], shards, amax.split(1), strict=True):
            s._state.amax, s._state.param, s._state.stamp = a, weakref.ref(p), _stamp(p)
        count += len(shards)
    return count


def is_fp8_all_gather_weight(t: torch.Tensor) -> bool:
    """Whether ``t`` is a :class:`Float8AllGatherWeight` or FSDP2's DTensor over one."""
    if isinstance(t, Float8AllGatherWeight):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed: no DTensor
        return False
    return isinstance(t, DTensor) and isinstance(_local(t), Float8AllGatherWeight)


def wrap_weight(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """``param`` as a Parameter over a :class:`Float8AllGatherWeight` (itself if it is one)."""
    if isinstance(param, Float8AllGatherWeight):
        return param
    return torch.nn.Parameter(Float8AllGatherWeight(param.detach()), requires_grad=param.requires_grad)


def unwrap_weight(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """The plain Parameter of a :class:`Float8AllGatherWeight` one (``param`` otherwise)."""
    if not isinstance(param, Float8AllGatherWeight):
        return param
    return torch.nn.Parameter(param._tensor.detach(), requires_grad=param.requires_grad)
