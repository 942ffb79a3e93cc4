"""Tool calls in the published chat templates' own formats: each template's rendering of an assistant's call is
read back into the same call, the forced-call grammar of its format takes that rendering token by token (so a
forced call is what the template writes again next turn, and the prompt cache goes on through it), and text that
only looks like a call stays text. Templates: ``data/chat_templates`` (Qwen2.5, Hermes 3, Llama 3.1, Mistral Nemo,
Ministral 3, gpt-oss); tokenizer: Qwen2.5's."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.grammar import compile_lark
from engine.server.constrain import marker_ids
from engine.server.tool_calls import ToolStream, call_grammar, detect_format, parse
from tool_models import QWEN_VOCAB, qwen_tokenizer, template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
ARGS = {"city": "Paris", "days": 3}
FORMATS = {"qwen2.5": "hermes", "hermes3": "hermes", "llama3.1": "llama3", "mistral-nemo": "mistral",
           "ministral3": "mistral_args", "gpt-oss": "harmony", "gemma4": "gemma"}
# each template's end of the turn (Gemma 4 opens the tool's response after a call: its stop token then)
ENDS = ("<|im_end|>\n", "<|im_end|>", "<|eot_id|>", "<|call|>", "</s>", "<turn|>\n", "<|tool_response>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen-tok"))


def rendered_call(tok, name: str, calls: list[dict]) -> str:
    """The text the template writes for an assistant's ``calls`` after the generation prompt (its end marker
    cut off: the model's stop token, never in a reply's text)."""
    tok.chat_template = template(name)
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i}abcd", "type": "function", "function": c} for i, c in enumerate(calls)]}
    pre = tok.apply_chat_template(USER, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(USER + [msg], tools=TOOLS, tokenize=False, add_generation_prompt=False)
    if name == "gemma4":  # its generation prompt opens an empty thought channel the rendered turn leaves out
        pre = pre.removesuffix("<|channel>thought\n<channel|>")
    assert full.startswith(pre), name
    text = full[len(pre):]
    for end in ENDS:
        if text.endswith(end):
            return text[: -len(end)]
    return text


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_templates_call_is_read_back(tok, name):
    text = rendered_call(tok, name, [{"name": "get_weather", "arguments": ARGS}])
    assert detect_format(template(name)) == FORMATS[name]
    got = parse(FORMATS[name], text, tuple(tok.all_special_tokens))
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", ARGS)], text
    assert got.content == ""
    if name == "mistral-nemo":  # the id the template wrote is the call's (Nemo's template demands 9 characters)
        assert got.calls[0].id == "call0abcd"
    # streamed in pieces of 3 characters: no content leaks before the call, the same call at the end
    stream = ToolStream(FORMATS[name], tuple(tok.all_special_tokens))
    shown = "".join(stream.push(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert shown + rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-nemo", "ministral3", "gemma4"])
def test_parallel_calls_are_read_in_order(tok, name):
    calls = [{"name": "get_weather", "arguments": ARGS}, {"name": "search", "arguments": {"q": "umbrella"}}]
    got = parse(FORMATS[name], rendered_call(tok, name, calls), ())
    assert [c.name for c in got.calls] == ["get_weather", "search"]
    assert len({c.id for c in got.calls}) == 2


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "gemma4"])  # Gemma's syntax is not JSON: not forced
def test_the_forced_call_grammar_takes_the_templates_own_rendering(tok, name):
    """The grammar's call is the template's call to the token: every token of the rendering is allowed in turn
    and the grammar is complete at its end (a mismatch of one space would fail here)."""
    fmt = FORMATS[name]
    text = rendered_call(tok, name, [{"name": "get_weather", "arguments": ARGS}])
    tok.chat_template = template(name)
    g = compile_lark(tok, QWEN_VOCAB, (tok.eos_token_id,), call_grammar(fmt, TOOLS[:1], False, marker_ids(tok)),
                     "tools", "call")
    state = g.start()
    ids = tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        assert state.allowed()[t], f"{name}: token {i} {tok.decode([t])!r} of {text!r} refused"
        state.accept(t)
    assert state.allowed()[tok.eos_token_id], f"{name}: the grammar wants more after {text!r}"


def test_text_that_only_looks_like_a_call_stays_text():
    for fmt, text in (("hermes", "Use <tool_call> tags like <tool_call>{not json}</tool_call>"),
                      ("llama3", '{"weather": "sunny"}'), ("mistral", "[TOOL_CALLS] not json"),
                      ("json", "[1, 2, 3]"), ("hermes", "Plain answer.")):
        got = parse(fmt, text)
        assert got.calls == [] and got.content == text, (fmt, text)


def test_content_before_a_call_streams_at_once_and_the_marker_is_held(tok):
    s = ToolStream("hermes")
    assert s.push("It is ") == "It is "
    assert s.push("sunny. <tool") == "sunny. "  # "<tool" may start a marker: held
    assert s.push("_call>\n") == ""
    s.push('{"name": "search", "arguments": {"q": "x"}}\n</tool_call>')
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["search"]
    plain = ToolStream("hermes")
    assert plain.push("a <b> <tool") == "a <b> "
    assert plain.push(" no") == "<tool no"  # the held piece was no marker after all
    assert plain.finish() == ("", [])


def test_a_tokenizer_with_a_response_template_is_read_by_transformers(tok):
    """transformers' own response parsing is used where the tokenizer has a ``response_template``."""
    from engine.server.tool_calls import transformers_calls

    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "umbrella"}}\n</tool_call>'
    assert transformers_calls(tok, text, "", TOOLS) is None  # none: the format's parser reads it
    tok.response_template = {"version": 1, "start_anchor": "<|im_start|>assistant\n", "fields": {
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                       "transform": {"type": "function", "function": {"name": "{content.name}",
                                                                      "arguments": "{content.arguments}"}}},
        "content": {}}}
    try:
        calls = transformers_calls(tok, text, "<|im_start|>assistant\n", TOOLS)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"q": "umbrella"})]
        assert transformers_calls(tok, "<tool_call>\n{broken\n</tool_call>", "", TOOLS) is None
    finally:
        tok.response_template = None


@settings(max_examples=200, deadline=None)
@given(content=st.text(alphabet="ab <>/_tolcaTOL[]{}\"", max_size=30), with_call=st.booleans(),
       cuts=st.lists(st.integers(min_value=1, max_value=7), max_size=40))
def test_any_split_of_a_streamed_reply_gives_the_whole_replys_reading(content, with_call, cuts):
    """However the reply's text arrives (token pieces of any length), what the stream shows and its calls are what
    reading the whole reply gives: content before a call, never a piece of a marker, the call at the end."""
    call = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>' if with_call else ""
    text = content + call
    whole = parse("hermes", text)
    s, shown, i = ToolStream("hermes"), "", 0
    for n in cuts + [len(text)]:
        shown += s.push(text[i:i + n])
        i += n
    rest, calls = s.finish()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    if whole.calls:  # nothing shown that the reading drops (but spaces before a call, which it reads as none)
        assert whole.content.startswith(shown) or (whole.content == "" and shown.strip() == "")
        assert "<tool_call>" not in shown + rest
    else:
        assert shown + rest == text


def test_gemma_arguments_are_read_into_json():
    from engine.server.tool_calls import gemma_args

    text = '{city:<|"|>Paris, "the" {city}<|"|>,days:-3.5,ok:true,none:null,opts:{u:<|"|>C<|"|>},tags:[<|"|>a<|"|>,1]}'
    assert gemma_args(text) == {"city": 'Paris, "the" {city}', "days": -3.5, "ok": True, "none": None,
                                "opts": {"u": "C"}, "tags": ["a", 1]}
    for bad in ('{city:<|"|>Paris}', "[1, 2]", "{city: Paris}"):
        with pytest.raises(ValueError):
            gemma_args(bad)


def test_marker_ids_are_the_vocabularys_ids(tok):
    """The markers are asked of the tokenizer one by one (not its whole vocabulary built per request): the same
    ids ``get_vocab`` holds, added tokens included, None for a text that is not one token."""
    find, vocab = marker_ids(tok), tok.get_vocab()
    for text in ("<tool_call>", "</tool_call>", "<|im_end|>", "[TOOL_CALLS]", "[ARGS]", "Ġthe", "not one token"):
        assert find(text) == vocab.get(text)
    assert find("<tool_call>") is not None and find("not one token") is None
