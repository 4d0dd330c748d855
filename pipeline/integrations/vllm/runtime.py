"""The policy's hooks on vLLM 0.32's model runner (worker process), installed at run time; vLLM's source is not edited.

``install`` (called by ``BlockPilotDFlashQwen3ForCausalLM``'s constructor, so only in a process that builds our
drafter) checks vLLM's version and wraps five methods of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (the V1
runner; the CPU runner ``CPUModelRunner`` inherits them):

* ``execute_model`` (gpu_model_runner.py:3940) and ``sample_tokens`` (:4304): time each decode step (the target's
  forward, sampling and rejection, the drafter, bookkeeping) for the learned step costs (``StepCosts``);
* ``propose_draft_token_ids`` (:4748, called from ``sample_tokens`` at :4365 after the step's sampling): before the
  drafter runs, read how many of each request's verified drafts were accepted (the rejection sampler's output,
  -1 after a rejection) for the policy's drafted yield (``StepPolicy.observe``) and the label log, and let the
  policy decide whether the drafter drafts at all (``StepPolicy.plan``; K = 0 goes to the drafter as the scheduler's
  ``num_spec_tokens_to_schedule``, the per-step K vLLM's dynamic speculative decoding also uses: ``DFlashProposer``
  then feeds the step's context to its cache and drafts nothing, llm_base_proposer.py:606-614); after it, choose
  every request's verify width (``StepPolicy.widths``) from the drafter's probabilities
  (``BlockPilotDFlashQwen3ForCausalLM.confidence``);
* ``take_draft_token_ids`` (:4627, called by the engine after each step, v1/engine/core.py:694): cut each request's
  draft list to its width. The scheduler verifies exactly ``len(request.spec_token_ids)`` drafts of each request
  (v1/core/sched/scheduler.py:861-876), so a cut request verifies fewer rows next step; verification stays vLLM's
  (greedy: the text is the target's own, whatever the widths);
* ``shutdown`` (:6238): save the learned step costs before the runner lets go of its models. vLLM stops its workers by
  signal: a worker process (``MultiprocExecutor``, the CPU default, forked) turns SIGTERM into SystemExit and calls
  ``Worker.shutdown`` -> ``model_runner.shutdown`` on its way out (v1/executor/multiproc_executor.py:871-985,
  gpu_worker.py:1606), then leaves by ``os._exit``, so ``atexit`` never runs there; an in-process runner
  (``UniProcExecutor``) gets the same call from ``EngineCore.shutdown`` (v1/engine/core.py:2211).

and one method of ``vllm.v1.spec_decode.dflash.DFlashProposer``: ``propose`` (``SpecDecodeBaseProposer.propose``,
llm_base_proposer.py:512) with K = 0 runs only what keeps the drafter's cache complete, the projection of the step's
context into the drafter's keys/values (``set_inputs_first_pass``, dflash.py:113, and
``precompute_and_store_context_kv``, as ``build_model_inputs_first_pass`` does at dflash.py:262-268), not the forward
of the block's query rows, whose keys/values the next step's context overwrites and whose outputs a K = 0 step
discards (llm_base_proposer.py:606-614). A step without drafts then costs the target's step and that projection.

One ``Controller`` per runner holds the policy, the learned costs and the label log. The costs are saved to
``<cache>/step-costs-<key>.json`` when the worker stops: at the runner's ``shutdown``, on SIGTERM / SIGINT (a handler
chained before the one the process had: vLLM's worker raises SystemExit there, a plain process ends as it would have)
and at interpreter exit (``atexit``); while serving, also every ``SAVE_EVERY`` samples or
``BLOCKPILOT_VLLM_SAVE_EVERY_S`` seconds (default 5; 0: only at stop), for a worker killed outright.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import signal
import time

import torch

from pipeline.costs import store
from pipeline.integrations.vllm.costs import StepCosts, cache_key
from pipeline.integrations.vllm.labels import LabelLog, step_row
from pipeline.integrations.vllm.policy import StepPolicy
from pipeline.peers.vllm_settings import Settings, check_vllm_version, speculates

log = logging.getLogger("vllm.blockpilot")

GAP_LIMIT_S = 0.25  # a longer pause between two steps is an idle engine, not the engine's per-step overhead
SAVE_EVERY = 256  # step-cost samples between two saves of the cache while serving (or settings.save_every_s seconds)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the signals that stop a vLLM worker: the costs are saved first
SUMMARY_EVERY_S = 10.0  # seconds between two log lines of the policy's choices (while it serves)
_installed = False


def install() -> None:
    """Wrap ``GPUModelRunner``'s four methods (see the module docstring); idempotent.

    Raises:
        RuntimeError: for a vLLM outside the series the wraps were written for.
    """
    global _installed
    if _installed:
        return
    import vllm
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    check_vllm_version(vllm.__version__)
    execute_model, sample_tokens = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    propose, take = GPUModelRunner.propose_draft_token_ids, GPUModelRunner.take_draft_token_ids
    shutdown = GPUModelRunner.shutdown

    @functools.wraps(execute_model)
    def timed_execute_model(self, scheduler_output, *args, **kwargs):
        controller = _controller(self)
        if controller is not None:
            controller.step_started(scheduler_output)
        return execute_model(self, scheduler_output, *args, **kwargs)

    @functools.wraps(sample_tokens)
    def timed_sample_tokens(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        controller = _controller(self)
        if controller is not None:
            controller.step_ended()
        return out

    @functools.wraps(propose)
    def planned_propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                        slot_mappings):
        controller = _controller(self)
        args = (sampling_metadata, hidden_states, sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                common_attn_metadata, slot_mappings)
        if controller is None:
            return propose(self, scheduler_output, sampled_token_ids, *args)
        return controller.propose(lambda output: propose(self, output, sampled_token_ids, *args), scheduler_output,
                                  sampled_token_ids, spec_decode_metadata)

    @functools.wraps(take)
    def cut_take(self):
        out = take(self)
        controller = _controller(self)
        if controller is None or out is None:
            return out
        return DraftTokenIds(out.req_ids, controller.cut(out.req_ids, out.draft_token_ids))

    @functools.wraps(shutdown)
    def saving_shutdown(self, *args, **kwargs):
        controller = self.__dict__.get("_blockpilot")  # the runner's own, if it served (none is built now)
        if controller is not None:
            controller.stop("the worker shuts down")
        return shutdown(self, *args, **kwargs)

    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = timed_execute_model, timed_sample_tokens
    GPUModelRunner.propose_draft_token_ids, GPUModelRunner.take_draft_token_ids = planned_propose, cut_take
    GPUModelRunner.shutdown = saving_shutdown
    _install_context_only_proposer()
    _installed = True
    log.info("BlockPilot: hooks installed on GPUModelRunner (vLLM %s)", vllm.__version__)


def is_ours(model) -> bool:
    """Whether ``model`` is BlockPilot's drafter class inside vLLM (``model.BlockPilotDFlashQwen3ForCausalLM``, which
    sets ``BLOCKPILOT_DRAFTER``; checked by attribute: that module imports this one)."""
    return bool(getattr(type(model), "BLOCKPILOT_DRAFTER", False))


def _install_context_only_proposer() -> None:
    """Wrap ``DFlashProposer.propose``: with K = 0 and our drafter, only the context's keys/values (module docstring)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    propose = DFlashProposer.propose

    @functools.wraps(propose)
    def context_only_when_idle(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                               next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                               mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        if num_speculative_tokens != 0 or not is_ours(self.model) or mm_embed_inputs is not None:
            return propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                           next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                           mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings)
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        self.set_inputs_first_pass(target_token_ids=target_token_ids, next_token_ids=next_token_ids,
                                   target_positions=target_positions,
                                   target_hidden_states=self.model.combine_hidden_states(target_hidden_states),
                                   token_indices_to_sample=token_indices_to_sample, cad=common_attn_metadata,
                                   num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        n = self._dflash_num_context
        self.model.precompute_and_store_context_kv(self._dflash_hidden_states, self._context_positions_buffer[:n],
                                                   self._context_slot_mapping_buffer[:n])
        return torch.empty(batch_size, 0, device=target_hidden_states.device, dtype=torch.int64)

    DFlashProposer.propose = context_only_when_idle


def calibration_of(settings: Settings, drafter_dir: str):
    """The policy's ``AcceptanceCalibration``: ``BLOCKPILOT_VLLM_CALIBRATION``, else the drafter folder's
    ``calibration.json``; None for ``fixed`` (and ``off``), which choose no widths.

    Raises:
        FileNotFoundError: when there is none (names the variable and the refit); ValueError: for another kind of file.
    """
    if settings.policy in ("off", "fixed"):
        return None
    from pipeline.policy.calibration import load_calibration

    try:
        return load_calibration(settings.calibration or drafter_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"BlockPilot's {settings.policy} policy needs an acceptance calibration: {err}. In vLLM: "
                                "set BLOCKPILOT_VLLM_CALIBRATION to a calibration.json (make vllm-refit fits one from "
                                "the plugin's label logs), or use BLOCKPILOT_VLLM_POLICY=fixed") from None


def accepted_drafts(sampled, num_draft_tokens, n: int) -> list[int | None]:
    """How many of each of the step's n requests' verified drafts were accepted (None where it verified none), from
    the rejection sampler's output (a [n, K + 1] tensor with -1 after a rejection, or lists of the kept tokens: the
    accepted drafts and the bonus token)."""
    if torch.is_tensor(sampled):
        kept = (sampled != -1).sum(-1).tolist()
    else:
        kept = [len(s) for s in sampled]
    out: list[int | None] = []
    for i in range(n):
        k = int(num_draft_tokens[i]) if i < len(num_draft_tokens) else 0
        out.append(max(0, min(k, kept[i] - 1)) if k > 0 and i < len(kept) else None)
    return out


def save_on_stop_signals(controller, signals=STOP_SIGNALS) -> bool:
    """Make SIGTERM and SIGINT first save ``controller``'s step costs (``controller.stop``), then do what the handler
    installed before did: call it (vLLM's worker handler raises SystemExit and shuts the worker down; Python's SIGINT
    handler raises KeyboardInterrupt), or, for the default action, end the process by the signal as it would have;
    an ignored signal stays ignored. Returns False where handlers cannot be set (not the main thread)."""
    try:
        for signum in signals:
            signal.signal(signum, functools.partial(_stop_then_chain, controller, signal.getsignal(signum)))
    except ValueError:  # signal handlers are the main thread's
        return False
    return True


def _stop_then_chain(controller, previous, signum, frame) -> None:
    controller.stop(f"signal {signal.Signals(signum).name}")
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _controller(runner) -> "Controller | None":
    """The runner's ``Controller``, built on first use; None when the runner does not serve our drafter."""
    controller = runner.__dict__.get("_blockpilot")
    if controller is None and "_blockpilot" not in runner.__dict__:
        drafter = getattr(getattr(runner, "drafter", None), "model", None)
        ok = is_ours(drafter) and Settings.from_env().active
        controller = Controller(runner, drafter, Settings.from_env()) if ok else None
        runner.__dict__["_blockpilot"] = controller
    return controller


class Controller:
    """The policy of one runner: its decisions, the step timings and the label rows (see the module docstring).

    Args:
        runner: vLLM's ``GPUModelRunner``; drafter: its ``BlockPilotDFlashQwen3ForCausalLM``; settings: the plugin's.
    Raises:
        FileNotFoundError / ValueError: for a missing or malformed calibration (policies but ``fixed``).
    """

    def __init__(self, runner, drafter, settings: Settings):
        import vllm

        self.runner, self.drafter, self.settings = runner, drafter, settings
        spec = runner.speculative_config
        self.num_spec = int(spec.num_speculative_tokens)
        drafter_dir = str(spec.model)
        calibration = calibration_of(settings, drafter_dir)
        key = cache_key(vllm=vllm.__version__, target=runner.model_config.model, drafter=drafter_dir,
                        dtype=runner.model_config.dtype, k=self.num_spec, eager=runner.model_config.enforce_eager)
        self.cache_dir, self.cache_key = settings.cache_dir or store.default_dir(), key
        self.cache_file = store.path_of(self.cache_dir, key)
        self.costs = StepCosts.stored(self.cache_dir, key)
        self.policy = StepPolicy(settings.policy, calibration, self.costs, self.num_spec, settings.margin,
                                 settings.max_skip, settings.explore)
        self.labels = LabelLog(settings.labels) if settings.labels else None
        drafter.record_confidence = settings.policy != "fixed" or self.labels is not None
        self._speculate: dict[str, bool] = {}
        self._widths: dict[str, int] = {}
        self._pending: dict[str, list[float]] = {}  # the drafter's probabilities of each request's drafts
        self._step = 0
        self._t0 = self._last_end = None
        self._last_n = 0
        self._timing: dict | None = None
        self._summary_t, self._summary = time.monotonic(), {}
        self._saved_t = time.perf_counter()
        atexit.register(self.stop, "exit")
        save_on_stop_signals(self)
        log.info("BlockPilot: policy %s, K=%d, calibration %s, step costs %s (%d samples), labels %s",
                 settings.policy, self.num_spec, settings.calibration or f"{drafter_dir}/calibration.json",
                 self.cache_file, sum(len(s) for t in self.costs.tables.values() for s in t.values()),
                 settings.labels or "off")

    # ------------------------------------------------------------------------------------------------
    def speculates(self, req_id: str) -> bool:
        """Whether request ``req_id`` may speculate (its ``extra_args``; a malformed value is logged and ignored)."""
        if req_id not in self._speculate:
            state = self.runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            try:
                self._speculate[req_id] = speculates(getattr(params, "extra_args", None))
            except ValueError as err:
                log.warning("BlockPilot: request %s: %s; it speculates", req_id, err)
                self._speculate[req_id] = True
        return self._speculate[req_id]

    def step_started(self, scheduler_output) -> None:
        """Start timing a step; a decode-only step (no prompt tokens in it) will be recorded."""
        now = time.perf_counter()
        if self._last_end is not None and now - self._last_end < GAP_LIMIT_S and self._last_n:
            self.costs.add("overhead", self._last_n, (now - self._last_end) * 1e3)
        scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        decode_only = bool(scheduled) and not scheduler_output.scheduled_new_reqs and all(
            count == 1 + len(spec.get(r, ())) for r, count in scheduled.items())
        self._t0 = now
        self._timing = {"tokens": int(scheduler_output.total_num_scheduled_tokens), "requests": len(scheduled),
                        "decode_only": decode_only, "draft_ms": None, "drafted": False}

    def step_ended(self) -> None:
        """Record the step's costs (decode-only steps whose drafter ran)."""
        now = time.perf_counter()
        timing, self._timing = self._timing, None
        if timing is not None and self._t0 is not None:
            self._last_end, self._last_n = now, timing["requests"]
            if timing["decode_only"] and timing["draft_ms"] is not None:
                step_ms = (now - self._t0) * 1e3
                self.costs.add("verify", timing["tokens"], max(0.0, step_ms - timing["draft_ms"]))
                self.costs.add("draft" if timing["drafted"] else "idle", timing["requests"], timing["draft_ms"])
                every_s = self.settings.save_every_s  # 0: saved only when the worker stops
                due = self.costs.added >= SAVE_EVERY or (self.costs.added and now - self._saved_t >= every_s)
                if every_s > 0 and due:
                    self.save()

    def propose(self, run, scheduler_output, sampled_token_ids, spec_decode_metadata):
        """The drafter's run for the next step, planned by the policy (see the module docstring); returns its drafts."""
        self._step += 1
        req_ids = list(self.runner.input_batch.req_ids)
        if spec_decode_metadata is not None:
            accepted = accepted_drafts(sampled_token_ids, spec_decode_metadata.num_draft_tokens, len(req_ids))
            if self.policy.kind != "fixed":
                self.policy.observe(req_ids, accepted)
            if self.labels is not None:
                self._write_labels(req_ids, spec_decode_metadata.num_draft_tokens, accepted)
        flags = [self.speculates(r) for r in req_ids]
        live = set(req_ids)
        for gone in [r for r in self._speculate if r not in live]:
            del self._speculate[gone]
        k = min(self.policy.plan(req_ids, flags), int(scheduler_output.num_spec_tokens_to_schedule))
        if k != scheduler_output.num_spec_tokens_to_schedule:
            scheduler_output = dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=k)
        self.drafter.confidence = None
        t0 = time.perf_counter()
        drafts = run(scheduler_output)
        draft_ms = (time.perf_counter() - t0) * 1e3
        if self._timing is not None:
            self._timing.update(draft_ms=draft_ms, drafted=k > 0)
        confidence = None
        if k > 0 and self.drafter.confidence is not None and self.drafter.confidence.numel() == len(req_ids) * k:
            confidence = self.drafter.confidence.reshape(len(req_ids), k).cpu()
        if k == 0:
            widths = [0] * len(req_ids)
        elif confidence is None or self.policy.kind == "fixed":
            widths = [k if f else 0 for f in flags]  # every draft (no probabilities to choose by: vLLM's own widths)
        else:
            widths = self.policy.widths(req_ids, flags, confidence)
        self._widths = dict(zip(req_ids, widths))
        self.policy.decisions["verified"] += sum(widths)
        self.policy.decisions["drafts"] += k * len(req_ids)
        self._pending = {r: confidence[i].tolist() for i, r in enumerate(req_ids)} if confidence is not None else {}
        now = time.monotonic()
        if now - self._summary_t >= SUMMARY_EVERY_S:
            counts = {k: v - self._summary.get(k, 0) for k, v in self.policy.decisions.items()}
            log.info("BlockPilot: last %.0f s: %d steps, %d drafted (%d probes, %d exploring), %d of %d drafts verified, "
                     "drafted yield %.2f", now - self._summary_t, counts["steps"], counts["drafted"], counts["probes"],
                     counts["explored"], counts["verified"], counts["drafts"], self.policy.drafted_yield)
            self._summary_t, self._summary = now, dict(self.policy.decisions)
        return drafts

    def cut(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """Each request's drafts cut to the width chosen this step (unchanged where none was chosen)."""
        widths, self._widths = self._widths, {}
        return [list(d[: widths[r]]) if r in widths else d for r, d in zip(req_ids, drafts)]

    def _write_labels(self, req_ids: list[str], num_draft_tokens, accepted: list[int | None]) -> None:
        """Label rows of the drafts this step verified (their probabilities were recorded last step)."""
        rows = []
        for i, (r, a) in enumerate(zip(req_ids, accepted)):
            confidence = self._pending.get(r)
            k = int(num_draft_tokens[i]) if i < len(num_draft_tokens) else 0
            if a is not None and confidence is not None and 0 < k <= len(confidence):
                row = step_row(r, self._step, self.num_spec + 1, confidence, k, a)
                if row is not None:
                    rows.append(row)
        self.labels.write(rows)

    def save(self) -> bool:
        """Write the learned step costs to the cache unless the file already holds them (nothing learned since the last
        save); errors are logged (the server keeps running). Returns whether it wrote."""
        self._saved_t = time.perf_counter()
        if not self.costs.added and self.cache_file.exists():
            return False
        try:
            self.costs.store(self.cache_dir, self.cache_key)
        except OSError as err:
            log.warning("BlockPilot: could not write the step costs to %s: %s", self.cache_file, err)
            return False
        return True

    def stop(self, why: str) -> None:
        """Save the learned step costs as the worker stops (``why``: the runner's shutdown, a signal, exit)."""
        new = self.costs.added
        if self.save():
            log.info("BlockPilot: step costs saved to %s at stop (%s; %d new samples)", self.cache_file, why, new)
