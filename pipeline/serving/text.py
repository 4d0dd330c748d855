"""Token ids -> text deltas for streaming, with stop strings.

The text of a response is always ``tokenizer.decode(output_ids, skip_special_tokens=True)`` cut before
the first stop string, exactly what ``pipeline.evaluate``'s decode of the same prompt gives (no stop
strings). Deltas are differences of that full text, so streamed and non-streamed text are identical;
a delta is held back while the text ends in an incomplete UTF-8 sequence (U+FFFD) or in a prefix of a
stop string.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Accumulates output token ids and yields the new text that is safe to send.

    Args:
        tokenizer: the target's tokenizer.
        stops: stop strings (may be empty).
    Attributes:
        ids: every token id fed so far; text: the text sent so far; stopped: a stop string was found.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def _full(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _cut(self, full: str) -> str:
        """``full`` cut before its first stop string (sets ``stopped``)."""
        hits = [i for i in (full.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return full[: min(hits)]
        return full

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; return the text delta now safe to send ('' when held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in ids)
        full = self._cut(self._full())
        if not self.stopped:
            hold = len(full) - len(full.rstrip("\ufffd"))
            for stop in self.stops:  # longest suffix of the text that could still grow into a stop string
                for k in range(min(len(stop) - 1, len(full)), 0, -1):
                    if full.endswith(stop[:k]):
                        hold = max(hold, k)
                        break
            full = full[: len(full) - hold]
        if not full.startswith(self.text):  # a later token changed earlier text (rare with byte-level BPE)
            return ""
        delta, self.text = full[len(self.text):], full
        return delta

    def finish(self) -> str:
        """The rest of the text after the last token (held-back characters included, stop strings cut)."""
        if self.stopped:
            return ""
        full = self._cut(self._full())
        if not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta
