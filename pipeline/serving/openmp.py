"""OpenMP settings for a server whose decoder runs in a worker thread, applied before torch loads.

The server loads the model (and warms it up, and measures its cost models) in the main thread, then decodes in a worker
thread (``Engine``'s executor, ``BatchEngine``'s scheduler). GNU OpenMP (torch's ``libgomp``) gives each thread that
opens a parallel region its own team of workers, so the process then manages more OpenMP threads than it has cores,
and libgomp's default for that case is to spin only ~100 iterations after each region before sleeping on a futex: every
one of the ~200 parallel regions of a SmolLM2 decode step (each product, each attention call) then pays a wake-up.
Measured on this project's 2-core VM (2026-12-02, ``python -m pipeline.bench_serve`` with ``serve.policy=ar``, 16
requests x 64 tokens, one run each, nothing else running): batch 1 29.1 -> 41.0 tokens/s (TPOT p50 30.2 -> 20.5 ms),
c=8 90.2 -> 105.2 tokens/s; one decode of 128 tokens in a second thread 30 ms/step against 17.5 in the main thread,
19-21 with the setting below.

``OMP_WAIT_POLICY=ACTIVE`` with a finite ``GOMP_SPINCOUNT`` makes the oversubscribed case spin as long as the normal
one (libgomp's default 300,000 iterations, a few ms) and then sleep: without the finite count ``ACTIVE`` spins forever,
and the main thread's idle team would burn a core (40 ms/step measured). libgomp reads both once, when torch loads it.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

SETTINGS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def spin_between_regions(environ: dict | None = None) -> dict[str, str]:
    """Set ``SETTINGS`` in ``environ`` (default ``os.environ``) where the user has not set them; call it before the
    first ``import torch`` of the process (``python -m pipeline.serve`` does).

    Returns:
        the variables it set (empty when the user set both, or when torch is already loaded: then it logs that the
        setting cannot take effect in this process and sets nothing).
    """
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        log.info("OpenMP: torch is already loaded, so %s cannot take effect in this process", SETTINGS)
        return {}
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}  # the user's OpenMP settings stand as given (ACTIVE without a count would spin forever)
    environ.update(SETTINGS)
    return dict(SETTINGS)
