"""The draft stage's configuration check (``check_draft_config``), run before the target loads."""

from __future__ import annotations

from pipeline.decoding.checks import check_common, check_temperature, is_int

LOSS_TERMS = ("ce", "tv", "kl")


def check_loss(loss: dict | None) -> dict[str, float]:
    """The loss weights ``{"ce", "tv", "kl"}`` (missing terms 0; None is hard CE alone).

    Raises:
        ValueError: an unknown term, a negative weight, or all weights 0.
    """
    weights = {"ce": 1.0, "tv": 0.0, "kl": 0.0} if loss is None else {k: 0.0 for k in LOSS_TERMS} | dict(loss)
    unknown = set(weights) - set(LOSS_TERMS)
    if unknown:
        raise ValueError(f"draft.loss has unknown terms {sorted(unknown)}: use ce, tv and kl, e.g. {{ce: 0.1, tv: 0.9}}")
    if any(float(v) < 0 for v in weights.values()) or not any(float(v) > 0 for v in weights.values()):
        raise ValueError(f"draft.loss={dict(weights)}: weights must be >= 0 with at least one > 0, e.g. {{ce: 1.0}}")
    return {k: float(v) for k, v in weights.items()}


def check_draft_config(cfg) -> None:
    """Check the composed ``conf/draft.yaml``: the shared groups (``pipeline.decoding.checks.check_common``,
    ``model.device`` included), then ``draft.loss``, each set's ``temperature``, source and (``source: self``)
    ``limit``, and ``draft.checkpoint_every``.

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=True)
    if cfg.get("draft") is None:
        return
    from omegaconf import OmegaConf

    draft = cfg.draft
    loss = draft.get("loss")
    check_loss(OmegaConf.to_container(loss) if loss is not None else None)
    for s in draft.get("sets") or []:
        temperature = s.get("temperature", 0.0)
        check_temperature(temperature, f"draft.sets[{s.get('name')}].temperature")
        if s.get("source") == "self" and (s.get("limit") is None or not is_int(s.limit) or s.limit < 1):
            raise ValueError(f"draft.sets[{s.get('name')}]: source: self needs limit >= 1 (how many prompts the "
                             "target writes), e.g. limit: 1024")
        if not str(s.get("source") or "").strip():
            raise ValueError(f"draft.sets[{s.get('name')}] has no source: give a JSONL path, humaneval, hub:<id>, "
                             "stdlib, stdlib_source or self")
    if draft.get("checkpoint_every") is not None and (not is_int(draft.checkpoint_every) or draft.checkpoint_every < 0):
        raise ValueError(f"draft.checkpoint_every={draft.checkpoint_every!r}: optimizer steps between checkpoints "
                         "(0 or null: none)")
