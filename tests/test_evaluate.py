"""The eval stage end to end on a tiny target + trained tiny drafter: every method, losslessness, the oracle
bound, best_fixed from the train split, per-set blocks, the report, and the basic ar/fixed usage."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).parent))
from pipeline.policy.registry import METHODS  # noqa: E402
from policy_fixtures import ALL_METHODS, CANDIDATES, RUN, build_tiny_run, tiny_overrides  # noqa: E402

from pipeline import PROJECT_ROOT  # noqa: E402
from pipeline.decoding import DecodeConfig  # noqa: E402
from pipeline.policy.data import read_label_table, split_prompt_ids  # noqa: E402
from pipeline.evaluate import evaluate, load_eval_inputs, oracle_gain_share  # noqa: E402
from pipeline.decoding.build import build_decoder  # noqa: E402
from pipeline.policy import load_predictor  # noqa: E402
from pipeline.prompts import chat_input_ids, load_prompt_sets  # noqa: E402
from pipeline.evaluation.report import confusion_counts, markdown_table, request_count  # noqa: E402

CONF = str(PROJECT_ROOT / "conf")


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory) -> dict:
    """labels -> dataset -> train -> eval of every method on the session's tiny target + trained drafter (built once)."""
    return build_tiny_run(tmp_path_factory.getbasetemp() / "policy-run", tiny.target_dir("llama"), tiny.drafter_dir("llama", "trained"))


@pytest.fixture(scope="module")
def results(run) -> dict:
    return json.loads(Path(run["results"]).read_text())


@pytest.fixture(scope="module")
def labels(run) -> pd.DataFrame:
    return read_label_table(run["labels"])[0]


def eval_cfg(run: dict, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("evaluate", overrides=tiny_overrides(run) + list(overrides))


def test_evaluate_config_composes():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("evaluate", overrides=["run_name=r3"])
    assert list(cfg.eval.methods) == ["ar", "fixed"] and cfg.eval.split == "auto"
    assert cfg.eval.labels_dir.endswith("/labels/r3") and cfg.eval.features_dir.endswith("/features/r3/topk")
    assert cfg.eval.predictor_dir.endswith("/predictors/r3")
    assert cfg.policy.blockpilot.predictor == "mlp" and cfg.policy.full_vocab.predictor == "full_vocab"  # conf/policy/
    assert cfg.eval.out.endswith("/eval/r3/results.json") and cfg.logger.group == "r3"


def test_every_method_is_lossless_on_the_test_split(run, results):
    test_ids = split_prompt_ids(Path(run["data"]) / "features" / RUN / "topk")["test"]
    assert results["split"] == "test"
    assert list(results["methods"]) == ALL_METHODS
    for method, r in results["methods"].items():
        assert r["lossless"] == 1.0 and r["exact_matches"] == r["n_prompts"], method
        assert sorted(row["id"] for row in r["rows"]) == sorted(test_ids), method
        assert all(row["chosen_bs"] and row["chosen_bs"][0] == row["chosen_b"] for row in r["rows"]), method
        for key in ("tau", "tokens_per_s", "speedup", "tpot_ms", "n_prompts", "new_tokens", "decode_ms", "schedule_ms",
                    "overhead_ms", "overhead_pct", "oracle_gain_share", "oracle_gain_share_ci"):
            assert key in r, (method, key)
    assert results["methods"]["ar"]["tau"] == 1.0 and results["methods"]["ar"]["speedup"] == 1.0
    assert results["methods"]["fixed"]["tau"] > 1.0  # the trained tiny drafter gets drafts accepted


def test_oracle_uses_labels_and_bounds_fixed(results, labels):
    methods = results["methods"]
    label_of = dict(zip(labels["id"], labels["label_tau"]))
    assert all(row["chosen_b"] == label_of[row["id"]] for row in methods["oracle"]["rows"])
    assert all(row["chosen_b"] == 8 for row in methods["fixed"]["rows"])  # the drafter's training block size
    # per prompt and overall, the oracle's B (argmax of the recorded tau) is at least as good as any fixed B
    for method in ("fixed", "best_fixed", "ema", "blockpilot", "full_vocab"):
        assert methods["oracle"]["tau"] >= methods[method]["tau"] - 1e-9, method
    fixed = {r["id"]: r["tau"] for r in methods["fixed"]["rows"]}
    assert all(r["tau"] >= fixed[r["id"]] - 1e-9 for r in methods["oracle"]["rows"])
    # the label stage's tau at the oracle's B is what the eval measured (same decoder, T=0)
    tau_of = {r["id"]: dict(zip(r["candidates"], r["tau"])) for _, r in labels.iterrows()}
    for row in methods["oracle"]["rows"]:
        assert row["tau"] == pytest.approx(tau_of[row["id"]][row["chosen_b"]], rel=1e-9)


def test_best_fixed_is_the_train_splits_best_candidate(run, results, labels):
    train_ids = set(split_prompt_ids(Path(run["data"]) / "features" / RUN / "topk")["train"])
    mean = np.mean([t for i, t in zip(labels["id"], labels["tau"]) if i in train_ids], axis=0)
    best = CANDIDATES[int(np.argmax(mean))]
    assert {row["chosen_b"] for row in results["methods"]["best_fixed"]["rows"]} == {best}


def test_predictor_methods_pick_what_the_predictor_says(run, results):
    decoder = build_decoder(eval_cfg(run).model)
    prompts = {p.id: p for p in load_prompt_sets(run["sets"])}
    for method, name in (("blockpilot", "mlp"), ("full_vocab", "full_vocab")):
        predictor = load_predictor(Path(run["data"]) / "predictors" / RUN / name)
        for row in results["methods"][method]["rows"]:
            ids = chat_input_ids(decoder.target.tokenizer, prompts[row["id"]].turns)
            logits = decoder.prefill(ids, DecodeConfig(16)).last_logits
            assert row["chosen_b"] == predictor.predict(logits)
        r = results["methods"][method]
        assert r["overhead_ms"] > 0 and r["overhead_pct"] == pytest.approx(100 * r["schedule_ms"] / r["decode_ms"])
    assert results["predictors"]["blockpilot"]["arch"] == "mlp" and results["predictors"]["full_vocab"]["arch"] == "full_vocab"


def test_oracle_gain_share_and_per_set_blocks(results):
    methods = results["methods"]
    tau = {m: methods[m]["tau"] for m in methods}
    gain = tau["oracle"] - tau["fixed"]
    assert gain > 0.05  # the fixture's prompts gain from B != 8, so the share is defined
    for m in methods:
        share, ci = methods[m]["oracle_gain_share"], methods[m]["oracle_gain_share_ci"]
        if not METHODS[m].gain_share:  # no per-request B (the method table says so): no share
            assert share is None and ci == [None, None]
            continue
        assert share == pytest.approx((tau[m] - tau["fixed"]) / gain)
        assert ci[0] <= share + 1e-9 and share - 1e-9 <= ci[1], (m, share, ci)
    assert methods["fixed"]["oracle_gain_share"] == 0.0 and methods["oracle"]["oracle_gain_share"] == pytest.approx(1.0)
    assert methods["ar"]["tau"] < methods["fixed"]["tau"]  # B=1 is worse than the fixed block (ar itself has no share)
    assert sorted(results["per_set"]) == ["code", "math"]
    for name, block in results["per_set"].items():
        assert list(block) == ALL_METHODS
        n = block["ar"]["n_prompts"]
        assert n == sum(r["source_set"] == name for r in methods["ar"]["rows"]) and n > 0
        assert block["ar"]["speedup"] == 1.0 and all(block[m]["lossless"] == 1.0 for m in block)
        assert block["oracle"]["tau"] >= block["fixed"]["tau"] - 1e-9
        rows = [r for r in methods["blockpilot"]["rows"] if r["source_set"] == name]
        steps = sum(r["steps"] for r in rows)
        assert block["blockpilot"]["tau"] == pytest.approx(sum(r["tau"] * r["steps"] for r in rows) / steps)
    total = sum(block["fixed"]["n_prompts"] for block in results["per_set"].values())
    assert total == methods["fixed"]["n_prompts"]


def test_oracle_gain_share_bootstrap_by_hand():
    def rows(taus, steps):
        return [{"id": f"p{i}", "tau": t, "steps": s} for i, (t, s) in enumerate(zip(taus, steps))]

    data = {"fixed": rows([2.0, 2.0], [10, 10]), "oracle": rows([4.0, 3.0], [5, 10]), "m": rows([3.0, 2.0], [5, 10])}
    # tau = accepted / steps: fixed 40/20 = 2, oracle (20+30)/15 = 3.33, m (15+20)/15 = 2.33
    share, ci = oracle_gain_share(data, "m", samples=500, seed=0)
    assert share == pytest.approx((35 / 15 - 2.0) / (50 / 15 - 2.0))
    # resamples: both prompts (0.25, as above), p0 twice (1 / 2 = 0.5), p1 twice (0 / 1 = 0)
    assert ci == pytest.approx([0.0, 0.5])
    assert oracle_gain_share({"fixed": rows([2.0], [5]), "oracle": rows([2.0], [5]), "m": rows([2.0], [5])}, "m") == (None, [None, None])


def test_report_files_and_table(run, results):
    out = Path(run["results"]).parent
    for name in ("results.md", "speedup.png", "tau_curves.png", "optimal_b_hist.png", "confusion_blockpilot.png",
                 "confusion_full_vocab.png"):
        assert (out / name).stat().st_size > 500, name
    table = (out / "results.md").read_text()
    assert table == markdown_table(results)
    for m in ALL_METHODS:
        assert f"| {m} |" in table or f"| {m} † |" in table  # † marks rows of fewer than 10 requests
    assert "Source set `code`" in table and "Source set `math`" in table
    # the verify-width headroom: modelled from the labels' replays of the evaluated requests, with the run's latency model
    bound = results["verify_width"]["bound"]
    assert bound["block_size"] == 8 and bound["all"]["requests"] == request_count(results["methods"]["ar"]["rows"])
    assert bound["all"]["foresight"] >= bound["all"]["foresight_drafting"] > 0
    assert bound["all"]["foresight_drafting"] >= bound["all"]["fixed"] * (1 - 1e-9)  # never more drafts verified than B-1
    assert sorted(bound["per_set"]) == ["code", "math"] and "## Verify-width headroom (B=8, modelled)" in table
    counts = confusion_counts([2, 6, 6, 9], [2, 6, 4, 2], [2, 4, 6])
    assert counts.tolist() == [[1, 0, 0], [0, 0, 1], [0, 0, 1]]


def test_missing_artifacts_name_the_stage(run, tmp_path):
    decoder = None
    cases = [
        (["eval.methods=[ar,oracle]", f"eval.labels_dir={tmp_path}/none"], "make label"),
        (["eval.methods=[ar,best_fixed]", f"eval.features_dir={tmp_path}/none"], "make dataset"),
        (["eval.methods=[ar,blockpilot]", f"eval.predictor_dir={tmp_path}/none"], "make train"),
        (["eval.methods=[ar,full_vocab]", f"eval.predictor_dir={tmp_path}/none"], "predictor=full_vocab"),
    ]
    for overrides, stage in cases:
        cfg = eval_cfg(run, *overrides)
        with pytest.raises(FileNotFoundError, match=stage):
            load_eval_inputs(cfg, list(cfg.eval.methods), decoder)
    cfg = eval_cfg(run, "eval.methods=[ar,beam]", "eval.split=all", "data.limit=1")
    with pytest.raises(ValueError, match="unknown eval.methods"):
        evaluate(cfg, build_decoder(cfg.model))


def run_cli(monkeypatch, *args: str) -> None:
    """``python -m pipeline.evaluate <args>`` in this process (Hydra's real command-line path, no re-import).

    Imported, not run as ``__main__``, Hydra would look for a ``conf`` module: the config dir is passed explicitly.
    """
    from pipeline.evaluate import main

    monkeypatch.setattr(sys, "argv", ["pipeline.evaluate", f"--config-path={CONF}", *args])
    main()


def test_cli_basic_usage_without_labels(run, tmp_path, monkeypatch):
    """The documented basic usage: ar/fixed with no labels, dataset or predictor anywhere."""
    basic = tmp_path / "basic.json"
    run_cli(monkeypatch, "data=humaneval", "data.limit=1", "decode.max_new_tokens=6", "decode.block_size=3",
            "eval.methods=[ar,fixed]", f"eval.out={basic}", f"model.target={run['target']}", f"model.drafter={run['drafter']}",
            f"paths.data={tmp_path}/data", "logger.enabled=false", "eval.warmup=false")
    res = json.loads(basic.read_text())
    assert set(res["methods"]) == {"ar", "fixed"} and res["split"] is None and res["methods"]["ar"]["n_prompts"] == 1
    assert res["methods"]["fixed"]["lossless"] == 1.0 and res["methods"]["fixed"]["oracle_gain_share"] is None
    assert {r["chosen_b"] for r in res["methods"]["fixed"]["rows"]} == {3}
    assert res["methods"]["fixed"]["rows"][0]["id"] == "HumanEval/0"
    assert (tmp_path / "basic.md").exists() and (tmp_path / "speedup.png").exists()
    assert not (tmp_path / "tau_curves.png").exists()  # no labels, no label figures


def test_cli_full_run_logs_to_wandb_offline(run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    full = tmp_path / "full" / "results.json"
    run_cli(monkeypatch, *[o for o in tiny_overrides(run) if o != "logger.enabled=false"],
            f"eval.methods=[{','.join(ALL_METHODS)}]", f"eval.out={full}", "logger.enabled=true",
            f"logger.dir={tmp_path}/wandb", "eval.bootstrap.samples=200")
    res = json.loads(full.read_text())
    assert list(res["methods"]) == ALL_METHODS and all(r["lossless"] == 1.0 for r in res["methods"].values())
    assert (full.parent / "confusion_blockpilot.png").exists() and (full.parent / "results.md").exists()
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    media = list(runs[0].rglob("*.png"))
    assert len(media) >= 5, media  # the figures, logged as wandb.Image
    assert list(runs[0].rglob("*.table.json"))  # the results, logged as a wandb.Table
    assert "bound" in res["verify_width"]  # logged as summary scalars (all/verify_width_bound/...)


def test_shared_decodes_equal_separate_decodes(tiny):
    """A (request, B) decode shared between methods gives exactly what decoding it again gives; adaptive
    schedules and other B are decoded on their own; prefill and schedule times stay per request."""
    from pipeline.decoding import EMASchedule, FixedSchedule
    from pipeline.evaluation.runs import SharedDecodes
    from pipeline.models.drafter import DFlashDrafter
    from pipeline.models.target import load_target
    from pipeline.decoding.speculative import SpeculativeDecoder

    decoder = SpeculativeDecoder(load_target(tiny.target_dir("llama")), DFlashDrafter.from_pretrained(tiny.drafter_dir("llama", "trained")))
    ids = chat_input_ids(decoder.target.tokenizer, ["def add(a, b):"])
    for temperature in (0.0, 1.0):
        config = DecodeConfig(24, temperature, 3)
        shared = SharedDecodes(decoder)
        first = shared.generate(ids, FixedSchedule(4), config)
        again = shared.generate(ids, FixedSchedule(4), config)
        assert (shared.decodes, shared.reused) == (1, 1)
        fresh = decoder.generate(ids, 4, config)
        for stats in (first, again):
            assert stats.output_ids == fresh.output_ids and stats.taus == fresh.taus and stats.block_sizes == fresh.block_sizes
        assert again.prefill_ms != first.prefill_ms or again.schedule_ms != first.schedule_ms  # measured per request
        again.output_ids.append(-1)  # a caller's edit does not reach the stored decode
        assert shared.generate(ids, FixedSchedule(4), config).output_ids == fresh.output_ids
        other = shared.generate(ids, FixedSchedule(6), config)
        assert other.block_sizes[0] == 6 and other.output_ids == fresh.output_ids  # lossless: same text for any B
        ema = shared.generate(ids, EMASchedule([2, 4, 6]), config)
        assert ema.output_ids == fresh.output_ids
        assert (shared.decodes, shared.reused) == (3, 2)


def test_oracle_picks_each_turns_own_label():
    """Every turn of a multi-turn prompt is a request with its own label; labels of first turns only fall back."""
    from types import SimpleNamespace

    from pipeline.evaluate import EvalInputs, method_schedules
    from pipeline.prompts import Prompt

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("evaluate")
    decoder = SimpleNamespace(drafter=SimpleNamespace(block_size=8), check_block_size=lambda b: None)
    chat = Prompt("chat-1", ["first", "second"], "chat")

    def oracle_bs(ids, label_taus):
        labels = pd.DataFrame({"id": ids, "label_tau": label_taus, "candidates": [[6, 8, 10]] * len(ids)})
        make = method_schedules(cfg, decoder, EvalInputs(labels=labels))["oracle"].bind(chat)
        return [make().block_size for _ in chat.turns]

    assert oracle_bs(["chat-1", "chat-1#turn2"], [6, 10]) == [6, 10]
    assert oracle_bs(["chat-1"], [6]) == [6, 6]
    with pytest.raises(ValueError, match="no label"):
        oracle_bs(["other"], [8])


# ------------------------------------------------------------------------------------------------
# issue 15: a prompt too long for the context, per-prompt rows and resume, the exact-match rate
# ------------------------------------------------------------------------------------------------
def _small_eval_cfg(tiny, tmp_path, *overrides):
    prompts = tmp_path / "p.jsonl"
    too_long = "The quick brown fox jumps over the lazy dog. " * 120  # beyond the tiny target's 512 positions
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "turns": ["def add(a, b):"]}, {"id": "long", "turns": [too_long]},
        {"id": "c", "turns": ["Natalia sold clips", "and then?"]}]))
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("evaluate", [
            f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
            "logger.enabled=false", f"paths.data={tmp_path}", f"data.sets=[{{name: mine, source: '{prompts}'}}]",
            "decode.max_new_tokens=12", "eval.methods=[ar,fixed]", "eval.warmup=true", *overrides])


def _outcome(results: dict) -> dict:
    """Everything in a results dict that does not depend on timing."""
    return {m: [(r["id"], r["new_tokens"], r["steps"], r["tau"], r["chosen_bs"]) for r in block["rows"]]
            for m, block in results["methods"].items()} | {"skipped": [s["id"] for s in results["skipped"]]}


def test_eval_skips_a_prompt_beyond_the_context_and_resumes_from_its_rows(tiny, tmp_path, monkeypatch, caplog):
    """Item 2: one prompt longer than the context used to fail the whole eval (after decoding the others), unnamed,
    and nothing was written until the end; now it is skipped and named, rows are appended per prompt, and a
    killed run resumes where it stopped (a line cut by the kill is dropped)."""
    import pipeline.evaluation.runs as ev

    decoder = tiny.decoder("llama", "trained")
    cfg = _small_eval_cfg(tiny, tmp_path)
    with caplog.at_level("WARNING", logger="pipeline.evaluation.runs"):
        clean = evaluate(cfg, decoder)
    assert [s["id"] for s in clean["skipped"]] == ["long"] and "exceeds the target's context" in clean["skipped"][0]["reason"]
    assert any("'long'" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert [r["id"] for r in clean["methods"]["fixed"]["rows"]] == ["a", "c"] and clean["methods"]["fixed"]["lossless"] == 1.0

    rows = tmp_path / "eval" / "rows.jsonl"
    real, calls = ev.decode_prompt, []

    def killed_at_the_last_prompt(runner, prompt, *args):
        calls.append(prompt.id)
        if prompt.id == "c" and runner.share:  # the run, not its warmup
            raise KeyboardInterrupt("simulated kill")
        return real(runner, prompt, *args)

    monkeypatch.setattr(ev, "decode_prompt", killed_at_the_last_prompt)
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg, decoder, rows_path=rows)
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [e.get("id") for e in written] == [None, "a", "long"] and "skipped" in written[2]  # kept as it went
    with rows.open("a") as f:
        f.write('{"id": "c", "rows": {"ar": {"id"')  # a line cut by the kill
    calls.clear()
    monkeypatch.setattr(ev, "decode_prompt", lambda runner, prompt, *args: calls.append(prompt.id) or real(runner, prompt, *args))
    resumed = evaluate(cfg, decoder, rows_path=rows)
    assert set(calls) == {"c"}  # warmup and decodes of the remaining prompt only
    assert _outcome(resumed) == _outcome(clean)
    assert len(rows.read_text().splitlines()) == 4  # header + a, long, c
    calls.clear()
    assert _outcome(evaluate(cfg, decoder, rows_path=rows)) == _outcome(clean) and calls == []  # all done: no decode
    other = evaluate(_small_eval_cfg(tiny, tmp_path, "decode.max_new_tokens=8"), decoder, rows_path=rows)
    assert (tmp_path / "eval" / "rows.jsonl.old").exists() and "c" in calls  # other settings: decoded afresh
    assert other["methods"]["ar"]["new_tokens"] < clean["methods"]["ar"]["new_tokens"]
    weights = tiny.drafter_dir("llama", "trained") / "model.safetensors"  # a drafter retrained in place
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    calls.clear()
    evaluate(_small_eval_cfg(tiny, tmp_path, "decode.max_new_tokens=8"), decoder, rows_path=rows)
    assert "a" in calls and "c" in calls  # its rows were not reused


def test_lossless_is_the_exact_match_rate_against_ar():
    """Item 10: ``lossless`` was a bare ``all(...)``; it is now the fraction of prompts token-identical to ar."""
    from pipeline.evaluate import summarize

    def row(i, out):
        return {"id": f"p{i}", "steps": 2, "tau": 1.5, "new_tokens": 3, "prefill_ms": 1.0, "schedule_ms": 0.0,
                "decode_ms": 2.0, "output_ids": out}

    reference = {f"p{i}": [1, 2, 3] for i in range(4)}
    summary = summarize([row(0, [1, 2, 3]), row(1, [1, 2, 4]), row(2, [1, 2, 3]), row(3, [1, 2, 3])], reference)
    assert summary["lossless"] == 0.75 and summary["exact_matches"] == 3
    assert summarize([row(0, [1, 2, 3])], reference)["lossless"] == 1.0


def test_transformers_generate_baselines_equal_ar_through_the_eval_stage(tiny, tmp_path):
    """Issue 23 item 1: transformers' own ``model.generate`` (greedy) and its prompt-lookup decoding are eval methods;
    at T=0 their text is token-identical to ``ar``'s on the tiny target, they are timed like every method, and they get
    no oracle gain share. At T=1 they sample with transformers' sampler: the run reports their exact-match rate."""
    cfg = _small_eval_cfg(tiny, tmp_path, "eval.methods=[ar,hf_generate,hf_prompt_lookup]", "eval.warmup=false")
    results = evaluate(cfg, tiny.decoder("llama", "trained"))
    for m in ("hf_generate", "hf_prompt_lookup"):
        r = results["methods"][m]
        assert r["lossless"] == 1.0 and r["exact_matches"] == 2 and r["new_tokens"] == results["methods"]["ar"]["new_tokens"], m
        assert r["tokens_per_s"] > 0 and r["oracle_gain_share"] is None and r["oracle_gain_share_ci"] == [None, None]
        assert all(row["prefill_ms"] > 0 and row["decode_ms"] > 0 for row in r["rows"])
    assert results["methods"]["hf_generate"]["tau"] == 1.0  # one token per forward
    qwen = _small_eval_cfg(tiny, tmp_path, "eval.methods=[ar,hf_generate]", "eval.warmup=false",
                           f"model.target={tiny.target_dir('qwen3')}", "model.drafter=null")
    assert evaluate(qwen)["methods"]["hf_generate"]["lossless"] == 1.0  # the other tiny target, through the stage's own load
    sampled = evaluate(_small_eval_cfg(tiny, tmp_path, "eval.methods=[ar,hf_generate]", "eval.warmup=false",
                                       "decode.temperature=1.0"), tiny.decoder("llama", "trained"))
    assert 0.0 <= sampled["methods"]["hf_generate"]["lossless"] <= 1.0 and sampled["methods"]["hf_generate"]["n_prompts"] == 2


def test_a_broken_prompt_file_fails_before_any_model_loads(tiny, tmp_path, monkeypatch):
    """Issue 23 item 4: a broken JSONL line used to be reported only after the target loaded."""
    import pipeline.evaluation.runs as runs

    monkeypatch.setattr(runs, "build_decoder", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded first")))
    cfg = _small_eval_cfg(tiny, tmp_path)
    Path(cfg.data.sets[0].source).write_text('{"id": "a", "turns": ["hi"]}\n{"id": "b", "turns": \n')
    with pytest.raises(ValueError):
        evaluate(cfg)


def test_results_say_where_they_came_from_and_one_prompt_has_no_interval(tiny, tmp_path):
    """Issue 23 item 7: results.md names the run, date (UTC) and commit; a single prompt gets no bootstrap interval."""
    cfg = _small_eval_cfg(tiny, tmp_path, "data.limit=1", "eval.warmup=false", "run_name=origin")
    results = evaluate(cfg, tiny.decoder("llama", "trained"))
    origin = results["provenance"]
    assert origin["run_name"] == "origin" and len(origin["date_utc"]) == len("2026-12-02 06:40")
    table = markdown_table(results)
    assert f"Run `origin`, {origin['date_utc']} UTC, commit `" in table
    fixed_line = next(line for line in table.splitlines() if line.startswith("| fixed"))
    assert "[" not in fixed_line  # no zero-width [x, x] interval for one prompt


def test_demo_reports_and_logs_like_the_eval_stage():
    """Issue 23 item 7: ``make demo`` wrote no results.md and logged nothing to W&B although every stage logs."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("evaluate", overrides=["experiment=demo"])
    assert cfg.eval.report is True and cfg.logger.enabled is True and cfg.run_name == "demo"
    assert cfg.eval.out.endswith("/eval/demo/results.json")
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:"):makefile.index("\nserve:")]
    assert "pipeline.evaluate experiment=demo" in demo and "results.md" in makefile[makefile.index("# A short look"):]


@pytest.mark.slow
def test_demo_runs_to_the_end_on_a_fresh_clone_without_shared_data_or_hub(tmp_path):
    """Issue 33 item 10: ``make demo`` with no ../shared/data and no hub (loads SmolLM2): the sets it cannot read are
    skipped with a warning naming them and the fix, HumanEval decodes, the report is written, and the W&B summary
    file is plain JSON."""
    import subprocess

    empty = tmp_path / "shared"
    empty.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "WANDB_MODE": "offline"}
    env.pop("BLOCKPILOT_SHARED_DATA", None)
    cmd = [sys.executable, "-m", "pipeline.evaluate", "experiment=demo", f"paths.shared_data={empty}",
           f"paths.data={tmp_path}/data", f"logger.dir={tmp_path}/wandb", "decode.max_new_tokens=8"]
    result = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    for name in ("mbpp", "gsm8k", "math500", "mt_bench"):
        assert log.count(f"skipping a prompt set (data.missing=skip): prompt set {name}: {empty}/{name}.jsonl") == 1, name
    assert "BLOCKPILOT_SHARED_DATA=" in log
    results = json.loads((tmp_path / "data" / "eval" / "demo" / "results.json").read_text())
    assert list(results["per_set"]) == ["humaneval"] and set(results["methods"]) == {"ar", "fixed", "verify_width", "mixed"}
    assert sorted(results["skipped_sets"]) == ["gsm8k", "math500", "mbpp", "mt_bench"]  # named in results.json too
    assert (tmp_path / "data" / "eval" / "demo" / "results.md").exists()
    assert (tmp_path / "data" / "eval" / "demo" / "speedup.png").exists()
    (summary_file,) = (tmp_path / "wandb").rglob("files/blockpilot-summary.json")
    summary = json.loads(summary_file.read_text())
    # HumanEval takes the skipped sets' share (data.skipped_to): the table rests on 5 requests, not 1
    assert summary["ar/n_prompts"] == 5 and isinstance(summary["eval/results"], dict)
    assert "object at 0x" not in summary_file.read_text()
