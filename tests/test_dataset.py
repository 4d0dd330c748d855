"""The dataset stage: labels -> features + rewards, deterministic stratified splits, leave-one-set-out."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).parent))
from policy_fixtures import TOPK, label_row, planted_labels, write_labels  # noqa: E402

from pipeline import PROJECT_ROOT  # noqa: E402
from pipeline.policy.data import build_dataset, load_feature_dataset, read_label_table, split_ids  # noqa: E402
from pipeline.policy.features import Featurizer, FeatureSpec  # noqa: E402

CONF = str(PROJECT_ROOT / "conf")


def dataset_cfg(labels: Path, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("dataset", overrides=[f"dataset.labels_dir={labels}", f"dataset.out={out}", "logger.enabled=false", *overrides])


@pytest.fixture(scope="module")
def labels(tmp_path_factory) -> Path:
    directory, _ = planted_labels(tmp_path_factory.mktemp("labels") / "run", n=90, store_full=True)
    return directory


def test_config_groups_compose():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for name, kind in (("topk", "topk"), ("topk_ids", "topk"), ("full_vocab", "full_vocab")):
            cfg = compose("dataset", overrides=[f"features={name}", "run_name=r1"])
            spec = FeatureSpec.from_dict(cfg.features)
            assert (spec.name, spec.kind) == (name, kind)
            assert cfg.dataset.out.endswith(f"/features/r1/{name}")
            assert cfg.dataset.labels_dir.endswith("/labels/r1")
            assert cfg.logger.group == "r1"
        assert Featurizer(FeatureSpec.from_dict(compose("dataset").features)).dim == 2 * 16 + 2
        assert Featurizer(FeatureSpec.from_dict(compose("dataset", overrides=["features=topk_ids"]).features)).uses_ids


def test_features_from_labels_match_live_logits():
    """The dataset path (stored top-k + entropy) and the decoder path (a live [V] row) give the same features."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g) * torch.tensor([0.1, 1.0, 3.0, 8.0, 20.0])[:, None]
    rows = [label_row(f"p{i}", "s", logits[i], [2, 3], [1.0, 2.0], [5.0, 4.0]) for i in range(5)]
    for parts in (["probs", "logprobs", "entropy", "tail"], ["probs", "ids"], ["entropy"]):
        featurizer = Featurizer(FeatureSpec(k=8, parts=parts, vocab_size=300))
        stored = featurizer.from_labels(pd.DataFrame(rows))
        live = featurizer.from_logits(logits)
        assert stored["x"].shape == (5, featurizer.dim)
        for key in stored:
            np.testing.assert_allclose(stored[key], live[key].numpy(), rtol=1e-5, atol=1e-5)
    full = Featurizer(FeatureSpec(name="full_vocab", kind="full_vocab", vocab_size=300))
    stored = full.from_labels(pd.DataFrame(rows))["x"]
    assert stored.shape == (5, 300)
    np.testing.assert_allclose(stored.sum(1), 1.0, rtol=1e-4)
    np.testing.assert_allclose(stored, full.from_logits(logits)["x"].numpy(), atol=1e-6)
    # entropy feature is the distribution's entropy in nats: a uniform row has log V
    uniform = Featurizer(FeatureSpec(k=4, parts=["entropy", "tail"])).from_logits(torch.zeros(300))["x"][0]
    assert uniform[0].item() == pytest.approx(np.log(300), rel=1e-5)
    assert uniform[1].item() == pytest.approx(1 - 4 / 300, rel=1e-4)


def test_build_dataset_columns_splits_and_rewards(labels, tmp_path):
    out = build_dataset(dataset_cfg(labels, tmp_path / "feat", "dataset.seed=3"))
    dd, info = load_feature_dataset(out)
    df, meta = read_label_table(labels)
    assert set(dd) == {"train", "validation", "test"}
    ids = {s: list(dd[s]["id"]) for s in dd}
    assert sorted(sum(ids.values(), [])) == sorted(df["id"])  # every prompt exactly once
    assert not (set(ids["train"]) & set(ids["test"])) and not (set(ids["train"]) & set(ids["validation"]))
    # stratified: 30 prompts per set -> 21/5/4 (0.7/0.15/0.15, rounded)
    for split, n in (("train", 21), ("validation", 4), ("test", 4)):
        counts = pd.Series(dd[split]["source_set"]).value_counts()
        assert sorted(counts.index) == ["chat", "code", "math"]
        assert (counts >= n).all() and (counts <= n + 2).all(), (split, counts.to_dict())
    assert info["candidates"] == [2, 3, 4, 5, 6] and info["features"]["vocab_size"] == 320
    assert info["target"] == meta["target"] and info["training_block_size"] == 4
    # rewards and labels are the label rows', class indices point at the label B
    row = dd["test"][0]
    src = df.set_index("id").loc[row["id"]]
    np.testing.assert_allclose(row["tau"], src["tau"], rtol=1e-6)
    np.testing.assert_allclose(row["tokens_per_s"], src["tokens_per_s"], rtol=1e-6)
    assert row["label_tau"] == src["label_tau"] == [2, 3, 4, 5, 6][row["label_tau_idx"]]
    assert row["label_speed"] == src["label_speed"] == [2, 3, 4, 5, 6][row["label_speed_idx"]]
    assert int(np.argmax(row["tau"])) == row["label_tau_idx"]
    assert len(row["x"]) == 34


def test_splits_are_deterministic_and_seeded(labels, tmp_path):
    a = build_dataset(dataset_cfg(labels, tmp_path / "a", "dataset.seed=5"))
    b = build_dataset(dataset_cfg(labels, tmp_path / "b", "dataset.seed=5"))
    c = build_dataset(dataset_cfg(labels, tmp_path / "c", "dataset.seed=6"))
    da, db, dc = (load_feature_dataset(p)[0] for p in (a, b, c))
    for split in ("train", "validation", "test"):
        assert da[split]["id"] == db[split]["id"]
        np.testing.assert_array_equal(np.asarray(da[split]["x"]), np.asarray(db[split]["x"]))
    assert da["test"]["id"] != dc["test"]["id"]


def test_holdout_set_goes_entirely_to_test(labels, tmp_path):
    out = build_dataset(dataset_cfg(labels, tmp_path / "h", "dataset.holdout_set=math"))
    dd, info = load_feature_dataset(out)
    assert set(dd["test"]["source_set"]) == {"math"} and len(dd["test"]) == 30
    assert "math" not in set(dd["train"]["source_set"]) | set(dd["validation"]["source_set"])
    assert len(dd["train"]) + len(dd["validation"]) == 60 and len(dd["validation"]) >= 2
    assert info["holdout_set"] == "math"
    with pytest.raises(ValueError, match="holdout_set='poetry'.*chat"):
        build_dataset(dataset_cfg(labels, tmp_path / "x", "dataset.holdout_set=poetry"))


def test_topk_ids_and_full_vocab_datasets(labels, tmp_path):
    dd, _ = load_feature_dataset(build_dataset(dataset_cfg(labels, tmp_path / "ids", "features=topk_ids")))
    row = dd["train"][0]
    assert len(row["ids"]) == 16 and len(row["id_weights"]) == 16
    assert row["id_weights"] == sorted(row["id_weights"], reverse=True)
    dd, info = load_feature_dataset(build_dataset(dataset_cfg(labels, tmp_path / "full", "features=full_vocab")))
    x = np.asarray(dd["train"]["x"])
    assert x.shape == (len(dd["train"]), 320) and info["features"]["kind"] == "full_vocab"
    np.testing.assert_allclose(x.sum(1), 1.0, rtol=1e-4)


def test_split_ids_edge_cases():
    df = pd.DataFrame({"id": [f"a{i}" for i in range(3)] + ["b0"], "source_set": ["a"] * 3 + ["b"]})
    out = split_ids(df, 0, {"train": 0.8, "validation": 0.1, "test": 0.1})
    assert [len(out[s]) for s in ("train", "validation", "test")] == [2, 1, 1]  # small set keeps one per share
    assert "b0" in out["train"]
    with pytest.raises(ValueError, match="sum to 1"):
        split_ids(df, 0, {"train": 0.8, "validation": 0.1, "test": 0.3})


def test_split_ids_keep_every_turn_of_a_prompt_together():
    ids = [f"q{i}" for i in range(10)] + [f"q{i}#turn2" for i in range(0, 10, 2)]
    df = pd.DataFrame({"id": ids, "source_set": ["chat"] * len(ids)})
    out = split_ids(df, 3, {"train": 0.6, "validation": 0.2, "test": 0.2})
    assert sorted(sum(out.values(), [])) == sorted(ids)  # every request once
    for split, members in out.items():
        for rid in members:
            if rid.endswith("#turn2"):
                assert rid.removesuffix("#turn2") in members, (split, rid)
    # the prompt-level assignment is the one of first-turn-only labels
    first_only = split_ids(df[~df["id"].str.contains("#")], 3, {"train": 0.6, "validation": 0.2, "test": 0.2})
    assert {s: [i for i in v if "#" not in i] for s, v in out.items()} == first_only


def test_bad_inputs_name_the_fix(labels, tmp_path):
    with pytest.raises(FileNotFoundError, match="make label"):
        build_dataset(dataset_cfg(tmp_path / "nothing", tmp_path / "o"))
    with pytest.raises(ValueError, match=f"label.topk>={TOPK + 8}"):
        build_dataset(dataset_cfg(labels, tmp_path / "o", f"features.k={TOPK + 8}"))
    no_full, _ = planted_labels(tmp_path / "nofull", n=12, store_full=False)
    with pytest.raises(ValueError, match="store_full_logits=true"):
        build_dataset(dataset_cfg(no_full, tmp_path / "o", "features=full_vocab"))
    g = torch.Generator().manual_seed(0)
    bad = [label_row(f"p{i}", "s", torch.randn(50, generator=g), [2, 3], [1.0, 2.0], [1.0, 2.0]) for i in range(3)]
    bad[1]["candidates"] = [2, 4]
    write_labels(tmp_path / "mixed", bad, {"candidates": [2, 3]})
    with pytest.raises(ValueError, match="other candidates"):
        build_dataset(dataset_cfg(tmp_path / "mixed", tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match="make dataset"):
        load_feature_dataset(tmp_path / "missing")


def test_too_few_prompts_per_set_is_refused_up_front_with_what_is_needed(tmp_path):
    g = torch.Generator().manual_seed(0)

    def labels_of(n: int, name: str) -> Path:
        rows = [label_row(f"{s}-{i}", s, torch.randn(50, generator=g), [2, 3], [1.0, 2.0], [1.0, 2.0])
                for s in ("a", "b") for i in range(n)]
        return write_labels(tmp_path / name, rows, {"candidates": [2, 3]})

    out = tmp_path / "features"
    with pytest.raises(ValueError, match=r"validation/test splits are empty.*'a': 2.*at least 3 prompts per set"):
        build_dataset(dataset_cfg(labels_of(2, "two"), out))
    assert not out.exists()  # refused before writing
    dd, info = load_feature_dataset(build_dataset(dataset_cfg(labels_of(3, "three"), out)))
    assert {s: len(dd[s]) for s in ("train", "validation", "test")} == {"train": 2, "validation": 2, "test": 2}
