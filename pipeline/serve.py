"""``serve``: an OpenAI-compatible server over the speculative decoder (FastAPI + uvicorn; batch 1, or continuous
batching with ``serve.max_batch > 1``).

    make serve                                                  # python -m pipeline.serve: the embedded default
    python -m pipeline.serve serve.policy=blockpilot run_name=main   # B per request from `make train`'s predictor
    make serve RUN=quick ARGS="serve.policy=verify_width"            # the run of `make all EXPERIMENT=quick`
    python -m pipeline.serve serve.max_batch=8 serve.policy=budget  # 8 requests per step, their verify widths jointly
    python -m pipeline.serve serve.record=true                  # also label served requests -> data/labels/served

    curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

See ``pipeline.serving`` for the routes and the recorder, ``pipeline.policy.registry`` for the policies (the same
builders as the eval stage), ``conf/serve.yaml`` and ``conf/policy/default.yaml`` (``policy.<name>.*``).
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def build_recorder(cfg: DictConfig, decoder):
    """The ``Recorder`` of ``serve.record`` (None when off); its latency model is the record run's, ``serve.latency_path``'s,
    or measured now (``label.latency``, with progress).

    Raises:
        ValueError: without a drafter, or when ``serve.record_dir`` holds labels of other settings.
    """
    if not cfg.serve.record:
        return None
    from pipeline.labeling.oracle import check_candidates
    from pipeline.labeling.store import LabelStore
    from pipeline.prompts import template_kwargs_of
    from pipeline.serving.recorder import Recorder

    if decoder.drafter is None:
        raise ValueError("serve.record=true needs a drafter (model.drafter): replay labels are drafter replays")
    candidates = check_candidates(list(cfg.label.block_sizes), decoder)
    temperature = float(cfg.decode.temperature)
    stored = LabelStore(cfg.serve.record_dir, create=False).read_meta() if cfg.serve.record_dir else None
    from pipeline.timing.steps import load_or_measure

    latency = load_or_measure(decoder, cfg, candidates, "label.latency", (stored or {}).get("latency_model"),
                                    cfg.serve.get("latency_path"), "serve.latency_path")
    drafter = decoder.drafter
    meta = {
        "target": str(cfg.model.target), "drafter": str(cfg.model.drafter), "training_block_size": int(drafter.block_size),
        "candidates": candidates, "temperature": temperature, "repeats": 1, "seed": int(cfg.decode.seed),
        "max_new_tokens": int(cfg.serve.max_tokens), "mode": "replay", "topk": int(cfg.label.topk),
        "store_full_logits": bool(cfg.label.store_full_logits), "sets": [str(cfg.serve.record_source_set)],
        "source": "serve",
        "chat_template_kwargs": template_kwargs_of(cfg.model),
    }
    return Recorder(decoder, cfg.serve.record_dir, candidates, latency, meta, str(cfg.serve.record_source_set),
                    int(cfg.label.topk), bool(cfg.label.store_full_logits), str(cfg.label.lm_head),
                    int(cfg.serve.record_flush_every))


def build_engine(cfg: DictConfig, decoder=None, thread=None):
    """The serving engine of ``cfg`` (``conf/serve.yaml``): decoder (default ``build_decoder(cfg.model)``), policy
    (``policy_inputs`` + ``build_policy``, the registry the eval stage builds from), recorder; an ``Engine`` (batch 1)
    or, with ``serve.max_batch > 1``, a ``BatchEngine`` (continuous batching; ``serve.policy=budget``'s
    ``BudgetPolicy`` chooses every step's verify widths). ``thread``: the single-worker executor the engine decodes on
    (None: its own; ``main`` passes the one this runs on).

    Raises:
        ValueError: for a bad config (``validate_config(cfg, "serve")``, before any model loads: e.g.
            ``serve.policy=budget`` with ``serve.max_batch=1``).
        ValueError / FileNotFoundError: for a policy or recorder that cannot run (see ``build_policy``, ``build_recorder``).
    """
    from pipeline.config_checks import validate_config
    from pipeline.decoding.build import build_decoder
    from pipeline.models.loading import resolve_path
    from pipeline.serving.batch_engine import BatchEngine
    from pipeline.serving.engine import Engine, build_policy

    validate_config(cfg, "serve")
    s = cfg.serve
    decoder = decoder or build_decoder(cfg.model)
    predictor_dir = resolve_path(str(s.predictor_dir)) if s.get("predictor_dir") else None
    options = policy_options(cfg)
    policy = build_policy(str(s.policy), decoder, s.get("block_size"), predictor_dir, list(cfg.model.candidates), options,
                          policy_inputs(cfg, decoder), run_hint(cfg))
    settings = (decoder, policy, str(s.model_name), int(s.max_queue), int(s.default_max_tokens), int(s.max_tokens),
                int(cfg.decode.seed), build_recorder(cfg, decoder), float(cfg.decode.temperature))
    max_batch = int(s.get("max_batch") or 1)
    return BatchEngine(*settings, max_batch=max_batch, thread=thread) if max_batch > 1 else Engine(*settings, executor=thread)


def start_engine(cfg: DictConfig, thread=None):
    """``build_engine`` and, with ``serve.warmup``, one short decode; ``main`` runs it on ``thread``, the thread the
    engine then decodes on."""
    from pipeline.decoding import DecodeConfig
    from pipeline.prompts import messages_input_ids

    engine = build_engine(cfg, thread=thread)
    if cfg.serve.get("warmup", True):
        ids = messages_input_ids(engine.tokenizer, [{"role": "user", "content": "Hello"}])
        engine.decoder.generate(ids, engine.policy.make(), DecodeConfig(8, 0.0, 0))
    return engine


def serve_options(cfg: DictConfig):
    """The app's ``ServeOptions`` of ``cfg.serve``: host, ``api_key`` (null: the ``BLOCKPILOT_API_KEY`` environment
    variable), ``allowed_hosts``, ``max_body_bytes``, ``max_prompt_chars``, ``allow_request_chat_template``.

    Raises:
        ValueError: for limits below 1.
    """
    import os

    from pipeline.serving.app import API_KEY_ENV, ServeOptions

    s = cfg.serve
    hosts = s.get("allowed_hosts")
    return ServeOptions(host=str(s.host), api_key=s.get("api_key") or os.environ.get(API_KEY_ENV) or None,
                        allowed_hosts=[str(h) for h in hosts] if hosts is not None else None,
                        max_body_bytes=int(s.get("max_body_bytes", 4 << 20)),
                        max_prompt_chars=int(s.get("max_prompt_chars", 1_000_000)),
                        allow_request_chat_template=bool(s.get("allow_request_chat_template", False)))


def policy_options(cfg: DictConfig) -> dict:
    """The ``policy`` config group as a dict, plus ``target`` (``serve.target``: which label best_fixed reads)."""
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(cfg.policy, resolve=True) if cfg.get("policy") is not None else {}
    options["target"] = str(cfg.serve.get("target", "tau"))
    return options


def run_hint(cfg: DictConfig) -> str:
    """What to say when the run has no predictor: the run_name it looked in, the runs that have one, and the make
    command with ``RUN=`` (``make serve`` reads RUN, not the EXPERIMENT that ``make all`` ran)."""
    from pathlib import Path

    root = Path(cfg.paths.data) / "predictors"
    sub = str((cfg.get("policy") or {}).get("blockpilot", {}).get("predictor") or "mlp")
    others = sorted(p.parent.parent.name for p in root.glob(f"*/{sub}/predictor.json") if p.parent.parent.name != str(cfg.run_name))
    hint = f"; this server looked for run_name={cfg.run_name}"
    if others:
        return hint + (f"; runs with a trained predictor here: {', '.join(others)}: serve one with "
                       f"make serve RUN={others[0]} ARGS='serve.policy={cfg.serve.policy}' (python -m pipeline.serve "
                       f"run_name={others[0]} serve.policy={cfg.serve.policy})")
    return hint + f" (after make all EXPERIMENT=quick, serve with make serve RUN=quick ARGS='serve.policy={cfg.serve.policy}')"


def policy_inputs(cfg: DictConfig, decoder):
    """What ``serve.policy`` needs beyond a predictor, loaded as the eval stage loads it (``pipeline.policy.registry``):
    best_fixed: the run's labels and splits (``serve.labels_dir``, ``serve.features_dir``); verify_width / hybrid: the
    calibration (``policy.verify_width.calibration``, else ``predictors/<run_name>/verify_width``, else the drafter
    folder's) and this machine's latency model (measured at startup for widths up to B and the candidates, or reused
    from the cache the label and eval stages share); budget: the same calibration and the batched step cost model
    (``policy.budget.costs``, for blocks of B and up to ``serve.max_batch`` requests: measured once per machine and
    cached, as ``pipeline.bench_batch`` obtains it).

    Raises:
        FileNotFoundError: without labels, splits or a calibration (names the stage to run).
    """
    from pathlib import Path

    from pipeline.policy import registry

    inputs = registry.PolicyInputs()
    method = registry.METHODS.get(str(cfg.serve.policy))
    if method is None:
        return inputs
    if registry.LABELS in method.needs and method.servable is None:
        from pipeline.labeling.store import read_label_table
        from pipeline.policy.data import split_prompt_ids

        inputs.labels, inputs.label_meta = read_label_table(cfg.serve.labels_dir)
        inputs.splits = split_prompt_ids(cfg.serve.features_dir)
    options = policy_options(cfg)
    b = registry.verify_width_block_size(options, decoder, cfg.serve.get("block_size"))
    if registry.CALIBRATION in method.needs:
        registry.load_verify_width(inputs, decoder, options, Path(cfg.paths.data) / "predictors" / str(cfg.run_name) / "verify_width",
                                   cfg.model.get("drafter"), [*cfg.model.candidates, b],
                                   cfg if registry.COSTS in method.needs else None)
    if registry.BATCH_COSTS in method.needs:
        try:
            decoder.check_block_size(b)
        except ValueError as err:
            raise ValueError(f"serve.policy={cfg.serve.policy} drafts at B={b} (policy.verify_width.block_size, else "
                             f"serve.block_size, else the drafter's training B): {err}") from err
        registry.load_batch_costs(inputs, decoder, options, cfg.model, b, int(cfg.serve.get("max_batch") or 1), int(cfg.seed))
    return inputs


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    import torch
    import uvicorn

    from pipeline.config_checks import validate_config
    from pipeline.serving.app import create_app
    from pipeline.serving.threads import decoder_thread

    validate_config(cfg, "serve")  # before any model loads (build_engine checks again: it is also called alone)
    if cfg.serve.get("num_threads"):
        torch.set_num_threads(int(cfg.serve.num_threads))
    options = serve_options(cfg)  # checked before any model loads
    thread = decoder_thread()  # loads, warms and measures the model, then decodes: one OpenMP team (pipeline/serving/threads.py)
    engine = thread.submit(start_engine, cfg, thread).result()
    log.info("serving %s with policy %s on http://%s:%d (queue %d%s%s)", engine.model_name, engine.policy.name,
             cfg.serve.host, int(cfg.serve.port), engine.max_queue, ", API key required" if options.api_key else "",
             f", recording to {cfg.serve.record_dir}" if engine.recorder else "")
    shutdown = cfg.serve.get("shutdown_timeout_s")
    try:
        uvicorn.run(create_app(engine, options), host=str(cfg.serve.host), port=int(cfg.serve.port), log_level="info",
                    timeout_graceful_shutdown=float(shutdown) if shutdown is not None else None)
    finally:
        engine.close()
        if engine.recorder is not None:
            log.info("recorder: %s", engine.recorder.stats())


if __name__ == "__main__":
    main()
