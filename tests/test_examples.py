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
        ("custom_loop.py", ["--steps", "12"], None),
        ("fsdp.py", ["--steps", "12"], None),  # 2 local gloo processes (FSDP2 on CPUs)
        ("hf_trainer.py", ["--steps", "4"], "transformers"),
        ("lightning.py", ["--steps", "8"], "lightning"),
        ("lightning.py", ["--steps", "8", "--manual"], "lightning"),
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


def test_readme_quick_start_runs_as_written_and_learns():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[1]) for line in proc.stdout.split("\n") if line.strip()]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # nothing the interpreter says reaches the user
