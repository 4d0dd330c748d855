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

from pipeline.models.kernel import KernelUnavailableError, smallm_kernel


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

    def gumbel(self, position: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Standard Gumbel noise [V] (float32) for one absolute position, cached per request and device.

        Drawn as ``-log(-log(U))`` from uniforms U of a generator of ``device`` (CPU when None) seeded with (seed,
        position): on the CPU 0.15 ms for SmolLM2's 49,152 ids, where ``exponential_`` took 0.84 ms (2026-12-06; the
        noise of every sampled token, so ~14% of a T>0 step went to it); U is kept above float32's smallest normal, so
        no id gets -inf noise. On another device it is drawn there: no [V] row crosses the bus per step (19 MB per
        B=16 step for Qwen3's 151,936-token vocabulary). Each device's noise depends only on (seed, position), so
        outputs stay the same for every block size B on that device; a CUDA run's sampled text differs from a CPU
        run's, and texts sampled before 2026-12-06 (drawn with ``exponential_``) differ from today's.
        """
        device = _normalize(device)
        key = position if device.type == "cpu" else (position, str(device))
        noise = self._noise.get(key)
        if noise is None:
            generator = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + position)
            uniform = torch.rand(self.vocab_size, device=device, generator=generator)
            noise = uniform.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_().log_().neg_()
            self._noise[key] = noise
        return noise

    def noise(self, positions, device: torch.device | str | None = None) -> torch.Tensor:
        """Gumbel rows [n, V] (float32, on ``device``; default CPU) for the absolute ``positions`` (n ints)."""
        return torch.stack([self.gumbel(int(p), device) for p in positions])

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
        return argmax_rows(self.scores(logits, range(first_position, first_position + logits.shape[0]), vocab_ids))

    def pick_at(self, logits: torch.Tensor, positions) -> torch.Tensor:
        """Tokens [n] for rows that score the absolute ``positions`` (n ints, any order: a draft tree's rows)."""
        return argmax_rows(self.scores(logits, positions))

    def top_columns(self, logits: torch.Tensor, first_position: int, k: int,
                    vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The [n, k] best columns of consecutive positions' ``logits``, best first: the first is ``pick_columns``'s
        (the chain's draft), the others the next by the same score (the logits at T=0, with the position's noise above)."""
        k = max(1, min(int(k), logits.shape[-1]))
        return top_indices(self.scores(logits, range(first_position, first_position + logits.shape[0]), vocab_ids), k)

    def scores(self, logits: torch.Tensor, positions, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """What the pick maximises for rows at ``positions``: the logits at T=0, else logits / T + the positions' noise."""
        if self.temperature == 0:
            return logits
        noise = self.noise(positions, logits.device)
        if vocab_ids is not None:
            noise = noise[:, vocab_ids]
        return logits.float() / self.temperature + noise


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [n] (the first maximum; NaN as the maximum, as ``argmax``). On the CPU the kernel's
    ``topk_rows`` at k = 1 (the same order) for float32, else NumPy's ``argmax`` (vectorised): rows of 49,152 float32,
    AMD EPYC Zen 4, 2026-12-07: 1 / 3 / 8 rows 5 / 12 / 29 us hot against torch's ``max(dim=-1).indices`` 44 / 86 /
    184; right after the LM head wrote them (every verified row of every step, an eval's `mixed` and `ar` steps) 72 us
    a step with NumPy, 25 with the kernel; elsewhere ``max``'s indices."""
    native = _native_top(scores, 1)
    if native is not None:
        return native.view(-1)
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64) and scores.dim() == 2:
        return torch.from_numpy(scores.detach().numpy().argmax(-1))
    return scores.max(dim=-1).indices


def _normalize(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` with an index for CUDA (``cuda`` -> ``cuda:<current>``); None -> CPU."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def draft_confidence(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
    """The drafter's probability of each proposed token: ``softmax(logits / T)[index]`` (T=0 reads T=1).

    The per-position signal the verify-width policy calibrates (``pipeline.policy.verify_width``); the
    decoder and the label stage's replays compute it with this one function.

    Args:
        logits: [R, V'] float drafter logits (over its draft vocabulary when it has one).
        index: [R] column of the proposed token in ``logits`` (long), or [R, k]: k candidates per row (a draft tree's).
        temperature: the request's temperature (0 = greedy).
    Returns:
        [R] (or [R, k]) float32 probabilities in (0, 1].
    """
    scaled = logits.float() / (float(temperature) if temperature > 0 else 1.0)
    columns = index.reshape(index.shape[0], -1).to(scaled.device)
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, columns)  # one fused pass (half logsumexp's time on the CPU)
    return picked.exp() if index.dim() > 1 else picked[:, 0].exp()


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` best columns, best first ([R, V] -> [R, k] int64): the one top-k of every consumer (the
    drafter's candidates, the recycled candidates, the label stage's shortlists), so that they agree on ties. On the CPU
    the smallm kernel's ``topk_rows`` (one pass a row; ties: the lower column first, NaN above every number; ~10 us a
    row of 49,152 against ``torch.topk``'s ~86, AMD EPYC Zen 4, 2026-12-07); elsewhere ``torch.topk``'s indices (the
    same where the k + 1 best values are distinct)."""
    native = _native_top(scores, k)
    return native if native is not None else scores.topk(k, dim=-1).indices


def _native_top(scores: torch.Tensor, k: int) -> torch.Tensor | None:
    """The kernel's ``topk_rows(scores, k)`` for float32 [R, V] CPU rows (1 <= k <= V), else None (another device,
    dtype or shape, or no kernel here)."""
    if not (scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2
            and 1 <= k <= scores.shape[1]):
        return None
    try:
        return smallm_kernel().topk_rows(scores, int(k))
    except KernelUnavailableError:
        return None
