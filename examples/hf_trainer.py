"""HF transformers' Trainer driving a tkern optimizer on a converted GPT-2.

    python examples/hf_trainer.py --steps 8

``tkern.convert_network`` turns GPT-2's ``Conv1D`` layers and its (tied) LM head
into tkern GEMMs, LayerNorms stay fp32; the Trainer gets tkern's FusedAdamW and a
schedule through ``optimizers=``. On a GPU, ``fp16=True`` makes the Trainer scale
the loss with ``torch.amp.GradScaler``, which hands tkern's fused step the scale
and the overflow flag (torch's fused-optimizer protocol). On a CPU the kernels run
through Triton's interpreter: a tiny model, seconds per few steps.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import tkern


class RandomTokens(torch.utils.data.Dataset):
    """``n`` samples drawn from 4 sequences that repeat a short random pattern:
    learnable in a few steps."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        pattern = torch.randint(0, vocab, (4, 4), generator=g)
        self.ids = pattern.repeat(1, length // 4)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i % 4], "labels": self.ids[i % 4]}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-2, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).to("cuda" if cuda else "cpu")
    tkern.convert_network(model)  # Conv1D and lm_head -> tkern GEMMs (tied to wte, still)
    opt = tkern.optim.FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))

    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            fp16=cuda,  # GradScaler drives tkern's fused step on a GPU
            use_cpu=not cuda,
            disable_tqdm=True,
            seed=args.seed,
        )
        trainer = transformers.Trainer(
            model=model,
            args=training_args,
            train_dataset=RandomTokens(args.steps * args.batch_size, 12, 64, args.seed),
            optimizers=(opt, sched),
        )
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(f"{args.steps} steps ({tkern.mode()} kernels): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
