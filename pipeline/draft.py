"""``draft`` stage: train a DFlash drafter for a target and export it in the z-lab layout.

    make draft                       # the embedded default (SmolLM2-135M-Instruct), shipped drafter
    python -m pipeline.draft draft.trainer.max_time=00:00:30:00 draft.out=data/drafters/my-drafter

Pipeline: training prompt sets (local JSONL with ``turns``, hub ids, stdlib code prompts, prompts the
target writes itself: ``source: self``) -> target-generated responses, greedy or sampled per set
(``temperature``), with the tapped layers' features (cached shards, resumable) -> Lightning training
with random anchors, a block-sparse mask and a position-decayed loss (CE, optionally TV/KL to the
target; checkpointed every ``draft.checkpoint_every`` steps, resumed with ``draft.resume=true``) ->
``config.json`` + ``model.safetensors`` (bf16) + ``README.md`` model card.
Never point it at the benchmark sets used for evaluation (``draft.decontaminate`` lists them, and
self-written prompts that share a word 8-gram with any of them are dropped).
The recipe is ``pipeline.drafting.trainer.train_drafter``'s.
"""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.drafting.trainer import train_drafter


@stage("draft")
def main(cfg: DictConfig) -> None:
    validate_config(cfg, "draft")  # before the target loads
    print(train_drafter(cfg))


if __name__ == "__main__":
    main()
