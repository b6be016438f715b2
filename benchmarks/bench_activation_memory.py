"""Activation memory of one GPT-2 training step, read on a CPU (issue 28 item 5).

A transformers GPT-2 (2 layers, n_embd 128, 2 heads, the full 50257-token
vocabulary; batch 2 x 128 tokens) takes one step, ``model(input_ids,
labels=input_ids).loss.backward()``, under each recipe:

* ``torch autocast``: fp32 params under ``torch.autocast`` (bf16 on a CPU);
* ``tkern GEMMs only``: ``convert_network(model, torch.bfloat16, norms=False)``
  (before issue 28 there is no ``norms`` keyword and today's default is this);
* ``tkern + norms``: ``norms=True`` (tkern's LayerNorm: 16-bit input saved, fp32
  statistics);
* ``tkern + norms + fused loss``: also ``fused_loss=True`` (the head and the loss
  as ``linear_cross_entropy``, no (tokens x vocab) tensor).

A recipe whose keyword this tkern lacks is recorded as "not available" with the
keyword named. Two measures per recipe:

* **saved for backward**: every tensor autograd saves in the forward
  (``torch.autograd.graph.saved_tensors_hooks``), counting each storage once and
  leaving out the parameters' own storages (as ``Trainer.memory_report``), split by
  the module that saved it first: the innermost module running when the pack
  hook fires, tracked by forward pre-hooks and hooks on every module; ``norms`` is
  what LayerNorm/RMSNorm modules saved, ``head + loss`` what the LM head and the
  model's own code around it saved (HF computes the loss in the top module),
  ``linear`` the other Linear / Conv1D layers, ``attention`` the attention modules'
  own ops (SDPA), ``other`` the rest;
* **largest tensor**: the largest output of any op in the forward and backward (a
  ``TorchDispatchMode``), leaving out tensors shaped like a parameter (its
  gradient, which every recipe makes), with the op that made it; divided by the
  fp32 logits' bytes (tokens x vocab x 4).

Targets: ``tkern + norms``' norm bytes <= 0.55x autocast's (a 16-bit input and
two fp32 values per row instead of an fp32 copy of the input);
``tkern + norms + fused loss``' largest tensor <= 1/8 of the fp32 logits.

    python benchmarks/bench_activation_memory.py          # writes results/host/activation_memory.{json,md}
    python benchmarks/bench_activation_memory.py --smoke  # a small vocabulary; nothing written unless --out
    python benchmarks/bench_activation_memory.py --tiny   # smaller still (real launches against stubbed)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_host import stubbed_launches  # noqa: E402
from harness import RESULTS, Mode, Results, targets_markdown  # noqa: E402

import tkern  # noqa: E402

CONFIG = {"n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 50257, "n_positions": 128}
BATCH, SEQ = 2, 128
SMOKE_CONFIG = {**CONFIG, "vocab_size": 4096, "n_positions": 136}
SMOKE_BATCH, SMOKE_SEQ = 2, 136
#: --tiny: the smoke model narrower and one short ragged row, for checking stubbed launches
#: against real ones through the interpreter (the same code paths: two layers, the smoke's
#: vocabulary and so its loss chunks; a seventh of its rows)
TINY_CONFIG = {**SMOKE_CONFIG, "n_embd": 64, "n_positions": 40}
TINY_BATCH, TINY_SEQ = 1, 40
DTYPE = torch.bfloat16
CATEGORIES = ("norms", "linear", "attention", "head + loss", "other")
AUTOCAST = "torch autocast"
NORMS = "tkern + norms"
FUSED = "tkern + norms + fused loss"
LOSS_ONLY = "tkern GEMMs + fused loss"
#: recipe -> the convert_network keywords it needs (None: autocast, no conversion)
RECIPES: dict[str, dict | None] = {
    AUTOCAST: None,
    "tkern GEMMs only": {"norms": False},
    NORMS: {"norms": True},
    FUSED: {"norms": True, "fused_loss": True},
    # the loss alone, while convert_network has fused_loss= and not yet norms=
    LOSS_ONLY: {"norms": False, "fused_loss": True},
}
TARGETS = {"norms_saved_vs_autocast": 0.55, "loss_largest_vs_fp32_logits": 1 / 8}
MIB = 2**20


def make_model(config: dict) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        **config,
        attn_implementation="sdpa",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def category(module: nn.Module, root: nn.Module) -> str:
    """Which share a tensor saved while ``module`` is the innermost running module counts in."""
    if module is root or module is getattr(root, "lm_head", None):
        return "head + loss"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__:
        return "norms"
    if isinstance(module, nn.Linear) or type(module).__name__ in ("Conv1D", "Float8Conv1D"):
        return "linear"
    if "Attention" in type(module).__name__:
        return "attention"
    return "other"


@dataclass
class SavedBytes:
    """Storages saved for backward, each counted once, by the category of the
    module that saved it first; the parameters' storages left out."""

    root: nn.Module
    stack: list[nn.Module] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def __post_init__(self) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in self.root.parameters()}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and key not in self.params and storage.nbytes() > 0:
            self.seen.add(key)
            self.by_category[category(self.stack[-1] if self.stack else self.root, self.root)] += (
                storage.nbytes()
            )
        return t

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.stack.append(module)

    def leave(self, module: nn.Module, args: tuple, out: object) -> None:
        self.stack.pop()  # returns None: the output stays as it is

    def hooks(self) -> list:
        """A pre-hook and a hook on every module that keep :attr:`stack`."""
        handles = []
        for m in self.root.modules():
            handles.append(m.register_forward_pre_hook(self.enter, prepend=True))
            handles.append(m.register_forward_hook(self.leave, always_call=True))
        return handles


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op creates: outputs on a storage none of the op's
    inputs had (views, in-place ops and ``set_`` create none), leaving out
    parameter-shaped ones (a parameter's gradient or cast, which every recipe makes).
    Not their transposes: a chunk of H rows' (H, V) logits has the transposed shape of
    the (V, H) head, and a tensor that happens to is still the step's memory."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.param_shapes = {tuple(p.shape) for p in params}
        self.nbytes, self.what = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs or {}))
            if isinstance(a, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) in self.param_shapes:
                continue
            if t.untyped_storage().data_ptr() in inputs:
                continue
            n = t.untyped_storage().nbytes()
            if n > self.nbytes:
                self.nbytes = n
                self.what = f"{func.__name__} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        return out


def missing_keywords(keywords: dict) -> list[str]:
    """The ``convert_network`` keywords this tkern does not take."""
    accepted = inspect.signature(tkern.convert_network).parameters
    return [k for k in keywords if k not in accepted]


def build(recipe: str, base: nn.Module) -> tuple[nn.Module, Callable] | str:
    """(model, context of its forward) for ``recipe``, or why it is not available."""
    model = copy.deepcopy(base)
    keywords = RECIPES[recipe]
    if keywords is None:
        return model, lambda: torch.autocast("cpu", dtype=DTYPE)
    missing = missing_keywords(keywords)
    if missing and missing != ["norms"] or (missing == ["norms"] and keywords["norms"]):
        return f"not available: convert_network has no {', '.join(missing)}= in this tkern (issue 28)"
    # before issue 28, convert_network without norms= is "GEMMs only" (norms upcast to fp32)
    tkern.convert_network(model, DTYPE, **{k: v for k, v in keywords.items() if k not in missing})
    return model, torch.enable_grad


def measure(recipe: str, base: nn.Module, ids: torch.Tensor, stub: bool = False) -> dict:
    """One forward + backward of ``recipe``: saved bytes by category and the largest
    tensor. With ``stub``, tkern's Triton launches are no-ops (``bench_host.stubbed_launches``):
    every tensor is allocated, saved and freed as in a real step, but no kernel runs
    (through the interpreter the full vocabulary's chunked loss takes tens of minutes);
    the loss is then garbage, and the tests check that the counts equal a real run's."""
    built = build(recipe, base)
    if isinstance(built, str):
        return {"skipped": built}
    model, context = built
    model.train()
    saved = SavedBytes(model)
    handles = saved.hooks()
    largest = LargestTensor(list(model.parameters()))
    try:
        with stubbed_launches() if stub else contextlib.nullcontext():
            with largest, context(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            with largest:
                loss.float().backward()
    finally:
        for h in handles:
            h.remove()
    row = {f"{c} MiB": round(b / MIB, 3) for c, b in saved.by_category.items()}
    return {
        "saved MiB": round(sum(saved.by_category.values()) / MIB, 3),
        **row,
        "largest MiB": round(largest.nbytes / MIB, 3),
        "largest op": largest.what,
        "loss": round(float(loss.detach()), 4),
        "_norm_bytes": saved.by_category["norms"],
        "_largest": largest.nbytes,
    }


def markdown(res: Results, meta: dict) -> str:
    cols = [
        "saved MiB",
        *[f"{c} MiB" for c in CATEGORIES],
        "largest MiB",
        "largest / fp32 logits",
        "largest op",
    ]
    lines = [
        "# Activation memory of one GPT-2 training step (CPU)",
        "",
        f"`benchmarks/bench_activation_memory.py`, commit {meta['commit']}, {meta['date']}, torch "
        f"{meta['torch']}: GPT-2 {meta['config']}, batch {meta['batch']} x {meta['seq']} tokens; "
        f"fp32 logits {meta['fp32_logits_mib']} MiB. Saved bytes count each storage once (parameters "
        "left out), by the module that saved it first; the largest tensor leaves out parameter-shaped ones. "
        f"tkern's kernel launches: {meta['tkern_launches']} (stubbed: every tensor allocated and saved as in "
        "a real step, no kernel run; a test checks the counts against real launches at the smoke size).",
        "",
        "| recipe | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for r in res.rows:
        if r.get("skipped"):
            lines.append(f"| {r['impl']} | {r['skipped']} |" + " |" * (len(cols) - 1))
            continue
        lines.append(f"| {r['impl']} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    lines += ["", *targets_markdown(meta, TARGETS)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Results:
    parser = argparse.ArgumentParser(prog="bench_activation_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="a small vocabulary; nothing written unless --out"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="--smoke's model narrower, one 40-token row (implies --smoke)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default benchmarks/results/host)"
    )
    parser.add_argument(
        "--launches",
        choices=("real", "stubbed"),
        default=None,
        help="run tkern's kernels (through the interpreter) or stub them (default: real with --smoke, "
        "else stubbed: the same allocations, minutes instead of an hour)",
    )
    args = parser.parse_args(argv)
    args.smoke = args.smoke or args.tiny
    stub = (args.launches or ("real" if args.smoke else "stubbed")) == "stubbed"
    out_dir = args.out if args.smoke else (args.out or RESULTS / "host")
    mode = Mode(args.smoke, torch.device("cpu"), out_dir)
    if args.tiny:
        config, batch, seq = TINY_CONFIG, TINY_BATCH, TINY_SEQ
    else:
        config, batch, seq = (SMOKE_CONFIG, SMOKE_BATCH, SMOKE_SEQ) if args.smoke else (CONFIG, BATCH, SEQ)
    torch.manual_seed(0)
    base = make_model(config)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    logits_bytes = batch * seq * config["vocab_size"] * 4
    res = Results("activation_memory", mode, metric=None)
    res.meta.update(
        config=config,
        batch=batch,
        seq=seq,
        fp32_logits_mib=round(logits_bytes / MIB, 3),
        targets=TARGETS,
        tkern_launches="stubbed" if stub else "real",
    )
    raw: dict[str, dict] = {}
    for recipe in RECIPES:
        r = measure(recipe, base, ids, stub=stub and RECIPES[recipe] is not None)
        raw[recipe] = r
        if "_largest" in r:
            r["largest / fp32 logits"] = round(r["_largest"] / logits_bytes, 4)
        res.add("gpt2 step", recipe, None, **{k: v for k, v in r.items() if not k.startswith("_")})
    auto, norms = raw[AUTOCAST], raw[NORMS]
    # the loss target from the full recipe, or from the loss alone while norms= has not landed
    fused = raw[FUSED] if "_largest" in raw[FUSED] else raw[LOSS_ONLY]
    res.meta["norms_saved_vs_autocast"] = (
        round(norms["_norm_bytes"] / auto["_norm_bytes"], 4) if "_norm_bytes" in norms else None
    )
    res.meta["loss_largest_vs_fp32_logits"] = (
        round(fused["_largest"] / logits_bytes, 4) if "_largest" in fused else None
    )
    res.meta["autocast_largest_vs_fp32_logits"] = round(auto["_largest"] / logits_bytes, 4)
    payload = res.payload()  # before anything is written: the commit is the tree's, not "+dirty"
    res.save()
    text = markdown(res, payload)
    if out_dir is not None:
        (out_dir / "activation_memory.md").write_text(text)
        print(f"wrote {out_dir}/activation_memory.md")
    print(text)
    return res


if __name__ == "__main__":
    main()
