"""Training prompts the target writes itself (Magpie, Xu et al. 2024), with no hub and no benchmark data.

The instruct target gets its chat template up to the start of a user turn and samples the user's
message at T=1 (top-p 1). What it writes is what its own chat distribution expects a user to ask,
so the replies it then gives are the drafter's on-policy chat data. Candidates are kept when they
end their turn within the token budget, have ``min_words``..``max_chars`` of mostly-ASCII text, are
not a near duplicate of a kept prompt (same normalised text or the same first ``dedup_words``
words) and share no word ``ngram``-gram with any decontamination set (the benchmark prompts).

The kept prompts are cached as one JSONL file (written atomically with the filter counts in a
``.meta.json`` beside it); a rerun with the same settings reads it instead of sampling again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from pipeline.files import write_atomic
from pipeline.models.target import Target
from pipeline.prompts import Prompt

log = logging.getLogger(__name__)

_SENTINEL = "\u2063BLOCKPILOT_USER_TURN\u2063"
_WORD = re.compile(r"[a-z0-9]+")


def user_turn_prefix(tokenizer) -> torch.Tensor:
    """Token ids [n] of the chat template up to where the first user message's text starts.

    Found by rendering a one-message chat whose content is a sentinel and cutting before it, so it
    holds for any chat template (a default system prompt included).

    Raises:
        ValueError: the tokenizer has no chat template (a base model: self-written prompts need an
            instruct target), or the template does not copy the user text verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("source: self needs an instruct target with a chat template; this tokenizer has none "
                         "(train on prompt files instead)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not copy the user's text verbatim; source: self cannot cut it")
    prefix = text[: text.index(_SENTINEL)]
    return tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"][0]


def normalise(text: str) -> str:
    """Lower-case words joined by single spaces (punctuation dropped): the key of exact duplicates."""
    return " ".join(_WORD.findall(text.lower()))


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The set of word ``n``-grams of ``text`` (normalised); a text shorter than n words gives its whole word tuple."""
    words = normalise(text).split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def reject_reason(text: str, min_words: int = 4, max_chars: int = 1200, min_ascii: float = 0.97) -> str | None:
    """Why a sampled user message is not a usable prompt, or None when it is.

    Reasons: ``short`` (fewer than ``min_words`` words), ``long`` (over ``max_chars`` characters),
    ``language`` (under ``min_ascii`` of its letters are ASCII: the sets are English), ``template``
    (it contains chat-template markup such as ``<|im_start|>``).
    """
    if "<|" in text or "|>" in text:
        return "template"
    if len(text.split()) < min_words:
        return "short"
    if len(text) > max_chars:
        return "long"
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < min_ascii:
        return "language"
    return None


class PromptFilter:
    """Keeps sampled prompts that pass ``reject_reason``, are new and share no ``ngram``-gram with ``blocked`` texts.

    ``counts`` tallies every decision: ``kept``, ``unfinished``, ``duplicate``, ``contaminated`` and the
    ``reject_reason`` names.
    """

    def __init__(self, blocked: Iterable[str] = (), ngram: int = 8, dedup_words: int = 8, **reject_kwargs):
        self.ngram, self.dedup_words, self.reject_kwargs = ngram, dedup_words, reject_kwargs
        self.blocked: set[tuple[str, ...]] = set()
        for text in blocked:
            self.blocked |= ngrams(text, ngram)
        self.seen: set[str] = set()
        self.counts: dict[str, int] = {}

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def offer(self, text: str, finished: bool = True) -> bool:
        """True when ``text`` (one sampled user message; ``finished``: it ended its turn) is kept."""
        text = text.strip()
        reason = "unfinished" if not finished else reject_reason(text, **self.reject_kwargs)
        if reason is None:
            words = normalise(text).split()
            keys = {" ".join(words), "prefix:" + " ".join(words[: self.dedup_words])}
            if keys & self.seen:
                reason = "duplicate"
            elif ngrams(text, self.ngram) & self.blocked:
                reason = "contaminated"
            else:
                self.seen |= keys
        self._count(reason or "kept")
        return reason is None


@torch.inference_mode()
def sample_user_turns(target: Target, n: int, max_new_tokens: int, generator: torch.Generator,
                      temperature: float = 1.0) -> list[tuple[str, bool]]:
    """``n`` user messages sampled from the target after its user-turn prefix, in one batch.

    Returns:
        per row ``(text, finished)``; ``finished`` is False when the row ran out of ``max_new_tokens``
        before a stop token (the caller drops those: a cut-off request).
    """
    from pipeline.drafting.responses import generate_batch

    prefix = user_turn_prefix(target.tokenizer)
    stop = set(target.stop_token_ids())
    results = []
    for tokens, _ in generate_batch(target, [prefix] * n, [], max_new_tokens, with_features=False,
                                    temperature=temperature, generator=generator):
        reply = tokens[len(prefix):].tolist()
        ended = bool(reply) and reply[-1] in stop
        results.append((target.tokenizer.decode(reply[:-1] if ended else reply, skip_special_tokens=True), ended))
    return results


def self_prompts_key(target_name: str, settings: dict) -> str:
    """A short hash naming the cache file of one set of self-written prompts (target + every setting)."""
    blob = json.dumps({"target": target_name, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_self_prompts(target: Target, target_name: str, out_dir: str | Path, name: str, limit: int,
                       blocked_texts: Iterable[str] = (), batch_size: int = 64, max_new_tokens: int = 96,
                       temperature: float = 1.0, seed: int = 0, max_rounds: int | None = None,
                       ngram: int = 8, **reject_kwargs) -> list[Prompt]:
    """Sample, filter and cache ``limit`` self-written prompts (fewer if ``max_rounds`` batches run out).

    Args:
        target_name: the target's name or path (part of the cache key).
        out_dir: where ``self-<key>.jsonl`` and its ``.meta.json`` go.
        name: the prompt set's name (``Prompt.source_set`` and the ids' prefix).
        blocked_texts: decontamination texts (benchmark prompts): a prompt sharing a word ``ngram``-gram
            with any of them is dropped.
        max_rounds: at most this many sampling batches (default: 4 x the batches ``limit`` needs).
    Returns:
        the kept prompts, ids ``<name>-<i>``.
    Raises:
        ValueError: ``limit`` < 1, ``temperature`` <= 0, a target without a chat template, or no prompt kept.
    """
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"self-written prompt sets need limit >= 1 (how many prompts the target writes), got {limit!r}")
    if temperature <= 0:
        raise ValueError(f"self-written prompts are sampled: temperature must be > 0, got {temperature}")
    blocked_texts = list(blocked_texts)
    settings = {"limit": limit, "batch_size": batch_size, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "seed": seed, "ngram": ngram, "blocked": hashlib.sha256("\n".join(blocked_texts).encode()).hexdigest(),
                **reject_kwargs}
    out_dir = Path(out_dir)
    path = out_dir / f"self-{self_prompts_key(target_name, settings)}.jsonl"
    if path.exists():
        return [Prompt(row["id"], row["turns"], name) for row in map(json.loads, path.read_text().splitlines())]
    user_turn_prefix(target.tokenizer)  # fail before sampling on a base model
    filt = PromptFilter(blocked_texts, ngram=ngram, **reject_kwargs)
    kept: list[str] = []
    generator = torch.Generator().manual_seed(seed)
    rounds = max_rounds or 4 * -(-limit // batch_size)
    with tqdm(total=limit, desc=f"{name}: self-written prompts", unit="prompt") as bar:
        for _ in range(rounds):
            for text, finished in sample_user_turns(target, batch_size, max_new_tokens, generator, temperature):
                if len(kept) < limit and filt.offer(text, finished):
                    kept.append(text.strip())
                    bar.update(1)
            if len(kept) >= limit:
                break
    log.info("%s: kept %d self-written prompts; filter counts %s", name, len(kept), filt.counts)
    if not kept:
        raise ValueError(f"{name}: the target wrote no usable prompt in {rounds} batches (filter counts {filt.counts}); "
                         "raise the set's prompt_max_tokens if most are 'unfinished', or train on prompt files")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"{name}-{i}", "turns": [t], "source": "self"} for i, t in enumerate(kept)]
    meta = path.with_suffix(".meta.json")
    meta.write_text(json.dumps({"settings": {k: v for k, v in settings.items() if k != "blocked"},
                                "decontamination_texts": len(blocked_texts), "counts": filt.counts}, indent=2))
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return [Prompt(r["id"], r["turns"], name) for r in rows]
