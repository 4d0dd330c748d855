"""Lightning module that trains a DFlash drafter on cached target features.

Loss: position-decayed cross-entropy, weight exp(-(k-1)/gamma) at block position k = 1..B-1, against
the target's own (greedy) tokens (DFlash, Chen et al. 2026). The target's embedding and LM head are
frozen and shared; only the drafter's layers, ``fc`` and norms train.
Validation reports the teacher-forced acceptance length: per block, 1 + the number of leading
positions whose argmax equals the label, averaged over blocks ("val/tau").
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
from torch.nn import functional as F

from pipeline.drafting.data import block_inputs
from pipeline.models.drafter import DFlashDrafter, lm_head_logits, loss_weights


def init_from_target_layers(drafter: DFlashDrafter, target_model) -> list[int]:
    """Copy the target's top decoder layers into the draft layers (same shapes; q/k norms stay 1).

    Returns:
        the target layer indices copied.
    """
    layers = target_model.base_model.layers
    chosen = list(range(len(layers) - len(drafter.layers), len(layers)))
    for draft_layer, idx in zip(drafter.layers, chosen):
        src = layers[idx].state_dict()
        missing, _ = draft_layer.load_state_dict(src, strict=False)
        assert all("q_norm" in k or "k_norm" in k for k in missing), missing
    return chosen


class DrafterModule(L.LightningModule):
    """Trains ``drafter`` with the frozen target ``embedding`` [V, H] and ``lm_head`` [V, H] weights.

    Args:
        lr, weight_decay, warmup_steps, max_steps: AdamW with linear warm-up and cosine decay.
        max_seconds: optional wall-time budget (s) of training; the cosine decay then follows whichever
            of steps and seconds runs out first, so a run cut by ``trainer.max_time`` still ends at the
            low learning rate.
        gamma: loss decay constant (DFlash uses 7 for B=16; 4 suits B=8).
        eval_block_sizes: block sizes for teacher-forced validation tau.
        target_model: the frozen target (a transformers causal LM), needed only for batches without
            ``features`` (``draft.features=online``): each step then runs one no-grad target forward
            over the batch, in float32 even under mixed precision, and taps the drafter's layers.
    """

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, lr: float = 6e-4,
                 weight_decay: float = 0.01, warmup_steps: int = 50, max_steps: int = 1000, gamma: float = 4.0,
                 eval_block_sizes: tuple[int, ...] = (4, 8, 16), target_model=None, max_seconds: float | None = None):
        super().__init__()
        self.drafter = drafter
        self.target = target_model
        if target_model is not None:
            self.target.requires_grad_(False)
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("lm_head", drafter.draft_head(lm_head.detach()).clone(), persistent=False)
        # target token id -> row of the draft head (-100 for tokens outside the draft vocabulary)
        to_draft = torch.full((lm_head.shape[0],), -100, dtype=torch.long)
        vocab = drafter.draft_vocab if drafter.draft_vocab is not None else torch.arange(lm_head.shape[0])
        to_draft[vocab.cpu()] = torch.arange(len(vocab))
        self.register_buffer("to_draft", to_draft, persistent=False)
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.max_steps, self.gamma = warmup_steps, max_steps, gamma
        self.eval_block_sizes = tuple(eval_block_sizes)
        self.max_seconds = max_seconds
        self._t0: float | None = None

    @torch.no_grad()
    def target_features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Tapped target hidden states [b, L, n_taps*H] (bf16) of right-padded ``tokens`` [b, L] with
        ``lengths`` [b], from one float32 forward of the frozen target (the ``responses`` cache's features).

        Raises:
            ValueError: the module was built without ``target_model``.
        """
        if self.target is None:
            raise ValueError("batch has no features and DrafterModule has no target_model (draft.features=online needs it)")
        tokens, lengths = tokens.to(self.device), lengths.to(self.device)
        mask = (torch.arange(tokens.shape[1], device=self.device)[None] < lengths[:, None]).long()
        with torch.autocast(device_type=self.device.type, enabled=False):
            out = self.target.base_model(input_ids=tokens, attention_mask=mask, output_hidden_states=True)
        return self.drafter.extract_context(out.hidden_states).to(torch.bfloat16)

    def _logits(self, batch: dict, block_size: int):
        inputs = block_inputs(batch, block_size, self.drafter.mask_token_id)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        noise = F.embedding(inputs["block_ids"], self.embedding)
        if "features" in batch:
            features = batch["features"].to(self.device, noise.dtype)
        else:
            features = self.target_features(batch["tokens"], batch["lengths"]).to(noise.dtype)
        hidden = self.drafter(noise, features, inputs["position_ids"], inputs["attention_mask"])
        labels = inputs["labels"]
        b, K = labels.shape[:2]
        hidden = hidden.view(b, K, block_size, -1)[:, :, 1:]
        in_seq = labels >= 0
        labels = torch.where(in_seq, self.to_draft[labels.clamp(min=0)], labels)
        # out-of-draft-vocabulary targets: still count as a block position, never predictable
        labels = torch.where(in_seq & (labels < 0), torch.full_like(labels, -1), labels)
        return hidden, labels

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        B = self.drafter.block_size
        hidden, labels = self._logits(batch, B)
        keep = labels >= 0  # in-sequence and inside the draft vocabulary
        weights = loss_weights(B, self.gamma).to(self.device)[None, None].expand_as(labels)[keep]
        logits = hidden[keep] @ self.lm_head.T
        ce = F.cross_entropy(logits.float(), labels[keep], reduction="none")
        loss = (ce * weights).sum() / weights.sum()
        acc = (logits.argmax(-1) == labels[keep]).float().mean()
        self.log_dict({"train/loss": loss, "train/acc": acc}, prog_bar=True, batch_size=int(keep.sum()))
        return loss

    @torch.no_grad()
    def teacher_forced_tau(self, batch: dict, block_size: int) -> tuple[float, int]:
        """(sum of per-block acceptance lengths, number of full blocks) for one batch at ``block_size``."""
        hidden, labels = self._logits(batch, block_size)
        full = (labels != -100).all(-1)
        if not bool(full.any()):
            return 0.0, 0
        hidden, labels = hidden[full], labels[full]
        pred = lm_head_logits(hidden, self.lm_head).argmax(-1)
        accepted = (pred == labels).int().cumprod(-1).sum(-1)
        return float((accepted + 1).sum()), int(full.sum())

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if "features" not in batch:  # one target pass serves every block size
            batch = {**batch, "features": self.target_features(batch["tokens"], batch["lengths"])}
        for bs in sorted(set(self.eval_block_sizes) | {self.drafter.block_size}):
            total, count = self.teacher_forced_tau(batch, bs)
            if count:
                name = "val/tau" if bs == self.drafter.block_size else f"val/tau_b{bs}"
                self.log(name, total / count, batch_size=count, prog_bar=bs == self.drafter.block_size)

    def configure_optimizers(self):
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.lr, betas=(0.9, 0.95))

        def schedule(step: int) -> float:
            if self._t0 is None:
                self._t0 = time.monotonic()
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            if self.max_seconds:
                progress = max(progress, min(1.0, (time.monotonic() - self._t0) / self.max_seconds))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}}
