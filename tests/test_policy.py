"""The train stage and the policy package: planted-rule learning, objectives, export/load, the schedule."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).parent))
from policy_fixtures import planted_labels  # noqa: E402

from pipeline import PROJECT_ROOT  # noqa: E402
from pipeline.policy.data import build_dataset, load_feature_dataset  # noqa: E402
from pipeline.policy import (Featurizer, FeatureSpec, FullVocabPredictor, MLPPredictor, Predictor,  # noqa: E402
                             PredictorSchedule, build_predictor, load_predictor, num_parameters)
from pipeline.policy.fallback import ALWAYS_FALLBACK, apply_fallback, departure_gain, tune_margin  # noqa: E402
from pipeline.policy.module import policy_loss, policy_metrics  # noqa: E402
from pipeline.policy.schedule import measure_overhead_ms  # noqa: E402
from pipeline.policy.training import split_tensors, train_predictor  # noqa: E402

CONF = str(PROJECT_ROOT / "conf")


def compose_cfg(name: str, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(name, overrides=["logger.enabled=false", *overrides])


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Synthetic labels whose best B is a function of the prefill entropy, as topk and full_vocab datasets."""
    root = tmp_path_factory.mktemp("planted")
    labels, edges = planted_labels(root / "labels", n=600, store_full=True)
    feats = {name: build_dataset(compose_cfg("dataset", f"dataset.labels_dir={labels}", f"dataset.out={root}/{name}",
                                             f"features={name}"))
             for name in ("topk", "full_vocab")}
    return {"root": root, "labels": labels, "edges": edges, **feats}


RUNS = itertools.count()


def train(planted, name: str, *overrides: str) -> Path:
    predictor = "full_vocab" if name == "full_vocab" else "mlp"
    return train_predictor(compose_cfg("train", f"train.features_dir={planted[name]}", f"predictor={predictor}",
                                       f"train.out={planted['root']}/pred-{next(RUNS)}", "trainer=smoke", *overrides))


def test_config_groups_compose():
    cfg = compose_cfg("train", "run_name=r2")
    assert cfg.predictor.arch == "mlp" and cfg.features.name == "topk" and cfg.trainer.patience > 0
    assert cfg.train.features_dir.endswith("/features/r2/topk") and cfg.train.out.endswith("/predictors/r2/mlp")
    assert cfg.logger.group == "r2" and cfg.logger.mode in ("offline", "online", "disabled")
    full = compose_cfg("train", "predictor=full_vocab")
    assert full.predictor.arch == "full_vocab" and full.features.name == "full_vocab"  # selected with the predictor
    assert full.train.out.endswith("/predictors/blockpilot/full_vocab")
    assert compose_cfg("train", "predictor=full_vocab", "features=topk").features.name == "topk"  # the command line wins
    smoke = compose_cfg("train", "trainer=smoke")
    assert smoke.trainer.max_epochs < compose_cfg("train").trainer.max_epochs
    assert compose_cfg("train", "features=topk_ids").train.features_dir.endswith("/topk_ids")


def test_default_mlp_is_small_and_full_vocab_has_the_papers_shape():
    cfg = compose_cfg("train")
    kwargs = {k: v for k, v in cfg.predictor.items() if k not in ("name", "arch", "max_params")}
    mlp = build_predictor("mlp", 34, 5, **kwargs)
    assert num_parameters(mlp) <= cfg.predictor.max_params == 1_000_000
    with_ids = build_predictor("mlp", 34, 5, **kwargs)  # id_buckets=4096 x 16 still fits
    assert num_parameters(with_ids) <= 1_000_000
    full = FullVocabPredictor(49152, 5, hidden=256)
    assert [type(m).__name__ for m in full.proj] == ["Linear", "GELU"] and full.proj[0].in_features == 49152
    assert full.residual[1].in_features == full.residual[1].out_features == 256
    assert full(torch.randn(3, 49152)).shape == (3, 5)
    with pytest.raises(ValueError, match="predictor.arch"):
        build_predictor("transformer", 4, 2)


def test_losses():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    tau = torch.tensor([[1.0, 3.0, 2.0], [2.0, 2.0, 4.0]])
    batch = {"label": torch.tensor([1, 2]), "reward": tau, "tau": tau}
    assert policy_loss(logits, batch, "hard", 1.0).item() == pytest.approx(torch.nn.functional.cross_entropy(logits, batch["label"]).item())
    # a cold soft target is the hard label
    assert policy_loss(logits, batch, "soft", 1e-3).item() == pytest.approx(policy_loss(logits, batch, "hard", 1.0).item(), rel=1e-4)
    expected = (torch.softmax(logits, -1) * tau).sum(-1).mean().item()
    assert policy_loss(logits, batch, "reward", 1.0).item() == pytest.approx(-expected)
    m = policy_metrics(logits, tau, batch["label"], fixed_index=0)
    assert m["pick_tau"] == pytest.approx((1.0 + 2.0) / 2) and m["oracle_tau"] == pytest.approx(3.5)
    assert m["acc"] == 0.0 and m["expected_tau"] == pytest.approx(expected)
    assert m["oracle_gain_share"] == pytest.approx((1.5 - 1.5) / (3.5 - 1.5))
    with pytest.raises(ValueError, match="train.objective"):
        policy_loss(logits, batch, "ranking", 1.0)


@pytest.mark.parametrize("objective", ["hard", "soft", "reward"])
def test_mlp_learns_the_planted_entropy_rule(planted, objective):
    out = train(planted, "topk", f"train.objective={objective}", "train.lr=1e-2", "trainer.max_epochs=40", "trainer.patience=40")
    meta = json.loads((out / "predictor.json").read_text())
    test = meta["metrics"]["test"]
    # the classification objectives recover the rule; maximising expected tau directly learns it more slowly
    # (its gradient vanishes on confidently wrong rows) but still captures most of the oracle's gain
    assert test["acc"] > (0.9 if objective != "reward" else 0.85), test
    assert test["oracle_gain_share"] > (0.85 if objective != "reward" else 0.75), test
    assert test["pick_tau"] > test["best_fixed_tau"] + 0.5  # the planted bonus is 1 token of tau
    # the exported predictor reproduces the rule on live logits: low entropy -> B=2, high entropy -> B=6
    predictor = load_predictor(out)
    g = torch.Generator().manual_seed(7)
    peaked, flat = torch.randn(320, generator=g) * 5.5, torch.randn(320, generator=g) * 0.05
    assert predictor.predict(peaked) == 2 and predictor.predict(flat) == 6


def test_speed_labelled_predictor_is_deployed_by_its_own_reward(planted):
    """The planted speed rule is the tau rule reversed (the fastest B is the tau-worst one in its bin). Trained on
    speed labels, the predictor departs from B_train where tokens/s gains, and the deploy check, judging by the same
    reward, keeps those departures; judged by tau (as before) it kept B_train on every request."""
    out = train(planted, "topk", "train.target=speed", "train.objective=hard", "train.lr=1e-2", "trainer.max_epochs=40",
                "trainer.patience=40")
    fallback = json.loads((out / "predictor.json").read_text())["fallback"]
    assert fallback["reward"] == "speed" and fallback["margin"] < ALWAYS_FALLBACK, fallback
    check = fallback["validation_gain"]
    assert check["departures"] > 0 and check["lower_bound"] > 0, check
    # the reward is tokens/s over the prompt's best (<= 1): the deployed picks are near the best on validation
    assert 0.9 < fallback["validation_pick_reward"] <= 1.0, fallback
    predictor = load_predictor(out)
    g = torch.Generator().manual_seed(7)
    peaked, flat = torch.randn(320, generator=g) * 5.5, torch.randn(320, generator=g) * 0.05
    assert predictor.predict(peaked) == 6 and predictor.predict(flat) == 2  # the reversed rule


def test_early_stopping_keeps_the_best_checkpoint(planted):
    out = train(planted, "topk", "train.objective=soft", "trainer.max_epochs=25", "trainer.patience=3", "train.lr=0.05")
    meta = json.loads((out / "predictor.json").read_text())
    metrics = meta["metrics"]
    assert metrics["epochs"] < 25  # stopped early
    # the exported weights are the best validation checkpoint, not the last epoch's
    assert metrics["validation"]["expected_tau"] == pytest.approx(metrics["best_val_expected_tau"], abs=1e-4)


def test_export_roundtrip_and_schedule(planted):
    out = train(planted, "topk", "train.objective=hard", "trainer.max_epochs=5")
    meta = json.loads((out / "predictor.json").read_text())
    for key in ("features", "candidates", "target", "drafter", "training_block_size", "arch", "arch_config", "inference_ms"):
        assert key in meta, key
    assert meta["candidates"] == [2, 3, 4, 5, 6] and meta["target"] == "synthetic-target" and meta["training_block_size"] == 4
    assert meta["features"]["vocab_size"] == 320 and meta["num_parameters"] <= 1_000_000
    predictor = load_predictor(out)
    dd, _ = load_feature_dataset(planted["topk"])
    data = split_tensors(dd["test"])
    with torch.no_grad():  # the exported picks, confidence fallback included
        offline = torch.tensor([predictor.candidates.index(b) for b in predictor.choose(predictor.net(data["x"]))])
    logits = torch.randn(4, 320) * torch.tensor([0.1, 1.0, 4.0, 9.0])[:, None]
    batch = predictor.predict_batch(logits)
    assert batch == [predictor.predict(row) for row in logits]
    schedule = PredictorSchedule(predictor)
    assert schedule.max_block_size == 6
    b = schedule.first(logits[2])
    assert b == batch[2] and schedule.next(1, b) == b and schedule.next(b, b) == b
    assert (offline >= 0).all() and meta["metrics"]["test"]["acc"] == pytest.approx(
        float((offline == data["label"]).float().mean()), abs=1e-6)
    timing = measure_overhead_ms(predictor, repeats=20, warmup=2)
    assert 0 < timing["median_ms"] <= timing["p90_ms"]
    with pytest.raises(ValueError, match="vocabulary of 320"):
        predictor.predict(torch.randn(321))
    with pytest.raises(FileNotFoundError, match="make train"):
        load_predictor(planted["root"] / "nope")


def test_full_vocab_baseline_trains_the_same_way(planted):
    out = train(planted, "full_vocab", "train.objective=hard", "trainer.max_epochs=40", "trainer.patience=40")
    meta = json.loads((out / "predictor.json").read_text())
    assert meta["arch"] == "full_vocab" and meta["features"]["kind"] == "full_vocab" and meta["name"] == "full_vocab"
    assert meta["arch_config"]["in_dim"] == 320
    # the entropy rule is not linear in an unsorted [V] row: the net fits the train split and generalises
    # above chance (1/5) and above the best single B, well below the summary-feature MLP
    metrics = meta["metrics"]
    assert metrics["train"]["acc"] > 0.9
    assert metrics["test"]["acc"] > 0.25 and metrics["test"]["pick_tau"] > metrics["test"]["best_fixed_tau"]
    assert load_predictor(out).predict(torch.randn(320) * 8.0) in (2, 3, 4, 5, 6)


def test_train_rejects_mismatched_features_and_oversized_nets(planted, tmp_path):
    with pytest.raises(ValueError, match="rerun make dataset"):
        train_predictor(compose_cfg("train", f"train.features_dir={planted['topk']}", "features.k=8", f"train.out={tmp_path}/a"))
    with pytest.raises(ValueError, match="predictor.max_params=1000"):
        train_predictor(compose_cfg("train", f"train.features_dir={planted['topk']}", "predictor.max_params=1000",
                                    f"train.out={tmp_path}/b"))
    with pytest.raises(FileNotFoundError, match="make dataset"):
        train_predictor(compose_cfg("train", f"train.features_dir={tmp_path}/none", f"train.out={tmp_path}/c"))


def test_mlp_embeds_ids_weighted_by_probability():
    net = MLPPredictor(4, 3, hidden=8, id_buckets=16, id_dim=4).eval()
    x = torch.randn(2, 4)
    ids = torch.tensor([[1, 17], [1, 2]])  # 17 hashes to bucket 1
    w = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    a, b = net(x, ids, w), net(x.clone(), torch.tensor([[1, 1], [1, 5]]), w)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="'ids' part"):
        net(x)


def test_confidence_fallback_keeps_the_training_block_size_unless_sure():
    # classes = B in (6, 8, 10), fallback = index 1 (B=8). Row 0: confidently 10 and right (tau 3 > 2);
    # row 1: barely 6 and wrong (tau 1 < 2). The best margin keeps row 0's pick and drops row 1's.
    scores = torch.tensor([[0.0, 0.0, 4.0], [0.3, 0.0, 0.0]])
    tau = torch.tensor([[2.0, 2.0, 3.0], [1.0, 2.0, 2.0]])
    probs = torch.softmax(scores, -1)
    margin, mean = tune_margin(scores, tau, 1)
    assert margin == pytest.approx(float(probs[0, 2] - probs[0, 1])) and mean == pytest.approx(2.5)
    assert apply_fallback(scores, 1, margin).tolist() == [2, 1]
    assert apply_fallback(scores, 1, 0.0).tolist() == [2, 0]  # margin 0: the plain argmax
    # departures that never help: always keep the training block size
    margin, mean = tune_margin(scores, torch.tensor([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]), 1)
    assert margin == ALWAYS_FALLBACK and mean == 2.0
    assert apply_fallback(scores, 1, margin).tolist() == [1, 1]
    # the exported predictor applies the rule
    net = build_predictor("mlp", 4, 3, hidden=8, num_layers=1)
    predictor = Predictor(net, Featurizer(FeatureSpec(k=2, vocab_size=16)), [6, 8, 10], {"fallback": {"block_size": 8, "margin": 0.5}})
    assert predictor.choose(scores) == [10, 8]
    predictor.meta["fallback"]["margin"] = 0.0
    assert predictor.choose(scores) == [10, 6]
    with pytest.raises(IndexError, match="fallback index"):
        apply_fallback(scores, 3, 0.0)


def test_departure_gain_lower_bound_needs_consistent_wins():
    # 20 requests, classes B in (6, 8, 10), fallback B=8 (index 1); the predictor leaves B=8 where scores say 10
    def case(gains):
        scores = torch.zeros(20, 3)
        tau = torch.full((20, 3), 2.0)
        for row, g in enumerate(gains):
            scores[row, 2] = 5.0
            tau[row, 2] = 2.0 + g
        return departure_gain(scores, tau, 1, margin=0.5, confidence=0.95, resamples=4000, seed=0)

    once = case([0.1])  # one lucky request: resamples miss it in (19/20)^20 = 36% of cases
    assert once["departures"] == 1 and once["mean_gain"] == pytest.approx(0.005) and once["lower_bound"] == 0.0
    steady = case([0.5] * 10)  # half the requests gain 0.5 tokens each
    assert steady["departures"] == 10 and steady["mean_gain"] == pytest.approx(0.25) and 0.1 < steady["lower_bound"] < 0.25
    mixed = case([1.0, -1.0] * 5)  # wins and losses cancel
    assert mixed["mean_gain"] == pytest.approx(0.0) and mixed["lower_bound"] < 0
    assert case([0.5] * 10) == steady  # seeded: deterministic
    with pytest.raises(ValueError, match="fallback_confidence"):
        departure_gain(torch.zeros(2, 3), torch.zeros(2, 3), 1, 0.5, confidence=1.0)


# ------------------------------------------------------------------------------------------------
# issue 15 item 4: predictor.json checked against its net, its fallback and the config
# ------------------------------------------------------------------------------------------------
def _exported(directory: Path, **json_edits) -> Path:
    """A 5-class predictor (candidates 2..6, fallback B=4) exported to ``directory``, then ``json_edits`` applied."""
    from pipeline.policy.export import export_predictor

    spec = FeatureSpec(k=2, vocab_size=16)
    net = build_predictor("mlp", Featurizer(spec).dim, 5, hidden=8, num_layers=1)
    out = export_predictor(directory, net, spec, [2, 3, 4, 5, 6], {"fallback": {"block_size": 4, "margin": 0.1}})
    meta = json.loads((out / "predictor.json").read_text())
    meta.update({k: (v(meta[k]) if callable(v) else v) for k, v in json_edits.items()})
    (out / "predictor.json").write_text(json.dumps(meta))
    return out


def test_predictor_json_must_match_its_net_and_fallback(tmp_path):
    """A 5-class net whose json lists 3 candidates used to load and then raise IndexError on the first pick; a
    fallback block size outside the candidates silently dropped the safety fallback."""
    from pipeline.policy import load_predictor

    good = load_predictor(_exported(tmp_path / "good"))
    assert good.candidates == [2, 3, 4, 5, 6] and good.predict(torch.randn(16)) in good.candidates
    with pytest.raises(ValueError, match=r"predictor.json: predictor net has 5 classes but 3 candidates \[2, 3, 4\]"):
        load_predictor(_exported(tmp_path / "three", candidates=[2, 3, 4]))
    with pytest.raises(ValueError, match=r"fallback block size 8 is not one of its candidates \[2, 3, 4, 5, 6\]"):
        load_predictor(_exported(tmp_path / "fallback", fallback={"block_size": 8, "margin": 0.1}))
    with pytest.raises(ValueError, match=r"predictor.safetensors does not fit the net described in .*predictor.json"):
        load_predictor(_exported(tmp_path / "wide", arch_config=lambda c: {**c, "hidden": 16}))
    with pytest.raises(ValueError, match="fallback block size 9"):
        Predictor(good.net, good.featurizer, [2, 3, 4, 5, 6], {"fallback": {"block_size": 9, "margin": 0.0}})


def test_predictor_candidates_must_match_model_candidates(tmp_path):
    """Candidates [2..6] against model.candidates=[6..10] used to load silently."""
    from pipeline.evaluation.inputs import sources
    from pipeline.policy import setup

    _exported(tmp_path / "predictors" / "mlp")

    def load_method_predictor(cfg, method):  # as the eval stage loads it (pipeline.policy.setup.load_inputs)
        src = sources(cfg)
        return setup.load_method_predictor(method, setup.predictor_folder(src.predictor_dir, method, {}), None,
                                           list(cfg.model.candidates))

    def cfg(*overrides):
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            return compose("evaluate", [f"eval.predictor_dir={tmp_path / 'predictors'}", *overrides])

    with pytest.raises(ValueError, match=r"chooses among block sizes \[2, 3, 4, 5, 6\], but model.candidates=\[6, 7, 8, 9, 10\]"):
        load_method_predictor(cfg(), "blockpilot")
    assert load_method_predictor(cfg("model.candidates=[2,3,4,5,6]"), "blockpilot").candidates == [2, 3, 4, 5, 6]
