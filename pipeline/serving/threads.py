"""The server's decoder thread: the one thread that runs torch in ``python -m pipeline.serve``.

The server loads the model, warms it up and measures its cost models, then decodes requests while uvicorn's event loop
answers HTTP on the main thread. GNU OpenMP (torch's ``libgomp``) gives every thread that opens a parallel region a team
of its own: a model loaded on the main thread and decoded on a worker thread leaves two teams, more OpenMP threads than
the VM's two cores, and libgomp then spins only ~100 iterations (1,000 under ``OMP_WAIT_POLICY=ACTIVE``; no setting
raises it) after each parallel region before it sleeps on a futex, so each of a decode step's ~200 regions (every
product, every attention call) pays a wake-up. ``decoder_thread`` is that one thread: ``pipeline.serve.main`` builds,
warms and measures the engine on it (``start_engine``), and the engine then decodes on it (``Engine(thread=...)``).
Recording (``serve.record=true``) replays on a second worker: a second team while it runs.

The measured effect is in docs/results.md (2026-12-03 morning).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def decoder_thread() -> ThreadPoolExecutor:
    """A single-worker executor: run the engine's construction and warm-up on it (``start_engine``) and hand it to the
    engine, which decodes on the same thread; ``Engine.close`` shuts it down."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="decoder")
