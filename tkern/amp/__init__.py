"""Loss scalers whose state lives on the device.

Loss scaling multiplies the loss by S before backward so that small fp16
gradients do not flush to zero; the optimizer divides them by S in fp32.
Three ways to choose S, with one interface (``torch.amp.GradScaler``'s):

* :class:`StaticLossScaler` — a fixed S (fastai's default 512);
* :class:`DynamicLossScaler` — GradScaler's backoff/growth, plus DeepSpeed's
  hysteresis and apex's ceiling;
* :class:`LogNormalLossScaler` — OpenSeq2Seq's "LogMax": S from running
  statistics of log2(max |g|), keeping the chance of overflow near 0.001.

Usage, as with GradScaler::

    scaler = tkern.DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)     # a tkern fused optimizer: no host sync
    scaler.update()            # one tiny kernel: no host sync

With a tkern fused optimizer, ``step`` hands ``1/S`` to the optimizer as a
device tensor and receives its statistics (found_inf, sum of squares, max |g|)
as a device tensor; ``update`` is a single one-program kernel. The optimizer
unscales inside its update kernel and never writes the gradients: after
``scaler.step(fused_optimizer)`` the ``.grad`` tensors still hold the scaled
gradients (S times the true ones; torch's fused Adam writes them back
unscaled, tkern saves those 2 bytes per parameter). Call
``scaler.unscale_(optimizer)`` before ``step`` to get unscaled gradients.

With any other ``torch.optim.Optimizer``, ``step`` unscales the gradients in
place (sparse ones too), checks them, and calls ``optimizer.step()`` only when
they are finite; that decision waits for the device once per step (as
GradScaler does).

Distributed training: a scaler never communicates by default, so a rank-local
scaler cannot hang when ``torch.distributed`` is initialized (under DDP the
gradients, hence the decisions, are already identical on every rank). Pass
``process_group=`` to share the statistics (max over the group) when the
ranks' gradients differ: with a plain torch optimizer every rank then skips
the same steps, and with any optimizer every rank updates S from the same
statistics. A tkern fused optimizer decides the skip inside its own ``step``.
Gradients that are FSDP2 DTensors (``fully_shard``) are checked on their local
shards (empty ones included) and their statistics summed over their mesh by
every rank (found_inf and max |g| by max, as GradScaler reduces found_inf for
DTensors), whatever ``process_group`` says; under HSDP summed over the shard dim
and agreed on (max) over the replicate dim (:class:`tkern.optim.fsdp.MeshGroups`).

Safety: if ``max_overflows_at_min`` consecutive steps overflow while S is
already at its minimum, ``update`` raises ``RuntimeError`` naming the step and
the last finite loss, rather than skipping steps forever. On a GPU the check
reads a copy of the counter made without waiting; once that copy shows an
overflow streak that could have reached the limit, ``update`` reads the
counter itself, so the error comes at the step that reaches the limit (for a
limit of 1 or 2, up to two steps later).
"""

from tkern.amp.scaler import LossScaler
from tkern.amp.scalers import DynamicLossScaler, LogNormalLossScaler, StaticLossScaler
from tkern.amp.util import FP32_TINY

__all__ = ["FP32_TINY", "DynamicLossScaler", "LogNormalLossScaler", "LossScaler", "StaticLossScaler"]
