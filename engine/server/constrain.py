"""What a request asks its reply to be: a JSON value (``response_format``), a call of the tools it gives
(``tool_choice`` ``required`` or a named function), or free text read for calls (``auto``). Compiled into a
grammar (``engine.core.grammar``) on the tokenizing thread, never the engine's; a schema the grammar library
refuses is a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.server.errors import bad_request
from engine.server.schemas import GenRequest


@dataclass(frozen=True)
class Constraint:
    grammar: Any = None  # engine.core.grammar.Grammar, or None: free text
    tool_format: str = ""  # the reply is read for calls in this format ("": it is not)
    specials: tuple[str, ...] = ()  # special tokens' texts, taken out of content read with them


def marker_ids(tok):
    """``text -> id`` for a marker the vocabulary holds as one token (None when it does not). A fast tokenizer is
    asked per marker (its added tokens first, as ``get_vocab`` holds them): building the whole vocabulary as a dict
    took 130 ms of every forced call's first token (Qwen2.5's 151,646 pieces), for the two markers a call needs."""
    backend = getattr(tok, "_tokenizer", None)
    if callable(getattr(backend, "token_to_id", None)):
        return backend.token_to_id  # int, or None for a text that is not one token
    vocab = tok.get_vocab()

    def find(text: str):
        i = vocab.get(text)
        return i if isinstance(i, int) else None
    return find


def constraint_of(lm, req: GenRequest) -> Constraint:
    """The ``Constraint`` of ``req`` for model ``lm`` (400s naming the field)."""
    from engine.core.grammar import compile_json_schema, compile_lark
    from engine.server.render import specials, tool_format

    tok, n_vocab, stops = lm.tokenizer, lm.info.vocab_size, tuple(lm.stop_ids) + tuple(req.stop_token_ids)
    fmt = tool_format(tok) if req.kind == "chat" and req.tools else None
    if req.response_format is not None:
        schema = req.response_format.get("schema", {"type": "object"})
        param = "response_format.json_schema.schema" if req.response_format["type"] == "json_schema" \
            else "response_format"
        try:
            return Constraint(compile_json_schema(tok, n_vocab, stops, schema, param, req.response_format["type"]))
        except ValueError as e:
            raise bad_request(str(e), param, "invalid_value") from None
    if fmt is None or req.tool_choice == "none":
        return Constraint()
    marks = specials(tok)
    if req.tool_choice == "auto":
        check_schemas(req.tools)
        return Constraint(None, fmt, marks)
    from engine.server.tool_calls import call_grammar

    if fmt == "gemma":
        raise bad_request(f"tool_choice: {req.tool_choice!r} (a forced call) is not offered for this model's tool "
                          "format (Gemma's own argument syntax, which the grammar library does not write): use "
                          "'auto'", "tool_choice", "unsupported_parameter")
    tools = [t for t in req.tools if req.tool_choice == "required" or t["function"]["name"] == req.tool_choice]
    parallel = req.tool_choice == "required" and req.parallel_tool_calls
    lark = call_grammar(fmt, tools, parallel, marker_ids(tok))
    label = "a tool call" if req.tool_choice == "required" else f"a call of {req.tool_choice}"
    try:
        return Constraint(compile_lark(tok, n_vocab, stops, lark, "tools", label), fmt, marks)
    except ValueError as e:
        raise bad_request(f"{e} (a tool's parameters schema)", "tools", "invalid_value") from None


def check_schemas(tools) -> None:
    """400 naming the first tool whose parameters the grammar library could not take (a free reply uses none,
    but the same tools forced next step would fail there)."""
    import json

    from llguidance import LLMatcher

    for i, t in enumerate(tools):
        where = f"tools[{i}].function.parameters"
        try:
            schema = json.dumps(t["function"]["parameters"])
            err = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
        except ValueError as e:
            err = str(e)
        if err:
            raise bad_request(f"{where}: not a JSON schema the grammar library takes ({err.splitlines()[0][:300]})",
                              where, "invalid_value")
