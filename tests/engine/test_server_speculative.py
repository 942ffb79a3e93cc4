"""``serve --speculative``: every conversation speculates, replies are the same tokens, usage is unaffected, and
``/metrics`` counts drafts as vLLM names them (a real server on 127.0.0.1, a real HTTP client, stories260K)."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.config import CacheConfig, SpecConfig
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.metrics import parse as parse_metrics

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time, "
         "there was a little girl named Lily.")


@pytest.fixture(scope="module")
def spec_server(stories_path):
    from engine.loader import load_model

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
    assert body["choices"][0]["text"] == stories.tokenizer.decode(ref, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(ref)  # tokens, not forwards
    drafts = metrics["kvscope_spec_decode_num_draft_tokens_total"]
    accepted = metrics["kvscope_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafts and metrics["kvscope_spec_decode_num_drafts_total"] >= 1
    by_pos = [v for k, v in metrics.items() if k.startswith("kvscope_spec_decode_num_accepted_tokens_per_pos_total")]
    assert sum(by_pos) == accepted and by_pos[0] > 0


def test_serve_refuses_a_bad_speculative_flag(stories_path, capsys):
    from engine.cli import main as cli_main

    rc = cli_main(["serve", "--model", str(stories_path), "--port", "0", "--speculative", "beam"])
    assert rc == 2 and "is not one of off, ngram, draft" in capsys.readouterr().err
