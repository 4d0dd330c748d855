"""Weights & Biases tracking: offline by default (``WANDB_MODE=offline``), online when the user sets
a key and ``WANDB_MODE=online``. One group per pipeline run so the dashboard shows stages side by side.

An offline run keeps everything in its binary ``.wandb`` file, readable only after ``wandb sync``. So that a
user without an account can read a run, its ``files/`` folder also gets ``blockpilot-config.yaml`` (the
resolved config, at start) and ``blockpilot-summary.json`` (the run's summary as plain JSON, when it finishes).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    run = wandb.init(
        project=logger.project,
        group=str(logger.group),
        job_type=job_type,
        name=f"{cfg.get('run_name', 'run')}-{job_type}",
        dir=str(logger.dir),
        mode=str(logger.mode),
        config=OmegaConf.to_container(cfg, resolve=True),
        reinit="finish_previous",
    )
    if str(logger.mode) == "disabled":  # a no-op run: nothing is written (its run.dir does not exist)
        return run
    config = OmegaConf.to_container(cfg, resolve=True)
    (Path(run.dir) / "blockpilot-config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    run.finish = functools.partial(_finish_with_summary, run, run.finish)
    return run


def plain(value: Any) -> Any:
    """``value`` as plain JSON data: mappings (W&B's nested summary entries too) as dicts with string keys, lists and
    tuples as lists, numpy / torch scalars and arrays as numbers and lists, non-finite floats as None (JSON has no
    NaN), and anything else as its ``str()``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    kind = type(value)  # class attributes only: W&B's summary dicts answer any attribute lookup with a KeyError
    if isinstance(value, Mapping) or (callable(getattr(kind, "keys", None)) and callable(getattr(kind, "__getitem__", None))):
        return {str(k): plain(value[k]) for k in value.keys()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if callable(getattr(kind, "tolist", None)):
        return plain(value.tolist())
    return str(value)


def _finish_with_summary(run, finish, *args, **kwargs):
    """Write the run's summary to ``files/blockpilot-summary.json`` as plain JSON (``plain``; readable without W&B),
    then finish it."""
    summary = {k: plain(run.summary[k]) for k in run.summary.keys() if not k.startswith("_")}
    (Path(run.dir) / "blockpilot-summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True, allow_nan=False))
    return finish(*args, **kwargs)
