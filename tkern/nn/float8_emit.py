"""fp8 layers whose GEMM epilogue writes the next fp8 layer's input (issue 43 item 3): GPT-2's
fused MLP, ``c_fc`` (GELU in its fp8 epilogue) handing ``c_proj`` its e4m3 input, for a model
:func:`tkern.convert_network` converted with an fp8 recipe and ``fuse_activations``.

The norms' hand-off (:mod:`tkern.nn.float8_norm`) with a GEMM as the producer, through the
same seam: which layer feeds which is data, per transformers MLP class
(:data:`FLOAT8_EMIT_RULES`); a block a rule matches gets a :class:`Float8GemmEmitter` held by
the producer (``fp8_emitter``) and by the consumer (``fp8_producer``, the seam the norm's
consumers read). On each eager call of the producer's fused forward (the MLP's activation in
its epilogue: only then is its output the consumer's input) the emitter asks
:func:`tkern.ops.float8.float8_linear` for the consumer's cast (``emit_fp8``, under the
consumer's recipe and with its amax history); the consumer uses that cast only if its input
*is* the producer's output (the same tensor object, not written in place since) and it is
the exact module object the emitter was set up for, else it casts as before.

Under ``"delayed"`` the producer's launch records C's amax into the consumer's input history
and rolls the consumer's cached weight's deferred amax (the weight cast the optimizer made,
looked up at the producer's call and handed over with the input), so the histories end as
the unfused layers leave them and the forward, the gradients and the histories are bit for
bit the unfused ones (tests/test_float8_gemm_emit.py). Under ``"tensorwise"`` the launch
finds max |C| and one cast pass follows (c_proj's amax pass is gone).

Nothing is emitted (the consumer casts) under ``torch.compile``, for meta tensors or tensor
subclasses, for ``"blockwise"`` or the fp8 all-gather, when the two layers' dtypes or widths
disagree, or when the producer runs without the activation (the block's unfused forward,
whose activation module sits between the two). Parameters, names and ``state_dict`` are
unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.float8 import native_e4m3
from tkern.nn.float8 import Float8Layer
from tkern.nn.float8_norm import is_the_output, resolve
from tkern.ops.float8 import CACHED_SCALINGS, Float8Input
from tkern.ops.float8_emit import Float8Emit
from tkern.ops.norm import can_emit_float8

__all__ = [
    "FLOAT8_EMIT_RULES",
    "Float8EmitRule",
    "Float8GemmEmitter",
    "remove_float8_emit",
    "route_float8_emit",
]


@dataclass(frozen=True)
class Float8EmitRule:
    """An fp8 layer of a block whose output is the input of another (paths under the block),
    when the producer runs the block's activation in its epilogue (the fused MLP's form)."""

    producer: str
    consumer: str


#: transformers' MLP classes (by name) -> the fp8 layers whose output feeds another, read from
#: the classes' forward as tkern.nn.fusion runs it fused: GPT-2's ``c_proj(act(c_fc(x)))``, the
#: activation in ``c_fc``'s epilogue. A wrong entry costs nothing but the saving: the consumer
#: checks that its input is the producer's output.
FLOAT8_EMIT_RULES: dict[str, tuple[Float8EmitRule, ...]] = {
    "GPT2MLP": (Float8EmitRule("c_fc", "c_proj"),),
}


@dataclass
class _Emission:
    """One call's cast: the y it is the cast of, and the consumer's weight cast (or None)."""

    y: weakref.ref
    version: int
    x_fp8: Float8Input
    weight: tuple | None


class Float8GemmEmitter:
    """The hand-off from one fp8 layer's GEMM to the next (see the module docstring): the
    producer's ``fp8_emitter`` and the consumer's ``fp8_producer``. Drops its per-call state
    when pickled, so the model pickles and deep-copies."""

    def __init__(self, producer: nn.Module, consumer: nn.Module) -> None:
        self.producer = producer
        self.consumer = consumer
        self._emission: _Emission | None = None
        self._weight: tuple | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_emission": None, "_weight": None}

    def __repr__(self) -> str:
        return f"tkern.nn.float8_emit.Float8GemmEmitter(-> {type(self.consumer).__name__})"

    def spec(self, x: torch.Tensor, activation: str | None) -> Float8Emit | None:
        """What the producer's forward on ``x`` emits for the consumer (``float8_linear``'s
        ``emit_fp8``), or None: it emits nothing on this call. Looks up the consumer's
        cached weight cast, handed over with the input (:meth:`take`)."""
        self._emission = self._weight = None
        producer, consumer = self.producer, self.consumer
        if (
            activation is None
            or not can_emit_float8(x)
            or not isinstance(consumer, Float8Layer)
            or consumer.__dict__.get("fp8_producer") is not self  # the hand-off was removed there
        ):
            return None
        recipe = consumer.recipe
        weight = producer.weight
        if (
            recipe.scaling not in CACHED_SCALINGS
            or recipe.enable_fsdp_float8_all_gather
            or producer.recipe.scaling not in CACHED_SCALINGS
            or weight.dtype not in HALF_DTYPES
            or consumer.weight.dtype != weight.dtype
            or consumer.gemm_in_features() != producer.gemm_out_features()
        ):
            return None
        grad = torch.is_grad_enabled()
        update = consumer.training and grad
        cached = consumer.cached_weight_fp8()
        e4m3 = native_e4m3(weight.device)  # the consumer's x format (FNUZ on a gfx942)
        if recipe.scaling == "tensorwise":
            self._weight = cached
            return Float8Emit("tensorwise", e4m3, store_t=grad and consumer.weight.requires_grad)
        histories = consumer.fp8_histories()
        roll2 = None
        if update and cached is not None:  # the weight's deferred amax, rolled in the producer's launch
            roll2 = (histories[1], cached[0][2])
            cached = ((*cached[0][:2], None), cached[1])
        self._weight = cached
        return Float8Emit(
            "delayed", e4m3, store_t=grad and consumer.weight.requires_grad, history=histories[0],
            margin=recipe.margin, update=update, counter=consumer.fp8_counters()[0:1], roll2=roll2,
        )  # fmt: skip

    def record(self, y: torch.Tensor, x_fp8: Float8Input) -> None:
        """Keep the cast the producer's forward made of its output ``y``."""
        self._emission = _Emission(weakref.ref(y), y._version, x_fp8, self._weight)
        self._weight = None

    def take(self, consumer: nn.Module, x: torch.Tensor) -> tuple[Float8Input, tuple | None] | None:
        """``(x_fp8, (weight_fp8, weight_fp8_t) or None)`` for ``consumer`` if it is the module
        this hand-off was set up for and ``x`` is the producer's last output, unchanged (once);
        else None."""
        emission = self._emission
        if emission is None or consumer is not self.consumer:
            return None
        self._emission = None
        if not is_the_output(consumer, x, emission.y, emission.version, "producer", "tkern.nn.float8_emit"):
            return None
        return emission.x_fp8, emission.weight


def route_float8_emit(block: nn.Module) -> None:
    """Give the layers of ``block`` (a transformers class in :data:`FLOAT8_EMIT_RULES`) the
    GEMM-to-GEMM fp8 hand-off, where both are fp8 layers of a tensorwise or delayed recipe
    and the block runs tkern's fused forward (tkern.nn.fusion; convert_network's
    ``fuse_activations``). convert_network runs it after the block's children are converted."""
    from tkern.nn.fusion import FusedMLPForward  # fusion imports the fp8 layers: no cycle at import

    kind = type(block)
    rules = FLOAT8_EMIT_RULES.get(kind.__name__)
    if rules is None or not kind.__module__.startswith("transformers."):
        return
    if not isinstance(block.__dict__.get("forward"), FusedMLPForward):
        return
    for rule in rules:
        producer, consumer = resolve(block, rule.producer), resolve(block, rule.consumer)
        if (
            not isinstance(producer, Float8Layer)
            or not isinstance(consumer, Float8Layer)
            or "fp8_emitter" in producer.__dict__
            or "fp8_producer" in consumer.__dict__
            or producer.recipe.scaling not in CACHED_SCALINGS
            or consumer.recipe.scaling not in CACHED_SCALINGS
        ):
            continue
        emitter = Float8GemmEmitter(producer, consumer)
        producer.fp8_emitter = emitter
        consumer.fp8_producer = emitter


def remove_float8_emit(module: nn.Module) -> None:
    """Undo :func:`route_float8_emit` on ``module`` (a producer or a consumer)."""
    module.__dict__.pop("fp8_emitter", None)
    if isinstance(module.__dict__.get("fp8_producer"), Float8GemmEmitter):
        del module.__dict__["fp8_producer"]
