"""Modules built on tkern's kernels, and convert_network."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from tkern.functional import CACHED_SCALINGS, float8_linear, float8_weight_cache, linear
from tkern.kernels._common import HALF_DTYPES
from tkern.kernels.activation import check_activation

# and Conv1D, Float8Conv1D where transformers is installed
__all__ = ["Float8Linear", "Float8Recipe", "Linear", "convert_network"]


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`tkern.linear` (fp32-accumulated GEMMs,
    bias and activation fused into the GEMM's epilogue).

    Parameters have the names and the initialisation of ``nn.Linear``: they are
    drawn in fp32 exactly as ``nn.Linear`` draws them, then cast to ``dtype``.
    A floating-point input of another dtype is cast to the weight's dtype first,
    as ``torch.autocast`` would. ``in_features=0`` gives ``act(bias)``, as
    ``nn.Linear``; on the meta device the forward returns a meta tensor of the
    right shape and dtype.

    Args:
        in_features: K.
        out_features: N.
        bias: whether to learn an additive bias.
        activation: None, ``"relu"`` or ``"gelu"``, fused into the epilogue.
        dtype: fp16 (default) or bf16.
        device: where the parameters live.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        check_activation(activation)
        if dtype not in HALF_DTYPES:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        with warnings.catch_warnings():
            # nn.Linear(0, n) warns that initialising its empty weight does nothing; so does ours
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self.to(dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_forward(self, x, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}, dtype={self.weight.dtype}"


def _linear_forward(module: Linear, x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``module``'s forward with ``activation`` in the GEMM's epilogue (its own, or
    the one a fused activation module after it computes: see :class:`_FusedSequentialForward`)."""
    weight = module.weight
    if x.is_floating_point() and x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    return linear(x, weight, module.bias, activation)


#: The scaling recipes of :class:`Float8Recipe`.
FLOAT8_SCALINGS = ("tensorwise", "delayed", "blockwise")


@dataclass(frozen=True)
class Float8Recipe:
    """How a :class:`Float8Linear` scales its fp8 operands.

    Args:
        scaling: ``"tensorwise"``: each tensor's amax every step (torchao's default
            ``Float8LinearConfig()``); ``"delayed"``: Transformer Engine's
            ``DelayedScaling``, the multiplier from the max of an amax history of
            past steps; ``"blockwise"``: DeepSeek-V3's 1x128 tiles for activations
            and gradients, 128x128 blocks for weights, e4m3 everywhere.
        history_len: amax history length of ``"delayed"`` (16, as TE's default).
        margin: ``"delayed"``: the multiplier is fp8_max / amax x 2^-margin.
    """

    scaling: str = "tensorwise"
    history_len: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in FLOAT8_SCALINGS:
            raise ValueError(f"scaling must be one of {FLOAT8_SCALINGS}, got {self.scaling!r}")
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


#: Delayed scaling's amax histories: buffers of the module (saved with its state_dict).
_HISTORIES = ("fp8_amax_history_input", "fp8_amax_history_weight", "fp8_amax_history_grad_output")


class _Float8Layer:
    """What the fp8 layers share (mixed in before their torch class): the recipe
    and its device state, and the forward on :func:`tkern.functional.float8_linear`."""

    recipe: Float8Recipe

    def _set_recipe(self, recipe: Float8Recipe) -> None:
        self.recipe = recipe
        for name in _HISTORIES:
            if recipe.scaling == "delayed":
                if name not in self._buffers:
                    self.register_buffer(
                        name, torch.zeros(recipe.history_len, dtype=torch.float32, device=self.weight.device)
                    )
            elif name in self._buffers:
                del self._buffers[name]
        self._register_weight_cache()

    def _register_weight_cache(self) -> None:
        """Let a fused optimizer's step write the weight's cast (Float8WeightCache).

        Tensorwise and delayed only. Blockwise is left out: issue 17 asks for the
        two per-tensor recipes; the (128, 128)-block cast also depends on the weight
        alone and could be cached the same way, but a Float8Conv1D's stored weight
        is the transpose of the GEMM operand, so its block scales would have to be
        transposed with it (not done yet)."""
        scaling = self.recipe.scaling
        if scaling not in CACHED_SCALINGS:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._gemm_view(self.weight)
        if x.is_floating_point() and x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        delayed = self.recipe.scaling == "delayed"
        histories = tuple(getattr(self, n) for n in _HISTORIES) if delayed else None
        # the optimizer's cast of the weight (eager only: a compiled graph casts in the forward)
        cache = None if torch.compiler.is_compiling() else float8_weight_cache(self.weight)
        cached = None if cache is None else cache.lookup(self.weight, histories[1] if delayed else None)
        return float8_linear(
            x, weight, self.bias, scaling=self.recipe.scaling, margin=self.recipe.margin,
            update=self.training and torch.is_grad_enabled(), histories=histories,
            weight_fp8=None if cached is None else (self._gemm_view(cached[0]), *cached[1:]),
        )  # fmt: skip

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


class Float8Linear(_Float8Layer, nn.Linear):
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
        self._set_recipe(recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtype={self.weight.dtype}, recipe={self.recipe}"


def _conv1d_forward(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``Conv1D`` (``x @ weight + bias``, weight stored (in, out))
    on :func:`tkern.linear`: the transposed weight is read in place."""
    weight = self.weight
    if x.is_floating_point() and x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    return linear(x, weight.t(), self.bias)


def _transformers_conv1d() -> type | None:
    """transformers' ``Conv1D`` class when transformers is imported, else None
    (tkern never imports transformers itself)."""
    import sys

    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


_CONV1D: type | None = None
_FLOAT8_CONV1D: type | None = None


def __getattr__(name: str):
    # ``tkern.nn.Conv1D`` and ``Float8Conv1D`` subclass transformers' Conv1D, so they
    # exist only once transformers is importable; created on first use, found by
    # pickle by name.
    global _CONV1D, _FLOAT8_CONV1D
    if name == "Float8Conv1D":
        if _FLOAT8_CONV1D is None:
            from transformers.pytorch_utils import Conv1D as HFConv1D

            _FLOAT8_CONV1D = type(
                "Float8Conv1D",
                (_Float8Layer, HFConv1D),
                {
                    "__module__": __name__,
                    "__qualname__": "Float8Conv1D",
                    "__doc__": "transformers' GPT-2 ``Conv1D`` (weight stored (in, out)) as a "
                    ":class:`Float8Linear`: the same fp8 GEMMs and recipes on the transposed weight, "
                    "read in place; same parameters, names, shapes and state_dict keys.",
                    "_gemm_view": staticmethod(torch.Tensor.t),
                    "extra_repr": lambda self: (
                        f"nf={self.nf}, dtype={self.weight.dtype}, recipe={self.recipe}"
                    ),
                },
            )
        return _FLOAT8_CONV1D
    if name != "Conv1D":
        raise AttributeError(f"module 'tkern.nn' has no attribute {name!r}")
    if _CONV1D is None:
        from transformers.pytorch_utils import Conv1D as HFConv1D

        _CONV1D = type(
            "Conv1D",
            (HFConv1D,),
            {
                "__module__": __name__,
                "__qualname__": "Conv1D",
                "__doc__": "transformers' GPT-2 ``Conv1D`` (a Linear with a transposed weight) "
                "whose forward runs on :func:`tkern.linear`; same parameters, names and shapes.",
                "forward": _conv1d_forward,
            },
        )
    return _CONV1D


#: Normalization layers: kept in fp32 (parameters and running statistics), run
#: on their input cast to fp32, their output cast back (the apex/fastai rule).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

#: Modules with parameters or buffers that run correctly once cast to fp16/bf16.
#: Their floating-point inputs are cast to that dtype first, as autocast would.
CASTABLE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.modules.conv._ConvNd,
    nn.PReLU,
)


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (nested in tuples,
    lists and dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class _CastInputs:
    """Forward pre-hook: cast the floating-point positional and keyword inputs to
    ``dtype``. A module-level class, so converted models pickle and deepcopy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)

    def __repr__(self) -> str:
        return f"tkern.nn._CastInputs({self.dtype})"


class _CastOutput:
    """Forward hook: cast the floating-point outputs to ``dtype`` (picklable)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, output):
        return _cast_floats(output, self.dtype)

    def __repr__(self) -> str:
        return f"tkern.nn._CastOutput({self.dtype})"


# --------------------------------------------------------------------------- activation fusion


def _epilogue_activation(module: nn.Module) -> str | None:
    """The GEMM epilogue's name for the activation ``module`` computes, or None.

    Exact types only (a subclass may compute something else). ``ReLU(inplace=True)``
    too: the Linear's output it would overwrite is a fresh tensor nobody else holds.
    GELU's tanh form and SiLU are not in the epilogue (yet), so they run unfused."""
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.GELU and module.approximate == "none":
        return "gelu"
    return None


def _runs_more_than_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` would run more than its class's forward: the test
    ``nn.Module.__call__`` makes (the module's own hooks and the global ones), or a
    forward replaced on the instance."""
    hooked = (
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_forward_hooks
        or _torch_module._global_backward_pre_hooks
        or _torch_module._global_backward_hooks
    )
    return bool(hooked) or "forward" in module.__dict__


def _fusable(first: nn.Module, second: nn.Module) -> str | None:
    """The activation to run in ``first``'s GEMM epilogue in place of calling
    ``second`` on its output, or None: ``first`` a :class:`Linear` without an
    activation of its own, ``second`` an activation the epilogue computes, and
    neither with anything (a hook, a patched forward) that would see the difference."""
    if type(first) is not Linear or first.activation is not None:
        return None
    activation = _epilogue_activation(second)
    if activation is None or _runs_more_than_forward(first) or _runs_more_than_forward(second):
        return None
    return activation


class _FusedSequentialForward:
    """The forward of an ``nn.Sequential`` converted with ``fuse_activations``.

    ``nn.Sequential.forward``, except that a :class:`Linear` directly followed by
    an activation module the GEMM epilogue computes runs as one GEMM with that
    activation in its epilogue (the same values: see :func:`convert_network`),
    and the activation module is not called. Decided on every call from the
    modules as they are then: a hook put on either module later, a global module
    hook, or a module replaced, gets the plain path for that pair, each module
    called in turn with every hook firing on the values it would see unfused.

    Stored as the container's instance ``forward``: names, ``state_dict`` and
    ``print(model)`` are unchanged. A module-level class, so the model pickles
    and deep-copies (the copy routes its own modules)."""

    def __init__(self, sequential: nn.Sequential) -> None:
        self.sequential = sequential

    def __call__(self, input):  # noqa: A002 (nn.Sequential.forward's argument name)
        modules = list(self.sequential)
        i = 0
        while i < len(modules):
            module = modules[i]
            activation = _fusable(module, modules[i + 1]) if i + 1 < len(modules) else None
            if activation is None:
                input = module(input)
                i += 1
            else:
                input = _linear_forward(module, input, activation)
                i += 2
        return input

    def __repr__(self) -> str:
        return "tkern.nn._FusedSequentialForward()"


def _route_fusion(module: nn.Module) -> None:
    """Give ``module`` the fused forward if it is an ``nn.Sequential`` (or a subclass
    that keeps its forward) holding a :class:`Linear` directly followed by an
    activation the epilogue computes. Hooks are looked at on every call, not here."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return  # another forward: which output feeds what is not provable from the structure
    if "forward" in module.__dict__:
        return  # the user's own replacement forward
    children = list(module)
    pairs = zip(children, children[1:], strict=False)
    if any(type(a) is Linear and a.activation is None and _epilogue_activation(b) for a, b in pairs):
        module.forward = _FusedSequentialForward(module)


def _remove_tkern_hooks(module: nn.Module) -> None:
    """Remove the hooks and the fused forward a previous convert_network put on
    ``module`` (and only those)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, (_CastInputs, _CastOutput))]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
                getattr(module, extra, {}).pop(key, None)
    if isinstance(module.__dict__.get("forward"), _FusedSequentialForward):
        del module.forward


def _cast_own(module: nn.Module, dtype: torch.dtype, buffers: bool = True) -> None:
    """Cast ``module``'s own floating-point parameters and (with ``buffers``) buffers
    (not its children's) to ``dtype`` in place: each Parameter stays the same object,
    so parameters shared with other modules (tied weights) stay shared."""
    for p in module._parameters.values():
        if p is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in module._buffers.items() if buffers else ():
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            module._buffers[name] = b.to(dtype)


def _cast_tree(module: nn.Module, dtype: torch.dtype) -> None:
    for m in module.modules():
        _cast_own(m, dtype)


def _run_in_fp32(module: nn.Module, dtype: torch.dtype) -> None:
    """Keep ``module`` in fp32: its inputs are cast to fp32 and its outputs to ``dtype``."""
    _cast_tree(module, torch.float32)
    module.register_forward_pre_hook(_CastInputs(torch.float32), with_kwargs=True)
    module.register_forward_hook(_CastOutput(dtype))


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def _is_hf_conv1d(module: nn.Module) -> bool:
    hf = _transformers_conv1d()
    return hf is not None and type(module) is hf


def _check_convertible_back(model: nn.Module) -> None:
    for path, m in model.named_modules():
        if isinstance(m, Linear) and m.activation is not None:
            raise ValueError(
                f"convert_network(model, torch.float32): {path or 'the model'} is a tkern.nn.Linear with "
                f"activation={m.activation!r} fused in, which nn.Linear cannot express; nothing was changed"
            )


def _convert_back(module: nn.Module) -> None:
    """Undo :func:`convert_network`: plain fp32 modules, tkern's hooks removed."""
    for m in module.modules():
        _remove_tkern_hooks(m)
        if type(m) is Linear:
            del m.activation
            m.__class__ = nn.Linear
        elif type(m) is Float8Linear:
            m._set_recipe(Float8Recipe())  # drops delayed scaling's histories
            float8_weight_cache(m.weight, register=False)
            del m.recipe
            m.__class__ = nn.Linear
        elif _CONV1D is not None and type(m) is _CONV1D:
            m.__class__ = _CONV1D.__bases__[0]
        elif _FLOAT8_CONV1D is not None and type(m) is _FLOAT8_CONV1D:
            m._set_recipe(Float8Recipe())  # drops delayed scaling's histories
            float8_weight_cache(m.weight, register=False)
            del m.recipe
            m.__class__ = _FLOAT8_CONV1D.__bases__[1]
    _cast_tree(module, torch.float32)


def convert_network(
    model: nn.Module,
    dtype: torch.dtype = torch.float16,
    *,
    float8: str | Float8Recipe | None = None,
    float8_filter: Callable[[str, nn.Module], bool] | None = None,
    fuse_activations: bool = True,
) -> nn.Module:
    """Convert ``model`` in place for mixed-precision training, and return it.

    * every ``nn.Linear`` becomes a :class:`tkern.nn.Linear` (and transformers'
      GPT-2 ``Conv1D`` a :class:`tkern.nn.Conv1D`) with the same parameters in
      ``dtype``: the Parameter objects are kept (cast in place), so names,
      shapes, hooks and weights shared between modules (an output layer tied to
      an embedding) stay as they were;
    * normalization layers (:data:`NORM_TYPES`) keep fp32 parameters and
      statistics and run on their input cast to fp32, returning ``dtype``;
    * other modules that own parameters or buffers and are known to run in
      half precision (:data:`CASTABLE_TYPES`: embeddings, convolutions) are cast
      to ``dtype`` and get their floating-point inputs cast to ``dtype``, as
      autocast would (an fp32 image into a converted CNN works);
      modules that own none (activations, dropout, containers) need nothing;
    * any other module that owns parameters or buffers keeps its own tensors in
      fp32; a leaf of that kind also runs on inputs cast to fp32 with its output
      cast to ``dtype``, while the children of one that has children are still
      converted. One warning per module type names the modules affected.

    Converting twice is the same as converting once. ``dtype=torch.float32``
    converts back: plain ``nn.Linear`` (and ``Conv1D``) modules, every parameter
    and buffer in fp32, tkern's hooks and fused forwards removed.

    Every hook is an instance of a module-level class, so a converted model can
    be pickled (``torch.save(model)``) and deep-copied.

    With ``float8`` (a recipe name or a :class:`Float8Recipe`; bf16 is its natural
    ``dtype``), every ``nn.Linear`` whose in and out features are multiples of 16
    becomes a :class:`Float8Linear` of that recipe instead (same Parameter
    objects, in ``dtype``), unless ``float8_filter(name, module)`` returns False
    for it (as torchao's ``module_filter_fn``: True converts; e.g. keep an LM
    head out). The other Linears become :class:`tkern.nn.Linear` as without it.
    GPT-2 ``Conv1D`` layers (weight stored (in, out)) become ``tkern.nn.Float8Conv1D``
    under the same rule: the fp8 GEMMs read the transposed weight in place; same
    parameters, names and state_dict keys.

    With ``fuse_activations`` (the default), an ``nn.Sequential`` (or a subclass
    that keeps its forward) in which a :class:`tkern.nn.Linear` is directly
    followed by ``nn.ReLU`` (``inplace`` or not) or ``nn.GELU()`` (erf form) runs
    that activation in the Linear's GEMM epilogue: one kernel, no separate pass
    over the output, and the activation's gradient taken from the pre-activation
    the GEMM saves. The modules stay as they were (types, names, state_dict keys,
    ``print(model)``); the container gets an instance ``forward`` that decides on
    every call, so a pair where either module has a hook (its own or a global
    one; registered before ``torch.compile``, as compile requires of any hook)
    runs unfused, each hook seeing the values it would see without fusion. ReLU
    gives the same numbers as unfused; GELU rounds once fewer (the epilogue applies
    it to the fp32 accumulator, the module to the pre-activation rounded to
    ``dtype``). A Linear whose output is used in a forward tkern cannot see
    (any other container or module) is not fused; nor are GELU's tanh form, SiLU,
    or :class:`Float8Linear`.

    Args:
        model: the model (fp32, or converted before).
        dtype: torch.float16 (default) or torch.bfloat16; torch.float32 to convert back.
        float8: None, ``"tensorwise"``, ``"delayed"``, ``"blockwise"`` or a Float8Recipe.
        float8_filter: ``(fully qualified name, module) -> bool``; None converts all.
        fuse_activations: fold ReLU/GELU modules into the preceding Linear's GEMM.

    Raises:
        TypeError: ``model`` is not a module, or is a bare ``nn.Linear`` (it
            cannot be replaced in place; wrap it), or ``dtype`` is another dtype,
            or ``fuse_activations`` is not a bool.
        ValueError: converting back a :class:`tkern.nn.Linear` with a fused
            activation (nothing is changed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype not in (*HALF_DTYPES, torch.float32):
        raise TypeError(
            f"dtype must be torch.float16 or torch.bfloat16 (or torch.float32 to convert back), got {dtype}"
        )
    if type(model) is nn.Linear:
        raise TypeError("model is a bare nn.Linear, which cannot be replaced in place; wrap it in a module")
    recipe = None if float8 is None else Float8Recipe.of(float8)
    if not isinstance(fuse_activations, bool):
        raise TypeError(f"fuse_activations must be True or False, got {fuse_activations!r}")
    if float8_filter is not None and not callable(float8_filter):
        raise TypeError(f"float8_filter must be callable (name, module) -> bool, got {float8_filter!r}")
    if dtype == torch.float32:
        if recipe is not None:
            raise ValueError("float8 needs dtype torch.bfloat16 or torch.float16, not torch.float32")
        _check_convertible_back(model)
        _convert_back(model)
        return model

    def to_float8(module: nn.Module, path: str) -> bool:
        # features from the weight: (out, in) for a Linear, (in, out) for a Conv1D
        return (
            recipe is not None
            and module.weight.shape[0] % 16 == 0
            and module.weight.shape[1] % 16 == 0
            and (float8_filter is None or bool(float8_filter(path, module)))
        )

    kept: dict[type, list[str]] = {}

    def convert(module: nn.Module, path: str) -> None:
        _remove_tkern_hooks(module)  # converting again replaces, never stacks, the hooks
        if type(module) in (nn.Linear, Float8Linear) and to_float8(module, path):
            module.__class__ = Float8Linear
            _cast_own(module, dtype, buffers=False)  # delayed scaling's histories stay fp32
            module._set_recipe(recipe)
        elif isinstance(module, Float8Linear):
            _cast_own(module, dtype, buffers=False)
        elif type(module) is nn.Linear:
            module.__class__ = Linear
            module.activation = None
            _cast_own(module, dtype)
        elif isinstance(module, Linear):
            _cast_own(module, dtype)
        elif _is_hf_conv1d(module) or type(module) in (_CONV1D, _FLOAT8_CONV1D):
            if to_float8(module, path):
                module.__class__ = __getattr__("Float8Conv1D")
                _cast_own(module, dtype, buffers=False)
                module._set_recipe(recipe)
            elif type(module) is not _FLOAT8_CONV1D:
                module.__class__ = __getattr__("Conv1D")
                _cast_own(module, dtype)
            else:
                _cast_own(module, dtype, buffers=False)
        elif isinstance(module, CASTABLE_TYPES):
            _cast_tree(module, dtype)
            module.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True)
        elif isinstance(module, NORM_TYPES):
            _run_in_fp32(module, dtype)
        else:
            children = list(module.named_children())
            if _owns_tensors(module):
                kept.setdefault(type(module), []).append(path or "the model")
                if not children:
                    _run_in_fp32(module, dtype)
                    return
                _cast_own(module, torch.float32)
            for name, child in children:
                convert(child, f"{path}.{name}" if path else name)
            if fuse_activations:
                _route_fusion(module)

    convert(model, "")
    for cls, paths in kept.items():
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        verb = "is" if len(paths) == 1 else "are"
        warnings.warn(
            f"convert_network: {shown} ({cls.__name__}) {verb} not a type tkern knows to run in {dtype}; "
            "its own parameters and buffers are kept in fp32 (a leaf module runs on its inputs cast "
            "to fp32, a module with children has its children converted)",
            stacklevel=2,
        )
    return model
