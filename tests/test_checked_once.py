"""Arguments are checked once per call (issue 55 item 4): the public function checks, the
launchers it calls trust it (their ``*_prechecked`` paths), and a backward trusts what its
forward checked and saved. Counted by wrapping kernels/_common.py's checks wherever tkern
bound them, over one forward and backward of each public op."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

import tkern
import tkern.kernels._common as common
from tkern.ops.float8 import float8_linear

DEVICE = "cuda" if torch.cuda.is_available() and not tkern.INTERPRET else "cpu"
CHECKS = ("check_tensor", "check_same_device", "check_int32_addressable", "check_int32_elements")


@pytest.fixture
def checks(monkeypatch) -> Counter:
    """Counts every call of a _common check, by ``(check, the name it checks)`` (the
    tensor's name; ``same_device`` for check_same_device)."""
    seen: Counter = Counter()

    def counting(check, real):
        def wrapped(*args, **kwargs):
            seen[check, "same_device" if check == "check_same_device" else args[0]] += 1
            return real(*args, **kwargs)

        return wrapped

    for check in CHECKS:
        real = getattr(common, check)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("tkern") and getattr(module, check, None) is real:
                monkeypatch.setattr(module, check, counting(check, real))
    return seen


def _t(*shape, requires_grad=True):
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=requires_grad)


def _forward_backward(checks: Counter, fn) -> tuple[Counter, Counter]:
    """The checks ``fn()``'s forward made and those its backward made."""
    checks.clear()
    out = fn()
    forward = Counter(checks)
    checks.clear()
    out.float().sum().backward()
    return forward, Counter(checks)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_linear_checks_x_once_in_forward_and_nothing_in_backward(checks, activation):
    x, w, b = _t(8, 32), _t(16, 32), _t(16)
    forward, backward = _forward_backward(checks, lambda: tkern.linear(x, w, b, activation))
    assert not forward  # the fast test (linear_args_plainly_valid) stands for every check
    assert not backward
    strided = _t(32, 8).t()  # not contiguous: the full checks, once
    forward, backward = _forward_backward(checks, lambda: tkern.linear(strided, w, b, activation))
    assert forward["check_tensor", "x"] == 1 and forward["check_int32_addressable", "x"] == 1
    assert max(forward.values()) == 1, forward
    assert not backward


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed", "blockwise"])
def test_float8_linear_checks_x_once_in_forward_and_nothing_in_backward(checks, scaling):
    """Before issue 55 a tensorwise layer's forward made 13 checks (x's cast and the GEMM
    checked again what float8_linear had) and its backward 16."""
    x, w, b = _t(8, 32), _t(16, 32), _t(16)
    kw = {"histories": tuple(torch.zeros(4, device=DEVICE) for _ in range(3))} if scaling == "delayed" else {}
    forward, backward = _forward_backward(checks, lambda: float8_linear(x, w, b, scaling=scaling, **kw))
    assert forward["check_tensor", "x"] == 1 and forward["check_int32_elements", "x"] == 1
    assert max(forward.values()) == 1, forward
    assert not backward


def test_norms_and_rotary_backward_check_nothing_again(checks):
    x, w = _t(8, 32), _t(32)
    for fn in (lambda: tkern.layer_norm(x, (32,), w), lambda: tkern.rms_norm(x, (32,), w)):
        forward, backward = _forward_backward(checks, fn)
        assert forward["check_tensor", "x"] == 1 and not backward
    q, k = _t(2, 2, 8, 16), _t(2, 2, 8, 16)
    cos, sin = _t(2, 8, 16, requires_grad=False), _t(2, 8, 16, requires_grad=False)
    forward, backward = _forward_backward(checks, lambda: sum(tkern.apply_rotary_pos_emb(q, k, cos, sin)))
    assert forward["check_tensor", "q"] == 1 and not backward
    gate, up = _t(8, 32), _t(8, 32)
    forward, backward = _forward_backward(checks, lambda: tkern.swiglu(gate, up))
    # autograd's dh: only its int32 reach (it may be a view into a larger gradient)
    assert forward["check_tensor", "gate"] == 2 and backward == Counter(
        {("check_int32_addressable", "dh"): 1}
    )


def test_bad_input_still_raises_before_anything_launches(checks):
    """The checks moved, they did not go: float8_linear still names a bad argument, and the
    checks the kernels keep for their own public calls still run (scaled_mm's)."""
    x, w = _t(8, 32), _t(16, 32)
    with pytest.raises(ValueError, match="x must have shape"):
        float8_linear(_t(8, 31), w)
    with pytest.raises(TypeError, match="x must have dtype"):
        float8_linear(x.half(), w)
    a = torch.zeros(4, 32, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        tkern.scaled_mm(a, a, torch.ones(()), torch.ones(()))
    assert checks["check_tensor", "a"] == 1
