"""transformers' pre-norm decoder layers, by family, with the first residual add fused into
the second norm (see :func:`tkern.convert_network`): :data:`DECODER_RULES` (data: which child
does what) and :class:`FusedDecoderForward`.

Llama's layer is ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``. Converted, ``norm2(h)``
and ``h`` come from one :func:`tkern.add_rms_norm` launch (``h = x + attn_out`` in fp32,
rounded once, as torch's add), and its backward adds the gradient that ``h`` receives from
the second add (the residual branch) inside the norm's backward kernel, where autograd would
sum the two with a torch add over (tokens, hidden). The second add ``y = h + mlp_out`` and
the sum of the gradients ``x`` receives (``norm1`` and the residual) stay torch ops: fusing
them needs the next layer's norm (or the model's final norm), across the decoder layers'
boundary (docs: the rest of issue 54 item 4). The layer's class, children and Parameters stay
as they are: only the instance's ``forward`` is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tkern.nn.fusion import runs_more_than_forward
from tkern.nn.norm import RMSNorm
from tkern.ops.norm import add_rms_norm

__all__ = ["DECODER_RULES", "DecoderRule", "FusedDecoderForward", "route_decoder"]


@dataclass(frozen=True)
class DecoderRule:
    """A pre-norm decoder layer's children, by name: its forward is ``h = x +
    attn(hidden_states=norm1(x), **kwargs)[0]; return h + mlp(norm2(h))``."""

    norm1: str = "input_layernorm"
    attn: str = "self_attn"
    norm2: str = "post_attention_layernorm"
    mlp: str = "mlp"


#: transformers' decoder layers (by name) whose forward is exactly the rule's (read from their
#: source, transformers 5.x; tests/test_residual.py checks each class's forward against Llama's).
#: Gemma's and OLMo's have the same forward but norms tkern's RMSNorm does not replace.
DECODER_RULES: dict[str, DecoderRule] = dict.fromkeys(
    ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"), DecoderRule()
)


def _fusable_now(layer: nn.Module, rule: DecoderRule) -> bool:
    """Whether the layer runs fused on this call: ``norm2`` is tkern's RMSNorm, with nothing
    (a hook, a patched forward) that skipping its call would skip."""
    norm2 = getattr(layer, rule.norm2, None)
    return type(norm2) is RMSNorm and not runs_more_than_forward(norm2)


class FusedDecoderForward:
    """The forward of a transformers decoder layer converted with ``fuse_activations``: the
    rule's form with ``norm2(x + attn_out)`` one :func:`tkern.add_rms_norm` (the children
    called as modules otherwise). A call with positional arguments besides the hidden states,
    the deprecated ``past_key_values``, or a norm2 that is not tkern's now (or hooked) runs the
    class's own forward. Stored as the instance's ``forward``; a module-level class, so the
    model pickles and deep-copies."""

    def __init__(self, layer: nn.Module, rule: DecoderRule) -> None:
        self.layer = layer
        self.rule = rule

    def __call__(self, *args, **kwargs):
        layer, rule = self.layer, self.rule
        if len(args) != 1 or "past_key_values" in kwargs or not _fusable_now(layer, rule):
            return type(layer).forward(layer, *args, **kwargs)
        (x,) = args
        attn_out, _ = getattr(layer, rule.attn)(hidden_states=getattr(layer, rule.norm1)(x), **kwargs)
        norm2 = getattr(layer, rule.norm2)
        y, h = add_rms_norm(attn_out, x, norm2.normalized_shape, norm2.weight, norm2.eps)
        return h + getattr(layer, rule.mlp)(y)

    def __repr__(self) -> str:
        return "tkern.nn.residual.FusedDecoderForward()"


def decoder_rule(layer: nn.Module) -> DecoderRule | None:
    """``layer``'s rule: its class, or a base whose forward it keeps, is named in
    :data:`DECODER_RULES` and comes from transformers; else None."""
    forward = type(layer).forward
    for cls in type(layer).__mro__:
        rule = DECODER_RULES.get(cls.__name__)
        if rule is not None and cls.__module__.startswith("transformers.") and cls.forward is forward:
            return rule
    return None


def route_decoder(layer: nn.Module) -> None:
    """Give ``layer`` the fused forward if it is a decoder layer of a family in
    :data:`DECODER_RULES` whose norm2 is tkern's RMSNorm (converted with ``norms``); returns
    None (a POST rule that never warns: an unfused layer runs as HF wrote it)."""
    if "forward" in layer.__dict__:
        return None  # the user's own replacement forward (or ours, from an earlier call)
    rule = decoder_rule(layer)
    if rule is not None and _fusable_now(layer, rule):
        layer.forward = FusedDecoderForward(layer, rule)
    return None
