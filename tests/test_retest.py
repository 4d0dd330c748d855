"""The per-request policy re-test on planted labels: every leave-one-set-out fold finds the planted rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from policy_fixtures import planted_labels  # noqa: E402

from pipeline.evaluation.retest import gain_share, run_retest  # noqa: E402


def test_gain_share_by_hand():
    values = np.array([[1.0, 2.0, 3.0], [1.0, 3.0, 2.0], [2.0, 1.0, 1.0]])
    out = gain_share(values, np.array([2, 1, 1]), fixed_index=1, samples=200)
    # pick 3,3,1 = 7/3; fixed 2,3,1 = 2; oracle 3,3,2 = 8/3: share (7/3-2)/(8/3-2) = 0.5
    assert out["pick"] == pytest.approx(7 / 3) and out["fixed"] == pytest.approx(2.0) and out["oracle"] == pytest.approx(8 / 3)
    assert out["gain_share"] == pytest.approx(0.5) and out["departures"] == 1 and out["n"] == 3
    lo, hi = out["gain_share_ci"]
    assert lo <= 0.5 <= hi
    assert gain_share(np.ones((4, 2)), np.zeros(4, dtype=int), 0)["gain_share"] is None  # nothing to gain


def test_every_held_out_set_learns_the_planted_rule(compose_config, tmp_path):
    labels, _ = planted_labels(tmp_path / "labels", n=360)
    cfg = compose_config("retest", [f"paths.data={tmp_path}", "run_name=planted", f"retest.labels_dir={tmp_path / 'labels'}",
                                    "trainer=smoke", "logger.enabled=false", "retest.bootstrap.samples=200"])
    results = run_retest(cfg)
    assert set(results["folds"]) == {"tau", "speed"}
    for target, folds in results["folds"].items():
        assert set(folds) == {"code", "math", "chat"}
        for holdout, e in folds.items():
            assert e["n"] == 120 and e["fixed_block_size"] == 4
            assert e["oracle"] >= e["pick"] and e["gain_share"] is not None
            if target == "tau":  # the planted tau rule is learnt on every fold (keeping the fixed B scores 0)
                assert e["gain_share"] > 0.5 and e["gain_share_ci"][0] > 0.2, (holdout, e)
    stored = json.loads((tmp_path / "retest" / "planted" / "topk" / "retest.json").read_text())
    assert stored["folds"]["tau"]["code"]["gain_share"] == results["folds"]["tau"]["code"]["gain_share"]
    assert "| code | 120 |" in (tmp_path / "retest" / "planted" / "topk" / "retest.md").read_text()
