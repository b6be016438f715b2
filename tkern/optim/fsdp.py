"""tkern's fused optimizers and loss scalers on FSDP2 (``torch.distributed.fsdp.fully_shard``).

``fully_shard`` turns each param into a DTensor sharded on dim 0 over a 1-D
device mesh: ``p.to_local()`` is this rank's rows (uneven shards are allowed;
a rank's shard may be empty), and after backward ``p.grad`` is a DTensor of the
same layout holding this rank's rows of the averaged gradient. What that
changes for a fused optimizer (see :mod:`tkern.flat` for the buffers):

Where the buffers' memory comes from
    The flat buffers are built over the local shards, and then become FSDP2's
    storage of them: FSDP2 all-gathers from a padded shard of its own (the local
    tensor is a view of its start), and :func:`fsdp_shard_storage` (the one seam
    that touches FSDP2's private names) points both into the flat buffer, whose
    slot keeps FSDP2's padding (zeros). A step then copies nothing in or out.
    Where FSDP2 is in a mode that forbids that (CPU offload, a tensor subclass
    with its own all-gather, ``reshard_after_forward`` as an int, a torch whose
    internals differ), the buffer holds a copy, each step copies its updated
    params into FSDP2's shards, and ``memory_report()["alias_fallback"]`` says
    why. Writes to the params from outside (``set_model_state_dict``,
    ``model.load_state_dict``) move the DTensor's version counter, writes through
    ``p.to_local()`` its local tensor's, and the master takes them before the
    next step (copied in first on the copy path), as for plain params. ``.grad``
    stays a DTensor over the flat gradient view: FSDP2 accumulates its
    reduce-scattered gradient into it in place.

Who reduces the statistics
    Each rank reads only its shard's gradients, so the step's statistics of the
    DTensor params are combined over the params' mesh (found_inf and max |g| by
    max, the sum of squares summed: :func:`tkern.kernels.overflow.combine_stats`
    with ``sharded=True``), on the device, with no host sync. ``max_grad_norm``
    then clips by the norm of the whole gradient (what ``clip_grad_norm_`` over
    the DTensor grads gives) and every rank skips the same steps. A plain param
    group beside them (params FSDP2 left whole, their gradients each rank's own)
    has its statistics agreed on over the mesh first (the ranks' max, as for
    replicas: one more all-reduce per step, only then), so its gradients cannot
    make ranks clip by different norms or one rank skip alone.

HSDP (``fully_shard`` on a 2-D mesh, dims (replicate, shard))
    The params are DTensors with placements ``(Replicate(), Shard(0))``: the local
    tensor is the rows the shard dim's coordinate gives, and every rank of a
    replicate group holds the same rows (after backward, FSDP2 reduce-scatters the
    gradients over the shard dim and all-reduces them over the replicate dim). The
    rule for the statistics (:class:`MeshGroups`): the sum of squares is summed
    over the shard dim's group only (the ranks of one replica hold the whole
    gradient between them; summing over the replicas too would count it twice),
    and then the ranks of the replicate dim agree on the elementwise max of the
    result (found_inf, max |g| and the sum of squares: equal replicas give back
    the same values), so all ranks of the mesh clip by one norm and skip the same
    steps even when one rank's gradients differ from its replicas' (an inf only
    there). A plain param group beside them is agreed on (max) over both dims.
    That is one more tiny collective per step than on a 1-D mesh. The seed of
    stochastic rounding is rank (0, 0)'s on every rank. ``memory_report``'s
    ``world_size`` is the shard dim's size (what the shards divide the bytes by).

Limits (a ``ValueError`` before anything changes): a param group holds DTensor
params or plain ones, not both; DTensor params are ``Shard(0)`` on a 1-D mesh or
``(Replicate(), Shard(0))`` on a 2-D one (HSDP; no tensor parallelism, no
other placements, no mesh of more dims), all on one mesh; tkern's ZeRO-2
optimizers take plain params only.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tkern.flat import OWNED, ParamStorage, describe_param
from tkern.flat.storage import SharedSlots
from tkern.kernels.overflow import combine_stats

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "DTensorShards",
    "MeshGroups",
    "fsdp_shard_storage",
    "fsdp_storage_bytes",
    "is_dtensor",
    "mesh_groups",
    "param_storage",
    "split_by_mesh",
]

#: torch.distributed.tensor, imported where a DTensor is met (a third of ``import tkern``'s
#: time on a CPU): while no module has imported it, no tensor can be a DTensor.
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor when nothing has."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(t, module.DTensor)


def _layouts() -> dict[int, tuple]:
    """The layouts tkern steps: FSDP2's on a 1-D mesh, HSDP's on a 2-D (replicate, shard) mesh."""
    from torch.distributed.tensor import Replicate, Shard

    return {1: (Shard(0),), 2: (Replicate(), Shard(0))}


class MeshGroups(NamedTuple):
    """The process groups the statistics of sharded DTensor gradients are combined over.

    ``shard``: the group of the mesh dim the params are sharded over (its ranks hold
    disjoint rows: the sum of squares is summed). ``replicate``: HSDP's replicate dim
    (its ranks hold replicas of the same rows: they agree on the max), None on a 1-D mesh.
    Hashable: :func:`split_by_mesh` keys gradients by it."""

    shard: Any
    replicate: Any = None

    def combine(self, stats: torch.Tensor, *, sharded: bool = True) -> torch.Tensor:
        """The (N_STATS,) statistics every rank of the mesh steps with, from this rank's:
        ``sharded`` (this rank's shards' statistics): summed over ``shard`` in rank order
        (:func:`tkern.kernels.overflow.combine_stats`), then the max over ``replicate``;
        not ``sharded`` (whole gradients, each rank's own): the max over both."""
        stats = combine_stats(stats, self.shard, sharded=sharded)
        if self.replicate is not None:
            stats = combine_stats(stats, self.replicate)
        return stats

    @property
    def groups(self) -> tuple:
        """The groups that are set, ``shard`` first."""
        return (self.shard,) if self.replicate is None else (self.shard, self.replicate)


def mesh_groups(mesh: Any) -> MeshGroups:
    """The :class:`MeshGroups` of FSDP2's ``mesh`` (1-D, or HSDP's 2-D (replicate, shard))."""
    if mesh.ndim == 1:
        return MeshGroups(mesh.get_group(0))
    return MeshGroups(mesh.get_group(1), mesh.get_group(0))


class DTensorShards(ParamStorage):
    """FSDP2's DTensor params, ``Shard(0)`` on the 1-D ``mesh`` or ``(Replicate(), Shard(0))``
    on HSDP's 2-D one: the flat buffer is FSDP2's shard storage or holds a copy of each
    local shard (see the module docstring), ``.grad`` is a DTensor over the gradient view,
    and the statistics are combined by ``groups`` (:class:`MeshGroups`): summed over the
    shard dim's group (``stats_group``), agreed on over the replicate dim's."""

    owns_storage = False

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        #: The mesh dim the params are sharded over (the last: HSDP's mesh is (replicate, shard)).
        self.shard_dim = mesh.ndim - 1
        self.groups = mesh_groups(mesh)
        self.stats_group = self.groups.shard

    def local(self, param: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return param.to_local()

    def wrap(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        # as torchao's low-bit optimizers wrap their state: what torch.distributed.checkpoint
        # (get_optimizer_state_dict, dcp.save) needs to place each shard in the whole
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def unwrap(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``value``: a DTensor's local tensor (redistributed to the
        param's layout first if it has another: a collective), or the rows of a whole
        tensor (one process's state, a torch optimizer's) that ``Shard(0)`` gives this rank
        (by its coordinate on the shard dim: HSDP's replicas take the same rows)."""
        with torch.no_grad():
            if is_dtensor(value):
                if value.device_mesh != param.device_mesh or value.placements != param.placements:
                    value = value.redistribute(param.device_mesh, param.placements)
                return value.to_local()
            rows = self.local(param).shape[0] if param.dim() else 0
            if param.dim() == 0 or rows == param.shape[0]:
                return value.reshape(param.shape)
            # torch.chunk's split, as FSDP2's: ceil(n / W) rows per rank, the last ones short or empty
            chunk = -(-param.shape[0] // self.mesh.size(self.shard_dim))
            start = min(self.mesh.get_local_rank(self.shard_dim) * chunk, param.shape[0])
            return value.reshape(param.shape)[start : start + rows]

    def shared_slots(self, params: list[torch.Tensor]) -> SharedSlots | str:
        """FSDP2's padded shard storage of ``params`` as slots of the flat buffer, or why
        not (see :func:`fsdp_shard_storage`)."""
        return fsdp_shard_storage(params)

    def held_bytes(self, params: list[torch.Tensor], buffer: torch.Tensor) -> dict[int, int]:
        """FSDP2's storages of ``params`` outside the flat buffer (:func:`fsdp_storage_bytes`)."""
        return fsdp_storage_bytes(params, buffer)

    def versions(self, params: list[torch.Tensor]) -> list:
        """Each DTensor's version counter and its local tensor's: writes through the
        DTensor (``load_state_dict``) move the first, writes through ``p.to_local()``
        only the second, and either is copied in by the next step, never overwritten."""
        with torch.no_grad():  # to_local() is then the local tensor itself, no autograd node
            return [(p._version, p.to_local()._version) for p in params]

    def __reduce__(self) -> tuple:
        # device meshes and process groups do not travel: a copy of an optimizer over
        # DTensor params (deepcopy, pickle) is refused, as for the ZeRO-2 optimizers' groups
        raise TypeError("an optimizer over FSDP2's DTensor params cannot be copied or pickled")


def _fsdp_params() -> dict[int, Any]:
    """FSDP2's ``FSDPParam`` of every sharded param of the process, by the param's id (part of
    the seam: FSDP2's private module state; ``ImportError`` on a torch without it)."""
    from torch.distributed._composable_state import _module_state_mapping

    owners = {}
    for ref in list(_module_state_mapping.values()):
        for fp in getattr(getattr(ref(), "_fsdp_param_group", None), "fsdp_params", ()):
            owners[id(fp.sharded_param)] = fp
    return owners


def fsdp_shard_storage(params: list[torch.Tensor]) -> SharedSlots | str:
    """THE SEAM: the one place tkern reads or writes FSDP2's private names.

    FSDP2 (``torch.distributed.fsdp._fully_shard``) keeps each param's shard in
    ``FSDPParam._sharded_param_data`` (1-D, padded to the first rank's row count; its
    all-gather reads it) and the DTensor's ``_local_tensor`` is a view of its start.
    FSDP2 re-points both itself (``FSDPParam.reset_sharded_param``) and leaves them alone
    when they share one storage. This returns each param's padded size and a function
    that points both at a slot of the flat buffer (fresh views assigned in their place, so
    FSDP2's own shard is freed; the values are already there, the padding is zeros), so the
    buffer is FSDP2's storage and a step copies nothing; or, when that is not safe, why
    (the buffer then keeps a copy): the FSDPParam is not found (a torch without these
    names), its shard is offloaded to the CPU, a tensor subclass all-gathers itself,
    ``reshard_after_forward`` is an int (a second sharded copy after forward), or the
    layout is not the one described.
    Under HSDP (an ``HSDPMeshInfo``) the layout is the same, padded to the shard dim's
    first rank's rows, and is aliased alike. ``tests/test_fsdp_alias.py`` and
    ``tests/test_fsdp_hsdp.py`` fail if a torch upgrade breaks this.
    """
    try:
        owners = _fsdp_params()
        found = [owners.get(id(p)) for p in params]
        if None in found:
            return "FSDP2's FSDPParam of a param was not found (not fully_shard's, or another torch)"
        slots, datas, locals_ = [], [], []
        for p, fp in zip(params, found, strict=True):
            data, local = fp._sharded_param_data, p._local_tensor
            if fp.offload_to_cpu:
                return "FSDP2 offloads the shards to the CPU (CPUOffloadPolicy)"
            if type(data) is not torch.Tensor or type(local) is not torch.Tensor:
                return f"a shard is a tensor subclass ({type(local).__name__}) with its own all-gather"
            if fp.post_forward_mesh_info not in (None, fp.mesh_info):
                return "reshard_after_forward is an int: FSDP2 keeps a second sharded copy after forward"
            if fp.sharded_state.name != "SHARDED" or data.dim() != 1 or not local.is_contiguous():
                return (
                    "FSDP2's shard storage is not in the layout tkern aliases (unsharded, or another torch)"
                )
            if local.numel() and (local.data_ptr() != data.data_ptr() or data.numel() < local.numel()):
                return "the DTensor's local tensor is not the start of FSDP2's padded shard (another torch)"
            slots.append(data.numel())
            datas.append(fp)
            locals_.append(local)
    except (AttributeError, ImportError, TypeError) as e:
        return f"FSDP2's private storage is not as this tkern expects ({type(e).__name__}: {e})"

    def point(flat_slots: list[torch.Tensor]) -> None:
        # fresh views of the flat buffer, assigned: ``Tensor.set_`` on FSDP2's tensors (views of
        # its padded shard) would keep that shard alive as their ``._base``, unread, for the life
        # of the model; replaced, it is freed. One storage for both: FSDP2 leaves them as they are.
        with torch.no_grad():
            for p, fp, local, slot in zip(params, datas, locals_, flat_slots, strict=True):
                fp._sharded_param_data = slot
                p._local_tensor = slot.narrow(0, 0, local.numel()).view(local.shape)

    return slots, point


def fsdp_storage_bytes(params: list[torch.Tensor], buffer: torch.Tensor) -> dict[int, int]:
    """The storages FSDP2 holds for ``params`` besides ``buffer``'s (the flat buffer), by
    address -> bytes: its padded shards (``_sharded_param_data``) and the DTensors' local
    tensors, with the tensors they are views of (a view keeps its base's storage alive).
    Empty where the flat buffer is FSDP2's storage; on the copy path, FSDP2's shards. Part of
    the seam (:func:`fsdp_shard_storage`): it reads the same private names; a param whose
    FSDPParam is not found counts its local tensor only."""
    try:
        owners = _fsdp_params()
    except ImportError:
        owners = {}
    held: dict[int, int] = {}
    for p in params:
        fp = owners.get(id(p))
        for t in (p._local_tensor, getattr(fp, "_sharded_param_data", None)):
            if t is not None:
                _add_storages(t, held)
    lo = buffer.data_ptr()
    hi = lo + buffer.numel() * buffer.element_size()
    # the flat buffer's slots (storages of their own over its memory) and empty tensors are not FSDP2's
    return {at: n for at, n in held.items() if at and not lo <= at < hi}


def _add_storages(t: torch.Tensor, into: dict[int, int]) -> None:
    """Add the storages ``t`` keeps alive to ``into`` (address -> bytes): its own and its
    base's (a view's), or those of the inner tensors of a wrapper subclass."""
    if type(t) is not torch.Tensor:
        names = t.__tensor_flatten__()[0] if hasattr(t, "__tensor_flatten__") else ()
        for name in names:
            _add_storages(getattr(t, name), into)
        return
    for each in (t, t._base):
        if each is not None:
            storage = each.untyped_storage()
            into[storage.data_ptr()] = storage.nbytes()


def _check_dtensor(p: DTensor, name: str) -> None:
    mesh, placements, layouts = p.device_mesh, tuple(p.placements), _layouts()
    if mesh.ndim not in layouts:
        raise ValueError(
            f"{name} is a DTensor on a {mesh.ndim}-D device mesh: tkern's fused optimizers take FSDP2 "
            "params sharded on a 1-D mesh or HSDP's 2-D (replicate, shard) mesh"
        )
    if placements != layouts[mesh.ndim]:
        if mesh.ndim == 2:
            raise ValueError(
                f"{name} is a DTensor on a 2-D device mesh with placements {placements} (tensor "
                f"parallelism or another layout): on a 2-D mesh tkern's fused optimizers take HSDP's "
                f"params, placements {layouts[2]} (fully_shard on a (replicate, shard) mesh)"
            )
        raise ValueError(
            f"{name} is a DTensor with placements {placements}: tkern's fused optimizers take "
            "FSDP2 params sharded on dim 0, placements (Shard(dim=0),) (fully_shard's default)"
        )


def param_storage(
    params: list[torch.Tensor], group: int, current: DTensorShards | None, *, zero: bool = False
) -> ParamStorage:
    """How a fused optimizer holds param group ``group``'s ``params``: :data:`tkern.flat.OWNED`
    for plain tensors, a :class:`DTensorShards` for FSDP2's DTensor params (``current``, the
    optimizer's existing one, if it has one). Raises ``ValueError`` for a group that mixes
    the two, a DTensor in neither FSDP2's layout (``Shard(0)`` on a 1-D mesh) nor HSDP's
    (``(Replicate(), Shard(0))`` on a 2-D mesh), a second mesh, or DTensor
    params given to a ZeRO-2 optimizer (``zero``); nothing is changed."""
    kinds = [is_dtensor(p) for p in params]
    if not any(kinds):
        return OWNED
    if not all(kinds):
        d, t = kinds.index(True), kinds.index(False)
        raise ValueError(
            f"param group {group} mixes DTensor params ({describe_param(group, d, params[d])}) with plain "
            f"tensors ({describe_param(group, t, params[t])}): put FSDP2's sharded params and plain params "
            "in separate param groups"
        )
    if zero:
        raise ValueError(
            f"param group {group} holds DTensor params: tkern's ZeRO-2 optimizers shard plain params "
            "themselves; under fully_shard use FusedSGD, FusedAdam or FusedAdamW"
        )
    mesh = current.mesh if current is not None else params[0].device_mesh
    for i, p in enumerate(params):
        name = describe_param(group, i, p)
        _check_dtensor(p, name)
        if p.device_mesh != mesh:
            raise ValueError(
                f"{name} is on device mesh {p.device_mesh}, but earlier params are on {mesh}: "
                "a tkern optimizer takes DTensor params of one mesh"
            )
    return current if current is not None else DTensorShards(mesh)


def split_by_mesh(tensors: list[torch.Tensor]) -> dict[MeshGroups | None, list[torch.Tensor]]:
    """Gradients by the process groups their statistics are combined over: the local
    shards of FSDP2's DTensors (``Shard(0)`` on a 1-D mesh, HSDP's ``(Replicate(), Shard(0))``
    on a 2-D one) under their mesh's :class:`MeshGroups` (``key.combine(stats)``), every
    other tensor (a plain one, or a replicated DTensor's local copy) under None.
    Raises ``ValueError`` for other DTensor layouts (a loss scaler cannot tell how
    to combine their statistics)."""
    out: dict[Any, list[torch.Tensor]] = {}
    for i, t in enumerate(tensors):
        key = None
        if is_dtensor(t):
            if all(p.is_replicate() for p in t.placements):
                pass
            else:
                _check_dtensor(t, f"gradient {i} (shape {tuple(t.shape)}, dtype {t.dtype})")
                key = mesh_groups(t.device_mesh)
            with torch.no_grad():
                t = t.to_local()
        out.setdefault(key, []).append(t)
    return out
