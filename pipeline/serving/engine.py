"""The serving engine: continuous batching over one decoder, ``serve.max_batch`` requests per step (1 included).

``Engine.run`` admits a request (``QueueFull`` past ``max_batch`` decoding + ``max_queue`` waiting) and waits for its
``Completion``, decoded on one thread by the one scheduler of batched decoding (``pipeline.decoding.scheduler``, the
one ``pipeline.bench_batch`` measures): between two batched steps it admits waiting requests while fewer than
``max_batch`` decode (each prefilled alone, chunk by chunk, then joining at the step boundary), ends requests whose
client went away (the slot frees at once: ``finish_reason`` ``abort``), and after each step the engine answers the
requests that finished. The engine itself is the bridge: the event loop's admission and futures, each request's text
stream and stop strings, the recorder, the listeners. Each request's text is the one it would get alone
(batched steps are lossless and, on the smallm backend, bit-identical per request); with ``max_batch=1`` a request
decodes alone, exactly as ``SpeculativeDecoder.generate`` decodes it. Streaming passes ``Job.on_text``, called from the
scheduler thread with each text delta (``pipeline.serving.text``).

The request's life in one place (``_Request``): the schedule its policy gives it (or its own fixed ``block_size``), its
text stream and stop strings, its finish reason, the recorder hand-off, cancellation; and the engine's: ``drain``,
``close``, the counters ``/health`` reads, the ``listeners`` told of each finished request (``/metrics``,
``pipeline.serving.metrics``).

Policies (``serve.policy``): every method of ``pipeline.policy.registry`` the server can run, built by the one method
table (``pipeline.policy.setup``, as the eval stage and ``pipeline.bench_batch`` build it). A method whose verify
widths one batch-level policy chooses (``budget``: ``pipeline.policy.budget.BudgetPolicy``) gives the batched decoder
that policy; every other method runs under the base ``BatchPolicy`` (each request's schedule decides).

With a ``Recorder`` (``serve.record=true``) each finished request's label row is computed on the recorder's own thread
after its response is answered (``pipeline.serving.recorder``). With a ``CostWatch`` (``pipeline.policy.setup``) every
batched step's time is held against the cost model the policy reads, which is measured again when it drifted: only
while no request waits (a request arriving stops the measurement, which is taken again at the next idle moment), so no
request and no stream waits for a measurement.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.decoding import DecodeConfig, FixedSchedule
from pipeline.decoding.batched import BatchedDecoder
from pipeline.decoding.requests import RequestStats
from pipeline.decoding.scheduler import Entry, RequestCancelled, Scheduler
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.models.release import trim_heap
from pipeline.serving.metrics import Finished
from pipeline.serving.recorder import Recorder, Served
from pipeline.serving.schemas import DecodeInfo, RequestError
from pipeline.serving.text import TextStream

log = logging.getLogger(__name__)

class QueueFull(RuntimeError):
    """Every slot (``max_batch`` decoding + ``max_queue`` waiting) is taken; the caller answers 503 with
    ``Retry-After`` (``Engine.retry_after_s``)."""


JobCancelled = RequestCancelled  # the job was cancelled (its client went away, or shutdown) before its decode started


@dataclass
class Job:
    """One request for the engine.

    Attributes:
        request_id: the response id; input_ids: [1, n] prompt ids; config: decode settings;
        stops: stop strings; block_size: a request's own fixed B (None: the policy);
        on_text: called from the scheduler thread with each text delta (streaming; the first token's delta even when it
            is empty, so a stream's first chunk goes out with the first token), or None;
        cancelled: set when the client went away (the decode ends after the current step).
    """

    request_id: str
    input_ids: torch.Tensor
    config: DecodeConfig
    stops: list[str] = field(default_factory=list)
    block_size: int | None = None
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class Completion:
    """A finished request: ``text`` (stop strings cut), ``finish_reason`` (``stop``|``length``|``abort``),
    ``output_ids``, ``stats`` (the decoder's ``RequestStats``) and ``info`` (the ``blockpilot`` extension)."""

    text: str
    finish_reason: str
    output_ids: list[int]
    stats: RequestStats
    info: DecodeInfo


class _Request(Entry):
    """One admitted job's life inside the engine (scheduler thread): its schedule, text stream, prefill, batch request,
    and how it ends (the ``Entry`` hooks the scheduler calls)."""

    def __init__(self, job: Job, future: asyncio.Future, loop: asyncio.AbstractEventLoop, engine: "Engine"):
        super().__init__(job.request_id, job.input_ids, job.config)
        self.job, self.future, self.loop, self.engine = job, future, loop, engine
        self.stream: TextStream | None = None
        self.policy = ""
        self.queue_ms = 0.0
        self.record = False  # the recorder labels it
        self.kept = None  # its prefill with an unconsumed copy of the prompt cache (for the recorder), or None

    def start(self, decoder) -> bool:
        """Choose its schedule (its own fixed B, else the policy's) and open its text stream; True when the recorder
        labels it (its prefill keeps drafter features).

        Raises:
            ValueError: for a block size the drafter cannot draft.
        """
        job, engine = self.job, self.engine
        self.queue_ms = (time.perf_counter() - job.submitted) * 1e3
        if job.block_size is not None:
            decoder.check_block_size(int(job.block_size))
            self.policy, self.schedule = "request", FixedSchedule(int(job.block_size))
        else:
            self.policy, self.schedule = engine.policy.name, engine.policy()
        self.stream = TextStream(engine.tokenizer, job.stops)
        self.record = engine.wants_record(job)
        return self.record

    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    def on_tokens(self, ids: list[int]) -> bool:
        """Stream new tokens' text; True ends the request (a stop string, or its client went away). The first token
        is streamed even when its text is held back (``""``): a stream's first chunk goes out with the first token."""
        first = not self.stream.ids
        delta = self.stream.push(ids)
        if (delta or first) and self.job.on_text is not None:
            self.job.on_text(delta)
        return self.stream.stopped or self.job.cancelled.is_set()

    def joined(self, prefill) -> None:
        """Keep a copy of the prefill's prompt cache for the recorder (the decode consumes the cache)."""
        if self.record:
            self.kept = copy.copy(prefill)
            self.kept.cache = copy.deepcopy(prefill.cache)

    def finished(self) -> None:
        self.engine._finish(self)

    def failed(self, err: BaseException) -> None:
        self.settle(err=err)

    def completion(self) -> Completion:
        """The finished request's answer (its text stream flushed)."""
        job, stats = self.job, self.request.stats
        tail = self.stream.finish()
        if tail and job.on_text is not None:
            job.on_text(tail)
        if job.cancelled.is_set() and not self.stream.stopped:
            reason = "abort"
        elif self.stream.stopped or stats.stopped:
            reason = "stop"
        else:
            reason = "length"
        info = DecodeInfo.of(stats, self.policy, stats.first_block_size, self.queue_ms)
        return Completion(self.stream.text, reason, list(stats.output_ids), stats, info)

    def served(self) -> Served | None:
        """The recorder's input (its kept prefill and its decode's stats), or None when it is not recorded."""
        if self.kept is None:
            return None
        stats, halted = self.request.stats, self.stream.stopped or self.job.cancelled.is_set()
        return Served(self.job.request_id, self.kept, list(stats.output_ids), self.job.config, halted, list(stats.taus),
                      list(stats.block_sizes), stats.decode_ms)

    def settle(self, result: Completion | None = None, err: BaseException | None = None) -> None:
        """Answer the waiting ``Engine.run`` (from any thread)."""
        self.loop.call_soon_threadsafe(_settle, self.future, result, err)


class Engine:
    """Decodes requests in batched steps of one ``SpeculativeDecoder`` (see the module doc).

    Args:
        decoder: the decoder; policy: the served method's ``pipeline.policy.registry.Factory`` (its name, a fresh schedule
            per request, the batch-level policy of every step); model_name: the id served at ``/v1/models``;
        max_queue: requests that may wait for a slot while ``max_batch`` decode (more get ``QueueFull``);
        default_max_tokens: ``max_tokens`` of a request that sends none; max_tokens: the largest allowed;
        default_seed: the seed of a request that sends none; recorder: a ``Recorder`` or None;
        default_temperature: the temperature of a request that sends none (``decode.temperature``; OpenAI's is 1);
        max_batch: the most requests decoding together (1: one at a time);
        thread: a single-worker executor whose thread runs the scheduler for the engine's life (``python -m
            pipeline.serve`` passes the thread that loaded and warmed the model: one OpenMP team,
            ``pipeline.serving.threads``); None: a thread of its own.
        watch: a ``pipeline.policy.setup.CostWatch`` fed every batched step (None: no run-time cost check).
        kv_budget: the most bytes of KV cache the decoding requests may need together (``serve.kv_cache_mb``; each
            request its prompt plus ``max_tokens``): a request needing more than all of it gets a 400 naming the limit,
            the others wait for room (``Scheduler``); None: no bound.
    Raises:
        ValueError: for max_batch < 1 or max_queue < 0.
    """

    def __init__(self, decoder: SpeculativeDecoder, policy, model_name: str, max_queue: int = 64,
                 default_max_tokens: int = 256, max_tokens: int = 4096, default_seed: int = 0,
                 recorder: Recorder | None = None, default_temperature: float = 0.0, max_batch: int = 1,
                 thread: ThreadPoolExecutor | None = None, watch=None, kv_budget: int | None = None):
        if int(max_batch) < 1:
            raise ValueError(f"serve.max_batch must be >= 1, got {max_batch}")
        if int(max_queue) < 0:
            raise ValueError(f"serve.max_queue must be >= 0, got {max_queue}")
        self.decoder, self.policy, self.model_name = decoder, policy, model_name
        # read once, here, on the thread that built the engine (``python -m pipeline.serve``: the decoder thread): the
        # forward path reads the kernel and the cached crossover, and any torch parallel region on another thread (the
        # event loop answering /health) starts a second OpenMP team, after which libgomp throttles its spinning and
        # every decode step pays wake-ups (measured: c=1 TPOT 8.2 -> 13.7 ms after the first /health)
        self.forward_path = decoder.forward_path()
        self.tokenizer = decoder.target.tokenizer
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.default_max_tokens, self.max_tokens = int(default_max_tokens), int(max_tokens)
        self.default_seed, self.default_temperature = int(default_seed), float(default_temperature)
        self.recorder, self.watch = recorder, watch
        # called with each finished request (``metrics.Finished``) on the scheduler thread before it is answered
        self.listeners: list[Callable[[Finished], None]] = []
        self.batch = BatchedDecoder(decoder, policy.batch)
        self.kv_budget = int(kv_budget) if kv_budget else None
        self.scheduler = Scheduler(self.batch, self.max_batch, self.kv_budget)
        # the recorder labels finished requests on a thread of its own (a replay per request, after its answer)
        self._recording = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder") if recorder else None
        self.in_flight = 0  # admitted and not answered; touched only on the event loop's thread
        self.served = self.failed = 0
        self.aborted = 0  # cancelled before or during the decode (client gone, shutdown)
        self._recent_s: collections.deque[float] = collections.deque(maxlen=32)  # the last requests' times (Retry-After)
        self._jobs: dict[int, Job] = {}  # admitted and not answered, by id(job)
        self._inbox: queue.Queue[_Request | None] = queue.Queue()
        self._idle = threading.Event()  # set only while nothing is admitted and unanswered
        self._idle.set()
        self._admit = threading.Lock()  # orders clearing ``_idle`` + enqueueing against the scheduler setting it
        self._closed = False
        self._trim = False  # requests were served since the heap was last trimmed
        self._thread: threading.Thread | None = None
        self._loop_done: Future | None = None
        if thread is None:
            self._thread = threading.Thread(target=self._loop, name="decoder", daemon=True)
            self._thread.start()
        else:  # the scheduler occupies the given worker for the engine's life (the thread that loaded the model)
            self._loop_done = thread.submit(self._loop)
            self._loop_done.add_done_callback(_log_failure)
            self._executor = thread

    # -- request checks (event loop thread, before queueing) ----------------------------------------
    @property
    def running(self) -> int:
        """Requests decoding now (``/health``; the rest of ``in_flight`` waits for a slot)."""
        return self.scheduler.decoding

    def full(self) -> bool:
        """Whether a new request would be refused (``max_batch`` decoding and ``max_queue`` waiting)."""
        return self.in_flight >= self.max_batch + self.max_queue

    def full_message(self) -> str:
        return (f"the queue is full ({self.max_queue} waiting + {self.max_batch} decoding); retry in "
                f"{self.retry_after_s()} s")

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait (the 503's ``Retry-After``): the median time of the last requests
        served (1 s before any) times the queue ahead per slot, at least 1."""
        recent = sorted(self._recent_s)
        typical = recent[len(recent) // 2] if recent else 1.0
        return max(1, math.ceil(typical * max(1, self.in_flight - self.max_batch + 1) / self.max_batch))

    def decode_config(self, n_prompt: int, max_tokens: int | None, temperature: float | None, seed: int | None) -> DecodeConfig:
        """The request's ``DecodeConfig``; ``max_tokens`` defaults to what fits the context.

        Raises:
            RequestError: for a prompt that leaves no room, ``max_tokens`` over the limit or beyond the context.
        """
        room = self.decoder.max_context - n_prompt
        if room < 1:
            raise RequestError(f"the prompt has {n_prompt} tokens; this model's context is {self.decoder.max_context} "
                               "tokens: shorten the prompt", param="messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room, self.max_tokens)
        if max_tokens > self.max_tokens:
            raise RequestError(f"max_tokens={max_tokens} is above this server's limit of {self.max_tokens} "
                               "(serve.max_tokens)", param="max_tokens")
        if max_tokens > room:
            raise RequestError(f"the prompt has {n_prompt} tokens and max_tokens={max_tokens}, beyond this model's "
                               f"context of {self.decoder.max_context} tokens: shorten the prompt or lower max_tokens",
                               param="max_tokens", code="context_length_exceeded")
        need = (n_prompt + max_tokens) * self.decoder.kv_bytes_per_token
        if self.kv_budget is not None and need > self.kv_budget:
            raise RequestError(f"the prompt ({n_prompt} tokens) and max_tokens={max_tokens} need {need / 2**20:.1f} MB "
                               f"of KV cache; this server holds at most {self.kv_budget / 2**20:.1f} MB for all requests "
                               "(serve.kv_cache_mb): lower max_tokens or shorten the prompt", param="max_tokens",
                               code="kv_cache_exceeded")
        temperature = self.default_temperature if temperature is None else float(temperature)
        return DecodeConfig(int(max_tokens), temperature, self.default_seed if seed is None else int(seed))

    def check_block_size(self, block_size: int | None) -> None:
        """Raise ``RequestError`` for a request's ``block_size`` the drafter cannot draft."""
        if block_size is None:
            return
        try:
            self.decoder.check_block_size(int(block_size))
        except ValueError as err:
            raise RequestError(str(err), param="block_size") from err

    def wants_record(self, job: Job) -> bool:
        """Whether the recorder labels ``job`` (its temperature is the run's); a request it does not is counted."""
        if self.recorder is None:
            return False
        if self.recorder.wants(job.config):
            return True
        self.recorder.skip()
        return False

    # -- the event loop's side ----------------------------------------------------------------------
    async def run(self, job: Job) -> Completion:
        """Admit ``job`` and wait for its completion (decoded by the scheduler thread).

        Raises:
            QueueFull: when ``max_batch + max_queue`` requests are in flight.
            JobCancelled: when ``job.cancelled`` was set before its decode started.
            Exception: whatever its decode raised (the server answers 500 and keeps serving).
        """
        if self.full():
            raise QueueFull(self.full_message())
        self.in_flight += 1
        self._jobs[id(job)] = job
        try:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            with self._admit:
                self._idle.clear()
                self._inbox.put(_Request(job, future, loop, self))
            try:
                completion = await asyncio.shield(future)
            except asyncio.CancelledError:
                job.cancelled.set()  # the caller went away: the scheduler frees the slot at the next step boundary
                raise
        except JobCancelled:
            self.aborted += 1
            raise
        except Exception:
            self.failed += 1
            raise
        finally:
            self.in_flight -= 1
            self._jobs.pop(id(job), None)
        if completion.finish_reason == "abort":
            self.aborted += 1
        self.served += 1
        return completion

    def cancel_all(self) -> int:
        """Set ``cancelled`` on every admitted job (shutdown): waiting ones are dropped, running ones end after the
        current step. Returns how many jobs were cancelled."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancelled.set()
        return len(jobs)

    # -- the scheduler thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            if not scheduler.busy:
                if self.watch is not None and self.watch.pending:  # a stale cost model: measured while none waits
                    self.watch.measure_pending(lambda: not self._inbox.empty())
                if self._trim:  # idle after a burst: the C heap's freed pages go back (resident memory between bursts)
                    self._trim = False
                    trim_heap()
                with self._admit:  # idle only when no request was enqueued: every later one clears it first
                    if self._inbox.empty():
                        self._idle.set()
                request = self._inbox.get()
                if request is None:
                    return
                scheduler.submit(request)
            while True:
                try:
                    request = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if request is None:
                    scheduler.fail_all(RuntimeError("the server is shutting down"))
                    return
                scheduler.submit(request)
            self._trim = True
            if scheduler.tick() and self.watch is not None:
                self.watch.step(self.batch.step_log[-1][0], self.batch.rows[-1])

    def _finish(self, request: _Request) -> None:
        """Answer a finished request (its listeners first: counters move before its client hears), then hand it to
        the recorder."""
        completion = request.completion()
        if self.listeners:
            req = request.request
            done = Finished(req.stats, completion.finish_reason, request.job.submitted, req.first_token_s,
                            req.finished_s, list(req.token_times))
            for listener in self.listeners:
                try:
                    listener(done)
                except Exception:  # noqa: BLE001 - a metrics failure must not fail the request
                    log.exception("a listener failed on request %s", request.job.request_id)
        request.settle(completion)
        self._recent_s.append(time.perf_counter() - request.job.submitted)
        if self.watch is not None and self.max_batch == 1:
            self.watch.request(request.request.stats)
        served = request.served()
        if served is not None:  # labelled on the recorder's own thread, after the answer
            self._recording.submit(self.recorder.record, served)
            request.kept = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait (at most ``timeout_s``) until every admitted request has been answered (and recorded, then flush the
        recorder)."""
        deadline = time.monotonic() + timeout_s
        while not self._idle.wait(timeout=0.05) or not self._inbox.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout_s} s")
        if self.recorder is not None:
            self._recording.submit(lambda: None).result(timeout=max(1.0, deadline - time.monotonic()))
            self.recorder.flush()

    def close(self) -> None:
        """Finish the admitted requests, flush the recorder and stop the scheduler (a second call does nothing)."""
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
                self._executor.shutdown(wait=True)
            if self._recording is not None:
                self._recording.shutdown(wait=True)


def _log_failure(done: Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("the engine's scheduler stopped", exc_info=done.exception())


def _settle(future: asyncio.Future, result, err) -> None:
    if future.done():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(result)
