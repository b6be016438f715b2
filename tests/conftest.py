"""Shared test helpers: the device under test and the one tolerance table.

Every numeric test compares against a reference computed in float64 (or in
plain fp32 torch for the optimizers) from the same inputs, with a bound taken
from ``TOL`` below. Kernels run compiled on a CUDA device when there is one,
else through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# A CUDA graph whose capture fails raises in the tests instead of warning and running
# eager (tkern.graphs): a test that meant to run graphed fails rather than passing eager.
os.environ.setdefault("TKERN_GRAPH_STRICT", "1")

#: Set to 1 (with ``pytest --collect-only``) to collect the suite as a GPU machine would:
#: CUDA reported available before tkern is imported (so compiled Triton, DEVICE "cuda"),
#: nothing launched; tests/gpu_collection.py then lists every collected test that is
#: not skipped yet would use the CPU recorder, the interpreter or the compile gate
#: (tests/test_gpu_collection.py runs it).
FAKE_CUDA_ENV = "TKERN_FAKE_CUDA_COLLECT"
if os.environ.get(FAKE_CUDA_ENV) == "1":
    from torch.overrides import TorchFunctionMode

    class _CudaAsMeta(TorchFunctionMode):
        """Tensors made at import for ``device="cuda"`` (parametrize arguments) are
        made on the meta device: shapes and dtypes, no memory, nothing launched."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    torch.cuda.is_available = lambda: True
    _CudaAsMeta().__enter__()  # for the whole collection (the process only collects)

import tkern  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not tkern.INTERPRET else "cpu"

#: For a test that drives tests/graph_recorder.py's CPU recorder: it records launches
#: through Triton's interpreter (CPU tensors), so on a GPU machine (compiled Triton,
#: CUDA tensors) it would record nothing and fail for no defect of tkern. There
#: tests/test_gpu.py and the ``gpu`` tests capture real CUDA graphs instead.
needs_recorder = pytest.mark.skipif(
    not tkern.INTERPRET,
    reason="drives the CPU recorder (tests/graph_recorder.py), which needs Triton's interpreter; "
    "on a GPU the real captures are tests/test_gpu.py's",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``TKERN_FAKE_CUDA_COLLECT=1``: print the GPU-collection report
    (tests/gpu_collection.py), one line per collected test that needs the CPU. (``make
    test`` keeps each file's tests on one xdist worker with ``--dist loadfile``, so a module
    fixture is built once: docs/testing.md.)"""
    if os.environ.get(FAKE_CUDA_ENV) == "1":
        import gpu_collection

        gpu_collection.print_report(items)


# Relative Frobenius error ||out - ref|| / ||ref|| allowed for a GEMM result,
# keyed by the output dtype (and the input dtype where it matters).
# * fp16 out: one rounding to fp16 per element, unit roundoff u = 2^-11 = 4.9e-4;
#   the fp32 accumulation adds ~sqrt(K) * 2^-24, negligible. Bound 2u ~ 1e-3.
# * bf16 out: u = 2^-8 = 3.9e-3; bound 2u ~ 8e-3. Under the interpreter bf16
#   stores are rounded to nearest by tkern's own helper, so the same bound holds.
# * fp32 out: half x half products are exact in fp32, so only the fp32 sum
#   rounds: ~sqrt(K) * 2^-24 ~ 4e-6 at K = 4096 in the worst test, typically
#   far less; bound 2e-6 for K <= 256 (the shapes the fp32 tests use).
TOL = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 2e-6,
}


class LazyModule:
    """A module imported at its first attribute read, skipping the test that reads it
    where it is missing (``pytest.importorskip``). For references whose import probes
    the device (torchao's mx_formats, transformers' modeling files): imported at a test
    module's top, they break the suite's collection as a GPU machine would collect it
    (``TKERN_FAKE_CUDA_COLLECT``, tests/test_gpu_collection.py)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(pytest.importorskip(self._name), attr)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff if denom == 0 else diff / denom


def eager_and_compiled(f, x: torch.Tensor, params: tuple) -> tuple:
    """``f(x)`` run eagerly and under ``torch.compile(fullgraph=True, backend="aot_eager")``,
    after asserting that Dynamo traces it as one graph with no break: ``(out0, grads0, out1,
    grads1)``, the gradients those of ``(x, *params)``."""
    explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    out0 = f(x)
    grads0 = torch.autograd.grad(out0, (x, *params))
    out1 = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    grads1 = torch.autograd.grad(out1, (x, *params))
    return out0, grads0, out1, grads1


@pytest.fixture
def device() -> str:
    return DEVICE


gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (compiled Triton)")


# A sum (dbias, summed inside the wgrad GEMM) against torch's sum of the same fp32
# values: two summation orders over the reduced length L, each within
# (L - 1) * 2^-24 * sum|v| of the exact sum (Higham's bound), so they differ by at
# most twice that; a result rounded to half precision may then land one ulp
# (eps * |ref|) apart.
def sum_tolerance(values: torch.Tensor, dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    length = values.shape[dim]
    tol = 2 * max(length - 1, 1) * 2.0**-24 * values.float().abs().sum(dim)
    if out_dtype != torch.float32:
        tol = tol + torch.finfo(out_dtype).eps * values.float().sum(dim).abs()
    return tol


SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")


@contextlib.contextmanager
def count_syncs():
    """Counts the calls that read a tensor's value on the host (each a device-to-host sync
    on a GPU: Tensor.item, tolist, bool/int/float, nonzero) and torch.cuda.synchronize."""
    calls = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as stack:
        for name in SYNCING:
            stack.enter_context(
                mock.patch.object(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
            )
        stack.enter_context(
            mock.patch.object(torch.cuda, "synchronize", counted("synchronize", torch.cuda.synchronize))
        )
        yield calls


@pytest.fixture
def wgrad_counts(monkeypatch):
    """How often a backward put a weight gradient straight into a fused optimizer's flat
    buffer (``into``: ``tkern.ops.common.flat_wgrad`` accepted), and how often a
    gradient was copied into the buffer (``copies``: ``FlatParams._adopt_grad``)."""
    from tkern.flat import FlatParams
    from tkern.ops import common

    seen = {"into": 0, "copies": 0}
    flat_wgrad, adopt = common.flat_wgrad, FlatParams._adopt_grad

    def spy_into(*args):
        into = flat_wgrad(*args)
        seen["into"] += into is not None
        return into

    def spy_adopt(self, i, g):
        seen["copies"] += 1
        return adopt(self, i, g)

    monkeypatch.setattr(common, "flat_wgrad", spy_into)
    monkeypatch.setattr(FlatParams, "_adopt_grad", spy_adopt)
    return seen


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Every ``tkern.ops.float8.scaled_mm`` call the test makes, as (a, b, scale_a, scale_b,
    block_a, block_b), each still run: the fp8 operands a GEMM received, for a float64
    product of them (:func:`dequantized`)."""
    import tkern.ops.float8

    calls = []
    real = tkern.ops.float8.scaled_mm

    def recording(a, b, scale_a, scale_b, **kw):
        calls.append((a, b, scale_a, scale_b, kw.get("block_a"), kw.get("block_b")))
        return real(a, b, scale_a, scale_b, **kw)

    monkeypatch.setattr(tkern.ops.float8, "scaled_mm", recording)
    return calls


def dequantized(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """fp8 data ``q`` times its scale in float64: one scale (``block`` None) or one per
    ``block`` = (rows, cols) tile, the ragged last tiles cut to ``q``'s shape."""
    if not block:
        return q.double() * scale.double().reshape(-1)[0]
    r, c = q.shape
    full = scale.double().repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]
    return q.double() * full


@pytest.fixture
def hopper_routes(monkeypatch):
    """Hopper's routing (gemm.device_gemm_info patched: TMA, ragged M plans the TMA kernel),
    the TMA kernel run by the interpreter; the list of "tma" launches it took."""
    from tkern.kernels import gemm

    routes = []
    launch_tma = gemm.launch_tma
    monkeypatch.setattr(gemm, "device_gemm_info", lambda device: (132, True))
    monkeypatch.setattr(gemm, "plan_gemm_cached", functools.lru_cache(gemm.plan_gemm_cached.__wrapped__))
    monkeypatch.setattr(gemm, "launch_tma", lambda *a, **k: routes.append("tma") or launch_tma(*a, **k))
    return routes


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, its keyword meta) of every Triton launch (the interpreter's), each run
    with the dispatch modes disabled (a test's TorchDispatchMode sees the model's ops only)."""
    if not tkern.INTERPRET:
        pytest.skip("counts launches through Triton's interpreter")
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, dict]] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs))
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    return seen


class AddsOver(TorchDispatchMode):
    """Counts the aten adds whose output has ``numel`` elements (``seen``): the torch adds over
    a (tokens, hidden) stream. Use beside the ``launches`` fixture, which runs each launch with
    the modes disabled, so the interpreter's own ops are not seen."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and out.numel() == self.numel:
            self.seen += 1
        return out


class OpsOver(TorchDispatchMode):
    """The aten ops (outside Triton's launches) that read or write a tensor of one of
    ``sizes`` ((numel, last dim) pairs). Views and allocations touch no data: not counted.
    Under the interpreter a launch copies its tensors with aten ops: those are the kernel's;
    a tkern custom op is a launcher's door (its insides are not dispatched to a mode)."""

    FREE = {
        getattr(torch.ops.aten, n)
        for n in (
            "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "slice",
            "split", "split_with_sizes", "select", "unsqueeze", "squeeze", "detach", "alias",
            "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_",
        )
    }  # fmt: skip

    def __init__(self, sizes: set[tuple[int, int]]) -> None:
        super().__init__()
        self.sizes = sizes
        self.busy = 0
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.busy and func.overloadpacket not in self.FREE and func.namespace != "tkern":
            tensors = torch.utils._pytree.tree_leaves((args, kwargs, out))
            if any(isinstance(t, torch.Tensor) and (t.numel(), t.shape[-1:]) in self.sizes for t in tensors):
                self.seen.append(str(func))
        return out


@contextlib.contextmanager
def outside_launches(monkeypatch, mode):
    """``mode`` (a TorchDispatchMode with a ``busy`` count) entered, and under the interpreter
    ``busy`` raised while a Triton launch runs: the interpreter's own tensor ops inside a
    launch are the kernel's, not the model's (a compiled launch dispatches no aten op)."""
    if tkern.INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        real = InterpretedFunction.run

        def run(*args, **kwargs):
            mode.busy += 1
            try:
                return real(*args, **kwargs)
            finally:
                mode.busy -= 1

        monkeypatch.setattr(InterpretedFunction, "run", run)
    with mode:
        yield mode


@contextlib.contextmanager
def ops_over(monkeypatch, sizes):
    """:class:`OpsOver` of ``sizes`` ((numel, last dim) pairs) while in the block: yields its
    ``seen`` list, which fills as the block runs."""
    with outside_launches(monkeypatch, OpsOver({(n, torch.Size([d])) for n, d in sizes})) as mode:
        yield mode.seen


def loss_and_grads(model, ids):
    """A causal LM's loss on ``ids`` (its own labels) and a copy of every parameter's gradient
    by name, from fresh gradients (the copies survive a fused optimizer's buffer being zeroed)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.float().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
