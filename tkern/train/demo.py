"""The main job: an MLP on scikit-learn's digits (1,797 real 8x8 handwritten
digits shipped inside scikit-learn, no download), trained three ways from the
same initial weights, with a side-by-side table:

* ``tkern``: convert_network (fp16 tkern layers) + a fused optimizer on fp32
  master weights + a device-side loss scaler;
* ``fp32``: plain torch in fp32;
* ``autocast``: torch.autocast(fp16) + torch.amp.GradScaler + torch.optim.AdamW.

With ``Config.nproc`` = N > 1 the ``tkern`` run is data-parallel on N local
processes (gloo on the CPU, NCCL on N GPUs) with the sharded optimizer
(:mod:`tkern.optim.distributed`), or with ``Config.fsdp`` under FSDP2
(``fully_shard``, see :func:`shard_fully`) with the fused optimizer on its
sharded params: each rank trains on every N-th training
sample with a batch of ``batch_size // N``, so one optimizer step still sees
``batch_size`` samples; rank 0 evaluates, prints and writes files. The fp32 and
autocast runs stay in this process.
"""

from __future__ import annotations

import copy
import os
import pickle
import tempfile
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

import tkern
from tkern.optim import (
    DistributedFusedAdam,
    DistributedFusedAdamW,
    DistributedFusedSGD,
    FusedAdam,
    FusedAdamW,
    FusedSGD,
)
from tkern.train.checkpoint import CheckpointError
from tkern.train.trainer import Trainer

RUNS = ("tkern", "fp32", "autocast")
OPTIMIZERS = {
    "adamw": (FusedAdamW, torch.optim.AdamW),
    "adam": (FusedAdam, torch.optim.Adam),
    "sgd": (FusedSGD, torch.optim.SGD),
}
#: the sharded (ZeRO-2) optimizer of each, for the data-parallel tkern run
SHARDED = {"adamw": DistributedFusedAdamW, "adam": DistributedFusedAdam, "sgd": DistributedFusedSGD}
#: Each optimizer's own defaults for the demo: Adam(W) at 3e-3; SGD needs a
#: larger step and momentum (at Adam's 3e-3 without momentum it stays near
#: chance, 11.7%, after 10 epochs; with these it reaches ~97%).
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "adamw": {"lr": 3e-3},
    "adam": {"lr": 3e-3},
    "sgd": {"lr": 0.1, "momentum": 0.9},
}
SCALERS = {
    "dynamic": lambda: tkern.DynamicLossScaler(),
    "static": lambda: tkern.StaticLossScaler(),
    "lognormal": lambda: tkern.LogNormalLossScaler(),
}


class MissingExtraError(RuntimeError):
    """An optional dependency the demo needs is not installed."""


class NprocError(ValueError):
    """``Config.nproc`` asks for more GPUs than this machine has."""


def default_device() -> torch.device:
    """The GPU when there is one and tkern compiles its kernels, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() and not tkern.INTERPRET else "cpu")


@dataclass
class Config:
    epochs: int = 10
    batch_size: int = 64
    hidden: tuple[int, ...] = (128, 64)
    optimizer: str = "adamw"
    scaler: str = "dynamic"
    lr: float | None = None  # None: the optimizer's default (OPTIMIZER_DEFAULTS)
    seed: int = 0
    runs: tuple[str, ...] = RUNS
    progress: bool = True
    checkpoint: str | None = None  # the tkern run saves a checkpoint here after each epoch
    resume: str | None = None  # the tkern run starts from this checkpoint
    nproc: int = 1  # > 1: the tkern run is data-parallel on this many local processes
    fsdp: bool = False  # with nproc > 1: the tkern run under FSDP2 (fully_shard) instead of ZeRO-2
    float8: str | None = None  # a Float8Recipe name: the tkern run in bf16 with fp8 GEMMs
    cuda_graph: bool | str = "auto"  # the tkern run's Trainer(cuda_graph=...): its whole step as a CUDA graph
    norms: bool = False  # each hidden block Linear-LayerNorm-ReLU (an nn.Sequential), not Linear-ReLU
    underflow_every: int | None = None  # the tkern run samples zero/subnormal gradients every k steps


@dataclass
class Result:
    name: str
    train_loss: float
    val_accuracy: float
    step_time_ms: float
    peak_memory_bytes: int
    skipped_steps: int | None
    final_scale: float | None
    losses: list[float] = field(default_factory=list)
    #: how the steps ran with ``Config.cuda_graph`` (warmup, capture, replay, eager); None: eager
    graph_counts: dict[str, int] | None = None


def load_digits(seed: int, device: torch.device):
    """Digits as tensors: features scaled to [0, 1], an 80/20 split drawn with ``seed``."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise MissingExtraError("the digits demo needs scikit-learn: pip install 'tkern[demo]'") from e
    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = len(x) // 5
    val, train = perm[:n_val], perm[n_val:]
    return (x[train].to(device), y[train].to(device)), (x[val].to(device), y[val].to(device))


def make_mlp(in_features: int, hidden: tuple[int, ...], classes: int, norms: bool = False) -> nn.Sequential:
    """An fp32 MLP: Linear-ReLU blocks and a Linear head; with ``norms`` each hidden block
    is an ``nn.Sequential`` of Linear, LayerNorm and ReLU (a block with a norm, as a
    transformer's, for ``tkern train --norms --fsdp``)."""
    layers: list[nn.Module] = []
    for width in hidden:
        if norms:
            layers.append(nn.Sequential(nn.Linear(in_features, width), nn.LayerNorm(width), nn.ReLU()))
        else:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers.append(nn.Linear(in_features, classes))
    return nn.Sequential(*layers)


def _loader(x, y, batch_size, shuffle):
    # Shuffling draws from torch's global RNG, which checkpoints save and restore.
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle
    )


def shard_fully(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` under FSDP2 over every rank of the default process group: each block
    (an ``nn.Sequential`` child of the model) and each other Linear (tkern's after
    :func:`tkern.convert_network`) one all-gather unit, then the root; its params become
    DTensors holding this rank's rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = [m for m in model.children() if isinstance(m, nn.Sequential)]
    inside = {id(m) for b in blocks for m in b.modules()}
    for block in blocks:
        fully_shard(block, mesh=mesh)
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and id(layer) not in inside:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(name: str, base: nn.Module, cfg: Config, device: torch.device, sharded: bool = False):
    """(model, optimizer, scaler, autocast dtype) for one of the three runs; with
    ``sharded`` (a process group is initialised) the tkern run is data-parallel:
    with the sharded optimizer (ZeRO-2), or with ``cfg.fsdp`` under FSDP2 with the
    fused one on its sharded params."""
    model = copy.deepcopy(base)
    fused_cls, torch_cls = OPTIMIZERS[cfg.optimizer]
    if sharded and not cfg.fsdp:
        fused_cls = SHARDED[cfg.optimizer]
    hyper = dict(OPTIMIZER_DEFAULTS[cfg.optimizer])
    if cfg.lr is not None:
        hyper["lr"] = cfg.lr
    if name == "tkern":
        dtype = torch.float16 if cfg.float8 is None else torch.bfloat16  # bf16 is fp8's partner
        # under FSDP2 the norms' params share the Linears' dtype: one dtype per fully_shard unit
        norm_dtype = dtype if sharded and cfg.fsdp else None
        tkern.convert_network(model, dtype, float8=cfg.float8, norm_dtype=norm_dtype)
        if sharded and cfg.fsdp:
            shard_fully(model, device)  # before the optimizer: it steps on the DTensor shards
        opt = fused_cls(model.parameters(), **hyper)
        opt.track_underflows(every=cfg.underflow_every)  # the Trainer warns when the scale is too low
        return model, opt, SCALERS[cfg.scaler](), None
    extra = {"fused": True} if device.type == "cuda" and cfg.optimizer != "sgd" else {}
    opt = torch_cls(model.parameters(), **hyper, **extra)
    if name == "fp32":
        return model, opt, None, None
    return model, opt, torch.amp.GradScaler(device.type), torch.float16


def run_one(
    name: str, base: nn.Module, data, cfg: Config, device: torch.device, rank: int = 0, world: int = 1
) -> Result | None:
    """Train and evaluate one run. With ``world`` > 1 (a process group of that many
    ranks is initialised) this is rank ``rank`` of the data-parallel tkern run: it
    trains on every ``world``-th sample (the first ``len // world * world``, so every
    rank takes the same number of steps) with a batch of ``batch_size // world``;
    rank 0 returns the Result (its per-step losses averaged over the ranks), the
    others None."""
    (xt, yt), (xv, yv) = data
    batch_size = cfg.batch_size
    if world > 1:
        n = len(xt) // world * world
        xt, yt = xt[:n][rank::world], yt[:n][rank::world]
        batch_size = max(cfg.batch_size // world, 1)
    model, opt, scaler, autocast_dtype = build(name, base, cfg, device, sharded=world > 1)
    trainer = Trainer(
        model,
        opt,
        nn.functional.cross_entropy,
        scaler,
        autocast_dtype=autocast_dtype,
        progress=cfg.progress and rank == 0,
        cuda_graph=cfg.cuda_graph if name == "tkern" else False,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(cfg.seed + rank)  # each rank its own shuffles
    loader = _loader(xt, yt, batch_size, True)
    if name == "tkern" and cfg.resume:
        trainer.load_checkpoint(cfg.resume)
    trainer.fit(loader, cfg.epochs, checkpoint_path=cfg.checkpoint if name == "tkern" else None)
    losses = [h["loss"] for h in trainer.history]
    train_loss = trainer.epochs[-1]["train_loss"]
    if world > 1:  # each rank's losses are its own batches': report their mean over the ranks
        import torch.distributed as dist

        mean = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        losses = (mean / world).tolist()
        last = [x for x, h in zip(losses, trainer.history, strict=True) if h["epoch"] == trainer.epoch]
        train_loss = sum(last) / max(len(last), 1)
    # under FSDP2 a forward all-gathers each layer from every rank: all of them evaluate
    metrics = trainer.evaluate(_loader(xv, yv, 512, False)) if rank == 0 or cfg.fsdp else None
    if rank != 0:
        return None
    mem = trainer.memory_report()
    scales = [h["scale"] for h in trainer.history if h["scale"] is not None]
    return Result(
        name=name,
        train_loss=train_loss,
        val_accuracy=metrics["val_accuracy"],
        step_time_ms=1e3 * sum(e["step_time_s"] for e in trainer.epochs) / len(trainer.epochs),
        peak_memory_bytes=mem["total"],
        skipped_steps=trainer.skipped_steps if scaler is not None else None,
        final_scale=scales[-1] if scales else None,
        losses=losses,
        graph_counts=None if trainer.graphs is None else dict(trainer.graphs.counts),
    )


def compare(cfg: Config, device: torch.device | None = None) -> list[Result]:
    """Train the digits MLP once per run in ``cfg.runs``, from the same initial weights."""
    device = device or default_device()
    if cfg.nproc > 1 and device.type == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise NprocError(
            f"{cfg.nproc} processes need as many GPUs; this machine has {torch.cuda.device_count()}"
        )
    data = load_digits(cfg.seed, device)
    torch.manual_seed(cfg.seed)
    base = make_mlp(64, cfg.hidden, 10, norms=cfg.norms).to(device)
    return [
        run_parallel(base, data, cfg, device) if name == "tkern" and cfg.nproc > 1 else
        run_one(name, base, data, cfg, device)
        for name in cfg.runs
    ]  # fmt: skip


#: what a rank of the data-parallel run reports to the parent instead of a traceback
_EXPECTED_ERRORS = (CheckpointError, OSError)


def _rank_main(rank: int, world: int, base, data, cfg: Config, device_type: str, out: str):
    """One rank of the data-parallel tkern run (started by :func:`run_parallel`,
    a member of the process group already)."""
    # as the command: Triton's interpreter casts through numpy, which warns on fp16 overflows
    warnings.filterwarnings("ignore", message="overflow encountered in cast", category=RuntimeWarning)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    try:
        data = tuple((x.to(device), y.to(device)) for x, y in data)
        outcome: tuple[str, object] = (
            "ok",
            run_one("tkern", base.to(device), data, cfg, device, rank, world),
        )
    except _EXPECTED_ERRORS as e:  # every rank meets them alike (the same file); rank 0 reports
        outcome = ("error", e)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(outcome, f)


def run_parallel(base: nn.Module, data, cfg: Config, device: torch.device) -> Result:
    """The tkern run data-parallel on ``cfg.nproc`` local processes (see :func:`run_one`)."""
    from tkern.optim.distributed import run_local_processes

    cpu_data = tuple((x.cpu(), y.cpu()) for x, y in data)
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.pkl")
        run_local_processes(
            _rank_main,
            cfg.nproc,
            (copy.deepcopy(base).cpu(), cpu_data, cfg, device.type, out),
            backend="nccl" if device.type == "cuda" else "gloo",
        )
        with open(out, "rb") as f:
            status, value = pickle.load(f)
    if status == "error":
        raise value
    return value


def format_table(rows: list[tuple[str, ...]]) -> str:
    """``rows`` (a header, then one row per run) as a fixed-width text table: the
    first column left-aligned, the others right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None (a run without it)."""
    return "-" if value is None else format(value, spec)


#: the last columns of both jobs' tables (:func:`step_cells`)
STEP_COLUMNS = ("ms/step", "peak mem", "skipped", "loss scale")


def step_cells(r) -> tuple[str, str, str, str]:
    """A run's :data:`STEP_COLUMNS` cells: what its steps cost and how its scaler went
    (``r``: a :class:`Result`, or any result with those four fields)."""
    return (
        f"{r.step_time_ms:.2f}",
        f"{r.peak_memory_bytes / 2**20:.2f} MiB",
        fmt(r.skipped_steps, "d"),
        fmt(r.final_scale, "g"),
    )


def table(results: list[Result]) -> str:
    """The side-by-side comparison as a fixed-width text table."""
    rows = [("run", "train loss", "val acc", *STEP_COLUMNS)]
    for r in results:
        rows.append((r.name, f"{r.train_loss:.4f}", f"{100 * r.val_accuracy:.1f}%", *step_cells(r)))
    return format_table(rows)


def pyplot(option: str = "--plot"):
    """matplotlib's pyplot on the Agg backend (files only), or
    :class:`MissingExtraError` naming ``option`` if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingExtraError(f"{option} needs matplotlib: pip install 'tkern[demo]'") from e
    return plt


def plot(results: list[Result], path: str) -> None:
    """Draw the per-step training loss of each run into ``path`` (PNG)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(r.losses, label=r.name, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("digits MLP: tkern vs torch fp32 vs torch autocast")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
