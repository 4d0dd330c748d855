"""Position-keyed sampling: every token is a Gumbel-max draw whose noise depends only on (seed, position).

With T>0 the token at absolute position p is ``argmax(logits_p / T + G(seed, p))``; ``G`` is i.i.d.
standard Gumbel noise regenerated from a generator seeded by (seed, p). Each token is an exact draw from
softmax(logits_p / T), and because the noise does not depend on how tokens were grouped into blocks,
the sampled text is the same for every block size B. The drafter proposes with the same noise
(coupled proposals), so a draft token is accepted exactly when it equals the target's token.
At T=0 the token is the argmax.
"""

from __future__ import annotations

import math

import torch


class PositionKeyedSampler:
    """Picks tokens from logits with noise keyed by (seed, absolute position).

    Args:
        temperature: 0 for greedy, > 0 for sampling.
        seed: request seed.
        vocab_size: V, the logits' last dimension.

    Raises:
        ValueError: for a negative, NaN or infinite temperature.
    """

    def __init__(self, temperature: float, seed: int, vocab_size: int):
        if not math.isfinite(float(temperature)) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        self.temperature = float(temperature)
        self.seed = int(seed) if abs(int(seed)) <= 1 << 43 else int(seed) % (1 << 43)  # seed * 1_000_003 + position fits int64
        self.vocab_size = vocab_size
        self._noise: dict[int, torch.Tensor] = {}

    def gumbel(self, position: int) -> torch.Tensor:
        """Standard Gumbel noise [V] (float32, CPU) for one absolute position, cached per request."""
        noise = self._noise.get(position)
        if noise is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
            noise = -torch.empty(self.vocab_size).exponential_(generator=generator).log_()
            self._noise[position] = noise
        return noise

    def pick(self, logits: torch.Tensor, first_position: int, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens for consecutive positions.

        Args:
            logits: [n, V'] ; row i scores the token at absolute position ``first_position + i``.
            vocab_ids: [V'] target token ids of the logits' columns when they cover a sub-vocabulary
                (a drafter's draft vocabulary); None when V' = V.
        Returns:
            [n] token ids (long, on ``logits``' device).
        """
        index = self.pick_columns(logits, first_position, vocab_ids)
        return index if vocab_ids is None else vocab_ids[index]

    def pick_columns(self, logits: torch.Tensor, first_position: int, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Like ``pick``, but the [n] columns of ``logits`` picked (indices into ``vocab_ids`` when given)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        noise = torch.stack([self.gumbel(first_position + i) for i in range(logits.shape[0])]).to(logits.device)
        if vocab_ids is not None:
            noise = noise[:, vocab_ids]
        return (logits.float() / self.temperature + noise).argmax(dim=-1)


def draft_confidence(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
    """The drafter's probability of each proposed token: ``softmax(logits / T)[index]`` (T=0 reads T=1).

    The per-position signal the verify-width policy calibrates (``pipeline.policy.verify_width``); the
    decoder and the label stage's replays compute it with this one function.

    Args:
        logits: [R, V'] float drafter logits (over its draft vocabulary when it has one).
        index: [R] column of the proposed token in ``logits`` (long).
        temperature: the request's temperature (0 = greedy).
    Returns:
        [R] float32 probabilities in (0, 1].
    """
    scaled = logits.float() / (float(temperature) if temperature > 0 else 1.0)
    picked = scaled.gather(-1, index.reshape(-1, 1).to(scaled.device))[:, 0]
    return (picked - torch.logsumexp(scaled, dim=-1)).exp()
