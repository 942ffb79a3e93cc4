"""Tool calls in a model's own words: which format its chat template asks for, how to read calls out of a reply
(whole, or streamed), and the grammar that makes a forced call come out in that format.

Formats (the families people run; the template's text says which):

- ``hermes``: Qwen2.5 / Qwen3 / Hermes — ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call (parallel calls: several blocks);
- ``llama3``: Llama 3.1 / 3.2 / 3.3 — the reply is ``{"name": ..., "parameters": {...}}`` (after
  ``<|python_tag|>`` at times), one call per reply (the template refuses more);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Nemo, v3) or ``[TOOL_CALLS]name[ARGS]{...}``
  per call (Small 3.2, Ministral, Devstral); call ids of 9 letters and digits, as those templates demand;
- ``harmony``: gpt-oss — ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``, ended by
  ``<|call|>`` (a stop token);
- ``gemma``: Gemma 4 — ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>``, its own argument syntax
  (read into JSON; a forced call is not offered: the grammar library writes JSON);
- ``json``: any other template that renders tools — a forced call is a JSON array ``[{"name", "parameters"}]``
  (vLLM's way), and a free reply is text.

A tokenizer with a ``response_template`` (transformers' response parsing) is read with it instead. Replies are
parsed from their text decoded with special tokens kept (``[TOOL_CALLS]`` and ``<|python_tag|>`` are special).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field



@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name, its arguments as JSON text, and the id the reply gives it."""

    name: str
    arguments: str
    id: str

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def as_message(content: str, calls: list[ToolCall]) -> dict:
    """An assistant message as a request sends it back (arguments as objects, as templates read them)."""
    out: dict = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]
    return out


def new_call_id(fmt: str) -> str:
    if fmt.startswith("mistral"):  # Mistral's templates refuse any other id
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def detect_format(template: str) -> str:
    """The tool-call format a chat template's text asks for (``json`` when it names none we know)."""
    if "<|tool_call>call:" in template:
        return "gemma"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral_args" if "[ARGS]" in template else "mistral"
    if "to=functions." in template or ("<|channel|>" in template and "<|call|>" in template):
        return "harmony"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters": ' in template):
        return "llama3"
    return "json"


def _args_text(args) -> str:
    """Arguments as JSON text (a string given is kept when it parses; else it is taken as text)."""
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def _call_from(obj, fmt: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    cid = obj.get("id")  # Mistral's calls carry their id (the template writes it back)
    return ToolCall(obj["name"], _args_text(args), cid if isinstance(cid, str) and cid else new_call_id(fmt))


def _json_values(text: str) -> list:
    """The JSON values written one after another in ``text`` (separated by spaces, ``;`` or ``,``)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        val, i = dec.raw_decode(text, i)
        out.append(val)
    return out


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
# the recipient in the header's role part (as the template writes it) or in its channel part (as the model may)
_HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)(?:[^<]|<\|channel\|>|<\|constrain\|>)*?<\|message\|>(.*?)"
                           r"(?=<\|call\|>|<\|end\|>|<\|start\|>|$)", re.S)
_GEMMA = re.compile(r"<\|tool_call>call:([^\s{<]+)(\{.*?\})(?=<tool_call\|>|$)", re.S)
_GEMMA_BLOCK = re.compile(r"<\|tool_call>.*?(?:<tool_call\|>|$)", re.S)
_GEMMA_QUOTE = '<|"|>'
_WORD = re.compile(r"[A-Za-z_][\w.\-]*")
_HARMONY_MSG = re.compile(r"<\|channel\|>(\w+)(?:\s[^<]*)?<\|message\|>(.*?)(?=<\|end\|>|<\|return\|>|<\|start\|>|$)",
                          re.S)


def parse(fmt: str, text: str, specials: tuple[str, ...] = ()) -> Parsed:
    """The reply ``text`` (special tokens kept) as content and calls. Text that only looks like a call (JSON that
    does not parse, no function name) stays content: nothing the model wrote is lost."""
    if fmt == "hermes" and "<tool_call>" in text:
        calls, ok = [], True
        for body in _HERMES.findall(text):
            try:
                call = _call_from(json.loads(body), fmt)
            except ValueError:
                call = None
            ok = ok and call is not None
            calls.append(call)
        if ok and calls:
            return Parsed(_content(_HERMES.sub("", text), specials), calls)
    elif fmt == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        if body.startswith("{"):
            try:
                vals = _json_values(body)
            except ValueError:
                vals = []
            calls = [_call_from(v, fmt) for v in vals]
            if calls and all(calls):
                return Parsed("", calls)
    elif fmt in ("mistral", "mistral_args") and "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        calls = _mistral_calls(rest)
        if calls:
            return Parsed(_content(head, specials), calls)
    elif fmt == "harmony":
        return _harmony(text, specials)
    elif fmt == "gemma" and "<|tool_call>" in text:
        calls = []
        for name, body in _GEMMA.findall(text):
            try:
                call = _call_from({"name": name, "arguments": gemma_args(body)}, fmt)
            except ValueError:
                call = None
            if call is None:
                return Parsed(_content(text, specials))
            calls.append(call)
        if calls:
            return Parsed(_content(_GEMMA_BLOCK.sub("", text), specials), calls)
    elif fmt == "json" and text.lstrip().startswith("["):
        try:
            vals = json.loads(text)
            calls = [_call_from(v, fmt) for v in vals] if isinstance(vals, list) else []
        except ValueError:
            calls = []
        if calls and all(calls):
            return Parsed("", calls)
    return Parsed(_content(text, specials))


def gemma_args(text: str) -> dict:
    """Gemma 4's arguments (``{city:<|"|>Paris<|"|>,days:3,tags:[<|"|>a<|"|>]}``) as a JSON object; ``ValueError``
    when they are not that syntax."""
    out, i = [], 0
    while i < len(text):
        if text.startswith(_GEMMA_QUOTE, i):  # a string, written between <|"|> marks, with no escapes
            j = text.find(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
            if j < 0:
                raise ValueError("an unterminated string")
            out.append(json.dumps(text[i + len(_GEMMA_QUOTE):j]))
            i = j + len(_GEMMA_QUOTE)
        elif (m := _WORD.match(text, i)) is not None:  # a key (before ":") or true / false / null
            word = m.group()
            out.append(json.dumps(word) if text.startswith(":", m.end()) else word)
            i = m.end()
        else:
            out.append(text[i])
            i += 1
    value = json.loads("".join(out))
    if not isinstance(value, dict):
        raise ValueError("the arguments are not an object")
    return value


def _mistral_calls(rest: str) -> list[ToolCall]:
    body = rest.strip()
    if body.startswith("["):  # [TOOL_CALLS][{...}, {...}]
        try:
            vals = json.loads(body)
        except ValueError:
            return []
        calls = [_call_from(v, "mistral") for v in vals] if isinstance(vals, list) else []
        return calls if calls and all(calls) else []
    calls = []
    for part in body.split("[TOOL_CALLS]"):  # name[ARGS]{...} per call
        name, sep, args = part.partition("[ARGS]")
        try:
            call = _call_from({"name": name.strip(), "arguments": json.loads(args)}, "mistral") if sep else None
        except ValueError:
            call = None
        if call is None:
            return []
        calls.append(call)
    return calls


def _harmony(text: str, specials: tuple[str, ...]) -> Parsed:
    calls = []
    for name, body in _HARMONY_CALL.findall(text):
        try:
            call = _call_from({"name": name, "arguments": json.loads(body)}, "harmony")
        except ValueError:
            call = None
        if call is None:
            return Parsed(_content(text, specials))
        calls.append(call)
    msgs = _HARMONY_MSG.findall(text)
    final = "".join(b for ch, b in msgs if ch == "final")
    reasoning = "".join(b for ch, b in msgs if ch == "analysis")
    if not msgs:
        final = text
    return Parsed(_content(final, specials), calls, reasoning)


def _strip(text: str, specials: tuple[str, ...]) -> str:
    """``text`` without special tokens' texts."""
    for s in specials:
        text = text.replace(s, "")
    return text


def _content(text: str, specials: tuple[str, ...]) -> str:
    """A whole reply's content: no special tokens, and nothing when only spaces are left (a newline before a call)."""
    text = _strip(text, specials)
    return "" if not text.strip() else text


class ToolStream:
    """A streamed reply read as it comes: text before a call's start goes out as content at once (held back only
    while it could be the start of a call's marker); from the first marker on, the rest is kept and read as
    calls at the end (``finish``) — an OpenAI client gets the calls as ``delta.tool_calls`` chunks then."""

    def __init__(self, fmt: str, specials: tuple[str, ...] = ()) -> None:
        self.fmt, self.specials = fmt, specials
        self.text = ""
        self.sent = 0
        self.in_call = False
        self.markers = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "mistral_args": ("[TOOL_CALLS]",),
                        "harmony": ("<|channel|>", "<|start|>"), "llama3": ("{", "<|python_tag|>"),
                        "gemma": ("<|tool_call>",),
                        "json": ("[",)}[fmt]
        self.lead_only = fmt in ("llama3", "json")  # a call is the whole reply: only a marker at its start counts

    def push(self, delta: str) -> str:
        """Add text; returns the content that can be shown now."""
        self.text += delta
        if self.in_call or self.fmt == "harmony":
            self.in_call = True
            return ""
        if self.lead_only:
            head = self.text.lstrip()
            if any(head.startswith(m) for m in self.markers):
                self.in_call = self.sent == 0
                return "" if self.in_call else self._release(len(self.text))
            if not head:
                return ""
            return self._release(len(self.text))
        at = min((i for i in (self.text.find(m, self.sent) for m in self.markers) if i >= 0), default=-1)
        if at >= 0:
            self.in_call = True
            return self._release(at)
        held = max((k for m in self.markers for k in range(1, len(m)) if self.text.endswith(m[:k])), default=0)
        return self._release(len(self.text) - held)

    def _release(self, upto: int) -> str:
        out = _strip(self.text[self.sent:upto], self.specials) if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls) at the reply's end."""
        parsed = parse(self.fmt, self.text, self.specials)
        if not parsed.calls:
            rest = self._release(len(self.text))
            return rest, []
        sent = _strip(self.text[:self.sent], self.specials)
        rest = parsed.content[len(sent):] if parsed.content.startswith(sent) else ""
        return rest, parsed.calls


def transformers_calls(tok, text: str, prefix: str, tools) -> list[ToolCall] | None:
    """The calls transformers' response parsing reads in ``text`` (the tokenizer's ``response_template``), None
    when the tokenizer has none or the parsing fails (the format's own parser is used then)."""
    if getattr(tok, "response_template", None) is None:
        return None
    try:
        msg = tok.parse_response(text, prefix=prefix, tools=list(tools) or None)
    except Exception:  # noqa: BLE001 - a template that cannot read this reply: ours reads it
        return None
    out = []
    for c in msg.get("tool_calls") or [] if isinstance(msg, dict) else []:
        f = c.get("function", c) if isinstance(c, dict) else None
        call = _call_from({"name": f.get("name"), "arguments": f.get("arguments", {})}, "json") if f else None
        if call is None:
            return None
        out.append(call)
    return out


# -- grammars for forced calls (llguidance's Lark; engine.core.grammar compiles them) -------------------------
def _lit(text: str, token_id: int | None) -> str:
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def _call_schema(tools: list[dict], args_key: str, extra: dict | None = None) -> dict:
    """A JSON schema for one call of any of ``tools`` (OpenAI function tools): name then arguments, in order."""
    options = []
    for t in tools:
        f = t["function"]
        props = {"name": {"const": f["name"]}, args_key: f.get("parameters") or {"type": "object"}}
        props.update(extra or {})
        options.append({"type": "object", "properties": props, "required": list(props),
                        "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


JSON_OPTS = '"x-guidance": {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}'


def _json_rule(schema: dict) -> str:
    """``%json {...}`` with the separators ``tojson`` writes (the template renders the call again the same)."""
    text = json.dumps(schema)
    return "%json " + text[:-1] + (", " if len(schema) else "") + JSON_OPTS + "}"


def call_grammar(fmt: str, tools: list[dict], parallel: bool, marker_id) -> str:
    """Lark text for a reply that is one call (``parallel``: one or more) of ``tools`` in ``fmt``;
    ``marker_id(text)`` gives a marker's token id when the vocabulary has it as one token."""
    if fmt == "hermes":
        opening, closing = (_lit(m, marker_id(m)) for m in ("<tool_call>", "</tool_call>"))
        call = f'{opening} "\\n" body "\\n" {closing}'
        body = _json_rule(_call_schema(tools, "arguments"))
        start = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {start}\ncall: {call}\nbody: {body}\n"
    if fmt == "llama3":
        return f"start: body\nbody: {_json_rule(_call_schema(tools, 'parameters'))}\n"
    if fmt == "mistral":  # [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}, ...]
        tc = _lit("[TOOL_CALLS]", marker_id("[TOOL_CALLS]"))
        items = 'body (", " body)*' if parallel else "body"
        schema = _call_schema(tools, "arguments", {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
        return f'start: {tc} "[" {items} "]"\nbody: {_json_rule(schema)}\n'
    if fmt == "mistral_args":  # [TOOL_CALLS]name[ARGS]{...} per call
        tc, args = _lit("[TOOL_CALLS]", marker_id("[TOOL_CALLS]")), _lit("[ARGS]", marker_id("[ARGS]"))
        alts = " | ".join(f'"{t["function"]["name"]}" {args} a{i}' for i, t in enumerate(tools))
        rules = "".join(f'a{i}: {_json_rule(t["function"].get("parameters") or {"type": "object"})}\n'
                        for i, t in enumerate(tools))
        return f"start: call{'+' if parallel else ''}\ncall: {tc} ({alts})\n{rules}"
    if fmt == "harmony":  # after "<|start|>assistant": " to=functions.NAME<|channel|>commentary json<|message|>{...}"
        ch, msg = (_lit(m, marker_id(m)) for m in ("<|channel|>", "<|message|>"))
        alts = " | ".join(f'"{t["function"]["name"]}" {ch} "commentary json" {msg} a{i}' for i, t in enumerate(tools))
        rules = "".join(f'a{i}: {_json_rule(t["function"].get("parameters") or {"type": "object"})}\n'
                        for i, t in enumerate(tools))
        return f'start: " to=functions." call\ncall: {alts}\n{rules}'
    schema = {"type": "array", "items": _call_schema(tools, "parameters"), "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return f"start: body\nbody: {_json_rule(schema)}\n"
