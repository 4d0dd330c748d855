"""``label`` stage: oracle block sizes per request (each labelled turn of a prompt), written as sharded Parquet under data/labels/<run_name>/.

    python -m pipeline.label data=mix data.limit=50                       # one worker
    python -m pipeline.label -m label.shard=0,1 label.num_shards=2 hydra/launcher=joblib
    python -m pipeline.label -m label.shard='range(8)' label.num_shards=8 hydra/launcher=submitit_slurm
    torchrun --nproc_per_node=8 -m pipeline.label model=qwen3_4b         # rank-sharded, one GPU each

See ``pipeline.labeling`` for the modes (``label.mode=replay|brute``) and ``conf/label.yaml``.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from pipeline.cli import stage

log = logging.getLogger(__name__)


@stage("label")
def main(cfg: DictConfig) -> None:
    from pipeline.config_checks import validate_config
    from pipeline.labeling.runner import run_label  # imported here: a multirun's launcher process needs no torch

    validate_config(cfg, "label")

    summary = run_label(cfg)
    log.info("shard %d/%d: labelled %d, %d done before, %d skipped (too long for the context: %s), label_tau counts %s -> %s",
             summary["shard"], summary["num_shards"], summary["labelled"], summary["already_done"], len(summary["skipped"]),
             [s["id"] for s in summary["skipped"]][:10], summary["label_tau"], summary["out_dir"])
    print(summary["out_dir"])


if __name__ == "__main__":
    main()
