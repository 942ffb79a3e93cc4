"""Chat rendering and UTF-8-safe streaming text."""

from __future__ import annotations

import pytest

from engine.model.chat import StreamDecoder, plain_prompt, render_chat, validate_messages


@pytest.mark.parametrize("text", ["Hello 你好 world ☃ — naïve café 🎉!", "a\nb  c", "ÀÉÎ 日本語テキスト"])
def test_stream_decoder_never_splits_characters(stories, text):
    tok = stories.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any(3 <= i <= 258 for i in ids)  # byte-fallback tokens: characters span several ids
    d = StreamDecoder(tok)
    deltas = [d.push(i) for i in ids] + [d.flush()]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert d.text == "".join(deltas)


def test_demo_tokenizer_round_trips_bytes(demo_model):
    tok = demo_model.tokenizer
    text = "Grüße, 世界! {code}\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    d = StreamDecoder(tok)
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_plain_fallback_template(stories):
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    assert plain_prompt(msgs) == "System: Be kind.\n\nUser: Hi\n\nAssistant:"
    ids = render_chat(stories.tokenizer, msgs)
    assert ids[0] == 1 and stories.tokenizer.decode(ids[1:]) == plain_prompt(msgs)


def test_tokenizer_template_is_used(demo_model):
    ids = render_chat(demo_model.tokenizer, [{"role": "user", "content": "Hi"}])
    assert demo_model.tokenizer.decode(ids) == "<s><|user|>Hi<|end|><|assistant|>"


@pytest.mark.parametrize("bad,words", [
    ([], "non-empty"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user"}], "'role' and 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message"),
])
def test_bad_messages(bad, words):
    with pytest.raises(ValueError, match=words):
        validate_messages(bad)
