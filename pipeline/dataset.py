"""``dataset`` stage: labels -> prefill-distribution features + reward vectors, split by prompt.

    make dataset                                   # python -m pipeline.dataset run_name=<run>
    python -m pipeline.dataset features=full_vocab # the paper's full-vocabulary rows (labels need full logits)
    python -m pipeline.dataset dataset.holdout_set=gsm8k   # leave one source set out: all of it in test

Reads the label stage's rows (``data/labels/<run_name>/``), computes the features configured in
``conf/features/`` and writes a ``datasets.DatasetDict`` with splits ``train``/``validation``/``test`` to
``data/features/<run_name>/<features.name>/``, with ``blockpilot.json`` beside the splits. The builder, the
columns and the split rule are ``pipeline.policy.data``'s.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.policy.data import INFO, build_dataset
from pipeline.tracking import init_wandb


@stage("dataset")
def main(cfg: DictConfig) -> None:
    validate_config(cfg, "dataset")
    run = init_wandb(cfg, job_type="dataset")
    out = build_dataset(cfg)
    if run is not None:
        info = json.loads((out / INFO).read_text())
        run.summary.update({f"{s}/n_prompts": sum(c.values()) for s, c in info["counts"].items()})
        run.finish()
    print(out)


if __name__ == "__main__":
    main()
