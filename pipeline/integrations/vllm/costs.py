"""The cost of vLLM's own decode step on this machine, learned from the engine's real steps and cached per machine.

vLLM's step (``GPUModelRunner.execute_model`` then ``sample_tokens``, timed in the worker) costs, in ms,

    step_ms(T, n, drafted) = verify(T) + overhead(n) + (draft(n) if drafted else idle(n))

* ``verify(T)``: the target forward over the step's T scheduled tokens (each request's last token and its verified
  drafts), its sampling and rejection, and the runner's bookkeeping: the step without the drafter;
* ``draft(n)``: the DFlash drafter forward that drafts K tokens for each of the n requests (``propose_draft_token_ids``);
* ``idle(n)``: the drafter's run when the step drafts nothing (K = 0: vLLM still feeds the step's context to the
  drafter's cache);
* ``overhead(n)``: the engine's time between two steps of a busy engine (scheduling, the drafts' and outputs' trip
  between processes).

Every decode-only step (no prefill in it) adds one sample to each of its buckets; a bucket keeps its last ``keep``
samples and reads as their median (robust to the other processes on a shared machine). A table's curve is the
buckets' medians made non-decreasing in the bucket (``pipeline.costs.monotone``, isotonic regression) and read
between buckets by linear interpolation (``pipeline.costs.interp``): more rows or requests never cost less.

``StepCosts.stored`` / ``store`` keep the learned tables in the one per-machine cache (``pipeline.costs.store``, the
folder of every measured cost, ``data/cache/costs``) as ``step-costs-<key>.json`` (``cache_key``: the host, its CPUs,
torch's threads, vLLM's version and the served models), so a restarted server starts from this machine's curve.

Imports: the standard library and ``pipeline.costs`` (no numpy or torch).
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path
from typing import Iterable

from pipeline.costs import interp, monotone, store

TABLES = ("verify", "draft", "idle", "overhead")
KEEP = 32  # samples kept per bucket
NEAR = 0.2  # a bucket within this fraction of another supports the curve there (``StepCosts.known``)
CACHE_PREFIX = "step-costs"  # the cache files' kind: <cache>/step-costs-<key>.json
FIELD = "step_costs"  # the tables' field in a cache file


class StepCosts:
    """Learned step costs of one vLLM server (see the module docstring).

    Args:
        keep: the samples kept per bucket (the most recent ones).
        info: where it was learned (written with the tables).
    Raises:
        ValueError: for keep < 1.
    """

    def __init__(self, keep: int = KEEP, info: dict | None = None):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = int(keep)
        self.info = dict(info or {})
        self.tables: dict[str, dict[int, collections.deque]] = {name: {} for name in TABLES}
        self._curves: dict[str, tuple[list[int], list[float]]] = {}
        self.added = 0  # samples added since the last save

    def add(self, table: str, bucket: int, ms: float) -> None:
        """One sample (ms) of ``table`` at ``bucket`` (T tokens for ``verify``, n requests for the others).

        Raises:
            ValueError: for an unknown table.
        """
        if table not in self.tables:
            raise ValueError(f"step-cost table must be one of {TABLES}, got {table!r}")
        samples = self.tables[table].setdefault(int(bucket), collections.deque(maxlen=self.keep))
        samples.append(float(ms))
        self._curves.pop(table, None)
        self.added += 1

    def count(self, table: str, bucket: int) -> int:
        """Samples held for ``table`` at ``bucket``."""
        return len(self.tables[table].get(int(bucket), ()))

    def curve(self, table: str) -> tuple[list[int], list[float]]:
        """(buckets ascending, the fitted non-decreasing ms) of ``table``; empty lists before any sample."""
        if table not in self._curves:
            buckets = sorted(b for b, s in self.tables[table].items() if s)
            medians = [statistics.median(self.tables[table][b]) for b in buckets]
            self._curves[table] = (buckets, monotone(medians))
        return self._curves[table]

    def at(self, table: str, bucket: float) -> float:
        """The fitted cost of ``table`` at ``bucket`` (ms; 0 before any sample)."""
        xs, ys = self.curve(table)
        return interp(bucket, xs, ys) if xs else 0.0

    def step_ms(self, tokens: int, requests: int, drafted: bool) -> float:
        """One step of ``requests`` requests over ``tokens`` scheduled tokens, with (``drafted``) or without drafts for
        the next step (ms)."""
        return (self.at("verify", tokens) + self.at("overhead", requests)
                + self.at("draft" if drafted else "idle", requests))

    def known(self, table: str, bucket: float, enough: int, tolerance: float = NEAR) -> bool:
        """Whether ``table`` holds a bucket with at least ``enough`` samples within ``tolerance`` (relative) of
        ``bucket``: the curve is read there from measured steps, not extrapolated."""
        return any(len(s) >= enough and abs(b - bucket) <= tolerance * bucket for b, s in self.tables[table].items())

    def missing(self, requests: int, widths: Iterable[int], enough: int) -> dict[str, list[int]]:
        """What a step of ``requests`` requests would read without measured support (``known``):
        ``{"verify": [k ...], "draft": [...], "idle": [...]}`` (verify lists the uniform widths k whose step of
        requests * (1 + k) tokens has none; the others list ``requests`` when it has none)."""
        n = int(requests)
        return {"verify": [k for k in widths if not self.known("verify", n * (1 + k), enough)],
                "draft": [] if self.known("draft", n, enough) else [n],
                "idle": [] if self.known("idle", n, enough) else [n]}

    # ------------------------------------------------------------------------------------------------
    # the cache
    # ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"kind": "vllm_step_costs", "keep": self.keep, "info": self.info,
                "tables": {name: {str(b): list(s) for b, s in sorted(t.items())} for name, t in self.tables.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "StepCosts":
        """Inverse of ``to_dict``.

        Raises:
            ValueError: for a dict of another kind.
        """
        if data.get("kind") != "vllm_step_costs":
            raise ValueError("not a vLLM step-cost table (kind vllm_step_costs); delete the file to learn it again")
        out = cls(int(data.get("keep", KEEP)), data.get("info"))
        for name, table in data.get("tables", {}).items():
            for bucket, samples in table.items():
                for ms in samples:
                    out.add(name, int(bucket), float(ms))
        out.added = 0
        return out

    def store(self, cache_dir: str | Path, key: dict) -> Path:
        """Write the tables to the one per-machine cache (``pipeline.costs.store.put``, atomic) under ``key``
        (``cache_key``); returns the file."""
        path = store.put(cache_dir, key, FIELD, self.to_dict())
        self.added = 0
        return path

    @classmethod
    def stored(cls, cache_dir: str | Path, key: dict) -> "StepCosts":
        """The tables cached under ``key`` (``cache_key``) in ``cache_dir``, or empty ones (with the key as their
        ``info``) when there are none or they cannot be read."""
        data = store.get(cache_dir, key, FIELD)
        try:
            return cls.from_dict(data) if data is not None else cls(info=key)
        except ValueError:
            return cls(info=key)

    @classmethod
    def load(cls, path: str | Path) -> "StepCosts":
        """The tables of one cache file (as ``store`` wrote it; an inspection's reader).

        Raises:
            OSError / ValueError: for a missing or unreadable file.
        """
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get(FIELD, data))


def cache_key(**fields) -> dict:
    """What a step-cost table depends on (``pipeline.costs.store.key``, which adds this host: its name, CPUs, torch's
    threads): the given fields (vLLM's version, the models, dtype, K, eager...), as strings."""
    return store.key(CACHE_PREFIX, **{k: (str(v) if v is not None else None) for k, v in sorted(fields.items())})
