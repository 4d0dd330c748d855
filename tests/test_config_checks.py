"""``validate_config``: bad settings fail before any model loads, with the key and the fix in the message
(issue 15 items 1, 7 and 12)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline import PROJECT_ROOT
from pipeline.config_checks import validate_config
from pipeline.decoding import DecodeConfig
from pipeline.decoding.sampling import PositionKeyedSampler


@pytest.fixture
def no_model_load(monkeypatch):
    """Make every stage's model loading fail loudly, so a check that runs too late shows up as AssertionError."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    import pipeline.evaluation.runs
    import pipeline.labeling.runner

    monkeypatch.setattr(pipeline.evaluation.runs, "build_decoder", refuse)
    monkeypatch.setattr(pipeline.labeling.runner, "build_decoder", refuse)


def _eval_cfg(compose_config, tiny, tmp_path, *overrides):
    return compose_config("evaluate", [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama')}",
                                       "logger.enabled=false", f"paths.data={tmp_path}", "eval.warmup=false", *overrides])


@pytest.mark.parametrize("value", [0, -1, -2])
def test_decode_block_size_zero_raises_like_negative(value, compose_config, tiny, tmp_path, no_model_load):
    """Item 1: decode.block_size=0 used to become the training block size silently; 0, -1, -2 now fail alike, first."""
    from pipeline.evaluate import evaluate

    cfg = _eval_cfg(compose_config, tiny, tmp_path, f"decode.block_size={value}")
    with pytest.raises(ValueError, match=rf"decode.block_size={value}: a block size must be an integer >= 1"):
        evaluate(cfg)


def test_block_size_beyond_the_drafter_fails_before_any_decode(compose_config, tiny, tmp_path):
    """decode.block_size=17 (beyond the random drafter's limit 16) is refused when the schedules are built, not mid-run."""
    from pipeline.evaluate import method_schedules

    cfg = _eval_cfg(compose_config, tiny, tmp_path, "decode.block_size=17")
    with pytest.raises(ValueError, match=r"decode.block_size=17: block size 17 is beyond this drafter's limit 16"):
        method_schedules(cfg, tiny.decoder("llama"))
    assert method_schedules(_eval_cfg(compose_config, tiny, tmp_path, "decode.block_size=16"), tiny.decoder("llama"))


@pytest.mark.parametrize("override, message", [
    ("model.candidates=[0,8]", r"model.candidates entry=0: a block size must be an integer >= 1"),
    ("model.candidates=[8,8]", r"model.candidates=\[8, 8\] has duplicates"),
    ("model.candidates=[]", r"model.candidates=\[\]: give a non-empty list"),
    ("decode.block_size=-2", r"decode.block_size=-2"),
    ("decode.max_new_tokens=0", r"decode.max_new_tokens=0: must be an integer >= 1"),
    ("decode.temperature=-0.5", r"decode.temperature=-0.5: the temperature must be a finite number >= 0"),
    ("decode.temperature=nan", r"decode.temperature=nan: the temperature must be a finite number >= 0"),
    ("decode.temperature=inf", r"decode.temperature=inf: the temperature must be a finite number >= 0"),
    ("eval.methods=[ar,beam]", r"unknown eval.methods \['beam'\]; choose from"),
    ("eval.split=dev", r"eval.split must be auto, all, train, validation or test; got 'dev'"),
    ("eval.methods=[ar,budget]", r"eval.methods \['budget'\] cannot be evaluated here: .*python -m pipeline.bench_batch"),
    ("model.draft_precision=fp8", r"model.draft_precision must be one of \['auto', 'exact', 'bf16', 'int8'\]"),
    ("model.kv_cache_dtype=fp8", r"model.kv_cache_dtype must be one of \['auto', 'float32', 'bf16'\]"),
])
def test_eval_config_is_checked_before_any_model_loads(override, message, compose_config, tiny, tmp_path, no_model_load):
    """Item 12 (and 7): each of these used to pass silently or fail only after loading the target (and decoding)."""
    from pipeline.evaluate import evaluate

    with pytest.raises(ValueError, match=message):
        evaluate(_eval_cfg(compose_config, tiny, tmp_path, override))


@pytest.mark.parametrize("override, message", [
    ("model.candidates=[0,8]", r"label.block_sizes entry=0|model.candidates entry=0"),
    ("label.block_sizes=[4,0]", r"label.block_sizes entry=0"),
    ("decode.temperature=nan", r"decode.temperature=nan"),
    ("label.mode=oracle", r"label.mode='oracle': choose one of"),
    ("label.tree_top_k=0", r"label.tree_top_k=0: the drafter's candidates"),
])
def test_label_config_is_checked_before_the_model_loads(override, message, compose_config, tiny, tmp_path, no_model_load):
    from pipeline.labeling.runner import run_label

    cfg = compose_config("label", [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama')}",
                                   "logger.enabled=false", f"paths.data={tmp_path}", override])
    with pytest.raises(ValueError, match=message):
        run_label(cfg)
    assert not (tmp_path / "labels").exists()  # nothing written either


def test_every_stage_config_passes_as_shipped(compose_config):
    for stage, name in (("eval", "evaluate"), ("label", "label"), ("bench_label", "bench_label"), ("dataset", "dataset"),
                        ("train", "train"), ("draft", "draft"), ("serve", "serve")):
        validate_config(compose_config(name), stage)
    validate_config(compose_config("serve", ["serve.policy=budget", "serve.max_batch=8"]), "serve")
    validate_config(compose_config("serve", ["serve.policy=budget", "serve.max_batch=1"]), "serve")  # one engine
    validate_config(compose_config("evaluate", ["model=qwen3_4b", "model.device=cpu", "decode.temperature=0.7",
                                                "eval.methods=[ar,fixed,best_fixed,blockpilot,full_vocab,ema,oracle]"]), "eval")


@pytest.mark.parametrize("overrides, message", [
    (["serve.policy=budget", "serve.max_batch=8", "policy.budget.costs.rows=[]"], r"policy.budget.costs.rows=\[\]"),
    (["serve.policy=budget", "serve.max_batch=8", "policy.budget.costs.repeats=0"], r"policy.budget.costs.repeats=0"),
    (["serve.max_batch=0"], r"serve.max_batch=0: .* an integer >= 1"),
    (["serve.policy=beam"], r"unknown serve.policy 'beam'; choose from \[.*'budget'\]"),
    (["serve.policy=oracle"], r"serve.policy=oracle cannot be served"),
    (["policy.verify_width.objective=speed"], r"policy.verify_width.objective='speed'"),
])
def test_serve_config_is_checked_before_the_model_loads(overrides, message, compose_config, tiny, monkeypatch):
    from pipeline.serve import build_engine

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr("pipeline.decoding.build.build_decoder", refuse)
    cfg = compose_config("serve", [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama')}",
                                   *overrides])
    with pytest.raises(ValueError, match=message):
        build_engine(cfg)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf])
def test_non_finite_temperature_is_rejected_by_the_sampler_and_decoder(temperature, tiny):
    """Item 7: NaN passed the old ``< 0`` check and every Gumbel-max pick became token 0."""
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        PositionKeyedSampler(temperature, 0, 16)
    decoder = tiny.decoder("llama", kind=None)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        decoder.generate(torch.tensor([[5, 6, 7]]), 1, DecodeConfig(4, temperature, 0))


@pytest.mark.parametrize("stage", ["eval", "label"])
def test_a_missing_prompt_set_fails_before_any_model_loads(stage, compose_config, tiny, tmp_path, no_model_load,
                                                            monkeypatch):
    """Issue 33 item 10: a fresh clone has no ../shared/data; with no hub either, a stage given data=gsm8k stops at once,
    naming the set and both ways to provide it (the demo skips such sets instead: data.missing=skip)."""
    import datasets

    import pipeline.prompts

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(pipeline.prompts, "_HUB_CACHE", {})
    overrides = [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama')}",
                 "logger.enabled=false", f"paths.data={tmp_path}", f"paths.shared_data={tmp_path}/empty", "data=gsm8k"]
    message = (rf"prompt set gsm8k: {tmp_path}/empty/gsm8k.jsonl not found and its hub copy could not be loaded .*"
               r"BLOCKPILOT_SHARED_DATA=.* Hugging Face hub .*data.missing=skip")
    if stage == "eval":
        from pipeline.evaluate import evaluate

        with pytest.raises(FileNotFoundError, match=message):
            evaluate(compose_config("evaluate", overrides))
    else:
        from pipeline.labeling.runner import run_label

        with pytest.raises(FileNotFoundError, match=message):
            run_label(compose_config("label", overrides))
        assert not (tmp_path / "labels").exists()


def test_a_missing_prompt_set_is_one_line_on_the_command_line(tmp_path):
    import os
    import subprocess
    import sys

    from pipeline import PROJECT_ROOT

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HYDRA_FULL_ERROR", None)
    result = subprocess.run([sys.executable, "-m", "pipeline.label", "data=gsm8k", f"paths.shared_data={tmp_path}",
                             f"paths.data={tmp_path}/data", "logger.enabled=false"], cwd=PROJECT_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: prompt set gsm8k: {tmp_path}/gsm8k.jsonl not found"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr + result.stdout


CONF_OF = {"eval": "evaluate"}  # a stage's config file when its name differs
ENTRY_OF = {"eval": "evaluate"}  # a stage's entry point module when its name differs


def test_every_stage_is_dispatched_by_validate_config_and_checks_its_defaults(compose_config):
    """Issue 41 item 3: ``validate_config`` knows every stage that has an entry point and a config, each entry point
    calls it with its stage's name, and every stage's default config passes its check (each check imports no torch:
    tests/test_layout.py)."""
    from pipeline.config_checks import STAGES, validate_config

    confs = sorted(p.stem for p in (PROJECT_ROOT / "conf").glob("*.yaml"))
    expected = {s for s in STAGES}
    assert {CONF_OF.get(s, s) for s in expected} <= set(confs), confs
    for stage in STAGES:
        source = (PROJECT_ROOT / "pipeline" / f"{ENTRY_OF.get(stage, stage)}.py").read_text()
        assert f'validate_config(cfg, "{stage}")' in source, f"pipeline/{ENTRY_OF.get(stage, stage)}.py skips its check"
        validate_config(compose_config(CONF_OF.get(stage, stage)), stage)
    for name in confs:  # every stage config but the GPU drafter recipe's variant belongs to a dispatched stage
        assert name in {CONF_OF.get(s, s) for s in STAGES} or name == "draft_gpu", f"conf/{name}.yaml: no check"


@pytest.mark.parametrize("stage, overrides, message", [
    ("bench_batch", ["bench.methods=[oracle]"], r"bench.methods=oracle cannot be served"),
    ("bench_batch", ["bench.temperature=-1"], r"bench.temperature"),
    ("bench_step", ["contexts=[0]"], r"contexts"),
    ("serve_vllm", ["vllm.policy=budget"], r"vllm.policy='budget'.*now 'joint'"),
    ("serve_vllm", ["vllm.method=ar", "vllm.policy=joint"], r"applies to dflash"),
    ("bench_serve", ["bench.base_url=http://127.0.0.1:1", "bench.servers=[{name: a},{name: b}]"], r"drop bench.base_url"),
])
def test_the_newly_dispatched_stages_refuse_bad_values(compose_config, stage, overrides, message):
    from pipeline.config_checks import validate_config

    with pytest.raises(ValueError, match=message):
        validate_config(compose_config(stage, overrides), stage)
