"""bench_train's ``--models`` / ``--recipes``: an item that selects nothing is refused
before anything runs (issue 44), and every name gpu_check.sh hands it selects something."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_train  # noqa: E402


def gpu_check_selections() -> list[tuple[str, str]]:
    """``(flag, value)`` of every ``--models`` / ``--recipes`` gpu_check.sh passes to
    bench_train.py, its shell variables (``NAME="..."``, ``NAME+="..."``) expanded."""
    text = (BENCH / "gpu_check.sh").read_text()
    variables: dict[str, str] = {}
    for name, plus, value in re.findall(r'^([A-Z0-9_]+)(\+?)="([^"]*)"', text, re.M):
        variables[name] = variables.get(name, "") + value if plus else value
    found = []
    for command in re.findall(r"bench_train\.py(.*?)\"\$\{SMOKE\[@\]\}\"", text, re.S):
        for flag, quoted, bare in re.findall(r'(--models|--recipes)\s+(?:"([^"]*)"|(\S+))', command):
            value = quoted or bare
            found.append((flag, re.sub(r"\$\{?([A-Z0-9_]+)\}?", lambda m: variables[m.group(1)], value)))
    return found


def test_gpu_check_names_only_what_bench_train_has_on_a_gpu_and_in_the_dry_run():
    found = gpu_check_selections()
    flags = {flag for flag, _ in found}
    assert flags == {"--models", "--recipes"} and len(found) >= 12, found  # the parse saw the phases
    for smoke in (False, True):
        names = {"--models": bench_train.case_names(smoke), "--recipes": list(bench_train.RECIPES)}
        for flag, value in found:
            bench_train.check_selection(value, names[flag], flag)  # raises SystemExit on a no-op item


@pytest.mark.parametrize(
    ("argv", "item"),
    [
        (["--recipes", "tkern,=torch autocst"], "'=torch autocst'"),
        (["--recipes", "torchao8"], "'torchao8'"),
        (["--models", "gpt3"], "'gpt3'"),
        (["--models", ","], "','"),
        (["--profile", "--models", "gpt2-small"], "'gpt2-small'"),  # a GPU's case, not the smoke run's
    ],
)
def test_an_item_that_selects_nothing_is_refused_before_anything_runs(argv, item, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was built before the selection was checked")

    monkeypatch.setattr(bench_train, "cases", never)
    monkeypatch.setattr(bench_train, "run_profiles", never)
    with pytest.raises(SystemExit) as exc:
        bench_train.main(["--smoke", *argv])
    message = str(exc.value)
    assert item in message and "selects nothing" in message
    # the valid names are listed: the smoke run's cases or every recipe
    assert ("gpt2-tiny" in message) if "--models" in argv else ("torch autocast compiled" in message)


def test_prefixes_and_exact_names_select_as_documented():
    names = list(bench_train.RECIPES)
    bench_train.check_selection("tkern fp8,torchao,=torch autocast bf16", names, "--recipes")
    assert [n for n in names if bench_train._picked(n, "=tkern")] == ["tkern"]
    assert len([n for n in names if bench_train._picked(n, "tkern fp8")]) == len(bench_train.FP8_RECIPES)
