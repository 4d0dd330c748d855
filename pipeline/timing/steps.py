"""The batch-1 step costs of the loaded models on this machine: measured, checked, cached, re-measured.

``measure`` times, for each width b = 1..max(widths) and each context bucket L, one target verify (forward over b
tokens with an L-token cache, with the drafter's features + LM head + sampling), one drafter step (forward over b
tokens + LM head over b-1 rows + sampling, b >= 2) and a prefill of L tokens, all as points of one interleaved
measurement (``pipeline.costs.timer.time_points``). Points that break a step cost's shape (a wider step cheaper than a
narrower one, a longer context cheaper than a shorter one, by more than ``pipeline.costs.curves.TOLERANCE``) are timed
again after a pause (``retime``); the model keeps each point's least sample and its spread.

``load_or_measure`` is the one way every stage and the server obtain the model; a cached model is first held against
this machine now (``spot_check``: a few points re-timed; a cache that reads slower than the machine is was measured
under load, and is refused). ``remeasure`` measures afresh and replaces the cache (the run-time ``DriftMonitor``'s
verdict, ``pipeline.costs.monitor``).
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from pipeline.costs import CACHE_PREFIX, FIT, CostModel, identity, load, suspect_points
from pipeline.costs import store
from pipeline.models.cache import crop_to
from pipeline.timing.fixture import (SPOT_FLOOR_MS, SPOT_TOLERANCE, WARM, draft_cache_at, first_loaded,
                                     measure_points, prefill, random_ids, time_now)

log = logging.getLogger(__name__)

DEFAULTS = {"path": None, "cache": None, "context_buckets": [64, 256, 512], "repeats": 5, "spot_check": True}


class StepPoints:
    """The timed points of one decoder's steps: ``("verify", b, L)``, ``("draft", b, L)``, ``("prefill", 0, L)``.

    Random token ids stand in for a prompt (a step's cost does not depend on the token values); each bucket's target
    cache and features are prefilled once, and every point rolls back what it adds.

    Raises:
        ValueError: when no bucket fits the target's context.
    """

    def __init__(self, decoder, widths: Sequence[int], context_buckets: Sequence[int], temperature: float = 0.0,
                 seed: int = 0):
        from pipeline.decoding.sampling import PositionKeyedSampler

        self.decoder = decoder
        self.widths = [1] if decoder.drafter is None else sorted({int(b) for b in widths})
        for b in self.widths:
            decoder.check_block_size(b)
        widest = max(self.widths)
        self.buckets = sorted({int(c) for c in context_buckets if 1 <= int(c) and int(c) + widest <= decoder.max_context})
        if not self.buckets:
            raise ValueError(f"no context bucket of {list(context_buckets)} fits the target's {decoder.max_context} "
                             "positions; set label.latency.context_buckets to smaller lengths")
        self.vocab = decoder.lm_head.shape[0]
        self.ids = random_ids(decoder, max(self.buckets) + widest, torch.Generator().manual_seed(seed))
        self.sampler = PositionKeyedSampler(temperature, seed, self.vocab)
        if temperature > 0:  # noise is timed separately (noise_ms), not inside the steps
            for p in range(max(self.buckets) + widest + 1):
                self.sampler.gumbel(p)
        self._states: dict[int, tuple] = {}
        self._draft_caches: dict[tuple[int, int], object] = {}

    def _state(self, length: int) -> tuple:
        """(target cache, features) after a prefill of ``length`` tokens, made once."""
        if length not in self._states:
            cache, _, features = prefill(self.decoder, self.ids[:, :length])
            self._states[length] = (cache, features)
        return self._states[length]

    def point(self, part: str, b: int, length: int) -> Callable[[], None]:
        """The callable of one point (see the class doc)."""
        dec, ids, sampler = self.decoder, self.ids, self.sampler
        device = dec.device
        if part == "prefill":
            def prefill_point() -> None:
                _, logits, _ = prefill(dec, ids[:, :length])
                sampler.pick(logits, length)

            return prefill_point
        cache, features = self._state(length)
        block = ids[:, length: length + b]
        if part == "verify":
            def verify() -> None:
                logits, _ = dec.target_forward(block, cache, length, want_features=dec.drafter is not None)
                sampler.pick(logits, length + 1)
                crop_to(cache, length)

            return verify

        new = min(b, length)  # context features not yet in the drafter's cache: about one step's tokens
        if (b, length) not in self._draft_caches:
            self._draft_caches[(b, length)] = draft_cache_at(dec, block, features, length, new)
        draft_cache = self._draft_caches[(b, length)]
        positions = torch.arange(length - new, length + b, device=device)[None]

        def draft() -> None:
            hidden = dec.draft_forward(dec.embed(block), features[:, length - new: length], positions, draft_cache)
            crop_to(draft_cache, length - new)
            sampler.pick(dec.drafter_head(hidden[0, 1:]).float(), length + 1, dec.draft_vocab)

        return draft

    def points(self, names=None) -> dict[tuple[str, int, int], Callable[[], None]]:
        """Every point (or those of ``names``), named ``(part, b, L)``."""
        if names is None:
            names = [("prefill", 0, L) for L in self.buckets]
            names += [(part, b, L) for L in self.buckets for b in self.widths for part in ("verify", "draft")
                      if part == "verify" or b > 1]
        return {name: self.point(*name) for name in names}


def _tables(timings: Mapping, buckets: Sequence[int]) -> dict[str, dict[int, list]]:
    """{"verify" | "draft" | "prefill": {b: [Timing per bucket]}} (prefill under b = 0)."""
    out: dict[str, dict[int, list]] = {"verify": {}, "draft": {}, "prefill": {}}
    for (part, b, length), timing in timings.items():
        out[part].setdefault(b, [None] * len(buckets))[list(buckets).index(length)] = timing
    return out


def _suspects(timings: Mapping, buckets) -> set:
    names = set()
    for part, table in _tables(timings, buckets).items():
        ms = {b: [t.ms for t in row] for b, row in table.items()}
        names |= {(part, b, buckets[j]) for b, j in suspect_points(ms)}
    return names


@torch.inference_mode()
def measure(decoder, block_sizes: Sequence[int], context_buckets: Sequence[int], repeats: int = 5,
            temperature: float = 0.0, seed: int = 0) -> CostModel:
    """Time prefill, target verify and drafter steps on this machine (see the module doc); shows a progress bar.

    Times every width 1..max(``block_sizes``), so clipped last blocks and verify-width policies' verifies of k+1 rows
    read measured points. ``repeats``: the rounds every point is timed in (after one warm-up round).

    Raises:
        ValueError: when no bucket fits the target's context, or for ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"latency repeats must be >= 1, got {repeats}")
    widths = list(range(1, max([2, *[int(b) for b in block_sizes]]) + 1))
    bench = StepPoints(decoder, widths, context_buckets, temperature, seed)
    timings, check = measure_points(decoder, bench.points(), lambda t: _suspects(t, bench.buckets), repeats,
                                    "step costs of this machine")
    noise_ms = 0.0
    if temperature > 0:
        from pipeline.decoding.sampling import PositionKeyedSampler

        fresh = PositionKeyedSampler(temperature, seed + 1, bench.vocab)
        next_position = iter(range(1 << 30))
        noise = time_now(decoder, {"noise": lambda: [fresh.gumbel(next(next_position)) for _ in range(8)]}, repeats)
        noise_ms = noise["noise"].ms / 8
    tables = _tables(timings, bench.buckets)
    ms = {part: {b: [t.ms for t in row] for b, row in table.items()} for part, table in tables.items()}
    spread = {part: {b: [round(t.spread, 4) for t in row] for b, row in table.items()} for part, table in tables.items()}
    spread["prefill"] = spread["prefill"].get(0, [])
    model = decoder.model
    info = {"host": platform.node(), "device": str(decoder.device), "dtype": str(model.dtype).removeprefix("torch."),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "target": decoder.target.name,
            "temperature": temperature, "rounds": repeats, "check": check,
            "max_spread": max([s for row in tables["verify"].values() for s in (t.spread for t in row)], default=0.0)}
    return CostModel(bench.buckets, bench.widths, ms["verify"], ms["draft"], ms["prefill"].get(0, []), noise_ms, info,
                     spread)


@torch.inference_mode()
def spot_check(decoder, model: CostModel, rounds: int = 3, tolerance: float = SPOT_TOLERANCE,
               floor_ms: float = SPOT_FLOOR_MS) -> str | None:
    """Re-time a few of a stored model's points on this machine now: one row and the widest verify at every bucket,
    and the widest draft at the middle bucket. Returns why the model must be measured again (a point stored more than
    ``tolerance`` times, and ``floor_ms``, slower than it runs now: it was measured under load), or None."""
    widths = [w for w in (1, max(model.block_sizes)) if w in model.verify_points]
    try:
        bench = StepPoints(decoder, widths, model.context_buckets)
    except ValueError as err:
        return str(err)
    names = [("verify", b, L) for L in bench.buckets for b in bench.widths]
    widest, middle = max(bench.widths), bench.buckets[len(bench.buckets) // 2]
    if widest > 1 and widest in model.draft_points:
        names.append(("draft", widest, middle))
    stored = {(part, b, length): (model.verify_points if part == "verify" else model.draft_points)[b][
        model.context_buckets.index(length)] for part, b, length in names}
    loaded = first_loaded(decoder, bench.points(names), stored, rounds, tolerance, floor_ms)
    if loaded is None:
        return None
    (part, b, length), then, now = loaded
    return (f"its {part} of {b} rows at context {length} reads {then:.1f} ms, this machine takes {now:.1f} ms now (it "
            "was measured while other work shared the cores)")


# ------------------------------------------------------------------------------------------------
# obtaining: one way, stored or cached per machine and forward path
# ------------------------------------------------------------------------------------------------
def cache_key(decoder, model_identity: Mapping, block_sizes: Sequence[int], context_buckets: Sequence[int],
              repeats: int, temperature: float, seed: int) -> dict:
    """The key of a cached cost model (``pipeline.costs.store.key``, which adds this host): the models (``identity``),
    the decoder's resolved forward path (``backend`` with its kernel's version, lean forwards, ``kv_cache``), the
    arguments and how points are timed (``WARM``)."""
    return store.key(CACHE_PREFIX, identity=dict(model_identity), forward=decoder.forward_path(),
                     block_sizes=sorted({int(b) for b in block_sizes}),
                     context_buckets=sorted(int(c) for c in context_buckets), repeats=int(repeats),
                     temperature=float(temperature), seed=int(seed), warm=WARM)


def _select(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part)
    return node


def _settings(cfg, section: str, widths: Sequence[int]) -> dict:
    settings = {**DEFAULTS, **{k: v for k, v in (_select(cfg, section) or {}).items() if v is not None}}
    settings["context_buckets"] = [int(c) for c in settings["context_buckets"]]
    settings["repeats"] = int(settings["repeats"])
    settings["temperature"] = float(_select(cfg, "decode.temperature") or 0.0)
    settings["seed"] = int(_select(cfg, "seed") or 0)
    settings["widths"] = list(range(1, max([2, *[int(b) for b in widths]]) + 1))  # the widths ``measure`` times
    return settings


def _key(decoder, cfg, s: dict) -> dict:
    return cache_key(decoder, identity(_select(cfg, "model") or {}), s["widths"], s["context_buckets"], s["repeats"],
                     s["temperature"], s["seed"])


def _measure_with(decoder, s: dict) -> CostModel:
    return measure(decoder, s["widths"], s["context_buckets"], s["repeats"], s["temperature"], s["seed"])


def load_or_measure(decoder, cfg, widths: Sequence[int], section: str = "label.latency", stored: Mapping | None = None,
                    path: str | Path | None = None, path_setting: str | None = None) -> CostModel:
    """This machine's cost model for ``cfg``'s target and drafter: the one way every stage and the server obtain it.

    In order:
      1. ``stored``: the model a run already holds (a label or record run's ``meta.json`` ``latency_model``), so a
         resumed or sharded run keeps its costs (a warning when it was stored with another curve fit);
      2. ``path`` (named ``path_setting`` in errors), else ``<section>.path``: a stored model, cache file or label
         run's ``meta.json``;
      3. ``<section>.cache``: the model measured earlier on this host for the same models (``cfg.model``), threads,
         forward path (``decoder.forward_path()``) and arguments (``cache_key``), when ``spot_check`` passes
         (``<section>.spot_check: false`` reuses it unchecked);
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
    s = _settings(cfg, section, widths)
    if path:
        return load(path, path_setting or "path")
    if s["path"]:
        return load(s["path"], f"{section}.path")
    if decoder is None:
        raise ValueError(f"measuring the latency model needs the models loaded; or set {section}.path to a stored one")
    log.info("step costs: %s (%s.context_buckets=%s, widths 1..%d)", "reusing or measuring" if s["cache"] else
             "measuring", section, s["context_buckets"], max(s["widths"]))
    if not s["cache"]:
        return _measure_with(decoder, s)
    key = _key(decoder, cfg, s)
    check = (lambda d: spot_check(decoder, CostModel.from_dict(d))) if s["spot_check"] else None
    data = store.cached(s["cache"], key, "latency_model", lambda: _measure_with(decoder, s).to_dict(),
                        check=check)
    return CostModel.from_dict(data)


def remeasure(decoder, cfg, widths: Sequence[int], section: str, into: CostModel | None = None) -> CostModel:
    """Measure afresh (``measure``) and replace the cached model of ``<section>.cache`` (when set); with ``into``,
    update that model in place (every schedule holding it reads the new costs). Returns the new model."""
    s = _settings(cfg, section, widths)
    fresh = _measure_with(decoder, s)
    if s["cache"]:
        path = store.put(s["cache"], _key(decoder, cfg, s), "latency_model", fresh.to_dict())
        log.info("step costs: measured again and stored in %s", path)
    if into is not None:
        into.update(fresh)
        return into
    return fresh


@torch.inference_mode()
def step_figures(decoder, length: int, widths, block_sizes, pending: int, repeats: int, warmup: int,
                 seed: int = 0) -> dict:
    """``python -m pipeline.bench_step``'s figures at one context length L (tokens): ``ar_ms``, ``forward_ms[q]``,
    ``drafter_ms[B]``, ``step_ms[B]`` (the least of ``repeats`` interleaved rounds after ``warmup`` rounds) and
    ``step_over_ar[B]``.

    Raises:
        ValueError: when L + the widest block does not fit the target's context, or without a drafter.
    """

    from pipeline.decoding.requests import DecodeState
    from pipeline.decoding.sampling import PositionKeyedSampler
    from pipeline.decoding.step import chain_step, draft

    if decoder.drafter is None:
        raise ValueError("bench_step needs a drafter (model.drafter=...)")
    widest = max([*widths, *block_sizes])
    if length + widest > decoder.max_context or length < pending + 1:
        raise ValueError(f"context {length} (+ {widest}) does not fit the target's {decoder.max_context} positions")
    for b in block_sizes:
        decoder.check_block_size(b)
    ids = random_ids(decoder, length + widest, torch.Generator().manual_seed(seed))
    sampler = PositionKeyedSampler(0.0, seed, decoder.lm_head.shape[0])
    cache, _, features = prefill(decoder, ids[:, :length])
    draft_cache = draft_cache_at(decoder, ids[:, :1], features, length, pending)
    state = DecodeState(cache, draft_cache, features[:, length - pending:], int(ids[0, length]), length)

    def reset() -> None:
        crop_to(cache, length)
        crop_to(draft_cache, length - pending)
        state.features, state.feature_parts = features[:, length - pending:], []
        state.pending, state.start = int(ids[0, length]), length

    ar_state = DecodeState(cache, None, None, int(ids[0, length]), length)

    def ar() -> None:
        chain_step(decoder, ar_state, sampler, 1)

    def ar_reset() -> None:
        crop_to(cache, length)
        ar_state.pending, ar_state.start = int(ids[0, length]), length

    for _ in range(max(1, warmup) * 10):  # settle the backend's packed weights and thread pool first
        ar()
        ar_reset()

    def undone(fn, undo):
        return lambda: (fn(), undo())

    points = {("ar",): undone(ar, ar_reset)}
    for q in widths:
        block = ids[:, length : length + q]

        def forward(block=block) -> None:
            logits, _ = decoder.target_forward(block, cache, length, want_features=True)
            sampler.pick(logits, length + 1)

        points[("forward", q)] = undone(forward, reset)
    for b in block_sizes:

        def drafter(b=b) -> None:
            sampler.pick_columns(draft(decoder.forward, [state], [b])[0], state.start + 1, decoder.draft_vocab)

        points[("drafter", b)] = undone(drafter, reset)
        points[("step", b)] = undone(lambda b=b: chain_step(decoder, state, sampler, b), reset)
    ms = {k: t.ms for k, t in time_now(decoder, points, repeats, warmup).items()}
    out = {"ar_ms": ms[("ar",)], "forward_ms": {str(q): ms[("forward", q)] for q in widths},
           "drafter_ms": {str(b): ms[("drafter", b)] for b in block_sizes},
           "step_ms": {str(b): ms[("step", b)] for b in block_sizes}}
    out["step_over_ar"] = {b: v / out["ar_ms"] for b, v in out["step_ms"].items()}
    return out
