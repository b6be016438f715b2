"""``tkern.nn.Float8Linear`` (and GPT-2's ``Conv1D`` as ``Float8Conv1D``): fp8 GEMMs with
the scaling recipe as a small frozen object (:class:`Float8Recipe`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tkern.flat import has_grad_view
from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.float8 import check_fp8_device
from tkern.kernels.gemm_mx import check_mx_device
from tkern.nn.float8_fsdp import (
    Float8AllGatherWeight,
    Float8GatheredWeight,
    is_fp8_all_gather_weight,
    unwrap_weight,
    wrap_weight,
)
from tkern.ops.common import is_compiling
from tkern.ops.float8 import CACHED_SCALINGS, WEIGHT_CACHE_SCALINGS, float8_linear, float8_weight_cache
from tkern.ops.float8_args import recipe_formats
from tkern.ops.float8_mx import MX_GRAD_DTYPES

__all__ = ["FLOAT8_SCALINGS", "Float8Linear", "Float8Recipe", "float8_conv1d_class", "float8_forward"]


#: The scaling recipes of :class:`Float8Recipe`.
FLOAT8_SCALINGS = ("tensorwise", "delayed", "blockwise", "mxfp8")


@dataclass(frozen=True)
class Float8Recipe:
    """How a :class:`Float8Linear` scales its fp8 operands.

    Args:
        scaling: ``"tensorwise"``: each tensor's amax every step (torchao's default
            ``Float8LinearConfig()``); ``"delayed"``: Transformer Engine's
            ``DelayedScaling``, the multiplier from the max of an amax history of
            past steps; ``"blockwise"``: DeepSeek-V3's 1x128 tiles for activations
            and gradients, 128x128 blocks for weights, e4m3 everywhere; ``"mxfp8"``: MX
            blocks (one e8m0 scale per 32 elements along each GEMM's K: x and W along
            in_features forward, dY and W along out_features for dgrad, dY and x along
            the tokens for wgrad), e4m3 by default, on GPUs with native MX (Blackwell
            sm_100, MI355X gfx950); see tkern.ops.float8_mx.
        history_len: amax history length of ``"delayed"`` (16, as TE's default).
        margin: ``"delayed"``: the multiplier is fp8_max / amax x 2^-margin.
        enable_fsdp_float8_all_gather: under FSDP2 (``fully_shard``), all-gather the
            weight in fp8 (1 byte per element instead of bf16's 2), cast with the whole
            weight's tensorwise scale; results are bit-identical to casting the
            bf16-gathered weight (torchao's option of this name). ``"tensorwise"``
            only. The layer's weight becomes a
            :class:`tkern.nn.float8_fsdp.Float8AllGatherWeight`: set the recipe before
            ``fully_shard`` and before building the optimizer. See docs/fsdp.md.
        grad_dtype: ``"mxfp8"`` only: dY's fp8 format, ``torch.float8_e4m3fn`` (None, the
            default) or ``torch.float8_e5m2``.
    """

    scaling: str = "tensorwise"
    history_len: int = 16
    margin: int = 0
    enable_fsdp_float8_all_gather: bool = False
    grad_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.scaling not in FLOAT8_SCALINGS:
            raise ValueError(f"scaling must be one of {FLOAT8_SCALINGS}, got {self.scaling!r}")
        if not isinstance(self.enable_fsdp_float8_all_gather, bool):
            raise TypeError(
                f"enable_fsdp_float8_all_gather must be a bool, got {self.enable_fsdp_float8_all_gather!r}"
            )
        if self.enable_fsdp_float8_all_gather and self.scaling != "tensorwise":
            raise ValueError(
                f'enable_fsdp_float8_all_gather needs scaling="tensorwise" (one scale per weight, found '
                f'from the whole weight), got scaling="{self.scaling}"'
            )
        if self.grad_dtype is not None:
            if self.scaling != "mxfp8":
                raise ValueError(f'grad_dtype is the "mxfp8" recipe\'s option, got scaling="{self.scaling}"')
            if self.grad_dtype not in MX_GRAD_DTYPES:
                raise TypeError(
                    f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.grad_dtype}"
                )
        for name, low in (("history_len", 1), ("margin", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    @classmethod
    def of(cls, recipe: str | Float8Recipe) -> Float8Recipe:
        """A recipe from its name or itself."""
        if isinstance(recipe, cls):
            return recipe
        if isinstance(recipe, str):
            return cls(scaling=recipe)
        raise TypeError(f"recipe must be a Float8Recipe or one of {FLOAT8_SCALINGS}, got {recipe!r}")


def _dtensor_class() -> type:
    """torch's DTensor class (a class nothing is an instance of without torch.distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return type("NoDTensor", (), {})
    return DTensor


#: Delayed scaling's amax histories: buffers of the module (saved with its state_dict).
_HISTORIES = ("fp8_amax_history_input", "fp8_amax_history_weight", "fp8_amax_history_grad_output")
#: Delayed scaling's (3,) int32 launch counters (a non-persistent buffer).
_COUNTERS = "fp8_cast_counters"


class Float8Layer:
    """What the fp8 layers share (mixed in before their torch class): the recipe
    and its device state, and the forward on :func:`tkern.ops.float8.float8_linear`."""

    recipe: Float8Recipe

    def set_recipe(self, recipe: Float8Recipe) -> None:
        if not isinstance(recipe, Float8Recipe):
            raise TypeError(f"recipe must be a Float8Recipe, got {recipe!r}")
        weight = self.weight
        if recipe.scaling == "mxfp8":  # first: on a GPU without MX, that is the reason
            check_mx_device(weight.device)
        formats = recipe_formats(recipe.scaling, weight.device)  # FNUZ on a gfx942
        check_fp8_device(weight.device, f"{type(self).__name__}({recipe.scaling!r})", formats)
        if recipe.enable_fsdp_float8_all_gather != is_fp8_all_gather_weight(weight):
            if isinstance(weight, _dtensor_class()):
                raise ValueError(
                    "enable_fsdp_float8_all_gather is set before fully_shard and cannot change after it: "
                    "this layer's weight is already a DTensor"
                )
            if has_grad_view(weight):
                raise ValueError(
                    "enable_fsdp_float8_all_gather replaces this layer's weight Parameter, which a tkern "
                    "fused optimizer already holds (it would go on stepping the old one): set the recipe "
                    "before building the optimizer"
                )
            wrap = wrap_weight if recipe.enable_fsdp_float8_all_gather else unwrap_weight
            self.weight = wrap(weight)
        self.recipe = recipe
        for name in _HISTORIES:
            if recipe.scaling == "delayed":
                if name not in self._buffers:
                    self.register_buffer(
                        name, torch.zeros(recipe.history_len, dtype=torch.float32, device=self.weight.device)
                    )
            elif name in self._buffers:
                del self._buffers[name]
        if recipe.scaling == "delayed":
            if _COUNTERS not in self._buffers:
                # the three casts count their finished programs here (each leaves it at zero):
                # not state, not saved
                counters = torch.zeros(3, dtype=torch.int32, device=self.weight.device)
                self.register_buffer(_COUNTERS, counters, persistent=False)
        elif _COUNTERS in self._buffers:
            del self._buffers[_COUNTERS]
        self._register_weight_cache()

    def _register_weight_cache(self) -> None:
        """Let a fused optimizer's step write the weight's cast (Float8WeightCache).

        Tensorwise, delayed and mxfp8 (its two casts). Blockwise is left out: issue 17 asks for the
        two per-tensor recipes; the (128, 128)-block cast also depends on the weight
        alone and could be cached the same way, but a Float8Conv1D's stored weight
        is the transpose of the GEMM operand, so its block scales would have to be
        transposed with it (not done yet)."""
        scaling = self.recipe.scaling
        if scaling not in WEIGHT_CACHE_SCALINGS or self.recipe.enable_fsdp_float8_all_gather:
            float8_weight_cache(self.weight, register=False)
            return
        history = None
        if scaling == "delayed":
            # weakly: the cache lives as long as the weight, and must not keep the module alive
            module = weakref.ref(self)

            def history() -> torch.Tensor | None:
                m = module()
                return None if m is None else m._buffers.get(_HISTORIES[1])

        float8_weight_cache(
            self.weight, register=True, scaling=scaling, history=history, margin=self.recipe.margin
        )

    @staticmethod
    def _gemm_view(weight: torch.Tensor) -> torch.Tensor:
        """The stored weight as the GEMM's (N, K) operand."""
        return weight

    @staticmethod
    def _gemm_casts(data: torch.Tensor, data_t: torch.Tensor | None) -> tuple:
        """(W's cast (N, K), W^T's (K, N)) from the cast of the stored weight and its transpose."""
        return data, data_t

    def fp8_histories(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``"delayed"``: the (input, weight, grad_output) amax histories (buffers); else None."""
        if self.recipe.scaling != "delayed":
            return None
        buffers = self._buffers
        return buffers[_HISTORIES[0]], buffers[_HISTORIES[1]], buffers[_HISTORIES[2]]

    def fp8_counters(self) -> torch.Tensor | None:
        """``"delayed"``: the (3,) int32 launch counters of the input, weight and grad casts."""
        return self._buffers.get(_COUNTERS) if self.recipe.scaling == "delayed" else None

    def gemm_in_features(self) -> int:
        """K of the layer's GEMM: the width of the input it takes."""
        return self._gemm_view(self.weight).shape[1]

    def gemm_out_features(self) -> int:
        """N of the layer's GEMM: the width of its output."""
        return self._gemm_view(self.weight).shape[0]

    def cached_weight_fp8(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
        """The optimizer's cast of the weight if a forward now may use it (Float8WeightCache):
        ``(weight_fp8, weight_fp8_t)`` as :func:`~tkern.ops.float8.float8_linear` takes them,
        W's cast and W^T's (both K-major), or None (eager only: a compiled graph casts)."""
        if is_compiling():
            return None
        return self._cached_cast(self.weight, self.fp8_histories())

    def _cached_cast(self, weight: torch.Tensor, histories: tuple | None) -> tuple | None:
        """:meth:`cached_weight_fp8` of ``weight`` (``self.weight``) with ``histories``
        (:meth:`fp8_histories`), found by the caller (the forward has both)."""
        cache = float8_weight_cache(weight)
        cached = None if cache is None else cache.lookup(weight, histories and histories[1])
        if cached is None:
            return None
        if cache.scaling == "mxfp8":  # (W along K, W^T along N), swapped for Conv1D as the data
            (wq, sw), (wq_t, sw_t) = self._gemm_casts(cached, (cache.data_t, cache.scale_t))
            return (wq, sw, sw_t), wq_t
        wq, weight_fp8_t = self._gemm_casts(cached[0], cache.data_t)
        return (wq, *cached[1:]), weight_fp8_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_forward(self, x)

    def takes_activation(self) -> bool:
        """Whether :func:`float8_forward` can run an activation in this layer's GEMM
        epilogue now: a per-tensor recipe and a bf16 / fp16 weight (float8_linear's
        ``activation``)."""
        return self.recipe.scaling in CACHED_SCALINGS and self.weight.dtype in HALF_DTYPES

    def _forward(self, x: torch.Tensor, activation: str | None) -> torch.Tensor:
        recipe = self.recipe
        if recipe.enable_fsdp_float8_all_gather:
            return self._forward_fp8_gathered(x, activation)
        # each looked up once per call: the forward's host time (benchmarks/bench_host.py)
        stored = self.weight
        delayed = recipe.scaling == "delayed"
        histories = self.fp8_histories() if delayed else None
        x_fp8 = cached = emitter = emit = None
        eager = not is_compiling()
        if eager:  # eager only: a compiled graph casts x and the weight itself
            # x's cast made by its producer (a norm, tkern.nn.float8_norm; a GEMM, tkern.nn.float8_emit),
            # used only if x is its output
            producer = self.__dict__.get("fp8_producer")
            handoff = None if producer is None else producer.take(self, x)
            x_fp8, cached = (None, self._cached_cast(stored, histories)) if handoff is None else handoff
        weight = self._gemm_view(stored)
        if x.is_floating_point() and x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        if eager:  # the next layer's input cast, made by this GEMM's epilogue
            emitter = self.__dict__.get("fp8_emitter")
            emit = None if emitter is None else emitter.spec(x, activation)
        weight_fp8, weight_fp8_t = (None, None) if cached is None else cached
        out = float8_linear(
            x, weight, self.bias, scaling=recipe.scaling, margin=recipe.margin,
            update=self.training and torch.is_grad_enabled(), histories=histories,
            weight_fp8=weight_fp8, weight_fp8_t=weight_fp8_t,
            counters=self._buffers.get(_COUNTERS) if delayed else None, x_fp8=x_fp8, activation=activation,
            emit_fp8=emit, **({"grad_dtype": recipe.grad_dtype} if recipe.grad_dtype is not None else {}),
        )  # fmt: skip
        if emit is None:
            return out
        emitter.record(*out)
        return out[0]

    def _forward_fp8_gathered(self, x: torch.Tensor, activation: str | None) -> torch.Tensor:
        """Under ``enable_fsdp_float8_all_gather``: the weight is FSDP2's fp8-gathered
        one (its data and scale go to the GEMMs as they are) or, outside FSDP2, the
        whole high-precision weight, cast here (tensorwise, as without the option)."""
        w = self.weight
        if isinstance(w, Float8AllGatherWeight):
            weight, cast = self._gemm_view(w.high_precision()), None
        elif isinstance(w, Float8GatheredWeight):
            weight = self._gemm_view(w)
            cast = weight.fp8()
        else:
            raise TypeError(
                f"{type(self).__name__} with enable_fsdp_float8_all_gather holds a weight of type "
                f"{type(w).__name__}, not a Float8AllGatherWeight or FSDP2's fp8-gathered weight "
                "(a DTensor here: the forward ran outside FSDP2's unshard)"
            )
        if x.is_floating_point() and x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        return float8_linear(
            x, weight, self.bias, scaling="tensorwise", weight_fp8=cast, activation=activation
        )

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # a copy's weight is a new Parameter: it gets its own fp8 weight cache
        self._register_weight_cache()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, *args):
        before = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *args)
        # a checkpoint of a plain Linear has no histories: keep ours, load strictly
        kept = [k for k in missing_keys[before:] if k.removeprefix(prefix) in _HISTORIES]
        for k in kept:
            missing_keys.remove(k)


def float8_forward(module: Float8Layer, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """``module``'s forward (a :class:`Float8Linear` or ``Float8Conv1D``) with ``activation``
    in its fp8 GEMM's epilogue: the one a fused activation module after it computes
    (GPT-2's MLP: :mod:`tkern.nn.fusion`). The pre-activation is kept for the backward,
    which applies act' to dY before its fp8 cast; see :func:`~tkern.ops.float8.float8_linear`."""
    return module._forward(x, activation)


class Float8Linear(Float8Layer, nn.Linear):
    """``nn.Linear`` whose GEMMs run in fp8 with per-tensor (or per-block) scales.

    Parameters have ``nn.Linear``'s names, shapes, state_dict keys and
    initialisation (drawn in fp32, then cast to ``dtype``). Forward: x and W cast
    to e4m3 (:func:`tkern.to_float8`), one :func:`tkern.scaled_mm` with the bias
    in its epilogue, output in ``dtype``; x and W are saved for backward in fp8
    (half the activation memory of bf16). Backward: the output gradient cast to
    e5m2 (e4m3 under ``"blockwise"``), dgrad and wgrad as fp8 GEMMs.

    Under ``"delayed"`` the module holds three fp32 amax histories (input,
    weight, output gradient) as buffers, saved and restored with its state_dict
    (a resumed run is bit-exact); a plain checkpoint without them loads with
    ``strict=True`` (the histories are then kept as they are). The histories are
    updated only in training with grad mode on; in ``eval()`` or under
    ``torch.no_grad()`` the module casts with them and leaves them unchanged.

    Args:
        in_features, out_features, bias: as ``nn.Linear``; both features
            multiples of 16 suit the fp8 tensor cores.
        dtype: the params' (and output's) dtype: bf16 (default), fp16 or fp32.
        recipe: a :class:`Float8Recipe` or its scaling's name.
        device: where the parameters live.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype = torch.bfloat16,
        recipe: str | Float8Recipe = "tensorwise",
        device: torch.device | str | None = None,
    ) -> None:
        if dtype not in (*HALF_DTYPES, torch.float32):
            raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
        recipe = Float8Recipe.of(recipe)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self.to(dtype)
        self.set_recipe(recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtype={self.weight.dtype}, recipe={self.recipe}"


_FLOAT8_CONV1D: type | None = None


def float8_conv1d_class(create: bool = True) -> type | None:
    """``tkern.nn.Float8Conv1D``: transformers' GPT-2 ``Conv1D`` as a :class:`Float8Linear`,
    made on first use and found by pickle as ``tkern.nn.Float8Conv1D``. ``create=False``:
    None until then."""
    global _FLOAT8_CONV1D
    if _FLOAT8_CONV1D is None and create:
        from transformers.pytorch_utils import Conv1D as HFConv1D

        _FLOAT8_CONV1D = type(
            "Float8Conv1D",
            (Float8Layer, HFConv1D),
            {
                "__module__": "tkern.nn",
                "__qualname__": "Float8Conv1D",
                "__doc__": "transformers' GPT-2 ``Conv1D`` (weight stored (in, out)) as a "
                ":class:`Float8Linear`: the same fp8 GEMMs and recipes on the transposed weight, "
                "read in place; same parameters, names, shapes and state_dict keys.",
                "_gemm_view": staticmethod(torch.Tensor.t),
                # the stored (in, out) weight is W^T: its cast is W^T's, its transpose W's
                "_gemm_casts": staticmethod(lambda data, data_t: (data_t, data)),
                "extra_repr": lambda self: f"nf={self.nf}, dtype={self.weight.dtype}, recipe={self.recipe}",
            },
        )
    return _FLOAT8_CONV1D
