"""The step cost model (``pipeline.costs``): constructed timings give known values on the one monotone curve, every
consumer reads that curve, and the model is obtained one way: stored, else from a file, else from the per-machine
cache keyed by the models and the forward path, else measured (and re-measured when the key changes)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline import costs
from pipeline.costs import (CostModel, DriftMonitor, ObservedCosts, Timing, monotone, retime, suspect_points,
                            time_points)
from pipeline.policy.verify_width import VerifyWidthSchedule
from pipeline.costs import store
from pipeline.timing import steps
from pipeline.timing.steps import load_or_measure


def synthetic_model() -> CostModel:
    return CostModel(context_buckets=[100, 300], block_sizes=[1, 2, 10],
                     verify_points={1: [10.0, 20.0], 2: [11.0, 21.0], 10: [20.0, 40.0]},
                     draft_points={2: [2.0, 4.0], 10: [4.0, 8.0]}, prefill_points=[50.0, 150.0], noise_ms=0.5)


def bumpy_model() -> CostModel:
    """One bucket; a noisy bump at width 3 (30 ms between 11 and 13)."""
    return CostModel([100], [1, 2, 3, 4, 5], {1: [10.0], 2: [11.0], 3: [30.0], 4: [13.0], 5: [14.0]},
                     {b: [2.0] for b in range(2, 6)}, [1.0])


def test_monotone_is_isotonic_regression():
    assert monotone([10, 11, 30, 13, 14]) == pytest.approx([10, 11, 19, 19, 19])  # 19 = mean of 30, 13, 14
    assert monotone([3, 1, 2]) == pytest.approx([2, 2, 2])
    assert monotone([1, 2, 2, 5]) == [1, 2, 2, 5]  # already monotone: unchanged
    assert monotone([]) == []


def test_constructed_timings_give_known_values():
    model = synthetic_model()
    assert model.verify_ms(1, 100) == pytest.approx(10.0)
    assert model.step_ms(1, 100) == pytest.approx(10.0)  # B = 1: no draft
    assert model.step_ms(2, 200) == pytest.approx(16.0 + 3.0)  # verify 16 + draft 3, halfway between the buckets
    assert model.step_ms(6, 100) == pytest.approx(15.5 + 3.0)  # halfway between widths 2 and 10
    assert model.step_ms(10, 100, rows=2) == pytest.approx(11.0 + 4.0)  # draft B=10, verify k+1 = 2 rows
    assert model.verify_ms(1, 500) == pytest.approx(30.0)  # linear extrapolation past the last bucket
    assert model.prefill_ms(200) == pytest.approx(100.0)
    assert model.decode_ms([2, 2], [100, 300], new_tokens=4, temperature=0.0) == pytest.approx(13.0 + 25.0)
    assert model.decode_ms([2, 2], [100, 300], new_tokens=4, temperature=0.7) == pytest.approx(38.0 + 2.0)
    assert model.tokens_per_s(100, [2, 2], [100, 300], 4, 0.0) == pytest.approx(4 / ((50 + 38) / 1e3))
    # a noisy bump is pooled with its wider neighbours, never making a wider verify look cheaper
    bumpy = bumpy_model()
    assert [bumpy.verify_ms(q, 100) for q in range(1, 6)] == pytest.approx([10, 11, 19, 19, 19])
    assert bumpy.step_ms(3, 100) == pytest.approx(19 + 2)
    # the curve at a context: interpolated over the buckets first, then made monotone in the width
    two = CostModel([100, 300], [1, 2, 3], {1: [10.0, 10.0], 2: [30.0, 12.0], 3: [13.0, 14.0]}, {}, [1.0, 1.0])
    assert [two.verify_ms(q, 200) for q in (1, 2, 3)] == pytest.approx([10.0, 17.25, 17.25])  # [10, 21, 13.5] pooled
    with pytest.raises(ValueError, match="one value per context bucket"):
        CostModel([1, 2], [1], {1: [1.0]}, {}, [1.0, 2.0])
    with pytest.raises(ValueError, match="cost part"):
        model.curve("prefill", 100)


def test_the_curve_is_monotone_everywhere():
    rng = np.random.default_rng(0)
    widths = list(range(1, 17))
    model = CostModel([64, 256, 512], widths, {w: list(rng.uniform(5, 50, 3)) for w in widths},
                      {w: list(rng.uniform(1, 10, 3)) for w in widths if w > 1}, [10.0, 40.0, 80.0])
    for context in (1, 64, 100, 300, 512, 2048):  # inside and outside the measured buckets
        verify = [model.verify_ms(q, context) for q in range(1, 21)]  # past the widest measured verify too
        draft = [model.draft_ms(b, context) for b in range(2, 21)]
        assert verify == sorted(verify) and draft == sorted(draft) and min(verify) >= 0
        steps = [model.step_ms(b, context) for b in range(2, 17)]
        assert steps == sorted(steps)


def test_every_consumer_reads_the_same_curve():
    """The verify-width policy's per-step costs and the label stage's decode costs are the one fitted curve."""
    from pipeline.policy.calibration import AcceptanceCalibration

    model = bumpy_model()
    schedule = VerifyWidthSchedule(AcceptanceCalibration([0.0] * 4, [0.0] * 4), model, 5)
    draft, verify = schedule.costs(5, 100)
    assert draft == pytest.approx(model.draft_ms(5, 104)) and verify == pytest.approx([10, 11, 19, 19, 19])
    assert model.decode_ms([3, 1], [100, 100], 4, 0.0) == pytest.approx((19 + 2) + 10)


def test_dicts_round_trip_and_older_fits_read_the_same_timings():
    model = synthetic_model()
    data = json.loads(json.dumps(model.to_dict()))
    assert set(data) >= {"verify_ms", "draft_ms", "prefill_ms", "context_buckets", "block_sizes"}
    assert data["fit"] == costs.FIT
    again = CostModel.from_dict(data)
    assert again == model and again.step_ms(6, 150) == model.step_ms(6, 150)
    older = {**data, "fit": "linear"}  # a meta.json or cache file of the two-fit model: the same timings
    assert CostModel.from_dict(older) == model


def test_load_reads_models_cache_files_and_meta(tmp_path):
    model = synthetic_model()
    (tmp_path / "model.json").write_text(json.dumps(model.to_dict()))
    (tmp_path / "meta.json").write_text(json.dumps({"mode": "replay", "latency_model": model.to_dict()}))
    (tmp_path / "cache.json").write_text(json.dumps({"key": {}, "latency_model": model.to_dict()}))
    for name in ("model.json", "meta.json", "cache.json"):
        assert costs.load(tmp_path / name) == model
    (tmp_path / "brute.json").write_text(json.dumps({"mode": "brute", "latency_model": None}))
    with pytest.raises(ValueError, match="holds no latency model"):
        costs.load(tmp_path / "brute.json")
    with pytest.raises(FileNotFoundError, match="label.latency.path"):
        costs.load(tmp_path / "none.json")


def config(tmp_path, tiny, **latency) -> OmegaConf:
    return OmegaConf.create({
        "seed": 0, "decode": {"temperature": 0.0},
        "model": {"target": str(tiny.target_dir("llama")), "drafter": str(tiny.drafter_dir("llama", "trained")),
                  "dtype": "float32", "device": "cpu"},
        "label": {"latency": {"path": None, "cache": str(tmp_path / "cache"), "context_buckets": [8, 32], "repeats": 1,
                              "spot_check": False, **latency}},
        "eval": {"verify_width": {"latency": {"cache": str(tmp_path / "cache"), "context_buckets": [8, 32], "repeats": 1,
                                              "spot_check": False}}},
    })


def test_load_or_measure_precedence(tmp_path, tiny, caplog):
    model = synthetic_model()
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model.to_dict()))
    cfg = config(tmp_path, tiny, path=str(path))
    stored = {**bumpy_model().to_dict(), "fit": "linear"}
    with caplog.at_level(logging.WARNING, logger="pipeline.timing.steps"):
        assert load_or_measure(None, cfg, [4], stored=stored) == bumpy_model()  # the run's own model first
    assert "'linear' fit" in caplog.text
    assert load_or_measure(None, cfg, [4]) == model  # then <section>.path
    assert load_or_measure(None, config(tmp_path, tiny), [4], path=path) == model  # or an explicit path
    with pytest.raises(ValueError, match="eval.verify_width.latency.path"):
        load_or_measure(None, cfg, [4], "eval.verify_width.latency")  # measuring needs the decoder
    assert not (tmp_path / "cache").exists()


def test_cached_per_machine_and_forward_path_and_remeasured_on_a_key_change(tmp_path, tiny, trained_decoder,
                                                                             monkeypatch, steady_clock):
    cache = tmp_path / "cache"
    cfg = config(tmp_path, tiny)
    first = load_or_measure(trained_decoder, cfg, [4, 8])
    files = sorted(cache.glob("latency-*.json"))
    assert len(files) == 1 and first.block_sizes == list(range(1, 9)) and first.context_buckets == [8, 32]
    stored = json.loads(files[0].read_text())
    assert stored["key"]["forward"] == trained_decoder.forward_path() and stored["key"]["block_sizes"] == list(range(1, 9))
    assert stored["key"]["kind"] == "latency" and stored["key"]["host"] == store.host()  # the one key builder's host
    # reused (measured timings never repeat exactly), also by another stage's section with the same settings, and by a
    # caller reading other widths up to the same largest one (every width 1..max is measured and keyed)
    assert load_or_measure(trained_decoder, cfg, [8, 4, 4]) == first
    assert load_or_measure(trained_decoder, cfg, [2, 8]) == first
    assert load_or_measure(trained_decoder, cfg, [4, 8], "eval.verify_width.latency") == first
    assert len(list(cache.glob("latency-*.json"))) == 1
    # another forward path (e.g. another backend or KV cache): another key, measured afresh, the first file kept
    real = trained_decoder.forward_path()
    monkeypatch.setattr(trained_decoder, "forward_path", lambda: {**real, "kv_cache": "static"})
    other = load_or_measure(trained_decoder, cfg, [4, 8])
    assert other != first and len(list(cache.glob("latency-*.json"))) == 2
    assert load_or_measure(trained_decoder, cfg, [4, 8]) == other
    monkeypatch.undo()
    assert load_or_measure(trained_decoder, cfg, [4, 8]) == first
    # other models: another key
    moved = OmegaConf.merge(cfg, {"model": {"dtype": "bfloat16"}})
    assert load_or_measure(trained_decoder, moved, [4, 8]) != first
    assert len(list(cache.glob("latency-*.json"))) == 3
    # a file under the right name whose key differs is measured afresh and replaced, not misread
    stored["key"]["host"] = "elsewhere"
    files[0].write_text(json.dumps(stored))
    again = load_or_measure(trained_decoder, cfg, [4, 8])
    assert again != first and json.loads(files[0].read_text())["latency_model"] == again.to_dict()
    # an old-format file (the two-fit model's dict, fit "linear") under the right key is read: the same timings
    old = {"key": json.loads(files[0].read_text())["key"], "latency_model": {**first.to_dict(), "fit": "linear"}}
    files[0].write_text(json.dumps(old, indent=2))
    assert load_or_measure(trained_decoder, cfg, [4, 8]) == first
    # no cache: measured every time
    fresh = load_or_measure(trained_decoder, config(tmp_path, tiny, cache=None), [4, 8])
    assert fresh != first and len(list(cache.glob("latency-*.json"))) == 3


def test_measure_on_a_tiny_model(trained_decoder):
    model = steps.measure(trained_decoder, [4, 8], [8, 32], repeats=1, temperature=0.5)
    assert model.block_sizes == list(range(1, 9)) and model.context_buckets == [8, 32]  # every width up to the largest B
    assert set(model.draft_points) == set(range(2, 9)) and set(model.verify_points) == set(range(1, 9))
    curve = [model.verify_ms(q, 20) for q in range(1, 9)]
    assert curve == sorted(curve) and curve[0] > 0
    points = [*model.verify_points.values(), *model.draft_points.values()]
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in points)
    assert model.noise_ms > 0 and model.info["device"] == "cpu"
    with pytest.raises(ValueError, match="context_buckets"):
        steps.measure(trained_decoder, [4], [10_000])
    with pytest.raises(ValueError, match="repeats"):
        steps.measure(trained_decoder, [4], [8], repeats=0)


def test_the_report_draws_the_curve_the_policy_reads():
    """eval's verify_width.png draws the fitted, monotone curve (issue 23: it drew the raw points, L=64 1 token 23.6 ms
    above 2 tokens 16.5 ms), with the measured points beside it."""
    from pipeline.evaluation.report import verify_width_figure

    model = bumpy_model()
    results = {"verify_width": {"latency_model": model.to_dict(), "block_size": 4, "reliability": []},
               "methods": {"verify_width": {"rows": [{"confidences": [0.5], "verify_widths": [1]}]}}}
    curve_axis = verify_width_figure(results).axes[2]
    fitted, measured = curve_axis.lines[0], curve_axis.lines[1]
    assert list(fitted.get_ydata()) == pytest.approx([10, 11, 19, 19, 19])
    assert list(measured.get_ydata()) == [10, 11, 30, 13, 14]
    assert curve_axis.lines[2].get_ydata()[0] == pytest.approx(model.draft_ms(4, 100))


def test_a_missing_file_names_the_setting_that_named_it(tmp_path, tiny):
    cfg = config(tmp_path, tiny)
    cfg.eval.verify_width.latency.path = str(tmp_path / "none.json")
    with pytest.raises(FileNotFoundError, match=r"eval\.verify_width\.latency\.path"):
        load_or_measure(None, cfg, [4], "eval.verify_width.latency")
    with pytest.raises(FileNotFoundError, match=r"serve\.latency_path"):
        load_or_measure(None, cfg, [4], path=tmp_path / "none.json", path_setting="serve.latency_path")


# -- a noisy minute cannot spoil the model (issue 33) ----------------------------------------------------------------
class FakeClock:
    """A clock that advances by each point's cost, plus 500 ms on the runs of a point listed in ``spikes[name]``
    (1-based, the warm-up run included)."""

    def __init__(self):
        self.t, self.runs, self.spikes, self.cost = 0.0, {}, {}, {}

    def run(self, name):
        def point():
            self.runs[name] = self.runs.get(name, 0) + 1
            self.t += self.cost[name] / 1e3 + (0.5 if self.runs[name] in self.spikes.get(name, ()) else 0.0)
        return point

    def __call__(self):
        return self.t


def test_the_one_store_keys_by_kind_and_host_and_refuses_another_key(tmp_path, monkeypatch, caplog):
    import torch  # noqa: F401  (loaded: the host's identity names torch's threads and version)

    monkeypatch.delenv(store.CACHE_ENV, raising=False)
    from pipeline import DATA_DIR

    assert store.default_dir() == DATA_DIR / "cache" / "costs"
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert store.default_dir() == tmp_path / "elsewhere"
    key = store.key("limits", read_mb=512)
    assert key["kind"] == "limits" and key["read_mb"] == 512 and key["version"] == store.VERSION
    assert key["host"]["cpu"] == store.cpu_name() and key["host"]["threads"] == torch.get_num_threads()
    assert key["host"]["torch"] == torch.__version__
    path = store.path_of(tmp_path, key)
    assert path.parent == tmp_path and path.name.startswith("limits-") and path.suffix == ".json"
    assert store.path_of(tmp_path, store.key("limits", read_mb=256)) != path
    calls = []
    measure = lambda: calls.append(1) or {"gb_s": 3.0}  # noqa: E731
    assert store.cached(tmp_path, key, "limits", measure) == {"gb_s": 3.0}
    assert store.cached(tmp_path, key, "limits", measure) == {"gb_s": 3.0} and len(calls) == 1  # reused
    assert store.cached(tmp_path, key, "limits", measure, check=lambda d: "stale") == {"gb_s": 3.0} and len(calls) == 2
    assert store.get(tmp_path, key, "limits") == {"gb_s": 3.0} and store.get(tmp_path, key, "other") is None
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "key": {**stored["key"], "host": "elsewhere"}}))
    with caplog.at_level(logging.WARNING, logger="pipeline.costs.store"):
        assert store.get(tmp_path, key, "limits") is None  # a file under the right name with another key
    assert "holds no measurement" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written atomically: no temporary file left


def test_the_timer_interleaves_points_and_keeps_the_least_sample_and_the_spread():
    clock = FakeClock()
    clock.cost = {"a": 10.0, "b": 20.0}
    clock.spikes = {"a": {2, 3}, "b": {2}}  # a's first two timed runs, b's first (run 1 is the warm-up)
    timings = time_points({"a": clock.run("a"), "b": clock.run("b")}, rounds=4, clock=clock)
    assert timings["a"].ms == pytest.approx(10.0) and timings["b"].ms == pytest.approx(20.0)
    assert len(timings["a"].samples) == 4 and max(timings["a"].samples) == pytest.approx(510.0)
    assert timings["a"].spread > 0 and Timing([5.0, 5.0]).spread == 0
    with pytest.raises(ValueError, match="rounds"):
        time_points({"a": clock.run("a")}, rounds=0, clock=clock)


def test_warm_runs_precede_each_timed_run_untimed():
    """A point whose first run after another point is slow (its weights cold) is timed on its run after a warm one."""
    clock, last = FakeClock(), []

    def run(name, cost):
        def point():
            clock.t += (cost if last and last[-1] == name else 3 * cost) / 1e3  # 3x when another point ran before
            last.append(name)
        return point

    points = {"a": run("a", 10.0), "b": run("b", 20.0), "c": run("c", 5.0)}  # rotated: never the same point twice
    cold = time_points(points, rounds=3, clock=clock)
    assert cold["a"].ms == pytest.approx(30.0) and cold["b"].ms == pytest.approx(60.0)
    last.clear()
    warm = time_points(points, rounds=3, clock=clock, warm=1)
    assert warm["a"].ms == pytest.approx(10.0) and warm["b"].ms == pytest.approx(20.0)
    assert len(warm["a"].samples) == 3 and last.count("a") == 2 * (3 + 1)  # one warm run before each run, warm-up too
    with pytest.raises(ValueError, match="warm"):
        time_points(points, rounds=1, clock=clock, warm=-1)


def test_observed_costs_correct_each_row_count_by_its_observed_ratio():
    obs = ObservedCosts(weight=0.5, min_samples=2, clip=2.0)
    modelled = [6.0, 6.5, 7.5, 8.0]  # rows 1..4
    assert obs.correct(modelled) == modelled  # nothing observed: as modelled
    for _ in range(2):
        obs.observe(1, 6.0, 5.4)  # a plain step runs 0.9x the model
        obs.observe(2, 6.5, 7.8)  # a second row costs more than modelled: 1.2x
    obs.observe(3, 7.5, 7.5)  # one sample: below min_samples, not used yet
    assert obs.ratio(1) == pytest.approx(0.9) and obs.ratio(2) == pytest.approx(1.2) and obs.ratio(3) is None
    corrected = obs.correct(modelled)
    assert corrected[:2] == pytest.approx([5.4, 7.8])
    assert corrected[2] == pytest.approx(7.8) and corrected[3] == pytest.approx(8.0)  # kept non-decreasing in rows
    obs.observe(1, 6.0, 600.0)  # a step another process held: clipped to 2x, weighted 0.5 after min_samples
    assert obs.ratio(1) == pytest.approx((0.9 * 2.0) ** 0.5)
    obs.observe(5, 0.0, 3.0)  # no modelled time: ignored
    assert 5 not in obs.summary() and obs.summary()[2] == (2, 1.2)
    with pytest.raises(ValueError, match="ObservedCosts"):
        ObservedCosts(weight=0.0)


def test_observed_row_cost_is_the_least_squares_slope_of_the_batched_steps():
    """ms = a + b rows + c requests: the fit recovers b from steps whose drafted rows vary (numpy's lstsq as the
    reference), none before evidence, and keeps its last fit while a batch drafts nothing."""
    import numpy as np

    from pipeline.costs.monitor import ObservedRowCost

    rng = np.random.default_rng(0)
    steps = [(n + int(rng.integers(0, 9)), n) for n in rng.integers(4, 17, size=64).tolist()]
    ms = [3.0 + 0.93 * r + 0.41 * n + float(rng.normal(0, 0.2)) for r, n in steps]
    rc = ObservedRowCost(window=64, refit=8)
    for (r, n), m in list(zip(steps, ms))[:8]:
        rc.observe(r, n, m)
    assert rc.per_row() is None  # 8 steps: not yet fitted on 16
    for (r, n), m in list(zip(steps, ms))[8:]:
        rc.observe(r, n, m)
    x = np.array([[1.0, r, n] for r, n in steps])
    reference = np.linalg.lstsq(x, np.array(ms), rcond=None)[0][1]
    assert rc.per_row() == pytest.approx(reference, rel=1e-9) and rc.per_row() == pytest.approx(0.93, abs=0.05)
    for _ in range(128):  # plain steps only (a batch that drafts nothing): once the window holds no spread, no refit
        rc.observe(16, 16, 3.0 + 1.34 * 16)
    last = rc.per_row()
    assert last == pytest.approx(0.93, abs=0.05)
    rc.observe(16, 16, 99.0)
    assert rc.per_row() == last
    rc.observe(0, 16, 5.0)  # nothing verified: ignored
    with pytest.raises(ValueError, match="ObservedRowCost"):
        ObservedRowCost(window=4)


def test_the_shape_check_finds_a_noisy_point_and_retiming_it_resolves_it():
    assert suspect_points({1: [67.0, 38.0, 40.0], 2: [70.0, 41.0, 43.0]}) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert suspect_points({1: [10.0], 2: [30.0], 3: [12.0]}) == {(2, 0), (3, 0)}
    assert suspect_points({1: [10.0, 11.0], 2: [10.5, 12.0]}) == set()  # within the tolerance
    clock = FakeClock()
    clock.cost = {(1, 64): 25.0, (1, 256): 27.0, (2, 64): 30.0, (2, 256): 32.0}
    points = {name: clock.run(name) for name in clock.cost}
    clock.spikes = {(1, 64): {1, 2, 3, 4}}  # every run of (1, 64) in the measurement: a noisy minute on it
    timings = time_points(points, rounds=3, clock=clock)
    assert timings[(1, 64)].ms > 400

    def suspects():
        table = {w: [timings[(w, 64)].ms, timings[(w, 256)].ms] for w in (1, 2)}
        return {(w, (64, 256)[j]) for w, j in suspect_points(table)}

    check = retime(points, timings, suspects, rounds=3, clock=clock, sleep=lambda s: None)
    assert timings[(1, 64)].ms == pytest.approx(25.0) and check["unresolved"] == []
    assert "(1, 64)" in check["retimed"]


def test_the_monitor_asks_once_for_a_new_measurement_when_the_machine_runs_faster_than_the_model(caplog):
    monitor = DriftMonitor("test costs", tolerance=1.3, window=6, min_samples=3)
    assert [monitor.observe(100.0, 98.0) for _ in range(5)] == [None] * 5  # agrees
    verdicts = [monitor.observe(100.0, 50.0) for _ in range(6)]  # the model reads twice the machine's time
    assert verdicts.count("remeasure") == 1 and monitor.remeasured == 1
    with caplog.at_level(logging.WARNING, logger="pipeline.costs.monitor"):
        slow = [DriftMonitor("slow", 1.3, 4, 2).observe(10.0, 20.0) for _ in range(1)]
        monitor2 = DriftMonitor("slow", 1.3, 4, 2)
        verdicts = [monitor2.observe(10.0, 20.0) for _ in range(5)]  # slower than modelled: kept, said once
    assert slow == [None] and verdicts == [None] * 5 and caplog.text.count("slower than the cost model") == 1
    assert monitor.observe(0.0, 5.0) is None  # no modelled time: ignored
    with pytest.raises(ValueError):
        DriftMonitor("x", tolerance=1.0)


def test_a_cache_measured_under_load_is_refused_and_measured_again(tmp_path, tiny, trained_decoder, caplog,
                                                                   steady_clock):
    """A cached model whose points read far slower than the machine now (a noisy minute, kept for good) is refused by
    the spot check and measured again; a model that agrees is reused. Timed on the steady clock (conftest), so the
    machine's own load cannot make a verdict."""
    cfg = config(tmp_path, tiny, spot_check=True)
    load_or_measure(trained_decoder, cfg, [4])
    (path,) = (tmp_path / "cache").glob("latency-*.json")
    stored = json.loads(path.read_text())
    inflated = CostModel.from_dict(stored["latency_model"])
    inflated.verify_points = {w: [v * 50 + 10 for v in row] for w, row in inflated.verify_points.items()}
    path.write_text(json.dumps({**stored, "latency_model": inflated.to_dict()}))
    assert "other work shared the cores" in steps.spot_check(trained_decoder, inflated)
    with caplog.at_level(logging.WARNING, logger="pipeline.costs.store"):
        again = load_or_measure(trained_decoder, cfg, [4])
    assert "refusing" in caplog.text and again != inflated
    assert json.loads(path.read_text())["latency_model"] == again.to_dict()
    assert load_or_measure(trained_decoder, cfg, [4]) == again  # the new model agrees with the machine: reused
    assert again.spread and set(again.spread) == {"verify", "draft", "prefill"} and "check" in again.info


def test_remeasure_updates_the_model_every_schedule_holds(tmp_path, tiny, trained_decoder, steady_clock):
    cfg = config(tmp_path, tiny)
    held = load_or_measure(trained_decoder, cfg, [4])
    held.verify_points = {w: [v * 100 for v in row] for w, row in held.verify_points.items()}
    held._curves.clear()
    before = held.verify_ms(1, 8)
    fresh = steps.remeasure(trained_decoder, cfg, [4], "label.latency", into=held)
    assert fresh is held and held.verify_ms(1, 8) < before / 10
    (path,) = (tmp_path / "cache").glob("latency-*.json")
    assert json.loads(path.read_text())["latency_model"] == held.to_dict()
