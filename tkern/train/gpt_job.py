"""The main job on a language model (``tkern train --model gpt``): a character-level
GPT trained on real text, the same initial weights and the same batches for every
run, side by side:

* ``fp32``: plain torch in fp32, torch's AdamW;
* ``autocast``: ``torch.autocast`` fp16 + ``torch.amp.GradScaler`` + torch's AdamW
  (``fused=True`` on a GPU);
* ``tkern``: ``convert_network(model, norms=True, fused_loss=True)`` (fp16) +
  :class:`tkern.optim.FusedAdamW` + :class:`tkern.DynamicLossScaler`;
* ``tkern-bf16``: the same in bf16 (no loss scale);
* on a GPU also ``autocast-compiled`` (the autocast run under ``torch.compile``),
  ``tkern-fp8`` (bf16 with fp8 GEMMs, ``--float8 RECIPE``, tensorwise by default) and
  ``tkern-graph`` (the tkern run under ``Trainer(cuda_graph=True)``).

The text is CPython's own ``pydoc_data.topics`` (the help texts of ``help()``,
about 465k characters, shipped with every CPython: no download), or any UTF-8 file
(``GPTConfig.data``); its last tenth is held out for validation. The model is
transformers' ``GPT2LMHeadModel`` built from a config (no weights downloaded), or,
where transformers is not installed, :class:`CharGPT`: the same shape in plain
torch (its loss from logits, since ``fused_loss`` knows transformers' LMs only).

Every run is a :class:`tkern.Trainer` whose model returns its own loss (HF's, or
tkern's fused linear cross-entropy): an "epoch" of the trainer is ``eval_every``
optimizer steps, after which the validation loss is measured.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import tkern
from tkern.train.demo import (
    OPTIMIZER_DEFAULTS,
    OPTIMIZERS,
    SCALERS,
    STEP_COLUMNS,
    default_device,
    format_table,
    pyplot,
    step_cells,
)
from tkern.train.trainer import Trainer

#: the runs on a CPU, in order; fp32 first (the reference)
CPU_RUNS = ("fp32", "autocast", "tkern", "tkern-bf16")
#: the runs on a GPU: the CPU's and three that only a GPU makes worth running
GPU_RUNS = (*CPU_RUNS, "autocast-compiled", "tkern-fp8", "tkern-graph")
RUNS = GPU_RUNS
#: the fraction of the text held out for validation (its end)
VAL_FRACTION = 0.1
#: the vocabulary is padded to a multiple of this (tile-friendly GEMMs; fp8 needs 16)
VOCAB_MULTIPLE = 64
DEFAULT_DATA = "pydoc_data.topics"


class DataError(ValueError):
    """The text cannot train the model: missing, not UTF-8, or too short."""


@dataclass
class GPTConfig:
    """One run of the job. :func:`default_config` gives the CPU's and the GPU's."""

    steps: int = 16
    batch_size: int = 2
    block_size: int = 32
    n_layer: int = 1
    n_embd: int = 32
    n_head: int = 2
    eval_every: int = 4  # optimizer steps between validation losses
    eval_windows: int = 4  # validation windows of block_size characters (at most; fewer if the text is short)
    optimizer: str = "adamw"
    scaler: str = "dynamic"
    lr: float | None = None  # None: the optimizer's default (tkern.train.demo.OPTIMIZER_DEFAULTS)
    seed: int = 0
    runs: tuple[str, ...] = CPU_RUNS
    data: str | None = None  # a UTF-8 file; None: pydoc_data.topics
    float8: str = "tensorwise"  # the tkern-fp8 run's recipe
    underflow_every: int | None = None  # tkern runs sample zero/subnormal gradients every k steps
    progress: bool = True
    compile: bool = False  # the tkern runs (not tkern-graph) under torch.compile(fullgraph=True)


def default_config(device: torch.device) -> GPTConfig:
    """The CPU configuration (tiny: every tkern kernel runs through Triton's
    interpreter, whose norm kernels cost one program per row of every LayerNorm:
    1 block, 32 wide, 16 steps of 2 x 32 characters at lr 1e-2) or, on a GPU,
    GPT-2 small's shape (12 layers, 768 wide, 12 heads) on blocks of 1024
    characters, 300 steps of batch 8 at lr 3e-4, every run of :data:`GPU_RUNS`."""
    if device.type != "cuda":
        return GPTConfig(lr=1e-2)
    return GPTConfig(
        steps=300,
        batch_size=8,
        block_size=1024,
        n_layer=12,
        n_embd=768,
        n_head=12,
        eval_every=50,
        eval_windows=40,
        lr=3e-4,
        runs=GPU_RUNS,
    )


@dataclass
class GPTResult:
    """One run's numbers; losses in bits per character."""

    name: str
    val_bpc: float
    train_bpc: list[float]  # per optimizer step
    val_curve: list[tuple[int, float]]  # (step, validation bpc) after every eval_every steps
    tokens_per_s: float
    step_time_ms: float
    peak_memory_bytes: int
    skipped_steps: int | None
    final_scale: float | None
    graph_counts: dict[str, int] | None = None


# ---------------------------------------------------------------------- data


def load_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): the UTF-8 file ``path``, or CPython's
    ``pydoc_data.topics`` (its topics in order, a blank line between). Raises
    :class:`DataError` for a missing, unreadable or non-UTF-8 file."""
    if path is None:
        from pydoc_data import topics

        return "\n\n".join(topics.topics.values()), f"{DEFAULT_DATA} (CPython's help texts)"
    if os.path.isdir(path):
        raise DataError(f"{path!r} is a directory, expected a UTF-8 text file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read {path!r}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8"), path
    except UnicodeDecodeError as e:
        raise DataError(f"{path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def min_chars(block_size: int) -> int:
    """The shortest text that trains with ``block_size``: its held-out tenth must
    hold one validation window, and the rest a training window."""
    return math.ceil(block_size / VAL_FRACTION)


@dataclass
class Corpus:
    """A text as character ids: ``train`` and ``val`` (its last tenth), ``chars``
    (id -> character) and ``vocab_size`` (``len(chars)`` padded)."""

    train: torch.Tensor
    val: torch.Tensor
    chars: str
    source: str

    @property
    def vocab_size(self) -> int:
        return -(-len(self.chars) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def make_corpus(text: str, source: str, block_size: int) -> Corpus:
    """Encode ``text`` by character and split it; :class:`DataError` if it is too
    short for ``block_size``."""
    if len(text) < min_chars(block_size):
        raise DataError(
            f"{source!r} has {len(text)} characters; a block of {block_size} needs at least "
            f"{min_chars(block_size)} (its last {VAL_FRACTION:.0%} is held out and must hold one block)"
        )
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n_val = int(len(ids) * VAL_FRACTION)
    return Corpus(ids[:-n_val], ids[-n_val:], chars, source)


class Batches:
    """``count`` batches per iteration, each (ids, ids) of ``batch_size`` random
    windows of ``block_size`` characters of ``ids``, drawn once with ``seed``: every
    run sees the same batches. Each iteration (a trainer's epoch) takes the next
    ``count`` of the ``steps`` batches."""

    def __init__(self, ids: torch.Tensor, cfg: GPTConfig, device: torch.device) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        starts = torch.randint(0, len(ids) - cfg.block_size + 1, (cfg.steps, cfg.batch_size), generator=g)
        offsets = torch.arange(cfg.block_size)
        self.windows = ids[starts[..., None] + offsets].to(device)  # (steps, batch, block)
        self.count = cfg.eval_every
        self.next = 0

    def __len__(self) -> int:
        return min(self.count, len(self.windows) - self.next)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        first, self.next = self.next, min(self.next + self.count, len(self.windows))
        for x in self.windows[first : self.next]:
            yield x, x


def val_batches(ids: torch.Tensor, cfg: GPTConfig, device: torch.device) -> list:
    """Consecutive, non-overlapping validation windows (at most ``eval_windows``)
    in batches of ``batch_size``: the same for every run."""
    n = min(len(ids) // cfg.block_size, cfg.eval_windows)
    windows = ids[: n * cfg.block_size].view(n, cfg.block_size).to(device)
    return [(x, x) for x in windows.split(cfg.batch_size)]


# ---------------------------------------------------------------------- models


class CharGPT(nn.Module):
    """GPT-2's shape in plain torch, for machines without transformers: token and
    position embeddings, ``n_layer`` pre-norm blocks (causal self-attention by SDPA,
    a 4x GELU MLP), a final LayerNorm and a head tied to the token embedding.
    ``forward(ids, labels)`` returns the mean next-character cross-entropy, from
    logits cast to fp32."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln_1": nn.LayerNorm(n_embd),
                    "attn": nn.Linear(n_embd, 3 * n_embd),
                    "proj": nn.Linear(n_embd, n_embd),
                    "ln_2": nn.LayerNorm(n_embd),
                    "mlp": nn.Sequential(
                        nn.Linear(n_embd, 4 * n_embd), nn.GELU("tanh"), nn.Linear(4 * n_embd, n_embd)
                    ),
                }
            )
            for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
        for block in self.blocks:
            q, k, v = block["attn"](block["ln_1"](x)).view(b, t, 3, self.n_head, -1).transpose(1, 3).unbind(2)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](y.transpose(1, 2).reshape(b, t, -1))
            x = x + block["mlp"](block["ln_2"](x))
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device)
        )


class LMLoss(nn.Module):
    """A causal LM whose ``forward(ids)`` is its mean next-token loss on ``ids``
    (what :class:`tkern.Trainer` calls; its ``loss_fn`` then passes it on)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm, CharGPT):
            return self.lm(ids, ids)
        return self.lm(input_ids=ids, labels=ids, use_cache=False).loss


def passthrough_loss(loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    """The Trainer's ``loss_fn`` for :class:`LMLoss`: the model's output is the loss."""
    return loss


def gpt2_lm(cfg: GPTConfig, vocab_size: int) -> nn.Module:
    """transformers' ``GPT2LMHeadModel`` of ``cfg``'s shape (``n_layer``, ``n_embd``,
    ``n_head``, ``block_size`` positions) over ``vocab_size`` tokens, built from a config
    (no weights downloaded; drawn from torch's current seed): dropout off, SDPA attention.
    The job's model (:func:`make_model`), and the one tests compile and convert.
    Raises ImportError where transformers is not installed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def make_model(cfg: GPTConfig, vocab_size: int) -> tuple[LMLoss, str]:
    """The fp32 model every run starts from (weights drawn with ``cfg.seed``) and
    a line saying which it is."""
    torch.manual_seed(cfg.seed)
    blocks = f"{cfg.n_layer} block{'s' * (cfg.n_layer != 1)}"
    shape = f"{blocks}, {cfg.n_embd} wide, {cfg.n_head} heads, {cfg.block_size} characters a sequence"
    try:
        lm = gpt2_lm(cfg, vocab_size)
    except ImportError:
        lm = CharGPT(vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.n_head)
        what = (
            f"tkern.train.gpt_job.CharGPT, GPT-2's shape in plain torch ({shape}): transformers is not "
            "installed, so fused_loss has no HF model to fuse (the head's logits feed the loss)"
        )
    else:
        what = f"transformers GPT2LMHeadModel from a config, no weights downloaded ({shape})"
    n = sum(p.numel() for p in lm.parameters())
    return LMLoss(lm), f"{what}, {n / 1e6:.2f}M params"


def build(name: str, base: LMLoss, cfg: GPTConfig, device: torch.device):
    """(model, optimizer, scaler, autocast dtype, cuda_graph) for run ``name``."""
    model = copy.deepcopy(base).to(device)
    fused_cls, torch_cls = OPTIMIZERS[cfg.optimizer]
    hyper = dict(OPTIMIZER_DEFAULTS[cfg.optimizer])
    if cfg.lr is not None:
        hyper["lr"] = cfg.lr
    if name.startswith("tkern"):
        if name == "tkern-bf16":
            tkern.convert_network(model, torch.bfloat16, norms=True, fused_loss=True)
            scaler = None
        elif name == "tkern-fp8":  # bf16 is fp8's partner: layers fp8 cannot take stay bf16
            tkern.convert_network(model, torch.bfloat16, float8=cfg.float8, norms=True, fused_loss=True)
            scaler = None
        else:
            tkern.convert_network(model, norms=True, fused_loss=True)
            # the dynamic scaler from GradScaler's 2**16: the CPU job's first scaled gradients
            # peak at 0.4x fp16's 65504 (seed 0), so no step is skipped. The params, so their
            # gradients, are fp16 (autocast's are fp32): a seed whose first gradient is above
            # 1 (seed 4: the tied embedding and head, 1.04) overflows and skips that step, as
            # a dynamic scaler should
            scaler = SCALERS[cfg.scaler]()
        opt = fused_cls(model.parameters(), **hyper)
        opt.track_underflows(every=cfg.underflow_every)  # the Trainer warns when the scale is too low
        if cfg.compile and name != "tkern-graph":  # tkern's ops are custom ops: no graph break
            model = torch.compile(model, fullgraph=True)
        return model, opt, scaler, None, True if name == "tkern-graph" else "auto"
    extra = {"fused": True} if device.type == "cuda" and cfg.optimizer != "sgd" else {}
    opt = torch_cls(model.parameters(), **hyper, **extra)
    if name == "fp32":
        return model, opt, None, None, False
    if name == "autocast-compiled":
        model = torch.compile(model)
    return model, opt, torch.amp.GradScaler(device.type), torch.float16, False


def run_one(name: str, base: LMLoss, corpus: Corpus, cfg: GPTConfig, device: torch.device) -> GPTResult:
    """Train run ``name`` for ``cfg.steps`` steps from ``base``'s weights; the
    validation loss after every ``cfg.eval_every`` steps."""
    if device.type == "cuda":  # peak from the start: a CUDA graph's pool is allocated at capture
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    model, opt, scaler, autocast_dtype, cuda_graph = build(name, base, cfg, device)
    trainer = Trainer(
        model,
        opt,
        passthrough_loss,
        scaler,
        autocast_dtype=autocast_dtype,
        progress=cfg.progress,
        log_every=max(1, min(10, cfg.eval_every)),
        cuda_graph=cuda_graph,
    )
    batches = Batches(corpus.train, cfg, device)
    val = val_batches(corpus.val, cfg, device)
    intervals = -(-cfg.steps // cfg.eval_every)
    trainer.fit(batches, intervals, val_loader=val)
    bits = 1 / math.log(2)
    val_curve = [
        (min((i + 1) * cfg.eval_every, cfg.steps), e["val_loss"] * bits) for i, e in enumerate(trainer.epochs)
    ]
    # the first interval pays one-off costs (torch.compile, autotuning, graph capture)
    timed = trainer.epochs[1:] or trainer.epochs
    step_s = sum(e["step_time_s"] for e in timed) / len(timed)
    scales = [h["scale"] for h in trainer.history if h["scale"] is not None]
    return GPTResult(
        name=name,
        val_bpc=val_curve[-1][1],
        train_bpc=[h["loss"] * bits for h in trainer.history],
        val_curve=val_curve,
        tokens_per_s=cfg.batch_size * cfg.block_size / step_s,
        step_time_ms=1e3 * step_s,
        peak_memory_bytes=trainer.memory_report()["total"],
        skipped_steps=trainer.skipped_steps if scaler is not None else None,
        final_scale=scales[-1] if scales else None,
        graph_counts=None if trainer.graphs is None else dict(trainer.graphs.counts),
    )


#: a validation batch costs about this share of a training step (a forward, no backward or step)
FORWARD_SHARE = 1 / 3


def time_one_step(name: str, base: LMLoss, corpus: Corpus, cfg: GPTConfig, device: torch.device) -> float:
    """Seconds one training step of run ``name`` takes here, on a copy of ``base``
    (its first step: it pays the one-off costs too, so an estimate from it errs long).
    The global random state is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model, opt, scaler, autocast_dtype, _ = build(name, base, cfg, device)
        x, _ = next(iter(Batches(corpus.train, cfg, device)))
        start = time.perf_counter()
        with torch.autocast(device.type, autocast_dtype or torch.float16, enabled=autocast_dtype is not None):
            loss = model(x)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:  # the step a scaler drives: its unscale, skip check and update
            scaler.step(opt)
            scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def estimate(cfg: GPTConfig, corpus: Corpus, base: LMLoss, device: torch.device) -> tuple[float, str]:
    """(seconds the job will take here, how that was worked out): one step of the
    ``tkern`` run and one of the ``fp32`` run timed here (:func:`time_one_step`), the
    first standing for every tkern run, the second for every torch run; each run makes
    ``cfg.steps`` steps and a validation every ``cfg.eval_every`` of them (its batches
    at :data:`FORWARD_SHARE` of a step each)."""
    validations = -(-cfg.steps // cfg.eval_every) * len(val_batches(corpus.val, cfg, device))
    per_run = cfg.steps + FORWARD_SHARE * validations
    tkern_runs = sum(r.startswith("tkern") for r in cfg.runs)
    torch_runs = len(cfg.runs) - tkern_runs
    tkern_s = time_one_step("tkern", base, corpus, cfg, device) if tkern_runs else 0.0
    torch_s = time_one_step("fp32", base, corpus, cfg, device) if torch_runs else 0.0
    total = per_run * (tkern_runs * tkern_s + torch_runs * torch_s)
    how = (
        f"one step timed here: tkern {tkern_s:.2f} s, torch {torch_s:.3f} s; x {cfg.steps} steps and "
        f"{validations} validation batches per run, {tkern_runs} tkern and {torch_runs} torch runs"
    )
    return total, how


def duration(seconds: float) -> str:
    """``seconds`` in words: "40 s", "3.5 min", "1.2 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def prepare(cfg: GPTConfig) -> Corpus:
    """The corpus of ``cfg`` (:class:`DataError` before anything trains)."""
    text, source = load_text(cfg.data)
    return make_corpus(text, source, cfg.block_size)


def compare(
    cfg: GPTConfig,
    device: torch.device | None = None,
    corpus: Corpus | None = None,
    model: tuple[LMLoss, str] | None = None,
):
    """Train every run of ``cfg.runs`` from the same weights on the same batches.
    ``corpus`` and ``model`` (:func:`prepare`'s and :func:`make_model`'s) are made
    when not given. Returns (results, the model's description, the corpus)."""
    device = device or default_device()
    corpus = corpus or prepare(cfg)
    base, what = model or make_model(cfg, corpus.vocab_size)
    return [run_one(name, base, corpus, cfg, device) for name in cfg.runs], what, corpus


def table(results: list[GPTResult]) -> str:
    """The side-by-side comparison; ``vs fp32`` is the validation loss relative to
    the fp32 run's, where there is one."""
    ref = next((r.val_bpc for r in results if r.name == "fp32"), None)
    rows = [("run", "val bpc", "vs fp32", "tokens/s", *STEP_COLUMNS)]
    for r in results:
        rows.append(
            (
                r.name,
                f"{r.val_bpc:.4f}",
                "-" if ref is None else f"{100 * (r.val_bpc / ref - 1):+.2f}%",
                f"{r.tokens_per_s:.0f}",
                *step_cells(r),
            )
        )
    return format_table(rows)


#: one marker per run (with matplotlib's colour cycle: one colour each)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot(results: list[GPTResult], path: str, title: str = "character-level GPT") -> None:
    """Into ``path``: the training and validation curves (bits per character) of
    every run, above bar charts of tokens/s and peak memory (1560 px wide)."""
    plt = pyplot()
    fig, ((train_ax, val_ax), (speed_ax, mem_ax)) = plt.subplots(2, 2, figsize=(13, 8.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [r.name for r in results]
    for i, r in enumerate(results):
        # hollow markers, each run's smaller than the one before: runs that agree overlap
        # (they often do to the pixel) and every marker still shows
        style = {
            "color": colours[i % len(colours)],
            "marker": MARKERS[i % len(MARKERS)],
            "markersize": max(11 - 1.5 * i, 3),
            "markerfacecolor": "none",
            "label": r.name,
        }
        steps = range(1, len(r.train_bpc) + 1)
        train_ax.plot(steps, r.train_bpc, linewidth=1, markevery=max(1, len(steps) // 8), **style)
        val_ax.plot(*zip(*r.val_curve, strict=True), linewidth=1.5, **style)
    for ax, what in ((train_ax, "training"), (val_ax, "validation")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"{what} loss (bits per character)")
        ax.set_title(f"{title}: {what} loss")
        ax.grid(alpha=0.3)
        ax.legend()
    for ax, values, label in (
        (speed_ax, [r.tokens_per_s for r in results], "tokens/s (higher is better)"),
        (mem_ax, [r.peak_memory_bytes / 2**20 for r in results], "peak memory, MiB (lower is better)"),
    ):
        ax.bar(names, values, color=[colours[i % len(colours)] for i in range(len(names))])
        ax.set_xlabel("run")
        ax.set_ylabel(label)
        ax.set_title(label.split(" (")[0])
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "CPU_RUNS",
    "GPU_RUNS",
    "RUNS",
    "CharGPT",
    "Corpus",
    "DataError",
    "GPTConfig",
    "GPTResult",
    "LMLoss",
    "compare",
    "default_config",
    "gpt2_lm",
    "load_text",
    "make_corpus",
    "make_model",
    "plot",
    "prepare",
    "table",
]
