"""The batch-1 step cost model: what one decoding step costs on this machine, by verify width (rows) and context.

One home for the cost that labels, policies, eval and serve read:

* the label stage's replay tokens/s (``decode_ms`` / ``tokens_per_s`` of the replayed steps),
* the verify-width policy's choice of k (``verify_ms(k + 1, L)`` against ``draft_ms(B, L)``),
* the eval stage's foresight bound, and the server's recorder and verify-width policy.

The tables hold, for each width b = 1..max and each context bucket L, one target verify (forward over b tokens with an
L-token cache, with the drafter's features + LM head + sampling), one drafter step (forward over b tokens + LM head over
b-1 rows + sampling, b >= 2) and a prefill of L tokens, timed by ``pipeline.timing`` (interleaved rounds, the least
sample, a shape check; the spread of each point kept beside it). A decode then costs

    decode_ms = sum over steps of (draft_ms(b, L) [b > 1] + verify_ms(b, L))  (+ Gumbel noise at T>0)

The curve (one fit, read by every consumer): at a context L, each width's timing is interpolated linearly over the
context buckets (linear extrapolation outside them); the widths' values are then made non-decreasing in the width by
isotonic regression (``pipeline.costs.curves.monotone``) and interpolated linearly between widths. Verifying or
drafting more rows never costs less.

Pure: imports nothing of the project above ``pipeline.costs`` (no torch either), so a process that is not ours (the
vLLM plugin) can read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from pipeline.costs.curves import interp, monotone

FIT = "isotonic"  # the one curve fit; stored models of older fits ("linear", "interp") hold the same timings
CACHE_PREFIX = "latency"  # batch-1 cost models: <cache>/latency-<key>.json
PARTS = ("verify", "draft")


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
        info: where it was measured (host, device, dtype, torch version, threads, target, temperature, rounds) and
            its shape check (``check``: the points timed again, those still suspect).
        spread: the measurement's spread per point, (median - least) / least of its samples, in the tables' layout:
            {"verify": {b: [...]}, "draft": {b: [...]}, "prefill": [...]} (empty for models stored before it existed).
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
    spread: dict = field(default_factory=dict)

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

    def request_ms(self, stats) -> float:
        """The modelled decode time (ms) of a decoded request (a ``RequestStats``): each step's draft of its B and its
        verify of the rows it verified (k + 1), at the step's context (T=0: no sampling noise). The run-time check
        (``pipeline.costs.monitor``) holds it against the request's measured ``decode_ms``."""
        start, ms = int(stats.prompt_tokens), 0.0
        widths = list(stats.verify_widths) or [b - 1 for b in stats.block_sizes]
        for b, k, tau in zip(stats.block_sizes, widths, stats.taus):
            ms += self.step_ms(int(b), start, int(k) + 1)
            start += int(tau)
        return ms

    def update(self, other: "CostModel") -> None:
        """Take ``other``'s tables in place (every schedule holding this model reads the new costs from now on)."""
        for name in ("context_buckets", "block_sizes", "verify_points", "draft_points", "prefill_points", "noise_ms",
                     "info", "spread"):
            setattr(self, name, getattr(other, name))
        self._curves.clear()

    def to_dict(self) -> dict:
        """JSON-ready dict (int keys become strings; ``fit`` names the curve)."""
        spread = {part: ({str(k): list(v) for k, v in table.items()} if isinstance(table, dict) else list(table))
                  for part, table in self.spread.items()}
        return {"context_buckets": list(self.context_buckets), "block_sizes": list(self.block_sizes),
                "verify_ms": {str(k): list(v) for k, v in self.verify_points.items()},
                "draft_ms": {str(k): list(v) for k, v in self.draft_points.items()},
                "prefill_ms": list(self.prefill_points), "noise_ms": self.noise_ms, "info": dict(self.info), "fit": FIT,
                "spread": spread}

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
            spread={part: ({int(k): list(v) for k, v in table.items()} if isinstance(table, dict) else list(table))
                    for part, table in (data.get("spread") or {}).items()},
        )


def steps_of(stats) -> tuple[list[int], list[int]]:
    """(block widths, cache lengths at verify) of a decoded request's steps (a ``RequestStats``)."""
    starts, start = [], stats.prompt_tokens
    for tau in stats.taus:
        starts.append(start)
        start += tau
    return list(stats.block_sizes), starts


# ------------------------------------------------------------------------------------------------
# reading a stored model
# ------------------------------------------------------------------------------------------------
def load(path: str | Path, setting: str = "label.latency.path") -> CostModel:
    """A cost model from a JSON file: a ``CostModel.to_dict``, a cache file, or a label run's ``meta.json``.

    Args:
        setting: the config key that named the file (for the error messages).

    Raises:
        FileNotFoundError: for a missing file; ValueError: for a file without a cost model.
    """
    from pipeline import PROJECT_ROOT

    path = Path(path)
    if not path.is_absolute() and (PROJECT_ROOT / path).exists():  # config paths are relative to the project root
        path = PROJECT_ROOT / path
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


