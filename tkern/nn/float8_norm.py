"""Norms that write the next fp8 GEMM's input (issue 43 item 3): Transformer Engine's
fused LayerNorm-Linear, for a model :func:`tkern.convert_network` converted with an fp8
recipe.

Which norm feeds which fp8 layers is data, per transformers block class
(:data:`FLOAT8_NORM_RULES`, read from each class's forward). A block a rule matches gets
its norm's ``forward`` replaced on the instance by :class:`Float8NormForward` (names,
parameters, ``state_dict`` unchanged), and each consumer layer a reference to it
(``fp8_producer``). On each eager call the norm then runs
:func:`tkern.ops.norm.norm_float8`: y as before, plus y's e4m3 cast (y and y^T) under
the consumers' recipe; a consumer uses that cast only if its input *is* that y (the same
tensor object, not written in place since), else it casts as before. Several consumers
of one norm (Llama's q, k and v) share one cast.

Under ``"delayed"`` the norm's launch records y's amax into every consumer's input
history and rolls each consumer's cached weight's deferred amax (the weight cast the
optimizer made, looked up at the norm's call and handed to the consumer with it), so the
histories end as the unfused layers would leave them, and the forward, the gradients and
the histories are bit for bit the unfused ones (tests/test_float8_producers.py).

The norm emits nothing (and the consumers cast, as without it) under ``torch.compile``,
for meta tensors or tensor subclasses, when the consumers' recipes, dtypes, modes or
widths disagree, or for ``"blockwise"`` and the fp8 all-gather. Hooks do not stop it: a
hook that hands a consumer another tensor (a norm's forward hook returning a new output, a
consumer's pre-hook, an in-place write) only makes that consumer cast its input itself;
under ``"delayed"`` in training its input history then records the norm's amax as well
as its own that step, and it warns.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tkern.kernels.norm import MAX_ROLLS
from tkern.nn.float8 import Float8Layer
from tkern.nn.norm import LayerNorm, RMSNorm
from tkern.ops.float8 import CACHED_SCALINGS, Float8Input
from tkern.ops.norm import can_emit_float8, norm_float8

__all__ = [
    "FLOAT8_NORM_RULES",
    "Float8NormForward",
    "Float8NormRule",
    "is_the_output",
    "remove_float8_norm",
    "resolve",
    "route_float8_norm",
]


@dataclass(frozen=True)
class Float8NormRule:
    """One norm of a block and the fp8 layers that read its output as their input
    (paths under the block)."""

    norm: str
    consumers: tuple[str, ...]


_LLAMA = (
    Float8NormRule("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    Float8NormRule("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)

#: transformers' block classes (by name) -> their norms and the layers each feeds, read
#: from the classes' forward (transformers 5.x): GPT-2's ``attn(ln_1(h))`` reads it in
#: ``c_attn``, ``mlp(ln_2(h))`` in ``c_fc``; Llama's (and kin's) ``self_attn`` in q, k and
#: v, its MLP in gate and up. A wrong entry costs nothing but the saving: the consumer
#: checks that its input is the norm's output.
FLOAT8_NORM_RULES: dict[str, tuple[Float8NormRule, ...]] = {
    "GPT2Block": (Float8NormRule("ln_1", ("attn.c_attn",)), Float8NormRule("ln_2", ("mlp.c_fc",))),
    **dict.fromkeys(("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"), _LLAMA),
}


@dataclass
class _Emission:
    """One call's fp8 output: the y it is the cast of, and what each consumer takes."""

    y: weakref.ref
    version: int
    x_fp8: Float8Input
    #: id(consumer) -> its weight's cast looked up at the norm's call (or None)
    weights: dict[int, tuple | None]


class Float8NormForward:
    """The forward of a norm whose output feeds fp8 layers (see the module docstring):
    stored as the norm's instance ``forward``, and as each consumer's ``fp8_producer``.
    A module-level class that drops its per-call state when pickled, so the model
    pickles and deep-copies."""

    def __init__(self, norm: nn.Module, consumers: list[nn.Module]) -> None:
        self.norm = norm
        self.consumers = consumers
        self._emission: _Emission | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_emission": None}

    def __repr__(self) -> str:
        return f"tkern.nn.float8_norm.Float8NormForward({len(self.consumers)} fp8 consumers)"

    def _recipe(self, x: torch.Tensor):
        """The consumers' common recipe if the norm emits for them on this call, else None."""
        norm, consumers = self.norm, self.consumers
        # each consumer past the first adds an input history and a weight to roll
        if not can_emit_float8(x) or len(norm.normalized_shape) != 1 or 2 * len(consumers) - 1 > MAX_ROLLS:
            return None
        recipe = consumers[0].recipe
        training = consumers[0].training
        for c in consumers:
            if (
                not isinstance(c, Float8Layer)
                or c.recipe != recipe
                or c.training != training
                or c.weight.dtype != x.dtype
                or c.gemm_in_features() != x.shape[-1]
            ):
                return None
        if recipe.scaling not in CACHED_SCALINGS or recipe.enable_fsdp_float8_all_gather:
            return None
        return recipe

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if torch.compiler.is_compiling():  # the consumers cast: nothing here breaks the graph
            return type(norm).forward(norm, x)
        self._emission = None
        recipe = self._recipe(x)
        if recipe is None:
            return type(norm).forward(norm, x)
        consumers = self.consumers
        grad = torch.is_grad_enabled()
        update = consumers[0].training and grad
        store_t = grad and any(c.weight.requires_grad for c in consumers)
        weights = {id(c): c.cached_weight_fp8() for c in consumers}
        kwargs = {}
        if recipe.scaling == "delayed":
            histories = [c.fp8_histories() for c in consumers]
            rolls = [(h[0], None) for h in histories[1:]]
            if update:  # each cached weight's deferred amax, rolled in the norm's launch
                for c, h in zip(consumers, histories, strict=True):
                    cached = weights[id(c)]
                    if cached is not None:
                        rolls.append((h[1], cached[0][2]))
                        weights[id(c)] = ((*cached[0][:2], None), cached[1])
            counters = consumers[0].fp8_counters()
            kwargs = dict(
                history=histories[0][0], margin=recipe.margin, update=update,
                counter=counters[0:1], rolls=tuple(rolls) if update else (),
            )  # fmt: skip
        rms = isinstance(norm, RMSNorm)
        bias = None if rms else norm.bias
        y, x_fp8 = norm_float8(
            x, norm.normalized_shape, norm.weight, bias, norm.eps, rms=rms, store_t=store_t, **kwargs
        )
        self._emission = _Emission(weakref.ref(y), y._version, x_fp8, weights)
        return y

    def take(self, consumer: nn.Module, x: torch.Tensor) -> tuple[Float8Input, tuple | None] | None:
        """``(x_fp8, (weight_fp8, weight_fp8_t) or None)`` for ``consumer`` if ``x`` is this
        norm's last output, unchanged, and the cast was made for it (once); else None."""
        emission = self._emission
        if emission is None or id(consumer) not in emission.weights:
            return None
        weight = emission.weights.pop(id(consumer))
        if not is_the_output(consumer, x, emission.y, emission.version, "norm", "tkern.nn.float8_norm"):
            return None
        return emission.x_fp8, weight


def is_the_output(consumer: nn.Module, x: torch.Tensor, y: weakref.ref, version: int, what: str, rules: str):
    """Whether ``x``, ``consumer``'s input, is the producer's output ``y`` (a weak reference)
    unchanged since (its version then); if not, under ``"delayed"`` in training, warn that the
    consumer casts its input itself and its histories record the producer's amax as well (the
    producer, a ``what``, recorded it in its launch, as the rules of module ``rules`` say)."""
    if y() is x and x._version == version:
        return True
    if consumer.recipe.scaling == "delayed" and consumer.training and torch.is_grad_enabled():
        warnings.warn(
            f"{type(consumer).__name__}: its input is not its {what}'s output, as the block's "
            f"fp8 rule ({rules}) says; it casts its input itself, and its "
            f"amax histories record the {what}'s amax as well this step",
            stacklevel=4,
        )
    return False


def resolve(block: nn.Module, path: str) -> nn.Module | None:
    """``block``'s submodule at ``path``, or None where there is none."""
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def route_float8_norm(block: nn.Module) -> None:
    """Give the norms of ``block`` (a transformers block class in :data:`FLOAT8_NORM_RULES`)
    the fp8-emitting forward, where the norm is tkern's LayerNorm / RMSNorm with no forward
    of its own and its consumers are fp8 layers of a tensorwise or delayed recipe.
    convert_network runs it after the block's children are converted."""
    kind = type(block)
    rules = FLOAT8_NORM_RULES.get(kind.__name__)
    if rules is None or not kind.__module__.startswith("transformers."):
        return
    for rule in rules:
        norm = resolve(block, rule.norm)
        consumers = [resolve(block, path) for path in rule.consumers]
        if (
            type(norm) not in (LayerNorm, RMSNorm)
            or "forward" in norm.__dict__
            or not all(isinstance(c, Float8Layer) for c in consumers)
            or consumers[0].recipe.scaling not in CACHED_SCALINGS
        ):
            continue
        forward = Float8NormForward(norm, consumers)
        norm.forward = forward
        for c in consumers:
            c.fp8_producer = forward


def remove_float8_norm(module: nn.Module) -> None:
    """Undo :func:`route_float8_norm` on ``module`` (a norm or a consumer)."""
    if isinstance(module.__dict__.get("forward"), Float8NormForward):
        del module.forward
    if isinstance(module.__dict__.get("fp8_producer"), Float8NormForward):  # not a GEMM's hand-off
        del module.__dict__["fp8_producer"]
