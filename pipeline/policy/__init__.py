"""The BlockPilot policy: features of the prefill distribution -> a small predictor -> one block size per request.

Modules: ``features`` (featurizers shared by the dataset stage and the decoder), ``predictors`` (nets),
``module`` (Lightning training), ``fallback`` (the confidence fallback to the training block size),
``export`` (``predictor.safetensors`` + ``predictor.json``), ``schedule`` (``PredictorSchedule``, the decoder-side ``BlockSizeSchedule``),
``verify_width`` (the per-step verify width), ``baselines`` (transformers' own ``generate``), and ``registry``: every
decoding method declared once, built by the eval stage and the server alike.
"""

from pipeline.policy.export import Predictor, export_predictor, load_predictor
from pipeline.policy.features import Featurizer, FeatureSpec
from pipeline.policy.predictors import FullVocabPredictor, MLPPredictor, build_predictor, num_parameters
from pipeline.policy.schedule import PredictorSchedule

__all__ = ["FeatureSpec", "Featurizer", "FullVocabPredictor", "MLPPredictor", "Predictor", "PredictorSchedule",
           "build_predictor", "export_predictor", "load_predictor", "num_parameters"]
