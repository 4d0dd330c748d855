"""What the field's benchmark tools read from a vLLM server, from the decoder's own per-request record.

Two views of one source, the decoder's ``RequestStats`` (per step: ``taus`` = accepted drafts + 1 bonus,
``verify_widths`` = drafts verified, k) and the ``Request``'s times:

- ``speculative_decoding(stats)``: the per-response ``metrics.speculative_decoding`` object, vLLM's
  ``SpeculativeDecodingMetrics`` (``vllm/entrypoints/generate/base/protocol.py``, filled by
  ``RequestSpecDecodeMetrics.to_dict`` in ``vllm/v1/metrics/stats.py``), plus ``num_accepted_tokens_per_pos``.
- ``ServeMetrics``: ``/metrics`` in Prometheus' text format (``prometheus_client``, a registry of its own per app),
  with vLLM's names and meanings (``vllm/v1/metrics/loggers.py``, ``vllm/v1/spec_decode/metrics.py``), and the
  process's own series (``process_resident_memory_bytes`` and the rest of prometheus_client's ``ProcessCollector``,
  Linux) with ``process_resident_memory_peak_bytes`` (``resident_memory``).

vLLM's meanings, kept: a *draft* is one verify step of one request that verified at least one drafted token (a step
with k = 0, an autoregressive step, is not a draft); ``num_draft_tokens`` counts the drafted tokens verified (our k),
``num_accepted_tokens`` the accepted ones (tau - 1 of the step); the mean acceptance length is
``1 + accepted / drafts`` (the bonus token counted), and the rate of position i is ``accepted_per_pos[i] / drafts``.
Our own ``blockpilot.tau`` averages over every step, plain steps (tau 1) included, so the two agree when every step
drafted and ``tau * steps == steps + num_accepted_draft_tokens`` always.

Prefix caching, vLLM's meanings too: ``vllm:prefix_cache_queries`` counts the prompt tokens looked up in the prefix
cache and ``vllm:prefix_cache_hits`` the tokens found there (``pipeline.decoding.prefix_cache.PrefixCache``'s
``queries`` and ``hits``: their hit rate is hits / queries), read from the decoder's prefix cache when scraped.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# vLLM's default buckets (vllm/v1/metrics/buckets.py)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


def draft_steps(stats) -> list[tuple[int, int]]:
    """(drafted tokens verified, accepted drafts) of each step of ``stats`` that verified drafts (vLLM's drafts)."""
    return [(int(k), max(0, min(int(t) - 1, int(k)))) for t, k in zip(stats.taus, stats.verify_widths) if int(k) > 0]


def speculative_decoding(stats) -> dict:
    """vLLM's per-request ``metrics.speculative_decoding`` of one request's ``RequestStats`` (zeros when it never
    drafted): ``mean_acceptance_length`` (bonus counted; 1.0 without drafts), ``draft_acceptance_rate``,
    ``acceptance_histogram`` (index j: drafts that accepted exactly j tokens), ``num_spec_steps`` (drafts),
    ``num_accepted_draft_tokens``, ``num_draft_tokens``, ``num_spec_tokens`` (the most drafts a step could verify:
    the request's largest B - 1), ``num_accepted_tokens_per_pos`` (drafts whose position i was accepted, the
    per-request share of ``vllm:spec_decode_num_accepted_tokens_per_pos``), and ours, ``by_source``: {draft source:
    {"num_draft_tokens", "num_accepted_tokens"}} (``RequestStats.sources``: which source proposed what was verified
    and taken; a token two sources proposed at one place counts for both)."""
    steps = draft_steps(stats)
    spec = max([int(b) - 1 for b in stats.block_sizes] + [k for k, _ in steps] + [0])
    histogram, per_pos = [0] * (spec + 1), [0] * spec
    for _, accepted in steps:
        histogram[accepted] += 1
        for i in range(accepted):
            per_pos[i] += 1
    drafts, drafted, accepted = len(steps), sum(k for k, _ in steps), sum(a for _, a in steps)
    return {"mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": histogram, "num_spec_steps": drafts, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted, "num_spec_tokens": spec, "num_accepted_tokens_per_pos": per_pos,
            "by_source": {source: {"num_draft_tokens": int(d), "num_accepted_tokens": int(a)}
                          for source, (d, a) in sorted(getattr(stats, "sources", {}).items())}}


def resident_memory() -> tuple[int | None, int | None]:
    """(resident bytes now, the most resident since the peak was last reset: ``reset_peak_resident``) of this process,
    from ``/proc/self/status`` (VmRSS, VmHWM; Linux); (None, None) elsewhere."""
    found = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("VmRSS"), found.get("VmHWM")


def reset_peak_resident() -> bool:
    """Start the peak of ``resident_memory`` again from the resident memory now (Linux's ``clear_refs`` 5): the server
    calls it once loaded and warmed, so that its peak is the serving one. False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


@dataclass
class Finished:
    """One finished request for ``ServeMetrics.observe`` (scheduler thread).

    Attributes:
        stats: its ``RequestStats``; finish_reason: ``stop`` | ``length`` | ``abort``;
        submitted_s, first_token_s, finished_s: perf_counter times (s) of its admission, first token and end;
        token_times: perf_counter time (s) of each output token (the tokens of one step share a time).
    """

    stats: object
    finish_reason: str
    submitted_s: float
    first_token_s: float
    finished_s: float
    token_times: list[float]


class ServeMetrics:
    """The server's Prometheus series in vLLM's names, on a registry of its own (several apps in one process do not
    clash), labelled ``model_name`` as vLLM labels them (vLLM's ``engine`` label is left out: one engine).

    Counters and histograms move when a request finishes (``observe``, any thread); the two gauges and the prefix
    cache's counters are read from the engine when scraped (``render``), the process's series (resident memory and its
    peak, ``resident_memory``) from the process."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                             registry=registry).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                             registry=registry).labels(model_name)
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, ... (Linux)
        Gauge("process_resident_memory_peak_bytes", "The most resident memory since the server was loaded and warmed, in "
              "bytes.", registry=registry).set_function(lambda: resident_memory()[1] or 0)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(model_name)
        success = counter("vllm:request_success", "Count of successfully processed requests.", ["finished_reason"])
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(model_name)
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels(model_name)
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.").labels(model_name)
        self.per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                               ["position"])
        self.source_drafts = counter("blockpilot:spec_decode_num_draft_tokens_by_source",
                                     "Draft tokens verified, by the draft source that proposed them.", ["source"])
        self.source_accepted = counter("blockpilot:spec_decode_num_accepted_tokens_by_source",
                                       "Draft tokens accepted, by the draft source that proposed them.", ["source"])
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.").labels(model_name)
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.").labels(model_name)
        self._prefix_seen = (0, 0)  # the prefix cache's (queries, hits) already counted

    def observe(self, done: Finished) -> None:
        """Count one finished request (its tokens, finish reason, latencies and drafts)."""
        stats = done.stats
        self.prompt_tokens.inc(int(stats.prompt_tokens))
        self.generation_tokens.inc(len(stats.output_ids))
        if done.finish_reason in self.success:
            self.success[done.finish_reason].inc()
        self.ttft.observe(max(0.0, done.first_token_s - done.submitted_s))
        self.e2e.observe(max(0.0, done.finished_s - done.submitted_s))
        emitted = sorted(set(done.token_times))  # one output per step, as vLLM times each engine output
        for before, after in zip(emitted, emitted[1:]):
            self.itl.observe(after - before)
        if len(stats.output_ids) > 1 and done.token_times:
            self.tpot.observe((done.token_times[-1] - done.token_times[0]) / (len(stats.output_ids) - 1))
        spec = speculative_decoding(stats)
        self.drafts.inc(spec["num_spec_steps"])
        self.draft_tokens.inc(spec["num_draft_tokens"])
        self.accepted.inc(spec["num_accepted_draft_tokens"])
        for position, n in enumerate(spec["num_accepted_tokens_per_pos"]):
            self.per_pos.labels(self.model_name, str(position)).inc(n)
        for source, counts in spec["by_source"].items():
            self.source_drafts.labels(self.model_name, source).inc(counts["num_draft_tokens"])
            self.source_accepted.labels(self.model_name, source).inc(counts["num_accepted_tokens"])

    def count_prefix_cache(self, prefix_cache) -> None:
        """Move the prefix cache counters up to ``prefix_cache``'s ``queries`` and ``hits`` (None: no cache)."""
        if prefix_cache is None:
            return
        queries, hits = int(prefix_cache.queries), int(prefix_cache.hits)
        seen_queries, seen_hits = self._prefix_seen
        if queries < seen_queries or hits < seen_hits:  # another cache (counted from 0)
            seen_queries = seen_hits = 0
        self.prefix_queries.inc(queries - seen_queries)
        self.prefix_hits.inc(hits - seen_hits)
        self._prefix_seen = (queries, hits)

    def render(self, running: int, waiting: int, prefix_cache=None) -> tuple[bytes, str]:
        """The exposition text (and its content type) with the gauges set to ``running`` and ``waiting`` now and the
        prefix cache counters brought up to ``prefix_cache``'s (a ``PrefixCache``, or None)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.count_prefix_cache(prefix_cache)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def scrape(url: str) -> dict[str, float]:
    """A server's ``GET <url>/metrics`` (ours or vLLM's) as ``{sample name: value summed over its labels}``, read with
    prometheus-client's own parser: what benchmark scripts difference before and after a run."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
