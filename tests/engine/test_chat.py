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


def byte(tok, b: int) -> int:
    return tok.convert_tokens_to_ids(f"<0x{b:02X}>")


def test_an_invalid_byte_run_streams_the_text_a_whole_decode_gives(stories):
    """A byte-fallback run that is not UTF-8 decodes as one U+FFFD per byte, its valid start ("s", 0x1D) included:
    the stream holds the run until a token that is not a byte ends it, so the reply's text is that decode's — what
    the chat template renders again next turn (sent early, "s\x1d" differed and the follow-up's prompt left the
    cache there)."""
    tok = stories.tokenizer
    they, g = tok.convert_tokens_to_ids("▁They"), tok.convert_tokens_to_ids("g")
    run = [byte(tok, b) for b in (0x73, 0x1D, 0xBF, 0x80, 0xC9, 0xE8, 0xBC, 0x3E, 0x64)]
    d = StreamDecoder(tok)
    assert d.push(they) == "They"
    assert [d.push(i) for i in run] == [""] * len(run)  # held: a later byte may make the whole run invalid
    assert d.push(g) == "\ufffd" * len(run) + "g"
    ids = [they, *run, g]
    assert d.text + d.flush() == tok.decode(ids, skip_special_tokens=True)


def test_a_follow_up_splices_a_reply_with_invalid_bytes(stories):
    """The reply's ids go back into the next prompt when its text (invalid bytes and all) is what the stream wrote."""
    from engine.model.splice import splice

    tok = stories.tokenizer
    msgs = [{"role": "user", "content": "Tell me a story."}]
    prompt = render_chat(tok, msgs)
    reply = [tok.convert_tokens_to_ids("▁Once"), byte(tok, 0x73), byte(tok, 0xBF), byte(tok, 0x80),
             tok.convert_tokens_to_ids("▁upon"), byte(tok, 0xE2), byte(tok, 0x98), byte(tok, 0x83), 13]
    d = StreamDecoder(tok)
    text = "".join(d.push(i) for i in reply) + d.flush()
    assert "\ufffd" in text and "☃" in text
    fresh = render_chat(tok, msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}])
    s = splice(tok, prompt + reply, fresh)
    assert s.kept == len(prompt + reply) and s.ids[:s.kept] == prompt + reply
    assert tok.decode(s.ids) == tok.decode(fresh)


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
