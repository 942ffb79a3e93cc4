"""The agent fields of a chat request, checked: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``response_format``, and the messages agents send back (assistant messages carrying ``tool_calls``, ``tool``
results). Each wrong one is a 400 naming the field (``messages[2].tool_calls[0].function.arguments``).

Messages come out in the shape chat templates read (transformers' convention): an assistant message's calls with
their arguments as an object (templates write them with ``tojson``), a tool result with its ``tool_call_id`` and
the ``name`` of the function it answers (some templates print it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.server.errors import bad_request

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_tools(body: dict) -> tuple[dict, ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad_request(f"tools: expected a list of function tools ({type(tools).__name__} given)", "tools",
                          "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools ({len(tools)} given)", "tools", "invalid_value")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise bad_request(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                              "\"parameters\"}}", where, "invalid_type")
        f = t["function"]
        out.append({"type": "function", "function": function_of(f, f"{where}.function", seen)})
    return tuple(out)


def function_of(f: dict, where: str, seen: set) -> dict:
    """One function's definition checked: name, description, parameters (a JSON schema of an object)."""
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{where}.name: {name!r} is not a function name (1-64 letters, digits, _ . -)",
                          f"{where}.name", "invalid_value")
    if name in seen:
        raise bad_request(f"{where}.name: {name!r} is defined twice", f"{where}.name", "invalid_value")
    seen.add(name)
    desc = f.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{where}.description: expected a string", f"{where}.description", "invalid_type")
    params = f.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad_request(f"{where}.parameters: expected a JSON schema (an object)", f"{where}.parameters",
                          "invalid_type")
    if params.get("type", "object") != "object":
        raise bad_request(f"{where}.parameters: the arguments must be an object (type {params.get('type')!r} "
                          "given)", f"{where}.parameters", "invalid_value")
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict: expected a boolean", f"{where}.strict", "invalid_type")
    # the client's own order: templates print the tool as JSON, and the prompt is then the one it would render
    out = {k: f[k] for k in f if k in ("name", "description", "parameters", "strict") and f[k] is not None}
    out.setdefault("parameters", params)
    return out


def parse_tool_choice(body: dict, tools: tuple[dict, ...]) -> str:
    """``auto`` / ``none`` / ``required`` / the name of the one function to call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice: {choice!r} is not one of auto, none, required (or a named function)",
                              "tool_choice", "invalid_value")
        name = choice
    elif isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice", "invalid_type")
        if not any(t["function"]["name"] == name for t in tools):
            raise bad_request(f"tool_choice: {name!r} is not one of the tools given", "tool_choice", "invalid_value")
    else:
        raise bad_request(f"tool_choice: {choice!r} is not a string or an object", "tool_choice", "invalid_type")
    if name == "required" and not tools:
        raise bad_request("tool_choice: 'required' needs tools", "tool_choice", "invalid_value")
    return name


def parse_parallel(body: dict) -> bool:
    v = body.get("parallel_tool_calls", True)
    if v is None:
        return True
    if not isinstance(v, bool):
        raise bad_request(f"parallel_tool_calls: {v!r} is not a boolean", "parallel_tool_calls", "invalid_type")
    return v


def parse_response_format(body: dict) -> dict | None:
    """None (text), ``{"type": "json_object"}`` or ``{"type": "json_schema", "schema", "name"}``."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format: expected an object ({\"type\": \"text\" | \"json_object\" | "
                          "\"json_schema\"})", "response_format", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                          "response_format.type", "invalid_value")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format.json_schema: expected {\"name\", \"schema\"}",
                          "response_format.json_schema", "invalid_type")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema: expected a JSON schema (an object)",
                          "response_format.json_schema.schema", "invalid_type")
    name = js.get("name", "response")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"response_format.json_schema.name: {name!r} is not a name (1-64 letters, digits, _ . -)",
                          "response_format.json_schema.name", "invalid_value")
    return {"type": "json_schema", "schema": schema, "name": name}


def _text(c: Any, where: str, allow_none: bool = False) -> str:
    if isinstance(c, str):
        return c
    if c is None and allow_none:
        return ""
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad_request(f"{where}: only text parts are supported ({kind!r} given)", where, "invalid_value")
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request(f"{where}: expected a string or a list of text parts", where, "invalid_type")


def _calls(m: dict, where: str) -> list[dict]:
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls: expected a list", f"{where}.tool_calls", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(c.get("id"), str) or not c["id"]:
            raise bad_request(f"{w}: expected {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}}}", w, "invalid_type")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"{w}.function.name: expected a function name", f"{w}.function.name", "invalid_type")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise bad_request(f"{w}.function.arguments: not JSON text ({e})", f"{w}.function.arguments",
                                  "invalid_value") from None
        if not isinstance(args, dict):
            raise bad_request(f"{w}.function.arguments: expected a JSON object", f"{w}.function.arguments",
                              "invalid_value")
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def chat_messages(msgs: list) -> list[dict]:
    """The messages of a chat request as templates read them (400 naming the first bad one)."""
    out: list[dict] = []
    calls_by_id: dict[str, str] = {}
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: expected an object with role and content", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role: {role!r} is not supported (one of {', '.join(ROLES)})",
                              f"{where}.role", "invalid_value")
        if role == "assistant":
            calls = _calls(m, where)
            item = {"role": "assistant", "content": _text(m.get("content"), f"{where}.content", allow_none=True)}
            if calls:
                item["tool_calls"] = calls
                calls_by_id.update({c["id"]: c["function"]["name"] for c in calls})
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where}.tool_call_id: required (the id of the call this answers)",
                                  f"{where}.tool_call_id", "missing_required_parameter")
            if cid not in calls_by_id:
                raise bad_request(f"{where}.tool_call_id: {cid!r} answers no call of an earlier assistant message",
                                  f"{where}.tool_call_id", "invalid_value")
            item = {"role": "tool", "content": _text(m.get("content"), f"{where}.content"), "tool_call_id": cid,
                    "name": calls_by_id[cid]}
        else:
            item = {"role": "system" if role == "developer" else role,
                    "content": _text(m.get("content"), f"{where}.content")}
        out.append(item)
    last = out[-1]["role"]
    if last not in ("user", "tool"):
        raise bad_request(f"messages[{len(out) - 1}]: the last message must be from the user or a tool result (role "
                          f"{last!r} given)", f"messages[{len(out) - 1}].role", "invalid_value")
    return out
