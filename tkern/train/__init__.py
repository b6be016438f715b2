"""The training layer: the :class:`Trainer` (``trainer``, its checkpoints in
``trainer_checkpoint`` and memory report in ``trainer_memory``), the checkpoint
format (``checkpoint``), the main jobs (``demo``: the digits MLP; ``gpt_job``: a
language model) and the ``tkern`` command (``cli``).

The modules' earlier names at the package's top level (``tkern.trainer``,
``tkern.demo``, ``tkern.cli``, ...) still import: :data:`MOVED` maps each to its
module here, and importing the old name gives the same module object.
"""

from tkern.train.trainer import Trainer

#: old module name -> its module in this package (see :mod:`tkern` for the alias)
MOVED = {
    f"tkern.{name}": f"tkern.train.{name}"
    for name in ("trainer", "trainer_checkpoint", "trainer_memory", "checkpoint", "demo", "gpt_job", "cli")
}

__all__ = ["MOVED", "Trainer"]
