"""Lightning module that trains a block-size predictor on prefill-distribution features.

A batch holds ``x`` [b, d] (and ``ids``/``id_weights`` [b, k] for id features), ``tau`` [b, C] (the
recorded mean acceptance length of each candidate block size, tokens), ``reward`` [b, C] (what the
objective maximises: ``tau``, or tokens/s scaled per prompt) and ``label`` [b] (class index of the
best candidate). Objectives:

  * ``hard``: cross-entropy on ``label``;
  * ``soft``: cross-entropy to ``softmax(reward / temperature)`` (near-ties share probability);
  * ``reward``: maximise the expected reward ``sum_B pi(B) reward(B)`` under the softmax policy pi.

Validation logs ``val/expected_tau`` (E_pi[tau], early stopping's monitor), ``val/pick_tau`` (tau of the
argmax pick, what the decoder gets), ``val/acc``, ``val/oracle_tau`` and ``val/loss``.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

OBJECTIVES = ("hard", "soft", "reward")


def policy_loss(logits: torch.Tensor, batch: dict, objective: str, temperature: float) -> torch.Tensor:
    """Loss of scores ``logits`` [b, C] for one objective (see the module docstring).

    Raises:
        ValueError: for an unknown objective or a non-positive temperature with ``soft``.
    """
    if objective == "hard":
        return F.cross_entropy(logits, batch["label"])
    if objective == "soft":
        if temperature <= 0:
            raise ValueError(f"train.temperature must be > 0 for the soft objective, got {temperature}")
        return F.cross_entropy(logits, torch.softmax(batch["reward"].float() / temperature, dim=-1))
    if objective == "reward":
        return -(torch.softmax(logits, dim=-1) * batch["reward"].float()).sum(-1).mean()
    raise ValueError(f"train.objective must be one of {OBJECTIVES}, got {objective!r}")


@torch.no_grad()
def policy_metrics(logits: torch.Tensor, tau: torch.Tensor, label: torch.Tensor, fixed_index: int | None = None,
                   pick: torch.Tensor | None = None) -> dict[str, float]:
    """Offline quality of a policy over prompts.

    Args:
        logits: [n, C] predictor scores; tau: [n, C] recorded tau per candidate (tokens);
        label: [n] best-candidate index; fixed_index: index of the training block size among the candidates;
        pick: [n] chosen class indices (default: the argmax of ``logits``; the train stage passes the
        confidence-fallback picks).
    Returns:
        ``expected_tau`` (E_softmax[tau]), ``pick_tau`` (tau of the pick), ``oracle_tau`` (row max),
        ``acc`` (pick == label), ``departure_rate`` (pick != ``fixed_index``; NaN without it), and with
        ``fixed_index``: ``fixed_tau`` and ``oracle_gain_share`` ((pick - fixed) / (oracle - fixed), NaN
        when the oracle gains nothing). Means over prompts.
    """
    tau = tau.float()
    pick = logits.argmax(-1) if pick is None else pick
    out = {
        "expected_tau": float((torch.softmax(logits.float(), -1) * tau).sum(-1).mean()),
        "pick_tau": float(tau.gather(1, pick[:, None]).mean()),
        "departure_rate": float((pick != fixed_index).float().mean()) if fixed_index is not None else float("nan"),
        "oracle_tau": float(tau.max(-1).values.mean()),
        "acc": float((pick == label).float().mean()),
    }
    if fixed_index is not None:
        fixed = float(tau[:, fixed_index].mean())
        gain = out["oracle_tau"] - fixed
        out["fixed_tau"] = fixed
        out["oracle_gain_share"] = (out["pick_tau"] - fixed) / gain if gain > 1e-9 else float("nan")
    return out


class PolicyModule(L.LightningModule):
    """Trains ``net`` (a ``pipeline.policy.predictors`` model) with AdamW.

    Args:
        net: maps (x, ids, id_weights) to scores [b, C].
        objective: ``hard`` | ``soft`` | ``reward``.
        temperature: softmax temperature of the ``soft`` targets (tokens of tau).
        lr, weight_decay: AdamW settings.
    Raises:
        ValueError: for an unknown objective.
    """

    def __init__(self, net: nn.Module, objective: str = "soft", temperature: float = 0.25, lr: float = 3e-3,
                 weight_decay: float = 1e-4):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"train.objective must be one of {OBJECTIVES}, got {objective!r}")
        self.net = net
        self.objective, self.temperature = objective, float(temperature)
        self.lr, self.weight_decay = float(lr), float(weight_decay)

    def forward(self, batch: dict) -> torch.Tensor:
        """Scores [b, C] of a feature batch."""
        return self.net(batch["x"], batch.get("ids"), batch.get("id_weights"))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = policy_loss(logits, batch, self.objective, self.temperature)
        self.log("train/loss", loss, prog_bar=True, batch_size=logits.shape[0])
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits = self(batch)
        n = logits.shape[0]
        metrics = policy_metrics(logits, batch["tau"], batch["label"])
        self.log("val/loss", policy_loss(logits, batch, self.objective, self.temperature), batch_size=n)
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, batch_size=n, prog_bar=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
