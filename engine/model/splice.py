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


def _starts(tokenizer, seq: Sequence[int], lo: int, whole: str | None = None):
    """``m -> text(seq[:m])`` for ``m >= lo``: the text of a shared head (``seq[:a]``, ``a <= lo``, not inside a run of
    byte-fallback tokens) decoded once and each start's tail after it, where the tokenizer decodes ``seq`` piecewise
    there (checked: head + tail == ``whole``, its text); else each start decoded whole. A splice's searches decode a dozen or two
    starts of a ~5,000-token prompt: ~30 ms of an agent-loop step's time to first token, where the tails take ~1."""
    from engine.model.chat import byte_tokens

    b, a = byte_tokens(tokenizer), min(lo, len(seq))
    while 0 < a < len(seq) and seq[a - 1] in b and seq[a] in b:
        a -= 1
    head = _text(tokenizer, seq[:a])
    if a == 0 or head + _text(tokenizer, seq[a:]) != (_text(tokenizer, seq) if whole is None else whole):
        return lambda m: _text(tokenizer, seq[:m])
    return lambda m: head + _text(tokenizer, seq[a:m]) if m >= a else _text(tokenizer, seq[:m])


def _cuts(tokenizer, fed: Sequence[int], lo: int) -> list[int]:
    """The ``m >= lo`` where ``fed`` may be cut: between tokens, but inside a run of byte-fallback tokens only
    between two characters of a run that is UTF-8 — a run that is not decodes as one U+FFFD per byte, its valid
    start included, so its text is known only whole (``engine.model.chat.byte_tokens``)."""
    from engine.model.chat import byte_tokens

    b, n, out, m = byte_tokens(tokenizer), len(fed), [], lo
    while m <= n:
        out.append(m)
        if m < n and fed[m] in b and m > lo and fed[m - 1] in b:  # m is inside a run: drop it unless it may be cut
            out.pop()
        if m < n and fed[m] in b:  # the run from m: its inner cuts, then its end
            end = m
            while end < n and fed[end] in b:
                end += 1
            raw = bytes(b[i] for i in fed[m:end])
            try:
                raw.decode("utf-8")
                out += [m + k for k in range(1, end - m) if (raw[k] & 0xC0) != 0x80]  # a character starts at k
            except UnicodeDecodeError:
                pass
            m = end
            continue
        m += 1
    return out


def _longest_text_prefix(text_of, cuts: list[int], target: str) -> int:
    """The index in ``cuts`` of the largest cut ``m`` (``cuts[0]`` known good) with ``text_of(m)`` (the fed ids'
    start) a prefix of ``target``: a binary search, since a longer start of the ids (cut between characters) spells
    a longer text."""
    lo, hi = 0, len(cuts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if target.startswith(text_of(cuts[mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _boundary(tokenizer, ids: Sequence[int], lo: int, text: str, text_of) -> int:
    """The ``j >= lo`` with ``text_of(j)`` (``text(ids[:j])``) ``== text``, or -1: where the new prompt's own ids
    spell ``text``."""
    cuts = _cuts(tokenizer, ids, lo)
    a, b = 0, len(cuts)
    while a < b:  # the first cut whose text is at least as long
        mid = (a + b) // 2
        if len(text_of(cuts[mid])) < len(text):
            a = mid + 1
        else:
            b = mid
    for k in (a, a + 1):  # a byte-level token may leave half a character: the next one completes it
        if k < len(cuts) and text_of(cuts[k]) == text:
            return cuts[k]
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
    cuts = _cuts(tokenizer, fed, common)
    fed_text, ids_text = _starts(tokenizer, fed, common), _starts(tokenizer, ids, common, target)
    at = _longest_text_prefix(fed_text, cuts, target)
    for _ in range(tries):
        m = cuts[at]
        if m <= common:
            break
        j = _boundary(tokenizer, ids, common, fed_text(m), ids_text)
        if j > 0:
            out = [int(t) for t in fed[:m]] + ids[j:]
            if len(out) > m and _text(tokenizer, out) == target:  # one token at least is left to feed
                return Splice(out, m, common)
        at -= 1
    return Splice(ids, common, common)
