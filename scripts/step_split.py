"""Where a decode step's wall time goes: the native stack's call, the LM head's, and the rest (the Python and small
torch ops around them), per method, over an eval run (a benchmark that prints figures, not a test).

    .venv/bin/python scripts/step_split.py data=humaneval data.limit=20 decode.max_new_tokens=128 \
        'eval.methods=[ar,mixed]' run_name=split

Takes the eval stage's overrides (``python -m pipeline.evaluate``) and runs it with timers around each step
(``pipeline.decoding.step.advance``), the native target stack (``NativeStack.__call__``) and the head
(``pipeline.models.forward.by_rows``); prints ms a step per method. The timers add a few microseconds a step; compare
runs of this script with each other, alternating old and new code. The results directory is the eval's: give each
run its own ``run_name`` (a name already used resumes its rows and times nothing).
"""

from __future__ import annotations

import atexit
import collections
import runpy
import sys
import time

import pipeline.decoding.step as step
import pipeline.models.forward as forward
from pipeline.models.native import NativeStack

totals: dict[tuple[str, str], float] = collections.defaultdict(float)
steps: collections.Counter = collections.Counter()
current: list[str | None] = [None]


def _timed(fn, part: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if current[0] is not None:
                totals[(current[0], part)] += time.perf_counter() - t0
    return wrapper


_advance = step.advance


def _advance_timed(fwd, policy, reqs):
    current[0] = type(reqs[0].schedule).__name__
    t0 = time.perf_counter()
    try:
        return _advance(fwd, policy, reqs)
    finally:
        totals[(current[0], "step")] += time.perf_counter() - t0
        steps[current[0]] += 1
        current[0] = None


@atexit.register
def _report() -> None:
    for name in sorted(steps):
        n = steps[name]
        step_ms, stack, head = (totals[(name, part)] / n * 1e3 for part in ("step", "stack", "head"))
        print(f"{name}: {n} steps, {step_ms:.3f} ms a step: native stack {stack:.3f}, head {head:.3f}, "
              f"the rest {step_ms - stack - head:.3f}")


if __name__ == "__main__":
    step.advance = _advance_timed  # the decoders look it up at each call
    NativeStack.__call__ = _timed(NativeStack.__call__, "stack")
    forward.by_rows = _timed(forward.by_rows, "head")
    sys.argv = ["pipeline.evaluate", *sys.argv[1:]]
    runpy.run_module("pipeline.evaluate", run_name="__main__")
