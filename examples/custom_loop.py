"""The README's quick start as a script: a custom training loop with tkern.

    python examples/custom_loop.py --steps 40

A small MLP (LayerNorm kept in fp32) learns a toy classification task with
tkern's fp16 GEMMs, FusedAdamW on fp32 master weights and a dynamic loss scale.
On a machine without a GPU every kernel runs through Triton's interpreter, so a
step takes far longer than plain torch's, even for this tiny model.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tkern


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # a toy task: which of 10 random directions the input points along most
    centers = torch.randn(10, 64)
    x_all = torch.randn(2048, 64)
    y_all = (x_all @ centers.t()).argmax(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_all, y_all), batch_size=args.batch_size, shuffle=True
    )

    # --- the README's quick start, from here
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 10)).to(device)
    tkern.convert_network(model)  # Linear -> tkern fp16 Linear, LayerNorm -> tkern LayerNorm (fp32)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=3e-3, max_grad_norm=1.0)  # after moving the model
    scaler = tkern.DynamicLossScaler()

    step, start, losses = 0, time.perf_counter(), []
    while step < args.steps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).float(), y)  # loss in fp32
            scaler.scale(loss).backward()
            scaler.step(opt)  # skipped on the device if a gradient overflowed
            scaler.update()  # one tiny kernel, no host sync
            losses.append(loss.detach())
            step += 1
            if step == args.steps:
                break
    # --- to here

    first, last = losses[0].item(), torch.stack(losses[-10:]).mean().item()
    seconds = time.perf_counter() - start
    print(
        f"{args.steps} steps in {seconds:.1f} s ({tkern.mode()} kernels): loss {first:.3f} -> {last:.3f}, "
        f"loss scale {scaler.get_scale():.0f}"
    )
    return last


if __name__ == "__main__":
    main()
