"""The step cost model: what one decoding step costs on this machine, by verify width (rows) and context length.

One home for the cost that labels, policies, eval and serve read:

* the label stage's replay tokens/s (``decode_ms`` / ``tokens_per_s`` of the replayed steps),
* the verify-width policy's choice of k (``verify_ms(k + 1, L)`` against ``draft_ms(B, L)``),
* the eval stage's foresight bound, and the server's recorder and verify-width policy.

A short benchmark (``measure``) times, for each width b = 1..max(widths) and each context bucket L, one target
verify (forward over b tokens with an L-token cache, with the drafter's features + LM head + sampling) and one
drafter step (forward over b tokens + LM head over b-1 rows + sampling, b >= 2), plus a prefill of L tokens.
A decode then costs

    decode_ms = sum over steps of (draft_ms(b, L) [b > 1] + verify_ms(b, L))  (+ Gumbel noise at T>0)

The curve (one fit, read by every consumer): at a context L, each width's timing is interpolated linearly over the
context buckets (linear extrapolation outside them); the widths' values are then made non-decreasing in the width by
isotonic regression (pool adjacent violators: a noisy bump is averaged with its neighbours instead of lifting every
wider point, and a step between widths stays a step, which a straight line would hide), and interpolated linearly
between widths. Verifying or drafting more rows never costs less.

One way to obtain it: ``load_or_measure(decoder, cfg, widths, section)``: a run's stored model, else a stored file
(``<section>.path``), else the model measured earlier on this machine for the same models and forward path
(``<section>.cache``, ``data/cache/latency/latency-<key>.json``), else measured now (with progress) and cached.

The batched step (many requests per verify forward, issue 25) has its cost model beside this one in
``pipeline.costs.batched`` (step time by total verified rows, drafted rows and number of requests), on the same
monotone fit and the same cache (``batch-costs-<key>.json``).

This module imports only ``pipeline.models`` and ``pipeline.decoding`` (no stage, no labeling/policy/serving code).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import torch

log = logging.getLogger(__name__)

FIT = "isotonic"  # the one curve fit; stored models of older fits ("linear", "interp") hold the same timings
CACHE_PREFIX = "latency"  # batch-1 cost models: <cache>/latency-<key>.json
DEFAULTS = {"path": None, "cache": None, "context_buckets": [64, 256, 512], "repeats": 3}
PARTS = ("verify", "draft")


# ------------------------------------------------------------------------------------------------
# the one curve fit
# ------------------------------------------------------------------------------------------------
def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through sorted ``xs`` (linear extrapolation at both ends, never below 0)."""
    if len(xs) == 1:
        return max(0.0, float(ys[0]))
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def monotone(ys: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (isotonic regression, pool adjacent violators).

    Example: [10, 11, 30, 13, 14] -> [10, 11, 19, 19, 19].
    """
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


class StepCosts(Protocol):
    """What a policy reads of a cost model (ms). A batched cost model (issue 25) adds its own arguments."""

    def step_ms(self, block_size: int, context: int, rows: int | None = None) -> float: ...

    def prefill_ms(self, tokens: int) -> float: ...


# ------------------------------------------------------------------------------------------------
# the batch-1 cost model
# ------------------------------------------------------------------------------------------------
@dataclass
class CostModel:
    """Measured step costs of one target/drafter pair on one machine and forward path (batch 1; all times in ms).

    Attributes:
        context_buckets: context lengths L (tokens) at which steps were timed, ascending.
        block_sizes: widths b timed, ascending (1 = autoregressive step, no drafter).
        verify_points: {b: [ms per bucket]} target forward over b tokens + LM head + sampling.
        draft_points: {b: [ms per bucket]} drafter forward over b tokens + LM head over b-1 rows + sampling (b >= 2).
        prefill_points: [ms per bucket] prefill of L tokens.
        noise_ms: Gumbel noise of one sampled position (T>0 only; 0 at T=0).
        info: where it was measured (host, device, dtype, torch version, threads, target, temperature, repeats).
    Serialised (``to_dict``) with the keys ``verify_ms``/``draft_ms``/``prefill_ms`` for the point tables, the format
    of the label runs' ``meta.json`` and of the cache files.
    Raises:
        ValueError: for tables whose rows do not have one value per bucket, or without a bucket.
    """

    context_buckets: list[int]
    block_sizes: list[int]
    verify_points: dict[int, list[float]]
    draft_points: dict[int, list[float]]
    prefill_points: list[float]
    noise_ms: float = 0.0
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.context_buckets:
            raise ValueError("a cost model needs at least one context bucket")
        tables = (("verify_ms", self.verify_points), ("draft_ms", self.draft_points), ("prefill_ms", {0: self.prefill_points}))
        for name, table in tables:
            if any(len(row) != len(self.context_buckets) for row in table.values()):
                raise ValueError(f"cost model {name}: need one value per context bucket {self.context_buckets}")
        self._curves: dict[tuple[str, float], tuple[list[int], list[float]]] = {}

    def curve(self, part: str, context: float) -> tuple[list[int], list[float]]:
        """(widths, ms per width) of ``part`` (verify | draft) at a context length: the fitted, non-decreasing curve.

        Raises:
            ValueError: for another ``part``.
        """
        if part not in PARTS:
            raise ValueError(f"cost part must be one of {PARTS}, got {part!r}")
        key = (part, context)
        if key not in self._curves:
            table = self.verify_points if part == "verify" else self.draft_points
            widths = sorted(table)
            values = monotone([interp(context, self.context_buckets, table[w]) for w in widths])
            if len(self._curves) > 65536:  # bounded by the contexts a run visits; cleared rather than grown forever
                self._curves.clear()
            self._curves[key] = (widths, values)
        return self._curves[key]

    def _at(self, part: str, width: int, context: float) -> float:
        widths, values = self.curve(part, context)
        return interp(width, widths, values) if widths else 0.0

    def verify_ms(self, rows: int, context: float) -> float:
        """A target verify over ``rows`` tokens (k drafts + 1) with ``context`` tokens cached (ms); non-decreasing in rows."""
        return self._at("verify", rows, context)

    def draft_ms(self, block_size: int, context: float) -> float:
        """A drafter step of block size B (B-1 drafts) at a context length (ms); non-decreasing in B."""
        return self._at("draft", block_size, context)

    def step_ms(self, block_size: int, context: float, rows: int | None = None) -> float:
        """One step: a draft of block size B (none when B = 1) and a verify of ``rows`` tokens (default B) (ms)."""
        ms = self.verify_ms(block_size if rows is None else rows, context)
        if block_size > 1 and self.draft_points:
            ms += self.draft_ms(block_size, context)
        return ms

    def decode_ms(self, block_sizes: Sequence[int], starts: Sequence[int], new_tokens: int, temperature: float) -> float:
        """Predicted decode time (ms) of a request whose steps had widths ``block_sizes`` at cache lengths ``starts``."""
        ms = sum(self.step_ms(int(b), int(s)) for b, s in zip(block_sizes, starts))
        return ms + (self.noise_ms * new_tokens if temperature > 0 else 0.0)

    def prefill_ms(self, tokens: int) -> float:
        """Predicted prefill time of a prompt of ``tokens`` tokens (ms)."""
        return interp(tokens, self.context_buckets, self.prefill_points)

    def tokens_per_s(self, prompt_tokens: int, block_sizes: Sequence[int], starts: Sequence[int], new_tokens: int,
                     temperature: float) -> float:
        """Predicted end-to-end tokens/s (new tokens over prefill + decode time) of one request."""
        seconds = (self.prefill_ms(prompt_tokens) + self.decode_ms(block_sizes, starts, new_tokens, temperature)) / 1e3
        return new_tokens / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready dict (int keys become strings; ``fit`` names the curve)."""
        return {"context_buckets": list(self.context_buckets), "block_sizes": list(self.block_sizes),
                "verify_ms": {str(k): list(v) for k, v in self.verify_points.items()},
                "draft_ms": {str(k): list(v) for k, v in self.draft_points.items()},
                "prefill_ms": list(self.prefill_points), "noise_ms": self.noise_ms, "info": dict(self.info), "fit": FIT}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostModel":
        """Inverse of ``to_dict``; also reads the dicts of older fits (the same timings, read with this module's curve).

        Raises:
            KeyError: for a dict without the model's fields.
        """
        return cls(
            context_buckets=[int(x) for x in data["context_buckets"]],
            block_sizes=[int(x) for x in data["block_sizes"]],
            verify_points={int(k): [float(x) for x in v] for k, v in data["verify_ms"].items()},
            draft_points={int(k): [float(x) for x in v] for k, v in data["draft_ms"].items()},
            prefill_points=[float(x) for x in data["prefill_ms"]],
            noise_ms=float(data.get("noise_ms", 0.0)),
            info=dict(data.get("info", {})),
        )


def steps_of(stats) -> tuple[list[int], list[int]]:
    """(block widths, cache lengths at verify) of a decoded request's steps (a ``RequestStats``)."""
    starts, start = [], stats.prompt_tokens
    for tau in stats.taus:
        starts.append(start)
        start += tau
    return list(stats.block_sizes), starts


# ------------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------------
@torch.inference_mode()
def measure(decoder, block_sizes: Sequence[int], context_buckets: Sequence[int], repeats: int = 3,
            temperature: float = 0.0, seed: int = 0) -> CostModel:
    """Time prefill, target verify and drafter steps on this machine (fastest of ``repeats`` after a warm-up).

    Times every width 1..max(``block_sizes``): clipped last blocks and the verify-width policy's verifies of
    k+1 tokens read measured points. Random token ids stand in for a prompt (step cost does not depend on token
    values). Shows a progress bar (one tick per timing).

    Args:
        decoder: a ``pipeline.decoding.speculative.SpeculativeDecoder``.
    Raises:
        ValueError: when no bucket fits the target's context, or for ``repeats`` < 1.
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from pipeline.decoding.sampling import PositionKeyedSampler
    from pipeline.decoding.speculative import _now, crop_to
    from pipeline.models.target import new_cache

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
    return CostModel(buckets, widths, verify, draft, prefill_ms, noise_ms, info)


# ------------------------------------------------------------------------------------------------
# obtaining: one way, stored or cached per machine and forward path
# ------------------------------------------------------------------------------------------------
def load(path: str | Path, setting: str = "label.latency.path") -> CostModel:
    """A cost model from a JSON file: a ``CostModel.to_dict``, a cache file, or a label run's ``meta.json``.

    Args:
        setting: the config key that named the file (for the error messages).

    Raises:
        FileNotFoundError: for a missing file; ValueError: for a file without a cost model.
    """
    from pipeline.models.loading import resolve_path

    path = Path(resolve_path(str(path)))
    if not path.is_file():
        raise FileNotFoundError(f"latency model {path} not found ({setting})")
    data = json.loads(path.read_text())
    if "context_buckets" not in data:
        data = data.get("latency_model")
    if not data:
        raise ValueError(f"{path} holds no latency model; point {setting} at a replay run's meta.json")
    return CostModel.from_dict(data)


def identity(model_cfg: Mapping) -> dict:
    """What a cached cost model must match besides the machine and forward path: target, drafter, dtype, device."""
    return {k: str(model_cfg.get(k)) for k in ("target", "drafter", "dtype", "device")}


def cache_key(decoder, model_identity: Mapping, block_sizes: Sequence[int], context_buckets: Sequence[int],
              repeats: int, temperature: float, seed: int) -> dict:
    """The key of a cached cost model: the models (``identity``), this host, torch's thread count, the decoder's
    resolved forward path (``backend`` with its kernel's version, lean forwards, ``kv_cache``) and the arguments."""
    return {"identity": dict(model_identity), "host": platform.node(), "threads": torch.get_num_threads(),
            "forward": decoder.forward_path(),
            "block_sizes": sorted({int(b) for b in block_sizes}), "context_buckets": sorted(int(c) for c in context_buckets),
            "repeats": int(repeats), "temperature": float(temperature), "seed": int(seed)}


def _cached(cache_dir: str | Path, prefix: str, key: dict, field_name: str, measure_fn: Callable[[], dict]) -> dict:
    """The dict stored under ``cache_dir/<prefix>-<hash of key>.json`` (field ``field_name``), else ``measure_fn()``
    stored there atomically. A file whose stored key differs from ``key`` (a hash collision or a hand-edited file) is
    measured afresh and replaced, never read."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{prefix}-{digest}.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError:
            stored = {}
        if stored.get("key") == json.loads(json.dumps(key, default=str)) and stored.get(field_name):
            log.info("reusing the latency model measured earlier on this machine: %s (delete it to remeasure)", path)
            return stored[field_name]
        log.warning("%s does not hold a model for this machine and forward path; measuring afresh", path)
    data = measure_fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, field_name: data}, indent=2, default=str))
    os.replace(tmp, path)
    log.info("latency model stored for later runs: %s", path)
    return data


def _select(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part)
    return node


def load_or_measure(decoder, cfg, widths: Sequence[int], section: str = "label.latency", stored: Mapping | None = None,
                    path: str | Path | None = None, path_setting: str | None = None) -> CostModel:
    """This machine's cost model for ``cfg``'s target and drafter: the one way every stage and the server obtain it.

    In order:
      1. ``stored``: the model a run already holds (a label or record run's ``meta.json`` ``latency_model``), so a
         resumed or sharded run keeps its costs (a warning when it was stored with another curve fit);
      2. ``path`` (named ``path_setting`` in errors), else ``<section>.path``: a stored model, cache file or label
         run's ``meta.json``;
      3. ``<section>.cache``: the model measured earlier on this host for the same models (``cfg.model``), threads,
         forward path (``decoder.forward_path()``) and arguments (``cache_key``);
      4. measured now for every width 1..max(``widths``) (``measure``, with progress), then stored in the cache.

    Args:
        decoder: the ``SpeculativeDecoder`` to time (may be None when 1. or 2. applies).
        cfg: a composed config with ``model``, ``decode.temperature``, ``seed`` and the latency block at ``section``
            (``{path, cache, context_buckets, repeats}``: ``label.latency``, ``policy.verify_width.latency``
            (eval and serve); missing keys take ``DEFAULTS``, a missing cache measures every time).
        widths: the block sizes (and verify widths) the caller will read; the measured widths are 1..max.
    Raises:
        FileNotFoundError / ValueError: as ``load``; ValueError: when it must measure without a decoder, or as ``measure``.
    """
    if stored:
        if stored.get("fit", FIT) != FIT:
            log.warning("this run's latency model was stored with the %r fit; costs from now on read the %r curve "
                        "(start a fresh run directory for figures of one fit)", stored.get("fit"), FIT)
        return CostModel.from_dict(stored)
    settings = {**DEFAULTS, **{k: v for k, v in (_select(cfg, section) or {}).items() if v is not None}}
    if path:
        return load(path, path_setting or "path")
    if settings["path"]:
        return load(settings["path"], f"{section}.path")
    if decoder is None:
        raise ValueError(f"measuring the latency model needs the models loaded; or set {section}.path to a stored one")
    buckets, repeats = [int(c) for c in settings["context_buckets"]], int(settings["repeats"])
    temperature, seed = float(_select(cfg, "decode.temperature") or 0.0), int(_select(cfg, "seed") or 0)
    widths = sorted({int(b) for b in widths})
    log.info("latency model: %s (%s.context_buckets=%s, widths 1..%d)",
             "measuring" if not settings["cache"] else "reusing or measuring", section, buckets, max([2, *widths]))

    def measure_now() -> dict:
        return measure(decoder, widths, buckets, repeats, temperature, seed).to_dict()

    if not settings["cache"]:
        return CostModel.from_dict(measure_now())
    key = cache_key(decoder, identity(_select(cfg, "model") or {}), widths, buckets, repeats, temperature, seed)
    return CostModel.from_dict(_cached(settings["cache"], CACHE_PREFIX, key, "latency_model", measure_now))
