"""The ``gpu`` experiment (``make all EXPERIMENT=gpu`` + ``make serve``) end to end on the CPU with tiny stand-ins:
a random Qwen3 target in bfloat16 whose chat template has Qwen3's ``enable_thinking`` switch, and a drafter written
in z-lab's exact layout for ``z-lab/Qwen3-4B-DFlash-b16`` (config keys and file names as z-lab ships them: training
block size 16, ``dflash_config.target_layer_ids`` / ``mask_token_id``, ``model.safetensors`` in bfloat16, the full
vocabulary, no draft vocabulary). The composition is the experiment's own (``experiment=gpu``: model=qwen3_4b,
candidates 12..20, bfloat16, every eval method); only paths, the device and sizes are overridden.

Also here: the checks of the GPU path that need no GPU (issue 24 items 7c, 7d, 7e).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import composed
from tiny_models import QWEN3_TEMPLATE, make_tiny_target, train_tiny_drafter

TEXTS = {"code": ["def add(a, b):", "Write a function that returns the sum of a list.", "0123456789 + - *"],
         "math": ["Natalia sold clips to 48 of her friends", "What is 48 + 24 ?", "then she sold half as many"]}
MAX_NEW = 6


def zlab_drafter(target_dir: Path, out: Path, trained_dir: Path) -> Path:
    """The drafter trained at ``trained_dir`` (training block size 16) rewritten as z-lab ships ``Qwen3-4B-DFlash-b16``:
    ``config.json`` with z-lab's keys (transformers-4.57 style ``rope_theta``, ``block_size`` 16, ``num_target_layers``,
    ``dflash_config`` with ``target_layer_ids`` and ``mask_token_id`` only, ``auto_map`` to its ``dflash.py``) and the
    weights in one bfloat16 ``model.safetensors`` under z-lab's tensor names (no embeddings, no LM head, no
    ``draft_vocab``). Trained, not random: the verify-width calibration needs some accepted drafts."""
    from pipeline.models.drafter import DFlashDrafter

    tc = AutoModelForCausalLM.from_pretrained(target_dir).config
    drafter = DFlashDrafter.from_pretrained(trained_dir)
    assert drafter.block_size == 16
    layer_ids, mask_id, num_layers = drafter.target_layer_ids, drafter.mask_token_id, drafter.config.num_hidden_layers
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items() if "rotary_emb" not in k}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": tc.bos_token_id,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids}, "dtype": "bfloat16",
        "eos_token_id": tc.eos_token_id, "head_dim": tc.head_dim, "hidden_act": "silu", "hidden_size": tc.hidden_size,
        "initializer_range": 0.02, "intermediate_size": tc.intermediate_size,
        "layer_types": ["full_attention"] * num_layers, "max_position_embeddings": tc.max_position_embeddings,
        "max_window_layers": num_layers, "model_type": "qwen3", "num_attention_heads": tc.num_attention_heads,
        "num_hidden_layers": num_layers, "num_key_value_heads": tc.num_key_value_heads,
        "num_target_layers": tc.num_hidden_layers, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": tc.rope_parameters["rope_theta"], "sliding_window": None, "tie_word_embeddings": True,
        "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": tc.vocab_size,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def qwen3_target(out: Path) -> Path:
    """A tiny random Qwen3 target stored in bfloat16 (as Qwen/Qwen3-4B), with Qwen3's enable_thinking template."""
    make_tiny_target(out, arch="qwen3", chat_template=QWEN3_TEMPLATE, max_positions=1024)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("gpu-standins")
    target = qwen3_target(base / "Qwen3-4B")
    trained = train_tiny_drafter(target, base / "trained-b16", block_size=16, steps=40)
    drafter = zlab_drafter(target, base / "Qwen3-4B-DFlash-b16", trained)
    sets = []
    for name, texts in TEXTS.items():
        path = base / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{name}-{i}", "turns": [t]}) + "\n" for i, t in enumerate(texts)))
        sets.append({"name": name, "source": str(path)})
    return {"base": base, "target": target, "drafter": drafter, "sets": sets, "data": base / "data"}


def gpu_overrides(s: dict, *extra: str) -> list[str]:
    """``experiment=gpu`` pointed at the stand-ins on the CPU, small: paths, device, prompt sets, token and timing sizes."""
    sets = "data.sets=[" + ",".join(f"{{name:{x['name']},source:'{x['source']}'}}" for x in s["sets"]) + "]"
    return ["experiment=gpu", f"model.target={s['target']}", f"model.drafter={s['drafter']}", "model.device=cpu",
            f"paths.data={s['data']}", "logger.enabled=false", sets, "data.limit=null", "data.seed=null",
            f"decode.max_new_tokens={MAX_NEW}", *extra]


def test_the_zlab_standin_has_zlabs_layout_and_loads(standins):
    from pipeline.models.drafter import DFlashDrafter

    drafter_dir = standins["drafter"]
    assert sorted(p.name for p in drafter_dir.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["block_size"] == 16 and set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    weights = load_file(drafter_dir / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values()) and "draft_vocab" not in weights
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=torch.bfloat16)
    assert drafter.block_size == 16 and drafter.draft_vocab is None and drafter.target_layer_ids == [0, 2]
    assert drafter.mask_token_id == config["dflash_config"]["mask_token_id"]


def test_the_gpu_experiment_runs_end_to_end_on_cpu_standins(standins, caplog):
    """label -> dataset (topk, full_vocab) -> train (mlp, full_vocab) -> eval of every method of the gpu experiment, then
    a few served requests: results.json has every method, prompts are built with thinking off, and outputs are what
    autoregressive decoding gives."""
    from fastapi.testclient import TestClient

    from pipeline.evaluation.inputs import load_eval_inputs
    from pipeline.evaluation.report import write_json
    from pipeline.evaluation.runs import evaluate
    from pipeline.labeling.store import read_label_table
    from pipeline.policy.data import build_dataset
    from pipeline.labeling.runner import run_label
    from pipeline.decoding.build import build_decoder
    from pipeline.prompts import chat_input_ids
    from pipeline.serve import build_engine
    from pipeline.serving.app import create_app
    from pipeline.policy.training import train_predictor

    s = standins
    small_latency = ["label.latency.context_buckets=[32]", "label.latency.repeats=1"]
    with composed("evaluate", gpu_overrides(s)) as cfg:
        methods = list(cfg.eval.methods)
        assert cfg.model.candidates == list(range(12, 21)) and cfg.model.dtype == "bfloat16"
        assert cfg.model.training_block_size == 16 and {"verify_width", "hybrid"} <= set(methods)
        assert dict(cfg.model.chat_template_kwargs) == {"enable_thinking": False}

    with composed("label", gpu_overrides(s, *small_latency)) as cfg:
        summary = run_label(cfg)
    assert summary["labelled"] == 6 and not summary["skipped"]
    labels, meta = read_label_table(Path(summary["out_dir"]))
    assert meta["chat_template_kwargs"] == {"enable_thinking": False} and meta["candidates"] == list(range(12, 21))
    assert meta["training_block_size"] == 16
    tokenizer = build_decoder(cfg.model).target.tokenizer  # thinking off: the prompts end with an empty think block
    first = labels.set_index("id").loc["code-0"]
    assert first["prompt_tokens"] == chat_input_ids(tokenizer, [TEXTS["code"][0]]).shape[1]
    assert tokenizer.decode(chat_input_ids(tokenizer, [TEXTS["code"][0]])[0]).endswith("<think>\n\n</think>\n\n")

    for features in ("topk", "full_vocab"):
        with composed("dataset", gpu_overrides(s, f"features={features}")) as cfg:
            build_dataset(cfg)
    with composed("dataset", gpu_overrides(s, "model.chat_template_kwargs=null")) as cfg:  # labels of other prompts
        with pytest.raises(ValueError, match=r"made with model.chat_template_kwargs=\{'enable_thinking': False\} but this "
                                             r"run has \{\}.*'model.chat_template_kwargs=\{enable_thinking: false\}'"):
            build_dataset(cfg)
    for predictor in ("mlp", "full_vocab"):
        with composed("train", gpu_overrides(s, f"predictor={predictor}", "trainer=smoke", "train.batch_size=2")) as cfg:
            train_predictor(cfg)

    eval_extra = ["eval.warmup=false", "eval.report=false", "policy.verify_width.latency.context_buckets=[32]",
                  "policy.verify_width.latency.repeats=1", "eval.bootstrap.samples=20"]
    with composed("evaluate", gpu_overrides(s, *eval_extra)) as cfg:
        decoder = build_decoder(cfg.model)
        results = evaluate(cfg, decoder, inputs=load_eval_inputs(cfg, methods, decoder))
        out = write_json(results, cfg.eval.out)
    results = json.loads(Path(out).read_text())
    assert list(results["methods"]) == methods
    assert all(r["n_prompts"] >= 1 and r["tau"] >= 1.0 for r in results["methods"].values())
    path = results["forward_path"]
    assert path["backend"] == "eager" and path["batch_invariant"] is False and path["target"].startswith("transformers bfloat16")
    # bf16 on eager is not batch-invariant: the exact-match rate against ar is reported, not assumed
    assert all(0.0 <= r["lossless"] <= 1.0 for r in results["methods"].values())

    serve = [f"model.target={s['target']}", f"model.drafter={s['drafter']}", "model=qwen3_4b", "model.device=cpu",
             f"paths.data={s['data']}", "run_name=gpu", "serve.policy=blockpilot", "serve.warmup=false"]
    with composed("serve", [serve[2], *serve[:2], *serve[3:]]) as cfg:
        engine = build_engine(cfg)
    ar = build_decoder(cfg.model)
    with TestClient(create_app(engine), base_url="http://localhost") as client:
        for text, kwargs in ((TEXTS["code"][0], None), (TEXTS["math"][1], None), (TEXTS["math"][1], {"enable_thinking": True})):
            body = {"model": engine.model_name, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_NEW}
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            ids = chat_input_ids(ar.target.tokenizer, [text], **(kwargs or {}))
            assert reply.json()["usage"]["prompt_tokens"] == ids.shape[1]  # thinking off unless the request says so
            expected = ar.target.tokenizer.decode(ar.generate(ids, 1, _config()).output_ids, skip_special_tokens=True)
            assert reply.json()["choices"][0]["message"]["content"] == expected


def _config():
    from pipeline.decoding import DecodeConfig

    return DecodeConfig(max_new_tokens=MAX_NEW)


# -- 7(d): a CUDA device on a CPU-only torch is refused before any weight loads -------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: model.device=cuda is valid here")
def test_cuda_device_without_cuda_is_refused_before_weights_load(compose_config, monkeypatch):
    from pipeline.config_checks import validate_config
    from pipeline.decoding.checks import check_device
    from pipeline.models import loading

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("weights must not load"))
    message = r"model.device=cuda: this PyTorch .* CPU-only build; set model.device=cpu" if torch.version.cuda is None \
        else r"model.device=cuda: PyTorch .* sees no GPU"
    for stage, name, preset in (("label", "label", "experiment=gpu"), ("eval", "evaluate", "experiment=gpu"),
                                ("bench_label", "bench_label", "model=qwen3_4b")):
        with pytest.raises(ValueError, match=message):
            validate_config(compose_config(name, [preset]), stage)  # qwen3_4b: device cuda
    for stage in ("dataset", "train"):  # no target loads there: the gpu run's dataset and train stages run on any machine
        validate_config(compose_config(stage, ["experiment=gpu"]), stage)
    from pipeline.labeling.runner import run_label

    with pytest.raises(ValueError, match=message):
        run_label(compose_config("label", ["experiment=gpu", "logger.enabled=false"]))
    with pytest.raises(ValueError, match="is not a device name"):
        check_device("gpu0")
    assert check_device("cpu") == "cpu"


# -- 7(c): position-keyed noise is made on the logits' device, keyed by (seed, position) only ------------------------
def test_cpu_noise_is_gumbel_keyed_by_position_and_made_where_the_logits_are():
    import math

    from pipeline.decoding.sampling import PositionKeyedSampler

    sampler = PositionKeyedSampler(0.7, 12345, 300)
    for position in (0, 7, 511):  # the formula, independent of the class's code: -log(-log(U)), U from (seed, position)
        g = torch.Generator().manual_seed(12345 * 1_000_003 + position)
        uniform = torch.rand(300, generator=g).clamp_(min=torch.finfo(torch.float32).tiny)
        assert torch.equal(sampler.gumbel(position), -torch.log(-torch.log(uniform)))
    assert torch.equal(PositionKeyedSampler(0.7, 12345, 300).gumbel(7), sampler.gumbel(7))  # a fresh sampler: the same
    draws = torch.cat([PositionKeyedSampler(1.0, 3, 1000).gumbel(p) for p in range(200)])
    assert abs(draws.mean().item() - 0.5772) < 0.01 and abs(draws.var().item() - math.pi ** 2 / 6) < 0.03  # Gumbel(0, 1)
    assert torch.isfinite(draws).all()
    rows = sampler.noise([5, 6, 9], "cpu")
    assert rows.shape == (3, 300) and rows.device.type == "cpu" and torch.equal(rows[2], sampler.gumbel(9))
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampler.pick(logits, 5), (logits / 0.7 + sampler.noise([5, 6, 7])).argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is tested above)")
def test_cuda_noise_is_made_on_the_gpu_keyed_by_seed_and_position():
    from pipeline.decoding.sampling import PositionKeyedSampler

    sampler = PositionKeyedSampler(1.0, 3, 151936)
    rows = sampler.noise(range(16), "cuda")
    assert rows.device.type == "cuda" and rows.shape == (16, 151936)
    again = PositionKeyedSampler(1.0, 3, 151936).noise([4, 5], "cuda")
    assert torch.equal(again, rows[4:6])  # keyed by (seed, position) only: the same for every block size


# -- 7(e): drafter-data sampling at T > 0 stays on the model's device -----------------------------------------------
def test_sampled_drafter_data_draws_on_the_models_device(tiny):
    """On the CPU the draws are what a CPU generator gives (the same shards as before); the probabilities are no
    longer copied to the host (a GPU run draws from a generator on the GPU, seeded by the given one)."""
    from pipeline.drafting.responses import generate_batch
    from pipeline.prompts import chat_input_ids

    target = tiny.target("llama")
    prompt = chat_input_ids(target.tokenizer, ["def add(a, b):"])[0]
    seq = generate_batch(target, [prompt], [], 8, with_features=False, temperature=1.0,
                         generator=torch.Generator().manual_seed(7))[0][0]
    # independent reference: transformers' forward without a cache, softmax at T=1, torch.multinomial on the CPU generator
    g, ids = torch.Generator().manual_seed(7), prompt[None]
    stop = set(target.stop_token_ids())
    with torch.inference_mode():
        for _ in range(8):
            probs = torch.softmax(target.model(input_ids=ids).logits[0, -1].float(), -1)
            nxt = torch.multinomial(probs[None], 1, generator=g)[0]
            ids = torch.cat([ids, nxt[None]], dim=1)
            if int(nxt) in stop:
                break
    assert seq.tolist() == ids[0].tolist()


# -- scripts/gpu_check.sh on the CPU (issue 24 item 3) ---------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_script_runs_on_the_cpu_with_the_standins(standins, tmp_path):
    """``DEVICE=cpu``: every step of the GPU check (versions, cost curve by verify width, ar/fixed/verify_width eval with
    exact-match rates, replay labels, bench_label check) runs on the stand-ins and writes and prints its figures."""
    import os
    import subprocess

    from pipeline import PROJECT_ROOT

    s, dest = standins, tmp_path / "check"
    code = next(x["source"] for x in s["sets"] if x["name"] == "code")
    data = f"data.sets=[{{name:code,source:'{code}'}}] data.limit=1"
    env = {**os.environ, "DEVICE": "cpu", "DTYPE": "float32", "PYTHON": sys.executable, "TARGET": str(s["target"]),
           "DRAFTER": str(s["drafter"]), "DEST": str(dest), "MAX_NEW": "6", "BENCH_PROMPTS": "1", "WIDTHS": "1,4",
           "BLOCKS": "4", "CONTEXTS": "32", "REPEATS": "1", "LATENCY_BUCKETS": "32", "LATENCY_REPEATS": "1",
           "BENCH_KS": "3", "CALIBRATION": str(PROJECT_ROOT / "data/drafters/smollm2-135m-instruct-dflash-b8/calibration.json"),
           "DATA_ARGS": data, "BENCH_DATA_ARGS": data, "EXTRA": f"paths.data={tmp_path / 'data'}"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                            timeout=1500)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    for name in ("versions.json", "cost_curve.json", "eval.json", "bench_label.json"):
        assert (dest / name).is_file(), name
    assert any((dest / "labels").glob("shard-*.parquet"))
    versions = json.loads((dest / "versions.json").read_text())
    assert versions["torch"] == torch.__version__ and versions["device"] == "cpu"
    curve = json.loads((dest / "cost_curve.json").read_text())
    assert set(curve["by_context"]["32"]["forward_ms"]) == {"1", "4"}
    ev = json.loads((dest / "eval.json").read_text())
    assert list(ev["methods"]) == ["ar", "fixed", "verify_width"] and "batch_invariant" in ev["forward_path"]
    bench = json.loads((dest / "bench_label.json").read_text())  # the bench JSONs name the forward path too
    assert bench["forward_path"]["batch_invariant"] is curve["forward_path"]["batch_invariant"]
    assert 0.0 <= bench["output_agreement"] <= 1.0
    summary = out[out.index("== summary"):]
    assert f"versions: torch {torch.__version__}" in summary
    assert "context 32: forward ms by q 1:" in summary and ("-> flat" in summary or "-> rising" in summary)
    assert "verify_width vs fixed: tokens/s" in summary and "exact match vs ar 1.0" in summary
    assert "speculative output == B=1 output in" in summary and "label 1 prompts" in summary
    assert "gpu_check: done in" in out
