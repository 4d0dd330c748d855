"""Self-labelling: every finished served request becomes a label row, in the schema of ``make label``.

A served request already holds what replay labelling needs: the prefill (the target's last-token
distribution, the drafter's context features, the prompt's KV cache, copied before decoding) and the
target's own output. ``Recorder.record`` runs after the response is sent: one teacher-forced target
pass over the output (``pipeline.labeling.replay.trace_from_output``), drafter-only replays of every
candidate B (``replay``), tokens/s from the latency model, and one row appended to the label store
(``pipeline.labeling.store.LabelStore``, ``LABEL_SCHEMA``), so ``make dataset`` and ``make train`` read a
served run like any label run (``run_name`` = the record run).

Rows: ``id`` = the response id (``chatcmpl-...`` / ``cmpl-...``), ``source_set`` = ``serve.record.source_set``.
Only requests at the recorder's temperature are recorded (a label run has one temperature); at T>0 each
row is labelled under the request's own seed. A request that ended on a stop string or a client that
went away is labelled over the tokens it produced.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from pipeline.costs import CostModel
from pipeline.decoding.requests import DecodeConfig, PrefillResult
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.labeling.checks import LM_HEAD_MODES
from pipeline.labeling.replay import replay, trace_from_output

log = logging.getLogger(__name__)


@dataclass
class Served:
    """What one finished request leaves for the recorder.

    Attributes:
        request_id: the response id (the row's ``id``).
        prefill: the request's prefill with an unconsumed copy of the prompt cache.
        output_ids: the output tokens (positions n..).
        config: the request's decode settings; halted: the decode ended early (stop string, client gone),
            so the replay's budget is ``len(output_ids)``.
        taus: the served decode's per-step tau; block_sizes: its per-step B (to check the replay against).
        decode_ms: the served decode's wall time (ms).
    """

    request_id: str
    prefill: PrefillResult
    output_ids: list[int]
    config: DecodeConfig
    halted: bool
    taus: list[int]
    block_sizes: list[int]
    decode_ms: float


class Recorder:
    """Appends a label row per served request to ``out_dir`` (a label run: shards + ``meta.json``).

    Args:
        decoder: the serving decoder (needs a drafter).
        out_dir: the label run directory (``data/labels/<serve.record.run_name>``).
        candidates: the block sizes to label (checked against the decoder).
        latency: the machine's cost model (``pipeline.costs``: tokens/s and ``label_speed``).
        meta: the run's ``meta.json`` (``pipeline.labeling.runner.run_meta`` keys); checked against a stored one.
        source_set: the rows' ``source_set``; topk, store_full_logits, lm_head: as in ``conf/label/``.
        flush_every: rows per shard file (``flush`` writes the rest).
    Attributes:
        recorded, skipped: request counts; record_ms: wall time of every ``record`` call (ms);
        mismatches: requests whose replay at the served B disagreed with the served taus (fp near-ties).
    Raises:
        ValueError: without a drafter, for bad candidates, or for a stored ``meta.json`` of other settings.
    """

    def __init__(self, decoder: SpeculativeDecoder, out_dir, candidates, latency: CostModel, meta: dict,
                 source_set: str = "served", topk: int = 64, store_full_logits: bool = False, lm_head: str = "auto",
                 flush_every: int = 8):
        if decoder.drafter is None:
            raise ValueError("serve.record=true needs a drafter (model.drafter): replay labels are drafter replays")
        if lm_head not in LM_HEAD_MODES:
            raise ValueError(f"serve.record.lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
        from pipeline.labeling.oracle import check_candidates  # with the store: pandas and pyarrow (~60 MB resident),
        from pipeline.labeling.store import LabelStore  # imported only by a server that records

        self.decoder = decoder
        self.candidates = check_candidates(candidates, decoder)
        self.latency = latency
        self.temperature = float(meta["temperature"])
        self.source_set, self.topk, self.store_full_logits, self.lm_head = source_set, int(topk), bool(store_full_logits), lm_head
        self.store = LabelStore(out_dir)
        self.meta = self.store.ensure_meta({**meta, "latency_model": latency.to_dict()})
        self.flush_every = max(1, int(flush_every))
        self.rows: list[dict] = []
        self.recorded = self.skipped = self.mismatches = 0
        self.record_ms: list[float] = []
        self._lock = threading.Lock()

    def wants(self, config: DecodeConfig) -> bool:
        """Whether a request with these settings is recorded (its temperature is the run's)."""
        return abs(config.temperature - self.temperature) < 1e-9

    def skip(self) -> None:
        """Count a request that is not recorded (another temperature than the run's)."""
        with self._lock:
            self.skipped += 1

    @torch.inference_mode()
    def label_row(self, served: Served) -> dict:
        """The label row of one served request (``LABEL_SCHEMA`` fields).

        Raises:
            ValueError: for a request without output tokens or prefill features.
        """
        from pipeline.labeling.oracle import distribution_features, pick_label

        prefill, config = served.prefill, served.config
        budget = len(served.output_ids) if served.halted else config.max_new_tokens
        replay_config = DecodeConfig(budget, config.temperature, config.seed)
        trace = trace_from_output(self.decoder, prefill, served.output_ids, replay_config, served.decode_ms)
        results = replay(self.decoder, trace, self.candidates, replay_config, self.lm_head)
        served_b = served.block_sizes[0] if served.block_sizes else None
        if not served.halted and served_b in results and len(set(served.block_sizes[:-1])) <= 1 and results[served_b].taus != served.taus:
            self.mismatches += 1
            log.warning("request %s: replay at B=%d gives taus %s, the served decode %s (floating-point near-tie)",
                        served.request_id, served_b, results[served_b].taus, served.taus)
        n = prefill.input_ids.shape[1]
        prefill_ms = self.latency.prefill_ms(n)
        row = {"id": served.request_id, "source_set": self.source_set, "prompt_tokens": n,
               "candidates": list(self.candidates), "prefill_ms": prefill.prefill_ms, "shard": 0, "num_shards": 1,
               **distribution_features(prefill.last_logits, self.topk, self.store_full_logits)}
        row["tau"] = [float(results[b].tau) for b in self.candidates]
        row["new_tokens"] = [float(results[b].new_tokens) for b in self.candidates]
        row["decode_ms"] = [float(self.latency.decode_ms(results[b].block_sizes, results[b].starts, results[b].new_tokens,
                                                         config.temperature)) for b in self.candidates]
        row["tokens_per_s"] = [t / ((prefill_ms + ms) / 1e3) if prefill_ms + ms > 0 else 0.0
                               for t, ms in zip(row["new_tokens"], row["decode_ms"])]
        row["label_tau"] = pick_label(self.candidates, row["tau"])
        row["label_speed"] = pick_label(self.candidates, row["tokens_per_s"])
        return row

    def record(self, served: Served) -> dict | None:
        """Label ``served`` and queue its row (written every ``flush_every`` rows); returns the row, None when skipped.

        Never raises: a failure is logged and counted in ``skipped`` (the server must outlive a bad row).
        """
        t0 = time.perf_counter()
        try:
            if not self.wants(served.config) or not served.output_ids:
                with self._lock:
                    self.skipped += 1
                return None
            row = self.label_row(served)
        except Exception:  # noqa: BLE001 - a recording failure must not take the server down
            log.exception("recording request %s failed; skipped", served.request_id)
            with self._lock:
                self.skipped += 1
            return None
        with self._lock:
            self.rows.append(row)
            self.recorded += 1
            self.record_ms.append((time.perf_counter() - t0) * 1e3)
            if len(self.rows) >= self.flush_every:
                self._flush_locked()
        return row

    def flush(self) -> None:
        """Write the queued rows as one shard file."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        rows, self.rows = self.rows, []
        if rows:
            path = self.store.write(rows)
            log.info("recorded %d served requests -> %s", len(rows), path)

    def stats(self) -> dict:
        """{"recorded", "skipped", "mismatches", "record_ms_mean", "out_dir"} for logs and ``/v1/models``' owner."""
        mean = sum(self.record_ms) / len(self.record_ms) if self.record_ms else 0.0
        return {"recorded": self.recorded, "skipped": self.skipped, "mismatches": self.mismatches,
                "record_ms_mean": mean, "out_dir": str(self.store.directory)}
