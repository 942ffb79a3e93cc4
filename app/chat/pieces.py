"""A message's text cut into pieces small enough to lay out in one frame (no Qt here).

One rich-text label holding 100 KB took 66–290 ms a layout pass here and ~240 ms more for its minimum
size (a 100 KB paste froze the window 2–6 s and slowed the reply streaming beside it); a label of
``PIECE_CHARS`` = 2,000 characters takes 1–3 ms. So a bubble shows its text as consecutive pieces, one
label each, and a streaming reply re-renders only its last piece.

Cutting is deterministic from the piece's start: a piece depends only on the ``PIECE_CHARS`` characters
after it, so cutting text as it streams gives the same pieces as cutting it whole. A piece ends after a
blank line, else after a line, else after a space, else at the limit (an unbroken run); never before half
the limit, so a piece is not left nearly empty. The first piece is shorter (``HEAD_CHARS``): it is what a
collapsed text shows. A piece that starts inside a fenced code block reopens
the fence when drawn (``source``).
"""

from __future__ import annotations

from dataclasses import dataclass

PIECE_CHARS = 2000  # one label's text: 1–3 ms to lay out (a 100 KB label: 66–290 ms)
PIECE_LINES = 40  # and at most 40 lines (~600 px): short lines lay out as slowly as long ones
HEAD_CHARS, HEAD_LINES = 600, 12  # the first piece, all a collapsed text shows: ~13 lines, ~200 px in the
# narrowest column (300 px at 1024×768); a 2,000-character one was taller than the transcript there
COLLAPSE_PIECES = 2  # a text of more pieces than this (> ~2,600 characters or ~52 lines) collapses


@dataclass(frozen=True)
class Piece:
    """``text[start:start + len(body)]``; ``fence``: the language of the code fence open where it starts
    (None outside a fence)."""

    start: int
    body: str
    fence: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.body)

    def source(self) -> str:
        """The Markdown to draw: the piece, with its code fence reopened when it starts inside one."""
        return self.body if self.fence is None else f"```{self.fence}\n{self.body}"


def cut(text: str, limit: int = PIECE_CHARS, lines: int = PIECE_LINES, fence: str | None = None) -> int:
    """Where the first piece of ``text`` ends (``len(text)`` when all of it fits in one); ``fence``: the
    code fence open where it starts."""
    window = text[:limit]
    nl, at = -1, 0
    for _ in range(lines):  # the end of the window's ``lines``-th line
        nl = window.find("\n", nl + 1)
        if nl < 0:
            break
        at = nl + 1
    else:
        window = window[:at]
    if len(text) <= len(window):
        return len(text)
    half = len(window) // 2
    for mark in ("\n\n", "\n", " "):
        at = window.rfind(mark)
        while at >= half and _opens_fence(window, at, fence):  # a piece ending on "```" would show an empty block
            at = window.rfind(mark, 0, at)
        if at >= half:
            return at + len(mark)
    return len(window)


def _opens_fence(window: str, at: int, fence: str | None) -> bool:
    """The line that ends at ``at`` opens a code fence (a closing one may end a piece)."""
    line = window[window.rfind("\n", 0, at) + 1:at]
    return line.strip().startswith("```") and fence_after(window[:at], fence) is not None


def fence_after(body: str, fence: str | None) -> str | None:
    """The open code fence after ``body`` (a fence line toggles it), starting from ``fence``."""
    if "```" not in body:
        return fence
    for line in body.split("\n"):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip() if fence is None else None
    return fence


class Pieces:
    """The pieces of a text that grows at its end (a streaming reply) or is replaced (an edit).

    ``update(text)`` keeps the frozen pieces when ``text`` goes on from them and cuts only the new end:
    the work per call is the text added since the last one, plus one comparison of the frozen prefix.
    ``frozen`` pieces are final; ``tail`` is what follows them (shorter than a piece; it grows).
    """

    def __init__(self) -> None:
        self.frozen: list[Piece] = []
        self.tail = Piece(0, "")
        self._prefix = ""  # the frozen pieces' text

    def update(self, text: str) -> None:
        end, changed = len(self._prefix), False
        if not text.startswith(self._prefix):  # not a continuation (an edit, another version): cut anew
            self.frozen, end, changed = [], 0, True
        fence = fence_after(self.frozen[-1].body, self.frozen[-1].fence) if self.frozen else None
        while True:
            limit, lines = (HEAD_CHARS, HEAD_LINES) if end == 0 else (PIECE_CHARS, PIECE_LINES)
            at = end + cut(text[end:end + limit + 1], limit, lines, fence)  # one piece's worth, not the rest
            if at >= len(text):
                break
            piece = Piece(end, text[end:at], fence)
            self.frozen.append(piece)
            fence, end, changed = fence_after(piece.body, fence), at, True
        self.tail = Piece(end, text[end:], fence)
        if changed:  # a copy only when the frozen part changed, not every frame
            self._prefix = text[:end]

    @property
    def all(self) -> list[Piece]:
        """Every piece, the tail last (when it has text)."""
        return self.frozen + ([self.tail] if self.tail.body or not self.frozen else [])

    @property
    def collapsible(self) -> bool:
        """Long enough to show only its first piece until the user asks for all of it."""
        return len(self.all) > COLLAPSE_PIECES
