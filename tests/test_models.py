"""Target loading (local dirs, the packaged GGUF's location, dtypes) and the ``model`` config group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline import PROJECT_ROOT
from pipeline.decoding import SpeculativeDecoder
from pipeline.decoding.build import build_decoder
from pipeline.models.loading import load_models, resolve_path
from pipeline.models.target import load_target, packaged_gguf_path, resolve_dtype, target_config


def test_load_tiny_target(tiny, arch):
    target = tiny.target(arch)
    assert target.name == str(tiny.target_dir(arch))
    assert target.model.config.model_type == arch
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert target.device == torch.device("cpu")
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert target.tokenizer.eos_token_id == eos
    assert target.stop_token_ids() == [eos]


def test_stop_token_ids_merges_tokenizer_and_generation_config(tiny):
    target = load_target(str(tiny.target_dir("llama")))
    pad = target.tokenizer.pad_token_id
    target.model.generation_config.eos_token_id = [pad, target.tokenizer.eos_token_id]
    assert target.stop_token_ids() == sorted({pad, target.tokenizer.eos_token_id})


def test_load_target_dtype(tiny):
    target = load_target(str(tiny.target_dir("qwen3")), dtype="bfloat16")
    assert next(target.model.parameters()).dtype == torch.bfloat16


def test_missing_target_names_the_fix(tmp_path):
    with pytest.raises(OSError, match=r"model\.target=/path/to/model"):
        load_target(str(tmp_path / "no-such-model"))


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8")


def test_target_config_without_weights(tiny):
    config = target_config(str(tiny.target_dir("llama")))
    assert config.num_hidden_layers == 4 and config.hidden_size == 64


def test_packaged_gguf_is_installed():
    path = packaged_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000  # the 135M model, Q4_1


def test_resolve_path_is_relative_to_the_project_root(tmp_path):
    assert resolve_path("conf") == str(PROJECT_ROOT / "conf")
    assert resolve_path(str(tmp_path)) == str(tmp_path)
    assert resolve_path("org/hub-id-not-a-dir") == "org/hub-id-not-a-dir"
    assert resolve_path(None) is None


def test_load_models_from_the_model_config(tiny, compose_config):
    target_dir, drafter_dir = tiny.target_dir("qwen3"), tiny.drafter_dir("qwen3", "random", block_size=4)
    cfg = compose_config("evaluate", [f"model.target={target_dir}", f"model.drafter={drafter_dir}", "logger.enabled=false"])
    target, drafter = load_models(cfg.model)
    assert target.model.config.model_type == "qwen3"
    assert drafter.block_size == 4 and drafter.max_block_size == 16
    assert next(drafter.parameters()).dtype == torch.float32
    decoder = build_decoder(cfg.model)
    assert isinstance(decoder, SpeculativeDecoder) and decoder.drafter is not None

    cfg = compose_config("evaluate", [f"model.target={target_dir}", "model.drafter=null"])
    assert load_models(cfg.model)[1] is None


def test_load_models_rejects_a_drafter_for_another_target(tiny, compose_config, tmp_path):
    from tiny_models import make_tiny_target

    other = make_tiny_target(tmp_path / "wide", hidden_size=96)
    cfg = compose_config("evaluate", [f"model.target={other}", f"model.drafter={tiny.drafter_dir('llama')}"])
    with pytest.raises(ValueError, match="hidden size 64 != target's 96.*make draft model.target="):
        build_decoder(cfg.model)


def test_embedded_default_config_points_at_the_shipped_drafter(compose_config):
    cfg = compose_config("evaluate")
    assert cfg.model.target == "smollm2-135m-instruct"
    assert Path(cfg.model.drafter) == Path("data/drafters/smollm2-135m-instruct-dflash-b8")
    assert cfg.model.training_block_size == 8
    assert cfg.model.training_block_size in cfg.model.candidates


# ------------------------------------------------------------------------------------------------
# issue 15 items 8 and 9: targets whose cache or logits differ from Llama's
# ------------------------------------------------------------------------------------------------
PROMPT = torch.arange(5, 25)[None]  # 20 tokens: past the Gemma2-like target's sliding window of 8


@pytest.fixture(scope="module")
def edge_targets(tmp_path_factory):
    """A Phi-like target (LM-head bias) and a Gemma2-like one (sliding windows of 8, final logit softcapping 2.0),
    each with a random drafter."""
    from pipeline.models.drafter import DFlashDrafter
    from tiny_models import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("edge-targets")
    out = {}
    for arch, attention in (("phi", "sdpa"), ("gemma2", "eager")):  # transformers has no SDPA path for Gemma2
        directory = make_tiny_target(root / arch, arch=arch)
        drafter = DFlashDrafter.from_pretrained(make_tiny_drafter(directory, root / f"{arch}-drafter", block_size=4))
        out[arch] = SpeculativeDecoder(load_target(str(directory), attn_implementation=attention), drafter)
    return out


def _hf_greedy(decoder, max_new_tokens: int) -> list[int]:
    model = decoder.target.model
    ids = model.generate(PROMPT, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=decoder.target.stop_token_ids(),
                         pad_token_id=decoder.target.tokenizer.pad_token_id)
    return ids[0, PROMPT.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["phi", "gemma2"])
def test_logits_are_computed_as_the_model_does(edge_targets, arch):
    """Item 9: logits were ``hidden @ lm_head.weight.T``, losing a head bias (Phi) or the final softcapping
    (Gemma2): B=1 greedy then differed from HF greedy and the T=1 distributions differed (TV 0.022)."""
    from pipeline.decoding import DecodeConfig

    decoder = edge_targets[arch]
    reference = _hf_greedy(decoder, 24)
    assert decoder.generate(PROMPT, 1, DecodeConfig(24)).output_ids == reference  # B=1 is HF greedy
    own = decoder.target.model(input_ids=PROMPT).logits[0, -1].float()
    prefill = decoder.prefill(PROMPT, DecodeConfig(8))
    torch.testing.assert_close(prefill.last_logits, own, atol=1e-5, rtol=1e-5)
    tv = 0.5 * (torch.softmax(prefill.last_logits, -1) - torch.softmax(own, -1)).abs().sum()
    assert float(tv) < 1e-6
    plain = (decoder.lm_head @ decoder.target.model.base_model(input_ids=PROMPT).last_hidden_state[0, -1]).float()
    assert 0.5 * float((torch.softmax(plain, -1) - torch.softmax(own, -1)).abs().sum()) > 1e-3  # the old way was off
    for b in (3, 4):
        assert decoder.generate(PROMPT, b, DecodeConfig(24)).output_ids == reference, b
    assert (decoder.head.bias is not None) if arch == "phi" else (decoder.head.softcap == 2.0)


def test_sliding_window_target_decodes_at_every_block_size(edge_targets):
    """Item 8: a target with sliding-window layers crashed at B > 1 once the window filled (its cache was built
    without past recording, so the verify step's crop raised); every B now gives HF's greedy text, and at T > 0
    the same text for every B."""
    from pipeline.decoding import DecodeConfig

    decoder = edge_targets["gemma2"]
    reference = _hf_greedy(decoder, 40)
    for b in (2, 5, 8):
        assert decoder.generate(PROMPT, b, DecodeConfig(40)).output_ids == reference, b
    sampled = {b: decoder.generate(PROMPT, b, DecodeConfig(40, 1.0, 7)).output_ids for b in (1, 3, 8)}
    assert sampled[1] == sampled[3] == sampled[8]


def test_a_head_that_cannot_be_reproduced_is_refused(tiny):
    """A target whose own forward changes the logits in a way ``LogitHead`` does not know is refused, not served."""
    from pipeline.models.target import logit_head

    target = load_target(str(tiny.target_dir("llama")))
    forward = target.model.forward

    def doubled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    target.model.forward = doubled
    with pytest.raises(ValueError, match="computes its logits in a way BlockPilot does not reproduce"):
        logit_head(target.model)
    with pytest.raises(ValueError, match="cannot be served losslessly"):
        SpeculativeDecoder(target)


def test_the_forwards_run_on_fewer_threads_while_other_processes_hold_cores():
    """``ThreadGovernor`` (injected clock, CPU times and thread setter): it looks at most every period; with the
    process on 2 threads, others taking 0.9 of a core drop it to 1 and 0.2 bring it back; on 16, others taking 3.4
    cores leave 13; a count the process sets itself is the one it adapts from; one thread, or no reading, changes
    nothing."""
    from pipeline.models.threads import ThreadGovernor

    clock, load, threads = [0.0], [0.0], [2]
    governor = ThreadGovernor(0.25, others=lambda: load[0], clock=lambda: clock[0], get_threads=lambda: threads[0],
                              set_threads=lambda n: threads.__setitem__(0, n))
    governor.adapt()
    assert threads[0] == 2 and governor.threads == 2
    load[0] = 0.9
    clock[0] = 0.1
    governor.adapt()  # within the period: no look
    assert threads[0] == 2
    clock[0] = 0.3
    governor.adapt()
    assert threads[0] == 1 and governor.switches == 1
    load[0], clock[0] = 0.2, 0.6
    governor.adapt()
    assert threads[0] == 2 and governor.switches == 2
    threads[0], load[0], clock[0] = 16, 3.4, 0.9  # the process asked for 16 threads since
    governor.adapt()
    assert governor.threads == 16 and threads[0] == 13  # 3 cores held, the fourth less than half
    threads[0], load[0], clock[0] = 1, 1.0, 1.2
    governor.adapt()
    assert threads[0] == 1 and governor.threads == 1
    quiet = ThreadGovernor(0.25, others=lambda: None, clock=lambda: 0.0, get_threads=lambda: 2,
                           set_threads=lambda n: pytest.fail("set without a reading"))
    quiet.adapt()


def test_cpu_times_read_other_processes_share_of_this_processes_cpus():
    """``CpuTimes`` on this host's /proc: nothing at the first call, then a share of cores (>= 0, at most the CPUs this
    process may use)."""
    import os
    import time

    from pipeline.models.threads import CpuTimes

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc on this host: the governor keeps the process's thread count")
    times = CpuTimes()
    assert times() is None
    time.sleep(0.2)  # ~20 clock ticks a CPU: the share's tick rounding stays well inside the bound
    share = times()
    assert share is not None and 0.0 <= share <= len(os.sched_getaffinity(0)) + 0.5
