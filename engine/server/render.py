"""A chat request rendered into token ids through the model's own chat template — with its tools, the calls the
assistant made and their results (``apply_chat_template(..., tools=...)``) — and the tool-call format the
template asks for. Every server prompt is rendered by ``render_messages``: the one place to change the renderer.

A template that never writes the tools it is given (most base models', the plain fallback) has no tool support: a
request with ``tools`` or tool messages is a 400 saying so, found once per tokenizer by rendering a probe tool.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from engine.server.errors import bad_request
from engine.server.tool_calls import detect_format

PROBE = "kvscope_probe_function"
_SUPPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
KINDS = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool_result"}


def needs_tools(messages: Sequence[dict], tools: Sequence[dict]) -> bool:
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def kind_of(m: dict) -> str:
    """The message's kind in the cache account: system / user / assistant / tool_call / tool_result."""
    return "tool_call" if m.get("tool_calls") else KINDS.get(m["role"], m["role"])


def tool_format(tok) -> str | None:
    """The tool-call format of ``tok``'s chat template (``engine.server.tool_calls``), None without tool support."""
    try:
        return _SUPPORT[tok]
    except (KeyError, TypeError):
        pass
    template = getattr(tok, "chat_template", None)
    fmt = None
    if isinstance(template, str) and template:
        probe = [{"type": "function", "function": {"name": PROBE, "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            from engine.model import template_guard

            template_guard.install()
            text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                           add_generation_prompt=True)
            fmt = detect_format(template) if PROBE in text else None
        except Exception:  # noqa: BLE001 - a template that fails on tools has no tool support
            fmt = None
    try:
        _SUPPORT[tok] = fmt
    except TypeError:
        pass
    return fmt


def _apply(tok, messages: list[dict], tools: Sequence[dict], for_reply: bool, model: str) -> list[int]:
    from engine.model import template_guard

    template_guard.install()  # rendered within bounds: output, loop steps, time
    try:
        ids = tok.apply_chat_template(messages, tools=list(tools) or None, add_generation_prompt=for_reply,
                                      tokenize=True)
    except template_guard.TemplateLimitError as e:
        raise bad_request(f"messages: the chat template of {model or 'the model'} went past a render's bounds: {e}",
                          "messages") from None
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception): the template refuses them
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        raise bad_request(f"messages: the chat template of {model or 'the model'} refused them: {e}",
                          "messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def render_messages(tok, messages: Sequence[dict[str, Any]], tools: Sequence[dict] = (),
                    for_reply: bool = True, model: str = "") -> list[int]:
    """Token ids of the chat (ready for the reply with ``for_reply``). Plain chats take the engine's own path
    (``engine.model.chat.render_chat``); chats with tools or tool messages go through the template with them. Both
    render within the template guard's bounds (``engine.model.template_guard``); past one, a 400 naming ``model``."""
    if not needs_tools(messages, tools):
        from engine.model.chat import render_chat

        return render_chat(tok, [{"role": m["role"], "content": m["content"]} for m in messages], for_reply,
                           model=model)
    if tool_format(tok) is None:
        what = "tools" if tools else "messages"
        raise bad_request(f"{what}: this model's chat template has no tool support (it does not write the tools "
                          "it is given)", what, "invalid_value")
    return _apply(tok, [dict(m) for m in messages], tools, for_reply, model)


def spans(tok, messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[tuple[int, int]]:
    """Token range ``[start, end)`` of each message in the rendered chat (ends found by rendering prefixes)."""
    out, start = [], 0
    for i in range(len(messages)):
        try:
            end = len(render_messages(tok, messages[: i + 1], tools, for_reply=False))
        except Exception:  # noqa: BLE001 - a template refusing a prefix (a tool result first): the span is empty
            end = start
        out.append((start, max(start, end)))
        start = max(start, end)
    return out


def reply_text(m: dict) -> str:
    """What identifies an assistant message as a reply this server gave (``engine.server.reply_ids``): its text,
    and its calls' names and arguments (arguments compared as JSON values, not as the client spelled them)."""
    import json

    calls = m.get("tool_calls") or []
    if not calls:
        return m.get("content") or ""
    return (m.get("content") or "") + "\0calls\0" + json.dumps(
        [[c["function"]["name"], c["function"]["arguments"]] for c in calls], ensure_ascii=False)


def session_messages(messages: Sequence[dict]) -> list[dict]:
    """The messages as the session keeps them (roles system / user / assistant: a tool result protects and
    counts as the user's turn it answers)."""
    return [{"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]} for m in messages]


def specials(tok) -> tuple[str, ...]:
    """The special tokens' texts (taken out of the content of a reply decoded with them)."""
    return tuple(sorted((t for t in getattr(tok, "all_special_tokens", ()) if t), key=len, reverse=True))
