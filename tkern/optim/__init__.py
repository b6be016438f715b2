"""tkern's optimizers: fused SGD/Adam/AdamW on fp32 master weights in flat buffers.

:mod:`tkern.optim.fused` holds the single-process optimizers.
"""

from tkern.optim.fused import FusedAdam, FusedAdamW, FusedSGD, _FusedOptimizer

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD", "_FusedOptimizer"]
