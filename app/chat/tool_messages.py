"""A chat's tool calls and their results as the engine reads them, and as the chat shows them (Qt-free).

An assistant message that called tools keeps the calls in its stats (``tool_calls``: the API's form, arguments as
JSON text); each result is a message of its own, role ``tool``, its stats naming the call it answers
(``tool_call_id``), the tool (``name``, ``server``), the arguments and what became of the call (``status``: done,
failed, declined).
"""

from __future__ import annotations

from typing import Any

STATUS_WORDS = {"done": "", "failed": "failed", "declined": "declined by you"}


def engine_message(role: str, content: str, stats: dict[str, Any]) -> dict | None:
    """A stored message as the engine reads it (None: not part of the prompt — an empty reply)."""
    if role == "tool":
        return {"role": "tool", "content": content, "tool_call_id": str(stats.get("tool_call_id", ""))}
    calls = stats.get("tool_calls") if role == "assistant" else None
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": list(calls)}
    if role == "user" or (role == "assistant" and content):
        item = {"role": role, "content": content}
        if stats.get("pinned"):
            item["pinned"] = True  # the priority policy never evicts it
        return item
    return None


def tool_title(stats: dict[str, Any]) -> str:
    """A tool message's header: 'Tool · get_weather (weather) · {"city": "Paris"}' and, where it did not run, why."""
    name, server, args = stats.get("name", "tool"), stats.get("server", ""), stats.get("arguments", "")
    status = STATUS_WORDS.get(stats.get("status", "done"), "")
    head = f"Tool · {name}" + (f" ({server})" if server else "")
    return " · ".join(p for p in (head, args if len(args) <= 160 else args[:157] + "…", status) if p)
