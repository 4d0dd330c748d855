"""The serving engine: one decoder, one request at a time (batch 1), a bounded queue in front of it.

``Engine.run`` admits a request (``QueueFull`` when ``1 + max_queue`` requests are already in flight),
runs prefill, the policy's choice of B and the decode in the engine's single worker thread
(``SpeculativeDecoder.decode``, the same loop as ``pipeline.evaluate``), and returns a ``Completion``.
Streaming passes ``on_text``, called from the worker with each text delta (``pipeline.serving.text``).
With a ``Recorder``, the request's label row is computed in the same worker after the response is
returned, ahead of requests admitted later (``pipeline.serving.recorder``).

Policies (``serve.policy``): every method of ``pipeline.policy.registry`` the server can run, built by the same
code as the eval stage's (``build_policy``): ``fixed`` (``serve.block_size``, default the drafter's training B),
``ar`` (B=1), ``best_fixed`` (the run's labels), ``blockpilot`` / ``full_vocab`` (a trained predictor picks B once
from the prefill logits), ``ema`` (per-step adaptive B over ``model.candidates``), ``verify_width`` and ``hybrid``
(verify the k drafts that pay each step against this machine's measured costs; ``pipeline.policy.verify_width``),
and, with continuous batching only (``pipeline.serving.batch_engine``), ``budget`` (the widths of all requests sharing
a batched step chosen jointly; ``pipeline.policy.budget``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.decoding import DecodeConfig, FixedSchedule
from pipeline.decoding.schedules import FirstChoice
from pipeline.decoding.speculative import RequestStats, SpeculativeDecoder
from pipeline.policy.registry import SERVABLE
from pipeline.serving.recorder import Recorder, Served
from pipeline.serving.schemas import DecodeInfo, RequestError
from pipeline.serving.text import TextStream

log = logging.getLogger(__name__)

POLICIES = SERVABLE  # every method of pipeline.policy.registry the server can run


class QueueFull(RuntimeError):
    """Every slot (the running request + ``max_queue`` waiting) is taken; the caller answers 503."""


class JobCancelled(RuntimeError):
    """The job was cancelled (its client went away, or the server is shutting down) before its decode started."""


class Policy:
    """Builds a fresh block-size schedule per request.

    Args:
        name: one of ``POLICIES``; make: zero-argument schedule factory; budget: the batch-level policy choosing the
            verify widths of every batched step jointly (``budget``: a ``pipeline.policy.budget.BudgetPolicy``; only a
            ``BatchEngine`` runs it), else None.
    """

    def __init__(self, name: str, make: Callable[[], object], budget=None):
        self.name, self.make, self.budget = name, make, budget


def build_policy(name: str, decoder: SpeculativeDecoder, block_size: int | None = None, predictor_dir: str | None = None,
                 candidates=(), options: dict | None = None, inputs=None, run_hint: str = "") -> Policy:
    """The ``serve.policy`` schedule factory from ``pipeline.policy.registry`` (the same builder as the eval stage),
    checked against the decoder.

    Args:
        block_size: the fixed policy's B (None: the drafter's training B); verify_width drafts at it unless
            ``options["verify_width"]["block_size"]`` says otherwise.
        predictor_dir: the run's predictors folder (the method's ``options[m]["predictor"]`` sub-folder is read), or a
            predictor folder itself (blockpilot / full_vocab / hybrid, when ``inputs`` has none loaded).
        candidates: ``model.candidates`` (ema); options: ``{method: {option: value}}`` (the ``policy`` config group).
        inputs: ``PolicyInputs`` already loaded (labels + splits for best_fixed; calibration + latency for
            verify_width / hybrid; calibration + batch_costs for budget, whose ``Policy.budget`` is then set).
        run_hint: appended to a missing predictor's message (``pipeline.serve`` names run_name and ``make ... RUN=``).
    Raises:
        ValueError: for an unknown or unservable policy, missing inputs, a B the drafter cannot draft, or a predictor
            that does not fit.
        FileNotFoundError: for a predictor policy without a trained predictor at ``predictor_dir`` (names ``make train``).
    """
    from pipeline.policy import registry

    options = dict(options or {})
    inputs = inputs if inputs is not None else registry.PolicyInputs()
    method = registry.METHODS.get(name)
    wanted = method.predictor if method is not None and method.servable is None else None
    if wanted and wanted not in inputs.predictors:
        directory = registry.predictor_folder(predictor_dir, wanted, options) if predictor_dir else None
        if directory is None or not (directory / "predictor.json").is_file():
            raise FileNotFoundError(f"serve.policy={name} needs a trained predictor at {directory}: run make label, make dataset "
                                    f"and make train first (or serve.predictor_dir=...){run_hint}")
        inputs.predictors[wanted] = registry.load_method_predictor(wanted, directory, decoder, device=str(decoder.device))
    ctx = registry.Context(decoder, options, inputs, [int(c) for c in candidates], block_size, "serve.block_size",
                           str(options.get("target", "tau")), "serve")
    factory = registry.build(name, ctx)
    if isinstance(factory, registry.JointWidths):
        return Policy(name, factory.make, factory.policy)
    return Policy(name, factory)


@dataclass
class Job:
    """One request for the worker.

    Attributes:
        request_id: the response id; input_ids: [1, n] prompt ids; config: decode settings;
        stops: stop strings; block_size: a request's own fixed B (None: the policy);
        on_text: called from the worker thread with each text delta (streaming), or None;
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


def keep_for_recorder(prefill):
    """A shallow copy of ``prefill`` with a copy of its prompt cache: the decode consumes the cache, and the recorder
    replays from the prefill."""
    kept = copy.copy(prefill)
    kept.cache = copy.deepcopy(prefill.cache)
    return kept


def served_of(job: Job, kept, stats, halted: bool) -> Served:
    """The recorder's input for a finished ``job``: its kept prefill and its decode's ``RequestStats``."""
    return Served(job.request_id, kept, list(stats.output_ids), job.config, halted, list(stats.taus),
                  list(stats.block_sizes), stats.decode_ms)


class Engine:
    """Runs requests through one ``SpeculativeDecoder``, one at a time.

    Args:
        decoder: the decoder; policy: the configured ``Policy``; model_name: the id served at ``/v1/models``;
        max_queue: requests that may wait while one runs (more get ``QueueFull``);
        default_max_tokens: ``max_tokens`` of a request that sends none; max_tokens: the largest allowed;
        default_seed: the seed of a request that sends none; recorder: a ``Recorder`` or None;
        default_temperature: the temperature of a request that sends none (``decode.temperature``; OpenAI's is 1);
        executor: the single-worker executor that decodes and records (None: a new one). ``python -m pipeline.serve``
            passes the thread that loaded and warmed the model, so that one thread runs torch
            (``pipeline.serving.threads``).
    Raises:
        ValueError: for max_queue < 0, or a policy with a batch-level ``budget`` (only a ``BatchEngine`` runs it).
    """

    batched = False  # whether requests share decode steps (``BatchEngine``)

    def __init__(self, decoder: SpeculativeDecoder, policy: Policy, model_name: str, max_queue: int = 64,
                 default_max_tokens: int = 256, max_tokens: int = 4096, default_seed: int = 0,
                 recorder: Recorder | None = None, default_temperature: float = 0.0,
                 executor: ThreadPoolExecutor | None = None):
        if max_queue < 0:
            raise ValueError(f"serve.max_queue must be >= 0, got {max_queue}")
        if getattr(policy, "budget", None) is not None and not self.batched:
            raise ValueError(f"serve.policy={policy.name} chooses the verify widths of batched steps jointly; this engine "
                             "runs one request at a time: serve it with serve.max_batch=8 (BatchEngine)")
        self.decoder, self.policy, self.model_name = decoder, policy, model_name
        self.tokenizer = decoder.target.tokenizer
        self.max_queue, self.default_max_tokens, self.max_tokens = int(max_queue), int(default_max_tokens), int(max_tokens)
        self.default_seed, self.recorder = int(default_seed), recorder
        self.default_temperature = float(default_temperature)
        # the one worker thread that decodes (and records); serve passes the thread that loaded the model
        # (pipeline/serving/threads.py: one OpenMP team in the process)
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="decoder")
        self.in_flight = 0  # admitted and not finished; touched only on the event loop's thread
        self.served = 0
        self.failed = 0
        self.aborted = 0  # cancelled before or during the decode (client gone, shutdown)
        self._jobs: dict[int, Job] = {}  # admitted and not finished, by id(job)
        self._decoding = 0  # 1 while the worker decodes a job
        self._closed = False

    @property
    def running(self) -> int:
        """Requests decoding now (``/health``; the rest of ``in_flight`` waits)."""
        return self._decoding

    # -- request checks (event loop thread, before queueing) ----------------------------------------
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

    # -- running ------------------------------------------------------------------------------------
    async def run(self, job: Job) -> Completion:
        """Admit ``job``, decode it in the worker, then (with a recorder) queue its label row.

        A job whose ``cancelled`` is set while it waits is dropped when its turn comes (``JobCancelled``); one cancelled
        during its decode ends after the current step with ``finish_reason`` ``abort``.

        Raises:
            QueueFull: when ``1 + max_queue`` requests are in flight.
            JobCancelled: when ``job.cancelled`` was set before its decode started.
            Exception: whatever the decode raised (the server answers 500 and keeps serving).
        """
        if self.in_flight >= 1 + self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting + 1 running); retry later")
        with self._admitted(job):
            completion, served = await asyncio.get_running_loop().run_in_executor(self.executor, self._generate, job)
        self._answered(completion)
        if served is not None:
            self.executor.submit(self.recorder.record, served)
        return completion

    def _generate(self, job: Job) -> tuple[Completion, Served | None]:
        """Worker thread: prefill, choose B, decode; returns the completion and the recorder's input.

        Raises:
            JobCancelled: when the job was cancelled while it waited.
        """
        if job.cancelled.is_set():
            raise JobCancelled(f"request {job.request_id} was cancelled before its decode started")
        self._decoding = 1
        try:
            return self._decode_job(job)
        finally:
            self._decoding = 0

    def _decode_job(self, job: Job) -> tuple[Completion, Served | None]:
        """``_generate``'s decode of an admitted job (worker thread)."""
        queue_ms = (time.perf_counter() - job.submitted) * 1e3
        decoder = self.decoder
        if job.block_size is not None:
            policy, schedule = "request", FixedSchedule(int(job.block_size))
        else:
            policy, schedule = self.policy.name, self.policy.make()
        schedule = FirstChoice(schedule)
        record = self._wants_record(job)
        prefill = decoder.prefill(job.input_ids, job.config, want_features=schedule.max_block_size > 1 or record)
        kept = keep_for_recorder(prefill) if record else None
        stream = TextStream(self.tokenizer, job.stops)

        def on_tokens(ids: list[int]) -> bool:
            delta = stream.push(ids)
            if delta and job.on_text is not None:
                job.on_text(delta)
            return stream.stopped or job.cancelled.is_set()

        stats = decoder.decode(prefill, schedule, job.config, on_tokens)
        tail = stream.finish()
        if tail and job.on_text is not None:
            job.on_text(tail)
        halted = stream.stopped or job.cancelled.is_set()
        if job.cancelled.is_set() and not stream.stopped:
            reason = "abort"
        elif stream.stopped or stats.stopped:
            reason = "stop"
        else:
            reason = "length"
        info = DecodeInfo.of(stats, policy, schedule.chosen, queue_ms)
        completion = Completion(stream.text, reason, list(stats.output_ids), stats, info)
        served = served_of(job, kept, stats, halted) if kept is not None else None
        return completion, served

    def _wants_record(self, job: Job) -> bool:
        """Whether the recorder labels ``job`` (its temperature is the run's); a request it does not is counted."""
        if self.recorder is None:
            return False
        if self.recorder.wants(job.config):
            return True
        self.recorder.skip()
        return False

    @contextlib.contextmanager
    def _admitted(self, job: Job):
        """One admitted job's bookkeeping (event loop thread): in flight and cancellable (``cancel_all``) while inside;
        counted as aborted (``JobCancelled``) or failed (any other exception) when it raises out."""
        self.in_flight += 1
        self._jobs[id(job)] = job
        try:
            yield
        except JobCancelled:
            self.aborted += 1
            raise
        except Exception:
            self.failed += 1
            raise
        finally:
            self.in_flight -= 1
            self._jobs.pop(id(job), None)

    def _answered(self, completion: Completion) -> None:
        """Count a finished job (an ``abort`` finish also as aborted)."""
        if completion.finish_reason == "abort":
            self.aborted += 1
        self.served += 1

    def cancel_all(self) -> int:
        """Set ``cancelled`` on every admitted job (shutdown): waiting ones are dropped, the running one ends after its
        current step. Returns how many jobs were cancelled."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancelled.set()
        return len(jobs)

    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait (at most ``timeout_s``) for the worker's queued jobs, recordings included, then flush the recorder."""
        self.executor.submit(lambda: None).result(timeout=timeout_s)
        if self.recorder is not None:
            self.recorder.flush()

    def close(self) -> None:
        """Finish queued work, flush the recorder and stop the worker (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self.executor.shutdown(wait=True)
