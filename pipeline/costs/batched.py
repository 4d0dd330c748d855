"""The cost of one batched decode step (``BatchCostModel``): by total verified rows, drafted rows and requests.

Measured once per machine, models and forward path by ``pipeline.timing.batched`` (interleaved rounds, the least
sample, the shape check) and cached in the one per-machine cache (``pipeline.costs.store``). Pure: standard library
only, like the rest of ``pipeline.costs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.costs.curves import interp


@dataclass
class BatchCostModel:
    """The cost of one batched step (ms), by total verified rows, drafted rows and requests.

    ``step_ms(R, D, N, N_d) = verify(R) + verify_per_request_ms * (N - 1)
                              + [D > 0] * (draft(D) + draft_per_request_ms * (N_d - 1))``

    with ``verify`` / ``draft`` interpolated from the measured tables (rows -> ms: the forward, its LM head and
    sampling, as one request, or rows split over several when more than one request's worth) and the per-request
    terms the attention, masks and bookkeeping each extra request adds. Measured per machine and forward path by
    ``pipeline.timing.batched.batch_costs_of``.

    Attributes:
        verify_rows, verify_ms: the target-forward table; draft_rows, draft_ms: the drafter-forward table (rows
        ascending); verify_per_request_ms, draft_per_request_ms: ms per extra request; context: the context length
        it was measured at (tokens); info: how it was measured (and its shape check); spread: (median - least) /
        least of each table point's samples ({"verify": [...], "draft": [...]}).
    Raises:
        ValueError: for empty or unsorted tables.
    """

    verify_rows: list[int]
    verify_ms: list[float]
    draft_rows: list[int]
    draft_ms: list[float]
    verify_per_request_ms: float = 0.0
    draft_per_request_ms: float = 0.0
    context: int = 128
    info: dict = field(default_factory=dict)
    spread: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, xs, ys in (("verify", self.verify_rows, self.verify_ms), ("draft", self.draft_rows, self.draft_ms)):
            if not xs or len(xs) != len(ys) or list(xs) != sorted(set(xs)):
                raise ValueError(f"BatchCostModel: the {name} table needs ascending distinct rows with one ms each, "
                                 f"got {xs} / {ys}")

    def verify(self, rows: int) -> float:
        """One target forward over ``rows`` rows (ms)."""
        return max(1e-6, interp(rows, self.verify_rows, self.verify_ms))

    def draft(self, rows: int) -> float:
        """One drafter forward over ``rows`` block rows (ms); 0 for none."""
        return 0.0 if rows <= 0 else max(0.0, interp(rows, self.draft_rows, self.draft_ms))

    def step_ms(self, verified_rows: int, drafted_rows: int, requests: int, drafting: int = 0) -> float:
        """One batched step: a target forward over ``verified_rows`` rows of ``requests`` requests, after a drafter
        forward over ``drafted_rows`` block rows of ``drafting`` requests (ms)."""
        ms = self.verify(verified_rows) + self.verify_per_request_ms * max(0, requests - 1)
        if drafted_rows > 0:
            ms += self.draft(drafted_rows) + self.draft_per_request_ms * max(0, drafting - 1)
        return ms

    def update(self, other: "BatchCostModel") -> None:
        """Take ``other``'s tables in place (the policy holding this model reads the new costs from now on)."""
        for name in ("verify_rows", "verify_ms", "draft_rows", "draft_ms", "verify_per_request_ms",
                     "draft_per_request_ms", "context", "info", "spread"):
            setattr(self, name, getattr(other, name))

    def to_dict(self) -> dict:
        return {"verify_rows": list(self.verify_rows), "verify_ms": list(self.verify_ms),
                "draft_rows": list(self.draft_rows), "draft_ms": list(self.draft_ms),
                "verify_per_request_ms": self.verify_per_request_ms, "draft_per_request_ms": self.draft_per_request_ms,
                "context": self.context, "info": self.info, "spread": self.spread}

    @classmethod
    def from_dict(cls, data: dict) -> "BatchCostModel":
        return cls([int(r) for r in data["verify_rows"]], [float(v) for v in data["verify_ms"]],
                   [int(r) for r in data["draft_rows"]], [float(v) for v in data["draft_ms"]],
                   float(data.get("verify_per_request_ms", 0.0)), float(data.get("draft_per_request_ms", 0.0)),
                   int(data.get("context", 128)), dict(data.get("info", {})), dict(data.get("spread") or {}))


def check_batch_cost_settings(settings, setting: str = "policy.budget.costs") -> list[int]:
    """Check a batched cost model's config block (``{context, rows, repeats, cache}``) before any model loads; returns
    its rows.

    Raises:
        ValueError: for a missing block, empty or non-positive ``rows``, or ``context`` / ``repeats`` below 1, naming
            ``setting``.
    """
    if settings is None:
        raise ValueError(f"{setting} is missing: give {{context, rows, repeats, cache}} (conf/policy/default.yaml "
                         "policy.budget.costs)")
    try:
        rows = [int(r) for r in (settings.get("rows") or [])]
    except (TypeError, ValueError):
        rows = []
    if not rows or min(rows) < 1:
        raise ValueError(f"{setting}.rows={settings.get('rows')!r}: give the total verified rows to time, "
                         "e.g. [1, 2, 4, 8, 16, 32, 64]")
    for key in ("context", "repeats"):
        value = settings.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{setting}.{key}={value!r}: must be an integer >= 1")
    return rows


KNEE_SHARE = 0.95  # serve.max_batch=auto: the fewest requests reaching this share of the most tokens/s (0.9 took 12
# on a curve flat from 12 to 32 requests, 2026-12-06: at 16 clients four waited a whole reply, TTFT p99 2.9 s)


def knee(costs: BatchCostModel, limit: int = 64, share: float = KNEE_SHARE) -> int:
    """The batch size ``serve.max_batch=auto`` takes: the fewest requests per step (1..``limit``) whose plain steps
    (one verified row each) reach ``share`` of the most tokens per ms any batch size up to ``limit`` reaches on
    ``costs``. Past it, another request adds nearly its whole step to every request's TPOT and little throughput; the
    requests beyond it wait (their TTFT) instead of slowing every stream.

    Raises:
        ValueError: for limit < 1 or a share outside (0, 1].
    """
    if int(limit) < 1 or not 0 < share <= 1:
        raise ValueError(f"knee needs limit >= 1 and 0 < share <= 1, got {limit}, {share}")
    rate = {n: n / costs.step_ms(n, 0, n) for n in range(1, int(limit) + 1)}
    best = max(rate.values())
    return min(n for n, r in rate.items() if r >= share * best)
