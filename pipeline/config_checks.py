"""Configuration checks that run before any model loads: ``validate_config(cfg, stage)``.

Every stage entry point calls ``validate_config`` first, so a bad value (``model.candidates=[0,8]``,
``decode.block_size=-2``, ``decode.temperature=nan``, an unknown ``eval.methods`` entry) fails in
milliseconds with a message naming the key and the fix, not after loading a target and decoding.
Checks that need the loaded models (a block size beyond the drafter's limit, a predictor's vocabulary)
stay with the code that loads them.
"""

from __future__ import annotations

import math
from typing import Any

STAGES = ("label", "dataset", "train", "eval", "bench_label", "draft", "serve")
MODEL_STAGES = ("label", "eval", "bench_label", "draft", "serve")  # the stages that load the target on model.device


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_block_size_value(value: Any, key: str) -> int:
    """``value`` as a block size B >= 1 (tokens).

    Raises:
        ValueError: for a non-integer or B < 1 (0 included), naming ``key``.
    """
    if not _is_int(value) or value < 1:
        raise ValueError(f"{key}={value!r}: a block size must be an integer >= 1 (1 = autoregressive); "
                         f"set {key} to e.g. 8" + (" or null (the drafter's training block size)" if key == "decode.block_size" else ""))
    return int(value)


def check_block_sizes(values: Any, key: str) -> list[int]:
    """A non-empty list of distinct block sizes >= 1.

    Raises:
        ValueError: for an empty list, a duplicate or a bad entry, naming ``key``.
    """
    if values is None or isinstance(values, (str, int)) or len(values) == 0:
        raise ValueError(f"{key}={values!r}: give a non-empty list of block sizes, e.g. {key}=[6,7,8,9,10]")
    out = [check_block_size_value(v, f"{key} entry") for v in values]
    if len(set(out)) != len(out):
        raise ValueError(f"{key}={out} has duplicates; list each block size once")
    return out


def check_temperature(value: Any, key: str = "decode.temperature") -> float:
    """A finite temperature >= 0 (0 = greedy).

    Raises:
        ValueError: for a negative, NaN or infinite value (NaN passes a ``< 0`` test and would emit token 0 forever).
    """
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r}: the temperature must be a number >= 0 (0 = greedy)") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"{key}={value!r}: the temperature must be a finite number >= 0 (0 = greedy), e.g. {key}=0.7")
    return t


def _check_decode(decode) -> None:
    if not _is_int(decode.get("max_new_tokens")) or decode.max_new_tokens < 1:
        raise ValueError(f"decode.max_new_tokens={decode.get('max_new_tokens')!r}: must be an integer >= 1")
    check_temperature(decode.get("temperature", 0.0))
    if not _is_int(decode.get("seed", 0)):
        raise ValueError(f"decode.seed={decode.get('seed')!r}: must be an integer")
    if decode.get("block_size") is not None:
        check_block_size_value(decode.block_size, "decode.block_size")


def check_device(value: Any, key: str = "model.device") -> str:
    """``value`` as a device this PyTorch can run on (``cpu``, ``cuda``, ``cuda:<i>``, ``mps``).

    Checked before any model loads: on a CPU-only PyTorch build ``model.device=cuda`` would otherwise fail only
    after the target's weights (8 GB for Qwen3-4B) were read.
    Raises:
        ValueError: for a name torch does not know, a CUDA device on a build without CUDA or on a machine where no
            GPU is visible, a CUDA index beyond the visible GPUs, or ``mps`` where MPS is unavailable; the message
            names ``key`` and the fix (``model.device=cpu`` or a CUDA build of torch).
    """
    import torch

    try:
        device = torch.device(str(value))
    except (RuntimeError, TypeError):
        raise ValueError(f"{key}={value!r} is not a device name: use cpu, cuda or cuda:<index>") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ValueError(f"{key}={value}: this PyTorch ({torch.__version__}) is a CPU-only build; set {key}=cpu "
                             f"{'model.dtype=float32 ' if key == 'model.device' else ''}or install a CUDA build of torch "
                             "(https://pytorch.org/get-started/locally/)")
        if not torch.cuda.is_available():
            raise ValueError(f"{key}={value}: PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU on this "
                             f"machine (check nvidia-smi and CUDA_VISIBLE_DEVICES), or set {key}=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{key}={value}: only {torch.cuda.device_count()} GPU(s) visible; use cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"{key}={value}: MPS is not available in this PyTorch on this machine; set {key}=cpu")
    return str(value)


def _check_model(model) -> None:
    check_block_sizes(model.get("candidates"), "model.candidates")
    if model.get("training_block_size") is not None:
        check_block_size_value(model.training_block_size, "model.training_block_size")


def _check_eval(cfg) -> None:
    methods = cfg.eval.get("methods")
    if not methods or isinstance(methods, str):
        raise ValueError(f"eval.methods={methods!r}: give a list, e.g. 'eval.methods=[ar,fixed]'")
    from pipeline.policy.registry import BATCHED, BATCHED_ONLY, EVALUABLE, METHODS

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown eval.methods {unknown}; choose from {list(EVALUABLE)}")
    batched = [m for m in methods if m in BATCHED]
    if batched:
        raise ValueError(f"eval.methods {batched} cannot be evaluated here: {BATCHED_ONLY}")
    _check_policy(cfg)
    split = str(cfg.eval.get("split", "auto") or "all")
    if split not in ("auto", "all", "train", "validation", "test"):
        raise ValueError(f"eval.split must be auto, all, train, validation or test; got {split!r}")


def _check_policy(cfg) -> None:
    """The methods' options (``policy.<method>.*``, conf/policy/default.yaml), shared by eval and serve."""
    policy = cfg.get("policy") or {}
    for m in ("blockpilot", "full_vocab"):
        if m in policy and not (policy.get(m) or {}).get("predictor"):
            raise ValueError(f"policy.{m}.predictor is empty: give the predictor's sub-folder, e.g. policy.{m}.predictor=mlp")
    vw = policy.get("verify_width") or {}
    if vw.get("block_size") is not None and int(vw.block_size) < 2:
        raise ValueError(f"policy.verify_width.block_size={vw.block_size}: the verify-width policy drafts blocks of B >= 2 "
                         "(null: decode.block_size or the drafter's training B)")
    if vw.get("objective") is not None and str(vw.objective) not in ("rate", "marginal"):
        raise ValueError(f"policy.verify_width.objective={vw.objective!r}: choose rate or marginal")
    if vw.get("max_skip") is not None and int(vw.max_skip) < 0:
        raise ValueError(f"policy.verify_width.max_skip={vw.max_skip}: give 0 (never skip drafts) or more steps")


def _check_serve(cfg) -> None:
    """``serve.policy`` (servable; ``budget`` only with ``serve.max_batch > 1`` and a valid ``policy.budget.costs``),
    ``serve.max_batch`` (>= 1), and the policies' options."""
    from pipeline.policy.registry import BATCHED, METHODS, SERVABLE

    serve = cfg.serve
    policy = str(serve.get("policy"))
    if policy not in METHODS:
        raise ValueError(f"unknown serve.policy {policy!r}; choose from {list(SERVABLE)}")
    if METHODS[policy].servable is not None:
        raise ValueError(f"serve.policy={policy} cannot be served: {METHODS[policy].servable}; serve one of {list(SERVABLE)}")
    max_batch = serve.get("max_batch", 1)
    max_batch = 1 if max_batch is None else max_batch
    if not _is_int(max_batch) or max_batch < 1:
        raise ValueError(f"serve.max_batch={max_batch!r}: the most requests decoding together, an integer >= 1 "
                         "(1: one at a time; e.g. serve.max_batch=8 for continuous batching)")
    if policy in BATCHED:
        if max_batch < 2:
            raise ValueError(f"serve.policy={policy} chooses the verify widths of the requests sharing a batched step "
                             f"jointly, and serve.max_batch={max_batch} runs one request at a time: set serve.max_batch=8 "
                             "(continuous batching), or serve serve.policy=verify_width at batch 1")
        from pipeline.costs.batched import check_batch_cost_settings

        check_batch_cost_settings(((cfg.get("policy") or {}).get("budget") or {}).get("costs"), "policy.budget.costs")
    _check_policy(cfg)


def _check_label(cfg) -> None:
    from pipeline.labeling.oracle import MODES
    from pipeline.labeling.replay import LM_HEAD_MODES

    label = cfg.label
    check_block_sizes(label.get("block_sizes"), "label.block_sizes")
    if str(label.get("mode", "replay")) not in MODES:
        raise ValueError(f"label.mode={label.get('mode')!r}: choose one of {list(MODES)}")
    if str(label.get("turns", "all")) not in ("all", "first"):
        raise ValueError(f"label.turns must be 'all' or 'first', got {label.get('turns')!r}")
    if str(label.get("lm_head", "auto")) not in LM_HEAD_MODES:
        raise ValueError(f"label.lm_head={label.get('lm_head')!r}: choose one of {list(LM_HEAD_MODES)}")


def _check_draft(cfg) -> None:
    from omegaconf import OmegaConf

    from pipeline.drafting.module import check_loss

    draft = cfg.draft
    loss = draft.get("loss")
    check_loss(OmegaConf.to_container(loss) if loss is not None else None)
    for s in draft.get("sets") or []:
        temperature = s.get("temperature", 0.0)
        check_temperature(temperature, f"draft.sets[{s.get('name')}].temperature")
        if s.get("source") == "self" and (s.get("limit") is None or not _is_int(s.limit) or s.limit < 1):
            raise ValueError(f"draft.sets[{s.get('name')}]: source: self needs limit >= 1 (how many prompts the "
                             "target writes), e.g. limit: 1024")
        if not str(s.get("source") or "").strip():
            raise ValueError(f"draft.sets[{s.get('name')}] has no source: give a JSONL path, humaneval, hub:<id>, "
                             "stdlib, stdlib_source or self")
    if draft.get("checkpoint_every") is not None and (not _is_int(draft.checkpoint_every) or draft.checkpoint_every < 0):
        raise ValueError(f"draft.checkpoint_every={draft.checkpoint_every!r}: optimizer steps between checkpoints "
                         "(0 or null: none)")


def validate_config(cfg, stage: str) -> None:
    """Check the composed config of ``stage`` before any model or data loads.

    Checks, where the groups exist: ``model.device`` for the stages that load the target (``MODEL_STAGES``: one this
    PyTorch can run on; ``cuda`` on a CPU-only build is refused before the weights load), ``model.candidates`` (distinct integers >= 1), ``decode.max_new_tokens``
    (>= 1), ``decode.temperature`` (finite, >= 0), ``decode.block_size`` (null or >= 1; 0 is not "default"),
    ``data.limit`` (null or >= 0); for ``eval``: every ``eval.methods`` entry is known and each predictor
    method has a ``policy.<method>.predictor`` sub-folder, ``policy.verify_width``, ``eval.split``; for ``label``: ``label.block_sizes``, ``mode``,
    ``turns``, ``lm_head``; for ``draft``: ``draft.loss``, each set's ``temperature`` and a ``source: self``
    set's ``limit``, ``draft.checkpoint_every``; for ``serve``: ``serve.policy`` (servable; ``budget`` only with
    ``serve.max_batch > 1``: the message names ``serve.max_batch=8``), ``serve.max_batch``, ``policy.budget.costs``
    (for budget) and the policies' options.

    Args:
        cfg: the stage's composed ``DictConfig``.
        stage: one of ``STAGES``.
    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
    if stage in MODEL_STAGES and cfg.get("model") is not None and cfg.model.get("device") is not None:
        check_device(cfg.model.device)
    if cfg.get("model") is not None:
        from pipeline.prompts import template_kwargs_of

        template_kwargs_of(cfg.model)  # a mapping or null
    if cfg.get("model") is not None and cfg.model.get("candidates") is not None:
        _check_model(cfg.model)
    if cfg.get("decode") is not None:
        _check_decode(cfg.decode)
    data = cfg.get("data")
    if data is not None and data.get("limit") is not None and (not _is_int(data.limit) or data.limit < 0):
        raise ValueError(f"data.limit={data.limit!r}: must be null (all prompts) or an integer >= 0")
    if stage == "eval":
        _check_eval(cfg)
    if stage == "label":
        _check_label(cfg)
    if stage == "draft" and cfg.get("draft") is not None:
        _check_draft(cfg)
    if stage == "serve" and cfg.get("serve") is not None:
        _check_serve(cfg)
