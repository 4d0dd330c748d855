"""The automatic prefix cache (``pipeline.decoding.prefix_cache``): the store against a restatement of its policy
without hashes and against the longest common block-aligned prefix computed directly, its hash chain and equality
check, LRU and byte bound, the strictly-shorter rule and vLLM's counters; then decoding with it on = off token for token
(hits and misses, bit-equal logits, features and keys) on the tiny targets, through the batching scheduler, through the
server (``/metrics``, ``/health``, ``usage``), and on the embedded SmolLM2 (slow) with a chat's second turn."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from transformers import DynamicCache, Gemma2Config, LlamaConfig

import pipeline.decoding.prefix_cache as prefix_module
from conftest import composed
from pipeline.decoding import DecodeConfig
from pipeline.decoding.prefix_cache import MIB, PrefixCache, block_key, prefix_cache_for
from pipeline.models.cache import HEADROOM, PreallocatedCache, PreallocatedLayer

LAYERS, HEADS, DIM, FEATS = 2, 2, 3, 5


# ----------------------------------------------------------------------------------------------------------------------
# fake prefills: keys that depend on the whole prefix, as a target's do
# ----------------------------------------------------------------------------------------------------------------------
def config() -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                       num_key_value_heads=HEADS, head_dim=DIM, vocab_size=16)


def empty_cache(kind: str = "dynamic", tokens: int | None = None):
    return PreallocatedCache(config=config(), tokens=tokens) if kind == "preallocated" else DynamicCache(config=config())


def prefix_states(ids) -> torch.Tensor:
    """[n] a rolling hash of each position's whole prefix (exact in float32)."""
    out, h = [], 0
    for t in ids:
        h = (h * 31 + int(t) + 1) % 1009
        out.append(float(h))
    return torch.tensor(out)


def fake_prefill(ids, kind: str = "dynamic"):
    """(a cache over ``ids`` whose position p holds keys and values of prefix p, [1, n, FEATS] features)."""
    cache, base = empty_cache(kind), prefix_states(ids)[None, None, :, None]
    for layer in range(LAYERS):
        keys = base + torch.arange(HEADS)[None, :, None, None] * 0.5 + torch.arange(DIM) * 0.25 + layer
        cache.update(keys.contiguous(), (-keys).contiguous(), layer)
    return cache, (prefix_states(ids)[None, :, None] + torch.arange(FEATS)).contiguous()


def block_bytes(bt: int, features: bool) -> int:
    return LAYERS * 2 * HEADS * bt * DIM * 4 + (bt * FEATS * 4 if features else 0)


def assert_restores(cache: PrefixCache, ids, prefix, hit: int, kind: str = "dynamic") -> None:
    """The restored cache holds exactly the keys, values and features of a prefill of ``ids[:hit]``."""
    target = empty_cache(kind, tokens=len(ids))
    features = cache.restore(prefix, target)
    reference, ref_features = fake_prefill(ids[:hit], kind)
    assert target.get_seq_length() == hit
    for got, want in zip(target.layers, reference.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    if features is not None:
        assert torch.equal(features, ref_features)


class Reference:
    """``PrefixCache``'s policy restated without hashes: each block keyed by its whole prefix (a tuple of tokens),
    holding whether it has features; touched leaf first and root last, evicted from the least recently used."""

    def __init__(self, max_bytes: int, bt: int):
        self.max_bytes, self.bt = max_bytes, bt
        self.blocks: OrderedDict[tuple, bool] = OrderedDict()
        self.queries = self.hits = 0

    @property
    def bytes(self) -> int:
        return sum(block_bytes(self.bt, f) for f in self.blocks.values())

    def _touch(self, chain) -> None:
        for key in reversed(chain):
            self.blocks.move_to_end(key)

    def lookup(self, ids, want: bool) -> int:
        chain = []
        for i in range((len(ids) - 1) // self.bt):
            key = tuple(ids[: (i + 1) * self.bt])
            if key not in self.blocks or (want and not self.blocks[key]):
                break
            chain.append(key)
        self._touch(chain)
        self.queries += len(ids)
        self.hits += len(chain) * self.bt
        return len(chain) * self.bt

    def store(self, ids, features: bool) -> None:
        blocks = min(len(ids) // self.bt, self.max_bytes // block_bytes(self.bt, features))
        chain = []
        for i in range(blocks):
            key = tuple(ids[: (i + 1) * self.bt])
            self.blocks[key] = self.blocks.get(key, False) or features
            chain.append(key)
        self._touch(chain)
        while self.bytes > self.max_bytes:
            self.blocks.popitem(last=False)


def random_prompts(rng: random.Random, count: int, vocab: int = 3, longest: int = 30) -> list[list[int]]:
    """Prompts that often share prefixes: each one a random prefix of an earlier one plus random tokens."""
    out: list[list[int]] = []
    for _ in range(count):
        base = rng.choice(out)[: rng.randint(0, longest)] if out and rng.random() < 0.8 else []
        out.append(base + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
    return out


# ----------------------------------------------------------------------------------------------------------------------
# (a) the store alone
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_lookup_is_the_longest_common_block_prefix_strictly_shorter_than_the_prompt(seed):
    """Without eviction a hit is, computed directly, the longest common block-aligned prefix with any stored prompt
    (stored with features, when the lookup wants them), capped one token short of the prompt; restoring it gives the
    prefix's own keys, values and features."""
    rng, bt = random.Random(seed), 4
    cache = PrefixCache(64 * MIB, block_tokens=bt)
    stored: list[tuple[list[int], bool]] = []
    queries = hits = 0
    for ids in random_prompts(rng, 60):
        want = rng.random() < 0.6
        best = 0
        for other, featured in stored:
            if want and not featured:
                continue
            common = 0
            while common < min(len(ids), len(other)) and ids[common] == other[common]:
                common += 1
            best = max(best, common // bt * bt)
        expected = min(best, (len(ids) - 1) // bt * bt)
        hit, prefix = cache.lookup(ids, want_features=want)
        assert hit == expected and (prefix is None) == (hit == 0)
        if prefix is not None:
            assert prefix.tokens == hit
            assert_restores(cache, ids, prefix, hit, rng.choice(["dynamic", "preallocated"]))
            if want:
                assert prefix.features() is not None
        queries, hits = queries + len(ids), hits + hit
        assert (cache.queries, cache.hits) == (queries, hits)
        kv, features = fake_prefill(ids)
        cache.store(ids, kv, features if want else None)
        stored.append((ids, want))
    blocks = {tuple(ids[: (i + 1) * bt]) for ids, _ in stored for i in range(len(ids) // bt)}
    assert cache.entries == len(blocks)  # a block shared by many prompts is stored once


@pytest.mark.parametrize("seed", range(4))
def test_lru_eviction_and_the_byte_bound_follow_the_reference(seed):
    """Under a budget of a few blocks, hits, bytes and stored blocks follow the hash-free restatement of the policy
    after every lookup and store, never exceed the budget, and every hit restores its prefix's own states."""
    rng, bt = random.Random(100 + seed), 4
    budget = block_bytes(bt, True) * rng.randint(2, 7) + rng.randint(0, block_bytes(bt, False))
    cache, reference = PrefixCache(budget, block_tokens=bt), Reference(budget, bt)
    for ids in random_prompts(rng, 80, longest=24):
        want = rng.random() < 0.5
        hit, prefix = cache.lookup(ids, want_features=want)
        assert hit == reference.lookup(ids, want)
        if prefix is not None:
            assert_restores(cache, ids, prefix, hit)
        kv, features = fake_prefill(ids)
        cache.store(ids, kv, features if want else None)
        reference.store(ids, want)
        assert cache.bytes == reference.bytes <= budget
        assert cache.entries == len(reference.blocks)
        assert (cache.queries, cache.hits) == (reference.queries, reference.hits)


def test_strictly_shorter_rule_and_a_prefix_of_a_longer_stored_prompt():
    cache = PrefixCache(MIB, block_tokens=16)
    ids = list(range(64))
    cache.store(ids, fake_prefill(ids)[0])
    assert cache.entries == 4
    assert cache.lookup(ids)[0] == 48  # the whole prompt is stored, but one token must run: the last full block is not
    assert cache.lookup(ids[:40])[0] == 32  # a prefix of the longer stored prompt hits
    assert cache.lookup(ids[:33])[0] == 32 and cache.lookup(ids[:32])[0] == 16
    assert cache.lookup(ids[:16]) == (0, None)
    assert cache.lookup(ids + [5])[0] == 64
    assert cache.lookup([1] + ids)[0] == 0  # the same blocks at other positions are other prefixes
    assert cache.queries == 64 + 40 + 33 + 32 + 16 + 65 + 65 and cache.hits == 48 + 32 + 32 + 16 + 64
    short = list(range(100, 110))  # shorter than a block: nothing to store
    assert cache.store(short, fake_prefill(short)[0]) == 0 and cache.entries == 4


def test_hash_chain_keys_depend_on_the_whole_prefix():
    import numpy as np

    a, b, c = (np.array(x, dtype=np.int64) for x in ([1, 2], [3, 4], [5, 6]))
    root_a, root_c = block_key(b"", a), block_key(b"", c)
    assert block_key(root_a, b) == block_key(block_key(b"", a.copy()), b.copy())
    assert block_key(root_a, b) != block_key(root_c, b) != block_key(b"", b)
    assert block_key(b"", np.array([1, 2, 3, 4])) != block_key(root_a, b)  # not a hash of the concatenation


def test_hash_collisions_never_give_a_false_hit(monkeypatch):
    """With keys that collide for every prompt of the same length, a lookup still compares the actual tokens (and the
    parent block): another prompt misses, a stored prompt keeps hitting, and a colliding store keeps the stored one."""
    monkeypatch.setattr(prefix_module, "block_key", lambda parent, tokens: parent + b".")
    cache = PrefixCache(MIB, block_tokens=4)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0, 0, 0, 9]
    cache.store(a, fake_prefill(a)[0])
    assert cache.lookup([7, 7, 7, 7, 7]) == (0, None)
    hit, prefix = cache.lookup(b)
    assert hit == 4  # the first block is truly shared; the second collides and is refused
    cache.store(b, fake_prefill(b)[0])
    assert cache.entries == 2
    hit, prefix = cache.lookup(a)
    assert hit == 8
    assert_restores(cache, a, prefix, 8)
    assert cache.lookup(b)[0] == 4


def test_blocks_without_features_serve_only_requests_that_want_none():
    cache = PrefixCache(MIB, block_tokens=4)
    ids = list(range(13))
    kv, features = fake_prefill(ids)
    cache.store(ids, kv)  # a B = 1 prefill: no features
    assert cache.lookup(ids, want_features=False)[0] == 12
    assert cache.lookup(ids, want_features=True) == (0, None)
    before = cache.bytes
    cache.store(ids, kv, features)  # a drafting prefill fills them in
    assert cache.entries == 3 and cache.bytes == before + 3 * 4 * FEATS * 4
    hit, prefix = cache.lookup(ids, want_features=True)
    assert hit == 12 and torch.equal(prefix.features(), features[:, :12])


@pytest.mark.parametrize("kind", ["dynamic", "preallocated"])
def test_a_restored_cache_is_the_requests_own(kind):
    """Writes into a restored cache (the decode's) leave the stored blocks alone, and a preallocated layer's buffer
    holds the whole request it was sized for (its ``tokens``), beyond the prefix plus its headroom."""
    cache = PrefixCache(MIB, block_tokens=4)
    ids = list(range(20))
    cache.store(ids, fake_prefill(ids, kind)[0])
    hit, prefix = cache.lookup(ids)
    mine = empty_cache(kind, tokens=hit + HEADROOM + 50)
    cache.restore(prefix, mine)
    if kind == "preallocated":
        assert all(type(layer) is PreallocatedLayer and layer.capacity == hit + HEADROOM + 50 for layer in mine.layers)
    for layer in mine.layers:
        layer.keys.fill_(-1.0)
        layer.update(torch.zeros(1, HEADS, 4, DIM), torch.zeros(1, HEADS, 4, DIM))
    assert_restores(cache, ids, cache.lookup(ids)[1], hit, kind)
    with pytest.raises(ValueError, match="empty cache"):
        cache.restore(prefix, mine)


def test_off_unsupported_and_mismatched_caches():
    off = PrefixCache(0)
    ids = list(range(40))
    kv, _ = fake_prefill(ids)
    assert off.store(ids, kv) == 0 and off.lookup(ids) == (0, None) and off.queries == 0 and not off.enabled
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(-1)
    sliding = DynamicCache(config=Gemma2Config(num_hidden_layers=2, sliding_window=8, head_dim=4, hidden_size=8,
                                               num_attention_heads=2, num_key_value_heads=1))
    assert not PrefixCache.supports(sliding) and PrefixCache.supports(empty_cache())
    assert not PrefixCache.supports(DynamicCache())  # no layers to fill
    cache = PrefixCache(MIB, block_tokens=4)
    cache.store(ids, kv)
    other = DynamicCache()  # three layers of another shape
    for i in range(3):
        other.update(torch.zeros(1, 1, 40, 2), torch.zeros(1, 1, 40, 2), i)
    with pytest.raises(ValueError, match="one PrefixCache serves one decoder"):
        cache.store(ids, other)
    assert cache.stats() == {"max_bytes": MIB, "block_tokens": 4, "bytes": 10 * block_bytes(4, False), "entries": 10,
                             "tokens": 40, "queries": 0, "hits": 0, "hit_rate": 0.0}


# ----------------------------------------------------------------------------------------------------------------------
# (b) decoding with the cache on = off
# ----------------------------------------------------------------------------------------------------------------------
def prompts_sharing_prefixes(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab, (1, 70), generator=g)
    return {"base": base, "longer": torch.cat([base, torch.randint(3, vocab, (1, 41), generator=g)], 1),
            "branch": torch.cat([base[:, :37], torch.randint(3, vocab, (1, 20), generator=g)], 1)}


def assert_same_prefill(got, want) -> None:
    assert torch.equal(got.input_ids, want.input_ids) and got.first_token == want.first_token
    assert torch.equal(got.last_logits, want.last_logits)
    assert (got.features is None) == (want.features is None)
    if got.features is not None:
        assert torch.equal(got.features, want.features)
    assert got.cache.get_seq_length() == want.cache.get_seq_length()
    for a, b in zip(got.cache.layers, want.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_finished_request_stores_its_output_for_the_next_turn(smallm_decoder, block_size):
    """A request that ends stores its prompt and output (positions its cache holds): the next turn, which repeats both
    and adds a question, hits all of them but the blocks it must compute, with a full prefill's bits."""
    decoder = smallm_decoder
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, decoder.lm_head.shape[0], (1, 40), generator=g)
    config = DecodeConfig(30)
    decoder.prefix_cache = PrefixCache(16 * MIB)
    try:
        out = decoder.generate(first, block_size, config).output_ids
        second = torch.cat([first, torch.tensor([out]), torch.randint(3, decoder.lm_head.shape[0], (1, 9), generator=g)], 1)
        cached = decoder.prefill(second, config, want_features=False)
        decoder.prefix_cache = None
        plain = decoder.prefill(second, config, want_features=False)
    finally:
        decoder.prefix_cache = None
    stored = 40 + len(out) - 1  # the last output token was never fed to the target
    assert cached.cached_tokens == stored // 16 * 16 > 40
    assert_same_prefill(cached, plain)


@pytest.mark.parametrize("chunk", [None, 16, 24])
def test_prefills_and_decodes_with_the_cache_equal_those_without(smallm_decoder, chunk):
    """On the native stack (both tiny archs): misses and hits (the same prompt again, a longer one, a branch, with and
    without features), in chunks or not, give a full prefill's bits and the same outputs, for B = 1 and B = 4."""
    decoder = smallm_decoder
    assert decoder.prefill_invariant
    decoder.prefill_chunk = chunk
    prompts = prompts_sharing_prefixes(decoder.lm_head.shape[0])
    config = DecodeConfig(24)
    order = [("base", 4), ("base", 4), ("longer", 4), ("longer", 1), ("branch", 1), ("branch", 4), ("longer", 4)]
    cache = PrefixCache(16 * MIB)
    hits = []
    try:
        for name, block_size in order:
            ids, want = prompts[name], block_size > 1
            decoder.prefix_cache = None
            plain = decoder.prefill(ids, config, want_features=want)
            decoder.prefix_cache = cache
            cached = decoder.prefill(ids, config, want_features=want)
            hits.append(cached.cached_tokens)
            assert_same_prefill(cached, plain)  # before the decodes write into the caches
            plain_out = decoder.decode(plain, block_size, config).output_ids
            assert decoder.decode(cached, block_size, config).output_ids == plain_out
            decoder.prefix_cache = None
            assert decoder.generate(ids, block_size, config).output_ids == plain_out
    finally:
        decoder.prefix_cache, decoder.prefill_chunk = None, None
    # base: a miss, then 64 of its 70; longer: the base's 64, then its own 6 blocks; branch: the base's first 32 (B = 1:
    # its third block is stored without features), then drafting: the same 32 (its third block cannot serve features)
    assert hits == [0, 64, 64, 96, 32, 32, 96]
    assert cache.queries == sum(prompts[n].shape[1] for n, _ in order) and cache.hits == sum(hits)


def test_the_batching_scheduler_gets_the_same_outputs_with_the_cache(smallm_decoder):
    """``decode_all`` (the server's scheduler: chunked prefills between batched steps) over prompts sharing a prefix."""
    from pipeline.decoding.scheduler import decode_all

    decoder = smallm_decoder
    decoder.prefill_chunk = 16
    prompts = list(prompts_sharing_prefixes(decoder.lm_head.shape[0], seed=1).values()) * 2
    configs = [DecodeConfig(20 + i) for i in range(len(prompts))]
    schedules = [4, 1, 4, 8, 4, 1]
    try:
        plain = [r.stats.output_ids for r in decode_all(decoder, prompts, schedules, configs, max_batch=2)]
        decoder.prefix_cache = PrefixCache(16 * MIB)
        cached = decode_all(decoder, prompts, schedules, configs, max_batch=2)
    finally:
        decoder.prefix_cache, decoder.prefill_chunk = None, None
    assert [r.stats.output_ids for r in cached] == plain
    # base: a miss; longer (B = 1): base's 64; branch (drafting): base's first 32 with their features; then again, the
    # longer prompt (drafting) only as far as blocks with features go (its own two were stored by a B = 1 prefill)
    assert [r.stats.cached_tokens for r in cached] == [0, 64, 32, 64, 64, 48]


def test_the_prefix_cache_keeps_only_what_the_kv_budget_leaves_free(smallm_decoder):
    """A scheduler with a KV budget: after every tick the prefix cache's bytes and the slots' reservations fit the
    budget together (its least recently used blocks go first); outputs unchanged."""
    from pipeline.decoding.batched import BatchedDecoder
    from pipeline.decoding.scheduler import Entry, Scheduler

    decoder = smallm_decoder
    prompts = list(prompts_sharing_prefixes(decoder.lm_head.shape[0], seed=1).values()) * 2
    configs = [DecodeConfig(12) for _ in prompts]
    plain = [decoder.generate(p, 4, c).output_ids for p, c in zip(prompts, configs)]
    need = max((p.numel() + 12) * decoder.kv_bytes_per_token for p in prompts)
    budget = 2 * need  # room for two requests; the cache may hold what they leave free
    decoder.prefix_cache = PrefixCache(64 * MIB)
    try:
        scheduler = Scheduler(BatchedDecoder(decoder), max_batch=4, kv_budget=budget)
        entries = [Entry(i, p, c, 4) for i, (p, c) in enumerate(zip(prompts, configs))]
        for e in entries:
            scheduler.submit(e)
        seen = []
        while scheduler.busy:
            scheduler.tick()
            seen.append((scheduler.kv_reserved, decoder.prefix_cache.bytes))
            assert scheduler.kv_reserved + decoder.prefix_cache.bytes <= budget, seen[-1]
        outputs = [e.request.stats.output_ids for e in entries]
    finally:
        decoder.prefix_cache = None
    assert outputs == plain
    assert max(b for _, b in seen) > 0 and any(r > need for r, _ in seen)  # the cache held blocks; two requests ran


def test_a_prefill_that_depends_on_its_chunks_does_not_use_the_cache(tiny):
    """On transformers' forward (eager) a chunk's bits depend on its shape: the cache is not consulted there."""
    decoder = tiny.decoder("llama", "random")
    assert not decoder.prefill_invariant
    assert prefix_cache_for(decoder, 8) is None  # what the server builds for it
    decoder.prefix_cache = cache = PrefixCache(16 * MIB)
    ids = prompts_sharing_prefixes(decoder.lm_head.shape[0])["base"]
    for _ in range(2):
        assert decoder.prefill(ids, DecodeConfig(8)).cached_tokens == 0
    assert cache.queries == 0 and cache.entries == 0


def test_the_servers_prefix_cache_for_a_decoder(smallm_decoder):
    assert prefix_cache_for(smallm_decoder, 0) is None
    assert prefix_cache_for(smallm_decoder, 1.5).max_bytes == int(1.5 * MIB)
    with pytest.raises(ValueError, match=">= 0"):
        prefix_cache_for(smallm_decoder, -1)


# ----------------------------------------------------------------------------------------------------------------------
# (c) through the server
# ----------------------------------------------------------------------------------------------------------------------
def metric_values(client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_a_prompt_sent_twice_gets_the_same_text_and_metrics_count_the_hit(tiny, restore_eager):
    """``build_engine`` gives a native-stack decoder its prefix cache (``serve.prefix_cache_mb``); the same chat sent
    again (plain, then streamed) gets the same text and token ids, ``usage.prompt_tokens_details.cached_tokens`` says
    what was hit, and ``/metrics`` and ``/health`` count it as vLLM does."""
    import json

    from pipeline.prompts import messages_input_ids
    from pipeline.serve import build_engine
    from pipeline.serving.app import create_app

    overrides = [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
                 "model.name=tiny", "model.backend=smallm", "model.prefill_chunk=16", "serve.policy=fixed",
                 "serve.max_batch=2", "serve.prefix_cache_mb=8"]
    with composed("serve", overrides) as cfg:
        engine = build_engine(cfg)
    cache = engine.decoder.prefix_cache
    assert isinstance(cache, PrefixCache) and cache.max_bytes == 8 * MIB
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 3},
                {"role": "user", "content": "Write a function that returns the sum of a list of numbers."}]
    n = messages_input_ids(engine.tokenizer, messages).shape[1]
    hit = (n - 1) // 16 * 16
    assert hit >= 32
    body = {"model": "tiny", "messages": messages, "max_tokens": 24, "return_token_ids": True}
    try:
        with TestClient(create_app(engine), base_url="http://localhost") as client:
            before = metric_values(client)
            first = client.post("/v1/chat/completions", json=body).json()
            again = client.post("/v1/chat/completions", json=body).json()
            streamed = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                                 "stream_options": {"include_usage": True}}).text
            after = metric_values(client)
            health = client.get("/health").json()["prefix_cache"]
    finally:
        engine.close()
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.splitlines() if line.startswith("data: {")]
    text = first["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == text and text
    assert again["blockpilot"]["token_ids"] == first["blockpilot"]["token_ids"] == chunks[-1]["blockpilot"]["token_ids"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert "prompt_tokens_details" not in first["usage"]  # the miss
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": hit} and again["usage"]["prompt_tokens"] == n
    assert chunks[-1]["usage"] == again["usage"]
    assert before["vllm:prefix_cache_queries_total"] == 0 and before["vllm:prefix_cache_hits_total"] == 0
    assert after["vllm:prefix_cache_queries_total"] == 3 * n and after["vllm:prefix_cache_hits_total"] == 2 * hit
    out = len(first["blockpilot"]["token_ids"])  # each request ends by storing its prompt and output, but the last
    assert health["queries"] == 3 * n and health["hits"] == 2 * hit and health["entries"] == (n + out - 1) // 16
    assert health["bytes"] == cache.bytes > 0


def test_a_negative_prefix_cache_size_is_refused_before_any_model_loads(compose_config):
    from pipeline.config_checks import validate_config

    with pytest.raises(ValueError, match=r"serve\.prefix_cache_mb=-1.*>= 0.*serve\.prefix_cache_mb=256"):
        validate_config(compose_config("serve", ["serve.prefix_cache_mb=-1"]), "serve")
    with pytest.raises(ValueError, match=r"serve\.prefix_cache_mb"):
        validate_config(compose_config("serve", ["serve.prefix_cache_mb=lots"]), "serve")


# ----------------------------------------------------------------------------------------------------------------------
# the embedded SmolLM2 (slow)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["exact", "auto"])
def test_smollm2_hits_give_a_full_prefills_bits_and_a_chats_second_turn_reuses_the_first(compose_config, precision):
    """The embedded target and shipped drafter on the eval config's forward path (native stack, prefills in chunks of
    256): a prompt over two chunks sent again, a longer prompt, and a two-turn chat (its second turn's prompt starts
    with the first's) give bit-equal prefills and the same outputs with the cache as without."""
    from conftest import require
    from pipeline.decoding.build import build_decoder
    from pipeline.decoding.conversation import decode_prompt
    from pipeline.prompts import Prompt, chat_input_ids, load_prompt_set
    from test_real_model import SHIPPED_DRAFTER

    require((SHIPPED_DRAFTER / "config.json").exists(), "the shipped drafter is not there yet (make draft)")
    decoder = build_decoder(compose_config("evaluate", [f"model.precision={precision}"]).model)
    assert decoder.prefill_invariant and decoder.prefill_chunk == 256
    tokenizer = decoder.target.tokenizer
    problems = [p.turns[0] for p in load_prompt_set("humaneval", limit=4)]
    long_turn = "\n\n".join(problems[:3])
    ids = chat_input_ids(tokenizer, [long_turn])
    longer = chat_input_ids(tokenizer, [long_turn + "\n\n" + problems[3]])
    assert ids.shape[1] > 300
    config = DecodeConfig(24)
    cache = PrefixCache(64 * MIB)
    for prompt, block_size, stored in ((ids, 8, []), (ids, 8, [ids]), (longer, 1, [ids])):
        decoder.prefix_cache = None
        plain = decoder.prefill(prompt, config, want_features=block_size > 1)
        decoder.prefix_cache = cache
        cached = decoder.prefill(prompt, config, want_features=block_size > 1)
        assert_same_prefill(cached, plain)
        plain_out = decoder.decode(plain, block_size, config).output_ids
        assert decoder.decode(cached, block_size, config).output_ids == plain_out
        assert cached.cached_tokens == expected_hit(stored, prompt)
    chat = Prompt("chat", [problems[0], "Now write tests for it."], "humaneval")
    decoder.prefix_cache = None
    plain = decode_prompt(decoder, chat, lambda: 8, config)
    decoder.prefix_cache = PrefixCache(64 * MIB)
    cached = decode_prompt(decoder, chat, lambda: 8, config)
    decoder.prefix_cache = None
    assert [s.output_ids for s in cached] == [s.output_ids for s in plain]
    first = chat_input_ids(tokenizer, chat.turns[:1])
    second = chat_input_ids(tokenizer, chat.turns, [tokenizer.decode(cached[0].output_ids, skip_special_tokens=True)])
    assert cached[0].cached_tokens == 0 and cached[1].cached_tokens == expected_hit([first], second) > 0


def expected_hit(stored: list[torch.Tensor], ids: torch.Tensor, bt: int = 16) -> int:
    """The hit computed directly: the longest common prefix of ``ids`` with a stored prompt, in whole blocks, strictly
    shorter than ``ids``."""
    ids = ids.reshape(-1).tolist()
    best = 0
    for other in stored:
        other = other.reshape(-1).tolist()
        common = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
        best = max(best, common // bt * bt)
    return min(best, (len(ids) - 1) // bt * bt)
