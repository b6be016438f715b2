"""An attention forward's projections of one input run as one autograd node (see
:func:`tkern.convert_network`): Llama's ``self.q_proj(hidden_states)``, ``self.k_proj(...)``,
``self.v_proj(...)`` become one :func:`tkern.ops.projections.shared_input_linears` call, whose
backward sums the three input gradients in the dgrad GEMMs (autograd would sum them with two
torch adds over (tokens, hidden)).

:func:`grouped_code` rewrites the forward's source (the three calls, as the family's rule in
``tkern.nn.rotary.ROTARY_RULES`` names them, each ``self.<name>(<the same name>)``) so that
each call goes through a :class:`SharedInputCall` with a dict local to that call of the
forward: the first of the three computes all three outputs and leaves the other two there for
their calls. Decided on every call: a layer that is not a tkern ``Linear`` without an
activation, has anything (a hook, a patched forward) on it, or computes in another dtype, or a
call under ``torch.compile``, gets each layer called as a module, as HF wrote it. The modules,
their Parameters and the module tree stay as they are.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch
from torch import nn

from tkern.nn.fusion import runs_more_than_forward
from tkern.nn.linear import Linear, compute_operands
from tkern.ops.common import is_compiling
from tkern.ops.projections import shared_input_linears

__all__ = ["CALL", "CALLS", "SharedInputCall", "grouped_code", "shared_outputs"]

#: The global the rewritten forward calls as ``CALL(CALLS, self, name, x)`` for each grouped
#: projection, and the local dict (one per call of the forward) it keeps outputs in.
CALL, CALLS = "_tkern_shared_input_call", "_tkern_shared_input_outputs"


def shared_outputs(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple | None:
    """``tuple(getattr(module, n)(x) for n in names)`` as one :func:`shared_input_linears`
    call where each child is a tkern ``Linear`` without an activation, nothing (a hook, a
    patched forward) on it, all computing in one dtype; else None (nothing run)."""
    layers = [getattr(module, n, None) for n in names]
    if any(type(layer) is not Linear or layer.activation is not None for layer in layers):
        return None
    if any(map(runs_more_than_forward, layers)):
        return None
    xs, weight = compute_operands(layers[0], x, layers[0].weight)
    weights = [weight] + [compute_operands(layer, xs, layer.weight)[1] for layer in layers[1:]]
    if any(w.dtype != xs.dtype for w in weights):
        return None
    return shared_input_linears(xs, weights, [layer.bias for layer in layers])


class SharedInputCall:
    """What a rewritten forward calls for each grouped projection (:data:`CALL`):
    ``call(outputs, module, name, x)`` returns ``getattr(module, name)(x)``, computed with the
    group's other projections of the same ``x`` by :func:`shared_outputs` on the first call and
    left in ``outputs`` (the forward's local dict) for theirs; each layer called as a module
    where the group cannot run as one (or under ``torch.compile``)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self, outputs: dict, module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        held = outputs.pop(name, None)
        if held is not None and held[0] is x:
            return held[1]
        ys = None if is_compiling() else shared_outputs(module, self.names, x)
        if ys is None:
            return getattr(module, name)(x)
        outputs.update((n, (x, y)) for n, y in zip(self.names, ys, strict=True) if n != name)
        return ys[self.names.index(name)]

    def __repr__(self) -> str:
        return f"tkern.nn.projections.SharedInputCall({self.names})"


class _Group(ast.NodeTransformer):
    """Rewrites each ``self.<name>(arg)`` for ``name`` in ``names`` into ``CALL(CALLS, self,
    "<name>", arg)``, recording the names and arguments it saw."""

    def __init__(self, self_name: str, names: tuple[str, ...]) -> None:
        self.self_name, self.names, self.seen = self_name, names, []

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if not (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id == self.self_name
            and f.attr in self.names
        ):
            return node
        plain = len(node.args) == 1 and isinstance(node.args[0], ast.Name) and not node.keywords
        self.seen.append((f.attr, node.args[0].id if plain else None))
        args = [ast.Name(CALLS, ast.Load()), ast.Name(self.self_name, ast.Load()), ast.Constant(f.attr)]
        return ast.copy_location(ast.Call(ast.Name(CALL, ast.Load()), [*args, *node.args], []), node)


def _parsed(fn) -> ast.FunctionDef | None:
    """``fn``'s definition (its own source, dedented), or None where it has none to read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef) or func.name != fn.__name__ or not func.args.args:
        return None
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)  # getsource starts at the decorators
    return func


def grouped_code(fn, names: tuple[str, ...]) -> types.CodeType | None:
    """``fn``'s code with its calls ``self.<name>(x)``, for each of ``names`` once and all on
    one plain name ``x``, going through :data:`CALL` with a local dict :data:`CALLS` made first
    (the code a :class:`SharedInputCall` bound to :data:`CALL` groups); None where ``fn`` is
    not written so (or has no source, or closes over anything)."""
    func = _parsed(fn) if len(names) > 1 and not fn.__code__.co_freevars else None
    if func is None or CALL in fn.__code__.co_names or CALLS in fn.__code__.co_varnames:
        return None
    group = _Group(func.args.args[0].arg, names)
    group.visit(func)
    args = {arg for _, arg in group.seen}
    if sorted(attr for attr, _ in group.seen) != sorted(names) or len(args) != 1 or None in args:
        return None
    first = func.body[0]
    made = ast.Assign([ast.Name(CALLS, ast.Store())], ast.Dict([], []))
    func.body.insert(0, ast.copy_location(made, first))
    func.decorator_list = []
    module = compile(
        ast.fix_missing_locations(ast.Module([func], [])), fn.__code__.co_filename, "exec", dont_inherit=True
    )
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
    return code if not code.co_freevars else None
