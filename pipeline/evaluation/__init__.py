"""The eval stage's library, split by role (``pipeline.evaluate`` is its command-line entry point):

  * ``inputs``: the split, the prompts, and the artifacts the methods need (labels, splits, predictors, calibration);
  * ``runs``: the run loop (every method over every prompt, interleaved) and ``SharedDecodes``;
  * ``stats``: per-method summaries, the oracle gain share and the one bootstrap interval;
  * ``resume``: the per-prompt row log (``rows.jsonl``) a killed run resumes from;
  * ``report``: results.json, results.md, the figures and W&B;
  * ``checks``: the eval stage's configuration check (before any model loads);
  * ``retest``: the per-request policy re-tested offline on leave-one-set-out folds (``pipeline.retest``'s library);
  * ``batched`` / ``serving``: the batched and served benchmarks (``pipeline.bench_batch``, ``pipeline.bench_serve``).

The methods themselves are declared once in ``pipeline.policy.registry`` (shared with the server).
"""
