"""Which signals tell, before or at a draft, whether the drafter's first draft will be accepted? (prints figures; not a test)

    python scripts/predraft_signals.py [--per-set 5] [--offset 100] [--max-new-tokens 64] [--block-size 8]

Decodes prompts of the benchmark sets in ``../shared/data`` (``--offset`` .. ``--offset + --per-set`` of each, first
turns) with the embedded default at T=0 and B, verifying every draft, and records per step:

- the target's probability of the pending token (known before the drafter runs; from the previous verify, or the
  prefill for the first step);
- the previous step's accepted drafts (known before the drafter runs);
- the drafter's probability of its first draft (known after the draft; what the verify-width calibration uses).

Prints the AUC of each signal for "draft 1 accepted" (0.5 = no information) and P(accepted) by bins of the first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from pipeline import PROJECT_ROOT
from pipeline.decoding.sampling import PositionKeyedSampler, draft_confidence
from pipeline.decoding.step import draft, verify
from pipeline.decoding.trees import DraftTree
from pipeline.decoding.requests import DecodeConfig
from pipeline.decoding.build import build_decoder
from pipeline.prompts import chat_input_ids, load_prompt_set

SETS = ("gsm8k", "math500", "mbpp", "mt_bench")


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of ``score`` for the boolean ``positive`` (Mann-Whitney, tied scores share their
    average rank, so a signal with few distinct values is not credited with an arbitrary order)."""
    ranks = pd.Series(score).rank(method="average").to_numpy()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-set", type=int, default=5)
    parser.add_argument("--offset", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--data", type=Path, default=PROJECT_ROOT.parent / "shared" / "data")
    args = parser.parse_args()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="evaluate")
    decoder = build_decoder(cfg.model)
    verifies = []  # the logits [q, V] of every verify, seen through the decoder's own step
    forward = decoder.forward
    target = forward.target

    def recording_target(*args, **kwargs):
        outs = target(*args, **kwargs)
        verifies.append(outs[0][0])
        return outs

    forward.target = recording_target
    config = DecodeConfig(args.max_new_tokens)
    rows = []  # (target p of pending, previous accepted, drafter p of draft 1, accepted)
    for name in SETS:
        prompts = load_prompt_set(str(args.data / f"{name}.jsonl"), offset=args.offset, limit=args.per_set)
        for prompt in prompts:
            ids = chat_input_ids(decoder.target.tokenizer, prompt.turns[:1])
            prefill = decoder.prefill(ids, config)
            state = decoder.new_state(prefill, use_drafter=True)
            sampler = PositionKeyedSampler(0.0, 0, decoder.lm_head.shape[0])
            target_p = float(torch.softmax(prefill.last_logits.float(), -1).max())
            previous, produced = -1, 1
            while produced < args.max_new_tokens and state.pending not in decoder.stop_ids:
                b = min(args.block_size, args.max_new_tokens - produced + 1)
                if b < 2:
                    break
                logits = draft(forward, [state], [b])[0]
                columns = sampler.pick_columns(logits, state.start + 1, decoder.draft_vocab)
                first_p = float(draft_confidence(logits, columns, 0.0)[0])
                tokens = columns if decoder.draft_vocab is None else decoder.draft_vocab[columns]
                (new, path, _), = verify(forward, [state], [sampler], [DraftTree.chain(tokens.tolist())])  # verify all
                accepted = len(path)
                rows.append((target_p, previous, first_p, accepted))
                target_p = float(torch.softmax(verifies[-1][accepted].float(), -1).max())  # p of the new pending token
                previous = accepted
                produced += len(new)
    target_p, previous, drafter_p, accepted = (np.array(c, dtype=float) for c in zip(*rows))
    positive = accepted > 0
    print(f"{len(rows)} steps of {len(SETS) * args.per_set} prompts at B={args.block_size}; "
          f"P(draft 1 accepted) = {positive.mean():.3f}")
    print(f"AUC for 'draft 1 accepted': target's p of the pending token {auc(target_p, positive):.3f}, "
          f"previous step's accepted drafts {auc(previous, positive):.3f}, drafter's p of draft 1 {auc(drafter_p, positive):.3f}")
    for lo, hi in ((0.0, 0.3), (0.3, 0.6), (0.6, 0.9), (0.9, 1.01)):
        inside = (target_p >= lo) & (target_p < hi)
        if inside.any():
            print(f"target p in [{lo:.1f}, {min(hi, 1.0):.1f}]: {int(inside.sum())} steps, P(accepted) {positive[inside].mean():.2f}")


if __name__ == "__main__":
    main()
