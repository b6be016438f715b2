"""transformers' attention modules, by family, with their rotary embedding on tkern's kernel
(see :func:`tkern.convert_network`): :data:`ROTARY_RULES` (data: which attention class calls
which module-level rotary function, in which convention) and :class:`RotaryAttentionForward`.

An HF attention's ``forward`` calls its modeling file's ``apply_rotary_pos_emb`` by a global
lookup at call time. Rebinding that global would change every model of the family, converted
or not; instead each converted attention module gets, as its instance ``forward``, the
class's own forward function rebuilt over a copy of its modeling module's globals in which
that one name is :func:`tkern.ops.rotary.apply_rotary_pos_emb` (the decorators around it,
``functools.wraps`` wrappers such as ``deprecate_kwarg``, rebuilt around the copy). The
module's class, children, Parameters and buffers stay as they are; an unconverted twin runs
HF's own rotary. The copy holds the modeling module's globals as they were when the family
was first converted (a later rebinding in that module is not seen by converted models).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

from torch import nn

from tkern.nn.fusion import family_rule
from tkern.nn.projections import CALL, SharedInputCall, grouped_code, rebuilt
from tkern.ops.rotary import apply_rotary_pos_emb

__all__ = ["ROTARY_RULES", "RotaryAttentionForward", "RotaryRule", "route_rotary"]


@dataclass(frozen=True)
class RotaryRule:
    """What one family's attention forward calls for its rotary embedding.

    ``function``: the modeling module's global the forward calls as ``function(q, k, cos,
    sin)``. ``partial``: that function rotates only the first ``cos.shape[-1]`` head-dim
    columns and passes the rest through (GPT-NeoX, Phi-3); else it rotates them all
    (Phi slices its ``rotary_ndims`` itself, then calls the full form). tkern's function
    computes both (tests/test_rotary.py checks each family's source against its rule).
    ``shared_input``: the children the forward calls, each as ``self.<name>(hidden_states)``, on
    one input (Llama's q, k, v projections), run as one autograd node whose backward sums their
    input gradients in the dgrad GEMMs (:mod:`tkern.nn.projections`); empty: none (one packed
    projection: Phi-3's ``qkv_proj``, GPT-NeoX's ``query_key_value``)."""

    function: str = "apply_rotary_pos_emb"
    partial: bool = False
    shared_input: tuple[str, ...] = ()


_FULL = RotaryRule(shared_input=("q_proj", "k_proj", "v_proj"))
_PARTIAL = RotaryRule(partial=True)

#: transformers' attention classes (by name) whose forward calls its modeling module's
#: ``apply_rotary_pos_emb(q, k, cos, sin)`` in HF's ``rotate_half`` convention (read from
#: their source, transformers 5.x).
ROTARY_RULES: dict[str, RotaryRule] = {
    **dict.fromkeys(
        (
            "LlamaAttention",
            "MistralAttention",
            "Qwen2Attention",
            "Qwen3Attention",
            "GemmaAttention",
            "Gemma2Attention",
            "Gemma3Attention",
            "OlmoAttention",
            "Olmo2Attention",
            "GraniteAttention",
            "PhiAttention",
        ),
        _FULL,
    ),
    "Phi3Attention": _PARTIAL,
    "GPTNeoXAttention": _PARTIAL,
}


def _innermost(fn):
    """The function at the bottom of ``fn``'s ``functools.wraps`` chain."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _rebuilt(fn, name: str, value, group: tuple[str, ...] = ()):
    """``fn`` rebuilt (:func:`tkern.nn.projections.rebuilt`) so that its innermost function
    looks ``name`` up as ``value`` (in a copy of its globals) and, where its code calls the
    children ``group`` as :func:`tkern.nn.projections.grouped_code` wants, calls them as one
    group. None where a wrapper holds the function below otherwise."""

    def innermost(fn):
        globals_ = {**fn.__globals__, name: value}
        # no __name__: torch.compile would take these globals for the module of that name
        # (and guard on HF's function); without one it guards on this dict itself
        globals_.pop("__name__", None)
        code = grouped_code(fn, group) if group else None
        if code is None:
            code = fn.__code__
        else:
            globals_[CALL] = SharedInputCall(group)
        return types.FunctionType(code, globals_, fn.__name__, fn.__defaults__, fn.__closure__)

    return rebuilt(fn, innermost)


#: attention class -> its forward with tkern's rotary (built once per class).
_FORWARDS: dict[type, object] = {}


def _rule_class(module: nn.Module) -> tuple[type | None, RotaryRule | None]:
    """The transformers class (``module``'s or a base whose forward it keeps) named in
    :data:`ROTARY_RULES`, and its rule."""
    return family_rule(module, ROTARY_RULES)


def _rotary_forward(module: nn.Module, rule: RotaryRule):
    """``type(module).forward`` with ``rule.function`` bound to tkern's (cached per class)."""
    cls = type(module)
    forward = _FORWARDS.get(cls)
    if forward is None:
        forward = _FORWARDS[cls] = _rebuilt(
            cls.forward, rule.function, apply_rotary_pos_emb, rule.shared_input
        )
    return forward


class RotaryAttentionForward:
    """The forward of a transformers attention module converted with ``fuse_activations``:
    its class's own forward, except that the rotary embedding (``rule.function``) runs
    :func:`tkern.apply_rotary_pos_emb` (q and k in one kernel, fp32 inside, one rounding,
    forward and backward), and the projections ``rule.shared_input`` run as one
    :func:`tkern.ops.projections.shared_input_linears` call where they can
    (:mod:`tkern.nn.projections`). Stored as the instance's ``forward`` (hooks on the module fire as
    before); a module-level class, so the model pickles and deep-copies."""

    def __init__(self, attention: nn.Module, rule: RotaryRule) -> None:
        self.attention = attention
        self.rule = rule

    def __call__(self, *args, **kwargs):
        return _rotary_forward(self.attention, self.rule)(self.attention, *args, **kwargs)

    def __repr__(self) -> str:
        return f"tkern.nn.rotary.RotaryAttentionForward({self.rule.function})"


def _rotary_globals(cls: type) -> list[str]:
    """The rotary functions (module-level names containing "rotary") that ``cls.forward``
    looks up in its modeling module."""
    module = sys.modules.get(cls.__module__)
    names = getattr(getattr(_innermost(cls.forward), "__code__", None), "co_names", ())
    return [n for n in names if "rotary" in n and callable(getattr(module, n, None))]


def _why_not(module: nn.Module) -> str | None:
    """Why a transformers attention module that calls a rotary function is left to it."""
    cls, rule = _rule_class(module)
    if cls is None:
        called = _rotary_globals(type(module))
        return f"tkern has no rotary rule for this attention class; its {called[0]} runs as torch ops"
    if rule.function not in _rotary_globals(cls):
        return f"its forward does not call {rule.function} as tkern's rule says; it runs as it is"
    if _rebuilt(cls.forward, rule.function, apply_rotary_pos_emb) is None:
        return "its forward is wrapped by a decorator tkern cannot rebuild; its rotary runs as torch ops"
    return None


def route_rotary(module: nn.Module) -> str | None:
    """Give ``module`` the rotary forward if it is a transformers attention module of a family
    in :data:`ROTARY_RULES`. Returns why not where it is a transformers module whose forward
    calls a rotary function and that is left to it (for convert_network's warning), else None."""
    if "forward" in module.__dict__ or not type(module).__module__.startswith("transformers."):
        return None  # the user's own replacement forward (or ours, from an earlier call)
    cls, rule = _rule_class(module)
    if cls is None and not _rotary_globals(type(module)):
        return None  # no rotary here
    reason = _why_not(module)
    if reason is None:
        module.forward = RotaryAttentionForward(module, rule)
    return reason
