"""The eval stage's library, split by role (``pipeline.evaluate`` is its command-line entry point):

  * ``inputs``: the split, the prompts, and the artifacts the methods need (labels, splits, predictors, calibration);
  * ``runs``: the run loop (every method over every prompt, interleaved) and ``SharedDecodes``;
  * ``stats``: per-method summaries, the oracle gain share and the one bootstrap interval;
  * ``resume``: the per-prompt row log (``rows.jsonl``) a killed run resumes from;
  * ``report``: results.json, results.md, the figures and W&B.

The methods themselves are declared once in ``pipeline.policy.registry`` (shared with the server).
"""
