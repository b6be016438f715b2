"""Copies of a model and its fused optimizer (issue 37, item 1): ``copy.deepcopy((model,
opt))``, ``copy.deepcopy(opt)`` and a pickle round trip of ``(model, opt)`` give an
optimizer that steps its own (copied) params, as torch.optim's copies do.

The reference is the original itself: fed the same batches after the copy, the copy
must give the original's params bit for bit (same kernels, same buffers' values, same
step counts and random stream: nothing may differ), and every param that had a
gradient must have moved (the regression: a copy whose gradient views were stale
copies counted no param as having a gradient, so its steps silently did nothing).
Every fused optimizer and memory mode is copied, with the wgrad path (``tkern.nn.Linear``
writing dW straight into the flat buffer) and with a param group that sits steps out
(before the copy, so the copy carries split step counts, and after it).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import DEVICE
from torch import nn

import tkern
from tkern.flat import FlatParams, grad_is_flat_view
from tkern.optim import FusedAdam, FusedAdamW, FusedSGD

#: (optimizer, its arguments, the params' dtype): every optimizer, every master mode
#: (fp32, split, none; fp32 params are their own master) and state dtype (fp32, bf16,
#: uint8 for the 64x64 weight, fp32 for the smaller params of that buffer).
CASES = [
    ("adamw-fp32", FusedAdamW, {"lr": 1e-2, "weight_decay": 0.1}, torch.bfloat16),
    (
        "adamw-split-bf16state",
        FusedAdamW,
        {"lr": 1e-2, "master": "split", "state_dtype": torch.bfloat16},
        torch.bfloat16,
    ),
    (
        "adamw-none-uint8state",
        FusedAdamW,
        {"lr": 1e-2, "master": "none", "state_dtype": torch.uint8},
        torch.bfloat16,
    ),
    ("adam-fp16-uint8state", FusedAdam, {"lr": 1e-2, "state_dtype": torch.uint8}, torch.float16),
    ("adam-fp32params", FusedAdam, {"lr": 1e-2}, torch.float32),
    ("sgd-momentum", FusedSGD, {"lr": 0.1, "momentum": 0.9}, torch.bfloat16),
    (
        "sgd-nesterov-none-bf16state",
        FusedSGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "master": "none", "state_dtype": torch.bfloat16},
        torch.bfloat16,
    ),
    ("sgd-no-state", FusedSGD, {"lr": 0.1}, torch.float16),
]
HOW = ["deepcopy_pair", "deepcopy_opt", "pickle_pair"]
#: Every case copied every way with nn.Linear layers; with tkern.nn.Linear layers (whose
#: backward is ~10x slower in Triton's interpreter) every case once, the ways in turn.
MATRIX = [
    pytest.param(cls, kwargs, dtype, wgrad, how, id=f"{name}-{layer}-{how}")
    for n, (name, cls, kwargs, dtype) in enumerate(CASES)
    for wgrad, layer in ((False, "nn.Linear"), (True, "tkern.nn.Linear"))
    for how in (HOW if not wgrad else [HOW[n % len(HOW)]])
]
#: Whether the side layer takes part in each step: it sits out the second step before
#: the copy (the copy carries a split cohort) and the first one after it.
SIDE_BEFORE = [True, False]
SIDE_AFTER = [False, True]


class Net(nn.Module):
    """Two layers always used, and a side layer used only on the steps that ask for it:
    on the others its params get no gradient and sit the step out."""

    def __init__(self, dtype: torch.dtype, wgrad: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        if wgrad:  # tkern.linear: dW written into the flat buffer by the GEMM
            extra = {"compute_dtype": torch.bfloat16} if dtype == torch.float32 else {}
            self.a, self.b, self.side = (
                tkern.nn.Linear(i, o, dtype=dtype, device=DEVICE, **extra)
                for i, o in ((64, 64), (64, 4), (64, 4))
            )
        else:
            self.a, self.b, self.side = (
                nn.Linear(i, o).to(DEVICE, dtype) for i, o in ((64, 64), (64, 4), (64, 4))
            )

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        h = torch.relu(self.a(x.to(self.b.weight.dtype)))
        y = self.b(h)
        return y + self.side(h) if side else y


def make(cls, kwargs, dtype, wgrad):
    """The model and its optimizer: the side layer's weight is a param group of its own
    (a group that sits a step out), its bias shares the other layers' group and flat
    buffer (a param that sits out while its neighbours step: a cohort of its own)."""
    model = Net(dtype, wgrad)
    groups = [
        {"params": [*model.a.parameters(), *model.b.parameters(), model.side.bias]},
        {"params": [model.side.weight], "lr": kwargs["lr"] / 2},
    ]
    return model, cls(groups, **kwargs)


def batch(k: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + k)).to(DEVICE)


def train_step(model, opt, k, side):
    opt.zero_grad(set_to_none=True)
    model(batch(k), side).float().square().mean().backward()
    opt.step()


def copy_pair(how, model, opt):
    """The copy ``(model, optimizer)``. ``deepcopy_opt`` copies the optimizer alone (its
    params are copies it holds, as torch's) and gives them to a copy of the model."""
    if how == "deepcopy_pair":
        return copy.deepcopy((model, opt))
    if how == "pickle_pair":
        return pickle.loads(pickle.dumps((model, opt)))
    o2 = copy.deepcopy(opt)
    m2 = copy.deepcopy(model)
    where = {id(p): (gi, pi) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])}
    for name, p in model.named_parameters():
        gi, pi = where[id(p)]
        module, _, leaf = name.rpartition(".")
        setattr(m2.get_submodule(module), leaf, o2.param_groups[gi]["params"][pi])
    return m2, o2


def tensors_in(value):
    """Every tensor in ``value`` (an attribute), looking into lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def assert_lives_in_its_buffers(flat: FlatParams) -> None:
    """Every tensor a (copied) flat buffer holds is one of its buffers or lies in one:
    a cached view copied as a tensor of its own (the regression) lies elsewhere."""
    buffers = [flat.param, flat.grad, *flat.state.values(), *flat.absmax.values(), *flat.steps]
    if flat.master is not None:
        buffers.append(flat.master)

    def inside(t, buf):
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end

    for name, value in vars(flat).items():
        for t in tensors_in(value):
            if t.numel():
                assert any(inside(t, b) for b in buffers), (
                    f"FlatParams.{name} holds a tensor outside its buffers"
                )


def assert_same_optimizer_state(o1, o2):
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["state"].keys() == s2["state"].keys()
    for i, entry in s1["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, s2["state"][i][key]), (i, key)


@pytest.mark.parametrize(("cls", "kwargs", "dtype", "wgrad", "how"), MATRIX)
def test_a_copy_steps_as_the_original_bit_for_bit(cls, kwargs, dtype, wgrad, how, wgrad_counts):
    model, opt = make(cls, kwargs, dtype, wgrad)
    for k, side in enumerate(SIDE_BEFORE):
        train_step(model, opt, k, side)
    m2, o2 = copy_pair(how, model, opt)

    p1, p2 = list(model.parameters()), list(m2.parameters())
    assert not any(a is b or a.data_ptr() == b.data_ptr() for a, b in zip(p1, p2, strict=True))
    # as torch.optim's copy: the copy's groups and state are keyed by the copied params
    held = [p for g in o2.param_groups for p in g["params"]]
    assert len(held) == len(p2) and {id(p) for p in held} == {id(p) for p in p2}
    assert all(p in o2.state and q not in o2.state for p, q in zip(p2, p1, strict=True))
    flats = [f for group in o2.flat_buffers for f in group]
    for flat in flats:
        assert_lives_in_its_buffers(flat)
    assert any(len(set(f.cohort)) > 1 for f in flats)  # the side bias's step count is its own
    side = {id(p) for p in m2.side.parameters()}

    for k, use_side in enumerate(SIDE_AFTER, start=len(SIDE_BEFORE)):
        before = [p.detach().clone() for p in p2]
        start = wgrad_counts["into"]
        train_step(model, opt, k, use_side)
        into = wgrad_counts["into"] - start
        train_step(m2, o2, k, use_side)
        # the copy's gradients take the original's path (the GEMM's, for each weight and bias
        # of a half-precision tkern.nn.Linear used), and neither copies a gradient into its buffer
        assert (
            wgrad_counts["into"] - start - into
            == into
            == (2 * (2 + use_side) if wgrad and dtype != torch.float32 else 0)
        )
        assert wgrad_counts["copies"] == 0
        assert all(grad_is_flat_view(p) for p in p2)
        for name, a, b, old in zip(dict(model.named_parameters()), p1, p2, before, strict=True):
            assert torch.equal(a, b), f"step {k}: {name} differs from the original's"
            moved = not torch.equal(b, old)
            expect = use_side or id(b) not in side  # a param without a gradient sits the step out
            assert moved == expect, f"step {k}: {name} {'did not move' if expect else 'moved'}"
    assert_same_optimizer_state(opt, o2)


@pytest.mark.parametrize("how", HOW)
def test_a_copy_taken_between_backward_and_step_steps_the_params_that_have_gradients(how):
    # The copy carries which params have a gradient since the last zero_grad: the
    # side layer, absent from this backward, sits the copy's step out as the original's.
    model, opt = make(FusedAdamW, {"lr": 1e-2}, torch.bfloat16, wgrad=False)
    train_step(model, opt, 0, side=True)
    opt.zero_grad(set_to_none=True)
    model(batch(1), False).float().square().mean().backward()
    m2, o2 = copy_pair(how, model, opt)
    before = [p.detach().clone() for p in m2.parameters()]
    opt.step()
    o2.step()
    side = {id(p) for p in m2.side.parameters()}
    for a, b, old in zip(model.parameters(), m2.parameters(), before, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(b, old) == (id(b) in side)
    assert_same_optimizer_state(opt, o2)


@pytest.mark.parametrize("how", HOW)
def test_a_copy_of_params_written_from_outside_brings_its_master_along(how):
    # An in-place write to a param after a step (the master follows it at the next
    # step) made before the copy: the copy's master follows it too.
    model, opt = make(FusedAdamW, {"lr": 1e-2}, torch.bfloat16, wgrad=False)
    train_step(model, opt, 0, side=True)
    with torch.no_grad():
        model.a.weight.mul_(0.5)
    m2, o2 = copy_pair(how, model, opt)
    for k in (1, 2):
        train_step(model, opt, k, side=True)
        train_step(m2, o2, k, side=True)
        for a, b in zip(model.parameters(), m2.parameters(), strict=True):
            assert torch.equal(a, b)
    assert_same_optimizer_state(opt, o2)
