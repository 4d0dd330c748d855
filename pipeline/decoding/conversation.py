"""Multi-turn requests: decode every user turn in order, feeding back the model's own replies."""

from __future__ import annotations

from typing import Callable

from pipeline.decoding.schedules import Schedule
from pipeline.decoding.requests import DecodeConfig, RequestStats
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.prompts import Prompt, chat_input_ids


def decode_prompt(
    decoder: SpeculativeDecoder,
    prompt: Prompt,
    make_schedule: Callable[[], Schedule | int],
    config: DecodeConfig,
) -> list[RequestStats]:
    """Decode all turns of ``prompt``; turn k's request holds turns 0..k and replies 0..k-1.

    Args:
        make_schedule: builds a fresh schedule per turn (schedules may keep per-request state).
    Returns:
        one ``RequestStats`` per turn.
    """
    replies: list[str] = []
    stats: list[RequestStats] = []
    tokenizer = decoder.target.tokenizer
    for turn in range(len(prompt.turns)):
        ids = chat_input_ids(tokenizer, prompt.turns, replies)
        result = decoder.generate(ids, make_schedule(), config)
        stats.append(result)
        replies.append(tokenizer.decode(result.output_ids, skip_special_tokens=True))
    return stats
