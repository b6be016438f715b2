"""The examples in examples/ run as a user would run them, and learn.

Each runs in a fresh interpreter with a few steps; the script prints
``loss A -> B`` and B must be below A. Examples that need an optional package
are skipped, naming it, when it is absent (`make test` installs ``.[integrations]``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize(
    "script, args, package",
    [
        ("custom_loop.py", ["--steps", "6"], None),
        ("fsdp.py", ["--steps", "6"], None),  # 2 local gloo processes (FSDP2 on CPUs)
        ("hf_trainer.py", ["--steps", "4"], "transformers"),
        ("lightning.py", ["--steps", "4"], "lightning"),
        ("lightning.py", ["--steps", "4", "--manual"], "lightning"),
    ],
)
def test_example_runs_and_learns(script, args, package):
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{script} needs {package}, which is not installed (pip install -e '.[integrations]')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    first, last = map(float, match.groups())
    assert last < first, proc.stdout[-2000:]


def test_examples_take_a_steps_flag():
    for script in sorted(EXAMPLES.glob("*.py")):
        assert "--steps" in script.read_text(), script.name


def test_readme_quick_start_runs_as_written_and_learns(tmp_path):
    """The README's ```python blocks (the quick start, then the trainer going on from it) in
    order in one fresh interpreter, as a user pastes them: the loss falls over the quick start's
    two epochs and nothing reaches stderr that names a warning (Python's or the interpreter's).
    tests/test_docs.py leaves the README's blocks to this test (one run, not two)."""
    import test_docs

    blocks = test_docs.python_blocks(ROOT / "README.md")
    assert blocks and "## Quick start" in (ROOT / "README.md").read_text()
    code = "\n".join(code for _, code in blocks)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = [line.split() for line in proc.stdout.split("\n") if re.fullmatch(r"[01] \S+", line.strip())]
    losses = [float(loss) for _, loss in epochs]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout
    assert (tmp_path / "run.ckpt").is_file()  # the trainer block ran to its checkpoint
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # nothing the interpreter says reaches the user
