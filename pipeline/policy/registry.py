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
    the same calibration and cost model (``pipeline.policy.trees``; ``policy.tree``);
  * ``mixed``: every draft source a request holds (n-gram matches over its prompt and output, a suffix cache of earlier
    responses, the drafter) merged in one tree sized by the same cost model (``pipeline.policy.mixed``; ``policy.mixed``);
  * ``budget``: every batched step's verify widths chosen jointly over the requests sharing it
    (``pipeline.policy.budget.BudgetPolicy``: verify_width's calibration, B and skip rule + the batched step cost model,
    ``policy.budget.costs``); only a batched decoder runs it: the server (any ``serve.max_batch``; the eval stage decodes
    one request at a time; ``pipeline.bench_batch`` benchmarks it);
  * ``hf_generate`` / ``hf_prompt_lookup``: transformers' own ``generate`` on the same target (greedy at T=0, sampled
    above), plain or with prompt-lookup decoding (``pipeline.policy.baselines``; eval only: the server streams from the
    speculative decoder);
  * ``vllm_ar`` / ``vllm_dflash`` / ``vllm_verify_width``: vLLM's OpenAI server on the same target and drafter (no
    speculation; its own DFlash verifying K = B - 1 drafts every step; DFlash with our plugin's ``per_request``
    widths, ``pipeline.integrations.vllm``: not this table's ``verify_width``, see ``pipeline.policy.core``);
    ``vllm_ngram`` / ``vllm_suffix``: vLLM's free draft sources on the same target (its prompt-lookup proposer;
    suffix decoding, where vLLM's environment has ``arctic-inference``), K = B - 1 of the fixed B; each request sent
    as the same prompt ids (``pipeline.policy.baselines``; eval only, needs ``make vllm``; options
    ``policy.vllm_*``).

Every builder returns a ``Factory``: a fresh schedule per request (``bind`` it to the request for the oracle) and the
batch-level policy a batched decoder runs the method's requests under (``budget``'s ``BudgetPolicy``, else the base one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from pipeline.costs import ObservedCosts
from pipeline.policy.checks import cache_seed_paths, seeds_from_labels

log = logging.getLogger(__name__)

LABELS, SPLITS, PREDICTOR, CALIBRATION, COSTS, REQUEST = "labels", "splits", "predictor", "calibration", "costs", "request"
BATCH_COSTS = "batch_costs"
VLLM = "vllm"  # vLLM's environment (.venv-vllm, make vllm)
BATCHED_ONLY = ("it chooses the verify widths of every batched step jointly, and the eval stage decodes one request at a "
                "time: benchmark it with python -m pipeline.bench_batch 'bench.methods=[ar,verify_width,budget]', serve it "
                "with serve.policy=budget serve.max_batch=8")


class Factory:
    """What every method's builder returns (the one factory shape): the method's schedules and its batch-level policy.

    Args:
        make: ``() -> schedule``, a fresh schedule per request; with ``per_request``, ``(prompt, turn) -> schedule`` (the
            oracle reads each request's own label: ``bind`` it to the request first).
        batch: the ``pipeline.decoding.schedules.BatchPolicy`` a batched decoder consults at every admission and step for
            this method's requests (``budget``: its ``BudgetPolicy``, which chooses their verify widths together); None:
            the base policy (each request's schedule decides).
        name: the method (``build`` sets it).
    """

    def __init__(self, make: Callable, batch=None, per_request: bool = False, name: str = ""):
        self.make, self.per_request, self.name = make, per_request, name
        if batch is None:
            from pipeline.decoding.schedules import BatchPolicy

            batch = BatchPolicy()
        self.batch = batch

    def __call__(self):
        """A fresh schedule for a request.

        Raises:
            ValueError: for a method that needs the request (``bind`` it).
        """
        if self.per_request:
            raise ValueError(f"method {self.name!r} needs the request: bind(prompt) first")
        return self.make()

    def bind(self, prompt) -> Callable[[], object]:
        """A zero-argument factory for ``prompt``'s turns: its k-th call builds the schedule of turn k (0-based)."""
        if not self.per_request:
            return self
        turn = iter(range(len(prompt.turns)))
        return lambda: self.make(prompt, next(turn))


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


def default_block_size(decoder, block_size: int | None = None) -> int:
    """B when none is configured: ``block_size`` when given, else the drafter's training block size (1 without a drafter)."""
    if block_size is not None:
        return int(block_size)
    return int(decoder.drafter.block_size) if decoder.drafter is not None else 1


def verify_width_block_size(options: Mapping, decoder, block_size: int | None = None) -> int:
    """B drafted by ``verify_width``: ``policy.verify_width.block_size``, else the fixed B (``block_size``, else the
    drafter's training block size: ``default_block_size``)."""
    return int((options.get("verify_width") or {}).get("block_size") or default_block_size(decoder, block_size))


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

    return Factory(lambda: FixedSchedule(1))


def _fixed(ctx: Context):
    from pipeline.decoding import FixedSchedule

    b = ctx.fixed_block_size
    return Factory(lambda: FixedSchedule(b))


def _ema(ctx: Context):
    from pipeline.decoding import EMASchedule

    cands = [int(c) for c in ctx.candidates]
    EMASchedule(cands)  # raises for an empty list
    ctx.decoder.check_block_size(max(cands))
    alpha, margin, start = ctx.option("ema", "alpha", 0.5), ctx.option("ema", "margin", 1.0), ctx.option("ema", "start")
    return Factory(lambda: EMASchedule(cands, alpha, margin, start))


def _best_fixed(ctx: Context):
    from pipeline.decoding import FixedSchedule

    b = best_fixed_block_size(ctx.inputs, ctx.target)
    ctx.decoder.check_block_size(b)
    return Factory(lambda: FixedSchedule(b))


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

    return Factory(oracle, per_request=True)


def _predictor(method: str):
    def build(ctx: Context):
        from pipeline.policy.schedule import PredictorSchedule

        predictor = ctx.inputs.predictors[method]
        ctx.decoder.check_block_size(max(predictor.candidates))
        return Factory(lambda: PredictorSchedule(predictor))

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
        observed = ObservedCosts()
        return Factory(lambda: _observing(VerifyWidthSchedule(calibration, latency, b, predictor, **options), observed))

    return build


def _tree(ctx: Context):
    from pipeline.decoding.trees import TOP_K
    from pipeline.policy.trees import TreeSchedule

    b = _drafted_block_size(ctx)
    options = {**_step_options(ctx), "top_k": int(ctx.option("tree", "top_k", TOP_K)),
               "max_nodes": tree_max_nodes(ctx.options, ctx.decoder)}
    calibration, latency = ctx.inputs.calibration, ctx.inputs.latency
    TreeSchedule(calibration, latency, b, **options)  # raises for B < 2 or a bad option
    observed = ObservedCosts()
    return Factory(lambda: _observing(TreeSchedule(calibration, latency, b, **options), observed))


def _observing(schedule, observed):
    """``schedule`` with the method's ``ObservedCosts`` (one per method, its requests' verify times)."""
    schedule.observed = observed
    return schedule


def mixed_sources(options: Mapping) -> list[str]:
    """``policy.mixed.sources`` (default ``pipeline.policy.mixed.SOURCES``)."""
    from pipeline.policy.mixed import SOURCES

    sources = (options.get("mixed") or {}).get("sources")
    return [str(s) for s in (SOURCES if sources is None else sources)]


def _mixed(ctx: Context):
    from pipeline.decoding.trees import TOP_K
    from pipeline.policy.mixed import MixedSchedule, SharedSources, read_responses

    sources = mixed_sources(ctx.options)
    drafter = "drafter" in sources and ctx.decoder.drafter is not None
    b = _drafted_block_size(ctx) if drafter else 1
    cache_tokens = int(ctx.option("mixed", "cache_tokens", 65536))
    max_n, branches = int(ctx.option("mixed", "max_n", 4)), int(ctx.option("mixed", "branches", 2))
    if cache_tokens < 0 or max_n < 1 or branches < 1:
        raise ValueError(f"policy.mixed needs cache_tokens >= 0 (0: no suffix cache), max_n >= 1 and branches >= 1, got "
                         f"cache_tokens={cache_tokens}, max_n={max_n}, branches={branches}")
    max_nodes = ctx.option("mixed", "max_nodes") or tree_max_nodes(ctx.options, ctx.decoder, 16)
    options = {**_step_options(ctx), "max_skip": int(ctx.option("mixed", "max_skip", 32)),
               "top_k": int(ctx.option("tree", "top_k", TOP_K)), "max_nodes": int(max_nodes),
               "max_n": max_n, "branches": branches, "sources": sources if drafter else [s for s in sources if s != "drafter"]}
    shared = SharedSources(cache_tokens if "cache" in sources else 0, max_n,
                           int(ctx.decoder.lm_head.shape[0]) if "recycle" in sources else None, ObservedCosts())
    seed = cache_seed_paths(ctx.options.get("mixed") or {})
    responses = None  # earlier responses in the suffix cache first: as warm as a server's that served them
    if seed and "cache" in sources:
        responses = list(read_responses(seed, getattr(getattr(ctx.decoder, "target", None), "name", None)).values())
    elif seeds_from_labels(ctx.options) and "cache" in sources:
        responses = train_replies(ctx.inputs)
    if responses is not None:
        log.info("mixed: suffix cache seeded with %d responses (%d tokens held) from %s", len(responses),
                 shared.seed(responses), seed or "the label stage's train split")
    calibration, latency = ctx.inputs.calibration, ctx.inputs.latency
    options["batch_costs"] = ctx.inputs.batch_costs  # a batching server's (loaded for serve.max_batch=auto), else None
    MixedSchedule(calibration, latency, b, shared, **options)  # raises for a bad option
    return Factory(lambda: MixedSchedule(calibration, latency, b, shared, **options))


def train_replies(inputs: PolicyInputs) -> list[list[int]]:
    """The label stage's replies (``reply_ids``) to the train split's requests, for ``policy.mixed.cache_seed=labels``.

    Raises:
        ValueError: where the labels hold no reply (labelled before replies were kept) or no train request.
    """
    from pipeline.prompts import prompt_id_of

    labels = inputs.labels
    kept = labels is not None and "reply_ids" in labels.columns and labels["reply_ids"].notna().any()
    if not kept:
        raise ValueError("policy.mixed.cache_seed=labels: the run's labels keep no replies (labelled before 2026-12-07); "
                         "label again (make label) or seed from eval runs' rows.jsonl")
    train = {prompt_id_of(i) for i in (inputs.splits or {}).get("train", [])}
    replies = [[int(t) for t in r] for i, r in zip(labels["id"], labels["reply_ids"])
               if r is not None and prompt_id_of(i) in train]
    if not replies:
        raise ValueError("policy.mixed.cache_seed=labels: no labelled request of the train split with a reply; run make "
                         "dataset (or label again)")
    return replies


def tree_max_nodes(options: Mapping, decoder, without_drafter: int = 2) -> int:
    """The most nodes of a ``tree`` step: ``policy.tree.max_nodes``, else as many as the drafter's widest block verifies
    (its ``max_block_size`` - 1; ``without_drafter`` - 1 without one), within the rows one native call takes
    (``SMALLM_MAX_ROWS`` - 1)."""
    from pipeline.models.backend import SMALLM_MAX_ROWS

    widest = int(decoder.drafter.max_block_size) if getattr(decoder, "drafter", None) is not None else without_drafter
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
    return Factory(lambda: FixedSchedule(b), policy)


def _vllm(name: str, method: str, policy: str = "off"):
    def build(ctx: Context):
        from pipeline.policy.baselines import VllmGenerate

        options = {k: v for k, v in (ctx.options.get(name) or {}).items() if v is not None}
        if method != "ar":  # vLLM's K: B - 1 of the fixed B unless policy.<method>.num_speculative_tokens says
            options.setdefault("num_speculative_tokens", ctx.fixed_block_size - 1)
        peer = VllmGenerate({"method": method, "policy": policy, **options})
        return Factory(lambda: peer)

    return build


def _hf(prompt_lookup: bool):
    def build(ctx: Context):
        from pipeline.policy.baselines import TransformersGenerate

        extra = {}
        if prompt_lookup:
            extra = {"prompt_lookup_num_tokens": int(ctx.option("hf_prompt_lookup", "num_tokens", 10)),
                     "max_matching_ngram_size": int(ctx.option("hf_prompt_lookup", "max_matching_ngram_size", 2))}
        return Factory(lambda: TransformersGenerate(extra))

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
        batched: whether only a batched decoder runs it (its ``Factory`` brings a batch-level policy; the server and bench_batch, not the
            eval stage).
        load_sized: whether, decoding many requests per step (the server, bench_batch), it sizes its drafts on the
            batched step cost model (then loaded for it: a row that costs ~17% of a step alone costs most of a
            request's share at 16).
        drafter: whether it runs the drafter, given the ``policy`` options (a server whose policy does not loads
            none: ``uses_drafter``).
        free_sources: whether it drafts from the free sources alone where it has no drafter to run (then it reads no
            calibration: ``needs_of``).
        needs_also: what else it reads, given the ``policy`` options (``mixed`` with ``policy.mixed.cache_seed=labels``:
            the run's labels and splits).
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
    load_sized: bool = False
    drafter: Callable[[Mapping], bool] = lambda options: True
    free_sources: bool = False
    needs_also: Callable[[Mapping], frozenset] = lambda options: frozenset()


_EVAL_ONLY_HF = "transformers' generate runs outside the server's speculative decoder; compare it in the eval stage"
_EVAL_ONLY_VLLM = "vLLM serves itself: make serve-vllm (docs/vllm.md); compare it in the eval stage"
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", frozenset(), _ar, gain_share=False, drafter=lambda options: False),
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
    Method("tree", frozenset({CALIBRATION, COSTS}), _tree, gain_share=False),
    Method("mixed", frozenset({CALIBRATION, COSTS}), _mixed, gain_share=False, load_sized=True,
           drafter=lambda options: "drafter" in mixed_sources(options), free_sources=True,
           needs_also=lambda options: frozenset({LABELS, SPLITS}) if seeds_from_labels(options) else frozenset()),
    Method("budget", frozenset({CALIBRATION, BATCH_COSTS}), _budget, gain_share=False, batched=True),
    Method("hf_generate", frozenset(), _hf(False), gain_share=False, servable=_EVAL_ONLY_HF),
    Method("hf_prompt_lookup", frozenset(), _hf(True), gain_share=False, servable=_EVAL_ONLY_HF),
    Method("vllm_ar", frozenset({VLLM}), _vllm("vllm_ar", "ar"), gain_share=False, servable=_EVAL_ONLY_VLLM),
    Method("vllm_dflash", frozenset({VLLM}), _vllm("vllm_dflash", "dflash"), gain_share=False, servable=_EVAL_ONLY_VLLM),
    Method("vllm_verify_width", frozenset({VLLM}), _vllm("vllm_verify_width", "dflash", "per_request"),
           gain_share=False, servable=_EVAL_ONLY_VLLM),
    Method("vllm_ngram", frozenset({VLLM}), _vllm("vllm_ngram", "ngram"), gain_share=False, servable=_EVAL_ONLY_VLLM),
    Method("vllm_suffix", frozenset({VLLM}), _vllm("vllm_suffix", "suffix"), gain_share=False, servable=_EVAL_ONLY_VLLM),
)}
SERVABLE = tuple(name for name, m in METHODS.items() if m.servable is None)
EVALUABLE = tuple(name for name, m in METHODS.items() if not m.batched)  # what the eval stage can run
BATCHED = tuple(name for name, m in METHODS.items() if m.batched)  # the server's and bench_batch's, not eval's


def _vllm_installed() -> bool:
    from pipeline.peers.vllm_server import VENV

    return (VENV / "bin" / "python").exists()


def uses_drafter(name: str, options: Mapping) -> bool:
    """Whether method ``name`` runs the drafter under the ``policy`` options ``options`` (``ar`` never; ``mixed`` only
    with ``drafter`` among ``policy.mixed.sources``)."""
    return METHODS[name].drafter(options)


def needs_of(method: Method, options: Mapping, decoder) -> frozenset:
    """What ``method`` reads on ``decoder``: its ``needs`` and ``needs_also``, but no calibration where it drafts from
    the free sources alone (``Method.free_sources``: ``mixed`` with no drafter among its sources, or none loaded)."""
    needs = method.needs | method.needs_also(options)
    if method.free_sources and (not method.drafter(options) or (decoder is not None and decoder.drafter is None)):
        return needs - {CALIBRATION}
    return needs


def missing_inputs(method: Method, inputs: PolicyInputs, options: Mapping | None = None, decoder=None) -> list[str]:
    """The inputs ``method`` needs (``needs_of``) that ``inputs`` lacks."""
    have = {LABELS: inputs.labels is not None, SPLITS: inputs.splits is not None and inputs.labels is not None,
            PREDICTOR: method.predictor in inputs.predictors, CALIBRATION: inputs.calibration is not None,
            COSTS: inputs.latency is not None, BATCH_COSTS: inputs.batch_costs is not None, REQUEST: True,
            VLLM: _vllm_installed()}
    return sorted(n for n in needs_of(method, options or {}, decoder) if not have[n])


STAGE_KEYS = {"eval": "eval.methods", "serve": "serve.policy", "bench": "bench.methods"}  # where -> the setting's name


def runnable(where: str) -> tuple[str, ...]:
    """The methods ``where`` runs: the eval stage decodes one request at a time (no batched method); the server and
    ``bench_batch`` run the batched decoder (the servable methods)."""
    return EVALUABLE if where == "eval" else SERVABLE


def check_methods(names, where: str, key: str | None = None) -> None:
    """The one check of method names (the config checks, ``build`` and the stages call it): every name is a method of
    ``METHODS`` that ``where`` (``eval``, ``serve`` or ``bench``) can run.

    Args:
        names: the method names (a list), or one name (a str: ``serve.policy``).
        key: the setting's name for messages (default ``STAGE_KEYS[where]``).
    Raises:
        ValueError: for the first unknown or unrunnable name, naming ``key`` and the choices.
    """
    key = key or STAGE_KEYS[where]
    single = isinstance(names, str)
    names = [names] if single else [str(n) for n in names]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        shown = repr(unknown[0]) if single else unknown
        raise ValueError(f"unknown {key} {shown}; choose from {list(runnable(where))}")
    if where == "eval":
        batched = [n for n in names if METHODS[n].batched]
        if batched:
            raise ValueError(f"{key} {batched} cannot be evaluated here: {BATCHED_ONLY}")
        return
    for n in names:
        if METHODS[n].servable is not None:
            raise ValueError(f"{key}={n} cannot be served: {METHODS[n].servable}; serve one of {list(SERVABLE)}")


def build(name: str, ctx: Context):
    """The schedule factory of method ``name``.

    Raises:
        ValueError: for an unknown method, one the stage cannot run (``check_methods``), missing inputs (names them), or
            a B the decoder cannot draft.
    """
    check_methods(name if ctx.where == "serve" else [name], ctx.where)
    method = METHODS[name]
    missing = missing_inputs(method, ctx.inputs, ctx.options, ctx.decoder)
    if missing:
        raise ValueError(f"method {name!r} needs {', '.join(missing)}, which were not loaded (load_inputs)")
    factory = method.build(ctx)
    factory.name = name
    return factory


def available(ctx: Context) -> dict:
    """Factories of every method whose inputs ``ctx.inputs`` holds (the eval stage's default set: no batched method)."""
    return {name: build(name, ctx) for name, m in METHODS.items()
            if not missing_inputs(m, ctx.inputs, ctx.options, ctx.decoder)
            and (ctx.where != "serve" or m.servable is None) and (ctx.where != "eval" or not m.batched)}
