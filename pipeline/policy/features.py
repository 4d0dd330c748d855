"""Featurizers of the prefill distribution: the target's predictive distribution at the last prompt token.

The same ``Featurizer`` turns either a live logits row (``from_logits``, used by the decoder's
schedule) or stored label rows (``from_labels``, used by the dataset stage) into identical features,
so the policy sees at inference exactly what it was trained on.

Kinds (``conf/features/``):
  * ``topk``: a dense vector built from the sorted top-k of the distribution, from the parts
    ``probs`` (top-k probabilities, descending, [k]), ``logprobs`` (their log-probabilities, floored at
    ``logprob_floor``, [k]), ``entropy`` (nats over the full vocabulary, [1]) and ``tail`` (probability
    mass outside the top-k, [1]). The part ``ids`` adds the top-k token ids ([k], int64) with their
    probabilities as weights ([k]); predictors embed them (hashed into buckets).
  * ``full_vocab``: the whole [V] row as the paper does, as probabilities (``transform: probs``) or
    floored log-probabilities (``transform: logprobs``). Logits are rounded to float16 first, the
    precision the label stage stores them in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

import numpy as np
import torch

TOPK_PARTS = ("probs", "logprobs", "entropy", "tail", "ids")
KINDS = ("topk", "full_vocab")
TRANSFORMS = ("probs", "logprobs")


@dataclass
class FeatureSpec:
    """What a featurizer computes; saved with datasets and predictors (``to_dict``/``from_dict``).

    Attributes:
        name: the config's name (``topk``, ``topk_ids``, ``full_vocab``...), also the dataset's sub-folder.
        kind: ``topk`` or ``full_vocab``.
        k: number of top entries used by ``topk`` (tokens); must not exceed the label stage's ``label.topk``.
        parts: for ``topk``: a subset of ``probs``, ``logprobs``, ``entropy``, ``tail``, ``ids``.
        transform: for ``full_vocab``: ``probs`` or ``logprobs``.
        logprob_floor: log-probabilities below this are clipped to it (nats).
        vocab_size: V, the logits row length; filled in from the labels by the dataset stage (0 = unknown).
    """

    name: str = "topk"
    kind: str = "topk"
    k: int = 16
    parts: list[str] = field(default_factory=lambda: ["probs", "logprobs", "entropy", "tail"])
    transform: str = "probs"
    logprob_floor: float = -30.0
    vocab_size: int = 0

    def __post_init__(self) -> None:
        self.parts = [str(p) for p in self.parts]
        if self.kind not in KINDS:
            raise ValueError(f"features.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "topk":
            unknown = [p for p in self.parts if p not in TOPK_PARTS]
            if unknown or not self.parts:
                raise ValueError(f"features.parts must be a non-empty subset of {TOPK_PARTS}, got {self.parts}")
            if [p for p in self.parts if p != "ids"] == []:
                raise ValueError("features.parts needs at least one dense part (probs, logprobs, entropy or tail) besides ids")
            if self.k < 1:
                raise ValueError(f"features.k must be >= 1, got {self.k}")
        elif self.transform not in TRANSFORMS:
            raise ValueError(f"features.transform must be one of {TRANSFORMS}, got {self.transform!r}")

    @classmethod
    def from_dict(cls, d: Mapping) -> "FeatureSpec":
        """Build from a config or JSON mapping; unknown keys are ignored."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: (list(v) if k == "parts" else v) for k, v in dict(d).items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def same_features(self, other: "FeatureSpec") -> bool:
        """True when both specs compute the same features (the name and vocab size aside)."""
        a, b = self.to_dict(), other.to_dict()
        for key in ("name", "vocab_size"):
            a.pop(key), b.pop(key)
        if self.kind == "full_vocab":
            a.pop("parts"), b.pop("parts"), a.pop("k"), b.pop("k")
        else:
            a.pop("transform"), b.pop("transform")
        return a == b


class Featurizer:
    """Computes features of the prefill distribution for one ``FeatureSpec``.

    Outputs a dict with ``x`` (float32 [b, dim]) and, when ``uses_ids``, ``ids`` (int64 [b, k]) and
    ``id_weights`` (float32 [b, k], the top-k probabilities).
    """

    def __init__(self, spec: FeatureSpec):
        self.spec = spec

    @property
    def uses_ids(self) -> bool:
        return self.spec.kind == "topk" and "ids" in self.spec.parts

    @property
    def dim(self) -> int:
        """Length of ``x``; for ``full_vocab`` the vocabulary size (raises if still unknown)."""
        if self.spec.kind == "full_vocab":
            if self.spec.vocab_size <= 0:
                raise ValueError("full_vocab features need spec.vocab_size (set from the labels by the dataset stage)")
            return self.spec.vocab_size
        sizes = {"probs": self.spec.k, "logprobs": self.spec.k, "entropy": 1, "tail": 1, "ids": 0}
        return sum(sizes[p] for p in self.spec.parts)

    # -- shared math -------------------------------------------------------------------------------
    def _topk_features(self, top_logprobs: torch.Tensor, top_ids: torch.Tensor | None, entropy: torch.Tensor) -> dict:
        """Features from the top-k log-probs [b, k] (descending), their ids [b, k] and the entropy [b] (nats)."""
        probs = top_logprobs.exp()
        pieces = []
        for part in self.spec.parts:
            if part == "probs":
                pieces.append(probs)
            elif part == "logprobs":
                pieces.append(top_logprobs.clamp(min=self.spec.logprob_floor))
            elif part == "entropy":
                pieces.append(entropy.reshape(-1, 1))
            elif part == "tail":
                pieces.append((1.0 - probs.sum(-1, keepdim=True)).clamp(0.0, 1.0))
        out = {"x": torch.cat(pieces, dim=-1).float()}
        if self.uses_ids:
            out["ids"] = top_ids.long()
            out["id_weights"] = probs.float()
        return out

    # -- runtime ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def from_logits(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Features of live logits.

        Args:
            logits: [V] or [b, V] raw target logits (any float dtype, any device).
        Returns:
            ``{"x": [b, dim] float32, ("ids": [b, k] int64, "id_weights": [b, k] float32)}`` on the
            logits' device.
        Raises:
            ValueError: when V differs from ``spec.vocab_size`` (when known) or V < k.
        """
        logits = logits.reshape(-1, logits.shape[-1])
        V = logits.shape[-1]
        if self.spec.vocab_size and V != self.spec.vocab_size:
            raise ValueError(f"logits have {V} entries but the features were built for a vocabulary of {self.spec.vocab_size}; "
                             "use a predictor trained for this target")
        logprobs = torch.log_softmax(logits.half().float() if self.spec.kind == "full_vocab" else logits.float(), dim=-1)
        if self.spec.kind == "full_vocab":
            x = logprobs.exp() if self.spec.transform == "probs" else logprobs.clamp(min=self.spec.logprob_floor)
            return {"x": x}
        if V < self.spec.k:
            raise ValueError(f"features.k={self.spec.k} exceeds the vocabulary size {V}")
        top = logprobs.topk(self.spec.k, dim=-1)  # sorted, descending
        # -sum p log p; the clamp keeps 0 * log 0 = 0 for masked (-inf) logits (4x cheaper than special.entr)
        entropy = -(logprobs.exp() * logprobs.clamp(min=-1e30)).sum(-1)
        return self._topk_features(top.values, top.indices, entropy)

    # -- dataset ------------------------------------------------------------------------------------
    def from_labels(self, rows) -> dict[str, np.ndarray]:
        """Features of stored label rows (a DataFrame or dicts with the label schema's ``topk_logprobs``, ``topk_ids``, ``entropy``,
        ``full_logits``, ``vocab_size`` columns).

        Returns:
            ``{"x": [n, dim] float32, ("ids": [n, k] int64, "id_weights": [n, k] float32)}``.
        Raises:
            ValueError: when the rows hold fewer than k top entries (raise ``label.topk`` or lower
            ``features.k``), or lack ``full_logits`` for ``full_vocab`` (label with
            ``label.store_full_logits=true``).
        """
        import pandas as pd

        df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        if self.spec.kind == "full_vocab":
            if "full_logits" not in df or df["full_logits"].isna().any():
                raise ValueError("full_vocab features need the full logits row of every prompt: rerun the label stage with "
                                 "label.store_full_logits=true (or pick features=topk)")
            logits = np.stack([np.frombuffer(b, dtype=np.float16) for b in df["full_logits"]]).astype(np.float32)
            return {k: v.numpy() for k, v in self.from_logits(torch.from_numpy(logits)).items()}
        stored = df["topk_logprobs"].map(len).min() if len(df) else self.spec.k
        if stored < self.spec.k:
            raise ValueError(f"labels store the top {stored} log-probabilities but features.k={self.spec.k}; "
                             f"lower features.k or relabel with label.topk>={self.spec.k}")
        k = self.spec.k
        top = torch.tensor(np.array([np.asarray(v[:k], dtype=np.float32) for v in df["topk_logprobs"]]).reshape(-1, k))
        ids = torch.tensor(np.array([np.asarray(v[:k], dtype=np.int64) for v in df["topk_ids"]]).reshape(-1, k)) if self.uses_ids else None
        entropy = torch.tensor(df["entropy"].to_numpy(np.float32))
        return {name: value.numpy() for name, value in self._topk_features(top, ids, entropy).items()}
