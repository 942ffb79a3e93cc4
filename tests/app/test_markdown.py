"""The streaming-safe Markdown converter."""

from app.chat.markdown import ZWSP, to_html


def test_code_block_and_inline():
    html = to_html("Use `x < 1`:\n```python\nprint('<b>')\n```\nDone **now**.")
    assert "<pre" in html and "print(&#x27;&lt;b&gt;&#x27;)" in html
    assert "python" in html
    assert "<code" in html and "x &lt; 1" in html
    assert "<b>now</b>" in html


def test_unclosed_fence_while_streaming_is_code():
    html = to_html("Here:\n```\nfor i in range(3):\n    pass")
    assert "<pre" in html and "for i in range(3):" in html


def test_lists_headings_and_escaping():
    html = to_html("# Title\n- a\n- b\n1. one\n<script>")
    assert "<h3>Title</h3>" in html
    assert html.count("<li>") == 3 and "<ul>" in html and "<ol>" in html
    assert "&lt;script&gt;" in html


def test_long_runs_can_wrap():
    html = to_html("x" * 100)
    assert ZWSP in html
