"""``serve``: an OpenAI-compatible server over the speculative decoder (FastAPI + uvicorn; continuous batching of up
to ``serve.max_batch`` requests per step, 1 included).

    make serve                                                  # python -m pipeline.serve: the embedded default
    python -m pipeline.serve serve.policy=blockpilot run_name=main   # B per request from `make train`'s predictor
    make serve RUN=quick ARGS="serve.policy=verify_width"            # the run of `make all EXPERIMENT=quick`
    python -m pipeline.serve serve.max_batch=1 serve.policy=verify_width   # one request at a time, k chosen alone
    python -m pipeline.serve serve.record=true                  # also label served requests -> data/labels/served

    curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

See ``pipeline.serving`` for the routes and the recorder, ``pipeline.policy.registry`` for the policies (the same
builders as the eval stage), ``conf/serve.yaml`` and ``conf/policy/default.yaml`` (``policy.<name>.*``).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from pipeline.cli import stage

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


def release_weights(cfg: DictConfig, decoder) -> None:
    """With ``serve.release_weights`` (on by default), free the float32 weights the decoder's native forward never reads
    (``pipeline.models.release.release_unused_weights``: transformers' layers, the drafter's, their packed copies, the
    float32 embedding where the LM head's q8 rows give its values); the drafter's are kept with ``serve.record`` (the
    replay runs its own forward). Off the native stack nothing is released (logged)."""
    from pipeline.models.release import release_unused_weights, unreleasable

    if not cfg.serve.get("release_weights", True):
        return
    reason = unreleasable(decoder)
    if reason is not None:
        log.info("serve.release_weights: every weight kept: %s", reason)
        return
    release_unused_weights(decoder, keep_drafter=bool(cfg.serve.record))


def sources(cfg: DictConfig, max_batch: int | None = None):
    """Where the server's policy reads its inputs (``pipeline.policy.setup.Sources``): ``serve.predictor_dir`` (its
    ``verify_width`` calibration, else the drafter's), ``serve.labels_dir`` / ``features_dir`` (best_fixed),
    ``serve.block_size``, up to ``max_batch`` requests per step (None: ``serve.max_batch``, a number)."""
    from pipeline.models.loading import resolve_path
    from pipeline.policy.setup import Sources

    s = cfg.serve
    return Sources("serve", resolve_path(str(s.predictor_dir)) if s.get("predictor_dir") else None,
                   s.get("labels_dir"), s.get("features_dir"), s.get("block_size"), "serve.block_size",
                   str(s.get("target", "tau")), int(max_batch or s.get("max_batch") or 1),
                   missing_hint="run make label, make dataset and make train first (or serve.predictor_dir=...)" + run_hint(cfg))


def build_engine(cfg: DictConfig, decoder=None, thread=None):
    """The serving engine of ``cfg`` (``conf/serve.yaml``): the decoder (default ``build_decoder(cfg.model)``), the
    policy from the one method table (``pipeline.policy.setup``, as the eval stage builds it), the recorder, the run-
    time check of the policy's cost models and the decoder's prefix cache of ``serve.prefix_cache_mb`` MiB
    (``pipeline.decoding.prefix_cache.prefix_cache_for``); ``serve.max_batch`` requests per step. ``thread``: the single-worker
    executor the engine decodes on (None: its own; ``main`` passes the one this runs on).

    Raises:
        ValueError: for a bad config (``validate_config(cfg, "serve")``, before any model loads).
        ValueError / FileNotFoundError: for a policy or recorder that cannot run (a missing predictor names
            ``make train``; see ``pipeline.policy.setup.load_inputs``, ``build_recorder``).
    """
    from pipeline.config_checks import validate_config
    from pipeline.decoding.build import build_decoder
    from pipeline.decoding.prefix_cache import prefix_cache_for
    from pipeline.models.release import pin_mmap_threshold
    from pipeline.policy import registry, setup
    from pipeline.serving.engine import Engine

    validate_config(cfg, "serve")
    s = cfg.serve
    own = decoder is None  # built here for this server's life: release_weights may free what its forward never reads
    if own and not s.record and not registry.uses_drafter(str(s.policy), setup.policy_options(cfg)):
        from omegaconf import OmegaConf

        log.info("serve.policy=%s never runs the drafter: serving without one (model.drafter=%s not loaded)", s.policy,
                 cfg.model.get("drafter"))
        cfg = OmegaConf.merge(cfg, {"model": {"drafter": None}})  # its costs measured and cached as drafterless
    if own:
        pin_mmap_threshold()  # large buffers mapped alone, handed back when freed (the serving peak)
    decoder = decoder or build_decoder(cfg.model)
    if own:
        release_weights(cfg, decoder)
    inputs = registry.PolicyInputs()
    max_batch = s.get("max_batch") or 1
    if max_batch == "auto":  # the knee of this machine's batched step costs (measured once, cached)
        from pipeline.costs.batched import knee

        limit = int(s.get("max_batch_limit", 64))
        src = sources(cfg, limit)
        setup.load_batch_costs(inputs, decoder, setup.policy_options(cfg), cfg.model,
                               setup.drafted_block_size(cfg, decoder, src), limit, int(cfg.get("seed", 0)))
        max_batch = knee(inputs.batch_costs, limit)
        log.info("serve.max_batch=auto: %d requests per step (the knee of this machine's batched step costs, up to %d)",
                 max_batch, limit)
    src, name = sources(cfg, int(max_batch)), str(s.policy)
    inputs = setup.load_inputs(cfg, decoder, [name], src, inputs)
    policy = setup.build_methods(cfg, decoder, inputs, [name], src)[name]
    decoder.prefix_cache = prefix_cache_for(decoder, s.get("prefix_cache_mb") or 0)
    return Engine(decoder, policy, str(s.model_name), int(s.max_queue), int(s.default_max_tokens), int(s.max_tokens),
                  int(cfg.decode.seed), build_recorder(cfg, decoder), float(cfg.decode.temperature),
                  max_batch=src.max_requests, thread=thread, watch=setup.CostWatch(cfg, decoder, inputs, src, defer=True),
                  kv_budget=int(float(s.get("kv_cache_mb") or 0) * 2**20) or None)


def start_engine(cfg: DictConfig, thread=None):
    """``build_engine`` and, with ``serve.warmup``, one short decode; ``main`` runs it on ``thread``, the thread the
    engine then decodes on."""
    from pipeline.decoding import DecodeConfig
    from pipeline.models.release import trim_heap
    from pipeline.prompts import messages_input_ids
    from pipeline.serving.metrics import reset_peak_resident

    engine = build_engine(cfg, thread=thread)
    if cfg.serve.get("warmup", True):
        ids = messages_input_ids(engine.tokenizer, [{"role": "user", "content": "Hello"}])
        prefixes, engine.decoder.prefix_cache = engine.decoder.prefix_cache, None  # not a request: not stored or counted
        try:
            engine.decoder.generate(ids, engine.policy(), DecodeConfig(8, 0.0, 0))
        finally:
            engine.decoder.prefix_cache = prefixes
    trim_heap()  # the heap a cost measurement at start freed goes back to the system, out of the serving peak
    reset_peak_resident()  # the peak /health and /metrics report: the serving one, from here
    return engine


def serve_options(cfg: DictConfig):
    """The app's ``ServeOptions`` of ``cfg.serve``: host, ``api_key`` (null: the ``BLOCKPILOT_API_KEY`` environment
    variable), ``allowed_hosts``, ``max_body_bytes``, ``max_prompt_chars``, ``allow_request_chat_template``.

    Raises:
        ValueError: for limits below 1.
    """
    import os

    from pipeline.serving.guards import API_KEY_ENV, ServeOptions

    s = cfg.serve
    hosts = s.get("allowed_hosts")
    return ServeOptions(host=str(s.host), api_key=s.get("api_key") or os.environ.get(API_KEY_ENV) or None,
                        allowed_hosts=[str(h) for h in hosts] if hosts is not None else None,
                        max_body_bytes=int(s.get("max_body_bytes", 4 << 20)),
                        max_prompt_chars=int(s.get("max_prompt_chars", 1_000_000)),
                        allow_request_chat_template=bool(s.get("allow_request_chat_template", False)))


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


@stage("serve")
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
    log.info("serving %s with policy %s on http://%s:%d (%d decoding together, %d waiting at most%s%s)",
             engine.model_name, engine.policy.name, cfg.serve.host, int(cfg.serve.port), engine.max_batch,
             engine.max_queue, ", API key required" if options.api_key else "",
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
