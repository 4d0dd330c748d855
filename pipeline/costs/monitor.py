"""The run-time check of a cost model: observed times held against the modelled ones while eval and serve run.

A cost model is measured once per machine and cached; a curve taken while other work briefly shared the cores reads
slower than the machine is, and every later run would choose its verify widths on it (docs/results.md has the case
that prompted this check). ``DriftMonitor`` is fed (modelled ms, observed ms)
per decoded request or batched step; over its last ``window`` observations the median of observed / modelled says
whether the model still describes the machine:

* below ``1 / tolerance``: the machine runs faster than the model says, which noise cannot cause (other work only
  adds time): the model was measured under load. ``DriftMonitor.observe`` then returns ``"remeasure"`` once, and the
  owner (the eval run, the server) measures afresh and replaces the cached curve;
* above ``tolerance``: the machine runs slower than when it was measured (other work now, or a slower host): measuring
  now would store that noise, so the model is kept; the monitor logs it once.

``ObservedCosts`` corrects a model's verify curve by the step times a decode loop observes, per verified row count
(what the interleaved measurement cannot see: a step that follows a step).

Standard library only.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics

log = logging.getLogger(__name__)


class DriftMonitor:
    """Observed against modelled times (see the module doc).

    Args:
        name: what is monitored (for the log lines), e.g. "batch-1 step costs".
        tolerance: the ratio (> 1) past which observed and modelled times disagree.
        window: how many of the latest observations the median reads; min_samples: the fewest before any verdict.
        max_remeasures: how many new measurements it asks for at most (a second disagreement after one is logged).
    Attributes:
        ratios: the latest observed / modelled ratios; remeasured: how many times it asked for a new measurement.
    Raises:
        ValueError: for tolerance <= 1 or min_samples < 1.
    """

    def __init__(self, name: str, tolerance: float = 1.3, window: int = 8, min_samples: int = 4,
                 max_remeasures: int = 1):
        if tolerance <= 1 or min_samples < 1 or window < min_samples:
            raise ValueError(f"DriftMonitor needs tolerance > 1 and window >= min_samples >= 1, got {tolerance}, "
                             f"{window}, {min_samples}")
        self.name, self.tolerance, self.min_samples = name, float(tolerance), int(min_samples)
        self.ratios: collections.deque[float] = collections.deque(maxlen=int(window))
        self.remeasured, self.max_remeasures = 0, int(max_remeasures)
        self._said_slow = self._said_fast = False

    @property
    def ratio(self) -> float | None:
        """The median observed / modelled ratio of the window (None before ``min_samples`` observations)."""
        return statistics.median(self.ratios) if len(self.ratios) >= self.min_samples else None

    def observe(self, modelled_ms: float, observed_ms: float) -> str | None:
        """Add one observation; returns ``"remeasure"`` when the model reads slower than the machine (see the module
        doc), else None. Observations of no modelled time are ignored."""
        if modelled_ms <= 0 or observed_ms <= 0:
            return None
        self.ratios.append(observed_ms / modelled_ms)
        ratio = self.ratio
        if ratio is None:
            return None
        if ratio < 1 / self.tolerance and self.remeasured >= self.max_remeasures:
            if not self._said_fast:
                self._said_fast = True
                log.warning("%s: this machine still runs %.2fx faster than the cost model after %d new measurement(s); "
                            "keeping it", self.name, 1 / ratio, self.remeasured)
            return None
        if ratio < 1 / self.tolerance:
            log.warning("%s: this machine runs %.2fx faster than the cost model (median over the last %d): the model "
                        "was measured while other work shared the cores; measuring it again", self.name, 1 / ratio,
                        len(self.ratios))
            self.remeasured += 1
            self.ratios.clear()
            return "remeasure"
        if ratio > self.tolerance and not self._said_slow:
            self._said_slow = True
            log.warning("%s: this machine runs %.2fx slower than the cost model (median over the last %d): other work "
                        "shares the cores now; keeping the model (a measurement now would store the noise)", self.name,
                        ratio, len(self.ratios))
        return None


class ObservedCosts:
    """A cost model's verify costs corrected by the step times a decoder observes, per verified row count.

    The measured model times each point in interleaved rounds beside prefills and drafts; a decode loop runs step
    after step. On this project's VM (2026-12-06, Intel Xeon, SmolLM2 int8, HumanEval) the modelled plain step read
    5.9 ms and a two-row verify 6.5 ms, the decode loop's 5.2 and 6.4: the model priced a second row at 10% of a step
    where it costs 23%, and a tree sized on it verified nodes that do not pay. Each observation (rows verified, the
    model's ms, the observed ms) moves that row count's ratio observed / modelled (a running mean of its log, each
    sample clipped to [1/``clip``, ``clip``]: a step another process delayed moves it little); ``correct`` scales a
    curve by the ratios of the row counts observed at least ``min_samples`` times (the others stay as modelled) and
    keeps it non-decreasing in rows.

    Args:
        weight: each new sample's weight in the running mean (after the first ``min_samples``, which are averaged).
        min_samples: observations of a row count before its ratio is used.
        clip: the largest ratio (and 1 / the smallest) one sample may contribute.
    Raises:
        ValueError: for weight outside (0, 1], min_samples < 1 or clip <= 1.
    """

    def __init__(self, weight: float = 0.05, min_samples: int = 4, clip: float = 2.0):
        if not 0 < weight <= 1 or min_samples < 1 or clip <= 1:
            raise ValueError(f"ObservedCosts needs 0 < weight <= 1, min_samples >= 1 and clip > 1, got {weight}, "
                             f"{min_samples}, {clip}")
        self.weight, self.min_samples, self.clip = float(weight), int(min_samples), float(clip)
        self.logs: dict[int, list[float]] = {}  # rows -> [samples, running mean of log(observed / modelled)]

    def observe(self, rows: int, modelled_ms: float, observed_ms: float) -> None:
        if rows < 1 or modelled_ms <= 0 or observed_ms <= 0:
            return
        bound = math.log(self.clip)
        x = max(-bound, min(bound, math.log(observed_ms / modelled_ms)))
        entry = self.logs.setdefault(int(rows), [0, 0.0])
        entry[0] += 1
        step = 1.0 / entry[0] if entry[0] <= self.min_samples else self.weight
        entry[1] += step * (x - entry[1])

    def ratio(self, rows: int) -> float | None:
        """observed / modelled of verifies of ``rows`` rows, or None before ``min_samples`` of them."""
        entry = self.logs.get(int(rows))
        return math.exp(entry[1]) if entry is not None and entry[0] >= self.min_samples else None

    def correct(self, verify_ms: list[float]) -> list[float]:
        """``verify_ms[k]`` (a verify of k + 1 rows, ms) scaled by each row count's ratio, non-decreasing in rows."""
        out, top = [], 0.0
        for k, ms in enumerate(verify_ms):
            r = self.ratio(k + 1)
            top = max(top, ms * r if r is not None else ms)
            out.append(top)
        return out

    def summary(self) -> dict[int, tuple[int, float]]:
        """{rows: (samples, observed / modelled)}."""
        return {rows: (n, round(math.exp(m), 4)) for rows, (n, m) in sorted(self.logs.items())}


class ObservedRowCost:
    """What one more verified row adds to a batched step, fitted on the steps a batching decoder runs.

    The batched cost model is timed at one context (128 tokens), its rows split evenly over requests; a serving step's
    rows sit at their requests' own contexts. On this project's VM (2026-12-06, Intel Xeon, SmolLM2 int8, HumanEval at
    16 requests, contexts ~150-280) the model priced a row at 0.53 ms where the steps measured 0.93, so trees under load
    verified nodes that do not pay (``mixed`` 0.96x ``ar`` at 16 requests). Each step gives (rows verified, requests,
    ms); every ``refit`` steps a least-squares fit of ``ms ~ a + b * rows + c * requests`` over the last ``window``
    steps gives ``b``, once the rows beyond one per request (the drafts) varied by at least ``min_spread`` (their
    standard deviation): a batch that drafts nothing carries no evidence.

    Raises:
        ValueError: for window < 8, refit < 1 or min_spread <= 0.
    """

    def __init__(self, window: int = 128, refit: int = 8, min_spread: float = 1.0):
        if int(window) < 8 or int(refit) < 1 or min_spread <= 0:
            raise ValueError(f"ObservedRowCost needs window >= 8, refit >= 1 and min_spread > 0, got {window}, {refit}, "
                             f"{min_spread}")
        self.steps: collections.deque = collections.deque(maxlen=int(window))
        self.refit, self.min_spread = int(refit), float(min_spread)
        self._since, self._per_row = 0, None

    def observe(self, rows: int, requests: int, ms: float) -> None:
        if rows < 1 or requests < 1 or ms <= 0:
            return
        self.steps.append((float(rows), float(requests), float(ms)))
        self._since += 1
        if self._since >= self.refit:
            self._since = 0
            self._per_row = self._fit()

    def per_row(self) -> float | None:
        """ms per verified row at fixed requests, or None before the steps gave evidence."""
        return self._per_row

    def _fit(self) -> float | None:
        if len(self.steps) < 16 or statistics.pstdev([r - n for r, n, _ in self.steps]) < self.min_spread:
            return self._per_row
        import numpy as np  # here, not at the top: importing the cost model loads no numpy (vLLM's process reads it)

        x = np.array([(1.0, r, n) for r, n, _ in self.steps])
        b = float(np.linalg.lstsq(x, np.array([ms for _, _, ms in self.steps]), rcond=None)[0][1])
        return b if b > 0 else self._per_row
