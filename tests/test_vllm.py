"""vLLM 0.32 (``.venv-vllm``, ``make vllm``) serving the embedded default with the shipped drafter and BlockPilot's
plugin, through the launcher (``pipeline.peers.vllm_server.VllmServer``, eager mode): every text equals our own
``ar`` decode token for token, the plugin verifies fewer than K drafts where they do not pay, a request can opt out,
vLLM's own DFlash drafts what our drafter drafts (the folder loads unchanged), and the label log feeds a refit.

Marked ``vllm`` and ``slow`` (two server starts, ~1-2 min on 2 cores). Without ``.venv-vllm`` it is skipped, except
under CI, where ``make vllm`` runs before ``make test`` and a missing environment fails it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import composed, require
from pipeline import PROJECT_ROOT
from pipeline.decoding import DecodeConfig
from pipeline.decoding.build import build_decoder
from pipeline.integrations.vllm.costs import StepCosts
from pipeline.integrations.vllm.labels import read_rows, refit
from pipeline.peers.vllm_server import VENV, VllmServer
from pipeline.policy.calibration import load_calibration
from pipeline.prompts import chat_input_ids, load_prompt_set

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 7
NEW_TOKENS = 48
SHIPPED = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(server: VllmServer, text: str, **extra) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "return_token_ids": True, **extra}
    request = urllib.request.Request(f"{server.openai_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def reference():
    """Four HumanEval prompts and our own decodes of them: ``ar`` token ids and the B=8 steps' taus."""
    require((VENV / "bin" / "python").exists(), f"no vLLM environment at {VENV}: make vllm")
    require((SHIPPED / "config.json").exists(), "no shipped drafter")
    # the eval stage's model: the embedded target, the shipped drafter, on exact products (vLLM's are float32)
    with composed("evaluate", ["model.precision=exact"]) as cfg:
        decoder = build_decoder(cfg.model)
    out = []
    for prompt in load_prompt_set("humaneval", limit=4):
        ids = chat_input_ids(decoder.target.tokenizer, prompt.turns)
        ar = decoder.generate(ids, 1, DecodeConfig(max_new_tokens=NEW_TOKENS))
        fixed = decoder.generate(ids, K + 1, DecodeConfig(max_new_tokens=NEW_TOKENS))
        assert fixed.output_ids == ar.output_ids
        out.append({"prompt": prompt, "ids": ar.output_ids, "taus": fixed.taus})
    return out


def test_vllm_dflash_loads_the_shipped_drafter_and_drafts_as_ours(reference, tmp_path):
    """vLLM's own DFlash (plugin off) on the shipped folder as it is: our text, and our drafter's acceptance (the same
    drafts, up to floating-point near-ties between vLLM's kernels and ours)."""
    with VllmServer(policy="off", num_speculative_tokens=K, max_num_seqs=4, port=_port(),
                    log_path=str(tmp_path / "off.log"), startup_timeout_s=900) as server:
        responses = [_chat(server, r["prompt"].turns[0]) for r in reference]
        counters = server.spec_decode_counters()
    ours = vllm = 0
    for r, response in zip(reference, responses):
        assert response["choices"][0]["token_ids"] == r["ids"], r["prompt"].id
        steps = response["metrics"]["speculative_decoding"]
        assert set(steps["per_step_drafted"]) == {K}  # without the plugin every draft is verified
        ours += sum(r["taus"]) / len(r["taus"])
        vllm += 1 + steps["num_accepted_draft_tokens"] / steps["num_spec_steps"]
    assert abs(vllm - ours) / ours < 0.2, (vllm, ours)  # a wrong vocabulary mapping would leave ~1 token per step
    assert counters["vllm:spec_decode_num_draft_tokens_total"] == K * counters["vllm:spec_decode_num_drafts_total"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_vllm_free_draft_sources_keep_our_text(reference, tmp_path, method):
    """The eval stage's peers ``vllm_ngram`` / ``vllm_suffix``: vLLM's prompt-lookup proposer and its suffix decoding
    (ArcticInference's suffix trees, built by make vllm) on the same target give our ``ar`` text and do accept drafts
    (code repeats its own names)."""
    if method == "suffix":
        found = subprocess.run([str(VENV / "bin" / "python"), "-c", "import arctic_inference.suffix_decoding"],
                               capture_output=True).returncode == 0
        require(found, "vLLM's environment has no arctic-inference (vLLM's suffix decoding): make vllm")
    with VllmServer(method=method, num_speculative_tokens=5, max_num_seqs=4, port=_port(),
                    log_path=str(tmp_path / f"{method}.log"), startup_timeout_s=900) as server:
        responses = [_chat(server, r["prompt"].turns[0]) for r in reference]
        counters = server.spec_decode_counters()
    for r, response in zip(reference, responses):
        assert response["choices"][0]["token_ids"] == r["ids"], r["prompt"].id
    assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0, counters


def test_vllm_with_the_joint_plugin_is_lossless_and_trims(reference, tmp_path):
    labels = tmp_path / "labels.jsonl"
    cache = tmp_path / "cache"
    # save_every_s=0: no save while serving, so the learned curve is on disk only if the worker saved it as vLLM
    # stopped it (by signal), however long or short the server ran
    with VllmServer(policy="joint", num_speculative_tokens=K, max_num_seqs=4, port=_port(), cache_dir=str(cache),
                    labels=str(labels), save_every_s=0, log_path=str(tmp_path / "joint.log"),
                    startup_timeout_s=900) as server:
        with ThreadPoolExecutor(4) as pool:  # the four at once: batched steps, the joint widths
            responses = list(pool.map(lambda r: _chat(server, r["prompt"].turns[0]), reference))
        opted_out = _chat(server, reference[0]["prompt"].turns[0], vllm_xargs={"blockpilot_speculate": False})
        counters = server.spec_decode_counters()
        log = server.log_tail(400)
        assert not list(cache.glob("step-costs-*.json"))  # nothing written while it serves
    stopped_log = server.log_tail(400)
    drafted = []
    for r, response in zip(reference, responses):
        assert response["choices"][0]["token_ids"] == r["ids"], r["prompt"].id  # lossless, token for token
        drafted += response["metrics"]["speculative_decoding"].get("per_step_drafted", [])
    assert any(0 < d < K for d in drafted), drafted  # some step verified fewer than K drafts
    assert opted_out["choices"][0]["token_ids"] == reference[0]["ids"]
    spec = (opted_out.get("metrics") or {}).get("speculative_decoding") or {}
    assert spec.get("num_draft_tokens", 0) == 0  # the opted-out request never verified a draft
    drafts, tokens = counters["vllm:spec_decode_num_drafts_total"], counters["vllm:spec_decode_num_draft_tokens_total"]
    assert drafts > 0 and 0 < tokens < K * drafts and counters["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert "BlockPilot: policy joint, K=7" in log
    (saved,) = cache.glob("step-costs-*.json")  # the learned curve, written as the worker stopped, for the next start
    assert sum(len(samples) for samples in StepCosts.load(saved).tables["verify"].values()) > 0  # decode steps timed
    assert "BlockPilot: step costs saved to" in stopped_log and "at stop" in stopped_log

    rows = read_rows([labels])  # the plugin's label log: one row per verified request-step
    assert len(rows) > 0 and rows["k"].between(1, K).all() and (rows["accepted"] <= rows["k"]).all()
    assert sum(len(c) for c in rows["conf_column"]) == sum(min(k, a + 1) for k, a in zip(rows["k"], rows["accepted"]))
    fitted = load_calibration(refit([labels], tmp_path / "refit"))
    assert fitted.info["rows"] == len(rows)
