"""The measuring harness: times the loaded models' steps on this machine into the cost models of ``pipeline.costs``.

One harness above decoding for every per-machine measurement, on the one timer (``pipeline.costs.timer``: named points
in interleaved rounds, the least sample, the spread kept) and the one cache (``pipeline.costs.store``):

* ``steps``: the batch-1 ``CostModel`` (verify and draft by width and context, prefill), obtained one way by every
  stage and the server (``load_or_measure``), checked against this machine before a cached one is reused
  (``spot_check``), measured again on demand (``remeasure``: the run-time ``DriftMonitor``'s verdict); and
  ``step_figures``, ``python -m pipeline.bench_step``'s table;
* ``batched``: the ``BatchCostModel`` of a batched step (``batch_costs_of``), likewise checked and re-measurable.

The smallm kernel's crossover (``pipeline.models.backend.exact_crossover``, below decoding) times its products with
the same timer and keeps them in the same cache.
"""
