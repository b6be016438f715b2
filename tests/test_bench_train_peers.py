"""bench_train's fp8 peers (issue 43): bf16 autocast eager and compiled, torchao's
Float8Linear as torchao documents it and with an fp32 master, each skipped with its
reason where torchao is missing, and the check column of the final loss against bf16's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_train  # noqa: E402

TORCHAO = ("torchao float8 tensorwise compiled", bench_train.TORCHAO_FP32_MASTER)


def test_the_fp8_recipes_have_every_peer_the_issue_names():
    peers = ("torch autocast bf16", bench_train.BF16_COMPILED, *TORCHAO)
    assert set(peers) <= set(bench_train.RECIPES)
    names = list(bench_train.RECIPES)
    # baselines first: a run cut by its time limit keeps what the fp8 rows are compared with
    assert max(names.index(p) for p in peers) < min(
        names.index(f"tkern fp8 {r}") for r in bench_train.FP8_RECIPES
    )
    assert bench_train.BF16_COMPILED in bench_train.SMOKE_SKIPS  # a whole-model compile: minutes on a CPU


@pytest.mark.skipif(DEVICE == "cuda", reason="the smoke path is the CPU's rehearsal of the GPU rows")
def test_torchao_missing_is_a_skipped_row_and_the_fp8_loss_is_checked_against_bf16(tmp_path, monkeypatch):
    for name in ("torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError, as without torchao
    recipes = "=torch autocast bf16,torchao,=tkern fp8 tensorwise"
    res = bench_train.main(["--smoke", "--models", "mlp", "--recipes", recipes, "--out", str(tmp_path)])
    rows = {r["impl"]: r for r in res.rows}
    for peer in TORCHAO:
        assert rows[peer]["ms"] is None and "torchao" in rows[peer]["skipped"], rows[peer]
    assert not res.meta["failed"]
    bf16, fp8 = rows["torch autocast bf16"], rows["tkern fp8 tensorwise"]
    assert bf16["loss_vs_bf16"] == 0.0 and bf16["loss_within_1pct_of_bf16"] is True
    off = fp8["loss"] / bf16["loss"] - 1
    assert fp8["loss_vs_bf16"] == pytest.approx(off, abs=1e-6)
    assert fp8["loss_within_1pct_of_bf16"] is (abs(off) <= bench_train.BF16_LOSS_MARGIN)
    case = fp8["case"]
    assert res.meta[f"{case}: fp8 tensorwise loss within 1% of bf16"] is fp8["loss_within_1pct_of_bf16"]
    assert f"{case}: fp8 tensorwise vs compiled autocast bf16" in res.meta  # None: not timed here
