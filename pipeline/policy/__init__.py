"""The BlockPilot policy: features of the prefill distribution -> a small predictor -> one block size per request.

Modules: ``features`` (featurizers shared by the dataset stage and the decoder), ``predictors`` (nets), ``module``
(Lightning training), ``fallback`` (the confidence fallback to the training block size), ``export``
(``predictor.safetensors`` + ``predictor.json``), ``schedule`` (``PredictorSchedule``, the decoder-side ``Schedule``),
``calibration`` and ``widths`` (the drafts' acceptance and the verify width they pay for; light, read by the vLLM
plugin), ``verify_width`` (the per-step verify-width schedule), ``budget`` (a batched step's widths chosen jointly),
``baselines`` (transformers' ``generate``, vLLM), ``registry`` (every decoding method declared once) and ``setup`` (the
one builder of a stage's methods: eval, serve and bench_batch), ``checks`` (the policy options' config check).
"""

import importlib

_EXPORTS = {"Predictor": "export", "export_predictor": "export", "load_predictor": "export", "Featurizer": "features",
            "FeatureSpec": "features", "FullVocabPredictor": "predictors", "MLPPredictor": "predictors",
            "build_predictor": "predictors", "num_parameters": "predictors", "PredictorSchedule": "schedule"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The package's API, imported on first use: importing one light module (``pipeline.policy.calibration``, read by
    the vLLM plugin in vLLM's own process) loads no predictor or model code."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.policy' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipeline.policy.{_EXPORTS[name]}"), name)
