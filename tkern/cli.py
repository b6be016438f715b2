"""The ``tkern`` command.

* ``tkern train`` — the digits MLP trained by tkern, torch fp32 and torch
  autocast side by side (see :mod:`tkern.demo`);
* ``tkern bench [gemm|optimizer|train|all]`` — the benchmark scripts of a source checkout;
* ``tkern info`` — device, versions, compiled or interpreted mode.

Mistakes a user can make end with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

BENCHES = ("gemm", "optimizer", "train")


class UsageError(Exception):
    """A mistake on the command line or in the environment, reported in one line."""


def _info(_: argparse.Namespace) -> int:
    import torch
    import triton

    import tkern

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"
    how = "Triton's interpreter on the CPU" if tkern.mode() == "interpreted" else "compiled for the GPU"
    print(f"tkern   {tkern.__version__}")
    print(f"device  {device}")
    print(f"torch   {torch.__version__}")
    print(f"triton  {triton.__version__}")
    print(f"mode    {tkern.mode()}  ({how})")
    return 0


def _hidden(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer widths like 128,64, got {text!r}"
        ) from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be positive, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _train(args: argparse.Namespace) -> int:
    from tkern import demo

    if args.plot:
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--plot: folder {str(folder)!r} does not exist")
    if args.resume and not Path(args.resume).is_file():
        raise UsageError(f"--resume: checkpoint {args.resume!r} does not exist")
    if args.checkpoint and not Path(args.checkpoint).resolve().parent.is_dir():
        raise UsageError(f"--checkpoint: folder of {args.checkpoint!r} does not exist")
    runs = (args.only,) if args.only else demo.RUNS
    cfg = demo.Config(
        epochs=args.epochs,
        batch_size=args.batch_size,
        hidden=args.hidden,
        optimizer=args.optimizer,
        scaler=args.scaler,
        lr=args.lr,
        seed=args.seed,
        runs=runs,
        progress=not args.no_progress,
        checkpoint=args.checkpoint,
        resume=args.resume,
    )
    try:
        results = demo.compare(cfg)
        print(demo.table(results))
        if args.plot:
            demo.plot(results, args.plot)
            print(f"loss curves written to {args.plot}")
    except demo.MissingExtraError as e:
        raise UsageError(str(e)) from None
    return 0


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
    parser = argparse.ArgumentParser(prog="tkern", description="Triton kernels for mixed-precision training.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="device, torch/triton versions, compiled or interpreted mode").set_defaults(
        func=_info
    )

    from tkern.demo import OPTIMIZERS, RUNS, SCALERS, Config

    d = Config()
    train = sub.add_parser(
        "train", help="train the digits MLP with tkern, torch fp32 and torch autocast; compare"
    )
    train.add_argument("--epochs", type=_positive, default=d.epochs)
    train.add_argument("--batch-size", type=_positive, default=d.batch_size)
    train.add_argument("--hidden", type=_hidden, default=d.hidden, help="hidden layer widths, e.g. 128,64")
    train.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer)
    train.add_argument("--scaler", choices=sorted(SCALERS), default=d.scaler, help="tkern's loss scaler")
    train.add_argument("--lr", type=float, default=d.lr)
    train.add_argument("--seed", type=int, default=d.seed)
    train.add_argument("--only", choices=RUNS, help="train only this run")
    train.add_argument("--plot", metavar="PNG", help="draw the loss curves into this file")
    train.add_argument(
        "--checkpoint", metavar="PATH", help="save the tkern run's checkpoint here after each epoch"
    )
    train.add_argument("--resume", metavar="PATH", help="start the tkern run from this checkpoint")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(func=_train)

    bench = sub.add_parser("bench", help="run the benchmark scripts (GPU)")
    bench.add_argument("which", nargs="?", choices=(*BENCHES, "all"), default="all")
    bench.add_argument("extra", nargs=argparse.REMAINDER, help="passed on to the scripts")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"tkern {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
