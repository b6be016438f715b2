"""``tkern train --model gpt`` (tkern/train/gpt_job.py): the paper's claim on a language
model, through the command itself, and the command's errors on bad input."""

from __future__ import annotations

import copy
import inspect
import sys

import pytest
import torch
from conftest import rel_err

from tkern.train import gpt_job
from tkern.train.cli import main

#: The claim tested: tkern fp16's and bf16's final validation loss within this of
#: fp32's (relative), from the same weights on the same batches.
CLAIM_TOLERANCE = 0.02


def _rows(printed: str) -> dict[str, list[str]]:
    """The table's rows by run name (the lines after the header's rule)."""
    lines = printed.splitlines()
    runs = [[name] for name in gpt_job.RUNS]
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "} and line.strip())
    return {line.split()[0]: line.split() for line in lines[rule + 1 :] if line.split()[:1] in runs}


@pytest.mark.slow
def test_tkern_fp16_and_bf16_match_fp32_validation_loss(tmp_path, capsys):
    """The CPU configuration made smaller (1 block, 12 steps of 2 x 16 characters;
    the interpreter's time is per row of every norm), seed 0: tkern fp16's and
    bf16's validation bits per character within 2% of fp32's, and the figure drawn."""
    png = tmp_path / "gpt.png"
    argv = ["train", "--model", "gpt", "--only", "fp32,tkern,tkern-bf16", "--steps", "12"]
    argv += ["--eval-every", "12", "--layers", "1", "--batch-size", "2", "--block-size", "16", "--seed", "0"]
    assert main([*argv, "--no-progress", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"fp32", "tkern", "tkern-bf16"}, out
    fp32 = float(rows["fp32"][1])
    assert fp32 < 7.0, out  # it learned: log2(128) = 7 bits is a uniform guess
    for name in ("tkern", "tkern-bf16"):
        assert float(rows[name][1]) == pytest.approx(fp32, rel=CLAIM_TOLERANCE), out
    assert png.stat().st_size > 10_000


@pytest.mark.filterwarnings("ignore:convert_network")
def test_tkern_run_starts_at_torchs_loss_scale_and_keeps_its_first_step():
    """The tkern run's DynamicLossScaler starts at torch.amp.GradScaler's 2^16. There the CPU
    job's first step (seed 0) is kept: every fp16 gradient is finite and, divided by S, within
    test_hf_fused_loss.py's bound for one layer of fp16 rounding (5e-3) of fp32's, the tied
    embedding and LM head included (its gradient is scaled in fp32 in the fused loss; rounded
    to fp16 first, 2^16 became inf and the first step was skipped)."""
    cpu = torch.device("cpu")
    cfg = gpt_job.default_config(cpu)
    corpus = gpt_job.prepare(cfg)
    base, _ = gpt_job.make_model(cfg, corpus.vocab_size)
    model, opt, scaler, _, _ = gpt_job.build("tkern", base, cfg, cpu)
    torch_default = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default
    assert scaler.get_scale() == torch_default == 2.0**16
    x, _ = next(iter(gpt_job.Batches(corpus.train, cfg, cpu)))
    scaler.scale(model(x)).backward()
    ref = copy.deepcopy(base)
    ref(x).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p.grad).all(), name
        assert rel_err(p.grad.double() / 2.0**16, r.grad) < 5e-3, name
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0 and scaler.get_scale() == 2.0**16


def test_batches_are_the_same_for_every_run():
    cfg = gpt_job.GPTConfig(steps=4, batch_size=2, block_size=8, eval_every=2)
    ids = torch.arange(100)
    a, b = gpt_job.Batches(ids, cfg, torch.device("cpu")), gpt_job.Batches(ids, cfg, torch.device("cpu"))
    first = [x for x, _ in a] + [x for x, _ in a]
    assert len(first) == 4 and all(x.shape == (2, 8) for x in first)
    assert all(torch.equal(x, y) for x, y in zip(first, [x for x, _ in b] + [x for x, _ in b], strict=True))
    assert all(torch.equal(x[:, 1:], x[:, :-1] + 1) for x in first)  # consecutive characters


def test_default_text_is_cpythons_help_and_splits_a_tenth():
    text, source = gpt_job.load_text(None)
    assert len(text) > 400_000 and "pydoc_data" in source
    corpus = gpt_job.make_corpus(text, source, 32)
    assert len(corpus.val) == len(text) // 10
    assert corpus.vocab_size % gpt_job.VOCAB_MULTIPLE == 0 and corpus.vocab_size >= len(corpus.chars)


@pytest.mark.parametrize(
    ("write", "extra", "message"),
    [
        (None, [], "--data: cannot read"),
        (b"\xff\xfe not utf-8" * 100, [], "is not UTF-8 text"),
        (b"short text", [], "has 10 characters; a block of 32 needs at least 320"),
        ("dir", [], "is a directory"),
        (b"x" * 1000, ["--epochs", "2"], "--epochs applies to --model mlp"),
        (b"x" * 1000, ["--only", "tkern,bogus"], "--only: 'bogus' is not a run of --model gpt"),
        (b"x" * 1000, ["--width", "30", "--heads", "4"], "--width 30 is not a multiple of --heads 4"),
        (b"x" * 1000, ["--only", "fp32", "--float8", "tensorwise"], "--float8 applies to the tkern-fp8 run"),
    ],
)
def test_bad_input_is_one_line_before_training(tmp_path, capsys, write, extra, message):
    path = tmp_path / "text.txt"
    if write == "dir":
        path.mkdir()
    elif write is not None:
        path.write_bytes(write)
    argv = ["train", "--model", "gpt", "--data", str(path), "--block-size", "32", "--no-progress", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tkern train: error: ") and message in err, err
    assert err.count("\n") == 1


def test_gpt_options_are_refused_for_the_mlp(capsys):
    assert main(["train", "--data", "x.txt"]) == 2
    assert "--data applies to --model gpt" in capsys.readouterr().err


def test_without_transformers_the_same_shape_in_plain_torch(monkeypatch):
    """transformers missing (its import fails): the job trains tkern.train.gpt_job.CharGPT,
    says so, and tkern's run of it stays within the claim's tolerance of fp32's."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    cfg = gpt_job.GPTConfig(steps=2, batch_size=1, block_size=8, eval_every=2, eval_windows=2, progress=False)
    cfg.runs = ("fp32", "tkern")
    text = "the quick brown fox jumps over the lazy dog. " * 4
    corpus = gpt_job.make_corpus(text, "fox", cfg.block_size)
    results, what, _ = gpt_job.compare(cfg, torch.device("cpu"), corpus)
    assert "CharGPT" in what and "transformers is not installed" in what
    fp32, tk = results
    assert tk.val_bpc == pytest.approx(fp32.val_bpc, rel=CLAIM_TOLERANCE)
    assert tk.skipped_steps == 0 and len(tk.train_bpc) == 2


@pytest.mark.filterwarnings("ignore:convert_network")
def test_compile_option_compiles_the_tkern_runs(capsys):
    # --compile: the tkern runs train under torch.compile(fullgraph=True), tkern-graph (its own
    # CUDA graphs) and the baselines as before; one step of the compiled model (aot_eager here:
    # inductor's codegen takes a minute on this CPU; tests/test_hf_compile.py runs both) equals
    # the eager one's loss
    from tkern.train.cli import build_parser, gpt_config

    cfg = gpt_config(build_parser().parse_args(["train", "--model", "gpt", "--compile"]))
    assert cfg.compile
    lm, _ = gpt_job.make_model(cfg, 16)
    built = {
        name: gpt_job.build(name, lm, cfg, torch.device("cpu"))[0]
        for name in ("tkern", "tkern-graph", "fp32")
    }
    compiled = built["tkern"]
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(built["tkern-graph"], torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(built["fp32"], torch._dynamo.eval_frame.OptimizedModule)
    ids = torch.randint(0, 16, (1, 8))
    eager_loss = compiled._orig_mod(ids)
    torch._dynamo.reset()
    loss = torch.compile(compiled._orig_mod, fullgraph=True, backend="aot_eager")(ids)
    assert torch.equal(loss, eager_loss)
    assert main(["train", "--compile", "--no-progress"]) == 2
    assert "--compile applies to --model gpt" in capsys.readouterr().err
