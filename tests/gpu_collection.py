"""What the suite would run on a GPU machine that only a CPU can run.

``TKERN_FAKE_CUDA_COLLECT=1 pytest --collect-only tests/`` (tests/conftest.py) collects
the suite as a GPU machine would: CUDA reported available before tkern is imported,
so tkern compiles its kernels and ``DEVICE`` is "cuda"; nothing is launched. Every
collected test is then classified by what it uses (:func:`needs_cpu`):

* ``recorder``: tests/graph_recorder.py (it patches Triton's interpreter to record
  launches, so it needs CPU tensors under the interpreter);
* ``interpreter``: Triton's interpreter itself (``triton.runtime.interpreter``);
* ``compile gate``: tests/test_compiled.py or a ``compiled`` test, which compiles
  every kernel ahead of time: CI's job on a machine without a GPU, minutes of a
  GPU session's budget otherwise.

and by whether its skip marks (``skip``, ``skipif`` with a condition already
evaluated) skip it there (:func:`skip_reason`). :func:`print_report` prints one
``GPU-COLLECT`` line per test that uses any of these; a line whose test is not
skipped is a test that would fail (or waste the budget) on a GPU.

What a test uses is read from its code and, transitively, from the functions of
its own module that it names (a helper taking the recorder counts): the names it
loads that resolve to the recorder's or the interpreter's module or objects. A
fixture's code is not followed.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterable
from typing import Any

import pytest

#: the line prefix of :func:`print_report`
PREFIX = "GPU-COLLECT"
RECORDER, INTERPRETER, COMPILE_GATE = "recorder", "interpreter", "compile gate"
#: the test modules that drive the recorder (each skipped on a GPU machine)
RECORDER_MODULES = (
    "test_health", "test_optim_graph", "test_optim_one_pass", "test_trainer_auto", "test_trainer_graph",
)  # fmt: skip


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _kind(value: Any) -> str | None:
    """What CPU-only thing ``value`` is, or None."""
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    if not isinstance(module, str):
        return None
    if module == "graph_recorder" or module.endswith(".graph_recorder"):
        return RECORDER
    if module.startswith("triton.runtime.interpreter"):
        return INTERPRETER
    return None


def uses(fn: Any) -> set[str]:
    """The CPU-only things ``fn`` names, directly or through the functions of its
    own module that it names (see the module docstring)."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [inspect.unwrap(fn)]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        scope = getattr(f, "__globals__", {})
        for c in _codes(code):
            for name in c.co_names:
                if name not in scope:
                    continue
                value = scope[name]
                kind = _kind(value)
                if kind is not None:
                    found.add(kind)
                elif isinstance(value, types.FunctionType) and value.__module__ == f.__module__:
                    todo.append(value)
    return found


def skip_reason(item: pytest.Item) -> str | None:
    """Why ``item`` is skipped by its marks (None: it runs). A ``skipif`` whose
    condition is a string is not evaluated here and counts as not skipping."""
    for mark in item.iter_markers("skip"):
        return mark.kwargs.get("reason", mark.args[0] if mark.args else "skip")
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or ((mark.kwargs["condition"],) if "condition" in mark.kwargs else ())
        if not conditions:
            return mark.kwargs.get("reason", "skipif")
        if any(not isinstance(c, str) and bool(c) for c in conditions):
            return mark.kwargs.get("reason", "skipif")
    return None


def needs_cpu(item: pytest.Item) -> set[str]:
    """What of the recorder, the interpreter and the compile gate ``item`` uses."""
    found = uses(item.function) if isinstance(item, pytest.Function) else set()
    if item.path.name == "test_compiled.py" or item.get_closest_marker("compiled") is not None:
        found.add(COMPILE_GATE)
    return found


def report(items: Iterable[pytest.Item]) -> list[tuple[str, list[str], str | None]]:
    """``(node id, what it uses, why it is skipped or None)`` for every item that
    uses anything :func:`needs_cpu` names."""
    rows = []
    for item in items:
        found = needs_cpu(item)
        if found:
            rows.append((item.nodeid, sorted(found), skip_reason(item)))
    return rows


def print_report(items: Iterable[pytest.Item]) -> None:
    """One line per :func:`report` row: ``GPU-COLLECT <runs|skipped> <node id> | <uses>``."""
    for nodeid, found, reason in report(items):
        status = "runs" if reason is None else "skipped"
        print(f"{PREFIX} {status} {nodeid} | {','.join(found)}", file=sys.stdout)


def classified(lines) -> list[tuple[str, str, str]]:
    """``(status, node id, uses)`` of each GPU-COLLECT line among ``lines``."""
    rows = []
    for line in lines:
        if line.startswith(PREFIX + " "):
            status, rest = line[len(PREFIX) + 1 :].split(" ", 1)
            nodeid, uses = rest.split(" | ")
            rows.append((status, nodeid, uses))
    return rows


def check_the_suite_on_a_gpu_machine(rows: list[tuple[str, str, str]]) -> None:
    """The whole suite's fake-CUDA collection (``rows`` from :func:`classified`): nothing runs
    that needs the CPU, and the classifier saw the recorder's tests and the compile gate. The
    collection itself is the GPU plan's dry run's ``gpu_collection`` phase, which the dry run's
    test reads (tests/test_benchmarks.py: one collection of the suite, not two;
    tests/test_gpu_collection.py checks this check on planted lines)."""
    running = [f"{nodeid} ({uses})" for status, nodeid, uses in rows if status == "runs"]
    assert running == [], "these would run on a GPU machine:\n" + "\n".join(running)
    by_use = {u: [n for s, n, uses in rows if u in uses.split(",")] for u in (RECORDER, COMPILE_GATE)}
    assert len(by_use[RECORDER]) >= 15
    assert {n.split("::")[0] for n in by_use[RECORDER]} == {f"tests/{m}.py" for m in RECORDER_MODULES}
    assert by_use[COMPILE_GATE] and all(
        n.startswith("tests/test_compiled")
        for n in by_use[COMPILE_GATE]  # test_compiled*.py
    )
