"""Block-size predictors: small nets from prefill-distribution features to scores over candidate block sizes.

  * ``MLPPredictor`` (``predictor=mlp``, the BlockPilot policy): standardised dense features, plus an
    optional hashed embedding of the top-k token ids weighted by their probabilities, through an MLP.
    Default size ~22k parameters; ``conf/predictor/mlp.yaml`` caps it at 1M.
  * ``FullVocabPredictor`` (``predictor=full_vocab``, the paper's shape): Linear(V -> hidden) ->
    one residual layer -> Linear(hidden -> classes) over the full-vocabulary row.

Both map ``x`` [b, d] (and for ids ``ids``/``id_weights`` [b, k]) to logits [b, C], C = number of
candidate block sizes, and keep their input normalisation as buffers so an export is self-contained.
"""

from __future__ import annotations

import torch
from torch import nn


class Standardize(nn.Module):
    """(x - mean) / std with buffers ``mean``/``std`` [d] (identity until ``fit``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    @torch.no_grad()
    def fit(self, x: torch.Tensor, eps: float = 1e-6) -> None:
        """Set the statistics from training features x [n, d] (columns with no spread keep std 1)."""
        x = x.float()
        self.mean.copy_(x.mean(0))
        std = x.std(0, unbiased=False)
        self.std.copy_(torch.where(std > eps, std, torch.ones_like(std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean) / self.std


class MLPPredictor(nn.Module):
    """MLP over dense features (+ optional hashed top-k id embeddings).

    Args:
        in_dim: d, the length of ``x``.
        num_classes: C, the number of candidate block sizes.
        hidden: width of the hidden layers.
        num_layers: number of hidden layers (>= 1).
        dropout: dropout after each hidden layer (training only).
        id_buckets: 0 = no id input; else token ids are hashed (``id % id_buckets``) into this many embeddings.
        id_dim: embedding width of the ids.
        normalize: standardise ``x`` with statistics set by ``fit_normalization``.
    """

    arch = "mlp"

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 128, num_layers: int = 2, dropout: float = 0.1,
                 id_buckets: int = 0, id_dim: int = 16, normalize: bool = True):
        super().__init__()
        if num_layers < 1 or hidden < 1:
            raise ValueError(f"predictor needs num_layers >= 1 and hidden >= 1, got {num_layers}, {hidden}")
        self.config = dict(in_dim=int(in_dim), num_classes=int(num_classes), hidden=int(hidden), num_layers=int(num_layers),
                           dropout=float(dropout), id_buckets=int(id_buckets), id_dim=int(id_dim), normalize=bool(normalize))
        self.norm = Standardize(in_dim)
        self.normalize = normalize
        self.id_embed = nn.EmbeddingBag(id_buckets, id_dim, mode="sum") if id_buckets else None
        width = in_dim + (id_dim if id_buckets else 0)
        layers: list[nn.Module] = []
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.mlp = nn.Sequential(*layers)

    def fit_normalization(self, x: torch.Tensor) -> None:
        """Standardisation statistics from the training features x [n, d] (no-op if ``normalize`` is off)."""
        if self.normalize:
            self.norm.fit(x)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None, id_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [b, C] from ``x`` [b, d] (and ``ids``/``id_weights`` [b, k] when built with ``id_buckets``).

        Raises:
            ValueError: when the predictor embeds ids but none are given.
        """
        h = self.norm(x)
        if self.id_embed is not None:
            if ids is None:
                raise ValueError("this predictor embeds top-k token ids; pass features built with the 'ids' part")
            w = id_weights.float() if id_weights is not None else None
            h = torch.cat([h, self.id_embed(ids.long() % self.id_embed.num_embeddings, per_sample_weights=w)], dim=-1)
        return self.mlp(h)


class FullVocabPredictor(nn.Module):
    """The paper's full-vocabulary baseline: Linear(V -> hidden) -> residual layer -> Linear(hidden -> C).

    Args:
        in_dim: V, the vocabulary size.
        num_classes: C.
        hidden: width after the input projection.
        dropout: dropout in the residual branch.
        normalize: standardise each vocabulary column (off by default: inputs are probabilities).
    """

    arch = "full_vocab"

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 256, dropout: float = 0.1, normalize: bool = False):
        super().__init__()
        self.config = dict(in_dim=int(in_dim), num_classes=int(num_classes), hidden=int(hidden), dropout=float(dropout),
                           normalize=bool(normalize))
        self.norm = Standardize(in_dim)
        self.normalize = normalize
        self.proj = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU())
        self.residual = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, num_classes)

    def fit_normalization(self, x: torch.Tensor) -> None:
        if self.normalize:
            self.norm.fit(x)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None, id_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [b, C] from the full row ``x`` [b, V] (``ids`` are ignored)."""
        h = self.proj(self.norm(x))
        return self.head(h + self.residual(h))


PREDICTORS = {"mlp": MLPPredictor, "full_vocab": FullVocabPredictor}


def build_predictor(arch: str, in_dim: int, num_classes: int, **kwargs) -> nn.Module:
    """Instantiate a predictor by architecture name (``mlp`` | ``full_vocab``).

    Raises:
        ValueError: for an unknown ``arch``.
    """
    if arch not in PREDICTORS:
        raise ValueError(f"predictor.arch must be one of {sorted(PREDICTORS)}, got {arch!r}")
    return PREDICTORS[arch](in_dim, num_classes, **kwargs)


def num_parameters(net: nn.Module) -> int:
    """Trainable parameter count (buffers excluded)."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad)
