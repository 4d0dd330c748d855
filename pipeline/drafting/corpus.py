"""Teacher-forced drafter data from plain text: Python standard-library source files.

Generating responses costs one target step per token; a teacher-forced forward over a text window
costs one batched prefill for all its tokens (~4x cheaper per token on the 2-core CPU here). The
drafter then learns to continue real code from the target's features (as EAGLE/DFlash do when
trained on fixed data without regeneration). Windows are written in the same shard format as
``pipeline.drafting.responses`` with a short "prompt" prefix that anchors are never drawn from.
"""

from __future__ import annotations

import random
import sysconfig
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline.drafting.responses import write_shard
from pipeline.models.target import Target

_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "encodings"}


def stdlib_source_windows(tokenizer, window: int = 384, prefix: int = 16, limit: int | None = None,
                          seed: int = 0) -> list[torch.Tensor]:
    """Token windows [window] cut from stdlib ``.py`` files (files in a seeded random order; tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    windows = []
    files = sorted(root.rglob("*.py"))
    random.Random(seed).shuffle(files)
    for path in files:
        if _SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
        for start in range(0, len(ids) - window // 2, window):
            chunk = ids[start : start + window]
            if len(chunk) > prefix + 8:
                windows.append(chunk)
        if limit and len(windows) >= limit:
            break
    return windows[:limit] if limit else windows


@torch.inference_mode()
def teacher_forced_features(target: Target, windows: list[torch.Tensor], layer_ids: list[int],
                            with_final: bool = False) -> list[torch.Tensor]:
    """Tapped features [n_i, n_taps*H] (bf16) of one right-padded batch of windows, one target forward;
    ``with_final`` appends the target's final hidden state (H more columns)."""
    base = target.model.base_model
    width = max(len(w) for w in windows)
    ids = torch.zeros(len(windows), width, dtype=torch.long)
    mask = torch.zeros(len(windows), width, dtype=torch.long)
    for i, w in enumerate(windows):
        ids[i, : len(w)] = w
        mask[i, : len(w)] = 1
    out = base(input_ids=ids.to(target.device), attention_mask=mask.to(target.device), output_hidden_states=True)
    taps = [out.hidden_states[i + 1] for i in layer_ids] + ([out.last_hidden_state] if with_final else [])
    feats = torch.cat(taps, dim=-1).to(torch.bfloat16).cpu()
    return [feats[i, : len(w)] for i, w in enumerate(windows)]


def build_corpus_cache(target: Target, out_dir: str | Path, layer_ids: list[int], window: int = 384,
                       prefix: int = 16, limit: int | None = None, batch_size: int = 8, shard_windows: int = 64,
                       with_features: bool = True) -> list[Path]:
    """Write (or resume) teacher-forced shards of stdlib source windows; returns the shard paths.

    ``with_features=False`` writes token-only shards and runs no target pass (``draft.features=online``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    windows = stdlib_source_windows(target.tokenizer, window, prefix, limit)
    groups = [windows[i : i + shard_windows] for i in range(0, len(windows), shard_windows)]
    paths = []
    for k, group in enumerate(tqdm(groups, desc="stdlib windows", unit="shard")):
        path = out_dir / f"shard-{k:05d}.safetensors"
        paths.append(path)
        if path.exists():
            continue
        t0 = time.perf_counter()
        sequences = []
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            feats = (teacher_forced_features(target, batch, layer_ids, with_final=True) if with_features
                     else [None] * len(batch))
            sequences += list(zip(batch, feats))
        write_shard(path, sequences, [prefix] * len(sequences), time.perf_counter() - t0,
                    final_size=target.model.config.hidden_size if with_features else 0)
    return paths
