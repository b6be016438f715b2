"""Triton kernels and their launchers. Nothing here knows about nn or optim."""

from tkern.kernels._common import INTERPRET, mode

__all__ = ["INTERPRET", "mode"]
