"""The one builder of a stage's decoding methods: what they need, loaded once, and their factories from the registry.

The eval stage (``pipeline.evaluation.inputs``), the server (``pipeline.serve``) and the batched benchmark
(``pipeline.evaluation.batched``) build their methods here, so a method name means the same object graph everywhere:
the same schedule class, calibration, cost model and options (``policy.<method>.*``, conf/policy/default.yaml). What
differs between the stages is only where they read their inputs (``Sources``): their own settings for the labels,
the predictors' folder and the fixed B, and how many requests may share a step.

``CostWatch`` is the run-time check of the cost models the methods read (``pipeline.costs.monitor``): the eval stage
and the server feed it every decoded request and batched step, and it measures a model again when the machine runs
faster than the model says (a model measured while other work shared the cores).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pipeline.policy import registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sources:
    """Where a stage's methods read what they need, and how the stage names its settings.

    Attributes:
        where: ``eval``, ``serve`` or ``bench`` (the registry's checks and messages).
        predictor_dir: the run's predictors folder (``<dir>/<policy.<m>.predictor>``; ``<dir>/verify_width`` holds the
            run's calibration), or a predictor folder itself.
        labels_dir, features_dir: the run's labels and dataset splits (``best_fixed``, ``oracle``).
        block_size, block_size_key: the fixed B (None: the drafter's training B) and its setting's name.
        target: ``tau`` or ``speed`` (which label ``best_fixed`` / ``oracle`` read).
        max_requests: the most requests sharing a batched step (the batched cost model is timed up to it).
        check_candidates: a predictor must choose among ``model.candidates`` (the eval stage: labels of them).
        missing_hint: appended to the message of a missing predictor.
    """

    where: str
    predictor_dir: str | None
    labels_dir: str | None = None
    features_dir: str | None = None
    block_size: int | None = None
    block_size_key: str = "decode.block_size"
    target: str = "tau"
    max_requests: int = 1
    check_candidates: bool = False
    missing_hint: str = ""


def policy_options(cfg) -> dict:
    """The ``policy`` config group as a plain dict (``{method: {option: value}}``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.policy, resolve=True) if cfg.get("policy") is not None else {}


def context(cfg, decoder, inputs: registry.PolicyInputs, src: Sources) -> registry.Context:
    """The registry's build context of a stage."""
    return registry.Context(decoder, policy_options(cfg), inputs, [int(c) for c in cfg.model.candidates], src.block_size,
                            src.block_size_key, src.target, src.where)


def drafted_block_size(cfg, decoder, src: Sources) -> int:
    """B drafted by ``verify_width`` / ``budget``: ``policy.verify_width.block_size``, else the stage's fixed B, else
    the drafter's training B."""
    return registry.verify_width_block_size(policy_options(cfg), decoder, src.block_size)


def widths(cfg, decoder, src: Sources) -> list[int]:
    """The widths a stage's batch-1 cost model covers: the candidates, the B ``verify_width`` drafts and a ``tree``
    step's widest verify (``registry.tree_max_nodes`` + 1 rows)."""
    tree_rows = registry.tree_max_nodes(policy_options(cfg), decoder) + 1 if decoder is not None else 0
    return [*[int(c) for c in cfg.model.candidates], drafted_block_size(cfg, decoder, src), tree_rows]


def load_inputs(cfg, decoder, methods, src: Sources, inputs: registry.PolicyInputs | None = None) -> registry.PolicyInputs:
    """Load what ``methods`` need into ``inputs`` (a new ``PolicyInputs`` by default): the run's labels and splits,
    predictors, the verify-width calibration, this machine's batch-1 cost model and its batched step cost model
    (measured once per machine and cached, ``pipeline.timing``).

    Raises:
        FileNotFoundError: for a missing label, split, predictor or calibration (names the stage to run).
        ValueError: when a predictor does not fit the decoder, or for a B the drafter cannot draft.
    """
    inputs = inputs if inputs is not None else registry.PolicyInputs()
    wanted = [registry.METHODS[m] for m in dict.fromkeys(methods) if m in registry.METHODS]
    needs = set().union(*[m.needs for m in wanted]) if wanted else set()
    if registry.LABELS in needs and inputs.labels is None:
        from pipeline.labeling.store import read_label_table
        from pipeline.policy.data import split_prompt_ids

        inputs.labels, inputs.label_meta = read_label_table(src.labels_dir)
        if registry.SPLITS in needs:
            inputs.splits = split_prompt_ids(src.features_dir)
    options = policy_options(cfg)
    for method in sorted({m.predictor for m in wanted if m.predictor} - set(inputs.predictors)):
        directory = registry.predictor_folder(src.predictor_dir, method, options)
        inputs.predictors[method] = registry.load_method_predictor(
            method, directory, decoder, list(cfg.model.candidates) if src.check_candidates else None,
            str(decoder.device) if decoder is not None else "cpu", src.missing_hint)
    if registry.CALIBRATION in needs:
        run_dir = registry.run_folder(src.predictor_dir)
        registry.load_verify_width(inputs, decoder, options, run_dir / "verify_width" if run_dir else None,
                                   cfg.model.get("drafter"), widths(cfg, decoder, src) if decoder is not None else [],
                                   cfg if registry.COSTS in needs else None)
    if registry.BATCH_COSTS in needs:
        b = drafted_block_size(cfg, decoder, src)
        try:
            decoder.check_block_size(b)
        except ValueError as err:
            raise ValueError(f"{', '.join(m.name for m in wanted if registry.BATCH_COSTS in m.needs)} drafts at B={b} "
                             f"(policy.verify_width.block_size, else {src.block_size_key}, else the drafter's training "
                             f"B): {err}") from err
        registry.load_batch_costs(inputs, decoder, options, cfg.model, b, src.max_requests, int(cfg.get("seed", 0)))
    return inputs


def build_methods(cfg, decoder, inputs: registry.PolicyInputs, methods, src: Sources) -> dict:
    """``{method: factory}`` of ``methods`` (``registry.build``): a zero-argument schedule factory, a ``PerPrompt`` or a
    ``JointWidths``.

    Raises:
        ValueError: for an unknown method, one the stage cannot run, missing inputs, or a B the drafter cannot draft.
    """
    ctx = context(cfg, decoder, inputs, src)
    return {m: registry.build(m, ctx) for m in dict.fromkeys(methods)}


@dataclass
class CostWatch:
    """The run-time check of a stage's cost models (see the module doc).

    Args:
        cfg, decoder, src: the stage's config, decoder and ``Sources`` (to measure again as it was measured).
        inputs: the loaded ``PolicyInputs`` (``latency``: the batch-1 model; ``batch_costs``: the batched one); a model
            measured again is updated in place, so every schedule and policy holding it reads the new costs.
    """

    cfg: object
    decoder: object
    inputs: registry.PolicyInputs
    src: Sources
    monitors: dict = field(init=False)

    def __post_init__(self) -> None:
        from pipeline.costs import DriftMonitor

        self.monitors = {"latency": DriftMonitor("batch-1 step costs"), "batch": DriftMonitor("batched step costs")}

    def request(self, stats) -> None:
        """A request decoded alone (``RequestStats``): its measured decode time against the batch-1 model's."""
        model = self.inputs.latency
        if model is None or not stats.taus or stats.decode_ms <= 0:
            return
        if self.monitors["latency"].observe(model.request_ms(stats), stats.decode_ms) == "remeasure":
            from pipeline.timing.steps import remeasure

            remeasure(self.decoder, self.cfg, widths(self.cfg, self.decoder, self.src), "policy.verify_width.latency",
                      into=model)

    def step(self, ms: float, rows: tuple[int, int, int, int]) -> None:
        """A batched step (its wall ms; verified rows, drafted rows, requests, drafting requests) against the batched
        model's."""
        costs = self.inputs.batch_costs
        if costs is None:
            return
        if self.monitors["batch"].observe(costs.step_ms(*rows), ms) == "remeasure":
            registry.load_batch_costs(self.inputs, self.decoder, policy_options(self.cfg), self.cfg.model,
                                      drafted_block_size(self.cfg, self.decoder, self.src), self.src.max_requests,
                                      int(self.cfg.get("seed", 0)), fresh=True)
