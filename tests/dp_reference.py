"""The data-parallel Trainer tests' data and their reference: one process trained
on the union of the ranks' micro-batches (tests/test_distributed.py's ZeRO-2 run,
tests/test_fsdp_trainer.py's FSDP2 run)."""

from __future__ import annotations

from typing import Any

import torch


def trainer_data() -> tuple[torch.Tensor, torch.Tensor]:
    """32 samples of 8 features, 4 classes: the trainer tests' data, split by rank."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def trainer_model() -> torch.nn.Sequential:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def trainer_loader(rank: int, world: int) -> torch.utils.data.DataLoader:
    """Rank ``rank``'s share of :func:`trainer_data` (as DistributedSampler splits it), 4 per batch."""
    x, y = trainer_data()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[rank::world], y[rank::world]), batch_size=4
    )


def trainer_reference(opt_class: type, **hyper: Any) -> torch.nn.Sequential:
    """:func:`trainer_model` trained in one process as a 2-rank Trainer run of 2 epochs of
    :func:`trainer_loader` with 2 micro-batches per step trains it: each step on the union of
    the ranks' micro-batches, the loss averaged over all of them."""
    x, y = trainer_data()
    model = trainer_model()
    opt = opt_class(model.parameters(), **hyper)
    parts = [(x[r::2], y[r::2]) for r in range(2)]
    for _epoch in range(2):
        for step in range(2):
            opt.zero_grad()
            for micro in range(2):
                rows = slice(8 * step + 4 * micro, 8 * step + 4 * micro + 4)
                xb = torch.cat([px[rows] for px, _ in parts])
                yb = torch.cat([py[rows] for _, py in parts])
                (torch.nn.functional.cross_entropy(model(xb), yb) / 2).backward()
            opt.step()
    return model
