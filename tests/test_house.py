"""The house's lines (issue 46 item 6), over every module of tkern/: no file over
600 lines outside tkern/kernels/, no class over 350 lines, no function over 80
lines outside tkern/kernels/ (a jit kernel is one program and may be longer).
A file or class past its line is a sign it does two jobs: split it by
responsibility rather than raise the number."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tkern

PACKAGE = Path(tkern.__file__).parent
KERNELS = PACKAGE / "kernels"
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


def _offenders() -> list[str]:
    found = []
    for path in _modules():
        name = str(path.relative_to(PACKAGE.parent))
        in_kernels = KERNELS in path.parents
        source = path.read_text()
        if not in_kernels and len(source.splitlines()) > MAX_FILE_LINES:
            found.append(f"{name}: {len(source.splitlines())} lines (file, > {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(source, filename=name)):
            if isinstance(node, ast.ClassDef):
                kind, limit = "class", MAX_CLASS_LINES
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not in_kernels:
                kind, limit = "function", MAX_FUNCTION_LINES
            else:
                continue
            if _lines(node) > limit:
                found.append(f"{name}:{node.lineno} {kind} {node.name}: {_lines(node)} lines (> {limit})")
    return found


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
