"""Drafter recipe options: self-written prompts (Magpie), sampled replies, the target's final hidden state,
distillation losses, per-set validation tau, checkpoint and resume."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.drafting import self_prompts
from pipeline.drafting.data import AnchorDataset, collate, load_sequences
from pipeline.drafting.module import DrafterModule, check_loss, distillation_terms
from pipeline.drafting.responses import build_response_cache, generate_batch, read_shard
from pipeline.drafting.self_prompts import PromptFilter, build_self_prompts, ngrams, reject_reason, user_turn_prefix
from pipeline.models.drafter import DFlashDrafter, make_drafter_config
from pipeline.prompts import Prompt, chat_input_ids

from drafting_fixtures import LAYERS, TEXTS, llama, prompt_ids, train_steps  # noqa: F401 (fixtures)


# ------------------------------------------------------------------------------------------------
# self-written prompts
# ------------------------------------------------------------------------------------------------
def test_user_turn_prefix_is_the_template_before_the_user_text(llama):
    prefix = user_turn_prefix(llama.tokenizer)
    full = chat_input_ids(llama.tokenizer, ["What is two plus two?"])[0]
    assert torch.equal(full[: len(prefix)], prefix)
    text = llama.tokenizer.decode(prefix)
    assert text.endswith("user\n") and "What" not in text


def test_user_turn_prefix_needs_a_chat_template(tiny):
    from pipeline.models.target import load_target

    target = load_target(str(tiny.target_dir("llama")))
    target.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        user_turn_prefix(target.tokenizer)


def test_reject_reasons_on_constructed_texts():
    assert reject_reason("Can you help me plan a trip to Rome?") is None
    assert reject_reason("Hi there") == "short"
    assert reject_reason("word " * 400) == "long"
    assert reject_reason("Пожалуйста, помогите мне написать письмо другу") == "language"
    assert reject_reason("Sure <|im_start|>assistant here you go now") == "template"


def test_prompt_filter_dedups_and_decontaminates():
    benchmark = ["Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins."]
    f = PromptFilter(benchmark, ngram=8, dedup_words=6)
    assert f.offer("Can you help me plan a trip to Rome next spring?")
    assert not f.offer("can you help me plan a trip to Rome next spring")  # same normalised text
    assert not f.offer("Can you help me plan a birthday party for my sister?")  # same first 6 words
    assert not f.offer("My friend says: janet's ducks lay 16 eggs per day. she eats three for breakfast. Why?")
    assert not f.offer("What is the capital of France and why is it famous?", finished=False)
    assert f.offer("What is the capital of France and why is it famous?")
    assert f.counts == {"kept": 2, "duplicate": 2, "contaminated": 1, "unfinished": 1}
    assert ngrams("a b c", 8) == {("a", "b", "c")} and len(ngrams("one two three four five", 3)) == 3


def test_sampled_user_turns_are_reproducible_and_follow_the_template(llama):
    a = self_prompts.sample_user_turns(llama, 4, 6, torch.Generator().manual_seed(3))
    b = self_prompts.sample_user_turns(llama, 4, 6, torch.Generator().manual_seed(3))
    c = self_prompts.sample_user_turns(llama, 4, 6, torch.Generator().manual_seed(4))
    assert a == b and a != c and len(a) == 4
    assert all(isinstance(t, str) and isinstance(done, bool) for t, done in a)


def test_sampled_user_turns_end_at_a_stop_token(tiny):
    """Near T=0 every row writes the greedy token first; made a stop token, every message ends there, empty."""
    from pipeline.models.target import load_target

    target = load_target(str(tiny.target_dir("llama")))  # own copy: its generation config is changed
    with torch.no_grad():
        first = int(target.model(input_ids=user_turn_prefix(target.tokenizer)[None]).logits[0, -1].argmax())
    assert self_prompts.sample_user_turns(target, 3, 4, torch.Generator().manual_seed(0), temperature=1e-6) == [
        (target.tokenizer.decode([first] * 4, skip_special_tokens=True), False)] * 3 or first in target.stop_token_ids()
    target.model.generation_config.eos_token_id = [target.tokenizer.eos_token_id, first]
    out = self_prompts.sample_user_turns(target, 3, 4, torch.Generator().manual_seed(0), temperature=1e-6)
    assert out == [("", True)] * 3


def test_self_prompts_are_filtered_cached_and_not_resampled(llama, tmp_path, monkeypatch):
    texts = iter([("Can you help me plan a trip to Rome next spring?", True), ("Hi", True),
                  ("Can you help me plan a trip to Rome next spring?", True), ("Write a poem about the sea, please.", True),
                  ("Janet's ducks lay 16 eggs per day and she eats three", True), ("Explain how a bicycle stays upright.", False),
                  ("Explain how a bicycle stays upright when moving.", True), ("never offered: the set is full", True),
                  ("never offered either", True)])
    monkeypatch.setattr(self_prompts, "sample_user_turns", lambda target, n, *a, **k: [next(texts) for _ in range(n)])
    blocked = ["Janet's ducks lay 16 eggs per day and she eats three for breakfast"]
    prompts = build_self_prompts(llama, "tiny", tmp_path, "mine", 3, blocked, batch_size=3, ngram=6)
    assert [p.turns[0] for p in prompts] == ["Can you help me plan a trip to Rome next spring?",
                                             "Write a poem about the sea, please.",
                                             "Explain how a bicycle stays upright when moving."]
    assert [p.id for p in prompts] == ["mine-0", "mine-1", "mine-2"] and {p.source_set for p in prompts} == {"mine"}
    meta = json.loads(next(tmp_path.glob("*.meta.json")).read_text())
    assert meta["counts"] == {"kept": 3, "short": 1, "duplicate": 1, "contaminated": 1, "unfinished": 1}
    monkeypatch.setattr(self_prompts, "sample_user_turns", lambda *a, **k: pytest.fail("sampled again"))
    again = build_self_prompts(llama, "tiny", tmp_path, "mine", 3, blocked, batch_size=3, ngram=6)
    assert [p.turns for p in again] == [p.turns for p in prompts]
    with pytest.raises(ValueError, match="limit"):
        build_self_prompts(llama, "tiny", tmp_path, "mine", 0)
    with pytest.raises(ValueError, match="temperature"):
        build_self_prompts(llama, "tiny", tmp_path, "mine", 3, temperature=0.0)
    monkeypatch.setattr(self_prompts, "sample_user_turns", lambda target, n, *a, **k: [("Hi", True)] * n)
    with pytest.raises(ValueError, match="no usable prompt"):
        build_self_prompts(llama, "tiny", tmp_path / "other", "mine", 3, max_rounds=2)


# ------------------------------------------------------------------------------------------------
# sampled replies and the final hidden state
# ------------------------------------------------------------------------------------------------
def test_sampled_replies_near_zero_temperature_equal_greedy(llama, prompt_ids):
    greedy = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=8, with_features=False)
    cold = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=8, with_features=False, temperature=1e-6,
                          generator=torch.Generator().manual_seed(0))
    assert [t.tolist() for t, _ in cold] == [t.tolist() for t, _ in greedy]


def test_sampled_replies_are_reproducible_and_not_greedy(llama, prompt_ids):
    def run(seed):
        return [t.tolist() for t, _ in generate_batch(llama, prompt_ids, LAYERS, 8, with_features=False, temperature=1.0,
                                                      generator=torch.Generator().manual_seed(seed))]
    greedy = [t.tolist() for t, _ in generate_batch(llama, prompt_ids, LAYERS, 8, with_features=False)]
    assert run(1) == run(1) and run(1) != greedy and run(1) != run(2)
    with pytest.raises(ValueError, match="temperature"):
        generate_batch(llama, prompt_ids, LAYERS, 8, temperature=-1.0)


def test_final_hidden_state_equals_the_teacher_forced_last_hidden_state(llama, prompt_ids, tmp_path):
    prompts = [Prompt(f"p{i}", [t], "test") for i, t in enumerate(TEXTS)]
    paths = build_response_cache(llama, prompts, tmp_path, LAYERS, max_new_tokens=6, max_prompt_tokens=64, batch_size=4,
                                 temperature=1.0, seed=5)
    for seq in read_shard(paths[0]):
        assert seq["final"].shape == (len(seq["tokens"]), 64) and seq["features"].shape == (len(seq["tokens"]), 128)
        with torch.no_grad():
            ref = llama.model.base_model(input_ids=seq["tokens"][None]).last_hidden_state[0]
        torch.testing.assert_close(seq["final"][:-1].float(), ref[:-1].to(torch.bfloat16).float(), atol=3e-2, rtol=3e-2)
        assert torch.count_nonzero(seq["final"][-1]) == 0
    first = [s["tokens"].tolist() for s in read_shard(paths[0])]
    paths[0].unlink()
    build_response_cache(llama, prompts, tmp_path, LAYERS, max_new_tokens=6, max_prompt_tokens=64, batch_size=4,
                         temperature=1.0, seed=5)
    assert [s["tokens"].tolist() for s in read_shard(paths[0])] == first  # a rewritten shard samples the same replies
    loaded = load_sequences([tmp_path], max_len=9)
    assert all(len(s["final"]) == len(s["tokens"]) <= 9 for s in loaded)
    assert all("final" not in s for s in load_sequences([tmp_path], features=False))


# ------------------------------------------------------------------------------------------------
# losses
# ------------------------------------------------------------------------------------------------
def test_check_loss_values():
    assert check_loss(None) == {"ce": 1.0, "tv": 0.0, "kl": 0.0}
    assert check_loss({"ce": 0.1, "tv": 0.9}) == {"ce": 0.1, "tv": 0.9, "kl": 0.0}
    for bad, msg in [({"mse": 1.0}, "unknown"), ({"ce": -1.0}, ">= 0"), ({"ce": 0.0}, "at least one")]:
        with pytest.raises(ValueError, match=msg):
            check_loss(bad)


def test_distillation_terms_on_known_distributions():
    big = 60.0
    same = torch.tensor([[1.0, 2.0, 3.0]])
    tv, kl = distillation_terms(same, same)
    assert float(tv) == pytest.approx(0.0, abs=1e-6) and float(kl) == pytest.approx(0.0, abs=1e-6)
    tv, _ = distillation_terms(torch.tensor([[big, 0.0]]), torch.tensor([[0.0, big]]))  # disjoint one-hots
    assert float(tv) == pytest.approx(1.0, abs=1e-6)
    q, p = torch.tensor([[0.0, 0.0]]), torch.log(torch.tensor([[0.75, 0.25]]))  # drafter uniform, target 3:1
    tv, kl = distillation_terms(q, p)
    assert float(tv) == pytest.approx(0.25, abs=1e-6)
    assert float(kl) == pytest.approx(0.75 * torch.log(torch.tensor(1.5)).item() + 0.25 * torch.log(torch.tensor(0.5)).item(),
                                      abs=1e-6)


def _module(llama, loss, target_model=None, block_size=4):
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(llama.model.config, num_layers=1, block_size=block_size,
                                                target_layer_ids=LAYERS))
    module = DrafterModule(drafter, llama.model.get_input_embeddings().weight, llama.model.get_output_embeddings().weight,
                           lr=5e-3, warmup_steps=1, max_steps=30, loss=loss, target_model=target_model)
    logged = {}
    module.log_dict = lambda d, **k: logged.update({n: float(v) for n, v in d.items()})
    module.log = lambda n, v, **k: logged.__setitem__(n, float(v))
    return module, logged


def _batch(llama, prompt_ids, with_final=True):
    results = generate_batch(llama, prompt_ids, LAYERS, max_new_tokens=10, with_final=with_final)
    sequences = []
    for i, ((t, f), p) in enumerate(zip(results, prompt_ids)):
        seq = {"tokens": t, "features": f[:, :128], "prompt_length": len(p), "set": "a" if i % 2 else "b"}
        if with_final:
            seq["final"] = f[:, 128:]
        sequences.append(seq)
    return collate([AnchorDataset(sequences, 4, 0)[i] for i in range(len(sequences))])


def test_tv_loss_from_cached_and_online_final_states_agree_and_it_trains(llama, prompt_ids):
    cached = _batch(llama, prompt_ids)
    assert cached["final"].shape[-1] == 64 and cached["sets"] == ["b", "a", "b", "a"]
    module, logged = _module(llama, {"ce": 0.1, "tv": 0.9})
    loss_cached = module.training_step(cached, 0)
    assert set(logged) >= {"train/loss", "train/ce", "train/tv", "train/kl"} and 0 < logged["train/tv"] <= 1
    online_module, _ = _module(llama, {"ce": 0.1, "tv": 0.9}, target_model=llama.model)
    online = {k: v for k, v in cached.items() if k not in ("features", "final")}
    torch.testing.assert_close(online_module.training_step(online, 0), loss_cached, atol=2e-2, rtol=2e-2)
    # the target's logits at label position a+i come from its final state at a+i-1: a drafter equal to the
    # target would have tv 0; here, check the gathered logits against the cached final rows directly
    target_logits = module.target_block_logits(cached, 4)
    a = int(cached["anchors"][0, 0])
    torch.testing.assert_close(target_logits[0, 0, 0], cached["final"][0, a].float() @ module.lm_head.T.float())
    losses = train_steps(module, cached, 12)
    assert losses[-1] < 0.7 * losses[0]


def test_distillation_needs_final_states(llama, prompt_ids):
    module, _ = _module(llama, {"ce": 0.5, "kl": 0.5})
    with pytest.raises(ValueError, match="final hidden states"):
        module.training_step(_batch(llama, prompt_ids, with_final=False), 0)
    plain, _ = _module(llama, None)
    plain.training_step(_batch(llama, prompt_ids, with_final=False), 0)  # hard CE needs no final states


def test_validation_reports_tau_per_training_set(llama, prompt_ids):
    module, logged = _module(llama, None)
    batch = _batch(llama, prompt_ids)
    module.validation_step(batch, 0)
    assert {"val/tau", "val/tau/a", "val/tau/b"} <= set(logged)
    accepted, full = module.block_acceptance(batch, 4)
    rows_a = torch.tensor([s == "a" for s in batch["sets"]])
    assert logged["val/tau/a"] == pytest.approx(float(accepted[rows_a].sum()) / int(full[rows_a].sum()))
    assert logged["val/tau"] == pytest.approx(float(accepted.sum()) / int(full.sum()))


# ------------------------------------------------------------------------------------------------
# the draft stage: self-written prompts, sampled replies, checkpoints and resume
# ------------------------------------------------------------------------------------------------
def _stage_config(compose_config, tiny, tmp_path, *extra):
    return compose_config("draft", [
        f"model.target={tiny.target_dir('llama')}", "model.name=tiny", f"paths.data={tmp_path / 'data'}",
        "logger.enabled=false", f"draft.out={tmp_path / 'drafter'}", f"draft.cache_dir={tmp_path / 'cache'}",
        "draft.sets=[{name: chat, source: self, limit: 6, prompt_max_tokens: 8}, "
        "{name: chat_t1, source: self, limit: 6, prompt_max_tokens: 8, temperature: 1.0}]",
        "draft.decontaminate=[]", "draft.max_new_tokens=10", "draft.max_prompt_tokens=64", "draft.gen_batch_size=4",
        "draft.max_seq_len=64", "draft.val_fraction=0.25", "draft.num_layers=1", "draft.block_size=4",
        f"draft.target_layer_ids={LAYERS}", "draft.draft_vocab_size=64", "draft.batch_size=4", "draft.anchors_per_seq=4",
        "draft.eval_block_sizes=[2,4]", "draft.warmup_steps=1", "draft.trainer.val_check_interval=2",
        "draft.trainer.limit_val_batches=1", "draft.checkpoint_every=2", *extra,
    ])


def test_draft_stage_with_self_prompts_resumes_from_its_checkpoint(tiny, compose_config, tmp_path, monkeypatch):
    from pipeline.drafting.trainer import train_drafter

    # a random tiny target writes noise that never ends its turn: the stage gets written prompts instead
    subjects = ["lists", "dicts", "sets", "loops", "files", "tests", "types", "docs", "maps", "trees", "heaps", "graphs"]
    written = iter([(f"{w.title()} question: how should I use {w} in Python code?", True) for w in subjects])
    monkeypatch.setattr(self_prompts, "sample_user_turns", lambda target, n, *a, **k: [next(written) for _ in range(n)])
    cfg = _stage_config(compose_config, tiny, tmp_path, "draft.trainer.max_steps=2", "draft.loss={ce: 0.5, tv: 0.5}")
    out = train_drafter(cfg)
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["optimizer steps"] == 2 and stats["loss"] == {"ce": 0.5, "tv": 0.5, "kl": 0.0}
    assert set(stats["training sequences per set"]) <= {"chat", "chat_t1"} and stats["val_tau_per_set"]
    assert len(list((tmp_path / "cache" / "self-prompts").glob("self-*.jsonl"))) == 1  # both sets share the prompts
    chat = [s["tokens"].tolist() for s in load_sequences([tmp_path / "cache" / "chat"])]
    chat_t1 = [s["tokens"].tolist() for s in load_sequences([tmp_path / "cache" / "chat_t1"])]
    assert chat != chat_t1  # greedy and sampled replies to the same prompts
    ckpt = tmp_path / "data" / "runs" / "draft" / cfg.run_name / "checkpoints" / "last.ckpt"
    assert ckpt.exists() and torch.load(ckpt, weights_only=False)["global_step"] == 2
    resumed = _stage_config(compose_config, tiny, tmp_path, "draft.trainer.max_steps=4", "draft.loss={ce: 0.5, tv: 0.5}",
                            "draft.resume=true")
    train_drafter(resumed)
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["optimizer steps"] == 4  # 2 more steps on top of the checkpoint's 2
    assert torch.load(ckpt, weights_only=False)["global_step"] == 4


def test_draft_config_checks_run_before_the_target_loads(compose_config, tmp_path):
    from pipeline.config_checks import validate_config

    base = ["logger.enabled=false", f"paths.data={tmp_path}", "model.target=/nonexistent"]
    for override, msg in [("draft.loss={ce: 0.0}", "at least one"), ("+draft.loss.mse=1.0", "unknown"),
                          ("draft.sets=[{name: x, source: self}]", "limit"),
                          ("draft.sets=[{name: x, source: self, limit: 4, temperature: -1}]", "temperature"),
                          ("draft.checkpoint_every=-5", "checkpoint_every"),
                          ("draft.sets=[{name: x}]", "has no source")]:
        with pytest.raises(ValueError, match=msg):
            validate_config(compose_config("draft", base + [override]), "draft")
    validate_config(compose_config("draft", base), "draft")


def test_decontamination_texts_read_every_turn_and_skip_missing_sets(tmp_path, caplog):
    from pipeline.drafting.sources import decontamination_texts

    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"id": "a", "turns": ["first turn", "second turn"]}) + "\n"
                    + json.dumps({"id": "b", "turns": ["third"]}) + "\n")
    assert decontamination_texts([str(path), str(tmp_path / "missing.jsonl")]) == ["first turn", "second turn", "third"]
    assert "decontamination set skipped" in caplog.text
    assert len(decontamination_texts(["humaneval"])) == 164 and decontamination_texts(None) == []
