"""transformers' pre-norm decoder layers, by family, with the first residual add fused into
the second norm (see :func:`tkern.convert_network`): :data:`DECODER_RULES` (data: which child
does what) and :class:`FusedDecoderForward`.

Llama's and GPT-2's layers are ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``. Converted,
``norm2(h)`` and ``h`` come from one :func:`tkern.add_rms_norm` (GPT-2:
:func:`tkern.add_layer_norm`) launch (``h = x + attn_out`` in fp32, rounded once, as torch's
add), and its backward adds the gradient that ``h`` receives from the second add (the
residual branch) inside the norm's backward kernel, where autograd would sum the two with a
torch add over (tokens, hidden). Likewise ``norm1`` runs as :func:`tkern.rms_norm_and_residual`
(GPT-2: :func:`tkern.layer_norm_and_residual`), whose second output, a view of ``x``, is the
add's residual: the gradient ``x`` receives from the residual branch reaches norm1's backward
kernel, which adds it to norm1's own, so autograd has no sum of x's two gradients left. The
second add ``y = h + mlp_out`` runs in the epilogue of the MLP's last GEMM (down_proj's,
c_proj's: :func:`tkern.nn.fusion.mlp_with_residual`; its backward passes the gradient on, no
add) where the MLP block runs fused, else it is a torch add. A norm1 that is not tkern's, or
is hooked, is called as a module and autograd sums x's gradients as before. The layer's
class, children and Parameters stay as they are: only the instance's ``forward`` is replaced.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from tkern.nn.fusion import family_rule, mlp_with_residual, runs_more_than_forward
from tkern.nn.norm import LayerNorm, RMSNorm
from tkern.ops.norm import add_layer_norm, add_rms_norm, layer_norm_and_residual, rms_norm_and_residual

__all__ = ["DECODER_RULES", "DecoderRule", "FusedDecoderForward", "route_decoder"]


@dataclass(frozen=True)
class DecoderRule:
    """A pre-norm decoder layer's children, by name, and how its forward calls them: ``h = x +
    attn(norm1(x), **arguments)[0]; return h + mlp(norm2(h))``, where ``arguments`` are the
    forward's other arguments (its defaults filled in, as HF passes them on) but
    ``not_to_attn``; ``positional``: the attention takes the normalized states positionally
    (GPT-2) or as ``hidden_states=`` (Llama); ``plain_if_given``: arguments that, not None,
    take another path (GPT-2's cross-attention) and so run the class's own forward."""

    norm1: str = "input_layernorm"
    attn: str = "self_attn"
    norm2: str = "post_attention_layernorm"
    mlp: str = "mlp"
    positional: bool = False
    not_to_attn: tuple[str, ...] = ()
    plain_if_given: tuple[str, ...] = ()


_GPT2_CROSS = ("encoder_hidden_states", "encoder_attention_mask")

#: transformers' decoder layers (by name) whose forward is exactly the rule's (read from their
#: source, transformers 5.x; tests/test_residual.py checks each Llama-like class's forward
#: against Llama's). Gemma's and OLMo's have Llama's forward but norms tkern's RMSNorm does not
#: replace.
DECODER_RULES: dict[str, DecoderRule] = {
    **dict.fromkeys(
        ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"), DecoderRule()
    ),
    "GPT2Block": DecoderRule(
        "ln_1", "attn", "ln_2", "mlp", positional=True, not_to_attn=_GPT2_CROSS, plain_if_given=_GPT2_CROSS
    ),
}

#: tkern's norm module -> its fused add-and-norm, called as ``(x, residual, norm)``.
_ADD_NORMS = {
    RMSNorm: lambda x, residual, n: add_rms_norm(x, residual, n.normalized_shape, n.weight, n.eps),
    LayerNorm: lambda x, residual, n: add_layer_norm(
        x, residual, n.normalized_shape, n.weight, n.bias, n.eps
    ),
}


#: tkern's norm module -> its norm that passes its input on, ``(normed, residual)``, called as
#: ``(x, norm)``.
_NORMS_AND_RESIDUAL = {
    RMSNorm: lambda x, n: rms_norm_and_residual(x, n.normalized_shape, n.weight, n.eps),
    LayerNorm: lambda x, n: layer_norm_and_residual(x, n.normalized_shape, n.weight, n.bias, n.eps),
}


def _plain(norm: nn.Module | None, table: dict) -> bool:
    """Whether ``norm`` is one of ``table``'s tkern norms, with nothing (a hook, a patched
    forward) that skipping its call would skip."""
    return type(norm) in table and not runs_more_than_forward(norm)


def _fusable_now(layer: nn.Module, rule: DecoderRule) -> bool:
    """Whether the layer runs fused on this call: ``norm2`` is tkern's RMSNorm or LayerNorm,
    with nothing (a hook, a patched forward) that skipping its call would skip."""
    return _plain(getattr(layer, rule.norm2, None), _ADD_NORMS)


#: decoder layer class -> its forward's signature (read once per class).
_SIGNATURES: dict[type, inspect.Signature] = {}


def _arguments(layer: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The forward's arguments by name, defaults filled in, ``**kwargs`` merged in; None where
    they do not bind (the class's own forward then says why)."""
    cls = type(layer)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(inspect.unwrap(cls.forward))
    try:
        bound = _SIGNATURES[cls].bind(layer, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(named)))  # self
    for name, param in _SIGNATURES[cls].parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name))
    return named


class FusedDecoderForward:
    """The forward of a transformers decoder layer converted with ``fuse_activations``: the
    rule's form with ``norm2(x + attn_out)`` one fused add-and-norm launch and, where ``norm1``
    is tkern's and not hooked, ``norm1(x)`` its ``*_and_residual`` form, whose passed x is that
    add's residual (the children called as modules otherwise). The deprecated
    ``past_key_values``, an argument of the rule's ``plain_if_given``, arguments that do not
    bind, or a norm2 that is not tkern's now (or is hooked) run the class's own forward. Stored
    as the instance's ``forward``; a module-level class, so the model pickles and deep-copies."""

    def __init__(self, layer: nn.Module, rule: DecoderRule) -> None:
        self.layer = layer
        self.rule = rule

    def __call__(self, *args, **kwargs):
        layer, rule = self.layer, self.rule
        named = None if "past_key_values" in kwargs else _arguments(layer, args, kwargs)
        if (
            named is None
            or any(named.get(n) is not None for n in rule.plain_if_given)
            or not _fusable_now(layer, rule)
        ):
            return type(layer).forward(layer, *args, **kwargs)
        x = named.pop("hidden_states")
        passed = {n: v for n, v in named.items() if n not in rule.not_to_attn}
        norm1 = getattr(layer, rule.norm1)
        if _plain(norm1, _NORMS_AND_RESIDUAL):  # x's residual-branch gradient: into norm1's kernel
            normed, x = _NORMS_AND_RESIDUAL[type(norm1)](x, norm1)
        else:
            normed = norm1(x)
        attn = getattr(layer, rule.attn)
        attn_out, _ = attn(normed, **passed) if rule.positional else attn(hidden_states=normed, **passed)
        norm2 = getattr(layer, rule.norm2)
        y, h = _ADD_NORMS[type(norm2)](attn_out, x, norm2)
        return mlp_with_residual(getattr(layer, rule.mlp), y, h)  # y = h + mlp(...): in its last GEMM

    def __repr__(self) -> str:
        return "tkern.nn.residual.FusedDecoderForward()"


def decoder_rule(layer: nn.Module) -> DecoderRule | None:
    """``layer``'s rule in :data:`DECODER_RULES` (``fusion.family_rule``), or None."""
    return family_rule(layer, DECODER_RULES)[1]


def route_decoder(layer: nn.Module) -> None:
    """Give ``layer`` the fused forward if it is a decoder layer of a family in
    :data:`DECODER_RULES` whose norm2 is tkern's RMSNorm or LayerNorm (``norms``); returns
    None (a POST rule that never warns: an unfused layer runs as HF wrote it)."""
    if "forward" in layer.__dict__:
        return None  # the user's own replacement forward (or ours, from an earlier call)
    rule = decoder_rule(layer)
    if rule is not None and _fusable_now(layer, rule):
        layer.forward = FusedDecoderForward(layer, rule)
    return None
