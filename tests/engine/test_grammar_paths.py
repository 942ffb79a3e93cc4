"""Decoding under a grammar on every path that chooses a token (the real stories260K model): a reply alone, replies
stepped together in one batched forward, and speculative verification — where a drafter that proposes tokens the
grammar refuses never gets them fed. The mask sits in ``Sampler.processed``, which each of those paths calls (the
compiled step hands its logits to the same ``Stepping.finish``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.config import CacheConfig, SamplingConfig, SpecConfig
from engine.core.grammar import compile_json_schema
from engine.core.session import ChatSession
from engine.core.verify import Speculator

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Tell me about Lily and her dog."}]


def grammar(lm, schema=SCHEMA):
    return compile_json_schema(lm.tokenizer, lm.info.vocab_size, lm.stop_ids, schema, "test")


def run(lm, sampling, spec=None):
    s = ChatSession(lm, CacheConfig(page_size=16))
    if spec is not None:
        s.spec = spec
    s.start(CHAT, sampling)
    while not (r := s.step()).done:
        pass
    ids = list(s.generated_ids)
    s.close()
    return r, ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_reply_parses_validates_and_every_token_was_allowed(stories, temperature):
    r, ids = run(stories, SamplingConfig(max_new_tokens=120, temperature=temperature, seed=5,
                                         grammar=grammar(stories)))
    assert r.stop_reason == "eos", r.text
    jsonschema.validate(json.loads(r.text), SCHEMA)
    replay = grammar(stories).start()  # each chosen token was one the grammar allowed at its place
    for t in ids[:-1]:
        assert replay.allowed()[t]
        replay.accept(t)
    assert replay.allowed()[ids[-1]] and ids[-1] in stories.stop_ids
    plain, _ = run(stories, SamplingConfig(max_new_tokens=40, temperature=temperature, seed=5))
    assert not plain.text.startswith("{")  # without the grammar the model tells a story: the mask did this


def test_a_drafter_proposing_refused_tokens_never_gets_them_fed(stories):
    """The drafter proposes the reply's own next tokens with a token the grammar refuses spliced in: drafts are cut
    before it, the good ones are accepted, and the reply is the one decoding without speculation gives."""
    want, want_ids = run(stories, SamplingConfig(max_new_tokens=120, grammar=grammar(stories)))
    bad = stories.tokenizer.convert_tokens_to_ids("▁Once")  # never allowed inside this JSON

    class Hostile:
        proposed = refused = 0

        def propose(self, ids, k, sampler=None):
            done = len(ids) - self.prompt_len
            good = want_ids[done:done + k]
            self.proposed += len(good) + 1
            self.refused += 1
            return good[:2] + [bad] + good[2:]

        def close(self):
            pass

    hostile = Hostile()
    spec = Speculator(SpecConfig(method="ngram", draft_tokens=4, auto_off=False), hostile)
    s = ChatSession(stories, CacheConfig(page_size=16))
    s.spec = spec
    stats = s.start(CHAT, SamplingConfig(max_new_tokens=120, grammar=grammar(stories)))
    hostile.prompt_len = stats.prompt_tokens
    while not (r := s.step()).done:
        pass
    assert r.text == want.text and list(s.generated_ids) == want_ids
    assert bad not in s.seq  # never fed to the cache
    assert spec.stats.accepted > 0 and spec.stats.draft_tokens < hostile.proposed  # cut, and still useful
    s.close()


def test_constrained_replies_stepped_together_are_each_their_own(stories):
    """Three chats under three grammars in one engine core's rounds (one-token decodes batched): each reply is
    the one it gives alone."""
    from engine.core.scheduler import EngineCore, Priority, Request

    schemas = [SCHEMA, {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 2, "maxItems": 3},
               {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}]
    alone = [run(stories, SamplingConfig(max_new_tokens=80, grammar=grammar(stories, sc)))[0].text for sc in schemas]
    core = EngineCore(stories)
    results: dict[int, object] = {}
    paths: set[str] = set()
    sessions = []

    def sink(i, r):
        if isinstance(r, BaseException):
            raise r
        if r.event is not None:
            paths.add(r.event.path)
        if r.done:
            results[i] = r

    for i, sc in enumerate(schemas):
        s = ChatSession(stories, CacheConfig(page_size=16))
        s.start(CHAT, SamplingConfig(max_new_tokens=80, grammar=grammar(stories, sc)))
        sessions.append(s)
        core.add(Request(s, lambda r, i=i: sink(i, r), Priority.API))
    for _ in range(400):
        if len(results) == len(schemas):
            break
        core.round()
    assert "batched" in paths or "compiled batch" in paths, paths  # their decodes shared forwards
    assert [results[i].text for i in range(len(schemas))] == alone
    for text, sc in zip(alone, schemas):
        jsonschema.validate(json.loads(text), sc)
    for s in sessions:
        s.close()
