"""Stop sequences as the OpenAI API has them: the text ends before the first stop sequence, and a stream
never shows a piece of one (text that could begin a stop sequence is held back until it cannot). The text of a
request's first ``min_tokens`` tokens is not searched (vLLM's rule; ``push(..., look=False)``)."""

from __future__ import annotations

from typing import Sequence


class StopTrimmer:
    def __init__(self, stops: Sequence[str] = (), keep: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep = keep  # the text ends after the stop sequence (vLLM's include_stop_str_in_output)
        self.text = ""  # the reply so far, cut before the first stop sequence
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False
        self.floor = 0  # characters of ``text`` not searched for stop sequences
        self.matched: str | None = None  # the stop sequence that ended the text

    def push(self, delta: str, look: bool = True) -> str:
        """Add generated text (``look`` False: a token before the reply's minimum, not searched); returns what can
        be shown now."""
        if self.stopped or not delta:
            return ""
        self.text += delta
        if not look:
            self.floor = len(self.text)
        if not self.stops or not look:
            return self._release(len(self.text))
        cuts = [(i, len(s)) for i, s in ((self.text.find(s, self.floor), s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            at, n = min(cuts)
            self.matched = next(s for s in self.stops if self.text.find(s, self.floor) == at and len(s) == n)
            self.text = self.text[:at + n if self.keep else at]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def finish(self) -> str:
        """What is left to show at the end of the reply."""
        return self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of ``text`` that is the start of a stop sequence."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.floor), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out
