"""Accepted draft tokens, tinted in a reply's rich text.

A reply's draft spans are character ranges of its text that came from draft tokens the model kept
(``TokenEvent.draft``). The spans are marked in the Markdown with two private-use characters, the Markdown is
rendered as usual, and the marks become ``<span>`` tags; a mark never sits in a code fence line nor before a
line's heading, list or number prefix (they would stop being Markdown), and a tinted run never crosses a line.
"""

from __future__ import annotations

import re

from app.chat.markdown import to_html

OPEN, CLOSE = "\ue000", "\ue001"
TINT = "#2c5a45"  # a green background the bubble's light text stays readable on
_PREFIX = re.compile(r"^\s*(?:#{1,6}\s+|[-*+]\s+|\d+[.)]\s+)?")


def add_span(spans: list[list[int]], start: int, end: int) -> None:
    """Add the characters ``start:end`` to ``spans`` (sorted, touching spans merged), in place."""
    if end <= start:
        return
    if spans and spans[-1][1] >= start:
        spans[-1][1] = max(spans[-1][1], end)
    else:
        spans.append([start, end])


def _runs(line: str, flags: list[bool]) -> str:
    out, inside = [], False
    for ch, on in zip(line, flags):
        if on != inside:
            out.append(OPEN if on else CLOSE)
            inside = on
        out.append(ch)
    if inside:
        out.append(CLOSE)
    return "".join(out)


def mark(text: str, spans) -> str:
    """``text`` with each tinted run inside one line wrapped in OPEN … CLOSE."""
    flags = [False] * len(text)
    for start, end in spans:
        for i in range(max(0, int(start)), min(len(text), int(end))):
            flags[i] = True
    out, pos = [], 0
    for line in text.split("\n"):
        end = pos + len(line)
        if line.strip().startswith("```"):
            out.append(line)
        else:
            skip = _PREFIX.match(line).end()
            out.append(line[:skip] + _runs(line[skip:], flags[pos + skip:end]))
        pos = end + 1
    return "\n".join(out)


def tinted_html(text: str, spans, colour: str = TINT) -> str:
    """The reply's rich text with its accepted draft tokens (or other ``spans``, in ``colour``: the fidelity check's
    worst tokens) on a tinted background."""
    if not spans:
        return to_html(text)
    html = to_html(mark(text, spans))
    return html.replace(OPEN, f'<span style="background-color:{colour}">').replace(CLOSE, "</span>")
