"""The README and docs/ pages: every ```python block runs, every relative link resolves.

Code blocks: each ```python block of docs/*.md is one test case (README.md's run in
tests/test_examples.py, in a fresh interpreter), named
``<file>:<line>``. The blocks of one page run in order in ONE namespace (a page builds on
itself: the README's trainer block goes on from the quick start), a fresh namespace per page,
on CPU tensors through Triton's interpreter, in a temporary working directory (a block may
write a checkpoint). A case runs the blocks of its page that this process has not run yet, so
the cases also pass one at a time or spread over xdist workers. Commands and scripts that
need more than one CPU process (a torchrun script) are written as ```text or ```bash, and
their runnable form lives in examples/ or tests/.

Links: every relative link's file exists, and a ``#anchor`` into a Markdown file names one
of its headings (GitHub's slugs).
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tkern

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

#: Pages other branches write (issue 29): links to them are allowed before they exist.
#: The lead empties this set when those branches are merged (test_pending_pages_are_pending
#: fails once a listed page exists).
PENDING: set[str] = set()

FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line of the first code line, code) of each fenced block, in order."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if lang is None and match:
            lang, start, body = match.group(1), number + 1, []
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{rel(path)}: a code block opened at line {start - 1} is never closed"
    return blocks


def python_blocks(path: Path) -> list[tuple[int, str]]:
    return [(line, code) for lang, line, code in fenced_blocks(path) if lang == "python"]


#: The README's blocks run in tests/test_examples.py (a fresh interpreter, as a user pastes them,
#: where it also checks that the quick start learns): run here too, they cost a minute twice.
RUN_ELSEWHERE = {
    ROOT / "README.md": "tests/test_examples.py::test_readme_quick_start_runs_as_written_and_learns",
}
CASES = [
    (page, index) for page in PAGES if page not in RUN_ELSEWHERE for index in range(len(python_blocks(page)))
]


def case_id(case: tuple[Path, int]) -> str:
    page, index = case
    return f"{rel(page)}:{python_blocks(page)[index][0]}"


#: Per page: the namespace its blocks run in and how many of its blocks have run.
_RUN: dict[Path, tuple[dict, int]] = {}


def run_block(page: Path, line: int, code: str, namespace: dict) -> None:
    # Padded so that a traceback names the page and the line of the failing statement.
    compiled = compile("\n" * (line - 1) + code, str(page), "exec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compiled, namespace)
    # A block that makes tkern (or torch, on tkern's behalf) warn is a bad example: the
    # user copying it would see the warning.
    said = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, DeprecationWarning)
    ]
    assert not said, f"{rel(page)}:{line} warned: {said}"


@pytest.mark.skipif(not tkern.INTERPRET, reason="the blocks use CPU tensors: Triton's interpreter only")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_code_block_runs(case, tmp_path, monkeypatch):
    page, index = case
    blocks = python_blocks(page)
    namespace, done = _RUN.get(page, (None, 0))
    if namespace is None or done > index:  # first block of the page here, or a rerun
        torch.manual_seed(0)
        namespace, done = {"__name__": f"docs_{page.stem}"}, 0
    monkeypatch.chdir(tmp_path)
    for k in range(done, index + 1):
        _RUN[page] = (namespace, k)  # a block that fails is run again by the next case
        run_block(page, *blocks[k], namespace)
    _RUN[page] = (namespace, index + 1)


def github_slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def code_lines(path: Path) -> set[int]:
    """The line numbers of fenced blocks, fences included."""
    return {
        n for _, start, code in fenced_blocks(path) for n in range(start - 1, start + code.count("\n") + 1)
    }


def anchors(path: Path) -> set[str]:
    skip = code_lines(path)
    lines = path.read_text().splitlines()
    return {
        github_slug(line.lstrip("#"))
        for n, line in enumerate(lines, 1)
        if line.startswith("#") and n not in skip
    }


def prose(path: Path) -> str:
    """The page without its fenced blocks and inline code (a link there is not a link)."""
    skip = code_lines(path)
    lines = [line for n, line in enumerate(path.read_text().splitlines(), 1) if n not in skip]
    return INLINE_CODE.sub("", "\n".join(lines))


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    missing = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            if path.is_relative_to(ROOT) and rel(path) in PENDING:
                continue
            missing.append(f"{target} (no file {path})")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            missing.append(f"{target} (no heading #{anchor} in {rel(path)})")
    assert not missing, f"{rel(page)}: broken links: {missing}"


def test_pending_pages_are_pending():
    landed = sorted(p for p in PENDING if (ROOT / p).exists())
    assert not landed, f"{landed} exist now: remove them from PENDING in tests/test_docs.py"


def test_the_testing_page_lists_every_test_file():
    """docs/testing.md's layout has a line for each tests/test_*.py (issue 55 item 2)."""
    page = (ROOT / "docs" / "testing.md").read_text()
    listed = set(re.findall(r"^\| `(test_\w+\.py)` \|", page, re.M))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert files - listed == set(), f"docs/testing.md does not list {sorted(files - listed)}"
    assert listed - files == set(), f"docs/testing.md lists missing files {sorted(listed - files)}"


def test_readme_is_short_and_links_every_page():
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(prose(readme))}
    pages = {p.resolve() for p in PAGES[1:]} | {(ROOT / p).resolve() for p in PENDING}
    unlinked = sorted(rel(p) for p in pages - linked)
    assert not unlinked, f"README.md does not link {unlinked}"
    text = readme.read_text()
    for marker in ("<!-- results-table:start -->", "<!-- results-table:end -->"):
        assert text.count(marker) == 1, f"README.md must hold {marker} exactly once (benchmarks/report.py)"


def test_parser_finds_blocks_and_links(tmp_path):
    # The checks above would pass vacuously if the parsers found nothing.
    page = tmp_path / "page.md"
    page.write_text(
        "# A `b`: c\n\nsee [x](other.md#a-b-c) and `[y](z.md)`\n\n"
        "```python\nx = 1\n```\n\n```text\n[q](nowhere.md)\n```\n"
    )  # fmt: skip
    assert python_blocks(page) == [(6, "x = 1\n")]
    assert LINK.findall(prose(page)) == ["other.md#a-b-c"]
    assert anchors(page) == {"a-b-c"}
    assert len(CASES) >= 8, CASES


# ------------------------------------------------- prose against the measured results
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_BLOCK = re.compile(r"<!-- results-table:start -->.*?<!-- results-table:end -->", re.S)
#: GPU names a page might say something was measured on
DEVICE = re.compile(r"\b(?:A100|A10G?|L4|L40S|H100|H200|H20|B100|B200|GB200|MI300X?)\b")
MEASURED = re.compile(r"measured|timed|\bGPU run|\bran on|\bruns? on|benchmark", re.I)
#: a speed or memory ratio against a peer, as prose would state one ("1.41x autocast")
PEER_FIGURE = re.compile(
    r"(?<![\w.])(\d+\.\d+)x\b(?=[^.\n]{0,40}?(?:autocast|torch|GradScaler|cuBLAS|torchao|Liger|AdamW|eager))"
)
BOUND = re.compile(r"(?:<=|>=|<|>|target[^.]{0,20}?)\s*$")
#: sentences that say something was never measured: (claim, what in the results contradicts it)
NEVER_MEASURED = [
    (re.compile(r"\bno fp8 figure|\bno fp8 \w+ (?:has been|was) measured", re.I), "fp8"),
    (re.compile(r"\bnot yet (?:run|measured) on a GPU", re.I), "graph"),
    (re.compile(r"\bthe (?:one|only) GPU run\b", re.I), "second GPU"),
]


def _gpu_payloads() -> list[dict]:
    payloads = []
    for path in sorted(RESULTS.glob("*/*.json")):
        payload = json.loads(path.read_text())
        if path.parent.name not in ("host", "static") and payload.get("device") not in (None, "cpu"):
            payloads.append(payload)
    return payloads


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _measured(payloads: list[dict]) -> dict[str, bool]:
    """What the results hold, for the never-measured claims."""
    rows = [r for p in payloads for r in p.get("rows", []) if r.get("ms")]
    return {
        "fp8": any("fp8" in r["impl"] or str(r["case"]).startswith("fp8") for r in rows),
        "graph": any(r["impl"] == "tkern whole-step graph" and r.get("graph_replays") for r in rows),
        "second GPU": len({p["device"] for p in payloads}) > 1,
    }


def _prose_pages() -> dict[str, str]:
    """Each page's prose (no code, no inline code), README without its generated results."""
    out = {}
    for page in PAGES:
        text = prose(page)
        out[rel(page)] = RESULTS_BLOCK.sub("", text) if page.name == "README.md" else text
    return out


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def test_pages_name_no_device_figure_or_absence_the_results_contradict():
    """docs/ and the README (outside the block report.py writes) must agree with
    benchmarks/results/: a GPU said to have measured something is one the results
    hold; a ratio against a peer ("1.41x autocast") is a value of a results file or a
    target's bound; "no fp8 figure", "not yet run on a GPU" (the whole-step graph) and
    "the one GPU run" are false once the results hold them. Pages link to the README's
    generated summary instead of stating figures."""
    payloads = _gpu_payloads()
    devices = {d for p in payloads for d in DEVICE.findall(p["device"])}
    values = {
        round(n, 6) for path in RESULTS.glob("*/*.json") for n in _numbers(json.loads(path.read_text()))
    }
    import report  # benchmarks/report.py: the targets' bounds

    bounds = {float(t.bound) for t in report.TARGETS if t.bound is not None}
    measured = _measured(payloads)
    wrong = []
    for page, text in _prose_pages().items():
        for sentence in _sentences(text):
            named = set(DEVICE.findall(sentence))
            if named - devices and MEASURED.search(sentence):
                wrong.append(
                    f"{page}: names {sorted(named - devices)} (results hold {sorted(devices)}): {sentence}"
                )
            for m in PEER_FIGURE.finditer(sentence):
                figure, digits = float(m.group(1)), len(m.group(1).split(".")[1])
                if BOUND.search(sentence[: m.start()]):
                    ok = figure in bounds
                else:
                    ok = any(round(v, digits) == figure for v in values)
                if not ok:
                    wrong.append(f"{page}: {m.group(0)} is in no results file: {sentence}")
            for claim, what in NEVER_MEASURED:
                if claim.search(sentence) and measured[what]:
                    wrong.append(f"{page}: the results hold {what} figures: {sentence}")
    assert not wrong, "\n".join(wrong)


def test_the_prose_check_catches_the_sentences_issue_47_found(monkeypatch):
    """The check above, on the sentences issue 47 quoted, against the committed results."""
    stale = {
        "docs/x.md": "The one GPU run so far is an H100. No fp8 figure has been measured on a GPU. "
        "The whole-step graph: not yet run on a GPU. The step ran on an A100 at 1.77x autocast.",
    }
    monkeypatch.setattr(sys.modules[__name__], "_prose_pages", lambda: stale)
    with pytest.raises(AssertionError) as caught:
        test_pages_name_no_device_figure_or_absence_the_results_contradict()
    said = str(caught.value)
    for part in ("second GPU", "fp8 figures", "graph figures", "['A100']", "1.77x"):
        assert part in said, (part, said)
