"""The prompts a drafter trains on, one configured set at a time (``draft.sets``), and the benchmark texts it must not see.

Never point the draft stage at the benchmark sets used for evaluation (``draft.decontaminate`` lists them, and
self-written prompts that share a word 8-gram with any of them are dropped).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline.drafting.self_prompts import build_self_prompts
from pipeline.drafting.stdlib_prompts import stdlib_prompts
from pipeline.prompts import load_prompt_set

log = logging.getLogger(__name__)


def decontamination_texts(sources) -> list[str]:
    """Every user turn of the benchmark prompt sets ``sources`` (``humaneval`` or JSONL paths); a missing
    file is skipped with a warning (the sets live outside the repository)."""
    texts = []
    for source in sources or []:
        try:
            texts += [t for p in load_prompt_set(str(source)) for t in p.turns]
        except FileNotFoundError as err:
            log.warning("decontamination set skipped: %s", err)
    return texts


def training_prompts(set_cfg, target=None, cfg: DictConfig | None = None) -> list:
    """Prompts of one configured training set (``source: stdlib`` builds the stdlib code prompts; ``source:
    self`` has ``target`` write them, filtered against ``cfg.draft.decontaminate``; ``source: stdlib_source``
    is handled by ``build_corpus_cache`` instead)."""
    if set_cfg.source == "stdlib":
        return stdlib_prompts(set_cfg.get("limit"), seed=0)
    if set_cfg.source == "self":
        if target is None or cfg is None:
            raise ValueError("source: self needs the target and the draft config")
        return build_self_prompts(
            target, str(cfg.model.target), Path(cfg.draft.cache_dir) / "self-prompts", set_cfg.name,
            set_cfg.get("limit"), decontamination_texts(cfg.draft.get("decontaminate")),
            batch_size=int(cfg.draft.gen_batch_size), max_new_tokens=int(set_cfg.get("prompt_max_tokens", 96)),
            seed=int(set_cfg.get("prompt_seed", 0)))
    return load_prompt_set(set_cfg.source, set_cfg.name, set_cfg.get("limit"), seed=0)
