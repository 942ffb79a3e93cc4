"""OpenAI parameters honoured or refused by name (#20 item 12): ``logprobs`` / ``top_logprobs`` and
``presence_penalty`` / ``frequency_penalty`` checked against the model run directly (HF forward, no cache);
a forced tool call, JSON response formats, ``logit_bias``, completions' ``echo`` / ``suffix`` / ``best_of`` get
a 400 naming the parameter. Real server on 127.0.0.1 with stories260K, httpx.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from engine.model.chat import render_chat
from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread

MODEL = "stories260K"
DEADLINE_S = 120.0
USER = [{"role": "user", "content": "Sara saw a big dog."}]


@pytest.fixture(scope="module")
def served(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=16), ServerOptions(), source=str(stories_path))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=DEADLINE_S)


@torch.no_grad()
def hf_greedy(lm, ids: list[int], n: int, presence: float = 0.0, frequency: float = 0.0):
    """(generated ids, log-softmax rows of the model's own logits) by full forwards of HF's model, with OpenAI's
    penalties applied to the reply's own tokens before the argmax."""
    ids, out, rows = list(ids), [], []
    for _ in range(n):
        logits = lm.model(torch.tensor([ids])).logits[0, -1].double()
        rows.append(torch.log_softmax(logits, -1))
        for t in set(out):
            logits[t] -= out.count(t) * frequency + presence
        tok = int(torch.argmax(logits))
        if tok in lm.stop_ids:
            break
        out.append(tok)
        ids.append(tok)
    return out, rows


def test_chat_logprobs_are_the_models_own(served, stories):
    _, url = served
    r = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 12, "temperature": 0, "logprobs": True,
                                           "top_logprobs": 3})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    content = choice["logprobs"]["content"]
    assert len(content) == usage["completion_tokens"] == 12
    ref_ids, rows = hf_greedy(stories, render_chat(stories.tokenizer, USER), 12)
    for i, e in enumerate(content):
        assert len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the chosen token is the most likely
        assert e["logprob"] == pytest.approx(float(rows[i][ref_ids[i]]), abs=1e-3)
        ranked = torch.topk(rows[i], 3)
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(ranked.values.tolist(), abs=1e-3)
        assert e["logprob"] <= 0 and e["token"] == bytes(e["bytes"]).decode("utf-8", errors="replace")
    text = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8")
    assert text.strip() == choice["message"]["content"].strip()

    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=DEADLINE_S, json={
            "model": MODEL, "messages": USER, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    streamed = [c["logprobs"]["content"] for c in chunks if c["logprobs"] is not None]
    assert all(len(x) == 1 for x in streamed)  # one token per chunk, its own entry
    # The same tokens and bytes; the numbers as float32 gives them (the second request reads the first's cached
    # prefix, so its prompt's attention sums in another order: ~2e-6 apart here).
    def tokens(entries):
        return [(e["token"], e["bytes"], [a["token"] for a in e["top_logprobs"]]) for e in entries]

    def numbers(entries):
        return [v for e in entries for v in [e["logprob"]] + [a["logprob"] for a in e["top_logprobs"]]]

    assert tokens([x[0] for x in streamed]) == tokens(content)
    assert numbers([x[0] for x in streamed]) == pytest.approx(numbers(content), abs=1e-5)


def test_completion_logprobs_in_the_legacy_shape(served):
    _, url = served
    r = post(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                                      "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert all(1 <= len(t) <= 2 and max(t.values()) == pytest.approx(v) for t, v in
               zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    off = post(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert off.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("presence,frequency", [(0.0, 2.0), (1.5, 0.0), (-1.0, 0.5)])
def test_presence_and_frequency_penalties_as_openai_defines_them(served, stories, presence, frequency):
    _, url = served
    prompt = "Once upon a time"
    ids = stories.tokenizer(prompt)["input_ids"]
    ref_ids, _ = hf_greedy(stories, ids, 48, presence, frequency)
    plain_ids, _ = hf_greedy(stories, ids, 48)
    assert ref_ids != plain_ids  # the penalties change this reply (so the comparison below can fail)
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 48, "temperature": 0,
                                      "presence_penalty": presence, "frequency_penalty": frequency})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == stories.tokenizer.decode(ref_ids, skip_special_tokens=True)


TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("path,extra,param", [
    # stories260K's template writes no tools: tools are a 400 saying so (tests/engine/test_server_tools.py: ones that do)
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools"),
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": "auto"}, "tools"),
    ("/v1/chat/completions", {"tools": TOOL}, "tools"),
    ("/v1/chat/completions", {"tools": "x"}, "tools"),
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": 5}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": "g"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                        "schema": {"type": 7}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"logit_bias": {"50": 100}}, "logit_bias"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "The end."}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "high"}, "frequency_penalty"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(served, path, extra, param):
    _, url = served
    body = {"messages": USER} if "chat" in path else {"prompt": "Once upon a time"}
    r = post(url, path, {**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


@pytest.mark.parametrize("extra", [{"tool_choice": "none"}, {"tools": []},
                                   {"response_format": {"type": "text"}}, {"logit_bias": {}},
                                   {"logprobs": False}])
def test_what_changes_nothing_is_still_accepted(served, extra):
    _, url = served
    r = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


@torch.no_grad()
def _at_a_stop(lm) -> list[int]:
    """Prompt ids whose greedy next token is a stop token: a story of HF's greedy reply, cut just before its end."""
    ids = lm.tokenizer("Sara saw a big dog.")["input_ids"]
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=300, do_sample=False)[0].tolist()
    assert out[-1] in lm.stop_ids and len(out) < len(ids) + 300  # the story ended by itself
    return out[:-1]


@torch.no_grad()
def _greedy_without_stops(lm, ids: list[int], n: int) -> list[int]:
    """HF forwards, the stop tokens' logits set to -inf (vLLM's min_tokens) for ``n`` tokens."""
    ids, out = list(ids), []
    for _ in range(n):
        logits = lm.model(torch.tensor([ids])).logits[0, -1]
        logits[list(lm.stop_ids)] = float("-inf")
        out.append(int(torch.argmax(logits)))
        ids.append(out[-1])
    return out


def test_ignore_eos_and_min_tokens_give_replies_of_the_length_asked(served, stories):
    """vLLM's benchmark clients send both: the reply is exactly max_tokens long. Without them the reply ends at
    the model's stop token (the bench of #34 read a 1-token stream as a 128-token one's share)."""
    _, url = served
    prompt = _at_a_stop(stories)
    plain = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                          "return_token_ids": True}).json()
    assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["finish_reason"] == "stop"
    eos = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True}).json()
    assert eos["usage"]["completion_tokens"] == 8 and eos["choices"][0]["finish_reason"] == "length"
    assert eos["choices"][0]["token_ids"][0] in stories.stop_ids  # the stop token is part of the reply
    least = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "min_tokens": 8, "temperature": 0,
                                          "return_token_ids": True}).json()
    got = least["choices"][0]["token_ids"]
    assert got[:8] == _greedy_without_stops(stories, prompt, 8)  # no stop token chosen before the 8th
    assert not set(got[:8]) & set(stories.stop_ids) and len(got) >= 8


def test_stop_sequences_in_the_first_min_tokens_do_not_end_the_reply(served):
    _, url = served
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stop": ["a"]}
    early = post(url, "/v1/completions", body).json()
    assert early["choices"][0]["finish_reason"] == "stop" and early["usage"]["completion_tokens"] < 12
    late = post(url, "/v1/completions", {**body, "min_tokens": 12}).json()
    choice = late["choices"][0]
    assert choice["finish_reason"] == "stop" and 12 < late["usage"]["completion_tokens"] < 40
    assert "a" in choice["text"] and len(choice["text"]) > len(early["choices"][0]["text"])  # not cut at the first


def test_include_stop_str_in_output_ends_the_text_after_the_stop_sequence(served):
    _, url = served
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stop": ["Lily"]}
    cut = post(url, "/v1/completions", body).json()["choices"][0]
    kept = post(url, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop" and "Lily" not in cut["text"]
    assert kept["text"] == cut["text"] + "Lily"
    # the defaults asked for explicitly change nothing
    same = post(url, "/v1/completions", {**body, "skip_special_tokens": True, "add_generation_prompt": True,
                                         "include_stop_str_in_output": False}).json()["choices"][0]
    assert same["text"] == cut["text"]


def test_stop_token_ids_end_the_reply_and_min_tokens_keeps_them_out(served, stories):
    _, url = served
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    plain = post(url, "/v1/completions", body).json()["choices"][0]["token_ids"]
    stop = plain[4]  # the fifth token of the greedy reply
    first = plain.index(stop)
    r = post(url, "/v1/completions", {**body, "stop_token_ids": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["token_ids"] == plain[:first + 1]
    assert r["usage"]["completion_tokens"] == first + 1
    held = post(url, "/v1/completions", {**body, "stop_token_ids": [stop], "min_tokens": 8,
                                         "ignore_eos": True}).json()["choices"][0]["token_ids"]
    assert stop not in held[:8] and len(held) >= 8  # masked until the eighth token (ignore_eos leaves it a stop)


def test_top_k_min_p_and_repetition_penalty_are_honoured(served, stories):
    _, url = served
    prompt = "Once upon a time"
    ids = stories.tokenizer(prompt)["input_ids"]
    ref = stories.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, repetition_penalty=1.3)
    ref_text = stories.tokenizer.decode(ref[0, len(ids):], skip_special_tokens=True)
    plain = stories.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
    assert ref_text != stories.tokenizer.decode(plain[0, len(ids):], skip_special_tokens=True)  # it can fail
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 48, "temperature": 0,
                                      "repetition_penalty": 1.3})
    assert r.json()["choices"][0]["text"] == ref_text
    # top_k 1 and min_p 0.999 leave one token to draw from: the greedy reply whatever the seed
    greedy = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    for extra in ({"top_k": 1}, {"min_p": 0.999}):
        hot = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 1.5, "seed": 3,
                                            **extra}).json()
        assert hot["choices"][0]["text"] == greedy["choices"][0]["text"], extra


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"top_k": "3"}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.0}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [3, "4"]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"guided_json": {"type": "object"}}, "guided_json"), ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"use_beam_search": True}, "use_beam_search"), ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"bad_words": ["dog"]}, "bad_words"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"), ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"skip_special_tokens": False}, "skip_special_tokens"), ({"include_stop_str_in_output": 1},
                                                               "include_stop_str_in_output"),
])
def test_vllms_extensions_out_of_range_are_a_400_naming_them(served, extra, param):
    _, url = served
    r = post(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Once upon a time"}),
                                       ("/v1/chat/completions", {"messages": USER})])
def test_min_tokens_beyond_the_context_without_max_tokens_is_a_400_naming_it(served, path, body):
    server, url = served
    for n in (10 ** 30, server.lm.info.context_length):  # neither fits the room the prompt leaves
        r = post(url, path, {**body, "min_tokens": n})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "min_tokens" and str(n) in err["message"], err
