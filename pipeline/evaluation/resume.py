"""The resume log of an eval run: per-prompt rows appended to ``rows.jsonl`` as each prompt finishes (``RowLog``),
valid only for the settings they were made with (``row_settings``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.evaluation.inputs import WIDTH_METHODS, EvalInputs
from pipeline.files import move_aside, write_atomic

log = logging.getLogger(__name__)


class RowLog:
    """Per-prompt rows of one eval run in a JSONL file, appended one line per finished prompt (resume after a kill).

    Line 1 is ``{"settings": ...}`` (what the rows depend on); each later line is ``{"id", "rows": {method: row}}``
    or ``{"id", "skipped": reason}``. A line is written with one ``write`` + ``fsync``; a line cut by a kill is
    dropped on the next open. Opening with other settings moves the old file to ``<name>.old`` and starts afresh.

    Args:
        path: the JSONL file (``rows.jsonl`` beside ``results.json``); None keeps nothing (no resume).
        settings: JSON-ready settings the rows depend on.
    """

    def __init__(self, path: str | Path | None, settings: dict):
        self.path = Path(path) if path is not None else None
        self.done: dict[str, dict] = {}
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = json.dumps({"settings": settings}, sort_keys=True)
        lines = self.path.read_text().split("\n") if self.path.exists() else []
        complete = []
        for line in lines[:-1]:  # the text after the last newline is empty or a cut line
            try:
                complete.append((line, json.loads(line)))
            except json.JSONDecodeError:
                log.warning("%s: dropping an unreadable line", self.path)
        if complete and complete[0][1].get("settings") != json.loads(header)["settings"]:
            log.warning("%s holds rows of other settings; moving it to %s and starting afresh", self.path,
                        self.path.name + ".old")
            move_aside(self.path, self.path.with_name(self.path.name + ".old"))
            complete = []
        for _, entry in complete[1:]:
            self.done[str(entry["id"])] = entry
        write_atomic(self.path, "".join(line + "\n" for line in [header] + [raw for raw, _ in complete[1:]]))
        if self.done:
            log.info("%s: resuming, %d prompts already done", self.path, len(self.done))

    def append(self, entry: dict) -> None:
        """Record one finished (or skipped) prompt."""
        self.done[str(entry["id"])] = entry
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


def row_settings(cfg: DictConfig, methods: list[str], split: str | None, inputs: EvalInputs | None = None,
                 decoder=None) -> dict:
    """What the per-prompt rows of an eval run depend on (a resumed run must match it): the methods, decoding and
    model settings, the methods' options (``policy``), the decoder's forward path (backend with its kernel's version,
    fast forward, KV cache: the rows hold timings), the drafter's weight files (size, mtime) and digests of the loaded
    predictors, labels and calibration (a retrained drafter or predictor invalidates the rows)."""

    def digest(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def weights_stamp(path) -> list | None:  # a checkpoint retrained in place invalidates the rows too
        from pipeline.models.loading import resolve_path

        directory = Path(resolve_path(str(path))) if path else None
        if directory is None or not directory.is_dir():
            return None
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(directory.glob("*.safetensors"))]

    keep = ("target", "drafter", "dtype", "device", "attn_implementation")
    loaded = {"drafter_weights": weights_stamp(cfg.model.get("drafter"))}
    if inputs is not None:
        loaded.update({m: digest(p.meta) for m, p in inputs.predictors.items()})
        if inputs.labels is not None:
            loaded["labels"] = digest(inputs.labels[["id", "label_tau", "label_speed"]].astype(str).values.tolist())
    forward = decoder.forward_path() if decoder is not None else None
    policy = OmegaConf.to_container(cfg.policy, resolve=True) if cfg.get("policy") is not None else {}
    if not any(m in WIDTH_METHODS for m in methods):
        policy.pop("verify_width", None)
    return {"loaded": loaded, "methods": list(methods), "split": split, "forward": forward,
            "decode": OmegaConf.to_container(cfg.decode, resolve=True),
            "model": {k: cfg.model.get(k) for k in keep},
            "share_decodes": bool(cfg.eval.get("share_decodes", True)), "target": str(cfg.eval.get("target", "tau")),
            "labels_dir": str(cfg.eval.labels_dir), "predictor_dir": str(cfg.eval.predictor_dir), "policy": policy,
            "calibration": digest(inputs.calibration.to_dict()) if inputs is not None and inputs.calibration is not None else None}
