"""The one scheduler of batched decoding: pending requests, chunked prefill, joining at the step boundary, cancellation.

``Scheduler.tick`` is one turn of a batching server's loop over a ``BatchedDecoder``: it ends the requests whose
caller went away (``Entry.cancelled``: waiting ones are answered at once, running ones leave the batch), prefills
waiting requests into free slots chunk by chunk (``SpeculativeDecoder.prefill_steps``: while others decode, about one
chunk of ``model.prefill_chunk`` tokens runs between two batched steps; with none decoding, prefills run back to back),
lets each prefilled request join at the load of the running, joining and waiting requests (the batch policy's
``admit``), runs one batched step and hands each finished request back (``Entry.finished``).

Its users: the server's engine (``pipeline.serving.engine``: it keeps only the bridge between the event loop and this
thread: admission, futures, text streams, the recorder) and ``decode_all``, the driver of ``pipeline.bench_batch`` and of
the tests: so a benchmark measures the server's own admission, prefill and steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from pipeline.decoding.batched import BatchedDecoder
from pipeline.decoding.requests import DecodeConfig, PrefillResult, Request
from pipeline.decoding.schedules import BatchPolicy, Schedule

log = logging.getLogger(__name__)

STEPS_KEPT = 10_000  # batched steps whose ``BatchedDecoder.rows`` / ``step_log`` entries a long-running loop keeps


class RequestCancelled(RuntimeError):
    """A request ended by its caller (``Entry.cancelled``) before its decode started."""


class Entry:
    """One request as the scheduler sees it; a user subclasses it for its own hand-offs (the hooks below).

    Args:
        rid: the request's id; input_ids: [1, n] or [n] prompt ids; config: its decoding settings;
        schedule: its schedule (or a fixed B), or None when ``start`` chooses it; arrived_s: its arrival time on the
            ``time.perf_counter`` clock (None: when it is submitted).
    Attributes:
        request: its ``Request`` once it joined the batch (None before).
        prefilled: prompt tokens prefilled so far.
    """

    def __init__(self, rid: Any, input_ids: torch.Tensor, config: DecodeConfig, schedule: Schedule | int | None = None,
                 arrived_s: float | None = None):
        self.rid, self.input_ids, self.config, self.schedule = rid, input_ids, config, schedule
        self.arrived_s = arrived_s
        self.request: Request | None = None
        self.prefilled = 0
        self.steps = None  # its prefill's chunk iterator while it prefills

    # -- hooks ------------------------------------------------------------------------------------------------------
    def start(self, decoder) -> bool:
        """Called when a slot frees for it, before its prefill: set ``schedule`` if it has none; return whether the
        prefill keeps drafter features beyond what the schedule needs. Raising fails this request only."""
        return False

    def cancelled(self) -> bool:
        """Whether its caller went away (checked between steps)."""
        return False

    def on_tokens(self, ids: list[int]) -> bool | None:
        """Its new tokens after each step (the prefill's first token first); a true return ends it."""
        return None

    def joined(self, prefill: PrefillResult) -> None:
        """Its prefill, just before it joins the batch."""

    def finished(self) -> None:
        """It is done (``request.stats`` final); called once."""

    def failed(self, err: BaseException) -> None:
        """It ended with ``err`` (a bad prompt or block size, a failed forward, ``RequestCancelled``)."""


class Scheduler:
    """Admits ``Entry`` requests into one ``BatchedDecoder`` (see the module doc).

    Args:
        batch: the batched decoder (its policy admits and plans); max_batch: the most requests decoding at once
            (None: no limit).
        kv_budget: the most bytes of KV cache the requests holding a slot may need together (each its prompt plus its
            ``max_new_tokens``, ``decoder.kv_bytes_per_token`` each): the next waiting request is admitted only when
            its need fits beside theirs (None: no bound; a request needing more than the whole bound is the caller's
            to refuse). The decoder's prefix cache (``decoder.prefix_cache``) holds at most what they leave free:
            after every admission and prefill its least recently used blocks go, as vLLM's cached blocks are the
            free part of one pool.
    Attributes:
        pending: submitted and waiting for a slot, in order; prefilling: the one whose prefill is under way (it holds a
            slot); running: ``{id(Request): Entry}`` of the requests in the batch.
    """

    def __init__(self, batch: BatchedDecoder, max_batch: int | None = None, kv_budget: int | None = None):
        if max_batch is not None and int(max_batch) < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.batch = batch
        self.decoder = batch.decoder
        self.max_batch = int(max_batch) if max_batch is not None else None
        self.kv_budget = int(kv_budget) if kv_budget else None
        self.pending: list[Entry] = []
        self.prefilling: Entry | None = None
        self.running: dict[int, Entry] = {}

    def submit(self, entry: Entry) -> None:
        """Queue ``entry`` (it joins when a slot frees)."""
        if entry.arrived_s is None:
            entry.arrived_s = time.perf_counter()
        self.pending.append(entry)

    @property
    def busy(self) -> bool:
        """Whether any request is waiting, prefilling or decoding."""
        return bool(self.pending or self.prefilling is not None or self.running)

    @property
    def decoding(self) -> int:
        """Requests holding a slot (decoding, or prefilling to join)."""
        return len(self.running) + (self.prefilling is not None)

    def _full(self) -> bool:
        return self.max_batch is not None and len(self.running) >= self.max_batch

    def kv_need(self, entry: Entry) -> int:
        """Bytes of KV cache ``entry`` may hold at its end (its prompt and ``max_new_tokens``)."""
        return (int(entry.input_ids.numel()) + int(entry.config.max_new_tokens)) * self.decoder.kv_bytes_per_token

    @property
    def kv_reserved(self) -> int:
        """Bytes of KV cache the requests holding a slot may need together."""
        held = [*self.running.values(), *([self.prefilling] if self.prefilling is not None else [])]
        return sum(self.kv_need(e) for e in held)

    def _fits(self, entry: Entry) -> bool:
        return (self.kv_budget is None or not (self.running or self.prefilling)
                or self.kv_reserved + self.kv_need(entry) <= self.kv_budget)

    def tick(self) -> bool:
        """Drop cancelled requests, prefill into free slots, run one batched step and hand back the finished ones.

        Returns:
            whether a batched step ran (its time is ``batch.step_log[-1]``).
        """
        self._drop_cancelled()
        self._prefill()
        if not self.batch.active:
            return False
        try:
            finished = self.batch.step()
        except Exception as err:  # a failed step fails the requests in it; the loop keeps serving
            log.exception("batched step failed")
            for req in list(self.batch.active):
                self.batch.cancel(req)
                self.running.pop(id(req)).failed(err)
            return False
        for req in finished:
            self.running.pop(id(req)).finished()
        for kept in (self.batch.rows, self.batch.step_log):  # a server runs for days: keep the recent steps
            if len(kept) > 2 * STEPS_KEPT:
                del kept[:-STEPS_KEPT]
        return True

    def fail_all(self, err: BaseException) -> None:
        """End every request with ``err`` (shutdown)."""
        if self.prefilling is not None:
            self.pending.insert(0, self.prefilling)
            self.prefilling = None
        for entry in [*self.pending, *self.running.values()]:
            entry.failed(err)
        for req in list(self.batch.active):
            self.batch.cancel(req)
        self.pending, self.running = [], {}

    def _drop_cancelled(self) -> None:
        for entry in [e for e in self.pending if e.cancelled()]:
            self.pending.remove(entry)
            entry.failed(RequestCancelled(f"request {entry.rid} was cancelled before its decode started"))
        for key, entry in list(self.running.items()):
            if entry.cancelled() and not entry.request.done:
                self.batch.cancel(entry.request)
                self.running.pop(key).finished()

    def _fit_prefix_cache(self) -> None:
        prefixes = getattr(self.decoder, "prefix_cache", None)
        if self.kv_budget is not None and prefixes is not None:
            prefixes.shrink(self.kv_budget - self.kv_reserved)

    def _prefill(self) -> None:
        try:
            self._prefill_chunks()
        finally:
            self._fit_prefix_cache()

    def _prefill_chunks(self) -> None:
        chunk = self.decoder.prefill_chunk or float("inf")
        spent = 0
        while True:
            entry = self.prefilling
            if entry is None:
                if not self.pending or self._full() or not self._fits(self.pending[0]):
                    return
                entry = self.pending.pop(0)
                try:
                    extra = entry.start(self.decoder)
                    if isinstance(entry.schedule, int):
                        self.decoder.check_block_size(entry.schedule)
                    drafts = entry.schedule if isinstance(entry.schedule, int) else entry.schedule.max_block_size
                    entry.steps = self.decoder.prefill_steps(entry.input_ids, entry.config,
                                                             want_features=drafts > 1 or bool(extra))
                except Exception as err:  # a block size the drafter cannot draft: this request only
                    entry.failed(err)
                    continue
                self.prefilling = entry
            if entry.cancelled():
                self.prefilling = None
                entry.failed(RequestCancelled(f"request {entry.rid} was cancelled during its prefill"))
                continue
            try:
                result = next(entry.steps)
            except Exception as err:  # a bad prompt (too long for max_tokens) or a failed forward: this request only
                self.prefilling = None
                entry.failed(err)
                continue
            step = min(entry.input_ids.numel() - entry.prefilled, chunk)
            entry.prefilled += step
            spent += step
            if result is not None:
                self.prefilling = None
                entry.steps = None
                self._join(entry, result)
            if self.batch.active and spent >= chunk:
                return

    def _join(self, entry: Entry, prefill: PrefillResult) -> None:
        entry.joined(prefill)
        load = len(self.running) + 1 + len(self.pending)
        if self.max_batch is not None:
            load = min(self.max_batch, load)
        try:
            req = self.batch.add(prefill, entry.schedule, entry.config, rid=entry.rid, on_tokens=entry.on_tokens,
                                 arrived_s=entry.arrived_s, load=load)
        except Exception as err:
            entry.failed(err)
            return
        entry.request = req
        if req.done:
            entry.finished()
        else:
            self.running[id(req)] = entry


def decode_all(decoder, prompts: Sequence[torch.Tensor], schedules: Sequence[Schedule | int],
               configs: Sequence[DecodeConfig], arrivals: Sequence[int] | None = None, max_batch: int | None = None,
               policy: BatchPolicy | None = None, arrival_times_s: Sequence[float] | None = None,
               batch: BatchedDecoder | None = None, on_step: Callable[[], None] | None = None) -> list[Request]:
    """Decode a workload of requests through the ``Scheduler`` (the server's), in batched steps.

    Request i arrives at batched step ``arrivals[i]`` (default: all at step 0), or, with ``arrival_times_s``, that many
    seconds after the start (wall clock; the loop sleeps until the next arrival when nothing is in flight). Arrived
    requests wait for a slot while ``max_batch`` decode (None: no limit) and are prefilled and admitted as the server
    admits them.

    Args:
        prompts: [1, n_i] or [n_i] prompt ids; schedules: per request a schedule or a fixed B; configs: per request.
        batch: the ``BatchedDecoder`` to run on (its ``step_log`` and ``rows`` then describe the run); None: a new one
            with ``policy``.
        on_step: called after every batched step.
    Returns:
        the ``Request`` of each prompt, in the order given (all done).
    Raises:
        ValueError: when the lists' lengths differ or max_batch < 1; the first request's error when one fails.
    """
    n = len(prompts)
    if len(schedules) != n or len(configs) != n or (arrivals is not None and len(arrivals) != n):
        raise ValueError(f"need one schedule, config (and arrival) per prompt: {n} prompts, {len(schedules)} schedules, "
                         f"{len(configs)} configs")
    batch = batch if batch is not None else BatchedDecoder(decoder, policy)
    scheduler = Scheduler(batch, max_batch)
    errors: list[BaseException] = []

    class _Item(Entry):
        def failed(self, err: BaseException) -> None:
            errors.append(err)

    order = list(range(n))
    if arrival_times_s is not None:
        order.sort(key=lambda i: arrival_times_s[i])
    elif arrivals is not None:
        order.sort(key=lambda i: arrivals[i])
    items = [_Item(i, prompts[i], configs[i], schedules[i]) for i in range(n)]
    t0 = time.perf_counter()
    waiting = list(order)
    while waiting or scheduler.busy:
        if arrival_times_s is not None:
            now_s = time.perf_counter() - t0
            while waiting and arrival_times_s[waiting[0]] <= now_s:
                i = waiting.pop(0)
                items[i].arrived_s = t0 + arrival_times_s[i]
                scheduler.submit(items[i])
            if waiting and not scheduler.busy:  # nothing in flight: wait for the next arrival
                time.sleep(max(0.0, arrival_times_s[waiting[0]] - now_s))
                continue
        else:
            while waiting and (arrivals is None or arrivals[waiting[0]] <= batch.steps):
                i = waiting.pop(0)
                items[i].arrived_s = t0 if arrivals is None else None  # all at once: queueing counts from the start
                scheduler.submit(items[i])
            if waiting and not scheduler.busy:  # nothing to step: the step clock jumps to the next arrival
                batch.steps = arrivals[waiting[0]]
                continue
        if scheduler.tick() and on_step is not None:
            on_step()
        if errors:
            raise errors[0]
    return [item.request for item in items]
