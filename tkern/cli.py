"""The ``tkern`` command: ``tkern info`` (and, later, train / bench)."""

from __future__ import annotations

import argparse
import sys


def _info(_: argparse.Namespace) -> int:
    import torch
    import triton

    from tkern.kernels import mode

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"
    print(f"tkern   {__import__('tkern').__version__}")
    print(f"device  {device}")
    print(f"torch   {torch.__version__}")
    print(f"triton  {triton.__version__}")
    how = "Triton's interpreter on the CPU" if mode() == "interpreted" else "compiled for the GPU"
    print(f"mode    {mode()}  ({how})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tkern", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, torch/triton versions, compiled or interpreted mode").set_defaults(
        func=_info
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
