"""The ``tkern`` command's help and its promises before it trains (issue 47 item 4):
``--help`` names both jobs and every option's default; the GPT job on a CPU says how
long it will take before any run starts; cli.py stays within the house's lines."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import torch

from tkern.train import cli, gpt_job
from tkern.train.cli import main

CLI_FILE = Path(cli.__file__)


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_help_names_both_jobs(capsys):
    assert _exit_code(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the digits MLP" in out and "--model gpt, a character-level GPT" in out
    assert _exit_code(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--model gpt (the character-level GPT) only" in out and "--model mlp (the digits MLP) only" in out
    assert "it prints how long it will take first" in out


def test_every_train_option_shows_its_default():
    parser = cli.build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    formatter = train.formatter_class(prog="tkern train")
    options = [a for a in train._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 25
    missing = [a.option_strings[0] for a in options if "(default:" not in formatter._get_help_string(a)]
    assert not missing, f"options whose --help shows no default: {missing}"
    cpu, gpu = cli._gpt_defaults()
    steps = next(a for a in options if a.dest == "steps")
    assert f"(default: {cpu.steps} on a CPU, {gpu.steps} on a GPU)" in formatter._get_help_string(steps)


def test_cli_file_is_within_the_house_lines():
    """No function of cli.py over 80 lines, the file under 600 (issue 46 item 6)."""
    source = CLI_FILE.read_text()
    assert len(source.splitlines()) < 600
    long = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, long


def test_estimate_is_steps_and_validations_times_the_timed_step(monkeypatch):
    """Each tkern run costs the timed tkern step, each torch run the timed fp32 step,
    times (steps + a third of a step per validation batch)."""
    timed = {"tkern": 2.0, "fp32": 0.01}
    monkeypatch.setattr(gpt_job, "time_one_step", lambda name, *args: timed[name])
    cfg = gpt_job.GPTConfig(steps=16, eval_every=4, eval_windows=4, batch_size=2, block_size=8)
    corpus = gpt_job.make_corpus("abcdefgh" * 200, "test", cfg.block_size)
    seconds, how = gpt_job.estimate(cfg, corpus, None, torch.device("cpu"))
    per_run = 16 + gpt_job.FORWARD_SHARE * 4 * 2  # 4 validations of 2 batches (4 windows, 2 a batch)
    assert seconds == pytest.approx(per_run * (2 * 2.0 + 2 * 0.01))  # tkern, tkern-bf16; fp32, autocast
    assert "2 tkern and 2 torch runs" in how
    assert gpt_job.duration(40) == "40 s" and gpt_job.duration(150) == "2.5 min"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the estimate is the CPU's")
def test_gpt_job_on_a_cpu_says_how_long_before_any_run_starts(monkeypatch, capsys):
    """The estimate's line is printed, from a step really timed here, before the runs."""
    printed_before = []

    def no_runs(*args, **kwargs):
        printed_before.append(capsys.readouterr().out)
        raise KeyboardInterrupt  # stop before training

    monkeypatch.setattr(gpt_job, "compare", no_runs)
    argv = ["train", "--model", "gpt", "--only", "fp32,tkern", "--steps", "2", "--eval-every", "2"]
    argv += ["--block-size", "8", "--batch-size", "1", "--no-progress"]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    (out,) = printed_before
    line = next(line for line in out.splitlines() if line.startswith("this will take about "))
    assert "one step timed here: tkern" in line and "1 tkern and 1 torch runs" in line
