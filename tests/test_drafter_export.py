"""Drafter folders outside BlockPilot: the remote-code model (``AutoModel(..., trust_remote_code=True)``), the
full-vocabulary export, dtype handling beside a float32 target, z-lab's ``dflash`` package and the shipped folder."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, DynamicCache

from conftest import require
from pipeline import PROJECT_ROOT
from pipeline.models.drafter import REMOTE_CODE, DFlashDrafter, draft_offsets, lm_head_logits
from pipeline.models.export_drafter import LOADING_HEADING, export_drafter

SHIPPED = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"


def _inputs(config, context: int = 5, block: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    H = config.hidden_size
    taps = len(config.dflash_config["target_layer_ids"])
    return (torch.randn(1, block, H, generator=g), torch.randn(1, context, taps * H, generator=g),
            torch.arange(context + block)[None])


def _draft_vocab_drafter(tiny, tmp_path, dtype=torch.float32):
    """The tiny random Llama drafter restricted to every third token id, saved in ``dtype``."""
    drafter = DFlashDrafter.from_pretrained(tiny.drafter_dir("llama", "random", block_size=4))
    target = tiny.target("llama").model
    drafter.set_draft_vocab(torch.arange(1, target.config.vocab_size, 3), target.get_output_embeddings().weight)
    return drafter, drafter.save_pretrained(tmp_path / f"dv-{str(dtype).removeprefix('torch.')}", dtype=dtype)


def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """Plain greedy decoding by full recomputation (the reference every speculative decoder must match)."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


def _tensor_bytes(path) -> dict[str, bytes]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k in f.keys()}


def test_saved_folder_loads_through_remote_code(tiny, tmp_path):
    drafter, out = _draft_vocab_drafter(tiny, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["dtype"] == "float32" and config["draft_vocab_size"] == drafter.draft_vocab.numel()
    assert "draft_vocab_size" not in config["dflash_config"]  # vLLM reads the top-level key only
    tensors = load_file(out / "model.safetensors")
    head = tiny.target("llama").model.get_output_embeddings().weight
    assert torch.equal(tensors["d2t"] + torch.arange(len(tensors["d2t"])), drafter.draft_vocab)
    assert torch.equal(tensors["lm_head.weight"], head[drafter.draft_vocab]) and "draft_vocab" not in tensors
    assert (out / "modeling_dflash.py").read_bytes() == REMOTE_CODE.read_bytes()

    remote = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__name__ == "DFlashDraftModel" and type(remote).__module__.startswith("transformers_modules.")
    assert remote.dtype == torch.float32
    assert torch.equal(remote.draft_vocab, drafter.draft_vocab)  # the extension is kept, not dropped
    assert remote.target_layer_ids == drafter.target_layer_ids and remote.block_size == 4 and remote.mask_token_id == 0

    noise, features, positions = _inputs(drafter.config)
    with torch.no_grad():
        ours, theirs = drafter(noise, features, positions), remote(position_ids=positions, noise_embedding=noise,
                                                                   target_hidden=features)
        assert torch.equal(ours, theirs)
        # with a cache: 5 context positions, then 3 more context positions and a new block
        ours_cache, theirs_cache = DynamicCache(), DynamicCache()
        drafter(noise, features, positions, cache=ours_cache)
        remote(position_ids=positions, noise_embedding=noise, target_hidden=features, past_key_values=theirs_cache)
        ours_cache.crop(-4), theirs_cache.crop(-4)
        noise2, features2, _ = _inputs(drafter.config, context=3, seed=1)
        positions2 = torch.arange(5, 12)[None]
        assert torch.equal(drafter(noise2, features2, positions2, cache=ours_cache),
                           remote(position_ids=positions2, noise_embedding=noise2, target_hidden=features2,
                                  past_key_values=theirs_cache))

        # scoring: only the draft-vocabulary rows, mapped back to target ids exactly as our decoder does
        head = tiny.target("llama").model.get_output_embeddings()
        ours_ids = drafter.to_target_ids(lm_head_logits(ours, drafter.draft_head(head.weight)).argmax(-1))
        assert remote.draft_logits(theirs, head).shape[-1] == drafter.draft_vocab.numel()
        full = remote.compute_logits(theirs, head)
        assert full.shape[-1] == drafter.config.vocab_size
        assert torch.equal(full.argmax(-1), ours_ids) and torch.isin(ours_ids, drafter.draft_vocab).all()
        outside = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
        outside[drafter.draft_vocab] = False
        assert torch.isneginf(full[..., outside]).all() and torch.isfinite(full[..., ~outside]).all()


def test_remote_code_without_draft_vocab_scores_the_full_vocabulary(tiny):
    drafter = tiny.drafter("qwen3", "random", block_size=4)
    remote = AutoModel.from_pretrained(tiny.drafter_dir("qwen3", "random", block_size=4), trust_remote_code=True).eval()
    assert remote.draft_vocab is None
    noise, features, positions = _inputs(drafter.config)
    head = tiny.target("qwen3").model.get_output_embeddings()
    with torch.no_grad():
        hidden = remote(position_ids=positions, noise_embedding=noise, target_hidden=features)
        assert torch.equal(hidden, drafter(noise, features, positions))
        logits = remote.compute_logits(hidden, head)
        assert torch.equal(logits, head(hidden))  # the target's own head, all rows
        torch.testing.assert_close(logits, lm_head_logits(hidden, head.weight))


def test_remote_spec_generate_is_lossless(tiny):
    target = tiny.target("llama").model
    remote = AutoModel.from_pretrained(tiny.drafter_dir("llama", "trained"), trust_remote_code=True)
    ids = torch.tensor([[5, 17, 42, 9, 77]])
    expected = _greedy(target, ids, 24)
    for block_size in (1, 4, 8, 16):
        assert remote.spec_generate(target=target, input_ids=ids, max_new_tokens=24, block_size=block_size)[0].tolist() == expected
    stop = expected[5 + 6]  # the 7th generated token: decoding ends right after it
    first = expected.index(stop, 5)
    assert remote.spec_generate(target=target, input_ids=ids, max_new_tokens=24, stop_token_ids=[stop])[0].tolist() == \
        expected[: first + 1]
    with pytest.raises(NotImplementedError, match="greedily"):
        remote.spec_generate(target=target, input_ids=ids, max_new_tokens=4, temperature=0.7)


def test_bfloat16_folder_beside_a_float32_target(tiny, tmp_path):
    drafter, out = _draft_vocab_drafter(tiny, tmp_path, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # what the weights are stored in
    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    target = tiny.target("llama").model
    assert target.dtype == torch.float32

    remote = AutoModel.from_pretrained(out, trust_remote_code=True)  # dtype="auto": the stored bfloat16
    assert remote.dtype == torch.bfloat16 and remote.draft_vocab.dtype == torch.long
    assert remote.rotary_emb.inv_freq.dtype == remote.to(torch.bfloat16).rotary_emb.inv_freq.dtype == torch.float32
    noise, features, positions = _inputs(drafter.config)
    with torch.no_grad():
        hidden = remote(position_ids=positions, noise_embedding=noise, target_hidden=features)  # float32 in
        assert hidden.dtype == torch.float32  # ... float32 out: the target's head takes it
        assert remote.compute_logits(hidden, target.get_output_embeddings()).dtype == torch.float32
        ours = DFlashDrafter.from_pretrained(out, dtype=torch.float32)(noise, features, positions)
        torch.testing.assert_close(hidden, ours, atol=0.1, rtol=0.05)  # bfloat16 compute vs float32 compute
    ids = torch.tensor([[5, 17, 42, 9, 77]])
    assert remote.spec_generate(target=target, input_ids=ids, max_new_tokens=16)[0].tolist() == _greedy(target, ids, 16)

    # dtype=torch.float32 computes in float32: bit-equal to our loader at float32
    remote32 = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(remote32(position_ids=positions, noise_embedding=noise, target_hidden=features), ours)


def test_remote_code_names_a_missing_draft_vocab(tiny, tmp_path):
    drafter, out = _draft_vocab_drafter(tiny, tmp_path)
    weights = load_file(out / "model.safetensors")
    del weights["d2t"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="draft_vocab_size but the weights hold no d2t"):
        AutoModel.from_pretrained(out, trust_remote_code=True)
    weights["draft_vocab"] = drafter.draft_vocab  # an older BlockPilot folder: absolute ids
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="older BlockPilot layout.*make export-drafter"):
        AutoModel.from_pretrained(out, trust_remote_code=True)


def test_draft_offsets_are_vllms_d2t():
    ids = torch.tensor([2, 5, 40, 41, 300])
    d2t = draft_offsets(ids)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [2, 4, 38, 38, 296]
    assert torch.equal(torch.arange(5) + d2t, ids)  # vLLM: target id = i + d2t[i]
    with pytest.raises(ValueError, match="1-D tensor of integer token ids"):
        draft_offsets(torch.tensor([[1, 2]]))


def test_older_folder_is_rewritten_in_vllms_layout(tiny, tmp_path):
    """A folder of an older BlockPilot (absolute ids in draft_vocab, nested draft_vocab_size, no head rows): our loader
    reads it as it is; the re-export writes d2t and the target's head rows and keeps every other tensor's bits."""
    drafter, new = _draft_vocab_drafter(tiny, tmp_path)
    old = tmp_path / "old"
    old.mkdir()
    weights = load_file(new / "model.safetensors")
    ids = weights.pop("d2t") + torch.arange(drafter.draft_vocab.numel())
    weights.pop("lm_head.weight")
    save_file({**weights, "draft_vocab": ids}, old / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((new / "config.json").read_text())
    config["dflash_config"]["draft_vocab_size"] = config.pop("draft_vocab_size")
    (old / "config.json").write_text(json.dumps(config))

    legacy = DFlashDrafter.from_pretrained(old)
    assert torch.equal(legacy.draft_vocab, drafter.draft_vocab) and legacy.draft_lm_head is None
    with pytest.raises(ValueError, match="TARGET="):
        export_drafter(old, tmp_path / "x")
    out = export_drafter(old, tmp_path / "rewritten", target=str(tiny.target_dir("llama")))
    assert _tensor_bytes(out / "model.safetensors") == _tensor_bytes(new / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == drafter.draft_vocab.numel() and "draft_vocab_size" not in config["dflash_config"]
    assert torch.equal(AutoModel.from_pretrained(out, trust_remote_code=True).draft_vocab, drafter.draft_vocab)


def test_full_vocab_export(tiny, tmp_path):
    drafter, src = _draft_vocab_drafter(tiny, tmp_path)
    (src / "README.md").write_text("# tiny\n\nmodel card\n")
    dst = export_drafter(src, tmp_path / "full", full_vocab=True)
    config = json.loads((dst / "config.json").read_text())
    assert "draft_vocab_size" not in config["dflash_config"] and "draft_vocab_size" not in config
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and config["dtype"] == "float32"
    src_tensors, dst_tensors = _tensor_bytes(src / "model.safetensors"), _tensor_bytes(dst / "model.safetensors")
    assert set(src_tensors) - set(dst_tensors) == {"d2t", "lm_head.weight"}
    assert all(dst_tensors[k] == src_tensors[k] for k in dst_tensors)  # every other tensor bit-identical
    card = (dst / "README.md").read_text()
    assert card.startswith("# tiny\n\nmodel card\n") and LOADING_HEADING in card and "full vocabulary" in card

    full = DFlashDrafter.from_pretrained(dst)
    assert full.draft_vocab is None
    noise, features, positions = _inputs(drafter.config)
    head = tiny.target("llama").model.get_output_embeddings().weight
    with torch.no_grad():
        hidden = full(noise, features, positions)
        assert torch.equal(hidden, drafter(noise, features, positions))  # same layers, only the scoring differs
        assert full.draft_head(head).shape[0] == drafter.config.vocab_size
    remote = AutoModel.from_pretrained(dst, trust_remote_code=True)
    assert remote.draft_vocab is None


def test_in_place_re_export_keeps_the_weights(tiny, tmp_path):
    """A folder written before the hub files existed (no auto_map, no modeling file) re-exported in place."""
    _, out = _draft_vocab_drafter(tiny, tmp_path, dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    del config["auto_map"]
    (out / "config.json").write_text(json.dumps(config))
    (out / "modeling_dflash.py").unlink()
    (out / "README.md").write_text("# card\n\n| item | value |\n|---|---|\n| a | 1 |\n")
    (out / "training_stats.json").write_text('{"a": 1}')
    weights = (out / "model.safetensors").read_bytes()

    for _ in range(2):  # idempotent
        assert export_drafter(out, out) == out
        assert (out / "model.safetensors").read_bytes() == weights
        card = (out / "README.md").read_text()
        assert card.startswith("# card\n\n| item | value |\n|---|---|\n| a | 1 |\n") and card.count(LOADING_HEADING) == 1
        assert "EAGLE-3" in card and "trust_remote_code=True" in card and "DFlashDraftModel" in card
    assert (out / "training_stats.json").read_text() == '{"a": 1}'
    new = json.loads((out / "config.json").read_text())
    assert new["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert {k: v for k, v in new.items() if k != "auto_map"} == config
    assert (out / "modeling_dflash.py").read_bytes() == REMOTE_CODE.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary folder left behind
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_drafter(tmp_path / "nothing", tmp_path / "x")


def test_model_card_has_the_loading_section(tmp_path):
    from omegaconf import OmegaConf

    from pipeline.drafting.model_card import write_model_card

    cfg = OmegaConf.create({"model": {"target": "tiny"}, "draft": {"features": "cached", "block_size": 4}, "seed": 0})
    write_model_card(tmp_path, "tiny-dflash", cfg, {"draft vocabulary": 64, "val_tau": {"4": 1.5}})
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("# tiny-dflash\n") and "| 4 | 1.500 |" in card and card.count(LOADING_HEADING) == 1
    assert "64 tokens" in card and "EAGLE-3" in card and "`d2t`" in card and "vLLM" in card
    write_model_card(tmp_path, "tiny-dflash", cfg, {"draft vocabulary": "full", "val_tau": {}})
    assert "scores the full vocabulary (no `d2t`" in (tmp_path / "README.md").read_text()


def test_shipped_folder_loads_everywhere():
    if not (SHIPPED / "config.json").exists():
        pytest.skip("no shipped drafter")
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and config["dtype"] == "bfloat16"
    assert (SHIPPED / "modeling_dflash.py").read_bytes() == REMOTE_CODE.read_bytes()  # re-export after editing it
    assert "## Loading" in (SHIPPED / "README.md").read_text()
    # vLLM's layout of the draft vocabulary: vLLM 0.32 loads the folder as it is (tests/test_vllm.py)
    assert config["draft_vocab_size"] == 8192 and "draft_vocab_size" not in config["dflash_config"]
    with safe_open(SHIPPED / "model.safetensors", "pt") as f:
        assert {"d2t", "lm_head.weight"} <= set(f.keys()) and "draft_vocab" not in f.keys()
        assert f.get_slice("lm_head.weight").get_shape() == [8192, 576] and f.get_slice("lm_head.weight").get_dtype() == "F32"
    ours = DFlashDrafter.from_pretrained(SHIPPED)
    remote = AutoModel.from_pretrained(SHIPPED, trust_remote_code=True, dtype=torch.float32)
    assert remote.draft_vocab.numel() == 8192 and torch.equal(remote.draft_vocab, ours.draft_vocab)
    noise, features, positions = _inputs(ours.config, context=6, block=8)
    with torch.no_grad():
        assert torch.equal(ours(noise, features, positions),
                           remote(position_ids=positions, noise_embedding=noise, target_hidden=features))


def test_shipped_folder_loads_in_zlabs_class():
    """z-lab's ``DFlashDraftModel`` (PyPI ``dflash``, installed by make install) reads the shipped folder's layers
    (it ignores the draft vocabulary); vLLM's loader: tests/test_vllm.py."""
    require((SHIPPED / "config.json").exists(), "no shipped drafter")
    require(importlib.util.find_spec("dflash") is not None, "z-lab's dflash package is not installed (make install)")
    from dflash import DFlashDraftModel

    ours = DFlashDrafter.from_pretrained(SHIPPED)
    zlab = DFlashDraftModel.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    noise, features, positions = _inputs(ours.config, context=6, block=8)
    with torch.no_grad():
        assert torch.equal(zlab(position_ids=positions, noise_embedding=noise, target_hidden=features),
                           ours(noise, features, positions))


def test_z_lab_dflash_package(tiny, tmp_path):
    """z-lab's own ``dflash.DFlashDraftModel`` (PyPI ``dflash``) on our folder, and its decoding loop on ours."""
    dflash = pytest.importorskip("dflash")
    from dflash.model import dflash_generate

    drafter, out = _draft_vocab_drafter(tiny, tmp_path)
    zlab = dflash.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    assert not hasattr(zlab, "draft_vocab") or zlab.draft_vocab is None  # the extension is unknown to it
    noise, features, positions = _inputs(drafter.config)
    with torch.no_grad():
        assert torch.equal(zlab(position_ids=positions, noise_embedding=noise, target_hidden=features),
                           drafter(noise, features, positions))

    # its decoding loop drives our remote-code model (drafts scored by its compute_logits) losslessly
    target = tiny.target("llama").model
    remote = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor([[5, 17, 42, 9, 77]])
    output_ids = dflash_generate(remote, target, ids, 20, None, 0.0, block_size=4)
    assert output_ids[0].tolist() == _greedy(target, ids, 20)
