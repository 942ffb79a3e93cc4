"""Agents on the server, with the official ``openai`` and ``anthropic`` clients over real HTTP: a random-weight Qwen2
over Qwen2.5's real tokenizer and published chat template (``tool_models``). Its free replies are noise, so calls
are forced by the grammar (``tool_choice`` required / named, Anthropic's ``any`` / ``tool``), and every forced call,
streamed or not, is a call of a tool given with arguments that validate; the conversation goes on with the call
and its result, reusing the cache through both; structured output validates on fifty schemas; bad agent input
is a 400 naming the field."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread
from json_schemas import SCHEMAS
from tool_models import save_qwen_folder

KEY = "tools-key-1"
DEADLINE_S = 120.0
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 16}}, "required": ["q"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
SCHEMA_OF = {"get_weather": WEATHER, "search": SEARCH}
USER = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from engine.model.loader import load_model

    folder = save_qwen_folder(tmp_path_factory.mktemp("qwen-tools"))
    lm = load_model(str(folder))
    server = KVServer(lm, CacheConfig(page_size=16), ServerOptions(api_key=KEY), source=str(folder))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=DEADLINE_S)


@pytest.fixture()
def claude(served):
    return anthropic.Anthropic(base_url=served[1], api_key=KEY, max_retries=0, timeout=DEADLINE_S)


def check_calls(calls, names=("get_weather", "search")) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        assert c.function.name in names and c.type == "function" and c.id
        jsonschema.validate(args, SCHEMA_OF[c.function.name])
        out.append((c.function.name, args))
    return out


def streamed(client, **kw):
    """A streamed reply put together as a client does: (content, tool calls by index, finish reason, usage)."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                got["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish, usage


def test_tools_reach_the_model_through_its_chat_template(served, client):
    server, _ = served
    r = client.chat.completions.create(model=server.model_id, messages=USER, tools=TOOLS, max_tokens=2,
                                       temperature=0, extra_body={"return_token_ids": True})
    want = server.lm.tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert r.model_extra["prompt_token_ids"] == list(want)
    assert "get_weather" in server.lm.tokenizer.decode(want)


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_of_forced_calls_reuses_the_cache_through_calls_and_results(served, client, stream):
    server, _ = served
    msgs = [dict(m) for m in USER]
    msgs[1] = {"role": "user", "content": f"Weather in Paris? ({'streamed' if stream else 'whole'})"}
    fed = 0
    for step in range(4):
        kw = dict(model=server.model_id, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=80,
                  temperature=0, parallel_tool_calls=False)
        if stream:
            content, calls, finish, usage = streamed(client, **kw)
            got = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                   for c in calls]
            check_calls([openai.types.chat.ChatCompletionMessageToolCall(**g) for g in got])
        else:
            r = client.chat.completions.create(**kw)
            content, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
            got = [c.model_dump() for c in r.choices[0].message.tool_calls]
            check_calls(r.choices[0].message.tool_calls)
        assert finish == "tool_calls" and len(got) == 1 and not content
        if step:  # everything the last step fed is reused but its last token (the reply's stop token)
            assert usage.prompt_tokens_details.cached_tokens >= fed - 1, (step, usage)
        fed = usage.prompt_tokens + usage.completion_tokens
        msgs += [{"role": "assistant", "content": None, "tool_calls": got},
                 {"role": "tool", "tool_call_id": got[0]["id"], "content": f"step {step}: 21 C, sunny"}]


def test_a_named_tool_is_the_one_called_and_parallel_calls_parse(served, client):
    server, _ = served
    r = client.chat.completions.create(model=server.model_id, messages=USER, tools=TOOLS, max_tokens=80,
                                       temperature=0, tool_choice={"type": "function", "function": {"name": "search"}})
    assert [n for n, _ in check_calls(r.choices[0].message.tool_calls)] == ["search"]
    r = client.chat.completions.create(model=server.model_id, messages=USER, tools=TOOLS, max_tokens=200,
                                       temperature=1.0, seed=4, tool_choice="required")
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    if r.choices[0].finish_reason == "tool_calls":
        assert len(check_calls(r.choices[0].message.tool_calls)) >= 1


def test_a_free_reply_with_tools_is_text(served, client):
    server, _ = served
    r = client.chat.completions.create(model=server.model_id, messages=USER, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    r2 = client.chat.completions.create(model=server.model_id, messages=USER, tools=TOOLS, max_tokens=8,
                                        temperature=0, tool_choice="none")
    assert r2.choices[0].message.tool_calls is None


def test_structured_output_validates_on_fifty_schemas(served, client):
    server, _ = served
    for i, schema in enumerate(SCHEMAS):
        r = client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": f"Record {i}"}], max_tokens=300,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                                   "strict": True}})
        assert r.choices[0].finish_reason == "stop", (i, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=server.model_id, messages=USER, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"}, extra_body={"top_k": 1})
    assert r.choices[0].finish_reason in ("stop", "length")


def _post(url, path, body, headers=None):
    return httpx.post(url + path, json=body, timeout=DEADLINE_S,
                      headers=headers or {"Authorization": f"Bearer {KEY}"})


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}},
     "response_format.json_schema.schema"),
    ({"messages": USER + [CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "tools": TOOLS},
     "messages[3].tool_call_id"),
    ({"messages": USER + [{**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{not json"}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                               "content": "x"}], "tools": TOOLS},
     "messages[2].tool_calls[0].function.arguments"),
    ({"messages": USER + [CALLED]}, "messages[2].role"),
])
def test_bad_agent_input_is_a_400_naming_the_field(served, extra, param):
    server, url = served
    r = _post(url, "/v1/chat/completions", {"model": server.model_id, "messages": USER, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0] in err["message"], err


# -- Anthropic's Messages API ----------------------------------------------------------------------------------
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"temperature": 0}  # the 2026 client no longer has the argument; servers still take it


def test_anthropic_round_trip_with_tool_use_and_cache_reads(served, claude):
    server, _ = served
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    r = claude.messages.create(model=server.model_id, max_tokens=80, system="You are a helpful agent.",
                               messages=msgs, tools=A_TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and r.role == "assistant" and r.id.startswith("msg_")
    use = [b for b in r.content if b.type == "tool_use"]
    assert len(use) >= 1 and use[0].name in SCHEMA_OF
    jsonschema.validate(use[0].input, SCHEMA_OF[use[0].name])
    first = r.usage.input_tokens + r.usage.cache_read_input_tokens
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "18 C"}]}]
    count = claude.messages.count_tokens(model=server.model_id, system="You are a helpful agent.", messages=msgs,
                                         tools=A_TOOLS)
    r2 = claude.messages.create(model=server.model_id, max_tokens=80, system="You are a helpful agent.",
                                messages=msgs, tools=A_TOOLS, tool_choice={"type": "tool", "name": "search"},
                                extra_body=GREEDY)
    assert [b.name for b in r2.content if b.type == "tool_use"] == ["search"]
    u = r2.usage
    assert u.input_tokens + u.cache_read_input_tokens == count.input_tokens  # count_tokens is the prompt
    assert u.cache_read_input_tokens >= first + r.usage.output_tokens - 1 - 16  # the call and all before it
    assert u.cache_creation_input_tokens == 0 and u.output_tokens > 0


def _sse(url, body):
    events = []
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=DEADLINE_S,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                data = json.loads(line.split(":", 1)[1])
                assert data["type"] == name
                events.append(data)
    return events


def test_anthropic_stream_is_its_event_sequence(served, claude):
    server, url = served
    body = {"model": server.model_id, "max_tokens": 80, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True, "temperature": 0}
    kinds = [e["type"] for e in _sse(url, body)]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"], kinds
    with claude.messages.stream(model=server.model_id, max_tokens=80, messages=body["messages"], tools=A_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    whole = claude.messages.create(model=server.model_id, max_tokens=80, messages=body["messages"], tools=A_TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "tool_use"
    text = _sse(url, {**body, "tools": None, "tool_choice": None, "max_tokens": 6})
    assert [e["type"] for e in text][:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert text[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_anthropic_errors_are_anthropic_shaped(served, claude):
    server, url = served
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=server.model_id, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    for body, field in (
            ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
             "messages[0].content[0]"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]},
             "messages[0].content[0].tool_use_id"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "maybe"}},
             "tool_choice")):
        r = _post(url, "/v1/messages", {"model": server.model_id, **body}, {"x-api-key": KEY})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(field), err


def test_a_client_that_rewrites_an_earlier_tool_result_is_told_where(served, client):
    """An agent's client sends an earlier tool result changed (a truncated log, a re-rendered table): the account
    places the recomputed range in the client's own messages — the rewritten tool result, or the call just before
    it when the range starts at that page's first token (a prompt that leaves its conversation is reused in
    whole pages)."""
    server, _ = served
    tok = server.lm.tokenizer
    msgs = [USER[0], {"role": "user", "content": "Weather in Oslo, then Bergen?"}]
    for step in range(2):
        r = client.chat.completions.create(model=server.model_id, messages=msgs, tools=TOOLS, max_tokens=80,
                                           temperature=0, tool_choice="required", parallel_tool_calls=False)
        call = r.choices[0].message.tool_calls[0].model_dump()
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": f"result {step}: 7 C, rain " * 3}]
    msgs[3] = {**msgs[3], "content": "result 0: (truncated)"}  # the first tool result, rewritten
    r = client.chat.completions.create(model=server.model_id, messages=msgs, tools=TOOLS, max_tokens=80,
                                       temperature=0, tool_choice="required")
    miss = next(m for m in r.model_extra["kvscope"]["cache"]["misses"] if m["reason"] != "new")
    ends = [len(tok.apply_chat_template(msgs[: i + 1], tools=TOOLS, tokenize=True, return_dict=True)["input_ids"])
            for i in range(len(msgs))]
    at = next(i for i, e in enumerate(ends) if e > miss["start"])  # the message its first token is in
    kinds = {2: "tool_call", 3: "tool_result"}
    assert at in kinds and miss["where"] == {"message": at, "kind": kinds[at], "number": 1}, (miss, ends)
    assert r.usage.prompt_tokens_details.cached_tokens == miss["start"] and miss["start"] < ends[3]


BOOM = "{% for m in messages %}{% if 'boom' in m.content %}{{ 'x' * 10**9 }}{% endif %}{% endfor %}"


def test_a_template_past_its_bounds_for_one_request_is_a_400_naming_the_model(stories_path, tmp_path):
    """A template that passes the load's trial render but builds 10^9 characters when a message says 'boom': that
    request is a 400 naming the model and the bound (with tools or without), and the server goes on."""
    import shutil

    from engine.model.loader import load_model
    from tool_models import template

    folder = tmp_path / "boom-model"
    shutil.copytree(stories_path, folder)
    tc = folder / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg.pop("chat_template", None)
    tc.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(BOOM + template("qwen2.5"))
    lm = load_model(str(folder))
    server = KVServer(lm, CacheConfig(page_size=16), ServerOptions(), source=str(folder))
    thread = ServerThread(server)
    url = thread.start()
    try:
        for extra in ({}, {"tools": TOOLS}):
            r = httpx.post(url + "/v1/chat/completions", timeout=DEADLINE_S, json={
                "model": server.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "boom"}], **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages", err
            assert f"the chat template of {lm.info.name} went past a render's bounds: it repeats a value " \
                   "1,000,000,000 times" in err["message"], err
        ok = httpx.post(url + "/v1/chat/completions", timeout=DEADLINE_S, json={
            "model": server.model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "calm"}]})
        assert ok.status_code == 200, ok.text  # (the tools' preamble does not fit stories260K's 512 tokens)
    finally:
        thread.stop()
