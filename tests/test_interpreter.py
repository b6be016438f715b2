"""What tkern does to Triton's interpreter (tkern/kernels/_common.py): the language is
patched once per launch, not once per jit-helper call (issue 55), a kernel whose
helpers are called in every program computes what torch computes, and int32 arithmetic
runs as compiled (no overflow asserts) unless TKERN_INTERPRETER_SANITIZE_OVERFLOW=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import tkern

pytestmark = pytest.mark.skipif(not tkern.INTERPRET, reason="Triton's interpreter only (the CPU)")


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[pid] = sum over the program's block of 2 * x (x: (n,) fp32, out: (programs,) fp32)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(_scaled(x, 2.0), axis=0))


def _launch(programs: int) -> torch.Tensor:
    x = torch.arange(programs * 16 - 3, dtype=torch.float32)
    out = torch.empty(programs)
    _helpers_kernel[(programs,)](x, out, x.numel(), BLOCK=16)
    expected = torch.nn.functional.pad(2 * x, (0, 3)).view(programs, 16).sum(1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    return out


def test_the_patch_once_wrapper_is_installed():
    assert getattr(interpreter._patch_lang, "tkern_once", False)


def test_a_launch_patches_the_language_once_whatever_its_programs_call(monkeypatch):
    """The language's builtins are patched for the launch and not again for each call of
    ``_scaled`` or ``tl.sum`` in each program: the number of patch passes is the same for
    one program and for eight (the interpreter alone makes several more per helper call
    and program)."""
    _launch(1)  # the first launch rewrites the helpers' sources (their globals change once)
    calls = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(1) or original(*a))
    _launch(1)
    one = len(calls)
    calls.clear()
    _launch(8)
    assert len(calls) == one > 0


def test_the_language_is_restored_after_a_launch():
    before = tl.sum
    _launch(2)
    assert tl.sum is before
    assert tl.arange.__module__ == "triton.language.core"  # the builtin itself, not the patch


@triton.jit
def _int32_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    """out = a * b + a (all (BLOCK,) int32): int32 arithmetic that may overflow."""
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs, a * b + a)


def test_int32_arithmetic_wraps_as_compiled_with_no_overflow_asserts():
    """A compiled kernel (no debug) wraps int32 overflow; the interpreter's sanitizer would
    assert instead, at a third of a GEMM launch's time. Under tkern the interpreter wraps,
    as torch's int32 arithmetic does."""
    a = torch.tensor([3, 2**20, -(2**30), 2**31 - 1] * 4, dtype=torch.int32)
    b = torch.tensor([5, 2**12, 4, 2] * 4, dtype=torch.int32)
    out = torch.empty_like(a)
    _int32_kernel[(1,)](a, b, out, BLOCK=16)
    assert torch.equal(out, a * b + a)
    assert not interpreter.interpreter_builder.options.sanitize_overflow


def test_the_overflow_checks_are_kept_on_request():
    """TKERN_INTERPRETER_SANITIZE_OVERFLOW=1 leaves Triton's checks on (a fresh interpreter:
    the option is chosen at import)."""
    code = (
        "import tkern.kernels._common; from triton.runtime import interpreter; "
        "print(interpreter.interpreter_builder.options.sanitize_overflow)"
    )
    env = {**os.environ, "TKERN_INTERPRETER_SANITIZE_OVERFLOW": "1", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]
