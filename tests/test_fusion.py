"""convert_network(fuse_activations=True): a Linear directly followed by ReLU,
GELU (either form) or SiLU in an nn.Sequential runs the activation in its GEMM's
epilogue, with the same results, names, printed structure and hooks as the
unfused model."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
from conftest import DEVICE, TOL, rel_err
from torch import nn

from tkern.nn import convert_network

ACTIVATIONS = {
    "relu": (nn.ReLU, "relu"),
    "relu_inplace": (lambda: nn.ReLU(inplace=True), "relu"),
    "gelu": (nn.GELU, "gelu"),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), "gelu_tanh"),
    "silu": (nn.SiLU, "silu"),
    "silu_inplace": (lambda: nn.SiLU(inplace=True), "silu"),
}

#: ReLU commutes with the one rounding to fp16/bf16 and its gradient is a mask of
#: the same rounded pre-activation, so fused and unfused are the same numbers. On a
#: GPU the autotuner keys on the activation and may pick another tile (another fp32
#: summation order) for the fused GEMM; under the interpreter there is one tile.
EXACT = DEVICE == "cpu"


def _mlp(make_act, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 24, bias=bias),
        make_act(),
        nn.Linear(24, 24, bias=bias),
        make_act(),
        nn.Linear(24, 5, bias=bias),
    ).to(DEVICE)


def _run(model: nn.Module, x: torch.Tensor):
    """Output and the parameters' gradients of a mean-square loss."""
    y = model(x)
    y.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


def _assert_same(got, want, bound: float | None) -> None:
    """Outputs and gradients equal (``bound`` None) or within ``bound`` (rel_err)."""
    (y, grads), (y_ref, grads_ref) = got, want
    pairs = [(y, y_ref), *zip(grads, grads_ref, strict=True)]
    for i, (a, b) in enumerate(pairs):
        assert a.dtype == b.dtype, i
        if bound is None:
            assert torch.equal(a, b), i
        else:
            assert rel_err(a, b) < bound, (i, rel_err(a, b))


def _same_relu_numbers(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp16 results of a ReLU pair fused in one and not the other: see EXACT."""
    assert torch.equal(a, b) if EXACT else rel_err(a, b) < TOL[torch.float16]


@pytest.fixture
def epilogues(monkeypatch) -> list:
    """The activation each tkern.nn.Linear forward put in its GEMM's epilogue, in order."""
    seen = []
    module = sys.modules["tkern.nn.linear"]  # the file tkern.nn.Linear's forward calls linear from
    real = module.linear

    def spy(x, weight, bias=None, activation=None):
        seen.append(activation)
        return real(x, weight, bias, activation)

    monkeypatch.setattr(module, "linear", spy)
    return seen


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_fused_matches_unfused_and_torch(act, bias, dtype, epilogues):
    make, name = ACTIVATIONS[act]
    base = _mlp(make, bias)
    fused = convert_network(copy.deepcopy(base), dtype)
    plain = convert_network(copy.deepcopy(base), dtype, fuse_activations=False)
    x = torch.randn(6, 12, device=DEVICE)
    got = _run(fused, x)
    assert epilogues == [name, name, None]  # both activations ran in the epilogues
    epilogues.clear()
    want = _run(plain, x)
    assert epilogues == [None, None, None]

    # torch in float64 on the same (rounded) weights and input
    reference = copy.deepcopy(base).double()
    for p, q in zip(reference.parameters(), fused.parameters(), strict=True):
        p.data = q.detach().double()
    y64, g64 = _run(reference, x.to(dtype).double())
    torch_ref = (y64.to(dtype), [g.to(dtype) for g in g64])
    # the converted model rounds each layer's activations and each gradient GEMM's
    # output to dtype once (u each; TOL is 2u); a few in a row stay within 2 * TOL
    _assert_same(got, torch_ref, 2 * TOL[dtype])
    _assert_same(want, torch_ref, 2 * TOL[dtype])
    if name == "relu":
        _assert_same(got, want, None if EXACT else TOL[dtype])
    else:
        # GELU, SiLU: the epilogue applies them to the fp32 accumulator, where the unfused
        # module sees it rounded to dtype (and torch's erf/exp are not Triton's):
        # not the same numbers, both within 2 * TOL of float64, so 2 * TOL apart
        _assert_same(got, want, 2 * TOL[dtype])


def test_fp32_input_is_cast_as_the_linear_casts_it(epilogues):
    base = _mlp(nn.ReLU)
    fused = convert_network(copy.deepcopy(base))
    plain = convert_network(copy.deepcopy(base), fuse_activations=False)
    x = torch.randn(3, 12, device=DEVICE)  # fp32, as a data loader gives it
    y = fused(x)
    assert epilogues[0] == "relu" and y.dtype == torch.float16
    _same_relu_numbers(y, plain(x))


# --------------------------------------------------------------------------- invisible


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_names_state_dict_and_printed_structure_are_unchanged(act):
    make, _ = ACTIVATIONS[act]
    base = _mlp(make)
    fused = convert_network(copy.deepcopy(base))
    plain = convert_network(copy.deepcopy(base), fuse_activations=False)
    assert "forward" in vars(fused) and "forward" not in vars(plain)  # fusion is on here
    assert repr(fused) == repr(plain)
    assert list(fused.state_dict()) == list(plain.state_dict()) == list(base.state_dict())
    names = [(n, type(m)) for n, m in fused.named_modules()]
    assert names == [(n, type(m)) for n, m in plain.named_modules()]
    assert type(fused) is nn.Sequential and type(fused[1]) is type(base[1])
    assert repr(fused[1]) == repr(base[1])  # e.g. GELU(approximate='tanh')
    assert fused[0].activation is None  # the Linear itself is not changed


@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "silu_inplace"])
def test_forward_hooks_on_the_activation_fire_with_unfused_values(act, epilogues):
    make, name = ACTIVATIONS[act]
    base = _mlp(make)
    fused = convert_network(copy.deepcopy(base))
    plain = convert_network(copy.deepcopy(base), fuse_activations=False)
    x = torch.randn(4, 12, device=DEVICE)
    seen = {}

    def record(tag):
        def hook(module, args, output):
            seen[tag] = (args[0].clone(), output.clone())

        return hook

    handle = fused[1].register_forward_hook(record("fused"))  # after the conversion
    plain[1].register_forward_hook(record("plain"))
    got, want = _run(fused, x), _run(plain, x)
    assert epilogues[:3] == [None, name, None]  # the hooked pair ran unfused, the other fused
    for a, b in zip(seen["fused"], seen["plain"], strict=True):
        assert torch.equal(a, b)  # the hooked pair ran as in the unfused model
    # the hook saw negatives: the pre-activation (after an in-place SiLU, args[0] is its
    # output, as in the unfused model; SiLU's is negative too)
    assert (seen["fused"][0] < 0).any()
    if name == "relu":
        _assert_same(got, want, None if EXACT else TOL[torch.float16])
    else:  # the second pair fused: one rounding fewer, see test_fused_matches_unfused_and_torch
        _assert_same(got, want, 2 * TOL[torch.float16])

    handle.remove()  # no hook any more: fused again
    epilogues.clear()
    fused(x)
    assert epilogues == [name, name, None]


def test_pre_hook_on_the_linear_and_backward_hook_on_the_activation_are_honoured(epilogues):
    base = _mlp(nn.GELU)
    fused = convert_network(copy.deepcopy(base))
    plain = convert_network(copy.deepcopy(base), fuse_activations=False)
    fired = []
    for model in (fused, plain):
        model[0].register_forward_pre_hook(lambda m, args: (2 * args[0],))  # changes the input
        model[3].register_full_backward_hook(lambda m, gin, gout: fired.append(gout[0].shape))
    x = torch.randn(4, 12, device=DEVICE)
    got, want = _run(fused, x), _run(plain, x)
    assert epilogues[:3] == [None, None, None]
    assert fired == [(4, 24), (4, 24)]  # once per model
    _assert_same(got, want, None if EXACT else TOL[torch.float16])


def test_a_global_module_hook_turns_fusion_off_while_it_is_registered(epilogues):
    model = convert_network(_mlp(nn.ReLU))
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: calls.append(type(m)))
    try:
        model(torch.randn(2, 12, device=DEVICE))
    finally:
        handle.remove()
    assert epilogues == [None, None, None]
    assert calls.count(nn.ReLU) == 2  # every module fired
    epilogues.clear()
    model(torch.randn(2, 12, device=DEVICE))
    assert epilogues == ["relu", "relu", None]


def test_a_module_replaced_after_conversion_is_seen(epilogues):
    model = convert_network(_mlp(nn.ReLU))
    model[1] = nn.Tanh()
    x = torch.randn(3, 12, device=DEVICE)
    y = model(x)
    assert epilogues == [None, "relu", None]
    h = torch.tanh(model[0](x))
    _same_relu_numbers(y, model[4](model[3](model[2](h))))


# --------------------------------------------------------------------------- what is not fused


class Residual(nn.Sequential):
    """Uses the Linear's output twice: fusing it would change the sum."""

    def forward(self, x):
        h = self[0](x)
        return self[1](h) + h


@pytest.mark.parametrize(
    "make",
    [
        nn.Tanh,  # not in the epilogue
        nn.Mish,
        type("MyReLU", (nn.ReLU,), {}),  # a subclass may compute something else
        type("MySiLU", (nn.SiLU,), {}),
        type("MyGELU", (nn.GELU,), {}),
    ],
)
def test_other_activations_are_not_fused(make, epilogues):
    model = convert_network(nn.Sequential(nn.Linear(8, 8), make()).to(DEVICE))
    assert "forward" not in vars(model)
    model(torch.randn(2, 8, device=DEVICE))
    assert epilogues == [None]


def test_unprovable_pairs_are_not_fused(epilogues):
    torch.manual_seed(0)
    residual = Residual(nn.Linear(8, 8), nn.ReLU()).to(DEVICE)
    tail = nn.Sequential(nn.ReLU(), nn.Linear(8, 8)).to(DEVICE)  # the activation before the Linear
    model = convert_network(nn.Sequential(residual, tail))
    assert "forward" not in vars(residual) and "forward" not in vars(tail)
    x = torch.randn(3, 8, device=DEVICE)
    y = model(x)
    assert epilogues == [None, None]
    h = residual[0](x)
    assert torch.equal(y, tail[1](torch.relu(torch.relu(h) + h)))


def test_a_linear_shared_with_another_place_is_fused_only_where_it_is_followed(epilogues):
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = convert_network(nn.Sequential(shared, nn.ReLU(), shared).to(DEVICE))
    x = torch.randn(3, 8, device=DEVICE)
    y = model(x)
    assert epilogues == ["relu", None]
    _same_relu_numbers(y, shared(torch.relu(shared(x))))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "silu"])
def test_convert_back_and_again(act):
    base = _mlp(ACTIVATIONS[act][0])
    model = convert_network(copy.deepcopy(base))
    assert convert_network(model, torch.float32) is model
    assert "forward" not in vars(model)
    assert [type(m) for m in model] == [type(m) for m in base]
    x = torch.randn(3, 12, device=DEVICE)
    assert model(x).dtype == torch.float32
    once = convert_network(copy.deepcopy(base))
    twice = convert_network(convert_network(copy.deepcopy(base)))
    assert isinstance(vars(twice)["forward"], type(vars(once)["forward"]))
    assert torch.equal(once(x), twice(x))
    assert "forward" not in vars(convert_network(twice, fuse_activations=False))  # converting again replaces


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_routes_its_own_modules(how, epilogues):
    model = convert_network(_mlp(nn.GELU))
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert vars(other)["forward"].sequential is other
    x = torch.randn(3, 12, device=DEVICE)
    y = model(x)
    assert torch.equal(other(x), y)
    assert epilogues == ["gelu", "gelu", None] * 2
    with torch.no_grad():
        model[0].weight.zero_()  # the copy does not read the original's modules
    assert torch.equal(other(x), y)


def test_bad_fuse_activations():
    with pytest.raises(TypeError, match="fuse_activations must be True or False, got 'yes'"):
        convert_network(nn.Sequential(nn.Linear(2, 2)), fuse_activations="yes")


# --------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_matches_eager():
    model = convert_network(_mlp(nn.GELU))
    x = torch.randn(4, 12, device=DEVICE)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = _run(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _assert_same(_run(compiled, x), eager, None)  # the same kernels on the same inputs


@pytest.mark.slow
def test_compile_with_inductor_matches_eager():
    model = convert_network(_mlp(nn.GELU))
    x = torch.randn(4, 12, device=DEVICE)
    eager = _run(model, x)
    torch._dynamo.reset()
    y, grads = _run(torch.compile(model, fullgraph=True), x)
    # Inductor writes its own kernel for the loss and its gradient (fp32, rounded
    # to fp16 once): the fp16 GEMM tolerance, gradients 2x, as test_functional's
    assert rel_err(y, eager[0]) < TOL[torch.float16]
    for g, ref in zip(grads, eager[1], strict=True):
        assert rel_err(g, ref) < 2 * TOL[torch.float16]


def test_compile_fullgraph_runs_a_hooked_pair_unfused():
    # hooks registered before compiling (torch.compile does not guard on hooks
    # added later, for any module: torch._dynamo.config.skip_nnmodule_hook_guards)
    model = convert_network(_mlp(nn.GELU))
    plain = convert_network(copy.deepcopy(model), fuse_activations=False)
    seen = []
    model[1].register_forward_hook(lambda m, args, out: seen.append((args[0].clone(), out.clone())))
    x = torch.randn(4, 12, device=DEVICE)
    torch._dynamo.reset()
    y = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert len(seen) == 1
    h = plain[0](x)
    assert torch.equal(seen[0][0], h) and torch.equal(seen[0][1], plain[1](h))  # the unfused values
    assert rel_err(y, plain(x)) < 2 * TOL[torch.float16]  # the second pair fused: GELU's bound above


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)])
def test_unfused_inplace_relu_after_a_linear_writes_its_output(shape):
    # the path a hooked pair takes: nn.ReLU(inplace=True) on tkern.linear's output
    # (that output was once a view made inside the autograd Function: not writable)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)).to(DEVICE)
    convert_network(model, fuse_activations=False)
    x = torch.randn(*shape, device=DEVICE, requires_grad=True)
    y = model(x)
    y.float().sum().backward()
    h = model[0](x.detach())
    assert torch.equal(y, torch.relu(h))
    dx = ((h > 0).to(h.dtype) @ model[0].weight).float()  # d sum(relu(xW^T + b)) / dx, in fp16
    assert x.grad.shape == x.shape and rel_err(x.grad, dx) < TOL[torch.float16]
