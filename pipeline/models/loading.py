"""Load the target and drafter of the ``model`` config group (the decoder over them: ``pipeline.decoding.build_decoder``)."""

from __future__ import annotations

from pathlib import Path

from pipeline import PROJECT_ROOT
from pipeline.models.drafter import DFlashDrafter
from pipeline.models.target import Target, load_target, resolve_dtype
from pipeline.prompts import set_chat_template_kwargs, template_kwargs_of


def resolve_path(path: str | None) -> str | None:
    """Relative paths in configs are relative to the project root (Hydra changes the cwd)."""
    if path is None:
        return None
    candidate = PROJECT_ROOT / path
    return str(candidate) if not Path(path).is_absolute() and candidate.exists() else str(path)


def load_models(model_cfg) -> tuple[Target, DFlashDrafter | None]:
    """Load ``model_cfg.target`` and ``model_cfg.drafter`` (null for none) on ``model_cfg.device``; the tokenizer
    builds every prompt with ``model_cfg.chat_template_kwargs`` (``pipeline.prompts.set_chat_template_kwargs``).

    Raises:
        ValueError: when the drafter does not fit the target.
    """
    target = load_target(resolve_path(model_cfg.target) if model_cfg.target != "smollm2-135m-instruct" else model_cfg.target,
                         dtype=model_cfg.dtype, device=model_cfg.device,
                         attn_implementation=model_cfg.get("attn_implementation", "sdpa"))
    set_chat_template_kwargs(target.tokenizer, template_kwargs_of(model_cfg))  # e.g. Qwen3's enable_thinking: false
    drafter = None
    if model_cfg.get("drafter"):
        drafter = DFlashDrafter.from_pretrained(resolve_path(model_cfg.drafter), dtype=resolve_dtype(model_cfg.dtype),
                                                device=model_cfg.device)
    return target, drafter

