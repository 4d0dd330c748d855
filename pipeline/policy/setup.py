"""The one builder of a stage's decoding methods: what they need, loaded once, and their factories from the registry.

The eval stage (``pipeline.evaluation.inputs``), the server (``pipeline.serve``) and the batched benchmark
(``pipeline.evaluation.batched``) build their methods here, so a method name means the same object graph everywhere:
the same schedule class, calibration, cost model and options (``policy.<method>.*``, conf/policy/default.yaml). What
differs between the stages is only where they read their inputs (``Sources``): their own settings for the labels,
the predictors' folder and the fixed B, and how many requests may share a step.

``CostWatch`` is the run-time check of the cost models the methods read (``pipeline.costs.monitor``): the eval stage
and the server feed it every decoded request and batched step, and it measures a model again when the machine runs
faster than the model says (a model measured while other work shared the cores): the eval stage at once, between two
requests; the server (``defer``) only while no request waits (``CostWatch.measure_pending``), so no request is held
for a measurement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

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
        split: the dataset split whose prompts the stage decodes (its ids are read from ``features_dir``), or None.
        labels_if_present: read the run's labels when ``labels_dir`` holds any, even when no method needs them (the eval
            stage's report figures).
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
    split: str | None = None
    labels_if_present: bool = False


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
    options = policy_options(cfg)
    needs = set().union(*[registry.needs_of(m, options, decoder) for m in wanted]) if wanted else set()
    present = src.labels_if_present and src.labels_dir and any(Path(src.labels_dir).glob("shard-*.parquet"))
    if inputs.labels is None and (registry.LABELS in needs or present):
        from pipeline.labeling.store import read_label_table

        try:
            inputs.labels, inputs.label_meta = read_label_table(src.labels_dir)
        except FileNotFoundError as err:
            users = [m.name for m in wanted if registry.LABELS in m.needs]
            raise FileNotFoundError(f"methods {users} need labels: {err}") from err
    if inputs.splits is None and (registry.SPLITS in needs or src.split is not None):
        from pipeline.policy.data import split_prompt_ids

        try:
            inputs.splits = split_prompt_ids(src.features_dir)
        except FileNotFoundError as err:
            users = [f"split={src.split}"] * (src.split is not None) + [m.name for m in wanted if registry.SPLITS in m.needs]
            raise FileNotFoundError(f"{' / '.join(users)} need the dataset stage's splits: {err}") from err
    for method in sorted({m.predictor for m in wanted if m.predictor} - set(inputs.predictors)):
        directory = predictor_folder(src.predictor_dir, method, options)
        inputs.predictors[method] = load_method_predictor(
            method, directory, decoder, list(cfg.model.candidates) if src.check_candidates else None,
            str(decoder.device) if decoder is not None else "cpu", src.missing_hint)
    if ((registry.CALIBRATION in needs and inputs.calibration is None)
            or (registry.COSTS in needs and inputs.latency is None)):
        run_dir = run_folder(src.predictor_dir)
        load_verify_width(inputs, decoder, options, run_dir / "verify_width" if run_dir else None,
                                   cfg.model.get("drafter"), widths(cfg, decoder, src) if decoder is not None else [],
                                   cfg if registry.COSTS in needs else None, registry.CALIBRATION in needs)
    if src.max_requests > 1 and any(m.load_sized for m in wanted):  # its trees sized on what a row adds under load
        needs.add(registry.BATCH_COSTS)
    if registry.BATCH_COSTS in needs and inputs.batch_costs is None:
        b = drafted_block_size(cfg, decoder, src)
        try:
            decoder.check_block_size(b)
        except ValueError as err:
            raise ValueError(f"{', '.join(m.name for m in wanted if registry.BATCH_COSTS in m.needs)} drafts at B={b} "
                             f"(policy.verify_width.block_size, else {src.block_size_key}, else the drafter's training "
                             f"B): {err}") from err
        load_batch_costs(inputs, decoder, options, cfg.model, b, src.max_requests, int(cfg.get("seed", 0)))
    return inputs


def build_methods(cfg, decoder, inputs: registry.PolicyInputs, methods, src: Sources) -> dict:
    """``{method: registry.Factory}`` of ``methods`` (``registry.build``).

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
        defer: keep a measurement a drifted model asks for in ``pending`` until the owner calls ``measure_pending``
            (the server: while no request waits); False: measure at once (the eval stage, between two requests).
    Attributes:
        pending: ``{"latency" | "batch": measure}`` the deferred measurements not yet taken.
    """

    cfg: object
    decoder: object
    inputs: registry.PolicyInputs
    src: Sources
    defer: bool = False
    monitors: dict = field(init=False)
    pending: dict = field(init=False, default_factory=dict)

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

            self._measure("latency", lambda: remeasure(self.decoder, self.cfg, widths(self.cfg, self.decoder, self.src),
                                                       "policy.verify_width.latency", into=model))

    def step(self, ms: float, rows: tuple[int, int, int, int]) -> None:
        """A batched step (its wall ms; verified rows, drafted rows, requests, drafting requests) against the batched
        model's."""
        costs = self.inputs.batch_costs
        if costs is None:
            return
        if self.monitors["batch"].observe(costs.step_ms(*rows), ms) == "remeasure":
            self._measure("batch", lambda: load_batch_costs(
                self.inputs, self.decoder, policy_options(self.cfg), self.cfg.model,
                drafted_block_size(self.cfg, self.decoder, self.src), self.src.max_requests, int(self.cfg.get("seed", 0)),
                fresh=True))

    def _measure(self, name: str, measure) -> None:
        if not self.defer:
            measure()
            return
        log.info("%s: measured again when no request waits", self.monitors[name].name)
        self.pending[name] = measure

    def measure_pending(self, waiting) -> bool:
        """Take the deferred measurements (``defer``) while ``waiting()`` stays false: each stops between two timed
        runs once a request waits (``pipeline.timing.fixture.yielding``) and is taken again at the next idle moment.
        Returns whether every pending measurement was taken."""
        from pipeline.timing.fixture import MeasurementYielded, yielding

        for name, measure in list(self.pending.items()):
            try:
                with yielding(waiting):
                    measure()
            except MeasurementYielded:
                log.info("%s: a request arrived during the measurement; it is taken again when idle",
                         self.monitors[name].name)
                return False
            del self.pending[name]
        return True


# -- the loaders of what the methods need --------------------------------------------------------------------------
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
        raise FileNotFoundError(f"method {method!r} needs a trained predictor at {directory} ({err}): "
                                f"{missing_hint or 'run make label, make dataset and make train first'}") from err
    if candidates is not None and sorted(predictor.candidates) != sorted(int(c) for c in candidates):
        candidates = [int(c) for c in candidates]
        raise ValueError(f"predictor {directory} chooses among block sizes {predictor.candidates}, but model.candidates="
                         f"{candidates}: evaluate with model.candidates={predictor.candidates} or train a predictor on labels "
                         f"made with these candidates (label.block_sizes=${{model.candidates}})")
    if decoder is not None:
        check_predictor(predictor, decoder, directory)
    return predictor


def load_verify_width(inputs: registry.PolicyInputs, decoder, options: Mapping, run_dir: str | Path, drafter: str | None,
                      widths, cfg=None, calibrate: bool = True) -> None:
    """Load the calibration (``find_calibration``: ``policy.verify_width.calibration``, else ``run_dir``, else the drafter
    folder's; not with ``calibrate`` false: ``mixed`` on its free sources alone) and, with ``cfg``, this machine's
    latency model (``policy.verify_width.latency``) into ``inputs``; logs which calibration. ``budget`` reads the
    calibration only (``cfg=None``) and ``load_batch_costs``.

    Raises:
        FileNotFoundError: without a calibration; ValueError: calibrating without a drafter.
    """
    from pipeline.policy.calibration import find_calibration, load_calibration
    from pipeline.timing.steps import load_or_measure

    vw = options.get("verify_width") or {}
    if calibrate and inputs.calibration is None:
        if decoder is not None and decoder.drafter is None:
            raise ValueError("methods verify_width/hybrid/tree/budget (and mixed drafting from the drafter) need a "
                             "drafter (model.drafter=...)")
        path = find_calibration(vw.get("calibration"), run_dir, drafter)
        inputs.calibration, inputs.calibration_path = load_calibration(path), str(path)
        info = inputs.calibration.info or {}
        log.info("verify_width: calibration %s (%s samples, fitted on %s)", path, info.get("samples", "?"),
                 info.get("labels_dir", "?"))
    lat = vw.get("latency") or {}
    if cfg is not None and (lat.get("path") or decoder is not None):  # the one way to obtain the cost model
        inputs.latency = load_or_measure(decoder, cfg, list(widths) if decoder is not None else [],
                                               "policy.verify_width.latency")


def load_batch_costs(inputs: registry.PolicyInputs, decoder, options: Mapping, model, block_size: int, max_requests: int,
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
    log.info("batched step cost model for B=%d and up to %d requests (%s)", block_size, max_requests,
             settings.get("cache") or "measured now, not cached")
