"""Draft sources that cost no model call: continuations of the longest n-gram matches over token sequences.

``NgramIndex`` indexes token sequences (a request's prompt and its own output, and, as a suffix cache, earlier
responses) by every n-gram of n = 1..``max_n`` tokens: each n-gram keeps the latest few places it ended. Appending a
token costs ``max_n`` dictionary updates (amortised O(1) per token, as a suffix automaton's extension); a lookup walks
n = ``max_n``..1 and returns the continuations after the latest occurrences of the longest suffix of the query that
occurred before, each with its match length (extended backwards up to ``MATCH_CAP`` tokens): the prompt-lookup
decoding of transformers and llama.cpp's ``ngram`` drafts, with several continuations where the match has several
(SAM-Decoding's and SuffixDecoding's idea of drafting from what the request already holds).

Imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

MATCH_CAP = 16
"""The longest match length measured (the acceptance estimate's feature saturates well before it)."""


@dataclass
class Continuation:
    """A proposed continuation: its tokens, the length of the match it follows, where it came from
    (``ngram``: the request's own tokens; ``cache``: an earlier response)."""

    tokens: list[int]
    match: int
    source: str


class NgramIndex:
    """The n-grams of one or more token sequences (segments), with the latest ``keep`` places each ended.

    Args:
        max_n: the longest n-gram indexed (a longer match is found through its last ``max_n`` tokens, and measured).
        keep: places kept per n-gram (the continuations a lookup may offer).
        max_tokens: the most tokens held over all segments (None: no bound); past it the oldest segments are dropped.
    Raises:
        ValueError: for max_n < 1, keep < 1 or max_tokens < 1.
    """

    def __init__(self, max_n: int = 4, keep: int = 3, max_tokens: int | None = None):
        if int(max_n) < 1 or int(keep) < 1 or (max_tokens is not None and int(max_tokens) < 1):
            raise ValueError(f"an n-gram index needs max_n >= 1, keep >= 1 and max_tokens >= 1 (or none), got "
                             f"max_n={max_n}, keep={keep}, max_tokens={max_tokens}")
        self.max_n, self.keep = int(max_n), int(keep)
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.segments: dict[int, list[int]] = {}
        self._held = 0  # tokens over all segments (kept, not summed at every extend)
        self._next_id = 0
        self._tables: list[dict[tuple, list[tuple[int, int]]]] = [{} for _ in range(self.max_n + 1)]

    @property
    def tokens_held(self) -> int:
        return self._held

    def new_segment(self, tokens=()) -> int:
        """Start a segment (a sequence of its own: no n-gram spans two), optionally with ``tokens``; its id."""
        sid = self._next_id
        self._next_id += 1
        self.segments[sid] = []
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens) -> None:
        """Append ``tokens`` to segment ``sid``, indexing every n-gram that ends at each."""
        seq = self.segments[sid]
        for token in tokens:
            seq.append(int(token))
            self._held += 1
            end = len(seq) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                places = self._tables[n].setdefault(tuple(seq[end - n + 1:]), [])
                places.append((sid, end))
                if len(places) > self.keep:
                    del places[0]
        if self.max_tokens is not None and self.tokens_held > self.max_tokens:
            self._evict(keep=sid)

    def _evict(self, keep: int) -> None:
        """Drop the oldest segments (never ``keep``) until the bound holds, each one's n-grams taken out of the tables
        (as many dictionary updates as indexing it took: the other segments are not indexed again; re-indexing all
        held tokens at each eviction cost 5 ms a token on average and 663 ms at worst once a 65,536-token cache was
        full, 2026-12-07). A single segment longer than the bound keeps its last three quarters of the bound (re-indexed:
        at most once per quarter of the bound appended)."""
        while self._held > self.max_tokens and len(self.segments) > 1:
            self._drop(next(s for s in self.segments if s != keep))
        if self._held > self.max_tokens:  # one segment longer than the bound: keep its tail
            tail = self.segments[keep][-(self.max_tokens - self.max_tokens // 4):]
            self._drop(keep)
            self.segments[keep] = []
            self.extend(keep, tail)

    def _drop(self, sid: int) -> None:
        """Segment ``sid`` and its places out of the index (an n-gram left with no place leaves its table)."""
        seq = self.segments.pop(sid)
        self._held -= len(seq)
        for end in range(len(seq)):
            for n in range(1, min(self.max_n, end + 1) + 1):
                table = self._tables[n]
                key = tuple(seq[end - n + 1: end + 1])
                places = table.get(key)
                if places is not None and (sid, end) in places:
                    places.remove((sid, end))
                    if not places:
                        del table[key]

    def lookup(self, tail: list[int], max_len: int, branches: int = 1, exclude: tuple[int, int] | None = None,
               source: str = "ngram") -> list[Continuation]:
        """Continuations of ``tail``'s longest suffix (up to ``max_n`` tokens) that occurred in the index.

        Args:
            tail: the tokens the continuation follows (at least its last ``max_n``).
            max_len: the most tokens a continuation has.
            branches: the most continuations (distinct first tokens, the latest occurrence first, longest match first).
            exclude: a (segment, end) place that is the query itself (a request looking up its own last token).
        Returns:
            continuations, best first (possibly none).
        """
        out: list[Continuation] = []
        firsts: set[int] = set()
        if max_len < 1 or not tail:
            return out
        for n in range(min(self.max_n, len(tail)), 0, -1):
            for sid, end in reversed(self._tables[n].get(tuple(tail[-n:]), ())):
                if (sid, end) == exclude:
                    continue
                seq = self.segments.get(sid)
                if seq is None or end + 1 >= len(seq):
                    continue
                tokens = seq[end + 1: end + 1 + max_len]
                if tokens[0] in firsts:
                    continue
                firsts.add(tokens[0])
                out.append(Continuation(tokens, self._match(tail, seq, end, n), source))
                if len(out) >= branches:
                    return out
        return out

    @staticmethod
    def _match(tail: list[int], seq: list[int], end: int, n: int) -> int:
        """How many tokens before ``tail``'s end equal those before ``seq[end]`` (at least ``n``, at most ``MATCH_CAP``)."""
        m = n
        while m < MATCH_CAP and m < len(tail) and end - m >= 0 and tail[-1 - m] == seq[end - m]:
            m += 1
        return m
