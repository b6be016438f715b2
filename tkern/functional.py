"""The functional entry points, kept at their old import path: they live in
:mod:`tkern.ops` (``tkern/ops/linear.py``, ``tkern/ops/float8.py``) now."""

from tkern.ops.float8 import CACHED_SCALINGS, Float8WeightCache, float8_linear, float8_weight_cache
from tkern.ops.linear import (
    PROLOGUE_ACTIVATIONS,
    check_linear_args,
    linear,
    linear_args_plainly_valid,
    matmul,
)

__all__ = [
    "CACHED_SCALINGS",
    "PROLOGUE_ACTIVATIONS",
    "Float8WeightCache",
    "check_linear_args",
    "float8_linear",
    "float8_weight_cache",
    "linear",
    "linear_args_plainly_valid",
    "matmul",
]
