"""Predictor export format, read by the decoder's ``PredictorSchedule``.

A predictor directory holds:
  * ``predictor.safetensors``: the net's state dict (float32, normalisation buffers included);
  * ``predictor.json``: ``format``/``version``, ``arch`` + ``arch_config`` (constructor arguments),
    ``features`` (the ``FeatureSpec``), ``candidates`` (block sizes, class order), ``training_block_size``,
    ``target``/``drafter`` ids, ``target_label`` (``tau``|``speed``), ``objective``, ``num_parameters``,
    ``metrics`` and ``inference_ms`` (measured at export), ``fallback`` (``{"block_size", "margin"}``, the
    confidence fallback of ``pipeline.policy.fallback``; absent or null = plain argmax), plus anything else
    passed as ``meta``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.files import atomic_dir
from pipeline.policy.fallback import apply_fallback
from pipeline.policy.features import Featurizer, FeatureSpec
from pipeline.policy.predictors import build_predictor, num_parameters

FORMAT = "blockpilot-predictor"
VERSION = 1
WEIGHTS = "predictor.safetensors"
CONFIG = "predictor.json"


@dataclass
class Predictor:
    """A loaded predictor: featurizer + net + the candidate block sizes it chooses from.

    Attributes:
        net: the predictor net (eval mode); featurizer: turns a logits row into its input;
        candidates: block sizes (tokens), in class order; meta: the parsed ``predictor.json``.
    """

    net: nn.Module
    featurizer: Featurizer
    candidates: list[int]
    meta: dict

    def __post_init__(self) -> None:
        """Check the candidates against the net and the fallback against the candidates.

        Raises:
            ValueError: for duplicate candidates, a class count that differs from the number of candidates, or a
                fallback block size that is not a candidate (the safety fallback would silently not apply).
        """
        self.candidates = [int(c) for c in self.candidates]
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"predictor candidates {self.candidates} must be distinct block sizes, one per class")
        classes = getattr(self.net, "config", {}).get("num_classes")
        if classes is not None and int(classes) != len(self.candidates):
            raise ValueError(f"predictor net has {classes} classes but {len(self.candidates)} candidates "
                             f"{self.candidates}: its {CONFIG} does not belong to these weights; re-export it with make train")
        fallback = self.meta.get("fallback")
        if fallback and int(fallback["block_size"]) not in self.candidates:
            raise ValueError(f"predictor fallback block size {fallback['block_size']} is not one of its candidates "
                             f"{self.candidates}, so the safety fallback could never apply; re-export it with make train")

    @property
    def name(self) -> str:
        return str(self.meta.get("name", self.meta.get("arch", "predictor")))

    @torch.inference_mode()
    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Class scores [b, C] for target logits [V] or [b, V] (computed on the net's device)."""
        device = next(self.net.parameters()).device
        features = self.featurizer.from_logits(logits.to(device))
        return self.net(features["x"], features.get("ids"), features.get("id_weights"))

    def choose(self, scores: torch.Tensor) -> list[int]:
        """Block sizes (tokens) for scores [b, C]: the argmax, or with a ``fallback`` entry in ``meta``
        (``{"block_size", "margin"}``, set by the train stage) the rule of ``pipeline.policy.fallback``."""
        fallback = self.meta.get("fallback")
        if fallback:  # a fallback block size among the candidates (checked in __post_init__)
            index = apply_fallback(scores, self.candidates.index(int(fallback["block_size"])), float(fallback["margin"]))
        else:
            index = scores.argmax(-1)
        return [self.candidates[i] for i in index.tolist()]

    def predict(self, logits: torch.Tensor) -> int:
        """The chosen block size B (tokens) for one prefill logits row [V]."""
        return self.choose(self.scores(logits))[0]

    def predict_batch(self, logits: torch.Tensor) -> list[int]:
        """Chosen block sizes for logits rows [b, V]."""
        return self.choose(self.scores(logits))


def export_predictor(out: str | Path, net: nn.Module, spec: FeatureSpec, candidates: list[int], meta: dict | None = None) -> Path:
    """Write ``predictor.safetensors`` + ``predictor.json`` into ``out`` atomically (a temp dir renamed into place).

    Args:
        net: a ``pipeline.policy.predictors`` model (has ``arch`` and ``config``).
        spec: the features it was trained on (``vocab_size`` filled in).
        candidates: block sizes in class order.
        meta: extra JSON-ready fields (target, drafter, training_block_size, metrics, ...).
    Returns:
        ``out``.
    """
    out = Path(out)
    with atomic_dir(out) as tmp:
        state = {k: v.detach().float().cpu().contiguous() for k, v in net.state_dict().items()}
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        config = {"format": FORMAT, "version": VERSION, "arch": net.arch, "arch_config": net.config,
                  "features": spec.to_dict(), "candidates": [int(c) for c in candidates],
                  "num_parameters": num_parameters(net), **(meta or {})}
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, default=float) + "\n")
    return out


def load_predictor(directory: str | Path, device: str | torch.device = "cpu") -> Predictor:
    """Load an exported predictor.

    Raises:
        FileNotFoundError: when ``directory`` lacks the two files (names ``make train``).
        ValueError: for a file of another format or version, weights that do not fit ``arch_config``, a candidate
            list whose length differs from the net's classes, or a fallback block size outside the candidates.
    """
    directory = Path(directory)
    if not (directory / CONFIG).exists() or not (directory / WEIGHTS).exists():
        raise FileNotFoundError(f"no predictor at {directory} ({CONFIG} + {WEIGHTS}); run the train stage first: "
                                "make train (python -m pipeline.train)")
    meta = json.loads((directory / CONFIG).read_text())
    if meta.get("format") != FORMAT or int(meta.get("version", -1)) != VERSION:
        raise ValueError(f"{directory / CONFIG} is not a {FORMAT} v{VERSION} file; re-export it with make train")
    cfg = dict(meta["arch_config"])
    net = build_predictor(meta["arch"], cfg.pop("in_dim"), cfg.pop("num_classes"), **cfg)
    try:
        net.load_state_dict(load_file(directory / WEIGHTS))
    except RuntimeError as err:
        raise ValueError(f"{directory / WEIGHTS} does not fit the net described in {directory / CONFIG} "
                         f"(arch {meta['arch']!r}, {meta['arch_config']}): {str(err).splitlines()[-1].strip()}; "
                         "the two files come from different exports, re-export with make train") from err
    net.to(device).eval()
    try:
        return Predictor(net, Featurizer(FeatureSpec.from_dict(meta["features"])), [int(c) for c in meta["candidates"]], meta)
    except ValueError as err:
        raise ValueError(f"{directory / CONFIG}: {err}") from err
