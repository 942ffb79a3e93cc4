"""A body of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) checked and turned
into the chat request the engine serves (``engine.server.schemas.GenRequest``), field errors named as Anthropic
names them (``messages[1].content[0].tool_use_id``).

Blocks: ``text``; ``tool_use`` (an assistant's call: ``id``, ``name``, ``input``); ``tool_result`` (a user's answer
to a call: ``tool_use_id``, ``content`` as text or text blocks, ``is_error``). Images, documents and extended
thinking are refused by name. ``system`` is a string or text blocks; ``tool_choice`` ``auto`` / ``any`` (a call is
forced) / ``tool`` (that one) / ``none``, ``disable_parallel_tool_use``; ``stop_sequences``, ``temperature``
(0..1), ``top_p``, ``top_k``; ``metadata`` and ``cache_control`` marks are taken and change nothing (the prefix
cache is automatic).
"""

from __future__ import annotations

import json
from typing import Any

from engine.server.errors import bad_request
from engine.server.schemas import MAX_STOP, GenRequest, parse_chat


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of content blocks", where, "invalid_type")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{where}[{j}]: expected a content block with a type", f"{where}[{j}]", "invalid_type")
    return content


def _text_of(content: Any, where: str) -> str:
    """Text blocks' text joined (a tool result's or the system prompt's)."""
    if content is None:
        return ""
    parts = []
    for j, b in enumerate(_blocks(content, where)):
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text blocks are supported here ({b['type']!r} given)",
                              f"{where}[{j}]", "invalid_value")
        parts.append(b["text"])
    return "".join(parts)


def _user(m: dict, i: int, calls: set) -> list[dict]:
    """A user turn: its tool results first (each a ``tool`` message), then its text."""
    out, text = [], []
    for j, b in enumerate(_blocks(m.get("content"), f"messages[{i}].content")):
        w = f"messages[{i}].content[{j}]"
        if b["type"] == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif b["type"] == "tool_result":
            cid = b.get("tool_use_id")
            if not isinstance(cid, str) or cid not in calls:
                raise bad_request(f"{w}.tool_use_id: {cid!r} answers no tool_use block of an earlier assistant "
                                  "message", f"{w}.tool_use_id", "invalid_value")
            body = _text_of(b.get("content"), f"{w}.content")
            out.append({"role": "tool", "tool_call_id": cid, "content": ("Error: " + body) if b.get("is_error")
                        else body})
        else:
            raise bad_request(f"{w}: {b['type']!r} blocks are not supported (text and tool_result are)", w,
                              "invalid_value")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(m: dict, i: int, calls: set) -> dict:
    text, tool_calls = [], []
    for j, b in enumerate(_blocks(m.get("content"), f"messages[{i}].content")):
        w = f"messages[{i}].content[{j}]"
        if b["type"] == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif b["type"] == "tool_use":
            if not isinstance(b.get("id"), str) or not b["id"] or not isinstance(b.get("name"), str):
                raise bad_request(f"{w}: a tool_use block needs an id and a name", w, "invalid_type")
            if not isinstance(b.get("input", {}), dict):
                raise bad_request(f"{w}.input: expected an object", f"{w}.input", "invalid_type")
            calls.add(b["id"])
            tool_calls.append({"id": b["id"], "type": "function",
                               "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif b["type"] in ("thinking", "redacted_thinking"):
            continue  # an earlier reply's reasoning: not sent back to the model (as Anthropic's own API does)
        else:
            raise bad_request(f"{w}: {b['type']!r} blocks are not supported (text and tool_use are)", w,
                              "invalid_value")
    out: dict = {"role": "assistant", "content": "".join(text)}
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: expected a list of tools ({name, description, input_schema})", "tools",
                          "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}]: expected an object", f"tools[{i}]", "invalid_type")
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}].type: {t.get('type')!r} (a server tool) is not supported",
                              f"tools[{i}].type", "invalid_value")
        if "input_schema" in t and not isinstance(t["input_schema"], dict):
            raise bad_request(f"tools[{i}].input_schema: expected a JSON schema (an object)",
                              f"tools[{i}].input_schema", "invalid_type")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
        if t.get("description") is not None:
            fn["description"] = t.get("description")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict) -> tuple[Any, bool | None]:
    tc = body.get("tool_choice")
    if tc is None:
        return None, None
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice: expected {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice",
                          "invalid_type")
    off = tc.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: expected a boolean",
                          "tool_choice.disable_parallel_tool_use", "invalid_type")
    kind = tc["type"]
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad_request("tool_choice.name: required with type 'tool'", "tool_choice.name", "invalid_type")
        return {"type": "function", "function": {"name": tc["name"]}}, None if off is None else not off
    return {"auto": "auto", "any": "required", "none": "none"}[kind], None if off is None else not off


def openai_body(body: dict, count_only: bool = False) -> dict:
    """The OpenAI-shaped chat body of an Anthropic Messages body (400s naming Anthropic's fields)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: required (a non-empty list of {role, content})", "messages",
                          "invalid_value" if msgs is not None else "missing_required_parameter")
    for name in ("thinking", "container", "mcp_servers"):
        if body.get(name):
            raise bad_request(f"{name}: not supported by this server", name, "unsupported_parameter")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    calls: set = set()
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out.extend(_user(m, i, calls))
        elif role == "assistant":
            out.append(_assistant(m, i, calls))
        else:
            raise bad_request(f"messages[{i}].role: {role!r} is not user or assistant", f"messages[{i}].role",
                              "invalid_value")
    oa: dict[str, Any] = {"model": body.get("model"), "messages": out}
    tools = _tools(body)
    choice, parallel = _tool_choice(body)
    for key, val in (("tools", tools), ("tool_choice", choice), ("parallel_tool_calls", parallel)):
        if val is not None:
            oa[key] = val
    return oa if count_only else _sampling(body, oa)


def _sampling(body: dict, oa: dict) -> dict:
    """``oa`` with the reply's settings of Anthropic's ``body``: max_tokens, stop_sequences, output_config's
    JSON schema, temperature (0..1), top_p, top_k, stream."""
    mt = body.get("max_tokens")
    if mt is None:
        raise bad_request("max_tokens: required", "max_tokens", "missing_required_parameter")
    oa["max_tokens"] = mt
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
            raise bad_request(f"stop_sequences: expected at most {MAX_STOP} non-empty strings", "stop_sequences",
                              "invalid_value")
        if stops:
            oa["stop"] = stops
    out_cfg = body.get("output_config")
    if out_cfg is not None:
        fmt = out_cfg.get("format") if isinstance(out_cfg, dict) else None
        if not isinstance(out_cfg, dict) or (fmt is not None and (not isinstance(fmt, dict)
                                                                 or fmt.get("type") != "json_schema")):
            raise bad_request("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                              "output_config.format", "invalid_type")
        if fmt is not None:  # Anthropic's structured output: the reply is JSON that validates
            oa["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": fmt.get("schema")}}
    temp = body.get("temperature")
    if temp is not None and (isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp > 1):
        raise bad_request(f"temperature: {temp} is outside [0.0, 1.0]", "temperature", "invalid_value")
    for key in ("temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            oa[key] = body[key]
    return oa


def parse_messages(body: dict) -> GenRequest:
    """The ``GenRequest`` of a Messages body (temperature defaults to 1.0, as Anthropic's does)."""
    return parse_chat(openai_body(body))
