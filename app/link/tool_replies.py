"""A chat reply with tools (the app's agent loop, ``app.agent``): rendered, constrained and read for calls by the
server's own code — the request checked as the API checks it (``engine.server.schemas.parse_chat``: tools, tool
messages, the calls they answer), the tools written into the prompt by the model's chat template
(``engine.server.render``), a forced call decoded under the grammar (``engine.server.constrain``), the reply read for
calls in the template's format (``engine.server.tool_calls``) — so a chat in the window and an agent over the API
see one behaviour. Runs on the worker's thread.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import Any, Sequence

from engine.config import SamplingConfig
from engine.errors import EngineError

FIELDS = ("role", "content", "tool_calls", "tool_call_id")  # what the API reads of a message (pins stay in the app)
NO_TOOLS = "this model's chat template takes no tools: the reply went without the MCP servers' tools"


@dataclass(frozen=True)
class ToolUse:
    """The tools a reply may call (OpenAI's ``tools``) and ``choice``: "auto", "required" (a call is forced) or
    "none"."""

    tools: tuple[dict, ...] = ()
    choice: str = "auto"


@dataclass(frozen=True)
class ToolTurn:
    """A finished reply read for calls: its text without them (``content``) and the calls, as an assistant message
    of the API carries them (``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments JSON
    text)."""

    content: str
    calls: tuple[dict, ...] = ()


@dataclass(frozen=True)
class ToolReply:
    """What reading the reply needs: the template's call format ("" when none is read), its special tokens."""

    fmt: str
    specials: tuple[str, ...]
    tools: tuple[dict, ...]
    prompt: tuple[int, ...]

    def read_end(self, session, stop_ids: Sequence[int], stats: Any, reason: str) -> ToolTurn | None:
        """``read`` at the reply's end; None for a reply that did not end by itself (cancelled, failed) or that
        cannot be read (its text then stands as it is)."""
        if stats is None or reason in ("cancelled", "error"):
            return None
        try:
            return self.read(session, stop_ids)
        except Exception:  # noqa: BLE001 - unread, the reply is its text
            traceback.print_exc()
            return None

    def read(self, session, stop_ids: Sequence[int]) -> ToolTurn:
        """The reply's text and calls (its tokens decoded with the template's markers kept, stop tokens left out)."""
        tok = session.tokenizer
        ids = [int(t) for t in session.generated_ids]
        while ids and ids[-1] in stop_ids:
            ids.pop()
        text = tok.decode(ids, skip_special_tokens=False)
        if not self.fmt:
            return ToolTurn(tok.decode(ids, skip_special_tokens=True))
        from engine.server.tool_calls import parse, transformers_calls

        parsed = parse(self.fmt, text, self.specials)
        calls = parsed.calls
        if getattr(tok, "response_template", None) is not None:
            prefix = tok.decode(list(self.prompt), skip_special_tokens=False)
            calls = transformers_calls(tok, text, prefix, list(self.tools)) or calls
        return ToolTurn(parsed.content.strip(), tuple(c.openai() for c in calls))


def needs_tools(messages: Sequence[dict], use: ToolUse | None) -> bool:
    """Does this reply go through the tools' road (tools given, or tool calls and results in the chat)?"""
    return use is not None or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def start(session, loaded, messages: Sequence[dict], sampling: SamplingConfig, generation_id: int,
          use: ToolUse | None) -> ToolReply:
    """Start ``session``'s reply to ``messages`` with ``use``'s tools; a request the API would refuse is one
    ``EngineError`` with its words (a tool's bad schema, a template without tool support)."""
    from engine.server.constrain import Constraint, constraint_of
    from engine.server.errors import ApiError
    from engine.server.render import render_messages, session_messages, spans, tool_format
    from engine.server.schemas import parse_chat

    plain = not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if plain and tool_format(loaded.tokenizer) is None:  # a template that writes no tools: the chat goes on without
        session.start(messages, sampling, generation_id)
        session.sequence.add_notes([NO_TOOLS])
        return ToolReply("", (), (), ())
    body: dict[str, Any] = {"model": loaded.info.name,
                            "messages": [{k: m[k] for k in FIELDS if k in m} for m in messages]}
    if use is not None and use.tools:
        body.update(tools=list(use.tools), tool_choice=use.choice)
    tok = loaded.tokenizer
    try:
        req = parse_chat(body)
        constraint = constraint_of(loaded, req) if req.tools else Constraint()
        # the ids the cache was fed wherever they spell the same text (a reply's call re-rendered by the template
        # tokenizes apart from how the model wrote it: 7 of 243 tokens read again without this)
        ids = session.with_fed_ids(render_messages(tok, req.messages, req.tools, model=loaded.info.name))
        cut = spans(tok, req.messages, req.tools) if session.cache.cache_config.needs_spans else []
    except ApiError as e:
        raise EngineError(e.message) from None
    session.start_rendered(ids, session_messages(req.messages), cut, replace(sampling, grammar=constraint.grammar),
                           generation_id)
    return ToolReply(constraint.tool_format or "", tuple(constraint.specials), tuple(req.tools), tuple(ids))
