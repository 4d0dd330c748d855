"""The speculative decoding loop: prefill, then draft B-1 tokens in one drafter forward, verify them in
one target forward, keep the longest matching prefix plus the bonus token, roll the caches back.

Follows the generate loop of z-lab/dflash ``dflash/model.py``, with three changes: B is chosen per
request (and may change per step through a ``BlockSizeSchedule``), sampling at T>0 is position-keyed
(``pipeline.decoding.sampling``) so outputs do not depend on B, and B=1 runs the same loop with no
drafter call (plain autoregressive decoding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.schedules import BlockSizeSchedule, FixedSchedule
from pipeline.models.drafter import DFlashDrafter, check_compatible, lm_head_logits
from pipeline.models.target import Target


@dataclass
class DecodeConfig:
    """Decoding settings of one request.

    Attributes:
        max_new_tokens: cap on generated tokens (the bonus token of the prefill included).
        temperature: 0 = greedy; > 0 = position-keyed Gumbel-max sampling.
        seed: sampling seed (ignored at T=0).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0


@dataclass
class PrefillResult:
    """What one prefill leaves behind: caches, the first new token, the last-token logits.

    Attributes:
        input_ids: [1, n] prompt ids.
        cache: the target's ``DynamicCache`` over the n prompt tokens.
        last_logits: [V] target logits at the last prompt token (float32) — the policy's input.
        features: [1, n, n_taps*H] context features for the drafter, or None without drafter.
        first_token: the token sampled from ``last_logits`` (position n).
        prefill_ms: wall time of the target forward and the first sample (ms).
    """

    input_ids: torch.Tensor
    cache: DynamicCache
    last_logits: torch.Tensor
    features: torch.Tensor | None
    first_token: int
    prefill_ms: float


@dataclass
class RequestStats:
    """Per-request outcome.

    Attributes:
        output_ids: generated token ids (the stop token included when one ended the output).
        taus: acceptance length of each draft-verify step (accepted drafts + 1 bonus, tokens).
        block_sizes: B used at each step.
        prefill_ms: prefill time (ms); decode_ms: time of all steps after prefill (ms);
        schedule_ms: time spent choosing B after prefill (the policy's overhead, ms).
    """

    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    taus: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    schedule_ms: float = 0.0
    stopped: bool = False

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        """Mean acceptance length over steps (tokens per target verify)."""
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    @property
    def tpot_ms(self) -> float:
        """Decode time per output token after the first (ms)."""
        return self.decode_ms / max(1, self.new_tokens - 1)

    def as_row(self) -> dict:
        """A JSON-ready summary row."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "tau": self.tau,
            "steps": len(self.taus),
            "block_sizes": sorted(set(self.block_sizes)),
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "schedule_ms": self.schedule_ms,
            "tpot_ms": self.tpot_ms,
            "stopped": self.stopped,
        }


def crop_to(cache: DynamicCache, length: int) -> None:
    """Roll ``cache`` back to its first ``length`` tokens (transformers 5 ``crop`` takes -tokens_to_drop)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _now(device: torch.device) -> float:
    """perf_counter after a CUDA synchronize (when on GPU), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpeculativeDecoder:
    """DFlash speculative decoding with a per-request block size (batch size 1).

    Args:
        target: the loaded target.
        drafter: a ``DFlashDrafter`` for this target, or None (autoregressive only).

    Raises:
        ValueError: when the drafter does not fit the target (hidden size, vocab, layer ids).
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None):
        self.target = target
        self.model = target.model
        self.base = target.model.base_model
        self.lm_head = target.model.get_output_embeddings().weight
        self.embed = target.model.get_input_embeddings()
        self.drafter = drafter
        self.draft_head = self.draft_vocab = None
        if drafter is not None:
            check_compatible(drafter, target.model.config)
            self.draft_head = drafter.draft_head(self.lm_head)  # [N, H] rows the drafter scores
            self.draft_vocab = drafter.draft_vocab
        self.max_context = int(getattr(target.model.config, "max_position_embeddings", 1 << 30))
        self.stop_ids = set(target.stop_token_ids())

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---------------------------------------------------------------------------------------------
    def check_block_size(self, block_size: int) -> None:
        """Raise ``ValueError`` unless 1 <= B <= the drafter's limit (B=1 needs no drafter)."""
        if block_size < 1:
            raise ValueError(f"block size must be >= 1 (1 = autoregressive), got {block_size}")
        if block_size > 1 and self.drafter is None:
            raise ValueError(f"block size {block_size} needs a drafter; load one (model.drafter=...) or use B=1")
        if self.drafter is not None and block_size > self.drafter.max_block_size:
            raise ValueError(
                f"block size {block_size} is beyond this drafter's limit {self.drafter.max_block_size} "
                f"(trained at B={self.drafter.block_size}); pick B in 1..{self.drafter.max_block_size}"
            )

    def check_prompt(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        """Raise ``ValueError`` for an empty prompt or one that leaves no room for ``max_new_tokens``."""
        n = input_ids.shape[-1]
        if n == 0:
            raise ValueError("prompt is empty: give at least one token (check the prompt set's 'turns')")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if n + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {n} tokens + max_new_tokens {max_new_tokens} exceeds the target's context of "
                f"{self.max_context} tokens; shorten the prompt or lower decode.max_new_tokens"
            )

    # ---------------------------------------------------------------------------------------------
    def _target_forward(self, ids: torch.Tensor, cache: DynamicCache, start: int, want_features: bool):
        """Target forward over ``ids`` [1, q] at positions start..start+q-1; returns (logits [q, V], features|None)."""
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        out = self.base(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
            output_hidden_states=want_features,
        )
        logits = lm_head_logits(out.last_hidden_state[0], self.lm_head).float()
        features = self.drafter.extract_context(out.hidden_states) if want_features else None
        return logits, features

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, config: DecodeConfig, want_features: bool = True) -> PrefillResult:
        """Run the target over the prompt once and sample the first new token.

        Args:
            input_ids: [1, n] or [n] prompt token ids.
            want_features: keep the drafter's context features (needs a drafter).
        """
        input_ids = input_ids.reshape(1, -1).to(self.device)
        self.check_prompt(input_ids, config.max_new_tokens)
        sampler = PositionKeyedSampler(config.temperature, config.seed, self.lm_head.shape[0])
        t0 = _now(self.device)
        cache = DynamicCache(config=self.model.config)
        positions = torch.arange(input_ids.shape[1], device=self.device)[None]
        want = want_features and self.drafter is not None
        out = self.base(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
                        output_hidden_states=want)
        last_logits = lm_head_logits(out.last_hidden_state[0, -1:], self.lm_head).float()
        first = int(sampler.pick(last_logits, input_ids.shape[1])[0])
        features = self.drafter.extract_context(out.hidden_states) if want else None
        prefill_ms = (_now(self.device) - t0) * 1e3
        return PrefillResult(input_ids, cache, last_logits[0], features, first, prefill_ms)

    @torch.inference_mode()
    def decode(self, prefill: PrefillResult, schedule: BlockSizeSchedule | int, config: DecodeConfig,
               on_tokens: Callable[[list[int]], bool | None] | None = None) -> RequestStats:
        """Decode after ``prefill`` with block sizes from ``schedule`` (an int means a fixed B).

        Args:
            on_tokens: called with the new token ids of the prefill's first token and then of every
                step (accepted drafts + bonus, the stop token included), in order; a true return ends
                the decode after that step (a server's stop string or a client that went away).
        Returns:
            ``RequestStats`` with the output ids and per-step tau. The output never exceeds
            ``config.max_new_tokens`` and ends at the first stop token.
        Raises:
            ValueError: for a block size out of range (checked at every step).
        """
        if isinstance(schedule, int):
            schedule = FixedSchedule(schedule)
        self.check_block_size(schedule.max_block_size)
        use_drafter = schedule.max_block_size > 1
        if use_drafter and prefill.features is None:
            raise ValueError("prefill ran without drafter features; call prefill(want_features=True)")
        sampler = PositionKeyedSampler(config.temperature, config.seed, self.lm_head.shape[0])
        n = prefill.input_ids.shape[1]
        stats = RequestStats(prompt_tokens=n, prefill_ms=prefill.prefill_ms)

        t_schedule = _now(self.device)
        block_size = schedule.first(prefill.last_logits)
        t0 = _now(self.device)
        stats.schedule_ms = (t0 - t_schedule) * 1e3

        cache = prefill.cache
        draft_cache = DynamicCache() if use_drafter else None
        features = prefill.features  # context features not yet in the draft cache
        pending = prefill.first_token  # sampled, not yet fed to the target, at position `start`
        start = n
        stats.output_ids.append(pending)
        stats.stopped = pending in self.stop_ids
        mask_id = self.drafter.mask_token_id if self.drafter is not None else 0
        halted = on_tokens is not None and bool(on_tokens([pending]))

        while not halted and not stats.stopped and stats.new_tokens < config.max_new_tokens:
            self.check_block_size(block_size)
            b = min(block_size, config.max_new_tokens - stats.new_tokens)
            block = torch.full((1, b), mask_id, dtype=torch.long, device=self.device)
            block[0, 0] = pending
            if b > 1:
                c = features.shape[1]
                positions = torch.arange(start - c, start + b, device=self.device)[None]
                hidden = self.drafter(self.embed(block), features, positions, cache=draft_cache)
                crop_to(draft_cache, start)  # keep context keys/values, drop the block's
                features = features[:, :0]
                draft_logits = lm_head_logits(hidden[0, 1:], self.draft_head).float()
                block[0, 1:] = sampler.pick(draft_logits, start + 1, self.draft_vocab)
            logits, new_features = self._target_forward(block, cache, start, want_features=use_drafter)
            target_tokens = sampler.pick(logits, start + 1)  # token i is the target's choice at start+1+i
            matches = (block[0, 1:] == target_tokens[:-1]).int()
            accepted = int(matches.cumprod(0).sum()) if b > 1 else 0
            new = block[0, 1 : accepted + 1].tolist() + [int(target_tokens[accepted])]
            for i, token in enumerate(new):
                if token in self.stop_ids:
                    new = new[: i + 1]
                    stats.stopped = True
                    break
            stats.output_ids.extend(new)
            stats.taus.append(len(new))
            stats.block_sizes.append(b)
            crop_to(cache, start + accepted + 1)
            if use_drafter:
                features = torch.cat([features, new_features[:, : accepted + 1]], dim=1)
            start += accepted + 1
            pending = new[-1]
            block_size = schedule.next(len(new), b)
            halted = on_tokens is not None and bool(on_tokens(new))

        stats.decode_ms = (_now(self.device) - t0) * 1e3
        return stats

    def generate(self, input_ids: torch.Tensor, schedule: BlockSizeSchedule | int, config: DecodeConfig,
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> RequestStats:
        """Prefill then decode one request; see ``prefill`` and ``decode``."""
        if isinstance(schedule, int):
            self.check_block_size(schedule)
            schedule = FixedSchedule(schedule)
        prefill = self.prefill(input_ids, config, want_features=schedule.max_block_size > 1)
        return self.decode(prefill, schedule, config, on_tokens)
