"""Every top-level config in conf/ composes and resolves, with every option of the groups it uses;
the launchers' plugins are installed; the eval config runs on a tiny target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from conftest import CONF_DIR, require, shared_data_dir
from pipeline import PROJECT_ROOT

TOP_LEVEL = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
GROUPS = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra"}


DATA = PROJECT_ROOT / "data"
MIX = ["humaneval", "mbpp", "gsm8k", "math500", "mt_bench"]
# Every top-level config, composed on its own defaults: keys its stage reads, with the values they must have.
EXPECTED = {
    "label": {"run_name": "label", "label.mode": "replay", "label.out_dir": f"{DATA}/labels/label", "label.num_shards": 1,
              "data.set_names": MIX, "model.name": "smollm2-135m-instruct"},
    "dataset": {"run_name": "blockpilot", "dataset.labels_dir": f"{DATA}/labels/blockpilot",
                "dataset.out": f"{DATA}/features/blockpilot/topk", "features.name": "topk",
                "dataset.fractions": {"train": 0.7, "validation": 0.15, "test": 0.15}},
    "train": {"run_name": "blockpilot", "train.features_dir": f"{DATA}/features/blockpilot/topk",
              "train.out": f"{DATA}/predictors/blockpilot/mlp", "predictor.name": "mlp",
              "train.calibration.out": f"{DATA}/predictors/blockpilot/verify_width"},
    "draft": {"run_name": "draft", "model.drafter": None, "draft.block_size": 8,
              "draft.out": "data/drafters/smollm2-135m-instruct-dflash-b8",
              "draft.decontaminate": ["humaneval", "{shared}/gsm8k.jsonl", "{shared}/math500.jsonl", "{shared}/mbpp.jsonl",
                                      "{shared}/mt_bench.jsonl"]},
    "draft_gpu": {"run_name": "draft", "model.device": "cuda", "draft.features": "online",
                  "draft.cache_dir": f"{DATA}/cache/drafter-tokens/smollm2-135m-instruct"},
    "evaluate": {"run_name": "eval", "eval.out": f"{DATA}/eval/eval/results.json", "data.set_names": ["humaneval"]},
    "bench_label": {"run_name": "bench-label", "ks": [5, 9], "num_prompts": 5, "data.limit": 1, "data.set_names": MIX,
                    "logger.enabled": False},
    "bench_serve": {"run_name": "bench-serve", "bench.out": f"{DATA}/bench/serve.json", "data.limit": 5,
                    "data.set_names": ["humaneval"]},
    "bench_batch": {"run_name": "bench-batch", "data.limit": 16, "data.set_names": ["humaneval"],
                    "bench.concurrency": [1, 4, 8, 16], "bench.methods": ["ar", "fixed", "verify_width", "budget"]},
    "bench_step": {"run_name": "bench-step", "backends": ["auto", "smallm_f32", "eager"], "model.name": "smollm2-135m-instruct"},
    "retest": {"run_name": "main", "retest.labels_dir": f"{DATA}/labels/main", "dataset.labels_dir": f"{DATA}/labels/main",
               "retest.out": f"{DATA}/retest/main/topk", "retest.targets": ["tau", "speed"]},
    "serve": {"run_name": "main", "serve.host": "127.0.0.1", "serve.port": 8000, "serve.model_name": "smollm2-135m-instruct"},
    "serve_vllm": {"run_name": "vllm", "vllm.host": "127.0.0.1", "vllm.port": 8000, "vllm.method": "dflash",
                   "vllm.policy": "joint", "vllm.target": "smollm2-135m-instruct",
                   "vllm.drafter": "data/drafters/smollm2-135m-instruct-dflash-b8"},
}


def _get(resolved: dict, dotted: str):
    if dotted == "data.set_names":
        return [s["name"] for s in resolved["data"]["sets"]]
    node = resolved
    for key in dotted.split("."):
        node = node[key]
    return node


def test_every_top_level_config_has_its_stage_keys(compose_config):
    """Each config composes on its own defaults to the paths and settings its stage reads (a new top-level config
    must be added to EXPECTED); every one reads the prompt sets from ``paths.shared_data``."""
    assert sorted(EXPECTED) == TOP_LEVEL
    shared = str(shared_data_dir())
    for name, expected in EXPECTED.items():
        resolved = OmegaConf.to_container(compose_config(name), resolve=True)
        assert Path(resolved["paths"]["shared_data"]).resolve() == Path(shared).resolve(), name
        assert "shared_data" not in resolved, f"{name}: shared_data belongs in conf/paths/ (paths.shared_data)"
        for key, value in expected.items():
            want = [v.format(shared=resolved["paths"]["shared_data"]) for v in value] if key == "draft.decontaminate" else value
            assert _get(resolved, key) == want, (name, key)
        for s in resolved.get("data", {}).get("sets", []):  # every JSONL prompt set lives under paths.shared_data
            assert s["source"] == "humaneval" or s["source"].startswith(resolved["paths"]["shared_data"] + "/"), (name, s)


COST_CACHES = ("label.latency.cache", "policy.verify_width.latency.cache", "policy.budget.costs.cache", "vllm.cache_dir")


def test_every_cost_cache_is_the_one_folder(compose_config, monkeypatch):
    """Every per-machine cost cache a config names is ``paths.costs``, the folder ``pipeline.costs.store`` defaults to
    (the crossover's and the machine limits')."""
    from pipeline.costs import store

    monkeypatch.delenv(store.CACHE_ENV, raising=False)
    found = {}
    for name in TOP_LEVEL:
        resolved = OmegaConf.to_container(compose_config(name), resolve=True)
        assert resolved["paths"]["costs"] == str(store.default_dir()) == f"{DATA}/cache/costs", name
        for key in COST_CACHES:
            try:
                found[(name, key)] = _get(resolved, key)
            except (KeyError, TypeError):
                continue
    assert {k for _, k in found} == set(COST_CACHES)
    assert set(found.values()) == {f"{DATA}/cache/costs"}, found


def _tiny_overrides(cfg, tiny) -> list[str]:
    overrides = []
    if "model" in cfg:
        overrides += [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama')}"]
    if "logger" in cfg:
        overrides.append("logger.enabled=false")
    return overrides


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_config_composes_and_resolves(name, compose_config, tiny):
    cfg = compose_config(name)
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert resolved["paths"]["root"] == str(PROJECT_ROOT) and resolved["paths"]["data"] == str(PROJECT_ROOT / "data")
    assert isinstance(resolved.get("run_name"), str) and resolved["run_name"]
    assert Path(resolved["paths"]["shared_data"]).resolve() == shared_data_dir().resolve()
    if "logger" in resolved:
        assert resolved["logger"]["mode"] == os.environ.get("WANDB_MODE", "offline")
    # with tiny models and the logger off, as the tests run stages
    tiny_cfg = compose_config(name, _tiny_overrides(cfg, tiny))
    OmegaConf.to_container(tiny_cfg, resolve=True)
    if "model" in tiny_cfg:
        assert tiny_cfg.model.target == str(tiny.target_dir("llama"))


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_every_option_of_the_groups_a_config_uses(name, compose_config):
    cfg = compose_config(name)
    tried = 0
    for group, options in GROUPS.items():
        if group not in cfg:
            continue
        for option in options:
            composed_cfg = compose_config(name, [f"{group}={option}"])
            OmegaConf.to_container(composed_cfg, resolve=True)
            tried += 1
    assert tried >= 1  # every stage config uses at least the paths group


@pytest.mark.parametrize("launcher", ["joblib", "submitit_slurm"])
def test_launcher_plugins_are_installed(launcher):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", [f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert get_class(cfg.hydra.launcher._target_).__name__.endswith("Launcher")


def test_model_presets(compose_config):
    small = compose_config("evaluate").model
    assert (small.target, small.device, small.dtype, small.training_block_size) == ("smollm2-135m-instruct", "cpu", "float32", 8)
    large = compose_config("evaluate", ["model=qwen3_4b"]).model
    assert (large.target, large.drafter, large.training_block_size, large.device) == (
        "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", 16, "cuda")
    assert large.training_block_size in large.candidates
    local = compose_config("evaluate", ["model=qwen3_4b", "model.target=/models/Qwen3-4B", "model.drafter=/models/d"]).model
    assert (local.target, local.drafter) == ("/models/Qwen3-4B", "/models/d")


@pytest.mark.parametrize("data", GROUPS["data"])
def test_prompt_set_sources_exist(data, compose_config):
    sets = OmegaConf.to_container(compose_config("evaluate", [f"data={data}"]).data.sets, resolve=True)
    assert sets and all({"name", "source"} <= set(s) for s in sets)
    for s in sets:
        if s["source"].endswith(".jsonl"):
            require(Path(s["source"]).exists(), f"{s['source']} not found (set BLOCKPILOT_SHARED_DATA)")


def test_shared_data_env_override(compose_config, monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKPILOT_SHARED_DATA", str(tmp_path))
    cfg = compose_config("evaluate", ["data=gsm8k"])
    assert OmegaConf.to_container(cfg.data.sets, resolve=True)[0]["source"] == f"{tmp_path}/gsm8k.jsonl"
    assert cfg.paths.shared_data == str(tmp_path)
    draft = compose_config("draft_gpu")  # the draft stage's training sets read it too
    assert OmegaConf.to_container(draft.draft.sets, resolve=True)[1]["source"] == f"{tmp_path}/train/code_alpaca.jsonl"


def test_eval_config_runs_on_a_tiny_target(compose_config, tiny, tmp_path):
    from pipeline.evaluate import evaluate

    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text('{"id": "a", "turns": ["def add(a, b):"]}\n{"id": "b", "turns": ["hello", "and more"]}\n')
    cfg = compose_config("evaluate", [
        f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
        "logger.enabled=false", f"paths.data={tmp_path}", f"data.sets=[{{name: mine, source: '{prompt_file}'}}]",
        "decode.max_new_tokens=16", "eval.methods=[ar,fixed]", "eval.warmup=false",
    ])
    results = evaluate(cfg)
    methods = results["methods"]
    assert set(methods) >= {"ar", "fixed"}
    assert methods["ar"]["speedup"] == pytest.approx(1.0) and methods["ar"]["tau"] == pytest.approx(1.0)
    assert methods["fixed"]["lossless"] == 1.0 and methods["fixed"]["n_prompts"] == 2
    assert methods["fixed"]["new_tokens"] == methods["ar"]["new_tokens"] == 2 * 16 + 16  # prompt b has two turns
    assert methods["fixed"]["tau"] > 1.0  # the trained tiny drafter gets drafts accepted


EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
STAGES = ("label", "dataset", "train", "evaluate")


def test_every_experiment_selects_one_profile_for_every_stage(compose_config):
    assert {"main", "quick", "demo", "t1", "gpu"} <= set(EXPERIMENTS)
    for name in EXPERIMENTS:
        cfgs = {stage: compose_config(stage, [f"experiment={name}"]) for stage in STAGES}
        for cfg in cfgs.values():
            OmegaConf.to_container(cfg, resolve=True)
        assert {c.run_name for c in cfgs.values()} == {name}  # every stage reads and writes the same run
        assert len({(c.data.limit, c.decode.max_new_tokens, c.decode.temperature, c.model.target) for c in cfgs.values()}) == 1
    main = {stage: compose_config(stage, ["experiment=main"]) for stage in STAGES}
    assert [s["name"] for s in main["label"].data.sets] == ["humaneval", "mbpp", "gsm8k", "math500", "mt_bench"]
    assert (main["label"].data.limit, main["label"].decode.max_new_tokens, main["label"].label.store_full_logits) == (60, 64, True)
    assert dict(main["dataset"].dataset.fractions) == {"train": 0.7, "validation": 0.15, "test": 0.15}
    assert list(main["evaluate"].eval.methods) == ["ar", "fixed", "best_fixed", "blockpilot", "full_vocab", "ema", "oracle",
                                                   "verify_width", "hybrid", "hf_generate", "mixed"]
    assert main["evaluate"].policy.mixed.cache_seed is None  # seeded from the train split's replies it read 1.14-1.15x
    # against 1.18x unseeded on the main job's mix (2026-12-07): an option, not the default
    assert compose_config("evaluate", ["experiment=gpu"]).model.target == "Qwen/Qwen3-4B"
    assert compose_config("evaluate").data.sets[0]["name"] == "humaneval"  # no experiment: the stage's own defaults


def test_the_makefile_passes_one_experiment_to_every_stage():
    import subprocess

    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", "-o", ".venv/.installed", *args], cwd=PROJECT_ROOT, capture_output=True,
                              text=True, check=True).stdout

    plan = dry("all", "EXPERIMENT=quick")
    stages = [line for line in plan.splitlines() if " -m pipeline." in line and "--cfg" not in line]
    assert len(stages) == 6 and all("experiment=quick run_name=quick" in line for line in stages)
    assert "experiment=main run_name=main" in dry("all")
    assert "experiment=" not in dry("eval", "EXPERIMENT=none") and "run_name=main" in dry("eval", "EXPERIMENT=none")
    assert "data/notebooks/main/analysis.ipynb" in dry("notebook")  # executes a copy, never the tracked notebook
