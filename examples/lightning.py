"""Lightning with tkern: a LightningModule whose ``configure_optimizers`` returns a
tkern optimizer, and a manual-optimization variant that scales the loss with a
tkern loss scaler.

    python examples/lightning.py --steps 20
    python examples/lightning.py --steps 20 --manual

The model is converted once in ``__init__`` (tkern fp16 GEMMs, LayerNorm in
fp32). Automatic optimization needs nothing else on a CPU; on a GPU,
``precision="16-mixed"`` makes Lightning scale the loss with
``torch.amp.GradScaler``, which drives tkern's fused step. The manual variant
keeps the whole step on the device with ``tkern.DynamicLossScaler``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import tkern

# This file is named lightning.py: when run as a script its folder comes first on
# sys.path, and `import lightning` would find the file itself instead of the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

try:
    import lightning as L
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit("this example needs lightning: pip install -e '.[integrations]'") from exc


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 3e-3, manual: bool = False) -> None:
        super().__init__()
        self.lr = lr
        self.net = tkern.convert_network(
            nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
        )
        self.automatic_optimization = not manual
        self.scaler = tkern.DynamicLossScaler() if manual else None
        self.losses: list[float] = []

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)  # loss in fp32

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers().optimizer  # the tkern optimizer inside Lightning's wrapper
        opt.zero_grad()
        self.manual_backward(self.scaler.scale(loss))
        self.scaler.step(opt)  # skipped on the device if a gradient overflowed
        self.scaler.update()
        return loss.detach()

    def configure_optimizers(self):
        return tkern.optim.FusedAdamW(self.parameters(), lr=self.lr, max_grad_norm=1.0)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--manual", action="store_true", help="manual optimization with a tkern scaler")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    L.seed_everything(args.seed, verbose=False)

    centers = torch.randn(4, 32)
    x = torch.randn(32 * max(args.steps, 1), 32)
    y = (x @ centers.t()).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    module = Classifier(manual=args.manual)
    cuda = torch.cuda.is_available()
    trainer = L.Trainer(
        # one optimizer step per batch; counted in batches, since Lightning counts only the
        # steps it takes itself, and the manual variant steps through the tkern scaler
        max_epochs=1,
        limit_train_batches=args.steps,
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="16-mixed" if cuda and not args.manual else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    losses = module.losses
    mode = "manual, tkern scaler" if args.manual else "automatic"
    print(f"{len(losses)} steps ({mode}, {tkern.mode()} kernels): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
