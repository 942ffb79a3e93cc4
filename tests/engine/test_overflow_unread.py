"""Overflow "turns" on a prompt longer than the context: the system prompt and pins stay, the fewest whole messages
go, a single over-long message loses its oldest part, all said before and after the reply in the same numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.foresee import foresee
from engine.core.session import ChatSession
from engine.model.chat import message_spans
from engine.policies import PINNED
from engine.policies.turns import dropped, run_words, unread_runs
from engine.snapshot import TOKEN_EVICTED

PASTE = "The little dog ran to the park and played with a big red ball in the sun. "
SYSTEM = {"role": "system", "content": "You are a storyteller who writes about dogs and cats."}


def test_one_message_longer_than_the_room_loses_its_oldest_part_never_the_system_prompt():
    # system [0, 10), user1 [10, 30), reply [30, 40), user2 [40, 400): 400 tokens, 100 may stay
    starts = (0, 10, 30, 40)
    pri = np.full(400, -1, dtype=np.int64)
    pri[:10] = PINNED
    drop = dropped(np.arange(400), starts, pri, 300)
    kept = np.flatnonzero(~drop)
    assert kept.tolist() == list(range(10)) + list(range(310, 400))  # the system prompt and the paste's end
    cached, runs = unread_runs(np.arange(40), 40, 360, starts, pri, 100)
    assert (cached, runs) == (30, [(40, 310)])
    assert run_words(10, 310, starts) == "2 whole messages and the oldest 270 tokens of the latest message"
    # with nothing to spare the system prompt goes too, never the newest token
    assert np.flatnonzero(~dropped(np.arange(400), starts, pri, 399)).tolist() == [399]


def _session(lm) -> ChatSession:
    return ChatSession(lm, CacheConfig(mode="paged", page_size=16, overflow="turns"))


def _reply(s: ChatSession, messages: list[dict]):
    s.start(messages, SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    said = []
    while not (r := s.step()).done:
        said += r.warnings
    return dataclasses.replace(r, warnings=tuple(said) + r.warnings)


@pytest.fixture(scope="module")
def lm(stories):
    return dataclasses.replace(stories, arenas=None)


def test_a_paste_longer_than_the_context_keeps_the_system_prompt_and_reads_its_end(lm):
    """A single prompt six times stories260K's 512 tokens: the system prompt stays cached, the paste's oldest tokens
    are passed over unread (never computed), its end is read; the reply runs, and what was foreseen before it is
    what it did."""
    ctx = lm.info.context_length
    msgs = [SYSTEM, {"role": "user", "content": PASTE * 120}]
    s = _session(lm)
    seen = foresee(s, msgs)
    r = _reply(s, msgs)
    spans = message_spans(lm.tokenizer, msgs)
    state = np.asarray(r.snapshot.token_state)
    assert not np.any(state[slice(*spans[0])] == TOKEN_EVICTED)  # the system prompt is read and kept
    st = r.stats
    assert st.prompt_tokens >= spans[1][1] > 5 * ctx
    assert st.dropped_tokens == seen.unread > 0 and st.recomputed_tokens + st.reused_tokens == seen.read
    assert st.recomputed_tokens + st.reused_tokens + st.dropped_tokens == st.prompt_tokens
    assert st.recomputed_tokens + st.reused_tokens <= ctx - ctx // 8  # the rule's room: 7/8 of the context
    a, b = spans[1][0], spans[1][0] + st.dropped_tokens  # the paste's oldest part, exactly
    assert np.all(state[a:b] == TOKEN_EVICTED) and not np.any(state[b:st.prompt_tokens] == TOKEN_EVICTED)
    assert [(m.start, m.end) for m in st.cache.misses] == [(st.reused_tokens, a), (b, st.prompt_tokens)]  # what was computed
    assert seen.whole == 0 and seen.part == st.dropped_tokens and seen.kept_system
    assert any(f"{st.dropped_tokens:,} tokens of the prompt" in n and "the oldest" in n and "latest message" in n
               for n in r.warnings)
    s.close()


def test_a_long_conversation_sent_whole_drops_the_oldest_turns_unread_and_keeps_a_pin(lm):
    """A client sends a whole conversation that does not fit (the server's case, a fresh session): the oldest whole
    messages are passed over unread, the system prompt and a pinned message are read, the latest one whole."""
    ctx = lm.info.context_length
    msgs = [SYSTEM]
    for turn in range(8):
        msgs.append({"role": "user", "content": f"{turn}: {PASTE * 2}", **({"pinned": True} if turn == 2 else {})})
        msgs.append({"role": "assistant", "content": f"{turn}: the cat sat on the mat and looked at the dog."})
    msgs.append({"role": "user", "content": "Tell me the end of the story."})
    spans = message_spans(lm.tokenizer, msgs)
    assert spans[-1][1] > ctx
    s = _session(lm)
    seen = foresee(s, msgs)
    r = _reply(s, msgs)
    state = np.asarray(r.snapshot.token_state)
    gone = [int(np.count_nonzero(state[a:b] == TOKEN_EVICTED)) for a, b in spans]
    assert gone[0] == 0 and gone[5] == 0 and gone[-1] == 0  # system, the pin (user turn 2), the latest message
    assert all(g in (0, b - a) for g, (a, b) in zip(gone, spans))  # whole messages only
    first_kept = next(i for i in range(1, len(spans)) if gone[i] == 0 and i != 5)
    assert all(gone[i] for i in range(1, first_kept) if i != 5) and not any(gone[first_kept:])  # the oldest went
    assert r.stats.dropped_tokens == sum(gone) == seen.unread and seen.whole == sum(1 for g in gone if g)
    assert seen.part == 0 and r.stats.recomputed_tokens + r.stats.reused_tokens == seen.read  # prefix cache: reused
    s.close()


def test_a_follow_up_that_fits_with_older_turns_dropped_reads_everything(lm):
    """When dropping cached messages makes the room, nothing of the new prompt is passed over unread."""
    s = _session(lm)
    msgs = [SYSTEM]
    for turn in range(8):
        msgs.append({"role": "user", "content": f"{turn}: {PASTE * 2}"})
        seen = foresee(s, msgs)
        r = _reply(s, msgs)
        assert seen.unread == 0 and not any("unread" in w for w in r.warnings)
        assert seen.read == r.stats.recomputed_tokens + (r.stats.reused_tokens if turn == 0 else 0)
        msgs.append({"role": "assistant", "content": r.text})
    assert r.snapshot.evicted_total > 0
    s.close()
