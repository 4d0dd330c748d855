"""The one timing fixture of the harness: what every measurement of the loaded models shares.

``StepPoints`` (the batch-1 costs), ``BatchPoints`` (a batched step's) and ``step_figures`` (``bench_step``'s table) are
each a set of named points on this fixture:

* the inputs: random token ids in the target's vocabulary (``random_ids``: a step's cost does not depend on the
  values), a target cache and features prefilled to a context (``prefill``), a drafter cache holding a context's
  features but the last ``pending`` (``draft_cache_at``: about one step's worth of new features);
* the timing: ``measure_points`` (every point in interleaved rounds after a warm-up, the least sample kept with its
  spread, the points that break the caller's shape check timed again, with a progress bar), ``time_now`` (a few rounds,
  no shape check: the spot checks and ``step_figures``) and ``first_loaded`` (the spot checks' one verdict: a stored
  point this machine now runs faster than, by ``measured_under_load``);
* one ``clock`` (and the device's synchronize) for all of them;
* ``yielding``: a measurement taken while its owner serves stops (``MeasurementYielded``) between two timed runs as soon
  as work is waiting, so that a server never holds a request for a measurement (it measures again when idle).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Mapping

import torch

from pipeline.costs import Timing, retime, time_points
from pipeline.models.cache import crop_to
from pipeline.models.clock import synchronize

log = logging.getLogger(__name__)

SPOT_TOLERANCE = 1.25  # a cached point this much slower than the machine now is refused (noise only adds time)
SPOT_FLOOR_MS = 2.0  # ... and by at least this much (a timer's jitter on sub-millisecond points is not load)
WARM = 1
"""Untimed runs of a point right before each timed one (``time_points``' ``warm``): every step cost is the cost of a
step that follows a step, as in a decode loop. Part of every cost cache's key."""


def clock() -> float:
    """The clock every measurement and spot check of the harness reads (seconds; ``time.perf_counter``). It is looked
    up by name at each measurement, so a test swaps it for a deterministic one
    (``monkeypatch.setattr(pipeline.timing.fixture, "clock", fake)``): its verdicts (a cache reused or refused, a curve
    measured again) then do not depend on the host's speed or load. The smallm kernel's crossover (model layer, below
    the harness) keeps its own."""
    return time.perf_counter()


def measured_under_load(stored_ms: float, now_ms: float, tolerance: float = SPOT_TOLERANCE,
                        floor_ms: float = SPOT_FLOOR_MS) -> bool:
    """Whether a stored point reads slower than the machine runs it now by ``tolerance`` times and ``floor_ms`` (noise
    only adds time, so such a point was measured while other work shared the cores): the spot checks' one test."""
    return stored_ms > tolerance * now_ms and stored_ms - now_ms > floor_ms


# ------------------------------------------------------------------------------------------------
# the inputs
# ------------------------------------------------------------------------------------------------
def random_ids(decoder, length: int, generator: torch.Generator) -> torch.Tensor:
    """[1, ``length``] random token ids the target's tokenizer and LM head both know, on the decoder's device."""
    vocab = min(decoder.lm_head.shape[0], len(decoder.target.tokenizer))
    return torch.randint(0, vocab, (1, int(length)), generator=generator).to(decoder.device)


def prefill(decoder, ids: torch.Tensor, features: bool = True) -> tuple[object, torch.Tensor, torch.Tensor | None]:
    """(a new target cache holding ``ids``, the last position's logits, their features for the drafter when
    ``features`` and it has one). A yield point of ``yielding``: a measurement that prefills many prompts before its
    first timed run (the batched cost model's 64) stops before each of them once a request waits."""
    from pipeline.models.target import new_cache

    yield_if_waiting()
    cache = new_cache(decoder.model, decoder.kv_cache)
    logits, feats = decoder.target_forward(ids, cache, 0, want_features=features and decoder.drafter is not None,
                                           last_only=True)
    return cache, logits, feats


def draft_cache_at(decoder, block: torch.Tensor, features: torch.Tensor, context: int, pending: int):
    """A drafter cache holding the features of a ``context``-token prefix but its last ``pending`` (``block``: a block
    of ids to run it with)."""
    cache = decoder.new_draft_cache()
    kept = context - pending
    decoder.draft_forward(decoder.embed(block), features[:, :kept],
                          torch.arange(0, kept + block.shape[1], device=decoder.device)[None], cache)
    crop_to(cache, kept)
    return cache


# ------------------------------------------------------------------------------------------------
# the timing
# ------------------------------------------------------------------------------------------------
class MeasurementYielded(RuntimeError):
    """A measurement under ``yielding`` stopped because its owner has work waiting (nothing was stored)."""


_owner = threading.local()  # this thread's ``yielding`` test, if any


@contextmanager
def yielding(waiting: Callable[[], bool]) -> Iterator[None]:
    """Within it, every measurement of the harness on this thread checks ``waiting()`` between two timed runs and
    raises ``MeasurementYielded`` when it is true (the server's engine measures again only while no request waits)."""
    before = getattr(_owner, "waiting", None)
    _owner.waiting = waiting
    try:
        yield
    finally:
        _owner.waiting = before


def yield_if_waiting() -> None:
    """The ``yielding`` check: raise ``MeasurementYielded`` when this thread's owner has work waiting (nothing else)."""
    waiting = getattr(_owner, "waiting", None)
    if waiting is not None and waiting():
        raise MeasurementYielded("work is waiting: the measurement stops and is taken again when idle")


def _sync(decoder) -> Callable[[], None]:
    """The device's synchronize before and after each timed run, and the ``yielding`` check."""
    device = decoder.device

    def sync() -> None:
        synchronize(device)
        yield_if_waiting()

    return sync


def measure_points(decoder, points: Mapping[Hashable, Callable[[], None]], suspects: Callable[[dict], set],
                   repeats: int, desc: str) -> tuple[dict[Hashable, Timing], dict]:
    """Time ``points`` in ``repeats`` interleaved rounds after one warm-up round, with a progress bar, then time again
    those ``suspects(timings)`` names (the caller's shape check) until it passes or the attempts are spent.

    Returns:
        ({name: Timing}, {"retimed": [...], "unresolved": [...]}); a warning names points still suspect.
    """
    from tqdm.auto import tqdm

    sync = _sync(decoder)
    with tqdm(total=len(points) * repeats, desc=desc, unit="timing") as bar:
        timings = time_points(points, rounds=repeats, sync=sync, clock=clock, progress=bar.update, warm=WARM)
        check = retime(points, timings, lambda: suspects(timings), rounds=repeats, sync=sync, clock=clock,
                       progress=bar.update, warm=WARM)
    if check["unresolved"]:
        log.warning("%s: %d points still break the cost's shape after timing them again (%s): the cores were busy, or "
                    "the cost bends there; the curve's monotone fit pools them", desc, len(check["unresolved"]),
                    check["unresolved"][:4])
    return timings, check


def time_now(decoder, points: Mapping[Hashable, Callable[[], None]], rounds: int, warmup: int = 1
             ) -> dict[Hashable, Timing]:
    """``points`` timed in ``rounds`` interleaved rounds after ``warmup`` ones, no shape check."""
    return time_points(points, rounds=rounds, warmup=warmup, sync=_sync(decoder), clock=clock, warm=WARM)


def first_loaded(decoder, points: Mapping[Hashable, Callable[[], None]], stored: Mapping[Hashable, float],
                 rounds: int = 3, tolerance: float = SPOT_TOLERANCE, floor_ms: float = SPOT_FLOOR_MS
                 ) -> tuple[Hashable, float, float] | None:
    """Re-time ``points`` now and return the first (name, stored ms, ms now) whose ``stored`` ms was
    ``measured_under_load``, or None (the stored measurement holds on this machine now)."""
    for name, timing in time_now(decoder, points, rounds).items():
        if measured_under_load(stored[name], timing.ms, tolerance, floor_ms):
            return name, float(stored[name]), timing.ms
    return None
