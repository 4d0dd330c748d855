"""``retest`` stage: the per-request policy re-tested where it could win, offline on the label stage's rows.

    python -m pipeline.retest run_name=main                      # the labels of make all
    python -m pipeline.retest experiment=policy                  # candidates 1..16 (conf/experiment/policy.yaml)

For every label target in ``retest.targets`` and every source set of the labels, one leave-one-set-out fold builds the
features of the other sets (dataset stage), fits and exports the predictor (train stage) and scores it on the held-out
set's labels against ``fixed``, ``best_fixed`` and ``oracle`` with the oracle gain share and a bootstrap 95% interval.
Writes ``retest.out/retest.json`` and ``retest.md`` (conf/retest.yaml). The folds are
``pipeline.evaluation.retest``'s.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.evaluation.retest import markdown, run_retest


@stage("retest")
def main(cfg: DictConfig) -> None:
    from pipeline.config_checks import validate_config

    validate_config(cfg, "retest")
    results = run_retest(cfg)
    print(markdown(results))
    print(Path(cfg.retest.out) / "retest.json")


if __name__ == "__main__":
    main()
