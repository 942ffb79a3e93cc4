"""The next turn's prompt holds the ids the cache was fed, wherever they spell the same text.

A chat's next prompt is the whole conversation rendered again by the chat template and tokenized afresh. The
reply's text tokenizes differently from the ids that were generated (a model may write " cat" as "▁c" "at"; the
tokenizer reads "▁cat"), so the new prompt leaves the cached ids at the reply's first such token and everything
after it is computed again. ``splice`` puts the fed ids back: the longest start of them that spells a start of
the new prompt's text, at a token boundary of the new prompt, followed by the new prompt's own ids from there.
The result decodes to exactly the text of the new prompt (checked); when no start of the fed ids does, the new
prompt is kept as it is and the caller says where it diverged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Splice:
    """``ids``: the prompt to feed; ``kept``: its first tokens taken from the fed ids (beyond the plain common
    prefix ``common`` of the fed ids and the freshly tokenized prompt)."""

    ids: list[int]
    kept: int
    common: int

    @property
    def spliced(self) -> bool:
        return self.kept > self.common


def _text(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _longest_text_prefix(tokenizer, fed: Sequence[int], lo: int, target: str) -> int:
    """The largest ``m >= lo`` (``lo`` known good) with ``text(fed[:m])`` a prefix of ``target``: a binary search,
    since a longer start of the ids spells a longer text."""
    hi = len(fed)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if target.startswith(_text(tokenizer, fed[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _boundary(tokenizer, ids: Sequence[int], lo: int, text: str) -> int:
    """The ``j >= lo`` with ``text(ids[:j]) == text``, or -1: where the new prompt's own ids spell ``text``."""
    lo_, hi = lo, len(ids)
    while lo_ < hi:  # the first j whose text is at least as long
        mid = (lo_ + hi) // 2
        if len(_text(tokenizer, ids[:mid])) < len(text):
            lo_ = mid + 1
        else:
            hi = mid
    for j in (lo_, lo_ + 1):  # a byte-level token may leave half a character: the next one completes it
        if j <= len(ids) and _text(tokenizer, ids[:j]) == text:
            return j
    return -1


def splice(tokenizer, fed: Sequence[int], ids: Sequence[int], tries: int = 4) -> Splice:
    """``ids`` (a freshly tokenized prompt) with the longest start of ``fed`` (the ids a cache was fed) that
    spells the same text in their place. ``tries``: how many shorter starts to try when a start ends inside one
    of the new prompt's tokens."""
    ids = [int(i) for i in ids]
    common = common_prefix(fed, ids)
    if tokenizer is None or common >= len(fed) or common >= len(ids) - 1:
        return Splice(ids, common, common)
    target = _text(tokenizer, ids)
    m = _longest_text_prefix(tokenizer, fed, common, target)
    for _ in range(tries):
        if m <= common:
            break
        j = _boundary(tokenizer, ids, common, _text(tokenizer, fed[:m]))
        if j > 0:
            out = [int(t) for t in fed[:m]] + ids[j:]
            if len(out) > m and _text(tokenizer, out) == target:  # one token at least is left to feed
                return Splice(out, m, common)
        m -= 1
    return Splice(ids, common, common)
