"""The configuration checks every stage shares, run before any model loads: block sizes, temperature, device, the
``model``, ``decode`` and ``data`` groups (``check_common``).

Each package checks its own stage's groups on top of these (``pipeline.labeling.checks``,
``pipeline.evaluation.checks``, ``pipeline.serving.checks``, ``pipeline.drafting.checks``, ``pipeline.policy.checks``);
``pipeline.config_checks.validate_config`` picks the one of a stage. A bad value (``model.candidates=[0,8]``,
``decode.block_size=-2``, ``decode.temperature=nan``) fails in milliseconds with a message naming the key and the
fix, not after loading a target and decoding. Checks that need the loaded models (a block size beyond the drafter's
limit, a predictor's vocabulary) stay with the code that loads them.
"""

from __future__ import annotations

import math
from typing import Any

def is_int(value: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_block_size_value(value: Any, key: str) -> int:
    """``value`` as a block size B >= 1 (tokens).

    Raises:
        ValueError: for a non-integer or B < 1 (0 included), naming ``key``.
    """
    if not is_int(value) or value < 1:
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


def check_model(model, loads_model: bool) -> None:
    """The ``model`` group: ``model.device`` (when the stage loads the target: one this PyTorch can run on),
    ``model.chat_template_kwargs`` (a mapping or null), ``model.candidates`` (distinct integers >= 1) and
    ``model.training_block_size`` (null or >= 1).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    from pipeline.prompts import template_kwargs_of

    if loads_model and model.get("device") is not None:
        check_device(model.device)
    if model.get("precision", "auto") not in (None, "auto", "exact"):
        from pipeline.models.native import check_precision

        check_precision(str(model.precision))
    if model.get("kv_cache_dtype", "auto") not in (None, "auto"):
        from pipeline.models.native import check_kv_dtype

        check_kv_dtype(str(model.kv_cache_dtype))
    if model.get("draft_precision", "auto") not in (None, "auto"):
        from pipeline.models.native import resolve_draft_precision

        resolve_draft_precision(str(model.draft_precision))
    template_kwargs_of(model)  # a mapping or null
    if model.get("candidates") is not None:
        check_block_sizes(model.get("candidates"), "model.candidates")
        if model.get("training_block_size") is not None:
            check_block_size_value(model.training_block_size, "model.training_block_size")


def check_decode(decode) -> None:
    """The ``decode`` group: ``max_new_tokens`` (>= 1), ``temperature`` (finite, >= 0), ``seed`` (an integer),
    ``block_size`` (null or >= 1; 0 is not "default").

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    if not is_int(decode.get("max_new_tokens")) or decode.max_new_tokens < 1:
        raise ValueError(f"decode.max_new_tokens={decode.get('max_new_tokens')!r}: must be an integer >= 1")
    check_temperature(decode.get("temperature", 0.0))
    if not is_int(decode.get("seed", 0)):
        raise ValueError(f"decode.seed={decode.get('seed')!r}: must be an integer")
    if decode.get("block_size") is not None:
        check_block_size_value(decode.block_size, "decode.block_size")


def check_data(data) -> None:
    """The ``data`` group: ``data.limit`` (null or >= 0), ``data.missing`` (``error`` or ``skip``) and
    ``data.skipped_to`` (null or a set's name; one that names none of ``data.sets`` has no effect, so the demo's
    HumanEval default stays harmless under ``data=gsm8k``).

    Raises:
        ValueError: for a bad value, naming the key and the fix.
    """
    if data.get("limit") is not None and (not is_int(data.limit) or data.limit < 0):
        raise ValueError(f"data.limit={data.limit!r}: must be null (all prompts) or an integer >= 0")
    from pipeline.prompts import MISSING

    missing = data.get("missing", "error")
    if str(missing) not in MISSING:
        raise ValueError(f"data.missing={missing!r}: choose error (a set that cannot be loaded stops the stage) or skip "
                         "(warn and go on with the sets there are)")
    skipped_to = data.get("skipped_to")
    if skipped_to is not None and not isinstance(skipped_to, str):
        raise ValueError(f"data.skipped_to={skipped_to!r}: the name of the set that takes a skipped set's share of "
                         "prompts, or null")


def check_common(cfg, loads_model: bool) -> None:
    """The groups every stage shares, where they exist: ``model`` (``check_model``; its device only when
    ``loads_model``), ``decode`` (``check_decode``) and ``data`` (``check_data``).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    if cfg.get("model") is not None:
        check_model(cfg.model, loads_model)
    if cfg.get("decode") is not None:
        check_decode(cfg.decode)
    if cfg.get("data") is not None:
        check_data(cfg.data)
