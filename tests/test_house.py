"""The house's lines (issue 46 item 6), over every module of tkern/: no file over
600 lines outside tkern/kernels/, no class over 350 lines, no function over 80
lines outside tkern/kernels/ (a jit kernel is one program and may be longer).
A file or class past its line is a sign it does two jobs: split it by
responsibility rather than raise the number.

The same lines hold over benchmarks/*.py (issue 55 item 3: the speed-judging tools),
every module there measured alike (no kernels among them), and no import circle
among those modules: an import anywhere in a module (a function's lazy import too)
is an edge, so two tools that need each other's parts share a module instead."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tkern

PACKAGE = Path(tkern.__file__).parent
KERNELS = PACKAGE / "kernels"
BENCHMARKS = PACKAGE.parent / "benchmarks"
MAX_FILE_LINES = 600  # outside kernels/
MAX_CLASS_LINES = 350  # everywhere
MAX_FUNCTION_LINES = 80  # outside kernels/


def _modules() -> list[Path]:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50, f"found only {len(modules)} modules under {PACKAGE}"
    return modules


def _lines(node: ast.AST) -> int:
    """The lines a def or class spans, from its ``def``/``class`` line (decorators
    not counted) to its last line."""
    return node.end_lineno - node.lineno + 1


def _past_the_lines(path: Path, name: str, exempt: bool) -> list[str]:
    """``path``'s file, classes and functions past the house's lines; ``exempt`` (a
    kernels/ module): only its classes are measured."""
    found = []
    source = path.read_text()
    if not exempt and len(source.splitlines()) > MAX_FILE_LINES:
        found.append(f"{name}: {len(source.splitlines())} lines (file, > {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS_LINES
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not exempt:
            kind, limit = "function", MAX_FUNCTION_LINES
        else:
            continue
        if _lines(node) > limit:
            found.append(f"{name}:{node.lineno} {kind} {node.name}: {_lines(node)} lines (> {limit})")
    return found


def _offenders() -> list[str]:
    found = []
    for path in _modules():
        found += _past_the_lines(path, str(path.relative_to(PACKAGE.parent)), KERNELS in path.parents)
    return found


def _bench_modules() -> list[Path]:
    modules = sorted(BENCHMARKS.glob("*.py"))
    assert len(modules) > 10, f"found only {len(modules)} modules under {BENCHMARKS}"
    return modules


def _bench_offenders() -> list[str]:
    found = []
    for path in _bench_modules():
        found += _past_the_lines(path, f"benchmarks/{path.name}", exempt=False)
    return found


def _imports(modules: list[Path]) -> dict[str, set[str]]:
    """Module name -> the names among ``modules`` it imports, anywhere in its source
    (``import a``, ``import a.b``, ``from a import b``; a function's lazy import too)."""
    names = {path.stem for path in modules}
    graph = {}
    for path in modules:
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[path.stem] = (found & names) - {path.stem}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (``[a, b, ..., a]``), or None when it has none."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every import is seen

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep, [*path, dep])):
                return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_no_module_class_or_function_past_the_house_lines():
    offenders = _offenders()
    assert not offenders, "past the house's lines:\n" + "\n".join(offenders)


def test_the_measure_sees_a_long_function_and_class(tmp_path, monkeypatch):
    """The walk is real: a module with one long function and one long class outside
    kernels/, and one long kernel function inside, gives exactly the two offenders."""
    package = tmp_path / "tkern"
    (package / "kernels").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (package / "long.py").write_text(f"def long_function():\n{body}\n\nclass LongClass:\n{body}")
    (package / "kernels" / "kernel.py").write_text(f"def long_kernel():\n{body}")
    for i in range(50):
        (package / f"m{i}.py").write_text("x = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", package / "kernels")
    offenders = _offenders()
    assert len(offenders) == 3, offenders  # the file (> 600 lines), the function, the class
    assert any("long_function" in o for o in offenders) and any("LongClass" in o for o in offenders)
    assert any("(file, > 600)" in o for o in offenders)
    assert not any("long_kernel" in o for o in offenders)


def test_benchmarks_keep_the_house_lines():
    offenders = _bench_offenders()
    assert not offenders, "past the house's lines:\n" + "\n".join(offenders)


def test_no_import_circle_among_the_benchmarks():
    graph = _imports(_bench_modules())
    assert graph["bench_train"] and graph["step_ledger"], graph  # the walk sees their imports
    circle = _circle(graph)
    assert circle is None, "benchmarks/ import circle: " + " -> ".join(circle)


def test_the_measure_sees_a_planted_circle_and_a_long_benchmark(tmp_path, monkeypatch):
    """The circle check is real: a circle closed by a lazy import inside a function is
    found, a chain that only looks alike is not; and the benchmarks' measure sees a long
    file and a long function there."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "a.py").write_text("import b\n")
    (bench / "b.py").write_text("def f():\n    from c import x\n    return x\n")
    (bench / "c.py").write_text("import a.sub as s\nx = 1\n")
    (bench / "d.py").write_text("import a, b\nimport os\n")
    modules = sorted(bench.glob("*.py"))
    assert _circle(_imports(modules)) == ["a", "b", "c", "a"]
    (bench / "c.py").write_text("import os\nx = 1\n")
    assert _circle(_imports(modules)) is None
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FILE_LINES))
    (bench / "long.py").write_text(f"def long_function():\n{body}")
    for i in range(10):
        (bench / f"m{i}.py").write_text("x = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "BENCHMARKS", bench)
    offenders = _bench_offenders()
    assert len(offenders) == 2, offenders  # the file (> 600 lines) and its function
    assert any("long_function" in o for o in offenders) and any("(file, > 600)" in o for o in offenders)
