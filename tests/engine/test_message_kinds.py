"""Where an API conversation's messages sit and their kinds (``engine.server.message_kinds``), with Qwen2.5's real
tokenizer and published template: the template's own spans, tool calls and results named, an agent's next step
measured with two renders (the ends of the messages it shares with the last step kept)."""

from __future__ import annotations

from tool_models import qwen_tokenizer

from engine.server import message_kinds
from engine.server.message_kinds import MessageKinds
from engine.server.render import render_messages, spans
from engine.server.schemas import parse_chat

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def _step(n: int) -> list[dict]:
    """An agent's conversation after ``n`` calls and their results."""
    out = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find the weather."}]
    for i in range(n):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": f'{{"q": "w{i}"}}'}}
        out += [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}: sunny"}]
    return parse_chat({"model": "m", "messages": out, "tools": TOOLS}).messages


def test_spans_kinds_and_an_agent_step_measured_with_two_renders(tmp_path, monkeypatch):
    tok = qwen_tokenizer(tmp_path)
    kinds = MessageKinds()
    renders = []
    real = message_kinds.render_messages
    monkeypatch.setattr(message_kinds, "render_messages", lambda *a, **k: renders.append(1) or real(*a, **k))
    first = _step(1)
    kinds.note(7, first, TOOLS)
    total = len(render_messages(tok, first, TOOLS)) + 5  # the reply's header and a few tokens of reply
    got = kinds.spans(tok, 7, total)
    assert [(m.start, m.end) for m in got[:-1]] == spans(tok, first, TOOLS)
    assert [(m.kind, m.number) for m in got] == [("system", 1), ("user", 1), ("tool_call", 1), ("tool_result", 1),
                                                 ("reply", 1)]
    assert got[-1].end == total and len(renders) == 4
    kinds.note(7, _step(2), TOOLS)  # the next step: the same four messages, then a call and its result
    renders.clear()
    got = kinds.spans(tok, 7, total + 40)
    assert len(renders) == 2 and [m.kind for m in got][-3:] == ["tool_call", "tool_result", "reply"]
    assert (got[4].number, got[5].number) == (2, 2)
    assert kinds.spans(tok, 8, 10) == ()  # a conversation never noted: nothing to draw
