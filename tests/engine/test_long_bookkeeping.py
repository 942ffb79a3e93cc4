"""A long StreamingLLM reply: the cache stays bounded and so does the bookkeeping around it (#20 item 18).

Over 120k tokens the KV cache stayed at 327,680 B while the process grew ~70 B per token: a new int object
per sampled id (32 B) held by the conversation's lists, and a third list of every id inside the streaming
detokenizer. Now the detokenizer keeps only its window, ids share one object per vocabulary entry, and what
is left per token is the conversation itself: one slot in its ids, one in the reply's ids, its text.
"""

from __future__ import annotations

import sys

from engine.config import CacheConfig, SamplingConfig
from engine.policies.base import config_from_flags

from engine.core.session import ChatSession

STREAMING = config_from_flags(policy="streaming", flags={"sinks": 4, "window": 60}, mode="paged", page_size=16)


def _run(session, tokens: int):
    """Step until ``tokens`` more tokens came (or the reply ended); the last snapshot."""
    last, seen = None, 0
    for _ in range(tokens + 50):  # bounded: one forward per token, plus the prefill's chunks
        r = session.step()
        last = r.snapshot or last
        seen += r.event is not None
        if r.done or seen == tokens:
            break
    return last


def test_the_detokenizer_keeps_only_its_window_and_ids_share_objects(stories):
    s = ChatSession(stories, STREAMING)
    try:
        s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=700, ignore_eos=True))
        snap = _run(s, 700)
        reply = s.sequence.reply
        assert len(reply.generated) == 700 and snap.kv_bytes <= 5 * 16 * 1280  # 5 pages of 16 tokens x 1,280 B
        assert len(reply.decoder.ids) < 64 + 16  # before: all 700
        assert reply.decoder.text == stories.tokenizer.decode(reply.generated, skip_special_tokens=True)
        gen = reply.generated
        assert len({id(t) for t in gen}) == len(set(gen)) < stories.info.vocab_size  # one object per id
        assert all(a is b for a, b in zip(s.sequence.ids[-700:], gen))
    finally:
        s.close()


def test_bytes_held_per_token_are_the_conversation_only(stories):
    """The engine's per-token structures, counted with sys.getsizeof: the conversation's ids, the reply's ids,
    the detokenizer's ids, the text, and the int objects behind the ids. Before: ~44 B per token here (a
    third list, and a 32 B int for every sampled id above 256); now two list slots and the text."""
    s = ChatSession(stories, STREAMING)
    try:
        s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=1500, ignore_eos=True))
        _run(s, 1500)
        q, reply = s.sequence, s.sequence.reply
        ints = {id(t): t for t in (*q.ids, *reply.generated, *reply.decoder.ids) if not -5 <= t <= 256}
        held = (sys.getsizeof(q.ids) + sys.getsizeof(reply.generated) + sys.getsizeof(reply.decoder.ids)
                + sys.getsizeof(reply.decoder.text) + sum(sys.getsizeof(t) for t in ints.values()))
        assert len(ints) < stories.info.vocab_size  # at most one object per id, however long the reply
        assert held / len(reply.generated) < 24, f"{held / len(reply.generated):.1f} B per token"
    finally:
        s.close()
