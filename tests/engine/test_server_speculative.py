"""``serve --speculative``: every conversation speculates, replies are the same tokens (greedy: HF's; seeded
sampling: decoding without speculation's, every time), usage is unaffected, and ``/metrics`` counts drafts as vLLM
names them (a real server on 127.0.0.1, a real HTTP client, stories260K)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from engine.config import CacheConfig, SamplingConfig, SpecConfig
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.metrics import parse as parse_metrics
from engine.core.session import ChatSession

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time, "
         "there was a little girl named Lily.")


@pytest.fixture(scope="module")
def spec_server(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(), ServerOptions(speculative=SpecConfig(method="ngram", auto_off=False)))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def test_speculative_replies_are_hf_greedy_and_counted(spec_server, stories):
    server, url = spec_server
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": server.model_id, "prompt": STORY, "max_tokens": 48,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        metrics = parse_metrics(c.get("/metrics").text)
    ids = stories.tokenizer(STORY)["input_ids"]
    with torch.inference_mode():
        ref = stories.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):]
    assert body["choices"][0]["text"] == in_context(stories.tokenizer, ids, ref)  # " She": its space is kept
    assert body["usage"]["completion_tokens"] == len(ref)  # tokens, not forwards
    drafts = metrics["kvscope_spec_decode_num_draft_tokens_total"]
    accepted = metrics["kvscope_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafts and metrics["kvscope_spec_decode_num_drafts_total"] >= 1
    by_pos = [v for k, v in metrics.items() if k.startswith("kvscope_spec_decode_num_accepted_tokens_per_pos_total")]
    assert sum(by_pos) == accepted and by_pos[0] > 0


def test_a_seeded_request_repeated_gives_the_same_text(spec_server, stories):
    """The same seeded request 5 times, then once more beside another (greedy, longer) request: 6 identical
    texts, each the text decoding without speculation samples with that seed. The server keeps the finished
    conversation and the next request takes it over, with the k its drafts had adapted to by then."""
    server, url = spec_server
    body = {"model": server.model_id, "prompt": STORY, "max_tokens": 64, "temperature": 0.8, "seed": 11}
    other = {"model": server.model_id, "prompt": "Lily and Tom went to the park.", "max_tokens": 300,
             "temperature": 0}
    with httpx.Client(base_url=url, timeout=120) as c:
        texts = [c.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(5)]
        seeded, beside = _together(server, url, body, other)
        drafted = parse_metrics(c.get("/metrics").text)["kvscope_spec_decode_num_draft_tokens_total"]
    s = ChatSession(stories, CacheConfig())
    s.start_completion(STORY, SamplingConfig(temperature=0.8, seed=11, max_new_tokens=64))
    while not s.step().done:
        pass
    plain = in_context(stories.tokenizer, stories.tokenizer(STORY)["input_ids"], s.generated_ids)
    assert drafted > 0 and len(s.generated_ids) > 32
    # admitted in one round, the two step in the same rounds: the longer one ran through all of the seeded one
    assert beside["usage"]["completion_tokens"] > seeded["usage"]["completion_tokens"]
    assert texts + [seeded["choices"][0]["text"]] == [plain] * 6


def in_context(tok, prompt_ids, reply_ids) -> str:
    """The reply's text as it continues the prompt (a first "▁She" keeps its space), as vLLM's detokenizer gives it."""
    ctx = [int(i) for i in prompt_ids][-5:]
    whole = tok.decode(ctx + [int(i) for i in reply_ids], skip_special_tokens=True)
    return whole[len(tok.decode(ctx, skip_special_tokens=True)):]


def _together(server, url: str, *bodies: dict) -> list[dict]:
    """The replies to ``bodies``, all queued while the engine thread waits, so one round admits them all."""
    gate = threading.Event()
    server.scheduler.call(lambda: gate.wait(60))  # the engine thread waits here until both are queued
    out: list = [None] * len(bodies)

    def post(i: int) -> None:
        out[i] = httpx.post(url + "/v1/completions", json=bodies[i], timeout=120).json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # a bound on a hang, not a measurement
    while len(server.scheduler._waiting) < len(bodies) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join()
    return out


def test_serve_refuses_a_bad_speculative_flag(stories_path, capsys):
    from engine.tools.cli import main as cli_main

    rc = cli_main(["serve", "--model", str(stories_path), "--port", "0", "--speculative", "beam"])
    assert rc == 2 and "is not one of off, ngram, draft" in capsys.readouterr().err
