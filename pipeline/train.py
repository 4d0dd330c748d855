"""``train`` stage: fit the block-size predictor on the feature dataset and export it for the decoder.

    make train                                      # python -m pipeline.train run_name=<run>  (MLP, topk features)
    python -m pipeline.train predictor=full_vocab   # the paper's full-vocabulary baseline (features=full_vocab)
    python -m pipeline.train train.objective=reward train.target=speed

Reads ``data/features/<run_name>/<features.name>/`` (``pipeline.dataset``), fits the predictor, tunes and checks
its confidence fallback on the validation split, and exports ``predictor.safetensors`` + ``predictor.json`` to
``data/predictors/<run_name>/<predictor.name>/`` (with ``train.calibration``, also the verify-width calibration).
The training itself is ``pipeline.policy.training``'s.
"""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.policy.training import train_predictor


@stage("train")
def main(cfg: DictConfig) -> None:
    validate_config(cfg, "train")
    print(train_predictor(cfg))


if __name__ == "__main__":
    main()
