"""``serve``: an OpenAI-compatible server over the speculative decoder (FastAPI + uvicorn, batch 1).

    make serve                                                  # python -m pipeline.serve: the embedded default
    python -m pipeline.serve serve.policy=blockpilot run_name=main   # B per request from `make train`'s predictor
    python -m pipeline.serve serve.record=true                  # also label served requests -> data/labels/served

    curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

See ``pipeline.serving`` for the routes, the policies and the recorder, and ``conf/serve.yaml``.
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
    from pipeline.labeling.latency import LatencyModel, measure_latency_cached
    from pipeline.labeling.oracle import check_candidates
    from pipeline.labeling.runner import latency_identity, load_latency
    from pipeline.labeling.store import LabelStore
    from pipeline.prompts import template_kwargs_of
    from pipeline.serving.recorder import Recorder

    if decoder.drafter is None:
        raise ValueError("serve.record=true needs a drafter (model.drafter): replay labels are drafter replays")
    candidates = check_candidates(list(cfg.label.block_sizes), decoder)
    temperature = float(cfg.decode.temperature)
    stored = LabelStore(cfg.serve.record_dir, create=False).read_meta() if cfg.serve.record_dir else None
    if stored and stored.get("latency_model"):
        latency = LatencyModel.from_dict(stored["latency_model"])
    elif cfg.serve.get("latency_path"):
        latency = load_latency(cfg.serve.latency_path)
    else:
        log.info("serve.record: measuring the latency model once for %s (label.latency)", cfg.serve.record_dir)
        latency = measure_latency_cached(decoder, candidates, list(cfg.label.latency.context_buckets),
                                         int(cfg.label.latency.repeats), temperature, int(cfg.seed),
                                         cfg.label.latency.get("cache"), latency_identity(cfg.model))
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


def build_engine(cfg: DictConfig, decoder=None):
    """The serving ``Engine`` of ``cfg`` (``conf/serve.yaml``): decoder (default ``build_decoder(cfg.model)``),
    policy, recorder.

    Raises:
        ValueError / FileNotFoundError: for a policy or recorder that cannot run (see ``build_policy``, ``build_recorder``).
    """
    from pipeline.models.loading import build_decoder, resolve_path
    from pipeline.serving.engine import Engine, build_policy

    s = cfg.serve
    decoder = decoder or build_decoder(cfg.model)
    predictor_dir = resolve_path(str(s.predictor_dir)) if s.get("predictor_dir") else None
    width = verify_width_options(cfg, decoder) if str(s.policy) == "verify_width" else None
    policy = build_policy(str(s.policy), decoder, s.get("block_size"), predictor_dir, list(cfg.model.candidates), s.get("ema"),
                          width)
    return Engine(decoder, policy, str(s.model_name), int(s.max_queue), int(s.default_max_tokens), int(s.max_tokens),
                  int(cfg.decode.seed), build_recorder(cfg, decoder), float(cfg.decode.temperature))


def verify_width_options(cfg: DictConfig, decoder) -> dict:
    """``serve.policy=verify_width``'s calibration (``serve.verify_width.calibration``, else the run's
    ``predictors/<run_name>/verify_width``, else the drafter folder's) and this machine's latency model (measured at
    startup for widths up to B and the candidates, or reused from the cache the label and eval stages share).

    Raises:
        FileNotFoundError: without a calibration (names the train stage).
    """
    from pathlib import Path

    from pipeline.labeling.runner import latency_identity
    from pipeline.policy.verify_width import find_calibration, load_calibration, load_cost_model

    vw = cfg.serve.get("verify_width") or {}
    run_dir = Path(cfg.paths.data) / "predictors" / str(cfg.run_name) / "verify_width"
    calibration = load_calibration(find_calibration(vw.get("calibration"), run_dir, cfg.model.get("drafter")))
    b = int(cfg.serve.get("block_size") or decoder.drafter.block_size)
    latency = load_cost_model(decoder, vw.get("latency"), [*cfg.model.candidates, b], cfg.decode.temperature, cfg.seed,
                              latency_identity(cfg.model))
    return {"calibration": calibration, "latency": latency, "skip_drafts": bool(vw.get("skip_drafts", True)),
            "max_skip": int(vw.get("max_skip", 8)), "objective": str(vw.get("objective", "rate"))}


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    import torch
    import uvicorn

    from pipeline.decoding import DecodeConfig
    from pipeline.prompts import messages_input_ids
    from pipeline.serving.app import create_app

    if cfg.serve.get("num_threads"):
        torch.set_num_threads(int(cfg.serve.num_threads))
    engine = build_engine(cfg)
    if cfg.serve.get("warmup", True):
        ids = messages_input_ids(engine.tokenizer, [{"role": "user", "content": "Hello"}])
        engine.decoder.generate(ids, engine.policy.make(), DecodeConfig(8, 0.0, 0))
    log.info("serving %s with policy %s on http://%s:%d (queue %d%s)", engine.model_name, engine.policy.name, cfg.serve.host,
             int(cfg.serve.port), engine.max_queue, f", recording to {cfg.serve.record_dir}" if engine.recorder else "")
    try:
        uvicorn.run(create_app(engine), host=str(cfg.serve.host), port=int(cfg.serve.port), log_level="info")
    finally:
        engine.close()
        if engine.recorder is not None:
            log.info("recorder: %s", engine.recorder.stats())


if __name__ == "__main__":
    main()
