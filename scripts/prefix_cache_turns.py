"""A chat's second turn with and without the server's prefix cache: prefill time (the TTFT the cache saves) and text.

    python scripts/prefix_cache_turns.py                      # MT-Bench from ../shared/data, 12 questions, 128 tokens
    python scripts/prefix_cache_turns.py --limit 4 --max-tokens 32 --source /path/mt_bench.jsonl

Builds the server's decoder (``conf/serve.yaml``: its precision, released weights and prefix cache) and decodes each
two-turn question twice through the eval stage's multi-turn decode (``decode_prompt``, B = 1): once without the cache,
once with a cleared one (turn 1 stores its prompt and reply, turn 2 repeats both). Prints, per question, turn 2's
prompt tokens, the tokens hit and both prefill times, then the means and whether every turn's text is the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    shared = os.environ.get("BLOCKPILOT_SHARED_DATA") or str(root.parent / "shared" / "data")
    parser.add_argument("--source", default=f"{shared}/mt_bench.jsonl")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from pipeline.decoding import DecodeConfig
    from pipeline.decoding.conversation import decode_prompt
    from pipeline.prompts import load_prompt_set
    from pipeline.serve import build_engine

    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["serve.policy=ar", "serve.warmup=false", "serve.max_batch=1"])
    engine = build_engine(cfg)
    decoder, cache = engine.decoder, engine.decoder.prefix_cache
    if cache is None:
        raise SystemExit("this decoder has no prefix cache (serve.prefix_cache_mb=0, or a prefill off the native stack)")
    prompts = [p for p in load_prompt_set(args.source, "mt_bench", limit=args.limit) if len(p.turns) >= 2]
    config = DecodeConfig(args.max_tokens)
    decoder.prefix_cache = None
    decode_prompt(decoder, prompts[0], lambda: 1, DecodeConfig(8))  # warm-up
    rows = []
    for prompt in prompts:
        decoder.prefix_cache = None
        off = decode_prompt(decoder, prompt, lambda: 1, config)
        cache.clear()
        decoder.prefix_cache = cache
        on = decode_prompt(decoder, prompt, lambda: 1, config)
        same = all(a.output_ids == b.output_ids for a, b in zip(off, on))
        rows.append((off[1].prompt_tokens, on[1].cached_tokens, off[1].prefill_ms, on[1].prefill_ms, same))
        print(f"{prompt.id}: turn 2 prompt {rows[-1][0]} tokens, {rows[-1][1]} from the cache; prefill "
              f"{rows[-1][2]:.1f} ms without, {rows[-1][3]:.1f} ms with; same text {same}", flush=True)
    off_ms, on_ms = statistics.mean(r[2] for r in rows), statistics.mean(r[3] for r in rows)
    print(f"{len(rows)} questions: turn 2 prompt {statistics.mean(r[0] for r in rows):.0f} tokens, "
          f"{statistics.mean(r[1] for r in rows):.0f} from the cache; prefill {off_ms:.1f} ms without the cache, "
          f"{on_ms:.1f} ms with ({on_ms / off_ms:.2f}x); every text the same: {all(r[4] for r in rows)}")
    engine.close()


if __name__ == "__main__":
    main()
