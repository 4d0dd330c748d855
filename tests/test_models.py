"""Target loading (local dirs, the packaged GGUF's location, dtypes) and the ``model`` config group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline import PROJECT_ROOT
from pipeline.decoding import SpeculativeDecoder
from pipeline.models.loading import build_decoder, load_models, resolve_path
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
    from pipeline.testing import make_tiny_target

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
