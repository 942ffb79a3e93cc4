"""A small, streaming-safe Markdown → Qt rich-text converter for chat messages.

Handles what chat replies use: fenced code blocks (an unclosed fence while streaming is shown as code),
inline code, **bold**, *italic*, headings, bullet and numbered lists, paragraphs. Everything else is
escaped text, so a half-written reply never breaks the layout.
"""

from __future__ import annotations

import html
import re

CODE_BG = "#15181e"
CODE_FG = "#d7dae0"
INLINE_CODE_BG = "#2a2f3a"

_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_ITALIC = re.compile(r"(?<![\*\w])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\*\w])")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_NUMBERED = re.compile(r"^\s*(\d+)[.)]\s+(.*)$")


_LONG_RUN = re.compile(r"\S{32,}")
ZWSP = "\u200b"


def breakable(text: str, every: int = 24) -> str:
    """Let Qt wrap very long runs without spaces (URLs, base64, a long code line) by inserting zero-width
    spaces every ``every`` characters: Qt breaks lines only at spaces, and one unbroken run made a label's
    minimum width its whole length, widening the bubble past the column (its buttons cut off). Used on
    prose, inline code and code blocks alike."""
    return _LONG_RUN.sub(lambda m: ZWSP.join(m.group(0)[i : i + every] for i in range(0, len(m.group(0)), every)), text)


def _inline(text: str) -> str:
    parts = _INLINE_CODE.split(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 1:
            out.append(
                f'<code style="background-color:{INLINE_CODE_BG}; font-family:monospace">'
                f"&nbsp;{html.escape(breakable(part))}&nbsp;</code>"
            )
        else:
            s = html.escape(breakable(part))
            s = _BOLD.sub(r"<b>\1</b>", s)
            s = _ITALIC.sub(r"<i>\1</i>", s)
            out.append(s)
    return "".join(out)


def _code_block(code: str, lang: str) -> str:
    label = f'<div style="color:#7f8896; font-size:small">{html.escape(lang)}</div>' if lang else ""
    body = html.escape(breakable(code.rstrip("\n"))) or "&nbsp;"
    return (
        f'<table width="100%" cellpadding="8" cellspacing="0" style="background-color:{CODE_BG}; '
        f'margin-top:4px; margin-bottom:4px"><tr><td>{label}'
        f'<pre style="color:{CODE_FG}; font-family:monospace; margin:0; white-space:pre-wrap">{body}</pre>'
        "</td></tr></table>"
    )


def _prose(lines: list[str]) -> str:
    out: list[str] = []
    para: list[str] = []
    list_kind: str | None = None

    def flush_para() -> None:
        if para:
            out.append("<p>" + "<br>".join(_inline(p) for p in para) + "</p>")
            para.clear()

    def close_list() -> None:
        nonlocal list_kind
        if list_kind:
            out.append(f"</{list_kind}>")
            list_kind = None

    for line in lines:
        if not line.strip():
            flush_para()
            close_list()
            continue
        m = _HEADING.match(line)
        if m:
            flush_para()
            close_list()
            level = min(len(m.group(1)) + 2, 6)  # keep headings modest inside a chat bubble
            out.append(f"<h{level}>{_inline(m.group(2))}</h{level}>")
            continue
        m_b, m_n = _BULLET.match(line), _NUMBERED.match(line)
        if m_b or m_n:
            flush_para()
            kind = "ul" if m_b else "ol"
            if list_kind != kind:
                close_list()
                out.append(f"<{kind}>")
                list_kind = kind
            out.append(f"<li>{_inline(m_b.group(1) if m_b else m_n.group(2))}</li>")
            continue
        close_list()
        para.append(line)
    flush_para()
    close_list()
    return "".join(out)


def to_html(text: str) -> str:
    """Render chat Markdown to Qt rich text. Safe on partial (streaming) input."""
    out: list[str] = []
    prose: list[str] = []
    code: list[str] | None = None
    lang = ""
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("```"):
            if code is None:
                out.append(_prose(prose))
                prose = []
                code, lang = [], stripped[3:].strip()
            else:
                out.append(_code_block("\n".join(code), lang))
                code = None
            continue
        (code if code is not None else prose).append(line)
    if code is not None:  # unclosed fence: still streaming
        out.append(_code_block("\n".join(code), lang))
    else:
        out.append(_prose(prose))
    return "".join(out)
