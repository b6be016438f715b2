"""Optimizer memory modes: bytes per parameter and the training quality each costs.

A small GPT-2 (a transformers ``GPT2Config``, nothing downloaded: 2 layers,
width 128, byte-level vocabulary of 256, context 64) with bf16 params is
trained on a shipped corpus (``data/corpus.txt.gz``: 256 KiB of tkern's
sources, frozen: the same bytes on every machine and at every commit) by
AdamW in each of tkern's memory modes (``master=`` fp32 / split / none,
``state_dtype=`` fp32 / uint8) and by
torchao's ``AdamW8bit`` and bf16 stochastic-rounding ``_AdamW`` on the same
data, batches and initial weights. Reported per run: the optimizer's bytes per
param (``memory_report()``; torchao's counted from its state tensors) and the
final loss (on 8 held-out batches after training; no dropout) against tkern's
fp32-master run.

On a CPU the tkern optimizers run through Triton's interpreter (torchao's
through torch.compile's CPU backend): 120 steps take one to five minutes per
run on a 2-core CPU. On a GPU the same script runs as it is, faster.

    python benchmarks/bench_memory.py          # writes results/<device, or host>/memory_quality.*
    python benchmarks/bench_memory.py --smoke  # a few steps of every run, nothing written
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path

import torch

import tkern  # before triton and torchao: on a CPU it switches Triton's interpreter on

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, commit, device_name, device_slug  # noqa: E402

SEQ, BATCH, LR, WD = 64, 8, 3e-3, 0.01
#: Batches the final loss is measured on after training (no dropout anywhere); ``--smoke``
#: (which checks that every run trains and reports, not the losses' margins) measures on fewer.
EVAL_BATCHES, SMOKE_EVAL_BATCHES = 8, 2
#: The largest relative difference of each mode's final loss from the fp32-master run that
#: the run accepts (split: the same master bit for bit, so only the forward's rounding on
#: exact ties differs; the rest: quantization or rounding noise).
MARGINS = {"split": 0.01, "uint8": 0.03, "none": 0.05}


#: The corpus: 256 KiB of text (tkern's sources and README as they were when the file was
#: made), shipped compressed and never regenerated, so every machine and commit trains on
#: the same bytes.
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt.gz"


def corpus() -> torch.Tensor:
    """The training text as byte values."""
    data = gzip.decompress(CORPUS.read_bytes())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, data.numel() - SEQ - 1, (steps, BATCH), generator=g)
    for row in starts:
        idx = row[:, None] + torch.arange(SEQ + 1)
        chunk = data[idx].to(device)
        yield chunk[:, :-1], chunk[:, 1:]


def model(device: torch.device) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4, tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).to(device, torch.bfloat16)


def tkern_run(master: str, state_dtype: torch.dtype):
    def make(params):
        opt = tkern.optim.FusedAdamW(
            params, lr=LR, weight_decay=WD, master=master, state_dtype=state_dtype, seed=0
        )
        return opt, lambda: opt.memory_report()["bytes_per_param"]

    return make


def nudged_run(make):
    """``make`` after moving one initial weight by one bf16 ulp: the smallest change
    to a run, whose effect on the final loss is this benchmark's noise floor (the
    training is chaotic: any difference, such as split's rounding of exact ties,
    grows into a different trajectory)."""

    def nudged(params):
        params = list(params)
        with torch.no_grad():
            params[0].view(-1)[:1].view(torch.int16).add_(1)
        return make(params)

    return nudged


def torchao_run(cls_name: str, **kw):
    def make(params):
        import torchao.optim

        params = list(params)
        opt = getattr(torchao.optim, cls_name)(params, lr=LR, weight_decay=WD, **kw)

        def bytes_per_param():
            numel = sum(p.numel() for p in params)
            state = 0
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.numel() > 1:
                        inner = [getattr(v, a) for a in getattr(v, "tensor_attrs", [])] or [v]
                        state += sum(t.numel() * t.element_size() for t in inner if t.numel() > 256)
            return (2 + 2) + state / numel  # bf16 param and grad, no master

        return opt, bytes_per_param

    return make


RUNS = {
    "tkern AdamW, fp32 master": ("fp32", tkern_run("fp32", torch.float32)),
    "tkern AdamW, fp32 master, one initial weight 1 ulp off (noise floor)": (
        "control",
        nudged_run(tkern_run("fp32", torch.float32)),
    ),
    "tkern AdamW, split master": ("split", tkern_run("split", torch.float32)),
    "tkern AdamW, no master (stochastic rounding)": ("none", tkern_run("none", torch.float32)),
    "tkern AdamW, fp32 master + uint8 moments": ("uint8", tkern_run("fp32", torch.uint8)),
    "tkern AdamW, split master + uint8 moments": ("uint8", tkern_run("split", torch.uint8)),
    "tkern AdamW, no master + uint8 moments": ("none", tkern_run("none", torch.uint8)),
    "torchao AdamW8bit (bf16 params, no master)": (None, torchao_run("AdamW8bit")),
    "torchao AdamW8bit, bf16 stochastic rounding": (
        None,
        torchao_run("AdamW8bit", bf16_stochastic_round=True),
    ),
    "torchao _AdamW, bf16 stochastic rounding": (None, torchao_run("_AdamW", bf16_stochastic_round=True)),
}


def loss_of(net, x, y) -> torch.Tensor:
    logits = net(x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


def train(
    make, data: torch.Tensor, steps: int, device: torch.device, eval_batches: int = EVAL_BATCHES
) -> tuple[list[float], float, float, float]:
    """The training losses, bytes per param, the loss on ``eval_batches`` held-out batches
    after training (the same batches for every run, drawn after the training ones) and
    the seconds it took."""
    net = model(device)
    opt, bytes_per_param = make(net.parameters())
    losses = []
    start = time.perf_counter()
    all_batches = list(batches(data, steps + eval_batches, device))
    for x, y in all_batches[:steps]:
        opt.zero_grad()
        loss = loss_of(net, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        held_out = sum(loss_of(net, x, y).item() for x, y in all_batches[steps:]) / eval_batches
    return losses, bytes_per_param(), held_out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="3 steps of every run, 2 held-out batches, nothing written"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", default="", help="run only the runs whose name contains this")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not tkern.INTERPRET
    device = torch.device("cuda" if gpu else "cpu")
    steps = 3 if args.smoke else args.steps
    data = corpus()
    rows = []
    for name, (kind, make) in RUNS.items():
        if args.only not in name:
            continue
        evals = SMOKE_EVAL_BATCHES if args.smoke else EVAL_BATCHES
        losses, bpp, final, seconds = train(make, data, steps, device, evals)
        rows.append({"run": name, "kind": kind, "bytes_per_param": round(bpp, 3), "final_loss": final,
                     "first_loss": losses[0], "seconds": round(seconds, 1)})  # fmt: skip
        print(
            f"{name:48s} {bpp:6.2f} B/param  loss {losses[0]:.3f} -> {final:.4f}  ({seconds:.0f} s)",
            flush=True,
        )
    ref = next((r["final_loss"] for r in rows if r["run"] == "tkern AdamW, fp32 master"), None)
    failed = []
    for r in rows:
        if ref is not None:
            r["vs_fp32_master"] = round((r["final_loss"] - ref) / ref, 4)
            margin = MARGINS.get(r["kind"])
            r["margin"] = margin
            if margin is not None and not args.smoke and abs(r["vs_fp32_master"]) > margin:
                failed.append(r["run"])
    result = {"device": device_name() if gpu else "cpu", "commit": commit(), "steps": steps,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}  # fmt: skip
    if not args.smoke:
        out = RESULTS / (device_slug() if gpu else "host")
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory_quality.json").write_text(json.dumps(result, indent=1))
        title = f"Optimizer memory modes, GPT-2 (2 x 128, bf16 params), {steps} steps on {result['device']}"
        lines = [f"{title}, commit {result['commit']}, {result['date']}", ""]
        lines += [
            "| run | B/param | final loss | vs fp32 master | margin |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            vs, margin = r.get("vs_fp32_master"), r.get("margin")
            vs = "" if vs is None else f"{vs:+.2%}"
            margin = "" if margin is None else f"{margin:.0%}"
            lines.append(
                f"| {r['run']} | {r['bytes_per_param']:.2f} | {r['final_loss']:.4f} | {vs} | {margin} |"
            )
        (out / "memory_quality.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out}/memory_quality.md")
    if failed:
        raise SystemExit(f"beyond their margin of the fp32-master loss: {failed}")
    if any(not math.isfinite(r["final_loss"]) for r in rows):
        raise SystemExit("a run diverged")
    return result


if __name__ == "__main__":
    main()
