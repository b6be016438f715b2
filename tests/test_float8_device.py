"""fp8 on a GPU without fp8 tensor cores (issue 46 item 4): tkern's own error, naming the
device's compute capability and what is needed, before any kernel is compiled or launched.

The CPU has no GPU to ask, so the tests answer for an A100 (8.0) through the one seam the
fp8 code asks (``tkern.kernels.float8.compiled_spec``, a :class:`tkern.DeviceSpec`) and
count the Triton launches through the interpreter (none may start)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from torch import nn

import tkern
from tkern.device import SPECS
from tkern.kernels import float8 as f8
from tkern.nn import Float8Linear


@pytest.fixture
def ampere(monkeypatch):
    """Every device answers compute capability 8.0 (sm_80: no fp8 tensor cores)."""
    monkeypatch.setattr(f8, "compiled_spec", lambda device: SPECS["a100"])


def _assert_the_capability_error(excinfo, what: str) -> None:
    message = str(excinfo.value)
    for words in (what, "fp8 tensor cores", "8.9", "8.0", "a100", "sm_80"):
        assert words in message, (words, message)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_float8_linear_refuses_a_gpu_without_fp8_tensor_cores_at_construction(ampere, recipe):
    with pytest.raises(RuntimeError) as excinfo:
        Float8Linear(32, 16, recipe=recipe, device=DEVICE)
    _assert_the_capability_error(excinfo, "Float8Linear")


def test_convert_network_refuses_before_any_module_changes(ampere):
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)).to(DEVICE)
    with pytest.raises(RuntimeError) as excinfo:
        tkern.convert_network(model, torch.bfloat16, float8="tensorwise")
    _assert_the_capability_error(excinfo, "convert_network(float8='tensorwise')")
    assert type(model[0]) is nn.Linear and model[0].weight.dtype == torch.float32  # untouched


def test_a_layer_moved_to_such_a_gpu_refuses_at_its_first_call_before_any_kernel(monkeypatch):
    layer = Float8Linear(32, 16, device=DEVICE)  # built where fp8 runs, then "moved"
    x = torch.randn(4, 32, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr(f8, "compiled_spec", lambda device: SPECS["a10"])
    launches = []
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    monkeypatch.setattr(
        InterpretedFunction, "run", lambda self, *a, **k: launches.append(self) or run(self, *a, **k)
    )
    for call in (lambda: layer(x), lambda: tkern.to_float8(x), lambda: tkern.scaled_mm(*_fp8_pair())):
        with pytest.raises(
            RuntimeError, match=r"fp8 tensor cores .* a10 \(nvidia sm_86, capability 8\.6\) has none"
        ):
            call()
    assert not launches


def _fp8_pair():
    a = torch.zeros(16, 32, device=DEVICE).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEVICE)
    return a, a.t(), one, one


def test_an_fp8_gpu_and_the_cpu_pass_the_check(monkeypatch):
    assert f8.compiled_spec("cpu") is None and f8.compiled_spec("meta") is None
    f8.check_fp8_device(DEVICE)
    for name in ("l4", "rtx4090", "h100", "b200", "rtx5090", "mi355x"):
        monkeypatch.setattr(f8, "compiled_spec", lambda device, name=name: SPECS[name])
        f8.check_fp8_device(DEVICE)
        Float8Linear(32, 16, device=DEVICE)
