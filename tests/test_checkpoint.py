"""tkern.train.checkpoint: the file rules on their own (the Trainer's use of them is
tests/test_trainer_checkpoint.py's). References: torch.load of what was written, and the
RNGs' own draws."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import tkern
from tkern.train import checkpoint


def test_write_atomic_round_trips_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "a.ckpt")
    payload = {"w": torch.arange(6.0).reshape(2, 3), "n": 3, "s": "x"}
    checkpoint.write_atomic(payload, path)
    checkpoint.write_atomic({**payload, "n": 4}, path)  # over an existing file
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], payload["w"]) and loaded["n"] == 4
    assert os.listdir(tmp_path) == ["a.ckpt"]


def test_write_atomic_follows_a_symlink_and_keeps_it(tmp_path):
    target = tmp_path / "real.ckpt"
    link = tmp_path / "link.ckpt"
    checkpoint.write_atomic({"n": 1}, str(target))
    link.symlink_to(target)
    checkpoint.write_atomic({"n": 2}, str(link))
    assert link.is_symlink() and torch.load(target, weights_only=True)["n"] == 2


def test_write_atomic_into_a_missing_folder_names_the_path(tmp_path):
    path = str(tmp_path / "no" / "such.ckpt")
    with pytest.raises(OSError, match="such.ckpt"):
        checkpoint.write_atomic({"n": 1}, path)


def test_digest_sees_every_byte_dtype_and_shape():
    base = {"w": torch.zeros(4), "k": [1, 2.0, "a"]}
    d = checkpoint.digest(base)
    assert d == checkpoint.digest({"w": torch.zeros(4), "k": [1, 2.0, "a"]})
    w = torch.zeros(4)
    w[3] = 2.0**-149  # one bit of one tensor
    for other in (
        {"w": w, "k": [1, 2.0, "a"]},
        {"w": torch.zeros(4, dtype=torch.float64), "k": [1, 2.0, "a"]},
        {"w": torch.zeros(2, 2), "k": [1, 2.0, "a"]},
        {"w": torch.zeros(4), "k": (1, 2.0, "a")},
    ):
        assert checkpoint.digest(other) != d


def test_digest_refuses_what_weights_only_cannot_load():
    with pytest.raises(TypeError, match=r"checkpoint\['bad'\] is a object"):
        checkpoint.digest({"bad": object()})


def test_rng_state_round_trip_repeats_every_generator():
    state = checkpoint.rng_state()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    checkpoint.set_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and np.array_equal(first[2], again[2])


def test_read_reports_a_missing_and_a_corrupt_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint.read(tmp_path / "none.ckpt")
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read"):
        checkpoint.read(bad)


def _payload(model, opt):
    payload = {
        "format": checkpoint.CHECKPOINT_FORMAT,
        "version": checkpoint.CHECKPOINT_VERSION,
        "model": model.state_dict(),
        "optimizer_class": type(opt).__name__,
        "optimizer": opt.state_dict(),
        "scaler_class": None,
        "scaler": None,
        "scheduler_class": None,
        "scheduler": None,
        "epoch": 0,
        "step": 0,
        "history": [],
        "epochs": [],
        "rng": checkpoint.rng_state(),
    }
    payload["sha256"] = checkpoint.digest(payload)
    return payload


def test_validate_accepts_a_fitting_payload_and_names_what_does_not_fit():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = _payload(model, opt)
    checkpoint.validate(good, "x", model=model, optimizer=opt)
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256"):
        checkpoint.validate({**good, "epoch": 1}, "x", model=model, optimizer=opt)
    other = nn.Linear(3, 4)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model"):
        checkpoint.validate(good, "x", model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(checkpoint.CheckpointError, match="has no scaler"):
        checkpoint.validate(good, "x", model=model, optimizer=opt, scaler=tkern.DynamicLossScaler())


def test_a_sharded_optimizers_checkpoint_is_its_single_process_kins():
    assert checkpoint.optimizer_kind("DistributedFusedAdamW") == checkpoint.optimizer_kind("FusedAdamW")
    assert checkpoint.shard_group_of(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)) == (
        None,
        0,
        1,
    )
