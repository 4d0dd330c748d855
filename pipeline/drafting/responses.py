"""Target-generated responses and their context features, the drafter's training data.

The target answers every training prompt greedily, in left-padded batches. The same forward passes
that generate the response also yield the hidden states of the tapped target layers, so the context
features cost no extra target pass. Each batch is written as one safetensors shard (atomically);
a rerun skips shards already written.

Shard ``shard-XXXXX.safetensors`` holds, for the S sequences of one batch:
  ``tokens``   int32 [T]       prompt + response tokens of all sequences, concatenated;
  ``features`` bfloat16 [T, n_taps*H]  tapped hidden states at those tokens (the final token's row is
               zero: it was never fed to the target). Absent in token-only shards
               (``draft.features=online``: the training step runs the frozen target instead);
  ``final``    bfloat16 [T, H]  the target's last hidden state (after its final norm) at those tokens,
               beside ``features``: the target's next-token distribution for distillation losses;
  ``offsets``  int64 [S+1]     sequence boundaries in ``tokens``;
  ``prompt_lengths`` int64 [S] prompt tokens of each sequence.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import DynamicCache

from pipeline.files import atomic_file
from pipeline.models.target import Target, logit_head
from pipeline.prompts import Prompt, chat_input_ids

log = logging.getLogger(__name__)


@torch.inference_mode()
def generate_batch(
    target: Target, prompt_ids: list[torch.Tensor], layer_ids: list[int], max_new_tokens: int,
    with_features: bool = True, temperature: float = 0.0, generator: torch.Generator | None = None,
    with_final: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Responses for a batch of prompts (greedy, or sampled at ``temperature`` > 0 with ``generator``),
    with the tapped features of every fed token.

    Rows that reach a stop token leave the batch (their cache rows are dropped), so stragglers do not
    keep finished rows busy.

    Args:
        prompt_ids: S tensors [n_i] of prompt ids.
        layer_ids: target decoder layers to tap (0-based).
        with_features: False returns ``features=None`` (token-only data, no hidden states kept).
        temperature: 0 takes the argmax; > 0 samples from softmax(logits / temperature) (full vocabulary,
            no top-k/top-p), drawing on ``generator`` so a shard is reproducible; a CPU generator with a model
            on another device seeds a generator there once, and every draw stays on the device.
        with_final: append the target's final hidden state (after its final norm) as H more feature columns.
    Returns:
        per sequence ``(tokens [n_i + r_i], features [n_i + r_i, n_taps*H (+ H)] bf16 or None)``; responses
        end at the first stop token or after ``max_new_tokens``. The final token's feature row is zero (never fed).
    Raises:
        ValueError: a negative temperature.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    model, base = target.model, target.model.base_model
    device = model.device
    stop = torch.tensor(target.stop_token_ids(), device=device)
    head = logit_head(model)  # bias, scaling, softcapping as the model's forward applies them
    if generator is not None and generator.device != device:
        # draw on the model's device (no [S, V] probability copy to the host per step), from a device generator
        # seeded by the given one: reproducible, and a CPU run (generator on the CPU) draws exactly as before
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        generator = torch.Generator(device=device).manual_seed(seed)
    s, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    ids = torch.full((s, width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((s, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    cache = DynamicCache(config=model.config)
    rows = list(range(s))  # original index of each active batch row
    tokens: list[list[torch.Tensor]] = [[p.to(device)] for p in prompt_ids]
    feats: list[list[torch.Tensor]] = [[] for _ in range(s)]
    step_ids = ids
    for step in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        out = base(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache,
                   use_cache=True, output_hidden_states=with_features)
        if with_features:
            taps = [out.hidden_states[i + 1] for i in layer_ids] + ([out.last_hidden_state] if with_final else [])
            tapped = torch.cat(taps, dim=-1).to(torch.bfloat16)
        logits = head(out.last_hidden_state[:, -1])
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).flatten()
        else:
            nxt = logits.argmax(-1)
        finished = torch.isin(nxt, stop) | (step == max_new_tokens - 1)
        for j, r in enumerate(rows):
            if with_features:
                n_real = len(prompt_ids[r]) if step == 0 else 1
                feats[r].append(tapped[j, tapped.shape[1] - n_real:])
            tokens[r].append(nxt[j : j + 1])
        if bool(finished.all()):
            break
        keep = (~finished).nonzero().flatten()
        if len(keep) < len(rows):
            cache.batch_select_indices(keep)
            mask = mask[keep]
            nxt = nxt[keep]
            rows = [rows[k] for k in keep.tolist()]
        step_ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
    result = []
    for r in range(s):
        if not with_features:
            result.append((torch.cat(tokens[r]).cpu(), None))
            continue
        f = torch.cat(feats[r])
        result.append((torch.cat(tokens[r]).cpu(), torch.cat([f, torch.zeros_like(f[:1])]).cpu()))
    return result


def write_shard(path: Path, sequences: list[tuple[torch.Tensor, torch.Tensor | None]], prompt_lengths: list[int],
                seconds: float | None = None, final_size: int = 0) -> None:
    """Atomically write one shard (see the module docstring for its tensors); ``seconds``, the wall time
    that produced it, goes into the safetensors metadata (``generation_seconds``). Sequences whose
    features are all None make a token-only shard. ``final_size`` > 0: the last ``final_size`` feature
    columns are the target's final hidden state and go to the ``final`` tensor."""
    tokens = torch.cat([t for t, _ in sequences]).to(torch.int32)
    offsets = torch.tensor([0] + [len(t) for t, _ in sequences]).cumsum(0)
    tensors = {"tokens": tokens, "offsets": offsets, "prompt_lengths": torch.tensor(prompt_lengths)}
    if any(f is not None for _, f in sequences):
        feats = torch.cat([f for _, f in sequences])
        if final_size:
            tensors["final"] = feats[:, -final_size:].contiguous()
            feats = feats[:, :-final_size]
        tensors["features"] = feats.contiguous()
    with atomic_file(path) as tmp:
        save_file(tensors, tmp, metadata=None if seconds is None else {"generation_seconds": f"{seconds:.3f}"})


def generation_seconds(paths: list[Path]) -> tuple[float, int]:
    """Recorded wall time (s) that produced the shards ``paths``, and how many shards carry no record."""
    total, unknown = 0.0, 0
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            value = (f.metadata() or {}).get("generation_seconds")
        if value is None:
            unknown += 1
        else:
            total += float(value)
    return total, unknown


def read_shard(path: Path) -> list[dict]:
    """Sequences of one shard as dicts ``{tokens [n], features [n, F], final [n, H], prompt_length}`` (no
    ``features`` key for a token-only shard, no ``final`` key for a shard written without it)."""
    data = load_file(path)
    off = data["offsets"].tolist()
    sequences = []
    for a, b, n in zip(off[:-1], off[1:], data["prompt_lengths"].tolist()):
        seq = {"tokens": data["tokens"][a:b].long(), "prompt_length": int(n)}
        for key in ("features", "final"):
            if key in data:
                seq[key] = data[key][a:b]
        sequences.append(seq)
    return sequences


def build_response_cache(
    target: Target,
    prompts: list[Prompt],
    out_dir: str | Path,
    layer_ids: list[int],
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    batch_size: int = 32,
    max_batches: int | None = None,
    with_features: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[Path]:
    """Generate (or resume) the response cache for ``prompts``; returns the shard paths.

    ``max_batches`` keeps only the first batches (the shortest prompts), to bound generation time.
    ``with_features=False`` writes token-only shards (for ``draft.features=online``).
    ``temperature`` > 0 samples the replies (shard ``k`` from a generator seeded with ``seed`` and ``k``,
    so a resumed run writes the same shard); 0 is greedy.

    Prompts longer than ``max_prompt_tokens`` are skipped (logged). Prompts are sorted by length so
    that batches need little padding; shard ``k`` always holds the same prompts, so reruns resume.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoded = []
    for p in prompts:
        ids = chat_input_ids(target.tokenizer, p.turns[:1])[0]
        if len(ids) <= max_prompt_tokens:
            encoded.append(ids)
    skipped = len(prompts) - len(encoded)
    if skipped:
        log.info("skipped %d prompts longer than %d tokens", skipped, max_prompt_tokens)
    encoded.sort(key=len)
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)][:max_batches]
    paths = []
    for k, batch in enumerate(tqdm(batches, desc="target responses", unit="batch")):
        path = out_dir / f"shard-{k:05d}.safetensors"
        paths.append(path)
        if path.exists():
            continue
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(seed * 1_000_003 + k) if temperature > 0 else None
        sequences = generate_batch(target, batch, layer_ids, max_new_tokens, with_features, temperature, generator,
                                   with_final=with_features)
        write_shard(path, sequences, [len(b) for b in batch], time.perf_counter() - t0,
                    final_size=target.model.config.hidden_size if with_features else 0)
    return paths
