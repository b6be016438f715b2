"""Trainer checkpoints: the file's atomic write and its rules (umask, symlinks, killed
saves, a full disk, weights_only, a flipped byte, validation before any change), and a
sharded optimizer's checkpoint resumed bit for bit on two ranks."""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE
from test_trainer import synthetic_loader
from torch import nn

import tkern
from tkern.optim import FusedAdamW, FusedSGD

# ----------------------------------------------------------------------- checkpoints (issue 9, item 17)


def variant_trainer(opt_cls=FusedAdamW, scaler="dynamic", scheduler="step", hidden=16, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, 2)).to(DEVICE)
    tkern.convert_network(model)
    opt = opt_cls(model.parameters(), lr=1e-2)
    scalers = {
        "dynamic": lambda: tkern.DynamicLossScaler(init_scale=2.0**12, growth_interval=4),
        "static": lambda: tkern.StaticLossScaler(2.0**10),
        None: lambda: None,
    }
    schedulers = {
        "step": lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7),
        "exp": lambda: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
        None: lambda: None,
    }
    return tkern.Trainer(
        model,
        opt,
        nn.functional.cross_entropy,
        scalers[scaler](),
        scheduler=schedulers[scheduler](),
        progress=False,
    )


def trained(trainer, n=16):
    trainer.fit(synthetic_loader(n=n), trainer.epoch + 1)
    return trainer


def snapshot(trainer):
    """Everything load_checkpoint could change, as comparable values."""
    opt = trainer.optimizer.state_dict()
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "opt_state": {k: {n: v.clone() for n, v in s.items()} for k, s in opt["state"].items()},
        "opt_groups": [{k: v for k, v in g.items()} for g in opt["param_groups"]],
        "scaler": None if trainer.scaler is None else trainer.scaler.state_dict(),
        "scheduler": None if trainer.scheduler is None else trainer.scheduler.state_dict(),
        "counters": (trainer.epoch, trainer.step, list(trainer.history)),
    }


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for k in a["opt_state"]:
        assert all(torch.equal(a["opt_state"][k][n], b["opt_state"][k][n]) for n in a["opt_state"][k])
    assert a["opt_groups"] == b["opt_groups"] and a["scheduler"] == b["scheduler"]
    assert a["counters"] == b["counters"]
    if a["scaler"] is not None:
        sa, sb = dict(a["scaler"]), dict(b["scaler"])
        ta, tb = sa.pop("state"), sb.pop("state")
        assert sa == sb and (ta is tb is None or torch.equal(ta, tb))


def test_checkpoint_respects_the_umask(tmp_path):
    trainer = trained(variant_trainer())
    old = os.umask(0o022)
    try:
        trainer.save_checkpoint(tmp_path / "a.ckpt")
        os.umask(0o077)
        trainer.save_checkpoint(tmp_path / "b.ckpt")
        os.chmod(tmp_path / "a.ckpt", 0o640)  # an existing file keeps its own mode
        trainer.save_checkpoint(tmp_path / "a.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "b.ckpt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "a.ckpt").st_mode) == 0o640
    os.umask(0o022)
    try:
        trainer.save_checkpoint(tmp_path / "c.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "c.ckpt").st_mode) == 0o644


def test_checkpoint_through_a_symlink_rewrites_the_target_and_keeps_the_link(tmp_path):
    trainer = trained(variant_trainer())
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "real.ckpt"
    target.write_bytes(b"an older checkpoint")
    link = tmp_path / "latest.ckpt"
    link.symlink_to(target)
    trainer.save_checkpoint(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["real.ckpt"]
    resumed = variant_trainer(seed=1)
    resumed.load_checkpoint(target)
    assert_same(snapshot(resumed), snapshot(trainer))


def test_checkpoint_save_removes_temporaries_of_killed_saves(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    script = (
        "import sys, time, torch, tkern\n"
        "from torch import nn\n"
        "m = nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "t = tkern.Trainer(m, opt, nn.functional.mse_loss, progress=False)\n"
        "def stuck(obj, f):\n"
        "    f.write(b'half a checkpoint'); f.flush(); print('writing', flush=True); time.sleep(120)\n"
        "torch.save = stuck\n"
        "t.save_checkpoint(sys.argv[1])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(ckpt)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"writing"
    finally:
        proc.kill()  # kill -9 in the middle of the save
        proc.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0] != "run.ckpt"  # the killed save's temporary file
    trained(variant_trainer()).save_checkpoint(ckpt)
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_checkpoint_write_failure_names_the_path_and_keeps_the_good_file(tmp_path):
    import resource

    ckpt = tmp_path / "run.ckpt"
    trainer = trained(variant_trainer())
    trainer.save_checkpoint(ckpt)
    good = ckpt.read_bytes()
    # the file size limit makes the write fail as a full disk does
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError, match=re.escape(str(ckpt))) as info:
            trainer.save_checkpoint(ckpt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.errno == errno.EFBIG
    assert ckpt.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]


def test_checkpoint_full_disk_at_sync_names_the_path(tmp_path, monkeypatch):
    ckpt = tmp_path / "run.ckpt"
    trainer = trained(variant_trainer())

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match=r"No space left on device.*" + re.escape(str(ckpt))) as info:
        trainer.save_checkpoint(ckpt)
    assert info.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_checkpoint_loads_with_weights_only(tmp_path):
    trainer = trained(variant_trainer())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    payload = torch.load(tmp_path / "run.ckpt", weights_only=True)
    assert payload["model"].keys() == trainer.model.state_dict().keys()
    assert payload["epoch"] == 1 and len(payload["sha256"]) == 64


def test_flipped_byte_fails_the_load_and_changes_nothing(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    trainer = trained(variant_trainer())
    trainer.save_checkpoint(ckpt)
    data = bytearray(ckpt.read_bytes())
    weight = trainer.model[0].weight.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(weight)
    assert at >= 0
    data[at + 7] ^= 0x04  # one bit of one fp16 weight
    ckpt.write_bytes(bytes(data))
    other = trained(variant_trainer(seed=1))
    before = snapshot(other)
    with pytest.raises(tkern.train.trainer.CheckpointError, match="SHA-256"):
        other.load_checkpoint(ckpt)
    assert_same(snapshot(other), before)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"scaler": None}, "has a DynamicLossScaler scaler, this trainer has none"),
        ({"scaler": "static"}, "has a DynamicLossScaler scaler, this trainer a StaticLossScaler"),
        ({"scheduler": None}, "has a StepLR scheduler, this trainer has none"),
        ({"scheduler": "exp"}, "has a StepLR scheduler, this trainer a ExponentialLR"),
        ({"opt_cls": FusedSGD}, "holds a FusedAdamW optimizer's state, not a FusedSGD's"),
        ({"hidden": 8}, r"does not fit this model: 0.weight is \(16, 12\) in the checkpoint, \(8, 12\) here"),
    ],
)
def test_load_checkpoint_validates_everything_before_changing_anything(tmp_path, changes, message):
    ckpt = tmp_path / "run.ckpt"
    trained(variant_trainer()).save_checkpoint(ckpt)
    other = trained(variant_trainer(seed=1, **changes))
    before = snapshot(other)
    with pytest.raises(tkern.train.trainer.CheckpointError, match=message):
        other.load_checkpoint(ckpt)
    assert_same(snapshot(other), before)


def test_load_checkpoint_refuses_a_checkpoint_without_a_scheduler(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    trained(variant_trainer(scheduler=None)).save_checkpoint(ckpt)
    other = trained(variant_trainer(seed=1))
    before = snapshot(other)
    with pytest.raises(
        tkern.train.trainer.CheckpointError, match="has no scheduler, this trainer has a StepLR"
    ):
        other.load_checkpoint(ckpt)
    assert_same(snapshot(other), before)


# ----------------------------------------------------------------------- sharded checkpoints (issue 12)


def _sharded_data(rank, world):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[rank::world], y[rank::world]), batch_size=8, shuffle=True
    )


def _sharded_trainer(model_seed):
    """A tkern model (dropout: each rank's RNG matters) with DistributedFusedAdamW and tkern's scaler."""
    from tkern.optim import DistributedFusedAdamW

    torch.manual_seed(model_seed)  # construction broadcasts rank 0's params anyway
    model = tkern.convert_network(
        nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    )
    opt = DistributedFusedAdamW(model.parameters(), lr=1e-2)
    scaler = tkern.DynamicLossScaler(init_scale=2.0**12, growth_interval=3)
    return tkern.Trainer(model, opt, nn.functional.cross_entropy, scaler, progress=False)


def _sharded_checkpoint_worker(rank, world, folder):
    out = {}
    try:
        writes = []
        real_write = tkern.Trainer._write_checkpoint

        def counting_write(self, payload, path):
            writes.append(path)
            return real_write(self, payload, path)

        tkern.Trainer._write_checkpoint = counting_write
        ckpt = os.path.join(folder, "sharded.ckpt")
        loader = _sharded_data(rank, world)
        # the uninterrupted run; each rank its own RNG stream (shuffles, dropout masks)
        a = _sharded_trainer(0)
        torch.manual_seed(100 + rank)
        a.fit(loader, 2, checkpoint_path=ckpt)  # saved after epoch 1, then overwritten after epoch 2
        straight = (a.history, [p.detach().clone() for p in a.model.parameters()], a.optimizer.state_dict())
        out["writes"] = list(writes)
        a.save_checkpoint(ckpt)  # the epoch-2 checkpoint again, for the single-process load in the test
        b = _sharded_trainer(0)
        torch.manual_seed(100 + rank)
        b.fit(loader, 1, checkpoint_path=ckpt)
        # a fresh pair: other initial weights, other RNG states; loads epoch 1 and continues
        c = _sharded_trainer(7)
        torch.manual_seed(555)
        c.load_checkpoint(ckpt)
        c.fit(loader, 2)
        resumed = (c.history, [p.detach().clone() for p in c.model.parameters()], c.optimizer.state_dict())
        out["straight"], out["resumed"] = straight, resumed
        a.save_checkpoint(os.path.join(folder, "final.ckpt"))
        # rank 0 cannot write: every rank raises, none hangs
        try:
            a.save_checkpoint(os.path.join(folder, "no", "such", "folder.ckpt"))
        except OSError as e:
            out["failed_save"] = (type(e).__name__, str(e))
    except Exception:
        import traceback

        out["error"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(folder, f"{rank}.pt"))


def test_sharded_checkpoint_resumes_bit_exactly_on_two_ranks(tmp_path):
    from tkern.optim.distributed import run_local_processes

    run_local_processes(_sharded_checkpoint_worker, 2, (str(tmp_path),), timeout_s=240, pg_timeout_s=60)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res['error']}"
        # only rank 0 writes (one file per epoch)
        assert res["writes"] == ([str(tmp_path / "sharded.ckpt")] * 2 if r == 0 else [])
        (h1, p1, s1), (h2, p2, s2) = res["straight"], res["resumed"]
        # the checkpoint holds rank 0's history (each rank's losses are its own micro-batches')
        assert h2[:4] == ranks[0]["straight"][0][:4] and h2[4:] == h1[4:] and len(h1) == 8
        assert all(torch.equal(x, y) for x, y in zip(p1, p2, strict=True))
        assert s1["param_groups"] == s2["param_groups"]
        for k, entry in s1["state"].items():
            assert all(torch.equal(v, s2["state"][k][n]) for n, v in entry.items()), k
        kind, message = res["failed_save"]
        assert kind in ("OSError", "FileNotFoundError") and "folder.ckpt" in message
    # the ranks drew different shuffles and dropout masks, yet their params agree
    assert ranks[0]["straight"][0] != ranks[1]["straight"][0]
    assert all(torch.equal(x, y) for x, y in zip(ranks[0]["resumed"][1], ranks[1]["resumed"][1], strict=True))
    assert not list(tmp_path.glob("no*"))
    # the full state loads into one process with the plain FusedAdamW (its single-process kin)
    torch.manual_seed(0)
    model = tkern.convert_network(
        nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    )
    one = tkern.Trainer(
        model, FusedAdamW(model.parameters(), lr=1e-2), nn.functional.cross_entropy,
        tkern.DynamicLossScaler(init_scale=2.0**12, growth_interval=3), progress=False,
    )  # fmt: skip
    one.load_checkpoint(tmp_path / "final.ckpt")
    assert one.step == 8 and all(
        torch.equal(x, y) for x, y in zip(model.parameters(), ranks[0]["straight"][1], strict=True)
    )
    saved = ranks[0]["straight"][2]
    for k, entry in one.optimizer.state_dict()["state"].items():
        assert all(torch.equal(v, saved["state"][k][n]) for n, v in entry.items()), k
