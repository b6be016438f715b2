"""The training layer: the :class:`Trainer` (``trainer``, its checkpoints in
``trainer_checkpoint`` and memory report in ``trainer_memory``), the checkpoint
format (``checkpoint``), the main jobs (``demo``: the digits MLP; ``gpt_job``: a
language model) and the ``tkern`` command (``cli``).
"""

from tkern.train.trainer import Trainer

__all__ = ["Trainer"]
