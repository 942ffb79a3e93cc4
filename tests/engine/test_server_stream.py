"""Streams that show text as it comes (#20 item 8b): the role chunk first, then one chunk per generated token
(empty text allowed), holding back only the bytes of a character not yet complete. Real server on 127.0.0.1
(stories260K), read with httpx line by line.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.model.chat import StreamDecoder
from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread

MODEL = "stories260K"
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def served(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=16), ServerOptions(), source=str(stories_path))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def sse(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed reply, in order (``[DONE]`` last, left out)."""
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                if data == "[DONE]":
                    return out
                out.append(json.loads(data))
    raise AssertionError("the stream ended without [DONE]")


@pytest.mark.parametrize("path,kind", [("/v1/chat/completions", "chat"), ("/v1/completions", "completion")])
def test_a_chunk_per_token_after_the_role(served, path, kind):
    _, url = served
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "Sara saw a big dog."}]} if kind == "chat"
                else {"prompt": "Once upon a time"})
    events = sse(url, path, body)
    usage = events[-1]["usage"]
    tokens = [e for e in events[:-1] if e["choices"][0]["finish_reason"] is None]
    if kind == "chat":
        assert tokens[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the role, at once
        tokens = tokens[1:]
        texts = [e["choices"][0]["delta"]["content"] for e in tokens]
    else:
        texts = [e["choices"][0]["text"] for e in tokens]
    assert len(texts) == usage["completion_tokens"] == 40  # one chunk per token, empty ones included
    plain = httpx.post(url + path, json={**body, "stream": False}, timeout=DEADLINE_S).json()["choices"][0]
    assert "".join(texts) == (plain["message"]["content"] if kind == "chat" else plain["text"])


def byte_level_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's byte alphabet) whose tokens may end inside a character, as SmolLM2's
    do: 'x' + the first byte of '€', the other two + 'y' + a first byte again, and the last two + 'z'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_char = dict(zip(sorted(range(256), key=lambda b: _gpt2_char(b)), sorted(alphabet)))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    pieces = [b"x\xe2", b"\x82\xacy\xe2", b"\x82\xacz"]
    for p in pieces:
        vocab["".join(byte_char[b] for b in p)] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk), [len(alphabet) + i for i in range(len(pieces))]


def _gpt2_char(b: int) -> str:
    """GPT-2's printable stand-in of byte ``b`` (the ByteLevel alphabet's order follows it)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    return chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def test_the_decoder_holds_back_only_the_incomplete_bytes():
    tok, ids = byte_level_tokenizer()
    assert tok.decode(ids) == "x€y€z"
    d = StreamDecoder(tok)
    # before: "", "", "x€y€z" (each token ended inside a character, so everything waited for the last)
    assert [d.push(i) for i in ids] == ["x", "€y", "€z"]
    assert d.flush() == "" and d.text == "x€y€z"
    d = StreamDecoder(tok)
    assert [d.push(i) for i in ids[:2]] == ["x", "€y"]
    assert d.flush() == "\ufffd" and d.text == "x€y\ufffd"  # a reply that ends inside a character says so


def test_the_role_chunk_comes_at_once_even_while_queued(served):
    """The engine holds every API request (paused): a streamed chat still gets its role chunk, before it runs."""
    server, url = served
    sched = server.scheduler
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    sched.pause()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=DEADLINE_S) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert sched.waiting == 1 and sched.running == 0  # still queued
            sched.resume()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and len(rest) == 3 + 2  # three tokens, the finish chunk, [DONE]
    finally:
        sched.resume()
