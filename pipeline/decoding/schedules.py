"""Block-size schedules: how the decoder picks B for each draft-verify step.

A schedule sees the target's last-token logits once after prefill (``first``) and the acceptance
length of every step (``next``); one whose ``static`` attribute is true keeps ``first``'s B for the
whole request. ``FixedSchedule`` is the usual single-B decoder, the BlockPilot
predictor wraps a policy in ``first`` (see ``pipeline.policy``), and ``EMASchedule`` is the per-round
adaptive baseline of the SGLang DFlash work.
``FirstChoice`` wraps any schedule and records the B its ``first`` picked (the eval stage and the server report it).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class BlockSizeSchedule(Protocol):
    """Chooses the block size B (tokens per block, the anchor included; B=1 is autoregressive)."""

    max_block_size: int

    def first(self, last_logits: torch.Tensor) -> int:
        """B for the first step, from the target's prefill logits at the last prompt token ([V])."""

    def next(self, tau: int, block_size: int) -> int:
        """B for the next step, given the last step's acceptance length tau (tokens) and its B."""


class FixedSchedule:
    """One block size for the whole request."""

    static = True  # B never changes after ``first`` (the eval stage may share such decodes)

    def __init__(self, block_size: int):
        self.block_size = self.max_block_size = int(block_size)

    def first(self, last_logits: torch.Tensor) -> int:
        return self.block_size

    def next(self, tau: int, block_size: int) -> int:
        return self.block_size


class EMASchedule:
    """Per-step adaptive B from a moving average of recent acceptance lengths.

    After each step, ``ema = alpha * tau + (1 - alpha) * ema``; the next B is the smallest candidate
    at least ``ema + margin`` (the largest candidate when none is), so blocks grow while drafts are
    accepted and shrink after rejections. Starts at ``start`` (default: the middle candidate).
    """

    def __init__(self, candidates: Sequence[int], alpha: float = 0.5, margin: float = 1.0, start: int | None = None):
        self.candidates = sorted(int(c) for c in candidates)
        if not self.candidates:
            raise ValueError("EMASchedule needs at least one candidate block size")
        self.alpha, self.margin = float(alpha), float(margin)
        self.start = int(start) if start is not None else self.candidates[len(self.candidates) // 2]
        self.max_block_size = self.candidates[-1]
        self.ema = float(self.start)

    def first(self, last_logits: torch.Tensor) -> int:
        self.ema = float(self.start)
        return self.start

    def next(self, tau: int, block_size: int) -> int:
        self.ema = self.alpha * tau + (1 - self.alpha) * self.ema
        goal = self.ema + self.margin
        return next((c for c in self.candidates if c >= goal), self.candidates[-1])


class FirstChoice:
    """Wraps a schedule and records the block size its ``first`` picked (``chosen``, tokens)."""

    def __init__(self, schedule):
        self.schedule = FixedSchedule(schedule) if isinstance(schedule, int) else schedule
        self.max_block_size = self.schedule.max_block_size
        self.chosen: int | None = None

    def first(self, last_logits: torch.Tensor) -> int:
        self.chosen = self.schedule.first(last_logits)
        return self.chosen

    def next(self, tau: int, block_size: int) -> int:
        return self.schedule.next(tau, block_size)

    def __getattr__(self, name: str):  # choose_width of a verify-width schedule, and any other optional hook
        if name == "schedule":
            raise AttributeError(name)
        return getattr(self.schedule, name)

    @property
    def static(self) -> bool:
        return bool(getattr(self.schedule, "static", False))
