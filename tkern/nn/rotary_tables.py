"""transformers' rotary embedding modules, by family, computing their (cos, sin) tables on
tkern's kernel (see :func:`tkern.convert_network`): :data:`ROTARY_TABLES_RULES` (data: which
class, and in which dtype it returns its tables), :data:`STATIC_ROPE_TYPES` and
:class:`RotaryTablesForward`.

HF's ``LlamaRotaryEmbedding.forward(x, position_ids)`` (and its per-family twins') reads
only ``x``'s dtype and device, and computes ``cat(freqs, freqs)`` with ``freqs = positions *
inv_freq`` in fp32, its cos and sin times ``attention_scaling``: about ten torch launches per
step, and a module convert_network would otherwise keep in fp32, its input (the whole hidden
states) cast to fp32 first. A converted one gets, as its instance ``forward``, one launch of
:func:`tkern.ops.rotary.rotary_tables` (fp32 inside, one rounding to the tables' dtype); its
class, buffers (``inv_freq``, ``original_inv_freq``: fp32, as HF keeps them) and attributes
stay as they are. Only the rope types whose ``inv_freq`` and ``attention_scaling`` are set once,
when the module is built (:data:`STATIC_ROPE_TYPES`), take it: ``dynamic_rope_update``
recomputes them per call for the "dynamic" and "longrope" types, whose modules keep HF's forward
(in fp32, as a module of no known type) and are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tkern.kernels.rotary import DTYPES, POSITION_DTYPES
from tkern.nn.fusion import family_rule
from tkern.ops.rotary import rotary_tables

__all__ = [
    "ROTARY_TABLES_RULES",
    "STATIC_ROPE_TYPES",
    "RotaryTablesForward",
    "RotaryTablesRule",
    "route_rotary_tables",
]


@dataclass(frozen=True)
class RotaryTablesRule:
    """What one family's rotary embedding forward returns. ``tables``: ``"input"``, the
    tables in its input ``x``'s dtype (``cos.to(dtype=x.dtype)``); ``"fp32"``, kept fp32
    (OLMo's, whose attention rotates in fp32). tests/test_rotary_tables.py checks each
    family's source against its rule."""

    tables: str = "input"


_INPUT = RotaryTablesRule()
_FP32 = RotaryTablesRule(tables="fp32")

#: transformers' rotary embedding classes (by name) whose forward is Llama's: ``freqs =
#: position_ids[..., None].float() * inv_freq``, ``emb = cat(freqs, freqs)``, ``emb.cos() *
#: attention_scaling`` and ``emb.sin() * attention_scaling`` (read from their source,
#: transformers 5.x; Gemma 3's takes a ``layer_type`` and is not among them).
ROTARY_TABLES_RULES: dict[str, RotaryTablesRule] = {
    **dict.fromkeys(
        (
            "LlamaRotaryEmbedding",
            "MistralRotaryEmbedding",
            "Qwen2RotaryEmbedding",
            "Qwen3RotaryEmbedding",
            "GemmaRotaryEmbedding",
            "Gemma2RotaryEmbedding",
            "GraniteRotaryEmbedding",
            "PhiRotaryEmbedding",
            "Phi3RotaryEmbedding",
            "GPTNeoXRotaryEmbedding",
        ),
        _INPUT,
    ),
    "OlmoRotaryEmbedding": _FP32,
    "Olmo2RotaryEmbedding": _FP32,
}

#: HF's ``rope_type`` values whose ``inv_freq`` and ``attention_scaling`` the module's
#: ``__init__`` sets once (``ROPE_INIT_FUNCTIONS``), untouched by ``dynamic_rope_update``,
#: which recomputes them per call only for the "dynamic" types and "longrope".
STATIC_ROPE_TYPES: frozenset[str] = frozenset(("default", "linear", "llama3", "yarn"))


def _static(module: nn.Module) -> bool:
    """Whether ``module``'s tables depend on its position ids alone: a static rope type, an fp32
    ``inv_freq`` and a float ``attention_scaling``."""
    inv_freq = getattr(module, "inv_freq", None)
    scaling = getattr(module, "attention_scaling", None)
    return (
        getattr(module, "rope_type", None) in STATIC_ROPE_TYPES
        and isinstance(inv_freq, torch.Tensor)
        and inv_freq.dim() == 1
        and inv_freq.dtype == torch.float32
        and isinstance(scaling, (int, float))
        and not isinstance(scaling, bool)
    )


class RotaryTablesForward:
    """The forward of a transformers rotary embedding module converted with
    ``fuse_activations``: ``(cos, sin)`` from :func:`tkern.ops.rotary.rotary_tables` in one
    launch, in the rule's dtype. HF's own forward where a call is not one the kernel computes
    (a ``layer_type``, position ids not int32 / int64 of shape (batch, seq), a rope type or
    ``inv_freq`` changed since). Stored as the instance's ``forward`` (hooks on the module fire
    as before); a module-level class, so the model pickles and deep-copies."""

    def __init__(self, module: nn.Module, rule: RotaryTablesRule) -> None:
        self.module = module
        self.rule = rule

    def __call__(self, x, position_ids, *args, **kwargs):
        m = self.module
        if (
            args
            or kwargs
            or not isinstance(position_ids, torch.Tensor)
            or position_ids.dtype not in POSITION_DTYPES
            or position_ids.dim() != 2
            or x.dtype not in DTYPES
            or not _static(m)
        ):
            return type(m).forward(m, x, position_ids, *args, **kwargs)
        dtype = x.dtype if self.rule.tables == "input" else torch.float32
        return rotary_tables(
            position_ids, m.inv_freq.to(position_ids.device), float(m.attention_scaling), dtype
        )

    def __repr__(self) -> str:
        return f"tkern.nn.rotary_tables.RotaryTablesForward(tables={self.rule.tables!r})"


def route_rotary_tables(module: nn.Module) -> tuple[bool, str | None]:
    """Give ``module`` the tables' forward if it is a transformers rotary embedding of a family
    in :data:`ROTARY_TABLES_RULES` with a static rope type. Returns ``(routed, why not)``: why
    not where it is one of those families left to HF's forward (for convert_network's
    warning), else None."""
    if "forward" in module.__dict__:
        return False, None  # the user's own replacement forward
    _, rule = family_rule(module, ROTARY_TABLES_RULES)
    if rule is None:
        return False, None
    if not _static(module):
        rope_type = getattr(module, "rope_type", None)
        return False, (
            f"its rope_type {rope_type!r} is not one whose inv_freq is set once "
            f"({', '.join(sorted(STATIC_ROPE_TYPES))}); HF's forward computes its tables in fp32"
        )
    module.forward = RotaryTablesForward(module, rule)
    return True, None
