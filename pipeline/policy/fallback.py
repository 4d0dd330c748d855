"""Confidence fallback: leave the training block size only when the predictor is sure enough.

Where tau(B) is nearly flat around the training block size (a weak drafter, or prompts whose optimum
is the training B anyway), an argmax policy trades small, noisy gains for small, noisy losses. The
fallback rule keeps the training block size B_train unless the predictor's softmax probability of its
argmax exceeds that of B_train by at least ``margin``:

    pick = argmax_c p(c)  if  p(argmax) - p(B_train) >= margin  else  B_train

``margin = 0`` is the plain argmax; ``margin > 1`` always keeps B_train. The train stage tunes the margin
on the validation split (``tune_margin``) and exports it; ``Predictor.predict`` applies it.

The margin that maximises the validation mean is an in-sample maximum over many thresholds, so it
finds a "gain" even where the predictor knows nothing (one validation request that happens to gain
0.002 tokens is enough). ``departure_gain`` guards against that: the tuned margin is kept only when
the one-sided bootstrap lower confidence bound (``train.fallback_confidence``, default 95%) of the
validation gain over B_train is above zero, i.e. when the departures win consistently, not once;
otherwise the predictor always keeps B_train. This is the safety test of high-confidence policy
improvement (Thomas et al., ICML 2015), with a percentile bootstrap in place of a concentration bound. This is the
usual "fall back to the default" guard of adaptive speculation schedules (e.g. the SGLang DFlash PR's
per-round schedule keeps B until recent acceptance moves it by a margin).
"""

from __future__ import annotations

import torch

ALWAYS_FALLBACK = 1.01  # above any probability difference


def apply_fallback(scores: torch.Tensor, fallback_index: int, margin: float) -> torch.Tensor:
    """Class indices [b] chosen from scores [b, C] under the fallback rule (module docstring).

    Raises:
        IndexError: when ``fallback_index`` is not a class index.
    """
    pick, advantage = argmax_advantage(scores, fallback_index)
    return torch.where(advantage >= margin, pick, torch.full_like(pick, fallback_index))


def argmax_advantage(scores: torch.Tensor, fallback_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax class [b] of scores [b, C] and its softmax-probability lead over ``fallback_index`` [b].

    Raises:
        IndexError: when ``fallback_index`` is not a class index.
    """
    if not 0 <= fallback_index < scores.shape[-1]:
        raise IndexError(f"fallback index {fallback_index} is not one of {scores.shape[-1]} classes")
    probs = torch.softmax(scores.float(), dim=-1)
    pick = probs.argmax(-1)
    return pick, probs.gather(-1, pick[..., None])[..., 0] - probs[..., fallback_index]


@torch.no_grad()
def tune_margin(scores: torch.Tensor, tau: torch.Tensor, fallback_index: int) -> tuple[float, float]:
    """The margin that maximises the mean tau of the picks on a (validation) split.

    Args:
        scores: [n, C] predictor scores; tau: [n, C] recorded tau per candidate (tokens), or the label target's reward
            (``train.target=speed``: tokens/s over the prompt's best);
        fallback_index: class index of the training block size.
    Returns:
        ``(margin, mean_pick_tau)``. Only the observed advantages can change the picks, so they (and
        ``ALWAYS_FALLBACK``) are the candidates searched; among equal means the largest margin wins
        (the fewest departures from the training block size).
    Raises:
        ValueError: for an empty split or mismatched shapes.
    """
    if scores.shape != tau.shape or scores.shape[0] == 0:
        raise ValueError(f"need matching non-empty [n, C] scores and tau, got {tuple(scores.shape)} and {tuple(tau.shape)}")
    _, advantage = argmax_advantage(scores, fallback_index)
    best = (float(tau[:, fallback_index].float().mean()), ALWAYS_FALLBACK)
    for margin in sorted(set(advantage.tolist()) | {0.0}, reverse=True):
        chosen = apply_fallback(scores, fallback_index, margin)
        mean = float(tau.float().gather(1, chosen[:, None]).mean())
        if mean > best[0] + 1e-9:
            best = (mean, float(margin))
    return best[1], best[0]


@torch.no_grad()
def departure_gain(scores: torch.Tensor, tau: torch.Tensor, fallback_index: int, margin: float,
                   confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict:
    """How much the picks under ``margin`` gain over always keeping the training block size, with a lower bound.

    Args:
        scores: [n, C] predictor scores; tau: [n, C] recorded tau per candidate (tokens), or the label target's reward.
        fallback_index: class index of the training block size; margin: the fallback margin.
        confidence: level of the one-sided percentile-bootstrap lower bound (resampling requests).
        resamples, seed: bootstrap size and generator seed (the bound is deterministic given them).
    Returns:
        {"departures": requests leaving B_train, "mean_gain": mean tau gain per request (tokens),
        "lower_bound": its bootstrap lower confidence bound (tokens), "confidence"}.
    Raises:
        ValueError: for mismatched or empty inputs, or ``confidence`` outside (0, 1).
    """
    if scores.shape != tau.shape or scores.shape[0] == 0:
        raise ValueError(f"need matching non-empty [n, C] scores and tau, got {tuple(scores.shape)} and {tuple(tau.shape)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"train.fallback_confidence must be in (0, 1), got {confidence}")
    chosen = apply_fallback(scores, fallback_index, margin)
    tau = tau.double()
    gain = tau.gather(1, chosen[:, None])[:, 0] - tau[:, fallback_index]
    generator = torch.Generator().manual_seed(int(seed))
    rows = torch.randint(0, gain.shape[0], (int(resamples), gain.shape[0]), generator=generator)
    means = gain[rows].mean(1)
    return {"departures": int((chosen != fallback_index).sum()), "mean_gain": float(gain.mean()),
            "lower_bound": float(torch.quantile(means, 1.0 - confidence)), "confidence": float(confidence)}
