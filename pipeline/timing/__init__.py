"""The measuring harness: times the loaded models' steps on this machine into the cost models of ``pipeline.costs``.

One harness above decoding for every per-machine measurement, on the one timer (``pipeline.costs.timer``: named points
in interleaved rounds, the least sample, the spread kept), the one fixture (``fixture``: random prompts, prefilled
caches, the timing with a shape check, the spot checks' verdict, one clock) and the one cache (``pipeline.costs.store``:
one folder, one key builder):

* ``steps``: the batch-1 ``CostModel`` (verify and draft by width and context, prefill), obtained one way by every
  stage and the server (``load_or_measure``), checked against this machine before a cached one is reused
  (``spot_check``), measured again on demand (``remeasure``: the run-time ``DriftMonitor``'s verdict); and
  ``step_figures``, ``python -m pipeline.bench_step``'s table;
* ``batched``: the ``BatchCostModel`` of a batched step (``batch_costs_of``), likewise checked and re-measurable.

The smallm kernel's crossover (``pipeline.models.backend.exact_crossover``) times its products with the same timer and
keeps them in the same cache, but is measured in the model layer: the packing of every weight reads it (at
``set_backend``, which the decoder calls as it is built), and the model and decoding layers sit below this harness.
"""
