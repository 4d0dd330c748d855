"""Continuous batching for the server: up to ``serve.max_batch`` requests share every draft-verify step.

``BatchEngine`` has ``Engine``'s interface (``run``, streaming through ``Job.on_text``, ``QueueFull``, cancellation
through ``Job.cancelled``, ``decode_config``, ``check_block_size``, ``drain``, ``close``, the counters ``/health``
reads) and runs one scheduler thread around a ``pipeline.decoding.batched.BatchedDecoder``: between two batched steps
it admits waiting requests while fewer than ``max_batch`` run (each prefilled alone, then joining at the step
boundary), ends requests whose client went away (the slot frees at once: ``finish_reason`` ``abort``), and after each
step answers the requests that finished. Each request's text is the one it would get alone (batched steps are
lossless and, on the smallm backend, bit-identical per request).

Admission: ``max_batch`` running + ``max_queue`` waiting; more get ``QueueFull`` (503). The ``max_queue`` attribute the
app reads holds ``max_queue + max_batch - 1`` so that its check ``in_flight >= 1 + max_queue`` counts every slot.
Policies: every ``serve.policy`` schedule (each request's own, verify-width ones choosing k alone), or ``budget``
(``serve.policy=budget``: ``pipeline.policy.budget.BudgetPolicy``, the widths of the step's requests chosen jointly on
this machine's batched step costs; the ``blockpilot`` extension of its responses says policy ``budget``). Prefills are
chunked (``model.prefill_chunk`` tokens a forward): between two batched steps at most about one chunk runs, so a long
prompt stalls the running requests one chunk at a time. With a recorder (``serve.record=true``) each finished request's
label row is computed on the recorder's own thread, as the batch-1 ``Engine`` does.

    python -m pipeline.serve serve.max_batch=8            # continuous batching (serve.max_batch=1: the batch-1 Engine)
    python -m pipeline.serve serve.max_batch=8 serve.policy=budget   # ... with the verify widths chosen jointly
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from pipeline.decoding.batched import BatchedDecoder
from pipeline.decoding.schedules import FirstChoice, FixedSchedule
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.serving.engine import (Completion, Engine, Job, JobCancelled, Policy, QueueFull, keep_for_recorder,
                                     served_of)
from pipeline.serving.schemas import DecodeInfo
from pipeline.serving.text import TextStream

log = logging.getLogger(__name__)
STEPS_KEPT = 10_000  # batched steps whose ``BatchedDecoder.rows`` / ``step_log`` entries the server keeps


class _Entry:
    """A job inside the scheduler: its future, loop, text stream and batch request."""

    __slots__ = ("job", "future", "loop", "stream", "schedule", "request", "policy", "queue_ms", "steps", "on_tokens",
                 "prefilled", "record", "kept")

    def __init__(self, job: Job, future: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.job, self.future, self.loop = job, future, loop
        self.stream = self.schedule = self.request = self.policy = self.steps = self.on_tokens = None
        self.queue_ms = 0.0
        self.prefilled = 0  # prompt tokens prefilled so far
        self.record = False  # the recorder wants this request
        self.kept = None  # its prefill with an unconsumed copy of the prompt cache (for the recorder)


class BatchEngine(Engine):
    """Runs requests through one ``SpeculativeDecoder`` in batched steps (see the module doc).

    Args:
        as ``Engine``, plus max_batch: the most requests decoding together (>= 1); budget: a
        ``pipeline.policy.budget.BudgetPolicy`` choosing every step's widths jointly (None: ``policy.budget``, which
        ``build_policy("budget", ...)`` sets; without either, each request's schedule chooses its own); thread: a
        single-worker executor whose thread runs the scheduler for the engine's life (``python -m pipeline.serve``
        passes the thread that loaded and warmed the model: one OpenMP team, ``pipeline.serving.threads``); None: a
        thread of its own. Recording runs on another worker.
    Raises:
        ValueError: for max_batch < 1 or max_queue < 0.
    """

    batched = True

    def __init__(self, decoder: SpeculativeDecoder, policy: Policy, model_name: str, max_queue: int = 64,
                 default_max_tokens: int = 256, max_tokens: int = 4096, default_seed: int = 0, recorder=None,
                 default_temperature: float = 0.0, max_batch: int = 8, budget=None,
                 thread: ThreadPoolExecutor | None = None):
        if int(max_batch) < 1:
            raise ValueError(f"serve.max_batch must be >= 1, got {max_batch}")
        super().__init__(decoder, policy, model_name, max_queue, default_max_tokens, max_tokens, default_seed, recorder,
                         default_temperature)
        if recorder is None:
            self.executor.shutdown(wait=False)  # the batch-1 worker is not used (with a recorder: it records)
        self.max_batch = int(max_batch)
        self.waiting_limit = int(max_queue)
        self.max_queue = self.waiting_limit + self.max_batch - 1  # the app's check: in_flight >= 1 + max_queue
        self.budget = budget if budget is not None else getattr(policy, "budget", None)
        budget = self.budget
        self.batch = BatchedDecoder(decoder, budget.allocate if budget is not None else None,
                                    budget.plan if budget is not None else None)
        self._inbox: queue.Queue[_Entry | None] = queue.Queue()
        self._pending: list[_Entry] = []
        self._prefilling: _Entry | None = None  # the request whose prefill is under way (it holds a slot)
        self._running: dict[int, _Entry] = {}  # id(BatchRequest) -> entry
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._loop_done: Future | None = None
        if thread is None:
            self._thread = threading.Thread(target=self._loop, name="batch-decoder", daemon=True)
            self._thread.start()
        else:  # the scheduler occupies the given worker for the engine's life (the thread that loaded the model)
            self._loop_done = thread.submit(self._loop)
            self._loop_done.add_done_callback(_log_failure)

    @classmethod
    def from_engine(cls, engine: Engine, max_batch: int, budget=None) -> Engine:
        """``engine`` itself when ``max_batch`` <= 1, else a ``BatchEngine`` with its settings (``engine`` is closed).

        Raises:
            ValueError: as the constructor.
        """
        if max_batch is None or int(max_batch) <= 1:
            return engine
        batched = cls(engine.decoder, engine.policy, engine.model_name, engine.max_queue, engine.default_max_tokens,
                      engine.max_tokens, engine.default_seed, engine.recorder, engine.default_temperature,
                      int(max_batch), budget)
        engine.close()
        return batched

    @property
    def running(self) -> int:
        """Requests in the batch now (``/health``; the rest of ``in_flight`` waits for a slot)."""
        return len(self._running)

    # -- the event loop's side ----------------------------------------------------------------------
    async def run(self, job: Job) -> Completion:
        """Admit ``job`` and wait for its completion (decoded in batched steps by the scheduler thread).

        Raises:
            QueueFull: when ``max_batch + max_queue`` requests are in flight.
            Exception: whatever its decode raised (the server answers 500 and keeps serving).
        """
        if self.in_flight >= 1 + self.max_queue:
            raise QueueFull(f"the queue is full ({self.waiting_limit} waiting + {self.max_batch} running); retry later")
        with self._admitted(job):
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._idle.clear()
            self._inbox.put(_Entry(job, future, loop))
            try:
                completion = await asyncio.shield(future)
            except asyncio.CancelledError:
                job.cancelled.set()  # the caller went away: the scheduler frees the slot at the next step boundary
                raise
        self._answered(completion)
        return completion

    # -- the scheduler thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if not self._pending and not self._running and self._prefilling is None:
                self._idle.set()
                entry = self._inbox.get()
                if entry is None:
                    return
                self._pending.append(entry)
            while True:
                try:
                    entry = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if entry is None:
                    self._fail_all(RuntimeError("the server is shutting down"))
                    return
                self._pending.append(entry)
            self._drop_cancelled()
            self._prefill()
            if not self.batch.active:
                continue
            try:
                finished = self.batch.step()
            except Exception as err:  # a failed step fails the requests in it; the engine keeps serving
                log.exception("batched step failed")
                for req in list(self.batch.active):
                    self.batch.cancel(req)
                    self._reject(self._running.pop(id(req)), err)
                continue
            for req in finished:
                self._complete(self._running.pop(id(req)))
            # the decoder logs every step; a server runs for days: keep the recent ones (memory stays bounded)
            for log_ in (self.batch.rows, self.batch.step_log):
                if len(log_) > 2 * STEPS_KEPT:
                    del log_[:-STEPS_KEPT]

    def _drop_cancelled(self) -> None:
        """End requests whose client went away: waiting ones are answered at once, running ones leave the batch."""
        for entry in [e for e in self._pending if e.job.cancelled.is_set()]:
            self._pending.remove(entry)
            # the batch-1 Engine's answer to a job cancelled before its decode started
            self._reject(entry, JobCancelled(f"request {entry.job.request_id} was cancelled before its decode started"))
        for key, entry in list(self._running.items()):
            if entry.job.cancelled.is_set() and not entry.request.done:
                self.batch.cancel(entry.request)
                self._complete(self._running.pop(key))

    def _prefill(self) -> None:
        """Prefill waiting requests into free slots, chunk by chunk (``SpeculativeDecoder.prefill_steps``): while other
        requests decode, at most about one chunk (``model.prefill_chunk`` tokens) runs between two batched steps, so a
        long prompt stalls them one chunk at a time; with none decoding, prefills run back to back. A request joins
        the batch at the step boundary after its last chunk."""
        chunk = self.decoder.prefill_chunk or float("inf")
        spent = 0
        while True:
            entry = self._prefilling
            if entry is None:
                if not self._pending or len(self._running) >= self.max_batch:
                    return
                entry = self._pending.pop(0)
                if not self._start(entry):
                    continue
                self._prefilling = entry
            if entry.job.cancelled.is_set():
                self._prefilling = None
                self._reject(entry, JobCancelled(f"request {entry.job.request_id} was cancelled during its prefill"))
                continue
            try:
                result = next(entry.steps)
            except Exception as err:  # a bad prompt (too long for max_tokens) or a failed forward: this request only
                self._prefilling = None
                self._reject(entry, err)
                continue
            n = entry.job.input_ids.numel()
            step = min(n - entry.prefilled, chunk)
            entry.prefilled += step
            spent += step
            if result is not None:
                self._prefilling = None
                self._join(entry, result)
            if self.batch.active and spent >= chunk:
                return

    def _start(self, entry: _Entry) -> bool:
        """Set up a request's schedule, text stream and prefill; False when it was answered at once (an error)."""
        job = entry.job
        entry.queue_ms = (time.perf_counter() - job.submitted) * 1e3
        try:
            if job.block_size is not None:
                entry.policy, schedule = "request", FixedSchedule(int(job.block_size))
                self.decoder.check_block_size(int(job.block_size))
            else:
                entry.policy, schedule = (self.policy.name if self.budget is None else "budget"), self.policy.make()
        except Exception as err:
            self._reject(entry, err)
            return False
        entry.schedule = FirstChoice(schedule)
        entry.record = self._wants_record(job)
        entry.stream = stream = TextStream(self.tokenizer, job.stops)

        def on_tokens(ids: list[int]) -> bool:
            delta = stream.push(ids)
            if delta and job.on_text is not None:
                job.on_text(delta)
            return stream.stopped or job.cancelled.is_set()

        entry.on_tokens = on_tokens
        entry.steps = self.decoder.prefill_steps(job.input_ids, job.config,
                                                 want_features=entry.schedule.max_block_size > 1 or entry.record)
        return True

    def _join(self, entry: _Entry, prefill) -> None:
        """The request joins the batch at the next step (its first token streamed now)."""
        if entry.record:
            entry.kept = keep_for_recorder(prefill)
        try:
            req = self.batch.add(prefill, entry.schedule, entry.job.config, rid=entry.job.request_id,
                                 on_tokens=entry.on_tokens)
        except Exception as err:
            self._reject(entry, err)
            return
        entry.request = req
        if req.done:
            self._complete(entry)
        else:
            self._running[id(req)] = entry

    def _complete(self, entry: _Entry) -> None:
        job, req, stream = entry.job, entry.request, entry.stream
        stats = req.stats
        tail = stream.finish()
        if tail and job.on_text is not None:
            job.on_text(tail)
        if job.cancelled.is_set() and not stream.stopped:
            reason = "abort"
        elif stream.stopped or stats.stopped:
            reason = "stop"
        else:
            reason = "length"
        info = DecodeInfo.of(stats, entry.policy, entry.schedule.chosen, entry.queue_ms)
        completion = Completion(stream.text, reason, list(stats.output_ids), stats, info)
        entry.loop.call_soon_threadsafe(_settle, entry.future, completion, None)
        if entry.kept is not None:  # labelled on the recorder's own thread, as the batch-1 engine does after a decode
            halted = stream.stopped or job.cancelled.is_set()
            self.executor.submit(self.recorder.record, served_of(job, entry.kept, stats, halted))
            entry.kept = None

    def _reject(self, entry: _Entry, err: BaseException) -> None:
        entry.loop.call_soon_threadsafe(_settle, entry.future, None, err)

    def _fail_all(self, err: BaseException) -> None:
        if self._prefilling is not None:
            self._pending.insert(0, self._prefilling)
            self._prefilling = None
        for entry in self._pending:
            self._reject(entry, err)
        for entry in self._running.values():
            self._reject(entry, err)
        self._pending, self._running = [], {}

    # -- lifecycle ----------------------------------------------------------------------------------
    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait (at most ``timeout_s``) until every admitted request has been answered (and recorded, then flush the
        recorder)."""
        deadline = time.monotonic() + timeout_s
        while not self._idle.wait(timeout=0.05) or not self._inbox.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout_s} s")
        if self.recorder is not None:
            self.executor.submit(lambda: None).result(timeout=max(1.0, deadline - time.monotonic()))
            self.recorder.flush()

    def close(self) -> None:
        """Finish the admitted requests and stop the scheduler (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self._inbox.put(None)
            if self._thread is not None:
                self._thread.join(timeout=60)
            else:
                futures_wait([self._loop_done], timeout=60)
            self.executor.shutdown(wait=True)


def _log_failure(done: Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("the batch scheduler stopped", exc_info=done.exception())


def _settle(future: asyncio.Future, result, err) -> None:
    if future.done():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(result)
