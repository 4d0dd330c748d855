"""A per-machine latency model of speculative decoding, and its check against measured speed.

Replay labelling knows every step's block width b and context length but runs no target verify, so
its tokens/s come from a model: a short benchmark (``measure_latency``) times, for each block width b
and each context-length bucket L, one drafter step (forward over b tokens with L context + LM head over
b-1 rows + sampling) and one target verify (forward over b tokens with an L-token cache, with the
drafter's features + LM head + sampling), plus a prefill of L tokens. A decode then costs

    decode_ms = sum over steps of (draft_ms(b, L) [b > 1] + verify_ms(b, L))  (+ Gumbel noise at T>0)

Over b, each bucket's timings are smoothed by a least-squares line (``fit="linear"``, the default: a
CPU shared with other jobs makes single timings noisy, and a noisy bump would flip rankings) or
interpolated point to point (``fit="interp"``); over L they are interpolated linearly (linear
extrapolation outside the measured range).
``rank_agreement`` compares predicted and measured tokens/s per prompt (Spearman and Kendall).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Sequence

import pandas as pd
import torch
from transformers import DynamicCache

from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.speculative import RequestStats, SpeculativeDecoder, _now, crop_to
from pipeline.models.target import new_cache

log = logging.getLogger(__name__)


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through sorted ``xs`` (linear extrapolation at both ends, never below 0)."""
    if len(xs) == 1:
        return max(0.0, float(ys[0]))
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _isotonic(ys: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


@dataclass
class LatencyModel:
    """Measured step costs of one target/drafter pair on one machine (all times in ms).

    Attributes:
        context_buckets: context lengths L (tokens) at which steps were timed, ascending.
        block_sizes: block widths b timed, ascending (1 = autoregressive step, no drafter).
        verify_ms: {b: [ms per bucket]} target forward over b tokens + LM head + sampling.
        draft_ms: {b: [ms per bucket]} drafter forward over b tokens + LM head over b-1 rows + sampling (b >= 2).
        prefill_ms: [ms per bucket] prefill of L tokens.
        noise_ms: Gumbel noise of one sampled position (T>0 only; 0 at T=0).
        info: where it was measured (host, device, dtype, torch version, target, drafter).
        fit: ``linear`` (least-squares line over b per bucket) or ``interp`` (through the points).
    Raises:
        ValueError: for an unknown ``fit`` or tables whose rows do not have one value per bucket.
    """

    context_buckets: list[int]
    block_sizes: list[int]
    verify_ms: dict[int, list[float]]
    draft_ms: dict[int, list[float]]
    prefill_ms: list[float]
    noise_ms: float = 0.0
    info: dict = field(default_factory=dict)
    fit: str = "linear"

    def __post_init__(self) -> None:
        if self.fit not in ("linear", "interp"):
            raise ValueError(f"latency fit must be 'linear' or 'interp', got {self.fit!r}")
        for name, table in (("verify_ms", self.verify_ms), ("draft_ms", self.draft_ms), ("prefill_ms", {0: self.prefill_ms})):
            if any(len(row) != len(self.context_buckets) for row in table.values()):
                raise ValueError(f"latency model {name}: need one value per context bucket {self.context_buckets}")
        self._lines = {"verify": self._fit_lines(self.verify_ms), "draft": self._fit_lines(self.draft_ms)}

    def _fit_lines(self, table: dict[int, list[float]]) -> list[tuple[float, float]]:
        """Per bucket, (intercept, slope) of the least-squares line of ms over b."""
        widths = sorted(table)
        lines = []
        for j in range(len(self.context_buckets)):
            ys = [table[w][j] for w in widths]
            if len(widths) < 2:
                lines.append((ys[0] if ys else 0.0, 0.0))
                continue
            mean_b, mean_y = sum(widths) / len(widths), sum(ys) / len(ys)
            slope = sum((b - mean_b) * (y - mean_y) for b, y in zip(widths, ys)) / sum((b - mean_b) ** 2 for b in widths)
            lines.append((mean_y - slope * mean_b, slope))
        return lines

    def _at(self, kind: str, b: int, context: int) -> float:
        """Step-part cost (``kind``: verify | draft) of width b at a context length (ms)."""
        if self.fit == "linear":
            per_bucket = [max(0.0, a + slope * b) for a, slope in self._lines[kind]]
            return _interp(context, self.context_buckets, per_bucket)
        table = self.verify_ms if kind == "verify" else self.draft_ms
        widths = sorted(table)
        per_width = [_interp(context, self.context_buckets, table[w]) for w in widths]
        return _interp(b, widths, per_width)

    def measured_ms(self, kind: str, b: int, context: int) -> float:
        """Step-part cost through the measured points (``kind``: verify | draft; ms), non-decreasing in b.

        Interpolated over the context buckets, then made monotone in b by isotonic regression over the measured
        widths (pool-adjacent-violators: a noisy bump is averaged with its neighbours instead of lifting every
        wider point), then interpolated between widths (``fit`` is ignored): the cost curve the verify-width policy
        compares k against, where a least-squares line would hide a step between widths.
        """
        table = self.verify_ms if kind == "verify" else self.draft_ms
        widths = sorted(table)
        if not widths:
            return 0.0
        curve = _isotonic([_interp(context, self.context_buckets, table[w]) for w in widths])
        return _interp(b, widths, curve)

    def step_ms(self, b: int, context: int) -> float:
        """One draft-verify step of width b with ``context`` tokens in the target cache (ms)."""
        ms = self._at("verify", b, context)
        if b > 1 and self.draft_ms:
            ms += self._at("draft", b, context)
        return ms

    def decode_ms(self, block_sizes: Sequence[int], starts: Sequence[int], new_tokens: int, temperature: float) -> float:
        """Predicted decode time (ms) of a request whose steps had widths ``block_sizes`` at cache lengths ``starts``."""
        ms = sum(self.step_ms(int(b), int(s)) for b, s in zip(block_sizes, starts))
        return ms + (self.noise_ms * new_tokens if temperature > 0 else 0.0)

    def prefill(self, prompt_tokens: int) -> float:
        """Predicted prefill time of a prompt (ms)."""
        return _interp(prompt_tokens, self.context_buckets, self.prefill_ms)

    def tokens_per_s(self, prompt_tokens: int, block_sizes: Sequence[int], starts: Sequence[int], new_tokens: int,
                     temperature: float) -> float:
        """Predicted end-to-end tokens/s (new tokens over prefill + decode time) of one request."""
        seconds = (self.prefill(prompt_tokens) + self.decode_ms(block_sizes, starts, new_tokens, temperature)) / 1e3
        return new_tokens / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready dict (int keys become strings)."""
        out = asdict(self)
        out["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        out["draft_ms"] = {str(k): v for k, v in self.draft_ms.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyModel":
        """Inverse of ``to_dict``.

        Raises:
            KeyError: for a dict without the model's fields.
        """
        return cls(
            context_buckets=[int(x) for x in data["context_buckets"]],
            block_sizes=[int(x) for x in data["block_sizes"]],
            verify_ms={int(k): [float(x) for x in v] for k, v in data["verify_ms"].items()},
            draft_ms={int(k): [float(x) for x in v] for k, v in data["draft_ms"].items()},
            prefill_ms=[float(x) for x in data["prefill_ms"]],
            noise_ms=float(data.get("noise_ms", 0.0)),
            info=dict(data.get("info", {})),
            fit=str(data.get("fit", "linear")),
        )


def steps_of(stats: RequestStats) -> tuple[list[int], list[int]]:
    """(block widths, cache lengths at verify) of a decoded request's steps."""
    starts, start = [], stats.prompt_tokens
    for tau in stats.taus:
        starts.append(start)
        start += tau
    return list(stats.block_sizes), starts


@torch.inference_mode()
def measure_latency(decoder: SpeculativeDecoder, block_sizes: Sequence[int], context_buckets: Sequence[int],
                    repeats: int = 3, temperature: float = 0.0, seed: int = 0, fit: str = "linear") -> LatencyModel:
    """Time prefill, target verify and drafter steps on this machine (fastest of ``repeats`` after a warm-up).

    Times every width 1..max(``block_sizes``): clipped last blocks and the verify-width policy's
    verifies of k+1 tokens (``pipeline.policy.verify_width``) read measured points. Random token ids
    stand in for a prompt (step cost does not depend on token values).

    Raises:
        ValueError: when no bucket fits the target's context, or for ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"latency repeats must be >= 1, got {repeats}")
    widths = list(range(1, max([2, *[int(b) for b in block_sizes]]) + 1))
    if decoder.drafter is None:
        widths = [1]
    for b in widths:
        decoder.check_block_size(b)
    buckets = sorted({int(c) for c in context_buckets if 1 <= int(c) and int(c) + max(widths) <= decoder.max_context})
    if not buckets:
        raise ValueError(f"no context bucket of {list(context_buckets)} fits the target's {decoder.max_context} "
                         "positions; set label.latency.context_buckets to smaller lengths")
    device, model, drafter = decoder.device, decoder.model, decoder.drafter
    vocab = decoder.lm_head.shape[0]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(vocab, len(decoder.target.tokenizer)), (1, max(buckets) + max(widths)), generator=generator).to(device)

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = _now(device)
            fn()
            times.append((_now(device) - t0) * 1e3)
        return min(times)  # other load only ever adds time: the minimum is the step's own cost

    sampler = PositionKeyedSampler(temperature, seed, vocab)
    if temperature > 0:  # noise is timed separately (noise_ms), not inside the steps
        for p in range(max(buckets) + max(widths) + 1):
            sampler.gumbel(p)
    verify = {b: [] for b in widths}
    draft = {b: [] for b in widths if b > 1}
    prefill_ms = []
    from tqdm.auto import tqdm

    progress = tqdm(total=len(buckets) * (1 + len(widths)), desc="latency model", unit="timing")
    for length in buckets:
        state = {}

        def prefill() -> None:
            cache = new_cache(model, decoder.kv_cache)
            logits, features = decoder.target_forward(ids[:, :length], cache, 0, want_features=drafter is not None,
                                                      last_only=True)
            sampler.pick(logits, length)
            state["cache"], state["features"] = cache, features

        prefill_ms.append(timed(prefill))
        progress.update(1)
        cache, features = state["cache"], state["features"]
        for b in widths:
            progress.update(1)
            block = ids[:, length : length + b]

            def verify_step() -> None:
                logits, _ = decoder.target_forward(block, cache, length, want_features=drafter is not None)
                sampler.pick(logits, length + 1)
                crop_to(cache, length)

            verify[b].append(timed(verify_step))
            if b == 1:
                continue
            new = min(b, length)  # context features not yet cached: about one step's tokens
            draft_cache = DynamicCache()
            drafter(decoder.embed(block), features[:, : length - new],
                    torch.arange(0, length - new + b, device=device)[None], cache=draft_cache)
            crop_to(draft_cache, length - new)

            def draft_step() -> None:
                hidden = drafter(decoder.embed(block), features[:, length - new : length],
                                 torch.arange(length - new, length + b, device=device)[None], cache=draft_cache)
                crop_to(draft_cache, length - new)
                sampler.pick(decoder.drafter_head(hidden[0, 1:]).float(), length + 1, decoder.draft_vocab)

            draft[b].append(timed(draft_step))
    progress.close()
    noise_ms = 0.0
    if temperature > 0:
        fresh = PositionKeyedSampler(temperature, seed + 1, vocab)
        next_position = iter(range(1 << 30))
        noise_ms = timed(lambda: [fresh.gumbel(next(next_position)) for _ in range(8)]) / 8
    info = {
        "host": platform.node(), "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "target": decoder.target.name,
        "temperature": temperature, "repeats": repeats,
    }
    return LatencyModel(buckets, widths, verify, draft, prefill_ms, noise_ms, info, fit)


def measure_latency_cached(decoder: SpeculativeDecoder, block_sizes: Sequence[int], context_buckets: Sequence[int],
                           repeats: int = 3, temperature: float = 0.0, seed: int = 0, cache_dir: str | Path | None = None,
                           identity: dict | None = None) -> LatencyModel:
    """``measure_latency``, reused across runs: the model is kept in ``cache_dir/<key>.json``, the key hashing
    ``identity`` (target, drafter, dtype, device), this host, torch's thread count, the decoder's resolved forward path
    (``backend`` with its kernel's version, ``fast_forward``, ``kv_cache``) and the arguments.

    A new run on the same machine and models reuses the stored model instead of measuring it again (about
    half a minute for the embedded default); delete the file, or pass ``cache_dir=None``
    (``label.latency.cache=null``), to measure afresh.

    Raises:
        ValueError: as ``measure_latency``.
    """
    if cache_dir is None:
        return measure_latency(decoder, block_sizes, context_buckets, repeats, temperature, seed)
    key = {"identity": identity or {}, "host": platform.node(), "threads": torch.get_num_threads(),
           "forward": decoder.forward_path(),  # backend (kernel hash, crossover), lean forwards, KV cache
           "block_sizes": sorted(int(b) for b in block_sizes), "context_buckets": sorted(int(c) for c in context_buckets),
           "repeats": int(repeats), "temperature": float(temperature), "seed": int(seed)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"latency-{digest}.json"
    if path.is_file():
        log.info("reusing the latency model measured earlier on this machine: %s (delete it to remeasure)", path)
        return LatencyModel.from_dict(json.loads(path.read_text())["latency_model"])
    model = measure_latency(decoder, block_sizes, context_buckets, repeats, temperature, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "latency_model": model.to_dict()}, indent=2))
    os.replace(tmp, path)
    log.info("latency model stored for later runs: %s", path)
    return model


# ------------------------------------------------------------------------------------------------
# checking the model against measured speed
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
        (ties -> smaller B), "n_prompts"}.
    Raises:
        ValueError: when the two sides differ in shape.
    """
    from pipeline.labeling.oracle import pick_label

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
