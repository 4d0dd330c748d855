"""The one timer of every per-machine measurement: named points timed in interleaved rounds.

Every cost this project measures (a step's verify and draft by width and context, a batched step by rows, the smallm
kernel's crossover, ``bench_step``'s figures) is a set of named callables timed here. ``time_points`` runs one warm-up
round, then ``rounds`` rounds in which every point runs once, in an order rotated each round. A point's cost is the
least of its samples (other work on the cores only ever adds time), and its ``spread`` is (median - least) / least.
Interleaving spreads each point's samples over the whole measurement, so a noisy minute inflates every point a little
rather than some points fully: the minimum then keeps the quiet samples, and the points it cannot save are caught by
the shape check (``pipeline.costs.curves.suspect_points``) and timed again (``retime``). With ``warm`` = w each timed
run follows w untimed runs of the same point, back to back: the cost a decode loop meets, whose step finds its weights
in the caches the step before left them in (2026-12-06, Intel Xeon host, SmolLM2 int8 at context 256: one verify row
4.5 ms warm against 6.2 ms after a prefill and a draft; a second row adds 1.3 ms warm, 0.2 ms interleaved cold, so a
cold model priced extra rows ~6x too cheap).

Standard library only; ``sync`` (a CUDA synchronize) and ``clock`` are passed in.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping


@dataclass
class Timing:
    """The samples of one timed point (ms).

    Attributes:
        samples: every timed run (warm-up excluded), in order.
    """

    samples: list[float] = field(default_factory=list)

    @property
    def ms(self) -> float:
        """The point's cost: its least sample (ms)."""
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(median - least) / least: 0 on a quiet machine, large when other work shared the cores."""
        low = self.ms
        return (self.median - low) / low if low > 0 else 0.0


def time_points(points: Mapping[Hashable, Callable[[], None]], rounds: int = 5, warmup: int = 1,
                sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                progress: Callable[[int], None] | None = None, into: dict | None = None, warm: int = 0
                ) -> dict[Hashable, Timing]:
    """Time every point of ``points`` in ``warmup`` + ``rounds`` interleaved rounds (see the module doc).

    Args:
        points: {name: a callable that runs the point once (and undoes what it changed, e.g. rolls a cache back)}.
        sync: called before reading the clock (a CUDA synchronize); clock: seconds.
        progress: called with 1 after each timed run (a progress bar's update).
        into: timings to add these samples to (``retime``), else new ones.
        warm: untimed runs of a point right before each of its timed runs (module doc).
    Returns:
        {name: Timing}.
    Raises:
        ValueError: for rounds < 1, warmup < 0 or warm < 0.
    """
    if rounds < 1 or warmup < 0 or warm < 0:
        raise ValueError(f"timing needs rounds >= 1, warmup >= 0 and warm >= 0, got rounds={rounds}, warmup={warmup}, "
                         f"warm={warm}")
    sync = sync or (lambda: None)
    names = list(points)
    out = into if into is not None else {}
    for name in names:
        out.setdefault(name, Timing())
    for r in range(warmup + rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            for _ in range(warm):
                points[name]()
            sync()
            t0 = clock()
            points[name]()
            sync()
            if r >= warmup:
                out[name].samples.append((clock() - t0) * 1e3)
                if progress is not None:
                    progress(1)
    return out


def retime(points: Mapping[Hashable, Callable[[], None]], timings: dict[Hashable, Timing], suspects: Callable[[], set],
           rounds: int = 5, attempts: int = 2, pause_s: float = 1.0, sleep: Callable[[float], None] = time.sleep,
           **kwargs) -> dict:
    """Time the suspect points again until the shape check passes or ``attempts`` are spent.

    Args:
        points / timings: as ``time_points`` took and returned them.
        suspects: recomputes the suspect names from ``timings`` (the caller's shape check).
        pause_s: wait before each attempt (a noisy minute passes).
        kwargs: passed to ``time_points``.
    Returns:
        {"retimed": [names timed again], "unresolved": [names still suspect]} (names as strings).
    """
    retimed: list = []
    bad = suspects()
    for _ in range(attempts):
        if not bad:
            break
        sleep(pause_s)
        again = {name: points[name] for name in points if name in bad}
        time_points(again, rounds=rounds, warmup=1, into=timings, **kwargs)
        retimed.extend(again)
        bad = suspects()
    return {"retimed": sorted({str(n) for n in retimed}), "unresolved": sorted(str(n) for n in bad)}
