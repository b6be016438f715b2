"""The suite on a GPU machine runs only what a GPU can run: every test that drives the
CPU recorder, Triton's interpreter or the compile gate skips there, for a stated
reason. Checked by collecting the suite as a GPU machine would
(``TKERN_FAKE_CUDA_COLLECT=1``, tests/conftest.py; nothing launched) and reading
tests/gpu_collection.py's report; the classifier itself is checked on a test module
written here, so the check can fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gpu_collection
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collect(*paths: str, cwd: Path = ROOT, plugin: bool = False) -> list[tuple[str, str, str]]:
    """``(status, node id, uses)`` of every GPU-COLLECT line of a fake-CUDA collection;
    ``plugin``: load tests/conftest.py as a plugin (for tests outside tests/)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TKERN_FAKE_CUDA_COLLECT="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-s", "-p", "no:cacheprovider"]
        + (["-p", "conftest"] if plugin else [])
        + list(paths),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith(gpu_collection.PREFIX + " "):
            status, rest = line[len(gpu_collection.PREFIX) + 1 :].split(" ", 1)
            nodeid, uses = rest.split(" | ")
            rows.append((status, nodeid, uses))
    return rows


@pytest.mark.slow
def test_on_a_gpu_machine_nothing_collected_needs_the_cpu():
    rows = _collect("tests")
    running = [f"{nodeid} ({uses})" for status, nodeid, uses in rows if status == "runs"]
    assert running == [], "these would run on a GPU machine:\n" + "\n".join(running)
    # the classifier saw what it must: the recorder's tests and the whole compile gate
    by_use = {u: [n for s, n, uses in rows if u in uses.split(",")] for u in ("recorder", "compile gate")}
    assert len(by_use["recorder"]) >= 15
    assert {n.split("::")[0] for n in by_use["recorder"]} == {
        "tests/test_health.py",
        "tests/test_optim_graph.py",
        "tests/test_optim_one_pass.py",
        "tests/test_trainer_auto.py",
        "tests/test_trainer_graph.py",
    }
    # every tests/test_compiled*.py
    assert by_use["compile gate"] and all(n.startswith("tests/test_compiled") for n in by_use["compile gate"])


def test_the_check_finds_an_unskipped_recorder_test_through_a_helper(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from graph_recorder import RecordingCapture
            from triton.runtime.interpreter import InterpretedFunction
            from conftest import needs_recorder

            def _helper():
                return RecordingCapture()

            def test_through_a_helper():
                _helper()

            @needs_recorder
            def test_marked():
                RecordingCapture()

            def test_interpreter():
                assert InterpretedFunction

            @pytest.mark.compiled
            def test_gate():
                pass

            def test_plain():
                pass
            """
        )
    )
    rows = _collect(str(tmp_path / "test_synthetic.py"), cwd=tmp_path, plugin=True)
    got = {nodeid.split("::")[1]: (status, uses) for status, nodeid, uses in rows}
    assert got == {
        "test_through_a_helper": ("runs", "recorder"),
        "test_marked": ("skipped", "recorder"),
        "test_interpreter": ("runs", "interpreter"),
        "test_gate": ("runs", "compile gate"),
    }
