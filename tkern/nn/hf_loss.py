"""transformers' causal LMs computing their loss with :func:`tkern.linear_cross_entropy`
(``convert_network(model, dtype, fused_loss=True)``): no (tokens x vocabulary) logits
in forward or backward.

The LM-head model's ``forward`` is replaced on the instance by a
:class:`FusedCausalLMLoss`: with ``labels`` it calls the base model (``model.transformer``
for GPT-2, ``model.model`` for Llama: ``model.base_model``) with the same arguments, and
the loss on its last hidden state and the head's weight (and bias), with HF's shift
(position i predicts label i + 1; the last position is ignored), ``ignore_index=-100``,
and HF's ``num_items_in_batch`` / ``shift_labels`` keywords; ``logits`` is None in the
output. Without labels (``generate()`` included) the model's own forward runs, untouched.
Tied embeddings stay tied: the head's weight is read where it lives. A config's
``final_logit_softcapping`` (Gemma 2: ``c * tanh(logits / c)`` before the loss) is
passed on as the loss's ``softcap``.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tkern.ops.cross_entropy import linear_cross_entropy

__all__ = [
    "FusedCausalLMLoss",
    "final_logit_softcap",
    "fused_loss_output_class",
    "install_fused_loss",
    "remove_fused_loss",
]

#: The LM-head model classes (by name) whose forward is "base model, lm_head, HF's causal
#: loss", and the output class each returns.
_FAMILIES = {
    "GPT2LMHeadModel": "CausalLMOutputWithCrossAttentions",
    "LlamaForCausalLM": "CausalLMOutputWithPast",
    "Gemma2ForCausalLM": "CausalLMOutputWithPast",
}
#: The LM-head forward's own arguments, not passed on to the base model.
_HEAD_ARGS = ("labels", "logits_to_keep", "return_dict")
IGNORE_INDEX = -100


def fused_loss_output_class(model: nn.Module) -> type | None:
    """The output class of ``model``'s forward if it is a causal LM whose loss can be
    fused (a supported family with an ``lm_head``), else None."""
    name = _FAMILIES.get(type(model).__name__)
    if name is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return None
    from transformers import modeling_outputs

    return getattr(modeling_outputs, name)


def final_logit_softcap(model: nn.Module) -> float | None:
    """The model config's ``final_logit_softcapping`` (Gemma 2), None where unset or absent."""
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return None if cap is None else float(cap)


class FusedCausalLMLoss:
    """``model.forward`` with the loss by :func:`tkern.linear_cross_entropy` when labels are
    given (see the module docstring). A module-level class, so models pickle and deep-copy."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.output_class = fused_loss_output_class(model)

    def _original(self, *args, **kwargs):
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if kwargs.get("labels") is None:
            return self._original(*args, **kwargs)
        try:
            bound = inspect.signature(type(self.model).forward).bind(self.model, *args, **kwargs)
        except TypeError:  # a deprecated spelling or a positional labels: HF's own path
            return self._original(*args, **kwargs)
        named = dict(bound.arguments)
        named.pop("self", None)
        extra = named.pop("kwargs", {})
        labels = named.pop("labels")
        return_dict = named.pop("return_dict", extra.pop("return_dict", None))
        for arg in _HEAD_ARGS:
            named.pop(arg, None)
        out = self.model.base_model(**named, **extra)
        loss = self.loss(out.last_hidden_state, labels, extra)
        fields = {k: v for k, v in out.items() if k in self.output_class.__dataclass_fields__}
        fields.pop("last_hidden_state", None)
        result = self.output_class(loss=loss, logits=None, **fields)
        return result.to_tuple() if return_dict is False else result

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, extra: dict) -> torch.Tensor:
        """HF's ``ForCausalLMLoss`` on ``hidden`` (B, T, H) through the head, chunked."""
        head = self.model.lm_head
        shift_labels = extra.get("shift_labels")
        if shift_labels is None:
            # position i predicts label i + 1; the last position predicts nothing
            shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        num_items = extra.get("num_items_in_batch")
        weight = head.weight
        x = hidden if hidden.dtype == weight.dtype else hidden.to(weight.dtype)
        loss = linear_cross_entropy(
            x.reshape(-1, x.shape[-1]),
            weight,
            shift_labels.reshape(-1),
            linear_bias=head.bias,
            reduction="mean" if num_items is None else "sum",
            ignore_index=IGNORE_INDEX,
            softcap=final_logit_softcap(self.model),
        )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        return loss


def install_fused_loss(model: nn.Module) -> bool:
    """Give ``model`` a :class:`FusedCausalLMLoss` forward if its family is supported;
    returns whether it did."""
    if fused_loss_output_class(model) is None:
        return False
    model.forward = FusedCausalLMLoss(model)
    return True


def remove_fused_loss(module: nn.Module) -> None:
    """Undo :func:`install_fused_loss` (nothing if it was not installed)."""
    if isinstance(module.__dict__.get("forward"), FusedCausalLMLoss):
        del module.forward
