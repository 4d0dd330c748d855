"""The forwards' thread count: the process's own where its cores are free, fewer where other processes hold cores.

A native forward opens ~150 parallel regions, and each waits for every thread. With one of this VM's two cores held
by another process (a shell loop), a 1-row forward took 94 ms (p90 312 ms) on two threads against 6.1 ms on one, and
3.5 ms on two alone (2026-12-07, Intel Xeon): at every region the second thread waits for the scheduler to give it
its core back. ``ThreadGovernor.adapt``, called before every target forward, reads at most every ``period_s`` how
much CPU time other processes took on this process's cores since its last look (``/proc/stat`` less
``/proc/self/stat``), and runs the forwards on the process's thread count less the cores they held (at least one).
A short timed probe does not see it: a waking thread preempts the shell loop for its first milliseconds. Outputs do
not depend on the thread count: every row's result is computed by one thread in a fixed order (the smallm kernel).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)


class CpuTimes:
    """Cores' worth of CPU time that other processes took on this process's CPUs between two calls (Linux
    ``/proc``; None where it cannot be read, and at the first call)."""

    def __init__(self):
        self._last: tuple[float, float, float] | None = None
        try:
            self._cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
            self._tick = float(os.sysconf("SC_CLK_TCK"))
        except (AttributeError, OSError, ValueError):
            self._cpus, self._tick = set(), 100.0

    def __call__(self) -> float | None:
        try:
            busy = 0.0
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name in self._cpus:  # user nice system idle iowait irq softirq steal: busy = all but idle, iowait
                        values = [float(v) for v in fields[:8]]
                        busy += sum(values) - values[3] - values[4]
            with open("/proc/self/stat") as f:
                own = sum(float(v) for v in f.read().rsplit(")", 1)[1].split()[11:13])  # utime, stime
        except (OSError, ValueError, IndexError):
            return None
        wall = time.monotonic() * self._tick
        last, self._last = self._last, (busy, own, wall)
        if last is None or wall <= last[2]:
            return None
        return max(0.0, (busy - last[0]) - (own - last[1])) / (wall - last[2])


class ThreadGovernor:
    """The forwards on the process's thread count less the cores other processes hold (module doc).

    Args:
        period_s: the least time between two looks.
        others: cores' worth of CPU time others took since the last call, or None (``CpuTimes``); clock: seconds;
            get_threads / set_threads: torch's (injected by tests).
    """

    def __init__(self, period_s: float = 0.25, others: Callable[[], float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 get_threads: Callable[[], int] = torch.get_num_threads,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.period_s = float(period_s)
        self.others = others if others is not None else CpuTimes()
        self.clock, self.get_threads, self.set_threads = clock, get_threads, set_threads
        self.threads: int | None = None  # the count the process asked for
        self.current: int | None = None  # the count the forwards run on
        self.switches = 0
        self._next = float("-inf")

    def adapt(self) -> None:
        """Look at most every ``period_s`` and set the forwards' thread count (module doc)."""
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.period_s
        got = self.get_threads()
        if got != self.current:  # first use, or the process set its threads since: that is the count asked for
            self.threads = self.current = got
        others = self.others()
        if others is None or self.threads < 2:
            return
        want = max(1, self.threads - math.ceil(others - 0.5))  # a core counts as held past half of it
        if want != self.current:
            self.set_threads(want)
            self.current = want
            self.switches += 1
            if self.switches <= 8:
                log.info("threads: %d of %d (other processes took %.2f cores)", want, self.threads, others)


GOVERNOR = ThreadGovernor()
"""The process's governor, adapted before every target forward (``pipeline.models.forward.Forward.target``)."""
