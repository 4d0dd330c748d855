"""Releasing the float32 weights a decoder's native forward never reads (``pipeline.models.release``), and the
server's resident memory (``/health``, ``/metrics``).

- a released decoder decodes the ids of an unreleased one (B=1, drafted, batched), on exact and int8 products, on a
  tiny target with a q8 tied embedding (its lookups then read the LM head's packed rows) and on the embedded SmolLM2;
- a path that needs a released weight (transformers' forward on either cache, a state dict, the drafter's
  head rows) raises ``ReleasedWeightError`` naming it; a decoder off the native stack is refused;
- the server releases what it built (the drafter's weights, and a whole-vocabulary drafter's head rows, kept when it
  records) and reports its resident memory.
"""

from __future__ import annotations

import sys

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from conftest import composed, require
from pipeline import PROJECT_ROOT
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.decoding.scheduler import decode_all
from pipeline.models.backend import set_backend, smallm_available
from pipeline.models.drafter import DFlashDrafter
from pipeline.models.native import int8_dot_available
from pipeline.models.release import ReleasedWeight, ReleasedWeightError, release_unused_weights
from pipeline.models.target import load_target
from pipeline.prompts import chat_input_ids
from pipeline.serving.app import create_app

needs_smallm = pytest.mark.skipif(not smallm_available(), reason="the smallm kernel does not build on this CPU")
PROMPTS = ["Write a function that returns the sum of a list of numbers.", "def add(a, b):",
           "Natalia sold clips to 48 of her friends in April."]
MODEL = "tiny"


def q8_exact(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] rounded to GGUF Q8_0's values (a float16 scale per row and group of 32): what a q8 GGUF dequantizes
    to, so that the smallm backend packs it as q8."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)).clamp(-127, 127), 0.0) + 0.0  # no -0.0
    return (d * q).view(n, k)


@pytest.fixture(scope="module")
def q8_target(tiny, tmp_path_factory):
    """The tiny Llama target with every matrix (its tied embedding / LM head included) on GGUF Q8_0's values."""
    out = tmp_path_factory.mktemp("q8-target")
    model = AutoModelForCausalLM.from_pretrained(tiny.target_dir("llama"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(q8_exact(p))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny.target_dir("llama")).save_pretrained(out)
    return out


def native_decoder(target_dir, drafter_dir, precision: str = "exact", draft_precision: str = "auto"
                   ) -> SpeculativeDecoder:
    """A fresh decoder of its own (nothing shared with other tests) on the native stack."""
    return SpeculativeDecoder(load_target(str(target_dir)), DFlashDrafter.from_pretrained(drafter_dir), backend="smallm",
                              precision=precision, draft_precision=draft_precision)


def decodes(decoder) -> list[list[int]]:
    """Output ids of the prompts at B=1 and B=4 alone, and batched together at B=4."""
    ids = [chat_input_ids(decoder.target.tokenizer, [text]) for text in PROMPTS]
    config = DecodeConfig(24, 0.0, 0)
    alone = [decoder.generate(i, b, config).output_ids for i in ids for b in (1, 4)]
    batched = decode_all(decoder, ids, [4] * len(ids), [config] * len(ids), max_batch=len(ids))
    return alone + [r.stats.output_ids for r in batched]


@needs_smallm
@pytest.mark.parametrize("precision, draft_precision", [("exact", "exact"), ("int8", "auto")])
def test_a_released_decoder_decodes_the_ids_of_an_unreleased_one(tiny, q8_target, precision, draft_precision):
    """Exact products (both LM heads on the q8 panels of the tied table: the tiny drafter scores the whole vocabulary)
    and int8 ones (the target head's VNNI rows)."""
    if precision == "int8" and not int8_dot_available():
        pytest.skip("model.precision=int8 needs AVX-512 VNNI")
    drafter = tiny.drafter_dir("llama", "random")
    expected = decodes(native_decoder(q8_target, drafter, precision, draft_precision))
    released = native_decoder(q8_target, drafter, precision, draft_precision)
    report = release_unused_weights(released)  # before any forward, as the server does
    assert report["target_layers"] > 0 and report["drafter_layers"] > 0 and report["embedding"] > 0
    assert isinstance(released.embed.weight, ReleasedWeight) and released.lm_head is released.embed.weight
    assert isinstance(released.base.layers[0].mlp.down_proj.weight, ReleasedWeight)
    assert decodes(released) == expected
    assert release_unused_weights(released) == {}  # once
    warm = native_decoder(q8_target, drafter, precision, draft_precision)
    assert decodes(warm) == expected
    release_unused_weights(warm)  # after its stacks were built: built again from the same weights
    assert decodes(warm) == expected


@needs_smallm
def test_a_released_weight_raises_where_a_path_needs_it(tiny):
    decoder = native_decoder(tiny.target_dir("llama"), tiny.drafter_dir("llama", "random"))
    report = release_unused_weights(decoder)
    assert "embedding" not in report  # random float32 rows: the head's packed form is not q8, the table stays
    assert not isinstance(decoder.embed.weight, ReleasedWeight)
    ids = chat_input_ids(decoder.target.tokenizer, [PROMPTS[0]])
    named = r"model\.layers\.0\.self_attn\.[qkv]_proj\.weight was released"
    with pytest.raises(ReleasedWeightError, match=named):  # a cache the native stack cannot write: transformers' path
        decoder.target_forward(ids, DynamicCache(), 0, want_features=False)
    with pytest.raises(ReleasedWeightError, match=r"drafter\.[a-z0-9_.]+\.weight was released"):
        decoder.drafter.state_dict()
    set_backend(decoder.base, "eager")
    with pytest.raises(ReleasedWeightError, match=named):
        decoder.base(input_ids=ids)
    eager = SpeculativeDecoder(load_target(str(tiny.target_dir("llama"))), backend="eager")
    with pytest.raises(ValueError, match="native stack"):
        release_unused_weights(eager)


def serve_overrides(tiny, *extra: str) -> list[str]:
    return [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'random')}",
            f"model.name={MODEL}", "model.backend=smallm", "serve.policy=fixed", "serve.max_batch=4",
            "serve.prefix_cache_mb=0", *extra]


@needs_smallm
def test_the_server_releases_what_it_built_and_reports_its_resident_memory(tiny):
    from pipeline.serve import start_engine

    with composed("serve", serve_overrides(tiny)) as cfg:
        engine = start_engine(cfg)
    try:
        assert engine.decoder.released_weights["target_layers"] > 0
        assert isinstance(engine.decoder.drafter.fc.weight, ReleasedWeight)
        with TestClient(create_app(engine), base_url="http://localhost") as c:
            body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8}
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            health = c.get("/health").json()
            metrics = c.get("/metrics").text
    finally:
        engine.close()
    assert "resident_bytes" in health and "peak_resident_bytes" in health
    assert "process_resident_memory_peak_bytes" in metrics
    if sys.platform.startswith("linux"):
        assert 0 < health["resident_bytes"] <= health["peak_resident_bytes"]
        assert "process_resident_memory_bytes" in metrics


_PIN_PROBE = r"""
import ctypes, json, sys, torch
from pipeline.models.release import MMAP_THRESHOLD, pin_mmap_threshold

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: hblkhd, the bytes in mapped blocks
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None)); sys.exit()
libc.mallinfo2.restype = MallInfo2
big = torch.empty(16 * 2**20, dtype=torch.uint8)  # a freed 16 MiB mapped block raises an unpinned threshold to it
del big
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False
before = libc.mallinfo2().hblkhd
buffer = torch.empty(2 * MMAP_THRESHOLD, dtype=torch.uint8)  # a request's layer of keys
print(json.dumps({"pinned": pinned, "mapped": libc.mallinfo2().hblkhd - before, "size": buffer.numel()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's")
def test_a_pinned_mmap_threshold_maps_a_kv_sized_buffer_on_its_own():
    """In a fresh process (a server's start; a long test run's heap has free chunks a buffer may reuse): unpinned, a
    buffer of twice the threshold lands in the heap after a 16 MiB block was freed; pinned, it gets a mapping."""
    import json
    import subprocess

    got = {}
    for mode in ("pin", "unpinned"):
        done = subprocess.run([sys.executable, "-c", _PIN_PROBE, mode], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        got[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        if got[mode] is None:
            pytest.skip("this glibc has no mallinfo2 (2.33+)")
    assert got["pin"]["pinned"] and got["pin"]["mapped"] >= got["pin"]["size"]
    assert got["unpinned"]["mapped"] == 0


@needs_smallm
def test_a_recording_server_keeps_what_its_replay_reads(tiny, q8_target):
    """The replay runs the drafter's own forward over its head rows: the drafter's weights stay, and so does the tied
    table where it is those rows (a whole-vocabulary drafter)."""
    from pipeline.serve import release_weights

    recorded = native_decoder(q8_target, tiny.drafter_dir("llama", "random"))
    with composed("serve", serve_overrides(tiny, "serve.record=true")) as cfg:
        release_weights(cfg, recorded)
    assert recorded.released_weights["target_layers"] > 0
    assert "drafter_layers" not in recorded.released_weights and "embedding" not in recorded.released_weights
    assert not isinstance(recorded.drafter.fc.weight, ReleasedWeight)
    assert recorded.draft_head is recorded.lm_head and not isinstance(recorded.draft_head, ReleasedWeight)


SHIPPED_DRAFTER = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"


@pytest.mark.slow
def test_released_smollm2_decodes_the_ids_of_an_unreleased_one(compose_config):
    """The embedded SmolLM2 with the shipped drafter, as the server builds it: the same ids, alone and batched, with
    its transformers layers, drafter layers and float32 embedding (its LM head's q8 rows give it) released."""
    from pipeline.decoding.build import build_decoder
    from pipeline.prompts import load_prompt_set

    require((SHIPPED_DRAFTER / "config.json").exists(), "the shipped drafter is not there (make draft)")
    model_cfg = compose_config("serve", []).model
    reference = build_decoder(model_cfg)
    ids = [chat_input_ids(reference.target.tokenizer, p.turns) for p in load_prompt_set("humaneval", limit=3)]
    config = DecodeConfig(32, 0.0, 0)

    def run(decoder):
        alone = [decoder.generate(i, b, config).output_ids for i in ids for b in (1, 8)]
        return alone + [r.stats.output_ids for r in decode_all(decoder, ids, [8] * 3, [config] * 3, max_batch=3)]

    expected = run(reference)
    del reference
    released = build_decoder(model_cfg)
    report = release_unused_weights(released)
    assert report["embedding"] == 49152 * 576 * 4 and report["target_layers"] > 400 * 2**20
    assert report["drafter_layers"] > 0
    # an int8 or bf16 draft head holds its own rows; an exact one reads the float32 rows
    assert report.get("draft_head") == (8192 * 576 * 4 if released.draft_precision != "exact" else None)
    assert run(released) == expected
    if released.draft_precision != "exact":
        with pytest.raises(ReleasedWeightError, match="decoder.draft_head was released"):
            released.draft_head[torch.tensor([0])]  # a replay's draft rows
    set_backend(released.target.model, "eager")
    with pytest.raises(ReleasedWeightError, match="was released"):
        released.target.model(input_ids=ids[0])
