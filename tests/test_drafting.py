"""Drafter training data and the draft stage: anchors and block masks, target features, shards, training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.drafting import responses
from pipeline.drafting.data import AnchorDataset, block_inputs, collate, load_sequences
from pipeline.drafting.module import DrafterModule, init_from_target_layers
from pipeline.drafting.responses import build_response_cache, generate_batch, read_shard, write_shard
from pipeline.models.drafter import DFlashDrafter, check_compatible, make_drafter_config
from pipeline.models.target import load_target
from pipeline.prompts import Prompt, chat_input_ids

from drafting_fixtures import LAYERS, TEXTS, llama, prompt_ids, train_steps  # noqa: F401 (fixtures)


# ------------------------------------------------------------------------------------------------
# anchors -> block inputs
# ------------------------------------------------------------------------------------------------
def hand_made_batch() -> dict:
    """Two sequences (10 and 7 tokens), anchors [2, 7] and [5, padding]."""
    tokens = torch.zeros(2, 10, dtype=torch.long)
    tokens[0] = torch.arange(10, 20)
    tokens[1, :7] = torch.arange(20, 27)
    return {"tokens": tokens, "features": torch.zeros(2, 10, 6), "lengths": torch.tensor([10, 7]),
            "anchors": torch.tensor([[2, 7], [5, -1]])}


def test_block_inputs_on_a_hand_made_batch():
    B, MASK = 4, 1
    out = block_inputs(hand_made_batch(), B, MASK)
    assert out["block_ids"][0].tolist() == [12, MASK, MASK, MASK, 17, MASK, MASK, MASK]
    assert out["block_ids"][1, :4].tolist() == [25, MASK, MASK, MASK]
    # labels: the B-1 tokens after each anchor; -100 past the sequence's end and for padded anchors
    assert out["labels"].tolist() == [
        [[13, 14, 15], [18, 19, -100]],
        [[26, -100, -100], [-100, -100, -100]],
    ]
    assert out["position_ids"][0].tolist() == list(range(10)) + [2, 3, 4, 5, 7, 8, 9, 10]
    assert out["position_ids"][1, :14].tolist() == list(range(10)) + [5, 6, 7, 8]

    mask = out["attention_mask"]
    assert mask.shape == (2, 1, 8, 18) and mask.dtype == torch.bool
    anchors = [[2, 7], [5, None]]
    for b in range(2):
        for row in range(8):
            k = row // B
            a = anchors[b][k]
            for col in range(18):
                if a is None:  # padded anchor: sees only itself, so no attention row is empty
                    expected = col == 10 + row
                elif col < 10:  # context: strictly before the anchor
                    expected = col < a
                else:  # block part: its own block, in both directions
                    expected = (col - 10) // B == k
                assert bool(mask[b, 0, row, col]) == expected, (b, row, col)


# ------------------------------------------------------------------------------------------------
# target responses and their features
# ------------------------------------------------------------------------------------------------
def _teacher_forced_taps(target, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = target.model.base_model(input_ids=tokens[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)


def _check_sequences(target, prompts, results, max_new_tokens, stop_ids):
    from pipeline.decoding import DecodeConfig, SpeculativeDecoder

    decoder = SpeculativeDecoder(target)
    decoder.stop_ids = set(stop_ids)
    for p, (tokens, features) in zip(prompts, results):
        assert torch.equal(tokens[: len(p)], p)
        response = tokens[len(p):].tolist()
        greedy = decoder.generate(p[None], 1, DecodeConfig(max_new_tokens)).output_ids
        assert response == greedy  # batched left-padded greedy == the decoder's autoregressive output
        assert features.dtype == torch.bfloat16 and features.shape == (len(tokens), len(LAYERS) * 64)
        assert torch.count_nonzero(features[-1]) == 0  # the last token was never fed to the target
        taps = _teacher_forced_taps(target, tokens)[:-1]
        torch.testing.assert_close(features[:-1].float(), taps.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)


def test_generate_batch_features_equal_teacher_forced_taps(llama, prompt_ids):
    results = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=10)
    assert [len(t) - len(p) for (t, _), p in zip(results, prompt_ids)] == [10] * 4
    _check_sequences(llama, prompt_ids, results, 10, llama.stop_token_ids())


def test_generate_batch_rows_leave_at_their_stop_token(tiny, prompt_ids):
    target = load_target(str(tiny.target_dir("llama")))  # own copy: its generation config is changed
    plain = generate_batch(target, prompt_ids, LAYERS, max_new_tokens=10)
    stop = int(plain[1][0][len(prompt_ids[1]) + 2])  # the 3rd response token of prompt 1 becomes a stop
    target.model.generation_config.eos_token_id = [target.tokenizer.eos_token_id, stop]
    results = generate_batch(target, prompt_ids, LAYERS, max_new_tokens=10)
    lengths = [len(t) - len(p) for (t, _), p in zip(results, prompt_ids)]
    assert lengths[1] <= 3 and min(lengths) < max(lengths) == 10  # rows finished at different steps
    for (tokens, _), p in zip(results, prompt_ids):
        response = tokens[len(p):].tolist()
        assert stop not in response[:-1] and (response[-1] == stop or len(response) == 10)
    _check_sequences(target, prompt_ids, results, 10, target.stop_token_ids())


def test_shard_round_trip(llama, prompt_ids, tmp_path):
    results = generate_batch(llama, prompt_ids[:3], LAYERS, max_new_tokens=6)
    path = tmp_path / "shard-00000.safetensors"
    write_shard(path, results, [len(p) for p in prompt_ids[:3]])
    assert path.exists() and not list(tmp_path.glob("*.tmp"))
    back = read_shard(path)
    assert len(back) == 3
    for seq, (tokens, features), p in zip(back, results, prompt_ids):
        assert torch.equal(seq["tokens"], tokens) and seq["tokens"].dtype == torch.long
        assert torch.equal(seq["features"], features)
        assert seq["prompt_length"] == len(p)
    assert responses.generation_seconds([path]) == (0.0, 1)  # written without a time: counted as unknown
    write_shard(path, results, [len(p) for p in prompt_ids[:3]], seconds=2.5)
    assert responses.generation_seconds([path, path]) == (5.0, 0)


def test_response_cache_resumes_and_skips_long_prompts(llama, tmp_path, monkeypatch):
    prompts = [Prompt(f"p{i}", [t], "test") for i, t in enumerate(TEXTS)] + [Prompt("long", ["word " * 200], "test")]
    out = tmp_path / "cache"
    paths = build_response_cache(llama, prompts, out, LAYERS, max_new_tokens=5, max_prompt_tokens=64, batch_size=3)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    sequences = [s for p in paths for s in read_shard(p)]
    assert len(sequences) == 4  # the long prompt was skipped
    assert [s["prompt_length"] for s in sequences] == sorted(s["prompt_length"] for s in sequences)  # sorted by length
    mtimes = [p.stat().st_mtime_ns for p in paths]

    def no_generation(*args, **kwargs):
        raise AssertionError("a finished shard was generated again")

    monkeypatch.setattr(responses, "generate_batch", no_generation)
    assert build_response_cache(llama, prompts, out, LAYERS, max_new_tokens=5, max_prompt_tokens=64, batch_size=3) == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes

    loaded = load_sequences([out])
    assert len(loaded) == 4 and all(len(s["tokens"]) - s["prompt_length"] == 5 for s in loaded)
    short = load_sequences([out], max_len=min(s["prompt_length"] for s in loaded) + 3)
    assert len(short) == 1 and len(short[0]["tokens"]) == short[0]["prompt_length"] + 3  # others keep < 2 response tokens


# ------------------------------------------------------------------------------------------------
# anchors, batches, training module
# ------------------------------------------------------------------------------------------------
def _sequences(n: int = 3) -> list[dict]:
    return [{"tokens": torch.arange(5 + 4 * i) + 3, "features": torch.randn(5 + 4 * i, 2 * 64).to(torch.bfloat16),
             "prompt_length": 3} for i in range(n)]


def test_anchor_dataset_and_collate():
    sequences = _sequences()
    ds = AnchorDataset(sequences, anchors_per_seq=4, seed=0)
    items = [ds[i] for i in range(3)]
    for seq, item in zip(sequences, items):
        n, p = len(seq["tokens"]), seq["prompt_length"]
        a = item["anchors"].tolist()
        assert a == sorted(set(a)) and len(a) == min(4, n - 1 - p)
        assert all(p <= x <= n - 2 for x in a)  # response positions with at least one label
    assert [ds[i]["anchors"].tolist() for i in range(3)] == [it["anchors"].tolist() for it in items]  # reproducible
    ds.epoch = 1
    assert any(ds[i]["anchors"].tolist() != items[i]["anchors"].tolist() for i in range(3))

    batch = collate(items)
    assert batch["tokens"].shape == (3, 13) and batch["features"].shape == (3, 13, 128)
    assert batch["lengths"].tolist() == [5, 9, 13]
    assert batch["anchors"].shape == (3, 4) and batch["anchors"][0].tolist() == items[0]["anchors"].tolist() + [-1] * 3
    assert torch.equal(batch["tokens"][0, 5:], torch.zeros(8, dtype=torch.long))


def test_drafter_module_learns_and_reports_tau(llama):
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(llama.model.config, num_layers=1, block_size=4, target_layer_ids=LAYERS))
    copied = init_from_target_layers(drafter, llama.model)
    assert copied == [3]
    torch.testing.assert_close(drafter.layers[0].mlp.up_proj.weight, llama.model.base_model.layers[3].mlp.up_proj.weight)
    module = DrafterModule(drafter, llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings().weight,
                           lr=5e-3, warmup_steps=1, max_steps=30)
    module.log_dict = module.log = lambda *a, **k: None  # no Trainer attached
    batch = collate([AnchorDataset(_sequences(), 4, 0)[i] for i in range(3)])
    losses = train_steps(module, batch, 15)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0]
    total, count = module.teacher_forced_tau(batch, 4)
    assert count > 0 and 1.0 <= total / count <= 4.0


# ------------------------------------------------------------------------------------------------
# the draft stage end to end
# ------------------------------------------------------------------------------------------------
def test_draft_stage_end_to_end(tiny, compose_config, tmp_path):
    from pipeline.decoding import DecodeConfig, SpeculativeDecoder
    from pipeline.drafting.trainer import train_drafter

    target_dir = tiny.target_dir("llama")
    prompt_file = tmp_path / "train.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"t{i}", "turns": [t]}) + "\n" for i, t in enumerate(TEXTS * 3)))
    out = tmp_path / "drafter"
    cfg = compose_config("draft", [
        f"model.target={target_dir}", "model.name=tiny", f"paths.data={tmp_path / 'data'}", "logger.enabled=false",
        f"draft.out={out}", f"draft.cache_dir={tmp_path / 'cache'}",
        f"draft.sets=[{{name: mine, source: '{prompt_file}'}}, {{name: src, source: stdlib_source, window: 48, limit: 3}}]",
        "draft.max_new_tokens=12", "draft.max_prompt_tokens=64", "draft.gen_batch_size=4", "draft.max_seq_len=64",
        "draft.val_fraction=0.25", "draft.num_layers=1", "draft.block_size=4", f"draft.target_layer_ids={LAYERS}",
        "draft.draft_vocab_size=64", "draft.batch_size=4", "draft.anchors_per_seq=4", "draft.eval_block_sizes=[2,4]",
        "draft.warmup_steps=1", "draft.trainer.max_steps=4", "draft.trainer.val_check_interval=2",
        "draft.trainer.limit_val_batches=1",
    ])
    assert train_drafter(cfg) == out
    assert {"config.json", "model.safetensors", "README.md", "training_stats.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 4 and config["dflash_config"]["target_layer_ids"] == LAYERS
    assert config["draft_vocab_size"] == 64 and config["dtype"] == "bfloat16"  # vLLM's layout: d2t + the head's rows
    weights = load_file(out / "model.safetensors")
    head = tiny.target("llama").model.get_output_embeddings().weight
    assert weights["d2t"].shape == (64,) and torch.equal(weights["lm_head.weight"], head[weights["d2t"] + torch.arange(64)])
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["optimizer steps"] == 4 and set(stats["val_tau"]) >= {"2", "4"}
    seconds = stats["data generation wall time per set (s, recorded in the cached shards)"]
    assert set(seconds) == {"mine", "src"} and all(isinstance(v, int) for v in seconds.values())
    assert (out / "README.md").read_text().startswith("# drafter")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["mine", "src"]
    assert list((tmp_path / "cache" / "src").glob("shard-*.safetensors"))

    drafter = DFlashDrafter.from_pretrained(out)
    target = tiny.target("llama")
    check_compatible(drafter, target.model.config)
    assert drafter.draft_vocab.shape == (64,) and set(target.stop_token_ids()) <= set(drafter.draft_vocab.tolist())
    decoder = SpeculativeDecoder(target, drafter)
    ids = chat_input_ids(target.tokenizer, [TEXTS[0]])
    assert decoder.generate(ids, 4, DecodeConfig(16)).output_ids == decoder.generate(ids, 1, DecodeConfig(16)).output_ids


# ------------------------------------------------------------------------------------------------
# token-only data and online features (draft.features=online)
# ------------------------------------------------------------------------------------------------
def test_token_only_generation_and_shards(llama, prompt_ids, tmp_path):
    with_feats = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=8)
    tokens_only = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=8, with_features=False)
    assert [torch.equal(a, b) for (a, _), (b, _) in zip(with_feats, tokens_only)] == [True] * len(prompt_ids)
    assert all(f is None for _, f in tokens_only)
    path = tmp_path / "shard-00000.safetensors"
    write_shard(path, tokens_only, [len(p) for p in prompt_ids])
    back = read_shard(path)
    assert all("features" not in s for s in back)
    assert [s["tokens"].tolist() for s in back] == [t.tolist() for t, _ in tokens_only]
    with pytest.raises(ValueError, match="draft.features=online"):
        load_sequences([tmp_path])
    assert len(load_sequences([tmp_path], features=False)) == sum(len(t) - len(p) >= 2 for (t, _), p in zip(tokens_only, prompt_ids))


def test_online_features_equal_cached_features(llama, prompt_ids):
    """The training step's own target pass gives the features the generation cache stores, so a batch
    without features yields the drafter outputs of the same batch with them."""
    torch.manual_seed(0)
    results = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=10)
    sequences = [{"tokens": t, "features": f, "prompt_length": len(p)} for (t, f), p in zip(results, prompt_ids)]
    items = [AnchorDataset(sequences, 4, 0)[i] for i in range(len(sequences))]
    cached = collate(items)
    online = collate([{k: v for k, v in it.items() if k != "features"} for it in items])
    assert "features" not in online
    drafter = DFlashDrafter(make_drafter_config(llama.model.config, num_layers=1, block_size=4, target_layer_ids=LAYERS))
    module = DrafterModule(drafter, llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings().weight,
                           target_model=llama.model)
    feats, final = module.target_features(online["tokens"], online["lengths"])
    assert final.shape == (*online["tokens"].shape, 64)
    for i, n in enumerate(online["lengths"].tolist()):  # the stored last row is zero: never fed during generation
        torch.testing.assert_close(feats[i, : n - 1].float(), cached["features"][i, : n - 1].float(), atol=2e-2, rtol=2e-2)
    hidden_cached, labels_cached = module._logits(cached, 4)
    hidden_online, labels_online = module._logits(module._with_features(online), 4)
    assert torch.equal(labels_cached, labels_online)
    torch.testing.assert_close(hidden_online, hidden_cached, atol=5e-2, rtol=5e-2)
    no_target = DrafterModule(drafter, llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings().weight)
    with pytest.raises(ValueError, match="target_model"):
        no_target._with_features(online)


def test_learning_rate_decay_follows_the_time_budget(llama):
    from pipeline.drafting.trainer import schedule_seconds

    assert schedule_seconds("00:00:05:00") == 300.0 and schedule_seconds("01:02:03:04") == 93784.0
    assert schedule_seconds(None) is None
    drafter = DFlashDrafter(make_drafter_config(llama.model.config, num_layers=1, block_size=4, target_layer_ids=LAYERS))
    emb, head = llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings().weight
    by_steps = DrafterModule(drafter, emb, head, lr=1.0, warmup_steps=1, max_steps=1000)
    by_time = DrafterModule(drafter, emb, head, lr=1.0, warmup_steps=1, max_steps=1000, max_seconds=1e-6)
    lr_steps = by_steps.configure_optimizers()["lr_scheduler"]["scheduler"]
    lr_time = by_time.configure_optimizers()["lr_scheduler"]["scheduler"]
    for _ in range(3):
        lr_steps.optimizer.step(), lr_steps.step(), lr_time.optimizer.step(), lr_time.step()
    assert lr_steps.get_last_lr()[0] > 0.99  # 3 of 1000 steps: still at the peak
    assert lr_time.get_last_lr()[0] == pytest.approx(0.1)  # the time budget is spent: the floor


def test_draft_stage_online_features(tiny, compose_config, tmp_path):
    from pipeline.drafting.trainer import train_drafter

    prompt_file = tmp_path / "train.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"t{i}", "turns": [t]}) + "\n" for i, t in enumerate(TEXTS * 2)))
    out = tmp_path / "drafter"
    cfg = compose_config("draft_gpu", [
        f"model.target={tiny.target_dir('llama')}", "model.name=tiny", "model.device=cpu", f"paths.data={tmp_path / 'data'}",
        "logger.enabled=false", f"draft.out={out}", f"draft.cache_dir={tmp_path / 'cache'}",
        f"draft.sets=[{{name: mine, source: '{prompt_file}'}}, {{name: src, source: stdlib_source, window: 48, limit: 3}}]",
        "draft.max_new_tokens=12", "draft.max_prompt_tokens=64", "draft.gen_batch_size=4", "draft.max_seq_len=64",
        "draft.val_fraction=0.25", "draft.num_layers=1", "draft.block_size=4", f"draft.target_layer_ids={LAYERS}",
        "draft.draft_vocab_size=64", "draft.batch_size=4", "draft.num_workers=0", "draft.anchors_per_seq=4",
        "draft.eval_block_sizes=[2,4]", "draft.warmup_steps=1", "draft.trainer.max_steps=3",
        "draft.trainer.val_check_interval=3", "draft.trainer.limit_val_batches=1", "draft.trainer.accelerator=cpu",
        "draft.trainer.precision=bf16-mixed",
    ])
    assert cfg.draft.features == "online"
    assert train_drafter(cfg) == out
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["optimizer steps"] == 3 and stats["features"] == "online" and set(stats["val_tau"]) >= {"2", "4"}
    shards = sorted((tmp_path / "cache").rglob("shard-*.safetensors"))
    assert shards and all("features" not in s for p in shards for s in read_shard(p))
    DFlashDrafter.from_pretrained(out)


def test_draft_features_mode_is_checked(tiny, compose_config, tmp_path):
    from pipeline.drafting.trainer import train_drafter

    cfg = compose_config("draft", [f"model.target={tiny.target_dir('llama')}", "logger.enabled=false",
                                   f"paths.data={tmp_path}", "draft.features=stored"])
    with pytest.raises(ValueError, match="draft.features='stored'"):
        train_drafter(cfg)


def test_validation_runs_the_target_once_for_all_block_sizes(llama, prompt_ids, monkeypatch):
    results = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=10, with_features=False)
    sequences = [{"tokens": t, "prompt_length": len(p)} for (t, _), p in zip(results, prompt_ids)]
    batch = collate([AnchorDataset(sequences, 4, 0)[i] for i in range(len(sequences))])
    drafter = DFlashDrafter(make_drafter_config(llama.model.config, num_layers=1, block_size=4, target_layer_ids=LAYERS))
    module = DrafterModule(drafter, llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings().weight,
                           eval_block_sizes=(2, 4, 8), target_model=llama.model)
    logged = {}
    module.log = lambda name, value, **k: logged.__setitem__(name, value)
    calls = []
    real = module.target_features
    monkeypatch.setattr(module, "target_features", lambda *a: calls.append(1) or real(*a))
    module.validation_step(batch, 0)
    assert len(calls) == 1 and set(logged) == {"val/tau_b2", "val/tau", "val/tau_b8"}
