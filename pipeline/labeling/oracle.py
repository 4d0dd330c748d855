"""The oracle label of one prompt: tau(B) and tokens/s for every candidate B after ONE prefill.

``label_prompt`` prefills once, keeps the target's last-token distribution (top-k log-probs, entropy,
optionally the full logits row) for the dataset stage, then measures every candidate B by brute force
(``mode="brute"``: one decode per B) or by replay (``mode="replay"``: one autoregressive trace, then
drafter-only replays of all Bs batched, tokens/s from the machine's ``pipeline.costs.CostModel``). Labels:
``label_tau`` = argmax mean tau, ``label_speed`` = argmax tokens/s, ties -> the smaller B (``pick_label``).
``rank_agreement`` checks how well the cost model's tokens/s rank (and pick) the candidates like measured ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from pipeline.costs import CostModel, steps_of
from pipeline.decoding.requests import DecodeConfig
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.decoding.trees import TOP_K as TREE_TOP_K
from pipeline.labeling.brute import brute_force, reseed
from pipeline.labeling.checks import LM_HEAD_MODES, MODES  # noqa: F401  (the label settings' names, re-exported)
from pipeline.labeling.replay import replay, target_trace
from pipeline.labeling.store import CONFIDENCE_COLUMNS



def pick_label(candidates: Sequence[int], values: Sequence[float]) -> int:
    """The candidate with the largest value; ties (within 1e-9 relative) go to the smaller candidate.

    Raises:
        ValueError: for empty or mismatched inputs, or when every value is NaN.
    """
    if not candidates or len(candidates) != len(values):
        raise ValueError(f"need one value per candidate, got {len(values)} values for {len(candidates)} candidates")
    pairs = [(int(c), float(v)) for c, v in zip(candidates, values) if not math.isnan(float(v))]
    if not pairs:
        raise ValueError("every value is NaN; nothing to pick")
    best = max(v for _, v in pairs)
    return min(c for c, v in pairs if math.isclose(v, best, rel_tol=1e-9, abs_tol=1e-12))


def candidate_window(center: int, k: int, max_block_size: int, min_block_size: int = 2) -> list[int]:
    """K consecutive block sizes around ``center`` (e.g. the training B), shifted to fit [min, max].

    Example: center 8, k 9 -> [4..12]; center 4, k 9, min 2 -> [2..10].

    Raises:
        ValueError: when k sizes do not fit in [min_block_size, max_block_size].
    """
    if k < 1 or k > max_block_size - min_block_size + 1:
        raise ValueError(f"cannot pick {k} block sizes within [{min_block_size}, {max_block_size}]")
    lo = min(max(min_block_size, center - k // 2), max_block_size - k + 1)
    return list(range(lo, lo + k))


def check_candidates(candidates: Sequence[int], decoder: SpeculativeDecoder) -> list[int]:
    """Validate and sort candidate block sizes.

    Raises:
        ValueError: for an empty list, duplicates, or a B out of the decoder's range (naming the fix).
    """
    values = [int(b) for b in candidates]
    if not values:
        raise ValueError("label.block_sizes is empty; give candidates, e.g. label.block_sizes=[6,7,8,9,10]")
    if len(set(values)) != len(values):
        raise ValueError(f"label.block_sizes has duplicates: {values}")
    for b in values:
        try:
            decoder.check_block_size(b)
        except ValueError as err:
            raise ValueError(f"label.block_sizes: {err}") from err
    return sorted(values)


def distribution_features(last_logits: torch.Tensor, topk: int, store_full_logits: bool = False) -> dict:
    """The target's last-token predictive distribution at prefill (temperature 1), for the policy.

    Args:
        last_logits: [V] float logits at the last prompt token.
        topk: how many of the most likely tokens to keep (clipped to V).
    Returns:
        {"topk_ids" (k ints, most likely first), "topk_logprobs" (k floats, nats, descending),
        "entropy" (nats, full distribution), "vocab_size" (V), "full_logits" (float16 bytes of the [V]
        row, or None)}.
    Raises:
        ValueError: for topk < 1.
    """
    if topk < 1:
        raise ValueError(f"label.topk must be >= 1, got {topk}")
    logits = last_logits.detach().float().reshape(-1).cpu()
    logp = torch.log_softmax(logits, dim=-1)
    values, ids = logp.topk(min(topk, logp.shape[0]))
    entropy = float(torch.special.entr(logp.exp()).sum())
    full = logits.to(torch.float16).numpy().tobytes() if store_full_logits else None
    return {"topk_ids": ids.tolist(), "topk_logprobs": values.tolist(), "entropy": entropy,
            "vocab_size": int(logits.shape[0]), "full_logits": full}


def decode_full_logits(blob: bytes) -> np.ndarray:
    """The [V] float16 row stored in ``full_logits`` (inverse of ``distribution_features``)."""
    return np.frombuffer(blob, dtype=np.float16)


@dataclass
class LabelSettings:
    """How to label (the ``label`` config group plus ``decode``).

    Attributes:
        candidates: block sizes to compare (sorted).
        mode: ``replay`` (one target decode + drafter replays) or ``brute`` (one decode per B).
        max_new_tokens, temperature, seed: the decode settings (``decode`` group).
        repeats: seeds seed, seed+1, ... averaged at T>0 (T=0 always uses one).
        topk, store_full_logits: what to keep of the prefill distribution.
        lm_head: replay's LM-head mode (``auto`` | ``lazy`` | ``full``).
        record_confidence: (replay) keep the verify-width calibration's samples of the first seed (``conf_*`` columns).
        tree_top_k: with ``record_confidence``, the drafter's candidates kept per sample (``conf_top_p``/``conf_rank``:
            what a draft tree's rank-aware calibration is fitted on).
    """

    candidates: list[int]
    mode: str = "replay"
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    topk: int = 64
    store_full_logits: bool = False
    lm_head: str = "auto"
    record_confidence: bool = True
    tree_top_k: int = TREE_TOP_K

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"label.mode must be one of {MODES}, got {self.mode!r}")
        if self.lm_head not in LM_HEAD_MODES:
            raise ValueError(f"label.lm_head must be one of {LM_HEAD_MODES}, got {self.lm_head!r}")
        if self.repeats < 1:
            raise ValueError(f"label.repeats must be >= 1, got {self.repeats}")

    @property
    def seeds(self) -> list[int]:
        """The sampling seeds averaged over (one at T=0: greedy decoding ignores the seed)."""
        return [self.seed + r for r in range(self.repeats if self.temperature > 0 else 1)]

    def decode_config(self, seed: int) -> DecodeConfig:
        return DecodeConfig(self.max_new_tokens, self.temperature, seed)


@dataclass
class PromptLabel:
    """The row of one prompt (without id/source/shard columns) and, on request, the raw runs.

    Attributes:
        row: the label-schema fields computed here (see ``pipeline.labeling.store.LABEL_SCHEMA``).
        runs: per seed, ``BruteResult`` (brute) or ``(Trace, {B: ReplayResult})`` (replay), when kept.
        reply_ids: the target's reply under the first seed (``settings.seed``), token ids: the same for every
            B (lossless decoding), so it is the assistant turn that the prompt's next request builds on.
    """

    row: dict
    runs: list = field(default_factory=list)
    reply_ids: list[int] = field(default_factory=list)


@torch.inference_mode()
def label_prompt(decoder: SpeculativeDecoder, input_ids: torch.Tensor, settings: LabelSettings,
                 latency: CostModel | None = None, keep_runs: bool = False, record_gaps: bool = False) -> PromptLabel:
    """Label one prompt: prefill once, then tau(B), new tokens, decode ms and tokens/s per candidate.

    Args:
        input_ids: [1, n] chat-templated prompt.
        latency: the machine's cost model, needed in replay mode (tokens/s and decode ms come from it); ignored in brute mode,
            where they are measured (tokens/s = new tokens / (prefill + decode seconds)).
        keep_runs: keep the per-seed brute/replay results in ``PromptLabel.runs``.
        record_gaps: (replay) record top-2 score gaps, for divergence reports.
    Over the seeds of ``settings.seeds``, ``tau``, ``new_tokens`` and ``decode_ms`` are means and
    ``tokens_per_s`` = mean new tokens / (prefill + mean decode) seconds.
    Raises:
        ValueError: replay mode without a latency model; bad prompts/block sizes (from the decoder).
    """
    if settings.mode == "replay" and latency is None:
        raise ValueError("replay mode needs a cost model (pipeline.timing.steps.load_or_measure) for tokens/s")
    candidates = settings.candidates
    prefill = decoder.prefill(input_ids, settings.decode_config(settings.seed), want_features=True)
    n = prefill.input_ids.shape[1]
    row = {"prompt_tokens": n, "candidates": list(candidates), "prefill_ms": prefill.prefill_ms,
           **distribution_features(prefill.last_logits, settings.topk, settings.store_full_logits)}
    per_b = {b: {"tau": [], "new_tokens": [], "decode_ms": []} for b in candidates}
    samples: dict[str, list] = {k: [] for k in CONFIDENCE_COLUMNS}
    runs = []
    reply_ids: list[int] = []
    seeds = settings.seeds
    for r, seed in enumerate(seeds):
        config = settings.decode_config(seed)
        last = r == len(seeds) - 1
        if settings.mode == "brute":
            result = brute_force(decoder, prefill, candidates, config, consume=last)
            if r == 0:
                reply_ids = list(result.stats[candidates[0]].output_ids)
            for b, stats in result.stats.items():
                per_b[b]["tau"].append(stats.tau)
                per_b[b]["new_tokens"].append(stats.new_tokens)
                per_b[b]["decode_ms"].append(stats.decode_ms)
        else:
            trace = target_trace(decoder, reseed(prefill, config, copy_cache=not last), config, record_gaps)
            if r == 0:
                reply_ids = list(trace.tokens)
            record = settings.record_confidence and r == 0
            result = replay(decoder, trace, candidates, config, settings.lm_head, record_gaps, record, settings.tree_top_k)
            for b, res in result.items():
                for step in res.confidence if record else []:
                    for sample in step:
                        for key, value in zip(CONFIDENCE_COLUMNS, (b, *sample)):
                            samples[key].append(value)
                per_b[b]["tau"].append(res.tau)
                per_b[b]["new_tokens"].append(res.new_tokens)
                per_b[b]["decode_ms"].append(latency.decode_ms(res.block_sizes, res.starts, res.new_tokens,
                                                               settings.temperature))
            result = (trace, result)
        if keep_runs:
            runs.append(result)
    prefill_ms = prefill.prefill_ms if settings.mode == "brute" else latency.prefill_ms(n)
    row["tau"] = [float(np.mean(per_b[b]["tau"])) for b in candidates]
    row["new_tokens"] = [float(np.mean(per_b[b]["new_tokens"])) for b in candidates]
    row["decode_ms"] = [float(np.mean(per_b[b]["decode_ms"])) for b in candidates]
    row["tokens_per_s"] = [tokens / ((prefill_ms + ms) / 1e3) if prefill_ms + ms > 0 else 0.0
                           for tokens, ms in zip(row["new_tokens"], row["decode_ms"])]
    row["label_tau"] = pick_label(candidates, row["tau"])
    row["label_speed"] = pick_label(candidates, row["tokens_per_s"])
    row.update(samples)
    return PromptLabel(row, runs, reply_ids)


def predicted_tokens_per_s(latency: CostModel, stats_by_b: dict, temperature: float) -> dict[int, float]:
    """Cost-model tokens/s of decodes that really ran ({B: RequestStats} -> {B: tokens/s})."""
    out = {}
    for b, stats in stats_by_b.items():
        widths, starts = steps_of(stats)
        out[b] = latency.tokens_per_s(stats.prompt_tokens, widths, starts, stats.new_tokens, temperature)
    return out


# ------------------------------------------------------------------------------------------------
# checking the cost model's tokens/s against measured ones
# ------------------------------------------------------------------------------------------------
def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    ra, rb = pd.Series(list(a), dtype=float).rank(), pd.Series(list(b), dtype=float).rank()
    if ra.std() == 0 or rb.std() == 0 or len(ra) < 2:
        return math.nan
    return float(ra.corr(rb))


def kendall(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b; NaN when either side is constant."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denom if denom else math.nan


def rank_agreement(predicted: Sequence[Sequence[float]], measured: Sequence[Sequence[float]],
                   candidates: Sequence[Sequence[int]] | None = None) -> dict:
    """How well predicted tokens/s rank the candidates of each prompt like the measured ones.

    Args:
        predicted, measured: per prompt, tokens/s per candidate (same order).
        candidates: per prompt, the candidate Bs (for the best-B agreement; default 0..K-1).
    Returns:
        {"spearman": mean per-prompt Spearman, "kendall": mean per-prompt Kendall tau-b (prompts where
        either side is constant are skipped), "best_agreement": fraction of prompts whose fastest B agrees
        (ties -> smaller B, ``pick_label``), "n_prompts"}.
    Raises:
        ValueError: when the two sides differ in shape.
    """
    if len(predicted) != len(measured) or any(len(p) != len(m) for p, m in zip(predicted, measured)):
        raise ValueError("predicted and measured tokens/s must have one equal-length list per prompt")
    rhos = [r for p, m in zip(predicted, measured) if not math.isnan(r := spearman(p, m))]
    taus = [t for p, m in zip(predicted, measured) if not math.isnan(t := kendall(p, m))]
    best = []
    for k, (p, m) in enumerate(zip(predicted, measured)):
        cands = list(candidates[k]) if candidates is not None else list(range(len(p)))
        best.append(pick_label(cands, p) == pick_label(cands, m))
    return {
        "spearman": sum(rhos) / len(rhos) if rhos else math.nan,
        "kendall": sum(taus) / len(taus) if taus else math.nan,
        "best_agreement": sum(best) / len(best) if best else math.nan,
        "n_prompts": len(predicted),
    }
