"""The server benchmark's library (``pipeline.evaluation.serving``): a response of our server and one of vLLM's are
read alike (token ids, tau, steps), and the table has one row per server with every concurrency's cell."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipeline.bench_serve import bench_serve
from pipeline.evaluation.serving import _figures, markdown


def test_our_extension_and_vllms_metrics_are_read_alike():
    ours = _figures("hi", [{}, {"blockpilot": {"token_ids": [5, 6, 2], "tau": 1.5, "steps": 2, "block_size": 8}}],
                    [{}], 100.0, 20.0, None)
    assert (ours["token_ids"], ours["tau"], ours["steps"], ours["completion_tokens"]) == ([5, 6, 2], 1.5, 2, 3)
    spec = {"mean_acceptance_length": 2.0, "num_spec_steps": 4, "per_step_accepted": [1, 1, 0, 2]}
    vllm = _figures("hi", [{}, {"metrics": {"speculative_decoding": spec}}],
                    [{"token_ids": [5, 6]}, {"token_ids": [7]}, {}], 100.0, 20.0, 3)
    assert (vllm["token_ids"], vllm["tau"], vllm["steps"], vllm["info"]) == ([5, 6, 7], 2.0, 4, None)
    plain = _figures("hi", [{}], [{"token_ids": [5]}], 10.0, 10.0, 1)  # vLLM without speculation
    assert plain["tau"] is None and plain["steps"] is None and plain["token_ids"] == [5]


def test_the_table_has_a_row_per_server():
    level = {"concurrency": 1, "tokens_per_s": 30.0, "exact_match": 1.0, "tau": 1.4, "ttft_ms": {"p99": 120.4}}
    health = {"forward_path": {"precision": "int8"}, "max_batch": 24}  # what ran, from the server's /health
    result = {"servers": {"ours": {"load": [level, {**level, "concurrency": 8, "tokens_per_s": 80.0}], "server": health},
                          "vllm_ar": {"load": [{**level, "tokens_per_s": 16.0, "tau": None}]}}}
    table = markdown(result).splitlines()
    assert table[0] == "| server | c=1 tokens/s (exact, tau, TTFT p99 ms) | c=8 tokens/s (exact, tau, TTFT p99 ms) |"
    assert table[2] == "| ours (int8, max_batch 24) | 30.0 (1.00, 1.40, 120) | 80.0 (1.00, 1.40, 120) |"
    assert table[3] == "| vllm_ar | 16.0 (1.00, -, 120) |  |"


def test_one_running_server_cannot_be_benchmarked_as_several():
    cfg = OmegaConf.create({"bench": {"base_url": "http://127.0.0.1:8000", "servers": [{"name": "a"}, {"name": "b"}]}})
    with pytest.raises(ValueError, match="drop bench.base_url"):
        bench_serve(cfg)
