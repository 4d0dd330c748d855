"""Where one decode step's time goes on this machine: cProfile over AR (B=1) and a fixed B on a few
HumanEval prompts with the embedded default (a benchmark that prints figures, not a test).

    .venv/bin/python scripts/profile_decode_step.py [--block-size 8] [--prompts 3] [--max-new-tokens 64]

Prints, per B, wall time, steps, tau and ms per step, then the top functions by cumulative time
(the target's forward, its Linear layers, ``lm_head_logits``, the drafter's forward...).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from omegaconf import OmegaConf

from pipeline import PROJECT_ROOT
from pipeline.decoding import DecodeConfig
from pipeline.decoding.build import build_decoder
from pipeline.prompts import chat_input_ids, load_prompt_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30, help="functions listed per B")
    args = parser.parse_args()
    decoder = build_decoder(OmegaConf.load(PROJECT_ROOT / "conf" / "model" / "smollm2.yaml"))
    prompts = load_prompt_sets([{"name": "humaneval", "source": "humaneval"}], args.prompts, None)
    ids = [chat_input_ids(decoder.target.tokenizer, p.turns[:1]) for p in prompts]
    config = DecodeConfig(args.max_new_tokens, 0.0, 0)
    decoder.generate(ids[0], args.block_size, DecodeConfig(8, 0.0, 0))  # warm-up
    for block_size in (1, args.block_size):
        profiler = cProfile.Profile()
        steps = tokens = 0
        t0 = time.perf_counter()
        profiler.enable()
        for x in ids:
            stats = decoder.generate(x, block_size, config)
            steps, tokens = steps + len(stats.taus), tokens + stats.new_tokens
        profiler.disable()
        seconds = time.perf_counter() - t0
        print(f"B={block_size}: {seconds:.2f} s, {steps} steps, {tokens} tokens, {seconds / steps * 1e3:.1f} ms/step, "
              f"tau {tokens / steps:.2f}")
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
