"""Weights & Biases tracking: offline by default (``WANDB_MODE=offline``), online when the user sets
a key and ``WANDB_MODE=online``. One group per pipeline run so the dashboard shows stages side by side."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def init_wandb(cfg: DictConfig, job_type: str):
    """Start a W&B run for one stage, or return None when ``logger.enabled`` is false.

    The run is named ``<run_name>-<job_type>`` inside group ``logger.group`` and carries the resolved
    config. Files go under ``logger.dir`` (git-ignored).
    """
    logger = cfg.get("logger")
    if not logger or not logger.get("enabled", False):
        return None
    import wandb

    os.environ.setdefault("WANDB_MODE", str(logger.mode))
    os.environ.setdefault("WANDB_SILENT", "true")
    Path(logger.dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=logger.project,
        group=str(logger.group),
        job_type=job_type,
        name=f"{cfg.get('run_name', 'run')}-{job_type}",
        dir=str(logger.dir),
        mode=str(logger.mode),
        config=OmegaConf.to_container(cfg, resolve=True),
        reinit="finish_previous",
    )
