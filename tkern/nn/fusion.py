"""Activation fusion (see :func:`tkern.convert_network`):

* an ``nn.Sequential``'s Linear directly followed by ReLU, SiLU or GELU runs that
  activation in the Linear's GEMM epilogue (:class:`FusedSequentialForward`);
* transformers' MLP blocks, by family (:data:`MLP_RULES`, data: which child does what),
  run their activation on tkern's kernels (:class:`FusedMLPForward`): GPT-2's
  ``c_proj(act(c_fc(x)))`` with the activation in c_fc's GEMM epilogue, Llama's
  ``down(act(gate(x)) * up(x))`` with ``act(gate) * up`` one fused kernel
  (:func:`tkern.ops.swiglu.swiglu`) and its backward in down's dgrad epilogue
  (:func:`tkern.ops.mlp.linear_glu_linear`), T5's two kinds the same way, each computed in fp32
  and rounded once, forward and backward; no torch op runs over the (tokens,
  intermediate) activation. A transformers block no rule matches that looks like an
  MLP is reported (:func:`route_mlp`: convert_network's "left eager" warning). The
  module's class, children and Parameters stay as they are: only the instance's
  ``forward`` is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from tkern.nn.float8 import Float8Layer, float8_forward
from tkern.nn.linear import Linear, compute_operands, conv1d_class, conv1d_forward, linear_forward
from tkern.ops.mlp import linear_act_linear, linear_glu_linear
from tkern.ops.swiglu import swiglu, swiglu_packed

__all__ = [
    "HF_ACTIVATIONS",
    "MLP_RULES",
    "FusedMLPForward",
    "FusedSequentialForward",
    "MLPRule",
    "epilogue_activation",
    "family_rule",
    "mlp_with_residual",
    "route_fusion",
    "route_mlp",
    "runs_more_than_forward",
]


#: ``nn.GELU.approximate`` -> the epilogue's name for that form.
_GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}

#: transformers' activation classes (``transformers.activations``, ``ACT2FN``) -> the
#: kernels' name for what they compute: ``gelu_new`` (``NewGELUActivation``), ``gelu_fast``,
#: ``gelu_accurate`` and ``gelu_pytorch_tanh`` (``GELUTanh``, once ``PytorchGELUTanh``) are
#: the tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (their
#: constants agree to fp32); ``gelu`` the erf form; ``silu`` x sigmoid(x). ``relu`` and
#: ``swish`` are torch's ``nn.ReLU`` / ``nn.SiLU``. Others (``quick_gelu``, ``gelu_10``,
#: ``relu2``, ...) have no kernel: a block using one is left eager, with a warning.
HF_ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "AccurateGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu",
    "SiLUActivation": "silu",
}


def epilogue_activation(module: nn.Module) -> str | None:
    """The kernels' name for the activation ``module`` computes, or None.

    Exact types only (a subclass may compute something else): torch's ``nn.ReLU``,
    ``nn.SiLU`` (``inplace=True`` too: the Linear's output they would overwrite is a
    fresh tensor nobody else holds), ``nn.GELU`` in either form (``approximate`` is
    "none" or "tanh"; anything else is refused by its forward, so left to it), and
    transformers' classes in :data:`HF_ACTIVATIONS`."""
    kind = type(module)
    if kind is nn.ReLU:
        return "relu"
    if kind is nn.SiLU:
        return "silu"
    if kind is nn.GELU and isinstance(module.approximate, str):
        return _GELU_FORMS.get(module.approximate)
    if kind.__module__ == "transformers.activations":
        return HF_ACTIVATIONS.get(kind.__name__)
    return None


def runs_more_than_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` would run more than its class's forward: the test
    ``nn.Module.__call__`` makes (the module's own hooks and the global ones), or a
    forward replaced on the instance."""
    return _hooked(module) or "forward" in module.__dict__


def _hooked(module: nn.Module) -> bool:
    """Whether ``nn.Module.__call__`` would run a hook around ``module``'s forward (its own
    hooks or the global ones)."""
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
    return bool(hooked)


def _is_identity(module: nn.Module) -> bool:
    """Whether calling ``module`` returns its input as it is: ``nn.Identity``, or a dropout
    in eval mode or with ``p == 0``, with nothing (a hook, a patched forward) on it."""
    if runs_more_than_forward(module):
        return False
    return type(module) is nn.Identity or (
        type(module) is nn.Dropout and (module.p == 0 or not module.training)
    )


def _fusable(first: nn.Module, second: nn.Module) -> str | None:
    """The activation to run in ``first``'s GEMM epilogue in place of calling
    ``second`` on its output, or None: ``first`` a :class:`Linear` without an
    activation of its own, ``second`` an activation the epilogue computes, and
    neither with anything (a hook, a patched forward) that would see the difference."""
    if type(first) is not Linear or first.activation is not None:
        return None
    activation = epilogue_activation(second)
    if activation is None or runs_more_than_forward(first) or runs_more_than_forward(second):
        return None
    return activation


class FusedSequentialForward:
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
                input = linear_forward(module, input, activation)
                i += 2
        return input

    def __repr__(self) -> str:
        return "tkern.nn.fusion.FusedSequentialForward()"


def route_fusion(module: nn.Module) -> None:
    """Give ``module`` the fused forward if it is an ``nn.Sequential`` (or a subclass
    that keeps its forward) holding a :class:`Linear` directly followed by an
    activation the epilogue computes. Hooks are looked at on every call, not here."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return  # another forward: which output feeds what is not provable from the structure
    if "forward" in module.__dict__:
        return  # the user's own replacement forward
    children = list(module)
    pairs = zip(children, children[1:], strict=False)
    if any(type(a) is Linear and a.activation is None and epilogue_activation(b) for a, b in pairs):
        module.forward = FusedSequentialForward(module)


# --------------------------------------------------------------------------- transformers' MLPs


@dataclass(frozen=True)
class MLPRule:
    """What one family's MLP block computes, by the names of its children.

    ``form``: ``"act"`` is ``tail(down(act(up(x))))`` (GPT-2: up ``c_fc``, down ``c_proj``,
    tail ``dropout``; ``down=None``: no second layer, as BERT's intermediate);
    ``"gated"`` is ``down(act(gate(x)) * up(x))`` (Llama); ``"packed"`` is
    ``down(act(g) * u)`` with ``g, u = up(x).chunk(2, -1)`` (Phi-3's ``gate_up_proj``).
    ``mid``: modules called between the activation (or the product) and ``down`` (T5's
    ``dropout``); ``to_down_dtype``: the input of ``down`` cast to its weight's dtype first
    (T5: ``wo`` may be kept fp32, by ``_keep_in_fp32_modules``; an int8 weight is left alone)."""

    form: str
    act: str
    up: str
    down: str | None
    gate: str | None = None
    tail: tuple[str, ...] = ()
    mid: tuple[str, ...] = ()
    to_down_dtype: bool = False


_LLAMA = MLPRule("gated", act="act_fn", up="up_proj", down="down_proj", gate="gate_proj")

#: transformers' MLP classes (by name) whose forward is exactly the rule's form: read from
#: their source (transformers 5.x; tests/test_blocks.py checks each class's forward text).
MLP_RULES: dict[str, MLPRule] = {
    "GPT2MLP": MLPRule("act", act="act", up="c_fc", down="c_proj", tail=("dropout",)),
    "PhiMLP": MLPRule("act", act="activation_fn", up="fc1", down="fc2"),
    "GPTNeoXMLP": MLPRule("act", act="act", up="dense_h_to_4h", down="dense_4h_to_h"),
    "BertIntermediate": MLPRule("act", act="intermediate_act_fn", up="dense", down=None),
    **dict.fromkeys(
        (
            "LlamaMLP",
            "MistralMLP",
            "Qwen2MLP",
            "Qwen3MLP",
            "GemmaMLP",
            "Gemma2MLP",
            "Gemma3MLP",
            "OlmoMLP",
            "GraniteMLP",
        ),
        _LLAMA,
    ),
    "Phi3MLP": MLPRule("packed", act="activation_fn", up="gate_up_proj", down="down_proj"),
    "T5DenseActDense": MLPRule("act", act="act", up="wi", down="wo", mid=("dropout",), to_down_dtype=True),
    "T5DenseGatedActDense": MLPRule(
        "gated", act="act", up="wi_1", down="wo", gate="wi_0", mid=("dropout",), to_down_dtype=True
    ),
}


def _gemm_with_activation(module: nn.Module) -> bool:
    """Whether ``module`` is a tkern GEMM layer that can take an activation in its epilogue
    (``tkern.nn.Linear`` without one of its own, ``tkern.nn.Conv1D``, or an fp8 layer,
    ``Float8Linear`` / ``Float8Conv1D``, under a per-tensor recipe with bf16 / fp16 weights)."""
    if type(module) is Linear:
        return module.activation is None
    if isinstance(module, Float8Layer):
        return module.takes_activation()
    return type(module) is conv1d_class(create=False)


def _forward_with_activation(module: nn.Module):
    """The forward of ``module`` (a layer :func:`_gemm_with_activation` accepts) that takes
    the activation for its epilogue."""
    if type(module) is Linear:
        return linear_forward
    return float8_forward if isinstance(module, Float8Layer) else conv1d_forward


def family_rule(module: nn.Module, rules: dict) -> tuple[type | None, object]:
    """``(cls, rule)``: the transformers class, ``module``'s own or a base class whose forward it
    keeps, whose name ``rules`` (a family table, by class name) holds, and its rule; else
    ``(None, None)``. Every per-family table (MLP, rotary, decoder layer) is read through it."""
    forward = type(module).forward
    for cls in type(module).__mro__:
        rule = rules.get(cls.__name__)
        if rule is not None and cls.__module__.startswith("transformers.") and cls.forward is forward:
            return cls, rule
    return None, None


def mlp_rule(module: nn.Module) -> MLPRule | None:
    """``module``'s rule in :data:`MLP_RULES` (:func:`family_rule`), or None."""
    return family_rule(module, MLP_RULES)[1]


def _why_not(module: nn.Module, rule: MLPRule) -> str | None:
    """Why ``module``'s children cannot run the rule's fused form (None: they can)."""
    act = getattr(module, rule.act, None)
    if epilogue_activation(act) is None:
        return f"its activation {type(act).__name__} is not one tkern's kernels compute"
    up = getattr(module, rule.up)
    if rule.form == "act" and not _gemm_with_activation(up):
        return f"its {rule.up} is a {type(up).__name__}, whose GEMM takes no activation{_fp8_why(up)}"
    return None


def _fp8_why(module: nn.Module) -> str:
    """Why an fp8 layer's GEMM takes no activation now (empty for other layers)."""
    if not isinstance(module, Float8Layer):
        return ""
    recipe, dtype = module.recipe.scaling, module.weight.dtype
    return f" under recipe {recipe!r} with {dtype} weights (it needs a per-tensor recipe, bf16 or fp16)"


#: Whether an "act" block whose two layers are tkern's 16-bit GEMMs (``Linear`` / ``Conv1D``)
#: runs as :func:`tkern.ops.mlp.linear_act_linear`: the activation's gradient in the second
#: layer's dgrad epilogue (no act' pass, no prologue); and a "gated" or "packed" block as
#: :func:`tkern.ops.mlp.linear_glu_linear`: the gated unit's two gradients in down's dgrad
#: epilogue (no gated-unit backward pass) and gate's and up's input gradients summed by
#: their GEMMs. False: each layer's own backward (act' or the gated unit's backward a pass
#: of its own over dH); the tests compare the two.
DGRAD_EPILOGUE = True


def _gemm_weight(module: nn.Module) -> torch.Tensor | None:
    """The (out, in) weight :func:`tkern.linear` takes for a tkern ``Linear`` without an
    activation or a tkern ``Conv1D`` (its (in, out) weight transposed in place), else None."""
    if type(module) is Linear and module.activation is None:
        return module.weight
    if type(module) is conv1d_class(create=False):
        return module.weight.t()
    return None


def _one_function_operands(mlp: nn.Module, rule: MLPRule, x: torch.Tensor, residual) -> tuple | None:
    """``(x, layers, weights)`` for one function over the block: its GEMM layers (gate, up,
    down: those the rule names, in that order), ``x`` and their weights in the compute dtype,
    where :data:`DGRAD_EPILOGUE` and the layers allow (tkern 16-bit GEMMs of one compute dtype,
    ``residual``'s too, nothing between them, nothing on a layer that would see the
    difference); else None (the caller's path)."""
    if not DGRAD_EPILOGUE or rule.down is None or rule.mid or rule.to_down_dtype:
        return None
    layers = [getattr(mlp, name) for name in (rule.gate, rule.up, rule.down) if name is not None]
    weights = [_gemm_weight(layer) for layer in layers]
    if any(w is None for w in weights) or any(map(runs_more_than_forward, layers)):
        return None
    x, first = compute_operands(layers[0], x, weights[0])
    weights = [first] + [
        compute_operands(layer, x, w)[1] for layer, w in zip(layers[1:], weights[1:], strict=True)
    ]
    if any(w.dtype != first.dtype for w in weights) or (
        residual is not None and residual.dtype != first.dtype
    ):
        return None
    return x, layers, weights


def _act_down(
    mlp: nn.Module, rule: MLPRule, x: torch.Tensor, activation: str, residual=None
) -> torch.Tensor | None:
    """``down(act(up(x)))`` (``+ residual``) as one :func:`linear_act_linear` call where
    :func:`_one_function_operands` allows, else None (the caller's path)."""
    operands = _one_function_operands(mlp, rule, x, residual)
    if operands is None:
        return None
    x, (up, down), (w1, w2) = operands
    return linear_act_linear(x, w1, up.bias, activation, w2, down.bias, residual)


def _glu_down(
    mlp: nn.Module, rule: MLPRule, x: torch.Tensor, activation: str, residual=None
) -> torch.Tensor | None:
    """``down(act(gate(x)) * up(x))`` (the "gated" form) or ``down(swiglu_packed(up(x)))`` (the
    "packed" form), ``+ residual``, as one :func:`linear_glu_linear` call where
    :func:`_one_function_operands` allows, else None (the caller's path)."""
    operands = _one_function_operands(mlp, rule, x, residual)
    if operands is None:
        return None
    x, layers, weights = operands
    w_up, b_up = (weights[1], layers[1].bias) if rule.gate is not None else (None, None)
    w_down, b_down = weights[-1], layers[-1].bias
    return linear_glu_linear(x, weights[0], layers[0].bias, w_up, b_up, activation, w_down, b_down, residual)


def _fusable_now(module: nn.Module, rule: MLPRule) -> bool:
    """Whether ``module`` runs fused on this call: its children as :func:`_why_not` wants
    them, and nothing (a hook, a patched forward) on the modules the fused form does not
    call (the activation; for the "act" form also the GEMM that takes it)."""
    if _why_not(module, rule) is not None or runs_more_than_forward(getattr(module, rule.act)):
        return False
    return rule.form != "act" or not runs_more_than_forward(getattr(module, rule.up))


def _to_weight_dtype(h: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``h`` cast to ``layer``'s weight dtype, as T5's MLPs do before ``wo`` (not to int8)."""
    weight = layer.weight
    if isinstance(weight, torch.Tensor) and h.dtype != weight.dtype and weight.dtype != torch.int8:
        return h.to(weight.dtype)
    return h


class FusedMLPForward:
    """The forward of a transformers MLP block converted with ``fuse_activations``: the
    rule's form with the activation on tkern's kernels (the GEMM epilogue, or the fused
    gated kernel), the other children called as modules (their hooks fire). Decided on
    every call, as :class:`FusedSequentialForward`: a hook put on the activation (or on
    the GEMM it would be fused into) later, or an activation replaced, runs the class's
    own forward. Stored as the instance's ``forward``; a module-level class, so the
    model pickles and deep-copies."""

    def __init__(self, mlp: nn.Module, rule: MLPRule) -> None:
        self.mlp = mlp
        self.rule = rule

    def __call__(self, x):
        mlp, rule = self.mlp, self.rule
        if not _fusable_now(mlp, rule):
            return type(mlp).forward(mlp, x)
        activation = epilogue_activation(getattr(mlp, rule.act))
        h = (_act_down if rule.form == "act" else _glu_down)(mlp, rule, x, activation)
        if h is None:  # no single function over act and down: the layers one by one
            h = self._through_down(x, activation)
        for name in rule.tail:
            h = getattr(mlp, name)(h)
        return h

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """``residual + self(x)`` with the add in down's GEMM epilogue where the block runs
        as one :func:`linear_act_linear` / :func:`linear_glu_linear` call now and its tail
        returns its input (a dropout in eval mode or with p 0), else None (nothing run)."""
        mlp, rule = self.mlp, self.rule
        if not _fusable_now(mlp, rule) or not all(_is_identity(getattr(mlp, n)) for n in rule.tail):
            return None
        activation = epilogue_activation(getattr(mlp, rule.act))
        return (_act_down if rule.form == "act" else _glu_down)(mlp, rule, x, activation, residual)

    def _through_down(self, x, activation):
        """The rule's form up to ``down``'s output (before ``tail``), layer by layer."""
        mlp, rule = self.mlp, self.rule
        up = getattr(mlp, rule.up)
        if rule.form == "act":
            h = _forward_with_activation(up)(up, x, activation)
        elif rule.form == "gated":
            h = swiglu(getattr(mlp, rule.gate)(x), up(x), activation)
        else:
            h = swiglu_packed(up(x), activation)
        for name in rule.mid:
            h = getattr(mlp, name)(h)
        if rule.down is not None:
            down = getattr(mlp, rule.down)
            if rule.to_down_dtype:
                h = _to_weight_dtype(h, down)
            h = down(h)
        return h

    def __repr__(self) -> str:
        return f"tkern.nn.fusion.FusedMLPForward({self.rule.form})"


def mlp_with_residual(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + mlp(x)``, the pre-norm block's last add, computed in the epilogue of the
    MLP's last GEMM (fp32, one rounding; no torch add over the residual stream either way:
    its gradient is the output's, passed on) where ``mlp`` is a block converted with
    ``fuse_activations`` that runs fused now, with no hook of its own
    (:meth:`FusedMLPForward.with_residual`); else ``mlp`` called as a module and the add
    a torch add."""
    forward = vars(mlp).get("forward")
    if isinstance(forward, FusedMLPForward) and not _hooked(mlp):
        y = forward.with_residual(x, residual)
        if y is not None:
            return y
    return residual + mlp(x)


#: torch's classes in ``torch.nn.modules.activation`` that are not an elementwise activation.
_NOT_ELEMENTWISE = frozenset({"Softmax", "Softmax2d", "LogSoftmax", "Softmin", "MultiheadAttention"})


def _is_activation(module: nn.Module) -> bool:
    """Whether ``module`` is an elementwise activation module (one the kernels compute,
    transformers' ``ACT2FN`` classes, torch's ``nn.Tanh``, ``nn.ReLU6``, ...)."""
    kind = type(module)
    if epilogue_activation(module) is not None or kind.__module__ == "transformers.activations":
        return True
    return kind.__module__ == "torch.nn.modules.activation" and kind.__name__ not in _NOT_ELEMENTWISE


def _is_gemm_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a Linear (torch's, tkern's, fp8) or transformers' Conv1D (or tkern's)."""
    return isinstance(module, nn.Linear) or any(k.__name__ == "Conv1D" for k in type(module).__mro__)


def _unruled_block(module: nn.Module) -> str | None:
    """Why ``module``, a transformers class without a rule, is an MLP block left eager: its
    name ends in ``MLP``, or an activation is one of its children beside two or more GEMM
    layers (OPT's decoder layer calls ``fc2(activation_fn(fc1(x)))`` inline); else None."""
    kind = type(module)
    if not kind.__module__.startswith("transformers."):
        return None
    if kind.__name__.endswith("MLP"):
        return "tkern has no fusion rule for this MLP class"
    children = dict(module.named_children())
    acts = [name for name, child in children.items() if _is_activation(child)]
    if acts and sum(map(_is_gemm_layer, children.values())) >= 2:
        return f"tkern has no fusion rule for this class, whose {acts[0]} runs between its GEMM layers"
    return None


def route_mlp(module: nn.Module) -> str | None:
    """Give ``module`` the fused forward if it is a transformers MLP block of a family
    in :data:`MLP_RULES` that can run fused. Returns why not where it is an MLP block
    left eager (a family without a rule (:func:`_unruled_block`), an activation the
    kernels do not have, a layer that takes no epilogue: for convert_network's warning),
    else None."""
    if "forward" in module.__dict__:
        return None  # the user's own replacement forward (or ours, from an earlier call)
    rule = mlp_rule(module)
    if rule is None:
        return _unruled_block(module)
    reason = _why_not(module, rule)
    if reason is None:
        module.forward = FusedMLPForward(module, rule)
    return reason
