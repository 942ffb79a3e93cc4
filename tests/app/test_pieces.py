"""A message's text in pieces a frame can lay out (``app.chat.pieces``): the same pieces whether the text
streamed or came whole, covering it exactly, each within the limits, fences reopened."""

from __future__ import annotations

from app.chat.markdown import to_html
from app.chat.pieces import HEAD_CHARS, HEAD_LINES, PIECE_CHARS, PIECE_LINES, Pieces, cut

PROSE = "The little dog ran to the park and played with a big red ball. "


def _pieces(text: str) -> list:
    p = Pieces()
    p.update(text)
    return p.all


def test_pieces_cover_the_text_within_the_limits():
    for text in (PROSE * 1600, "Pf" * 50_000, "line\n" * 3000, (PROSE * 20 + "\n\n") * 60):
        pieces = _pieces(text)
        assert "".join(p.body for p in pieces) == text
        assert [p.start for p in pieces] == [0] + [p.end for p in pieces[:-1]]
        assert all(len(p.body) <= PIECE_CHARS and p.body.count("\n") <= PIECE_LINES for p in pieces)
        assert len(pieces[0].body) <= HEAD_CHARS and pieces[0].body.count("\n") <= HEAD_LINES  # a collapsed text's
        assert len(pieces) >= len(text) // PIECE_CHARS


def test_a_piece_ends_at_a_paragraph_then_a_line_then_a_space():
    para = "word " * 300 + "\n\n"  # 1,502 characters
    assert cut(para * 3) == len(para)  # after the blank line
    assert cut("x" * 1500 + "\n" + "y" * 1000) == 1501
    assert cut("x" * 1500 + " " + "y" * 1000) == 1501
    assert cut("Pf" * 5000) == PIECE_CHARS  # nothing to break at: at the limit
    assert cut("a\n" * 100) == 2 * PIECE_LINES
    head = "Look: " + "Pf" * 600 + "\n"
    assert cut(head + "```\n" + "Pf" * 1200) == len(head)  # not after the fence line: no empty code block
    code = "value = compute(x)  # a comment here\n" * 30 + "```\n"
    assert cut(code + "Pf" * 1200, fence="python") == len(code)  # after a closing one: yes


def test_streaming_gives_the_pieces_of_the_whole_text():
    text = ("Some prose, then code:\n```python\n" + "x = 1  # " + "y" * 3000 + "\n" * 50 + "```\n"
            + PROSE * 100 + "Pf" * 3000)
    streamed = Pieces()
    for end in range(0, len(text) + 1, 37):  # 37 characters a frame, as tokens arrive
        streamed.update(text[:end])
    streamed.update(text)
    assert streamed.all == _pieces(text)


def test_a_piece_inside_a_code_fence_reopens_it():
    text = "Here:\n```python\n" + "print(1)\n" * 200 + "```\nDone **now**."
    pieces = _pieces(text)
    assert [p.fence for p in pieces[:3]] == [None, "python", "python"]
    assert pieces[1].source().startswith("```python\n")
    assert "<pre" in to_html(pieces[1].source()) and "<b>now</b>" in to_html(pieces[-1].source())


def test_an_edited_text_is_cut_anew():
    p = Pieces()
    p.update(PROSE * 200)
    p.update("Pf" * 3000)
    assert p.all == _pieces("Pf" * 3000) and "".join(x.body for x in p.all) == "Pf" * 3000
