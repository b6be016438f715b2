"""The ``tkern`` command.

* ``tkern train`` — the digits MLP trained by tkern, torch fp32 and torch
  autocast side by side (see :mod:`tkern.train.demo`); ``--model gpt``: a character-level
  GPT on real text, the same comparison with bf16 (and on a GPU compiled, fp8 and
  CUDA-graph) runs beside (see :mod:`tkern.train.gpt_job`);
* ``tkern bench [gemm|optimizer|train|all]`` — the benchmark scripts of a source checkout;
* ``tkern info [--device NAME]`` — device, versions, compiled or interpreted mode; with
  ``--device`` what tkern would run on that GPU (:mod:`tkern.train.device_report`).

Mistakes a user can make end with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import runpy
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

BENCHES = ("gemm", "optimizer", "train")
#: what --plot can write (matplotlib's formats)
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


_T = TypeVar("_T")


class UsageError(Exception):
    """A mistake on the command line or in the environment, reported in one line."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default: its value, "off" for a switch; an option
    whose default depends on the job or the device says it in its own help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is False:
            return f"{action.help} (default: off)"
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, reporting a bad option in one line on stderr (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _info(args: argparse.Namespace) -> int:
    from tkern.train import device_report

    try:
        return device_report.info(args.device)
    except ValueError as e:  # an unknown --device: its message lists the known names
        raise UsageError(str(e)) from None


def _parsed(text: str, parse: Callable[[str], _T], expected: str) -> _T:
    """``parse(text)``, or argparse's error saying what was ``expected`` (``parse``'s
    ``ValueError`` is the user's typing, not a fault to trace)."""
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _hidden(text: str) -> tuple[int, ...]:
    sizes = _parsed(
        text, lambda t: tuple(int(s) for s in t.split(",")), "comma-separated layer widths like 128,64"
    )
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be positive, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    value = _parsed(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _learning_rate(text: str) -> float:
    value = _parsed(text, float, "a number like 3e-3")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _check_writable(option: str, path: str) -> None:
    """A file ``path`` can be created or replaced: not a folder, in a folder we can write."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option}: {path!r} is a directory, expected a file name")
    folder = Path(os.path.realpath(p)).parent
    if not folder.is_dir():
        raise UsageError(f"{option}: folder {str(folder)!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(f"{option}: cannot write in folder {str(folder)!r} ({e.strerror or e})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{option}: {path!r} is not writable")


def _only(args: argparse.Namespace, runs: tuple[str, ...]) -> tuple[str, ...] | None:
    """The runs ``--only`` names (comma-separated), each one of ``runs``; None without it."""
    if args.only is None:
        return None
    names = tuple(n.strip() for n in args.only.split(","))
    for name in names:
        if name not in runs:
            raise UsageError(
                f"--only: {name!r} is not a run of --model {args.model}; choose from {', '.join(runs)}"
            )
    return names


#: the options of the MLP job alone (argparse dest -> option), refused with --model gpt
MLP_ONLY = {
    "epochs": "--epochs",
    "hidden": "--hidden",
    "checkpoint": "--checkpoint",
    "resume": "--resume",
    "fsdp": "--fsdp",
    "norms": "--norms",
}
#: the options of the GPT job alone, refused with --model mlp
GPT_ONLY = {
    "data": "--data",
    "steps": "--steps",
    "block_size": "--block-size",
    "layers": "--layers",
    "width": "--width",
    "heads": "--heads",
    "eval_every": "--eval-every",
    "compile": "--compile",
}


def _left_out(option: str, run: str, args: argparse.Namespace) -> UsageError:
    """The error for ``option``, which applies to ``run``, when ``--only`` leaves that run out."""
    return UsageError(f"{option} applies to the {run} run, but --only {args.only} leaves it out")


def _check_plot(args: argparse.Namespace) -> None:
    if args.plot:
        _check_writable("--plot", args.plot)
        if Path(args.plot).suffix.lower() not in PLOT_FORMATS:
            raise UsageError(
                f"--plot: {args.plot!r} is not an image file name; end it in {', '.join(PLOT_FORMATS)}"
            )


def _check_train_args(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for ``tkern train`` options that cannot work together
    or name files that cannot be read or written, before anything trains."""
    from tkern.train import demo

    for dest, option in GPT_ONLY.items():
        if getattr(args, dest) not in (None, False):
            raise UsageError(f"{option} applies to --model gpt")
    only = _only(args, demo.RUNS)
    _check_plot(args)
    if args.resume and args.fsdp:
        if not Path(args.resume).is_dir():
            raise UsageError(
                f"--resume: with --fsdp a checkpoint is a torch.distributed.checkpoint folder; "
                f"{args.resume!r} is not one"
            )
    elif args.resume:
        if Path(args.resume).is_dir():
            raise UsageError(f"--resume: {args.resume!r} is a directory, expected a checkpoint file")
        if not Path(args.resume).is_file():
            raise UsageError(f"--resume: checkpoint {args.resume!r} does not exist")
        if only and "tkern" not in only:
            raise _left_out("--resume", "tkern", args)
    if args.checkpoint and args.fsdp:  # each rank writes its shards into a folder
        if Path(args.checkpoint).exists() and not Path(args.checkpoint).is_dir():
            raise UsageError(
                f"--checkpoint: with --fsdp a checkpoint is a folder; {args.checkpoint!r} is a file"
            )
    elif args.checkpoint:
        _check_writable("--checkpoint", args.checkpoint)
        if only and "tkern" not in only:
            raise _left_out("--checkpoint", "tkern", args)
    if args.cuda_graph and only and "tkern" not in only:
        raise _left_out("--cuda-graph", "tkern", args)
    batch_size = args.batch_size or demo.Config().batch_size
    if args.nproc > 1 and batch_size < args.nproc:
        raise UsageError(
            f"--nproc: {args.nproc} processes split each batch of --batch-size {batch_size}; "
            f"use a --batch-size of at least {args.nproc}"
        )
    if args.fsdp and args.nproc < 2:
        raise UsageError("--fsdp shards the tkern run over --nproc processes: give --nproc 2 or more")
    if args.nproc > 1 and "tkern" not in (only or demo.RUNS):
        raise _left_out("--nproc", "tkern", args)


def _table_and_plot(job, results, plot: str | None, drawn: str) -> None:
    """Print ``job``'s table of ``results`` (``job``: :mod:`~tkern.train.demo` or
    :mod:`~tkern.train.gpt_job`) and, with ``--plot``, write its figure there."""
    print(job.table(results))
    if plot:
        job.plot(results, plot)
        print(f"{drawn} written to {plot}")


def _print_graph_counts(results) -> None:
    """A line per run that ran whole-step CUDA graphs: its steps by kind."""
    for r in results:
        if r.graph_counts is not None:
            how = ", ".join(
                f"{r.graph_counts.get(k, 0)} {k}" for k in ("warmup", "capture", "replay", "eager")
            )
            print(f"{r.name} run: whole-step CUDA graphs, steps by kind: {how}")


def _train(args: argparse.Namespace) -> int:
    if args.model == "gpt":
        return _train_gpt(args)
    from tkern.train import demo
    from tkern.train.checkpoint import CheckpointError

    _check_train_args(args)
    runs = _only(args, demo.RUNS) or demo.RUNS
    d = demo.Config()
    cfg = demo.Config(
        epochs=args.epochs or d.epochs,
        batch_size=args.batch_size or d.batch_size,
        hidden=args.hidden or d.hidden,
        optimizer=args.optimizer,
        scaler=args.scaler,
        lr=args.lr,
        seed=args.seed,
        runs=runs,
        progress=not args.no_progress,
        checkpoint=args.checkpoint,
        resume=args.resume,
        nproc=args.nproc,
        fsdp=args.fsdp,
        float8=args.float8,
        cuda_graph=True if args.cuda_graph else "auto",
        norms=args.norms,
        underflow_every=args.underflow_every,
    )
    try:
        results = demo.compare(cfg)
        if args.nproc > 1:
            how = "NCCL" if demo.default_device().type == "cuda" else "gloo"
            what = (
                f"FSDP2 (fully_shard), fused {args.optimizer}" if args.fsdp else f"sharded {args.optimizer}"
            )
            print(
                f"tkern run: data-parallel on {args.nproc} processes ({how}), {what}, "
                f"batch {cfg.batch_size // args.nproc} per process (ms/step, peak mem: process 0's)"
            )
        _print_graph_counts(results)
        _table_and_plot(demo, results, args.plot, "loss curves")
    except demo.MissingExtraError as e:
        raise UsageError(str(e)) from None
    except CheckpointError as e:  # the tkern run loads it before anything trains
        raise UsageError(f"--resume: {e}") from None
    except demo.NprocError as e:
        raise UsageError(f"--nproc: {e}") from None
    except OSError as e:
        if args.checkpoint and e.filename == args.checkpoint:
            raise UsageError(f"--checkpoint: {e.strerror}: {args.checkpoint!r}") from None
        raise
    return 0


def gpt_config(args: argparse.Namespace):
    """The :class:`tkern.train.gpt_job.GPTConfig` of ``tkern train --model gpt``'s options
    (their defaults: :func:`tkern.train.gpt_job.default_config` of this machine's device);
    :class:`UsageError` for an option that does not apply or a run that cannot be."""
    from tkern.train import demo, gpt_job

    for dest, option in MLP_ONLY.items():
        if getattr(args, dest) not in (None, False):
            raise UsageError(f"{option} applies to --model mlp (the digits MLP), not --model gpt")
    if args.nproc > 1:
        raise UsageError("--nproc applies to --model mlp (the digits MLP), not --model gpt")
    _check_plot(args)
    d = gpt_job.default_config(demo.default_device())
    runs = list(_only(args, gpt_job.RUNS) or d.runs)
    if args.only is None:  # asked for by name: the run that shows it
        runs += [r for r, asked in (("tkern-fp8", args.float8), ("tkern-graph", args.cuda_graph)) if asked]
        runs = list(dict.fromkeys(runs))
    elif args.float8 and "tkern-fp8" not in runs:
        raise _left_out("--float8", "tkern-fp8", args)
    elif args.cuda_graph and "tkern-graph" not in runs:
        raise _left_out("--cuda-graph", "tkern-graph", args)
    cfg = gpt_job.GPTConfig(
        steps=args.steps or d.steps,
        batch_size=args.batch_size or d.batch_size,
        block_size=args.block_size or d.block_size,
        n_layer=args.layers or d.n_layer,
        n_embd=args.width or d.n_embd,
        n_head=args.heads or d.n_head,
        eval_every=min(args.eval_every or d.eval_every, args.steps or d.steps),
        eval_windows=d.eval_windows,
        optimizer=args.optimizer,
        scaler=args.scaler,
        lr=args.lr or d.lr,
        seed=args.seed,
        runs=tuple(runs),
        data=args.data,
        float8=args.float8 or d.float8,
        progress=not args.no_progress,
        underflow_every=args.underflow_every,
        compile=args.compile,
    )
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"--width {cfg.n_embd} is not a multiple of --heads {cfg.n_head}")
    return cfg


def _train_gpt(args: argparse.Namespace) -> int:
    from tkern.train import demo, gpt_job

    cfg = gpt_config(args)
    try:
        corpus = gpt_job.prepare(cfg)  # a bad --data fails here, before anything trains
    except gpt_job.DataError as e:
        raise UsageError(f"--data: {e}") from None
    device = demo.default_device()
    print(
        f"text: {corpus.source}, {len(corpus.train) + len(corpus.val)} characters "
        f"({len(corpus.val)} held out), {len(corpus.chars)} distinct"
    )
    print(
        f"training {', '.join(cfg.runs)} on {device.type} ({tkern_mode()}): {cfg.steps} steps of "
        f"{cfg.batch_size} x {cfg.block_size} characters, {cfg.optimizer} lr {cfg.lr:g}, seed {cfg.seed}"
    )
    model = gpt_job.make_model(cfg, corpus.vocab_size)
    print(f"model: {model[1]}")
    if device.type != "cuda":  # every tkern kernel interpreted: say how long before it starts
        seconds, how = gpt_job.estimate(cfg, corpus, model[0], device)
        print(f"this will take about {gpt_job.duration(seconds)} here ({how})", flush=True)
    try:
        results, _, _ = gpt_job.compare(cfg, device, corpus, model)
        _print_graph_counts(results)
        print(
            "val bpc: validation loss in bits per character; ms/step and tokens/s "
            "leave out the first evaluation interval (one-off costs)"
        )
        _table_and_plot(gpt_job, results, args.plot, "curves and bar charts")
    except demo.MissingExtraError as e:
        raise UsageError(str(e)) from None
    return 0


def tkern_mode() -> str:
    """How tkern's kernels run here, in words."""
    import tkern

    return "Triton's interpreter" if tkern.mode() == "interpreted" else "compiled Triton"


def _bench(args: argparse.Namespace) -> int:
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if not folder.is_dir():
        raise UsageError("tkern bench runs the scripts in benchmarks/ of a source checkout; none was found")
    names = BENCHES if args.which == "all" else (args.which,)
    sys.path.insert(0, str(folder))
    for name in names:
        sys.argv = [f"bench_{name}.py", *args.extra]
        runpy.run_path(str(folder / f"bench_{name}.py"), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tkern", description="Triton kernels for mixed-precision training.")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="device, torch/triton versions, compiled or interpreted mode")
    info.add_argument(
        "--device", metavar="NAME", help="plan for this GPU (h100, mi300x, ...: tkern.device.SPECS)"
    )
    info.set_defaults(func=_info)

    train = sub.add_parser(
        "train",
        help="train a model by tkern, torch fp32 and torch autocast side by side and compare: the digits "
        "MLP (default) or, with --model gpt, a character-level GPT",
        description="Train one model several ways from the same weights on the same batches and compare "
        "loss, speed and memory. --model mlp (the default): the digits MLP, by tkern, torch fp32 and torch "
        "autocast. --model gpt: a character-level GPT on real text, the same runs and tkern in bf16 (on a "
        "GPU also compiled, fp8 and CUDA-graph runs); on a CPU it prints how long it will take first.",
        formatter_class=_Help,
    )
    _add_train_options(train)
    train.set_defaults(func=_train)

    bench = sub.add_parser("bench", help="run the benchmark scripts (GPU)", formatter_class=_Help)
    bench.add_argument("which", nargs="?", choices=(*BENCHES, "all"), default="all", help="which benchmark")
    bench.add_argument("extra", nargs=argparse.REMAINDER, help="passed on to the scripts")
    bench.set_defaults(func=_bench)
    return parser


def _add_train_options(train: argparse.ArgumentParser) -> None:
    """The options of ``tkern train``: both jobs', then the MLP's, then the GPT's."""
    _add_common_options(train)
    _add_mlp_options(train)
    _add_gpt_options(train)


def _add_common_options(train: argparse.ArgumentParser) -> None:
    """The options both jobs take (defaults: :class:`tkern.train.demo.Config`, and for
    the GPT job :func:`tkern.train.gpt_job.default_config`)."""
    from tkern.nn.float8 import FLOAT8_SCALINGS
    from tkern.train.demo import OPTIMIZER_DEFAULTS, OPTIMIZERS, RUNS, SCALERS, Config
    from tkern.train.gpt_job import CPU_RUNS, GPU_RUNS

    d = Config()
    cpu, gpu = _gpt_defaults()
    lrs = ", ".join(f"{k} {v['lr']:g}" for k, v in OPTIMIZER_DEFAULTS.items())
    train.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="mlp: the digits MLP; gpt: a character-level GPT on real text (fp32, autocast, tkern, "
        "tkern-bf16; on a GPU also autocast-compiled, tkern-fp8, tkern-graph)",
    )
    train.add_argument(
        "--batch-size",
        type=_positive,
        help=f"samples per step: mlp digits (default: {d.batch_size}); gpt sequences (default: "
        f"{cpu.batch_size} on a CPU, {gpu.batch_size} on a GPU)",
    )
    train.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer, help="the optimizer")
    train.add_argument("--scaler", choices=sorted(SCALERS), default=d.scaler, help="tkern's loss scaler")
    train.add_argument(
        "--lr",
        type=_learning_rate,
        default=None,
        metavar="LR",
        help=f"learning rate (default: mlp: the optimizer's own, {lrs}; sgd with momentum 0.9; "
        f"gpt: {cpu.lr:g} on a CPU, {gpu.lr:g} on a GPU)",
    )
    train.add_argument("--seed", type=int, default=d.seed, help="seed of the weights, split and batches")
    train.add_argument(
        "--only",
        metavar="RUNS",
        help=f"train only these runs, comma-separated (default: every run: mlp {', '.join(RUNS)}; "
        f"gpt {', '.join(CPU_RUNS)} on a CPU, {', '.join(GPU_RUNS)} on a GPU)",
    )
    train.add_argument("--plot", metavar="PNG", help="draw the loss curves into this file (default: none)")
    train.add_argument(
        "--float8",
        choices=FLOAT8_SCALINGS,
        default=None,
        metavar="RECIPE",
        help="the tkern run in bf16 with fp8 GEMMs (tkern.nn.Float8Linear) of this scaling recipe: "
        "tensorwise, delayed, blockwise or mxfp8; Linear layers whose sizes are not multiples of 16 "
        "(32 under mxfp8) stay bf16 "
        "(default: none; gpt on a GPU: a tkern-fp8 run, tensorwise)",
    )
    train.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture the tkern run's whole step (forward, backward, scaler, optimizer) as a CUDA graph "
        "per batch shape and replay it; where it cannot be captured (no GPU, --nproc > 1) the run warns "
        "once with the reason and trains eager. Without it the Trainer chooses (cuda_graph='auto')",
    )
    train.add_argument(
        "--underflow-every",
        type=_positive,
        metavar="K",
        help="the tkern runs sample their 16-bit gradients every K steps for the fraction that is zero "
        "or subnormal (optimizer.track_underflows) and log a warning naming the tensors when the loss "
        "scale is likely too low (default: not sampled)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_mlp_options(train: argparse.ArgumentParser) -> None:
    """The options of the digits MLP alone (refused with ``--model gpt``)."""
    from tkern.train.demo import Config

    d = Config()
    mlp = train.add_argument_group("--model mlp (the digits MLP) only")
    mlp.add_argument("--epochs", type=_positive, help=f"epochs to train (default: {d.epochs})")
    mlp.add_argument(
        "--hidden",
        type=_hidden,
        help=f"hidden layer widths, e.g. 128,64 (default: {','.join(map(str, d.hidden))})",
    )
    mlp.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="save the tkern run's checkpoint here after each epoch (default: none)",
    )
    mlp.add_argument(
        "--resume", metavar="PATH", help="start the tkern run from this checkpoint (default: none)"
    )
    mlp.add_argument(
        "--nproc",
        type=_positive,
        default=d.nproc,
        metavar="N",
        help="train the tkern run data-parallel on N local processes (gloo on the CPU, NCCL on N GPUs) "
        "with the sharded optimizer: each process trains on every N-th sample with a batch of "
        "batch-size // N, so a step still sees batch-size samples; the fp32 and autocast runs stay "
        "in one process; 1: no processes started",
    )
    mlp.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc N: the tkern run under FSDP2 (torch's fully_shard: each block or Linear "
        "and the root), tkern's fused optimizer on the sharded params, instead of ZeRO-2's sharded "
        "optimizer; --checkpoint/--resume then name a torch.distributed.checkpoint folder",
    )
    mlp.add_argument(
        "--norms", action="store_true", help="a LayerNorm in each hidden block (Linear-LayerNorm-ReLU)"
    )


def _gpt_defaults():
    """The GPT job's defaults on a CPU and on a GPU (:func:`tkern.train.gpt_job.default_config`)."""
    import torch

    from tkern.train.gpt_job import default_config

    return default_config(torch.device("cpu")), default_config(torch.device("cuda"))


def _add_gpt_options(train: argparse.ArgumentParser) -> None:
    """The options of the GPT job alone (refused with ``--model mlp``)."""
    cpu, gpu = _gpt_defaults()
    gpt = train.add_argument_group(
        "--model gpt (the character-level GPT) only",
        "defaults: a tiny model on a CPU, where every tkern kernel runs through Triton's interpreter "
        "(the job prints how long it will take before it starts), GPT-2 small's shape on a GPU",
    )

    def default(field: str) -> str:
        return f"(default: {getattr(cpu, field)} on a CPU, {getattr(gpu, field)} on a GPU)"

    gpt.add_argument(
        "--data",
        metavar="PATH",
        help="a UTF-8 text file to train on, its last tenth held out (default: CPython's pydoc_data.topics)",
    )
    gpt.add_argument("--steps", type=_positive, help=f"optimizer steps per run {default('steps')}")
    gpt.add_argument(
        "--block-size", type=_positive, metavar="T", help=f"characters per sequence {default('block_size')}"
    )
    gpt.add_argument("--layers", type=_positive, metavar="N", help=f"transformer blocks {default('n_layer')}")
    gpt.add_argument("--width", type=_positive, metavar="D", help=f"model width, n_embd {default('n_embd')}")
    gpt.add_argument(
        "--heads", type=_positive, metavar="H", help=f"attention heads, dividing --width {default('n_head')}"
    )
    gpt.add_argument(
        "--eval-every",
        type=_positive,
        metavar="N",
        help=f"steps between validation losses {default('eval_every')}",
    )
    gpt.add_argument(
        "--compile",
        action="store_true",
        help="train the tkern runs (not tkern-graph) under torch.compile(fullgraph=True)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            # Triton's interpreter casts through numpy, which warns when an fp16
            # value overflows; tkern detects those overflows itself (skipped steps)
            warnings.filterwarnings("ignore", message="overflow encountered in cast", category=RuntimeWarning)
            return args.func(args)
    except UsageError as e:
        print(f"tkern {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
