"""A chat as a Markdown document (File ▸ Export ▸ Chat as Markdown…): what was said and, under each reply,
its speed and cache line, so a conversation and what the cache did in it can be shared or kept."""

from __future__ import annotations

import time
from typing import Iterable

from app.history.store import Chat, Message
from app.chat.message_view import cache_line, error_line, note_lines, stats_line
from app.ground.reuse_words import footer_line

ROLE_TITLES = {"user": "You", "assistant": "Model", "system": "System"}


def chat_markdown(chat: Chat, messages: Iterable[Message], model: str = "", now: float | None = None) -> str:
    """The chat as Markdown: a title, who and when, the system prompt, then each message under a heading;
    a reply's error (if one stopped it), notes, stats and cache line follow it as a quote."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() if now is None else now))
    meta = [f"exported from KV Scope {stamp}"] + ([f"model {model}"] if model else [])
    lines = [f"# {chat.title}", "", "_" + " · ".join(meta) + "_", ""]
    if chat.system_prompt.strip():
        lines += ["## System", "", chat.system_prompt.strip(), ""]
    for m in messages:
        lines += [f"## {ROLE_TITLES.get(m.role, m.role.title())}", "", m.content.rstrip() or "_(empty)_", ""]
        lines_of = (error_line(m.stats), *note_lines(m.stats), stats_line(m.stats), cache_line(m.stats),
                    footer_line(m.stats))
        info = [x for x in lines_of if x] if m.role == "assistant" else []
        if info:
            lines += ["> " + " — ".join(info), ""]
    return "\n".join(lines).rstrip() + "\n"
