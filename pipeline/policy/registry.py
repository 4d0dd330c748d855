"""Every decoding method (policy) declared once: what it needs and how it builds a per-request schedule.

The eval stage, the server and ``pipeline.bench_batch`` build their schedules here (through ``pipeline.policy.setup``), from the same options (the ``policy`` config group, ``conf/policy/default.yaml``: ``policy.<method>.*``
in ``conf/evaluate.yaml`` and ``conf/serve.yaml`` alike) and the same loaded inputs (``PolicyInputs``).

Methods (``METHODS``):
  * ``ar`` (B=1); ``fixed`` (the configured B, default the drafter's training block size: ``default_block_size``);
  * ``ema``: ``EMASchedule`` over ``model.candidates`` (per-step adaptive baseline; ``policy.ema``);
  * ``best_fixed``: the candidate with the best mean label over the train split's requests (labels + splits);
  * ``oracle``: each request's own label B (labels; needs the request, so eval only);
  * ``blockpilot`` / ``full_vocab``: a trained predictor picks B once from the prefill logits (``policy.<m>.predictor``:
    the sub-folder of the run's predictors);
  * ``verify_width``: drafts at B, verifies the k drafts that pay each step (a calibration + this machine's cost model;
    ``policy.verify_width``); ``hybrid``: the same with blockpilot's B;
  * ``tree``: drafts at verify_width's B and verifies a draft tree of the drafter's top candidates, sized each step by
    the same calibration and cost model (``pipeline.policy.trees``; ``policy.tree``); the eval stage runs it;
  * ``budget``: every batched step's verify widths chosen jointly over the requests sharing it
    (``pipeline.policy.budget.BudgetPolicy``: verify_width's calibration, B and skip rule + the batched step cost model,
    ``policy.budget.costs``); only a batched decoder runs it: the server (any ``serve.max_batch``; the eval stage decodes
    one request at a time; ``pipeline.bench_batch`` benchmarks it);
  * ``hf_generate`` / ``hf_prompt_lookup``: transformers' own ``generate`` on the same target (greedy at T=0, sampled
    above), plain or with prompt-lookup decoding (``pipeline.policy.baselines``; eval only: the server streams from the
    speculative decoder);
  * ``vllm_ar`` / ``vllm_dflash`` / ``vllm_verify_width``: vLLM's OpenAI server on the same target and drafter (no
    speculation; its own DFlash verifying K = B - 1 drafts every step; DFlash with our plugin's ``per_request``
    widths, ``pipeline.integrations.vllm``: not this table's ``verify_width``, see ``pipeline.policy.core``), each
    request sent as the same prompt ids (``pipeline.policy.baselines``; eval only, needs ``make vllm``; options
    ``policy.vllm_*``).

A factory is a zero-argument callable returning a fresh schedule, a ``PerPrompt`` (it needs the request), or a
``JointWidths`` (a schedule per request plus the batch-level policy that chooses their widths together).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

log = logging.getLogger(__name__)

LABELS, SPLITS, PREDICTOR, CALIBRATION, COSTS, REQUEST = "labels", "splits", "predictor", "calibration", "costs", "request"
BATCH_COSTS = "batch_costs"
VLLM = "vllm"  # vLLM's environment (.venv-vllm, make vllm)
BATCHED_ONLY = ("it chooses the verify widths of every batched step jointly, and the eval stage decodes one request at a "
                "time: benchmark it with python -m pipeline.bench_batch 'bench.methods=[ar,verify_width,budget]', serve it "
                "with serve.policy=budget serve.max_batch=8")


class PerPrompt:
    """A schedule factory that needs the request (e.g. the oracle): ``fn(prompt, turn) -> schedule``."""

    def __init__(self, fn: Callable[[object, int], object]):
        self.fn = fn

    def bind(self, prompt) -> Callable[[], object]:
        """A zero-argument factory for ``decode_prompt``: its k-th call builds the schedule of turn k (0-based)."""
        turn = iter(range(len(prompt.turns)))
        return lambda: self.fn(prompt, next(turn))


class JointWidths:
    """The factory of a method whose requests' verify widths one batch-level policy chooses together (``budget``).

    Called, it returns a fresh per-request schedule (the B each request drafts); ``policy`` is the
    ``pipeline.decoding.batched.BatchPolicy`` the ``BatchedDecoder`` consults at every admission and step (a
    ``BudgetPolicy``). Only a batched decoder runs it (the server, ``pipeline.bench_batch``).
    """

    def __init__(self, make: Callable[[], object], policy):
        self.make, self.policy = make, policy

    def __call__(self):
        return self.make()


@dataclass
class PolicyInputs:
    """What the label-based, predictor and verify-width methods need (each None/empty when not needed).

    Attributes:
        labels: label rows (``pipeline.labeling.store.read_label_table``); label_meta: its ``meta.json``;
        splits: ``{split: prompt ids}`` from the feature DatasetDict; predictors: ``{method: Predictor}``;
        calibration / calibration_path / latency: the verify-width policy's acceptance calibration (and where it was
        read) and this machine's ``CostModel`` (step costs by width and context, ms);
        batch_costs: this machine's ``BatchCostModel`` (a batched step's cost, ms; ``budget``).
    """

    labels: object = None
    label_meta: dict = field(default_factory=dict)
    splits: dict[str, list[str]] | None = None
    predictors: dict = field(default_factory=dict)
    calibration: object = None
    calibration_path: str | None = None
    latency: object = None
    batch_costs: object = None

    @property
    def candidates(self) -> list[int] | None:
        return [int(b) for b in self.labels["candidates"].iloc[0]] if self.labels is not None and len(self.labels) else None


@dataclass
class Context:
    """Everything a method's builder reads.

    Args:
        decoder: the ``SpeculativeDecoder`` (its drafter's limits are checked here).
        options: ``{method: {option: value}}`` (the ``policy`` config group).
        inputs: the loaded ``PolicyInputs``.
        candidates: ``model.candidates`` (``ema``).
        block_size: the configured fixed B (``decode.block_size`` / ``serve.block_size``; None: the training B).
        block_size_key: that setting's name, for messages.
        target: ``tau`` or ``speed``: which label ``oracle`` / ``best_fixed`` read.
        where: ``eval``, ``serve`` or ``bench`` (what it may run, messages).
    """

    decoder: object
    options: Mapping = field(default_factory=dict)
    inputs: PolicyInputs = field(default_factory=PolicyInputs)
    candidates: list[int] = field(default_factory=list)
    block_size: int | None = None
    block_size_key: str = "decode.block_size"
    target: str = "tau"
    where: str = "eval"

    def option(self, method: str, key: str, default=None):
        """``options[method][key]``, or ``default`` when unset or null."""
        value = (self.options.get(method) or {}).get(key)
        return default if value is None else value

    @property
    def fixed_block_size(self) -> int:
        """The checked B of ``fixed``; raises ValueError naming ``block_size_key``."""
        b = default_block_size(self.decoder, self.block_size)
        try:
            self.decoder.check_block_size(b)
        except ValueError as err:
            raise ValueError(f"{self.block_size_key}={self.block_size}: {err}") from err
        return b


def batch_policy(factory):
    """The ``BatchPolicy`` a batched decoder runs a method's requests under: a ``JointWidths``' own, else the base
    policy (each request's schedule decides)."""
    from pipeline.decoding.schedules import BatchPolicy

    return factory.policy if isinstance(factory, JointWidths) else BatchPolicy()


def default_block_size(decoder, block_size: int | None = None) -> int:
    """B when none is configured: ``block_size`` when given, else the drafter's training block size (1 without a drafter)."""
    if block_size is not None:
        return int(block_size)
    return int(decoder.drafter.block_size) if decoder.drafter is not None else 1


def verify_width_block_size(options: Mapping, decoder, block_size: int | None = None) -> int:
    """B drafted by ``verify_width``: ``policy.verify_width.block_size``, else the fixed B (``block_size``, else the
    drafter's training block size: ``default_block_size``)."""
    return int((options.get("verify_width") or {}).get("block_size") or default_block_size(decoder, block_size))


def check_predictor(predictor, decoder, directory) -> None:
    """Raise ``ValueError`` when a predictor does not fit the decoder: its vocabulary, or the drafter's block-size limit."""
    vocab = decoder.lm_head.shape[0]
    spec_vocab = predictor.featurizer.spec.vocab_size
    if spec_vocab and spec_vocab != vocab:
        raise ValueError(f"predictor {directory} was trained on a vocabulary of {spec_vocab}, the target has {vocab}: "
                         "train it on labels of this target")
    limit = decoder.drafter.max_block_size if decoder.drafter is not None else 1
    if max(predictor.candidates) > limit:
        raise ValueError(f"predictor {directory} picks block sizes up to {max(predictor.candidates)}, beyond the drafter's "
                         f"limit {limit}; use a predictor trained for this drafter")


def best_fixed_block_size(inputs: PolicyInputs, target: str = "tau") -> int:
    """The candidate B with the best mean tau (``target=tau``) or tokens/s (``speed``) over the train split's labels.

    Raises:
        ValueError: when no train-split prompt has a label.
    """
    column = "tau" if target == "tau" else "tokens_per_s"
    train = set(inputs.splits["train"])
    rows = inputs.labels[inputs.labels["id"].isin(train)]
    if rows.empty:
        raise ValueError("no train-split prompt has a label: rebuild the dataset (make dataset) from these labels")
    mean = np.stack(rows[column].map(np.asarray).to_list()).astype(float).mean(0)
    return inputs.candidates[int(np.argmax(mean))]  # first maximum: the smaller B on ties


# -- the builders ------------------------------------------------------------------------------------------
def _ar(ctx: Context):
    from pipeline.decoding import FixedSchedule

    return lambda: FixedSchedule(1)


def _fixed(ctx: Context):
    from pipeline.decoding import FixedSchedule

    b = ctx.fixed_block_size
    return lambda: FixedSchedule(b)


def _ema(ctx: Context):
    from pipeline.decoding import EMASchedule

    cands = [int(c) for c in ctx.candidates]
    EMASchedule(cands)  # raises for an empty list
    ctx.decoder.check_block_size(max(cands))
    alpha, margin, start = ctx.option("ema", "alpha", 0.5), ctx.option("ema", "margin", 1.0), ctx.option("ema", "start")
    return lambda: EMASchedule(cands, alpha, margin, start)


def _best_fixed(ctx: Context):
    from pipeline.decoding import FixedSchedule

    b = best_fixed_block_size(ctx.inputs, ctx.target)
    ctx.decoder.check_block_size(b)
    return lambda: FixedSchedule(b)


def _oracle(ctx: Context):
    from pipeline.decoding import FixedSchedule
    from pipeline.prompts import request_id

    labels = ctx.inputs.labels
    column = "label_tau" if ctx.target == "tau" else "label_speed"
    label_of = dict(zip(labels["id"].astype(str), labels[column].astype(int)))

    def oracle(prompt, turn: int):
        if prompt.id not in label_of:
            raise ValueError(f"prompt {prompt.id!r} has no label; label it (make label) or evaluate the dataset's split "
                             "(eval.split=test)")
        rid = request_id(prompt.id, turn)
        if rid not in label_of:  # labels made with label.turns=first: the first turn's label for every turn
            log.warning("no label for request %r (labels of first turns only?); the oracle uses %r's", rid, prompt.id)
            rid = prompt.id
        return FixedSchedule(label_of[rid])

    return PerPrompt(oracle)


def _predictor(method: str):
    def build(ctx: Context):
        from pipeline.policy.schedule import PredictorSchedule

        predictor = ctx.inputs.predictors[method]
        ctx.decoder.check_block_size(max(predictor.candidates))
        return lambda: PredictorSchedule(predictor)

    return build


def _drafted_block_size(ctx: Context) -> int:
    """The checked B that ``verify_width``, ``hybrid``, ``tree`` and ``budget`` draft."""
    ctx.fixed_block_size  # a configured fixed B the drafter cannot draft fails here, named
    b = verify_width_block_size(ctx.options, ctx.decoder, ctx.block_size)
    ctx.decoder.check_block_size(b)
    return b


def _step_options(ctx: Context) -> dict:
    """``policy.verify_width``'s per-step options, shared by every method that chooses what each step verifies."""
    return {"skip_drafts": bool(ctx.option("verify_width", "skip_drafts", True)),
            "max_skip": int(ctx.option("verify_width", "max_skip", 8)),
            "objective": str(ctx.option("verify_width", "objective", "rate"))}


def _verify_width(hybrid: bool):
    def build(ctx: Context):
        from pipeline.policy.verify_width import VerifyWidthSchedule

        b, options = _drafted_block_size(ctx), _step_options(ctx)
        calibration, latency = ctx.inputs.calibration, ctx.inputs.latency
        predictor = ctx.inputs.predictors["blockpilot"] if hybrid else None
        VerifyWidthSchedule(calibration, latency, b, predictor, **options)  # raises for B < 2 or a bad option
        return lambda: VerifyWidthSchedule(calibration, latency, b, predictor, **options)

    return build


def _tree(ctx: Context):
    from pipeline.policy.trees import TreeSchedule

    b = _drafted_block_size(ctx)
    options = {**_step_options(ctx), "top_k": int(ctx.option("tree", "top_k", 4)),
               "max_nodes": tree_max_nodes(ctx.options, ctx.decoder)}
    calibration, latency = ctx.inputs.calibration, ctx.inputs.latency
    TreeSchedule(calibration, latency, b, **options)  # raises for B < 2 or a bad option
    return lambda: TreeSchedule(calibration, latency, b, **options)


def tree_max_nodes(options: Mapping, decoder) -> int:
    """The most nodes of a ``tree`` step: ``policy.tree.max_nodes``, else as many as the drafter's widest block verifies
    (its ``max_block_size`` - 1), within the rows one native call takes (``SMALLM_MAX_ROWS`` - 1)."""
    from pipeline.models.backend import SMALLM_MAX_ROWS

    widest = int(decoder.drafter.max_block_size) if getattr(decoder, "drafter", None) is not None else 2
    value = (options.get("tree") or {}).get("max_nodes")
    return int(value) if value is not None else max(1, min(widest, SMALLM_MAX_ROWS) - 1)


def _budget(ctx: Context):
    from pipeline.decoding import FixedSchedule
    from pipeline.policy.budget import BudgetPolicy

    b = _drafted_block_size(ctx)
    if b < 2:
        raise ValueError(f"budget drafts blocks of B >= 2, got B={b}: set policy.verify_width.block_size (or the fixed B)")
    options = _step_options(ctx)
    policy = BudgetPolicy(ctx.inputs.calibration, ctx.inputs.batch_costs, skip_drafts=options["skip_drafts"],
                          max_skip=options["max_skip"])
    return JointWidths(lambda: FixedSchedule(b), policy)


def _vllm(name: str, method: str, policy: str = "off"):
    def build(ctx: Context):
        from pipeline.policy.baselines import VllmGenerate

        options = {k: v for k, v in (ctx.options.get(name) or {}).items() if v is not None}
        if method == "dflash":  # vLLM's K: B - 1 of the fixed B unless policy.<method>.num_speculative_tokens says
            options.setdefault("num_speculative_tokens", ctx.fixed_block_size - 1)
        peer = VllmGenerate({"method": method, "policy": policy, **options})
        return lambda: peer

    return build


def _hf(prompt_lookup: bool):
    def build(ctx: Context):
        from pipeline.policy.baselines import TransformersGenerate

        extra = {}
        if prompt_lookup:
            extra = {"prompt_lookup_num_tokens": int(ctx.option("hf_prompt_lookup", "num_tokens", 10)),
                     "max_matching_ngram_size": int(ctx.option("hf_prompt_lookup", "max_matching_ngram_size", 2))}
        return lambda: TransformersGenerate(extra)

    return build


@dataclass(frozen=True)
class Method:
    """One decoding method.

    Attributes:
        name: the method's name (``eval.methods`` entry, ``serve.policy``).
        needs: inputs it reads: ``labels``, ``splits``, ``predictor`` (of ``predictor``), ``calibration``, ``costs``
            (the latency model), ``batch_costs`` (the batched step cost model), ``request`` (it needs the request
            itself: eval only).
        build: ``Context -> factory``; raises ValueError when the decoder cannot run it.
        predictor: the method whose trained predictor it reads (``policy.<predictor>.predictor`` sub-folder).
        gain_share: whether the oracle gain share means anything for it (a per-request B choice).
        per_step: whether B changes after every step (the report's B column says so).
        servable: whether the server can run it (None: yes; else why not).
        label_split: whether it is scored on the dataset's test split (``eval.split=auto``).
        batched: whether only a batched decoder runs it (its factory is a ``JointWidths``; the server and bench_batch, not the
            eval stage).
    """

    name: str
    needs: frozenset
    build: Callable[[Context], object]
    predictor: str | None = None
    gain_share: bool = True
    per_step: bool = False
    servable: str | None = None
    label_split: bool = False
    batched: bool = False


_EVAL_ONLY_HF = "transformers' generate runs outside the server's speculative decoder; compare it in the eval stage"
_EVAL_ONLY_VLLM = "vLLM serves itself: make serve-vllm (docs/vllm.md); compare it in the eval stage"
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", frozenset(), _ar, gain_share=False),
    Method("fixed", frozenset(), _fixed),
    Method("best_fixed", frozenset({LABELS, SPLITS}), _best_fixed, label_split=True),
    Method("blockpilot", frozenset({PREDICTOR}), _predictor("blockpilot"), predictor="blockpilot", label_split=True),
    Method("full_vocab", frozenset({PREDICTOR}), _predictor("full_vocab"), predictor="full_vocab", label_split=True),
    Method("ema", frozenset(), _ema, per_step=True),
    Method("oracle", frozenset({LABELS, REQUEST}), _oracle, label_split=True,
           servable="the oracle reads each request's own label, which a served request does not have; it is an eval bound"),
    Method("verify_width", frozenset({CALIBRATION, COSTS}), _verify_width(False), gain_share=False),
    Method("hybrid", frozenset({PREDICTOR, CALIBRATION, COSTS}), _verify_width(True), predictor="blockpilot",
           gain_share=False, label_split=True),
    Method("tree", frozenset({CALIBRATION, COSTS}), _tree, gain_share=False,
           servable="the batched decoder (server, bench_batch) verifies chains; trees run one request at a time: compare them in the eval stage"),
    Method("budget", frozenset({CALIBRATION, BATCH_COSTS}), _budget, gain_share=False, batched=True),
    Method("hf_generate", frozenset(), _hf(False), gain_share=False, servable=_EVAL_ONLY_HF),
    Method("hf_prompt_lookup", frozenset(), _hf(True), gain_share=False, servable=_EVAL_ONLY_HF),
    Method("vllm_ar", frozenset({VLLM}), _vllm("vllm_ar", "ar"), gain_share=False, servable=_EVAL_ONLY_VLLM),
    Method("vllm_dflash", frozenset({VLLM}), _vllm("vllm_dflash", "dflash"), gain_share=False, servable=_EVAL_ONLY_VLLM),
    Method("vllm_verify_width", frozenset({VLLM}), _vllm("vllm_verify_width", "dflash", "per_request"),
           gain_share=False, servable=_EVAL_ONLY_VLLM),
)}
SERVABLE = tuple(name for name, m in METHODS.items() if m.servable is None)
EVALUABLE = tuple(name for name, m in METHODS.items() if not m.batched)  # what the eval stage can run
BATCHED = tuple(name for name, m in METHODS.items() if m.batched)  # the server's and bench_batch's, not eval's


def _vllm_installed() -> bool:
    from pipeline.peers.vllm_server import VENV

    return (VENV / "bin" / "python").exists()


def missing_inputs(method: Method, inputs: PolicyInputs) -> list[str]:
    """The inputs ``method`` needs that ``inputs`` lacks (names from ``Method.needs``)."""
    have = {LABELS: inputs.labels is not None, SPLITS: inputs.splits is not None and inputs.labels is not None,
            PREDICTOR: method.predictor in inputs.predictors, CALIBRATION: inputs.calibration is not None,
            COSTS: inputs.latency is not None, BATCH_COSTS: inputs.batch_costs is not None, REQUEST: True,
            VLLM: _vllm_installed()}
    return sorted(n for n in method.needs if not have[n])


def build(name: str, ctx: Context):
    """The schedule factory of method ``name``.

    Raises:
        ValueError: for an unknown method, one the server cannot run (``ctx.where == "serve"``), a batched method in
            the eval stage, missing inputs (names them), or a B the decoder cannot draft.
    """
    method = METHODS.get(name)
    if method is None:
        key = "serve.policy" if ctx.where == "serve" else "eval.methods"
        raise ValueError(f"unknown {key} entry {name!r}; choose from {list(SERVABLE if ctx.where == 'serve' else METHODS)}")
    if ctx.where in ("serve", "bench") and method.servable is not None:
        key = "serve.policy" if ctx.where == "serve" else "bench.methods entry"
        raise ValueError(f"{key}={name} cannot run in the batched decoder: {method.servable}; choose one of "
                         f"{list(SERVABLE)}")
    if ctx.where == "eval" and method.batched:
        raise ValueError(f"eval.methods entry {name!r} cannot be evaluated here: {BATCHED_ONLY}")
    missing = missing_inputs(method, ctx.inputs)
    if missing:
        raise ValueError(f"method {name!r} needs {', '.join(missing)}, which were not loaded (load_inputs)")
    return method.build(ctx)


def available(ctx: Context) -> dict:
    """Factories of every method whose inputs ``ctx.inputs`` holds (the eval stage's default set: no batched method)."""
    return {name: build(name, ctx) for name, m in METHODS.items()
            if not missing_inputs(m, ctx.inputs) and (ctx.where != "serve" or m.servable is None)
            and (ctx.where != "eval" or not m.batched)}


# -- loading what the methods need -----------------------------------------------------------------------------
def predictor_folder(predictor_dir: str | Path, method: str, options: Mapping) -> Path:
    """Where ``method``'s predictor is read: ``predictor_dir`` itself when it holds ``predictor.json`` (a predictor folder
    given directly), else its ``policy.<method>.predictor`` sub-folder (``mlp`` for blockpilot, ``full_vocab``)."""
    directory = Path(predictor_dir)
    if (directory / "predictor.json").is_file():
        return directory
    sub = (options.get(method) or {}).get("predictor") or {"blockpilot": "mlp"}.get(method, method)
    return directory / str(sub)


def run_folder(predictor_dir: str | Path | None) -> Path | None:
    """The run's predictors folder behind ``predictor_dir`` (its parent when ``predictor_dir`` is a predictor folder
    given directly, ``predictor_folder``'s first case); its ``verify_width`` sub-folder holds the run's calibration.
    None without one."""
    if not predictor_dir:
        return None
    directory = Path(predictor_dir)
    return directory.parent if (directory / "predictor.json").is_file() else directory


def load_method_predictor(method: str, directory: str | Path, decoder=None, candidates=None, device: str = "cpu",
                          missing_hint: str = ""):
    """The exported predictor of ``method`` at ``directory``, checked against ``candidates`` and the decoder.

    Raises:
        FileNotFoundError: without an exported predictor (``missing_hint`` says how to train one).
        ValueError: when its candidates differ from ``candidates``, or it does not fit the decoder (``check_predictor``);
            also ``load_predictor``'s checks of the files against each other.
    """
    from pipeline.policy.export import load_predictor

    try:
        predictor = load_predictor(directory, device=device)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"method {method!r} needs a trained predictor at {directory}; {missing_hint or err}") from err
    if candidates is not None and sorted(predictor.candidates) != sorted(int(c) for c in candidates):
        candidates = [int(c) for c in candidates]
        raise ValueError(f"predictor {directory} chooses among block sizes {predictor.candidates}, but model.candidates="
                         f"{candidates}: evaluate with model.candidates={predictor.candidates} or train a predictor on labels "
                         f"made with these candidates (label.block_sizes=${{model.candidates}})")
    if decoder is not None:
        check_predictor(predictor, decoder, directory)
    return predictor


def load_verify_width(inputs: PolicyInputs, decoder, options: Mapping, run_dir: str | Path, drafter: str | None,
                      widths, cfg=None) -> None:
    """Load the calibration (``find_calibration``: ``policy.verify_width.calibration``, else ``run_dir``, else the drafter
    folder's) and, with ``cfg``, this machine's latency model (``policy.verify_width.latency``) into ``inputs``; logs
    which calibration. ``budget`` reads the calibration only (``cfg=None``) and ``load_batch_costs``.

    Raises:
        FileNotFoundError: without a calibration; ValueError: without a drafter.
    """
    from pipeline.policy.calibration import find_calibration, load_calibration
    from pipeline.timing.steps import load_or_measure

    vw = options.get("verify_width") or {}
    if decoder is not None and decoder.drafter is None:
        raise ValueError("methods verify_width/hybrid/budget need a drafter (model.drafter=...)")
    path = find_calibration(vw.get("calibration"), run_dir, drafter)
    inputs.calibration, inputs.calibration_path = load_calibration(path), str(path)
    info = inputs.calibration.info or {}
    log.info("verify_width: calibration %s (%s samples, fitted on %s)", path, info.get("samples", "?"),
             info.get("labels_dir", "?"))
    lat = vw.get("latency") or {}
    if cfg is not None and (lat.get("path") or decoder is not None):  # the one way to obtain the cost model
        inputs.latency = load_or_measure(decoder, cfg, list(widths) if decoder is not None else [],
                                               "policy.verify_width.latency")


def load_batch_costs(inputs: PolicyInputs, decoder, options: Mapping, model, block_size: int, max_requests: int,
                     seed: int = 0, fresh: bool = False) -> None:
    """This machine's batched step cost model (``policy.budget.costs``: measured once per machine, models and forward
    path, then read from its cache; ``pipeline.timing.batched.batch_costs_of``) into ``inputs.batch_costs``, timed for
    blocks of ``block_size`` and up to ``max_requests`` requests per step. ``fresh``: measure again, replace the cache
    and update the model ``inputs`` holds in place (every policy holding it reads the new costs).

    Raises:
        ValueError: for a bad ``policy.budget.costs`` block, or as ``measure_batch_costs``.
    """
    from pipeline.timing.batched import batch_costs_of

    settings = (options.get("budget") or {}).get("costs")
    costs = batch_costs_of(decoder, settings, model, block_size, max_requests, seed, "policy.budget.costs", fresh=fresh)
    if fresh and inputs.batch_costs is not None:
        inputs.batch_costs.update(costs)
        return
    inputs.batch_costs = costs
    log.info("budget: batched step cost model for B=%d and up to %d requests (%s)", block_size, max_requests,
             settings.get("cache") or "measured now, not cached")
