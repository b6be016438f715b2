"""Trainer, the digits comparison against torch.autocast, and the tkern command."""

from __future__ import annotations

import errno
import os
import re
import statistics

import pytest
import torch
from conftest import DEVICE
from torch import nn

import tkern
from tkern.flat import ALIGN, round_up
from tkern.optim import FusedAdamW, FusedSGD
from tkern.train import demo
from tkern.train.cli import main


def synthetic_loader(n=96, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True)


def small_trainer(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2)).to(DEVICE)
    tkern.convert_network(model)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    scaler = tkern.DynamicLossScaler(init_scale=2.0**12, growth_interval=4)
    return tkern.Trainer(
        model, opt, nn.functional.cross_entropy, scaler, scheduler=sched, progress=False, **kwargs
    )


def test_fastai_mixed_precision_test_adapted():
    # fastai's test of its MixedPrecision callback: two Linear(1, 1), SGD
    # without momentum, 3 epochs of synthetic linear data; the loss must fall.
    g = torch.Generator().manual_seed(42)
    x = torch.randn(160, 1, generator=g)
    y = 2.0 * x + 3.0 + 0.1 * torch.randn(160, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    torch.manual_seed(0)
    model = tkern.convert_network(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)).to(DEVICE))
    trainer = tkern.Trainer(
        model,
        FusedSGD(model.parameters(), lr=1e-2),
        nn.functional.mse_loss,
        tkern.DynamicLossScaler(),
        progress=False,
    )
    epochs = trainer.fit(loader, 3)
    assert epochs[2]["train_loss"] < epochs[1]["train_loss"] < epochs[0]["train_loss"]


def test_checkpoint_resume_is_bit_exact(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    full = small_trainer()
    full.fit(synthetic_loader(), 2, checkpoint_path=ckpt)  # checkpoint after epoch 2
    full.fit(synthetic_loader(), 4)  # continue to epoch 4 uninterrupted

    torch.manual_seed(123)  # scramble the RNG: the checkpoint must restore it
    resumed = small_trainer()
    resumed.load_checkpoint(ckpt)
    assert resumed.epoch == 2
    resumed.fit(synthetic_loader(), 4)
    for p, q in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(
            full.optimizer.state[p].get("master", p), resumed.optimizer.state[q].get("master", q)
        )
    assert [h["loss"] for h in full.history] == [h["loss"] for h in resumed.history]
    assert full.scaler.get_scale() == resumed.scaler.get_scale()
    assert full.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()


def test_interrupted_save_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    ckpt = tmp_path / "run.ckpt"
    trainer = small_trainer()
    trainer.fit(synthetic_loader(), 1, checkpoint_path=ckpt)
    good = ckpt.read_bytes()

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(ckpt)
    assert ckpt.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]


def test_load_missing_checkpoint():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        small_trainer().load_checkpoint("/no/such/file.ckpt")


def test_gradient_accumulation_and_history():
    trainer = small_trainer(accumulation_steps=3)
    trainer.fit(synthetic_loader(n=96, batch=8), 1)  # 12 micro-batches -> 4 steps
    assert trainer.step == 4 and [h["step"] for h in trainer.history] == [1, 2, 3, 4]
    assert all(h["scale"] == 2.0**12 for h in trainer.history[:3])
    assert trainer.history[3]["scale"] == 2.0**13  # grown after 4 clean steps


def test_last_short_accumulation_of_an_epoch_is_stepped():
    trainer = small_trainer(accumulation_steps=3)
    trainer.fit(synthetic_loader(n=80, batch=8), 1)  # 10 micro-batches: 3 + 3 + 3 + 1
    assert trainer.step == 4 and len(trainer.history) == 4


def test_memory_report_counts_master_state_grads_and_activations():
    trainer = small_trainer()
    trainer.fit(synthetic_loader(), 1)
    report = trainer.memory_report()
    n = sum(p.numel() for p in trainer.model.parameters())
    assert report["model"] == 2 * n  # fp16 params
    padded = sum(round_up(p.numel(), ALIGN) for p in trainer.model.parameters())  # the flat layout
    assert report["optimizer"] == (4 + 4 + 4) * padded + 4  # master, exp_avg, exp_avg_sq, the step count
    assert report["grads"] == 2 * n
    assert report["activations"] > 0
    assert report["total"] == sum(v for k, v in report.items() if k != "total")


def test_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        tkern.Trainer(model, "adam", nn.functional.mse_loss)
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
        tkern.Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, accumulation_steps=0
        )
    with pytest.raises(ValueError, match="epochs must be a non-negative int"):
        small_trainer().fit(synthetic_loader(), -1)


# ----------------------------------------------------------------------- vs torch.autocast


@pytest.mark.slow
def test_digits_tkern_tracks_autocast():
    """Both runs start from the same weights and see the same batches.

    Band: over the first 10 steps both evaluate nearly the same network with
    fp16 operands; their losses differ by a few fp16 roundings (u = 4.9e-4
    each): bound 2e-3 relative (4u; measured <= 4.1e-5). After that the two
    trajectories drift apart step by step (autocast rounds fp32 weights at
    each use, tkern keeps rounded copies of an fp32 master; the gradients
    round differently), so per-step losses are compared through epoch means,
    which average out the batch-to-batch noise: bound 2% relative (measured
    <= 0.36% over two seeds and 8 epochs: over 5x margin).
    """
    cfg = demo.Config(epochs=5, progress=False, runs=("tkern", "autocast"))
    mine, theirs = demo.compare(cfg)
    assert mine.val_accuracy > 0.9 and theirs.val_accuracy > 0.9
    first = [abs(a - b) / b for a, b in zip(mine.losses[:10], theirs.losses[:10], strict=True)]
    assert max(first) < 2e-3
    per_epoch = len(mine.losses) // cfg.epochs
    for e in range(cfg.epochs):
        a = statistics.mean(mine.losses[e * per_epoch : (e + 1) * per_epoch])
        b = statistics.mean(theirs.losses[e * per_epoch : (e + 1) * per_epoch])
        assert abs(a - b) / b < 0.02, e
    assert mine.skipped_steps == 0 and mine.final_scale == 2.0**16


# ----------------------------------------------------------------------- the command


def test_cli_train_only_tkern_with_checkpoint_and_resume(tmp_path, capsys):
    ckpt = tmp_path / "digits.ckpt"
    small = ["train", "--only", "tkern", "--hidden", "32", "--no-progress"]
    assert main([*small, "--epochs", "1", "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "tkern" in out and "val acc" in out and ckpt.is_file()
    assert main([*small, "--epochs", "2", "--resume", str(ckpt)]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--resume", "/no/such.ckpt"], "--resume: checkpoint '/no/such.ckpt' does not exist"),
        (["train", "--plot", "/no/such/folder/x.png"], "--plot: folder"),
    ],
)
def test_cli_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize(
    "argv", [["train", "--optimizer", "lamb"], ["train", "--hidden", "12,x"], ["train", "--epochs", "0"]]
)
def test_cli_bad_option_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cli_missing_extra_is_one_line(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError("no sklearn")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    assert main(["train", "--only", "tkern", "--epochs", "1", "--no-progress"]) == 2
    assert "needs scikit-learn: pip install 'tkern[demo]'" in capsys.readouterr().err


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out and tkern.mode() in out


# ----------------------------------------------------------------------- the command (issue 9, item 19)


def run_cli(argv):
    """The exit status of ``tkern argv`` (argparse's own errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def save_demo_checkpoint(path, **cfg):
    """A checkpoint of the CLI's tkern run for ``demo.Config(**cfg)``, without training."""
    config = demo.Config(**cfg)
    torch.manual_seed(0)
    model, opt, scaler, _ = demo.build(
        "tkern", demo.make_mlp(64, config.hidden, 10).to(DEVICE), config, torch.device(DEVICE)
    )
    tkern.Trainer(model, opt, nn.functional.cross_entropy, scaler, progress=False).save_checkpoint(path)


def no_training(*args, **kwargs):
    raise AssertionError("training started before the mistake was reported")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
        (["--lr=-1e-3"], "argument --lr: must be a finite number > 0"),
        (["--lr", "fast"], "argument --lr: expected a number like 3e-3, got 'fast'"),
        (["--checkpoint", "{tmp}"], "--checkpoint: '{tmp}' is a directory"),
        (["--checkpoint", "{tmp}/no/such/run.ckpt"], "--checkpoint: folder '{tmp}/no/such' does not exist"),
        (["--plot", "{tmp}/curves.txt"], "--plot: '{tmp}/curves.txt' is not an image file name"),
        (["--plot", "{tmp}"], "--plot: '{tmp}' is a directory"),
        (["--resume", "{tmp}"], "--resume: '{tmp}' is a directory"),
        (["--resume", "{tmp}/garbage.ckpt"], "--resume: checkpoint '{tmp}/garbage.ckpt' cannot be read"),
        (["--resume", "{tmp}/h32.ckpt", "--hidden", "16"], "does not fit this model: 0.weight is (32, 64)"),
        (["--resume", "{tmp}/sgd.ckpt"], "holds a FusedSGD optimizer's state, not a FusedAdamW's"),
        (["--resume", "{tmp}/h32.ckpt", "--only", "fp32"], "--resume applies to the tkern run"),
        (["--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
        (["--nproc", "two"], "argument --nproc: expected a positive integer, got 'two'"),
        (["--nproc", "3", "--batch-size", "2"], "--nproc: 3 processes split each batch of --batch-size 2"),
        (["--nproc", "2", "--only", "autocast"], "--nproc applies to the tkern run, but --only autocast"),
    ],
)
def test_cli_user_mistakes_are_one_line_and_exit_2(tmp_path, argv, message, capsys, monkeypatch):
    (tmp_path / "garbage.ckpt").write_bytes(b"not a checkpoint")
    save_demo_checkpoint(tmp_path / "h32.ckpt", hidden=(32,))
    save_demo_checkpoint(tmp_path / "sgd.ckpt", hidden=(32,), optimizer="sgd")
    monkeypatch.setattr(tkern.Trainer, "fit", no_training)
    argv = ["train", "--only", "tkern", "--hidden", "32", "--no-progress"] + [
        a.format(tmp=tmp_path) for a in argv
    ]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err and "\n" not in err and "Traceback" not in err


def test_cli_unwritable_checkpoint_folder(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(
            folder, os.W_OK
        ):  # root writes anywhere: make the folder refuse as a read-only mount does
            import tempfile

            def refuse(*args, **kwargs):
                raise PermissionError(errno.EROFS, "Read-only file system")

            monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
        monkeypatch.setattr(tkern.Trainer, "fit", no_training)
        assert run_cli(["train", "--only", "tkern", "--checkpoint", str(folder / "run.ckpt")]) == 2
    finally:
        folder.chmod(0o755)
    err = capsys.readouterr().err.strip()
    assert f"--checkpoint: cannot write in folder '{folder}'" in err and "\n" not in err


def test_cli_help_shows_defaults(capsys):
    assert run_cli(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in (
        "(default: 10)",
        "(default: 64)",
        "(default: 128,64)",
        "(default: adamw)",
        "(default: dynamic)",
    ):
        assert text in out
    assert "adamw 0.003, adam 0.003, sgd 0.1; sgd with momentum 0.9" in out


def test_sgd_gets_its_own_defaults_and_learns():
    # at Adam's 3e-3 and no momentum SGD stayed near chance (11.7% after 10 epochs)
    cfg = demo.Config(optimizer="sgd", epochs=5, progress=False, runs=("fp32",))
    for name in ("tkern", "fp32"):
        _, opt, _, _ = demo.build(name, demo.make_mlp(64, (8,), 10), cfg, torch.device("cpu"))
        assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.1, 0.9)
    (result,) = demo.compare(cfg)
    assert result.val_accuracy > 0.9  # measured 0.97 at 10 epochs, 0.88-0.90 at 3


def test_cli_underflow_every_samples_the_tkern_runs(monkeypatch):
    """``tkern train --underflow-every K`` reaches the tkern run's optimizer (the mlp's
    and the GPT job's), the other runs' torch optimizers untouched; K must be >= 1."""
    from tkern.train import gpt_job
    from tkern.train.cli import build_parser, gpt_config

    seen = []
    monkeypatch.setattr(demo, "compare", lambda cfg: seen.append(cfg) or [])
    assert main(["train", "--only", "tkern", "--no-progress", "--underflow-every", "3"]) == 0
    (cfg,) = seen
    assert cfg.underflow_every == 3
    base = demo.make_mlp(64, (8,), 10)
    _, opt, _, _ = demo.build("tkern", base, cfg, torch.device("cpu"))
    assert opt.underflow_every == 3 and opt.track_overflows
    _, opt, _, _ = demo.build("tkern", base, demo.Config(), torch.device("cpu"))
    assert opt.underflow_every is None and not opt.track_overflows  # off unless asked

    args = build_parser().parse_args(["train", "--model", "gpt", "--underflow-every", "2"])
    gcfg = gpt_config(args)
    assert gcfg.underflow_every == 2
    lm, _ = gpt_job.make_model(gcfg, 16)
    for name in ("tkern", "tkern-bf16"):
        _, opt, *_ = gpt_job.build(name, lm, gcfg, torch.device("cpu"))
        assert opt.underflow_every == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--underflow-every", "0"])


def test_cli_silences_numpy_cast_overflow_warnings(monkeypatch, capsys):
    import warnings

    import numpy as np

    def overflowing_compare(cfg):
        np.array([1e6], dtype=np.float32).astype(np.float16)  # what the interpreter does on overflow
        return []

    monkeypatch.setattr(demo, "compare", overflowing_compare)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", "--only", "tkern", "--no-progress"]) == 0
        assert not [w for w in seen if "overflow encountered in cast" in str(w.message)]
        np.array([1e6], dtype=np.float32).astype(np.float16)  # outside the command: not filtered
        assert [w for w in seen if "overflow encountered in cast" in str(w.message)]


@pytest.mark.slow
def test_cli_train_nproc_2_data_parallel(tmp_path, capsys):
    """``--nproc 2``: two gloo processes, the sharded optimizer, the same table.

    Both runs take the same 23 steps of a 64-sample batch (32 per process) from the same initial
    weights; only the shuffles differ (each process shuffles its half). After 2 epochs at lr 1e-2,
    seeds 0, 1, 2: 1 process 89.7%, 88.0%, 93.0% validation accuracy; 2 processes 87.5%, 88.6%,
    89.1% (at most 3.9 points, 14 of 359 samples, apart). Bound: 85% of the 1-process accuracy
    (about 13 points, over 3x that gap), far above chance (10%). The checkpoint the 2-process run
    wrote loads into one process (plain FusedAdamW) and evaluates to exactly the same accuracy.
    """

    def accuracy(out):
        row = next(line for line in out.splitlines() if line.startswith("tkern ") and "%" in line)
        return float(re.findall(r"([0-9.]+)%", row)[0]) / 100

    ckpt = tmp_path / "dp.ckpt"
    small = ["train", "--only", "tkern", "--hidden", "32", "--epochs", "2", "--lr", "1e-2", "--no-progress"]
    assert main([*small, "--nproc", "2", "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "data-parallel on 2 processes (gloo), sharded adamw, batch 32 per process" in out
    assert "val acc" in out and "ms/step" in out and ckpt.is_file()
    parallel = accuracy(out)
    assert main(small) == 0
    single = accuracy(capsys.readouterr().out)
    assert single > 0.8 and parallel > 0.85 * single
    assert main([*small, "--resume", str(ckpt)]) == 0  # 2 epochs done: loads, evaluates
    assert accuracy(capsys.readouterr().out) == parallel


def test_the_training_layer_is_one_package_with_one_name_for_each_module():
    import importlib
    from pathlib import Path

    import tkern.train

    top = Path(tkern.__file__).parent
    for name in ("trainer", "trainer_checkpoint", "trainer_memory", "checkpoint", "demo", "gpt_job", "cli"):
        assert not (top / f"{name}.py").exists(), name  # nothing left at the top level
        assert importlib.import_module(f"tkern.train.{name}").__name__ == f"tkern.train.{name}"
        with pytest.raises(ModuleNotFoundError):  # no second name (the old top-level one) for it
            importlib.import_module(f"tkern.{name}")
    from tkern.train.cli import main

    assert main.__module__ == "tkern.train.cli" and tkern.Trainer is tkern.train.Trainer
