"""W&B tracking: an offline run can be read without an account (config and summary as plain files)."""

from __future__ import annotations

import json

import numpy as np
import wandb
import yaml
from omegaconf import OmegaConf

from pipeline.tracking import init_wandb, plain


def test_offline_run_writes_readable_config_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = OmegaConf.create({"run_name": "t", "decode": {"max_new_tokens": 7},
                            "logger": {"enabled": True, "mode": "offline", "project": "p", "group": "g",
                                       "dir": str(tmp_path)}})
    run = init_wandb(cfg, job_type="eval")
    files = tmp_path / "wandb"
    run.summary["ar/tokens_per_s"] = 31.5
    run.summary.update({"methods": {"ar": {"tokens_per_s": 31.5, "ci": [30.0, 33.0], "n": np.int64(3)}},
                        "speedup": np.float32(1.5)})
    run.log({"table": wandb.Table(columns=["method"], data=[["ar"]])})
    run.finish()
    (config_file,) = files.glob("offline-run-*/files/blockpilot-config.yaml")
    (summary_file,) = files.glob("offline-run-*/files/blockpilot-summary.json")
    assert yaml.safe_load(config_file.read_text())["decode"]["max_new_tokens"] == 7
    summary = json.loads(summary_file.read_text())  # strict JSON: nested entries as data, no object reprs, no NaN
    assert summary["ar/tokens_per_s"] == 31.5 and summary["speedup"] == 1.5
    assert summary["methods"] == {"ar": {"tokens_per_s": 31.5, "ci": [30.0, 33.0], "n": 3}}
    assert summary["table"]["_type"] == "table-file" and summary["table"]["nrows"] == 1
    assert "object at 0x" not in summary_file.read_text()


def test_disabled_logger_starts_no_run():
    assert init_wandb(OmegaConf.create({"logger": {"enabled": False}}), job_type="eval") is None


def test_logger_mode_disabled_runs_the_stage_without_writing_anything(tmp_path, monkeypatch):
    """``logger.mode=disabled``: W&B's no-op run, which the stage logs to as to any run; no file is written."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = OmegaConf.create({"run_name": "t", "logger": {"enabled": True, "mode": "disabled", "project": "p",
                                                          "group": "g", "dir": str(tmp_path / "wandb")}})
    run = init_wandb(cfg, job_type="eval")
    run.summary["ar/tokens_per_s"] = 31.5
    run.log({"x": 1})
    run.finish()
    assert not list((tmp_path / "wandb").rglob("blockpilot-*"))


def test_plain_turns_nested_entries_into_json_data():
    class SubDict:  # like W&B's summary sub-dicts: keys() and [] only, any attribute lookup a KeyError
        def keys(self):
            return ["x"]

        def __getitem__(self, key):
            return {"x": (1, np.float64(2.5))}[key]

        def __getattr__(self, key):
            raise KeyError(key)

    assert plain({"a": SubDict(), "b": np.arange(2), 3: float("nan"), "s": "t"}) == {"a": {"x": [1, 2.5]}, "b": [0, 1],
                                                                                    "3": None, "s": "t"}
