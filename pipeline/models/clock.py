"""The wall clock of every timed region: ``now(device)``, seconds after the device's queued work is done."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a CUDA synchronize on a GPU; nothing on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    """``time.perf_counter()`` after ``device``'s queued work is done (seconds)."""
    synchronize(device)
    return time.perf_counter()
