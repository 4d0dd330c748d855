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

Standard library only.
"""

from __future__ import annotations

import collections
import logging
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
