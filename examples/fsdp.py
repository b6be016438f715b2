"""tkern under FSDP2 (``torch.distributed.fsdp.fully_shard``): tkern's bf16 layers
and fused AdamW on sharded params, checkpointed through torch.distributed.checkpoint.

    python examples/fsdp.py --steps 20                     # 2 local CPU processes (gloo)
    torchrun --nproc_per_node=8 examples/fsdp.py --steps 200   # one GPU per process (NCCL)

tkern owns the mixed precision: ``convert_network(model, torch.bfloat16)`` puts
tkern's Linear layers in and makes the params bf16, then ``fully_shard`` shards
each Linear and the root, so each rank keeps 1/W of every param (a DTensor) and
FSDP2 all-gathers a layer's bf16 weight just before it runs. ``FusedAdamW``
keeps the fp32 master and the moments of this rank's shards only, and each step
clips by the norm of the whole gradient (the statistics are summed over the
mesh). Each rank trains on its own part of every batch. On a machine without a
GPU every kernel runs through Triton's interpreter: a step takes a second or so.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import tkern


def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, converted and sharded over every rank, and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    tkern.convert_network(model.to(device), torch.bfloat16)  # tkern Linear layers, bf16 params
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # one all-gather unit per layer
    fully_shard(model, mesh=mesh)
    # after fully_shard: the params are the DTensors the optimizer steps on
    return model, tkern.optim.FusedAdamW(model.parameters(), lr=3e-3, max_grad_norm=1.0)


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    g = torch.Generator().manual_seed(args.seed)  # the same task on every rank
    centers = torch.randn(10, 64, generator=g)
    x_all = torch.randn(4096, 64, generator=g)
    y_all = (x_all @ centers.t()).argmax(1)
    model, opt = build(device)
    losses = []
    for step in range(args.steps):
        rows = torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(x_all)
        rows = rows[rank::world]  # this rank's part of the batch
        x, y = x_all[rows].to(device), y_all[rows].to(device)
        loss = nn.functional.cross_entropy(model(x).float(), y)  # loss in fp32
        loss.backward()  # FSDP2 reduce-scatters the gradients into each rank's shard
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    mean = torch.stack(losses).to(torch.float64)
    dist.all_reduce(mean)
    mean = (mean / world).tolist()
    if args.checkpoint:  # every rank writes its own shards
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=args.checkpoint)
    if rank == 0:
        k = max(len(mean) // 4, 1)
        print(f"{world} ranks ({dist.get_backend()}), {args.steps} steps")
        print(f"loss {sum(mean[:k]) / k:.4f} -> {sum(mean[-k:]) / k:.4f}")
        if args.checkpoint:
            print(f"checkpoint written to {args.checkpoint}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="samples per step, all ranks (default: %(default)s)"
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="local CPU processes without torchrun (default: %(default)s)"
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR", help="save a torch.distributed.checkpoint here at the end"
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: one process per GPU (or gloo on CPUs)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    from tkern.optim.distributed import run_local_processes

    run_local_processes(train, args.nproc, (args,))


if __name__ == "__main__":
    main()
