"""tkern's optimizers: fused SGD/Adam/AdamW on fp32 master weights in flat buffers.

:mod:`tkern.optim.fused` holds the single-process optimizers;
:mod:`tkern.optim.distributed` their sharded (ZeRO-2) versions on torch.distributed.
"""

from tkern.optim.adam import FusedAdam, FusedAdamW
from tkern.optim.distributed import DistributedFusedAdam, DistributedFusedAdamW, DistributedFusedSGD
from tkern.optim.fused import FusedOptimizer
from tkern.optim.sgd import FusedSGD

__all__ = [
    "DistributedFusedAdam",
    "DistributedFusedAdamW",
    "DistributedFusedSGD",
    "FusedAdam",
    "FusedAdamW",
    "FusedSGD",
    "FusedOptimizer",
]
