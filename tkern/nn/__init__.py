"""Modules built on tkern's ops, one file per family, and ``convert_network``:

``linear.py``   :class:`Linear` (and transformers' GPT-2 ``Conv1D`` as ``tkern.nn.Conv1D``)
``float8.py``   :class:`Float8Linear`, :class:`Float8Recipe` (and ``tkern.nn.Float8Conv1D``)
``float8_fsdp.py``  fp8 all-gather of Float8Linear weights under FSDP2
                (:class:`Float8AllGatherWeight`, :func:`precompute_float8_dynamic_scale_for_fsdp`)
``norm.py``     :class:`LayerNorm`, :class:`RMSNorm` (fp32 statistics and parameters, 16-bit input)
``fusion.py``   an ``nn.Sequential``'s Linear + activation run as one GEMM; transformers' MLP
                blocks (``MLP_RULES``, by family) with their activation on tkern's kernels
``loss.py``     :class:`CrossEntropyLoss`, :class:`LinearCrossEntropy` (tkern's fused cross-entropy)
``hf_loss.py``  transformers' causal LMs computing their loss without logits (``fused_loss=True``)
``convert.py``  :func:`convert_network`: the walk, the warnings, the entry point
``convert_rules.py``  its table of small per-module rules, as data
``casting.py``  the hooks and in-place casts the rules put on a model
"""

from tkern.nn.convert import CASTABLE_TYPES, NORM_TYPES, CastInputs, CastOutput, convert_network
from tkern.nn.float8 import FLOAT8_SCALINGS, Float8Linear, Float8Recipe, float8_conv1d_class
from tkern.nn.float8_fsdp import (
    Float8AllGatherWeight,
    Float8GatheredWeight,
    precompute_float8_dynamic_scale_for_fsdp,
)
from tkern.nn.linear import Linear, conv1d_class
from tkern.nn.loss import CrossEntropyLoss, LinearCrossEntropy
from tkern.nn.norm import LayerNorm, RMSNorm

# and Conv1D, Float8Conv1D where transformers is installed
__all__ = [
    "CASTABLE_TYPES",
    "FLOAT8_SCALINGS",
    "NORM_TYPES",
    "CastInputs",
    "CastOutput",
    "CrossEntropyLoss",
    "Float8AllGatherWeight",
    "Float8GatheredWeight",
    "Float8Linear",
    "Float8Recipe",
    "LayerNorm",
    "Linear",
    "LinearCrossEntropy",
    "RMSNorm",
    "convert_network",
    "precompute_float8_dynamic_scale_for_fsdp",
]


def __getattr__(name: str):
    # ``tkern.nn.Conv1D`` and ``Float8Conv1D`` subclass transformers' Conv1D, so they
    # exist only once transformers is importable; made on first use, found by pickle by name.
    if name == "Conv1D":
        return conv1d_class()
    if name == "Float8Conv1D":
        return float8_conv1d_class()
    raise AttributeError(f"module 'tkern.nn' has no attribute {name!r}")
