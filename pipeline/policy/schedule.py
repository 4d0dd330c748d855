"""The BlockPilot schedule: run the predictor once on the prefill logits, keep that block size.

``SpeculativeDecoder.decode`` times ``schedule.first`` as ``RequestStats.schedule_ms``, so the
predictor's cost is part of every reported tokens/s. The train stage measures the predictor's overhead on random
logits rows (``measure_overhead_ms``) and records it in ``predictor.json`` (``inference_ms``).
"""

from __future__ import annotations

import statistics
import time

import torch

from pipeline.decoding.schedules import Schedule
from pipeline.policy.export import Predictor


class PredictorSchedule(Schedule):
    """``Schedule`` that picks B once from the target's last-token logits and keeps it.

    Args:
        predictor: a loaded ``Predictor`` (featurizer + net + candidates).
    Attributes:
        max_block_size: the largest candidate (the decoder checks it against the drafter's limit).
        block_size: the B chosen by the last ``first`` call (None before).
    """

    static = True  # B is chosen once per request

    def __init__(self, predictor: Predictor):
        self.predictor = predictor
        self.max_block_size = max(predictor.candidates)
        self.block_size: int | None = None

    def first(self, last_logits: torch.Tensor) -> int:
        """B (tokens) for the whole request from the prefill logits ``last_logits`` [V]."""
        self.block_size = self.predictor.predict(last_logits)
        return self.block_size

    def next(self, tau: int, block_size: int) -> int:
        return self.block_size


def measure_overhead_ms(predictor: Predictor, vocab_size: int | None = None, repeats: int = 200, warmup: int = 20,
                        device: str | torch.device = "cpu", seed: int = 0) -> dict[str, float]:
    """Wall time of ``PredictorSchedule.first`` on random [V] logits rows (featurize + forward + argmax).

    Returns:
        ``{"median_ms", "p90_ms", "mean_ms"}`` over ``repeats`` calls after ``warmup`` calls.
    """
    V = vocab_size or predictor.featurizer.spec.vocab_size
    if not V:
        raise ValueError("pass vocab_size: the predictor's feature spec does not record one")
    generator = torch.Generator().manual_seed(seed)
    rows = (torch.randn(8, V, generator=generator) * 3).to(device)
    schedule = PredictorSchedule(predictor)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        row = rows[i % len(rows)]
        sync()
        t0 = time.perf_counter()
        schedule.first(row)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))], "mean_ms": statistics.fmean(times)}
