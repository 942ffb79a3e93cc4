"""Eviction policies: exact eviction order, budgets, sinks and pinned ranges, reporting, long streaming."""

from __future__ import annotations

import numpy as np
import pytest

from engine import snapshot as snap
from engine.config import CacheConfig, SamplingConfig
from engine.policies import H2OPolicy, PolicyState, PriorityPolicy, StreamingPolicy, get_policy, policy_names
from engine.core.session import ChatSession


def state(n, layers=2, **kw):
    return PolicyState(positions=np.broadcast_to(np.arange(n), (layers, n)).copy(), **kw)


def test_registry_and_params():
    assert policy_names() == ["none", "streaming", "h2o", "expected", "priority"]
    assert get_policy("none") is None
    p = get_policy("streaming", {"sinks": 2, "window": 10})
    assert isinstance(p, StreamingPolicy) and p.budget == 12
    with pytest.raises(ValueError, match="unknown parameter"):
        get_policy("streaming", {"sink": 2})
    with pytest.raises(ValueError, match="must be >= 1"):
        get_policy("streaming", {"window": 0})
    with pytest.raises(ValueError, match="not one of"):
        get_policy("lru")
    with pytest.raises(ValueError, match="recent 64 must be smaller than budget 32"):
        get_policy("h2o", {"budget": 32})
    import dataclasses

    fields = {f.name: f.metadata for f in dataclasses.fields(H2OPolicy.Params)}
    assert fields["budget"]["min"] == 2 and fields["budget"]["help"]


def test_streaming_evicts_oldest_after_sinks():
    p = StreamingPolicy(sinks=4, window=6)
    drops = p.select(state(20), target=10)
    assert [d.tolist() for d in drops] == [list(range(4, 14))] * 2
    assert p.select(state(8), target=10)[0].tolist() == []


def test_h2o_keeps_heavy_hitters_and_recent_window():
    p = H2OPolicy(budget=6, recent=2)
    scores = np.array([[5, 0.1, 3, 0.2, 0.2, 4, 0.0, 9, 1, 1],
                       [0, 9, 9, 9, 0.5, 0.1, 0.3, 0, 0, 0]], dtype=float)
    drops = p.select(state(10, scores=scores), target=6)
    # layer 0: candidates 0..7 (8, 9 are recent); lowest scores: 6 (0.0), 1 (0.1), then 3 and 4 (0.2, oldest first)
    assert drops[0].tolist() == [1, 3, 4, 6]
    # layer 1: lowest: 0 (0), 7 (0), 5 (0.1), 6 (0.3) → ties broken oldest first
    assert drops[1].tolist() == [0, 5, 6, 7]
    # the protected prefix is never a candidate
    drops = p.select(state(10, scores=scores, protected=2), target=6)
    assert 0 not in drops[1].tolist() and 1 not in drops[0].tolist()
    assert all(len(d) == 4 for d in drops)


def test_priority_lowest_first_then_oldest_and_pinned_kept():
    p = PriorityPolicy(budget=5, recent=1, default_priority=35)
    pri = np.array([100, 100, 10, 35, 10, 50, 35, 35], dtype=np.int64)
    drops = p.select(state(8, priorities=pri), target=5)
    assert drops[0].tolist() == [2, 3, 4]  # 10, 10 (oldest first), then 35 at position 3
    # positions < protected count as pinned; the recent token is kept at 99
    drops = p.select(state(8, priorities=pri, protected=3), target=4)
    assert drops[0].tolist() == [3, 4, 5, 6]


def run(lm, cache, n, prompt="Once upon a time", messages=None):
    s = ChatSession(lm, cache)
    if messages:
        s.start(messages, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    else:
        s.start_completion(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    snaps = []
    while True:
        r = s.step()
        snaps.append(r.snapshot)
        if r.done:
            return s, r, snaps


def test_streaming_session_keeps_sinks_and_window_and_reports_evictions(stories):
    s, r, snaps = run(stories, CacheConfig(mode="paged", page_size=4, policy="streaming",
                                           policy_params={"sinks": 4, "window": 32}), 120)
    budget = 36
    assert all(sn.tokens_per_layer.max() <= budget for sn in snaps)
    log = s.index.layer_log[0]
    assert log[:4].tolist() == [0, 1, 2, 3]  # sinks never evicted
    assert log[4:].tolist() == list(range(s.index.next_pos - (len(log) - 4), s.index.next_pos))  # the most recent window
    ev = [sn for sn in snaps if sn.evicted_positions]
    assert ev and ev[0].evict_reason == "streaming"
    assert ev[0].evicted_positions[0] == 4  # the oldest token after the sinks goes first
    total = sum(len(sn.evicted_positions) for sn in snaps)
    assert total == s.evicted_total == s.index.next_pos - s.cached_tokens
    last = snaps[-1]
    assert (last.token_state[:4] == snap.TOKEN_SINK).all()
    assert (last.token_state[4:s.index.next_pos - len(log) + 4] == snap.TOKEN_EVICTED).all()
    assert np.count_nonzero(last.token_state == snap.TOKEN_EVICTED) == s.evicted_total
    assert any((sn.page_state == snap.PAGE_EVICTED).any() for sn in ev)  # "just evicted" pages shown


def test_streaming_generates_4000_tokens_past_a_512_context_with_flat_kv(stories):
    s, r, snaps = run(stories, CacheConfig(mode="paged", page_size=16, policy="streaming",
                                           policy_params={"sinks": 4, "window": 252}), 4000)
    assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 4000
    assert len(s.seq) > 7 * stories.info.context_length
    kv = np.array([sn.kv_bytes for sn in snaps])
    full = kv[600:]  # after the window filled
    assert full.max() <= 256 * stories.info.kv_bytes_per_token
    assert full.max() - full.min() <= 16 * stories.info.kv_bytes_per_token  # flat: within one page
    assert s.index.next_rope <= 256  # RoPE positions never pass sinks + window
    words = r.text.split()
    assert len(set(words[-200:])) > 20  # still text, not a single repeated token


def test_h2o_session_budget_and_per_layer_choice(stories):
    s, r, snaps = run(stories, CacheConfig(mode="paged", page_size=8, policy="h2o",
                                           policy_params={"budget": 64, "recent": 16}), 150)
    assert all(sn.tokens_per_layer.max() <= 64 for sn in snaps)
    assert s.evicted_total > 0
    logs = [set(s.index.layer_log[layer].tolist()) for layer in range(stories.info.num_layers)]
    assert any(logs[0] != other for other in logs[1:])  # layers kept different tokens
    recent = set(range(s.index.next_pos - 16, s.index.next_pos))
    assert all(recent <= kept for kept in logs)
    assert float(s.evictor.scores.t[0].sum()) > 0  # the attention handed its probabilities over (scores path)
    # the accumulated scores rank what was kept above what was evicted in at least the first layer
    assert s.evictor.scores.t[0].shape[1] == s.cached_tokens


def test_priority_session_keeps_system_prompt_and_pinned_message(stories):
    msgs = [{"role": "system", "content": "You are a storyteller who loves dogs."},
            {"role": "user", "content": "Tell me about a cat."},
            {"role": "assistant", "content": "The cat sat on the mat and then it went to the park to play."},
            {"role": "user", "content": "Remember: the dog is named Max.", "pinned": True},
            {"role": "assistant", "content": "Max is a happy dog who likes to run and jump in the sun."},
            {"role": "user", "content": "And then?"}]
    from engine.model.chat import message_spans

    spans = message_spans(stories.tokenizer, msgs)
    s, r, snaps = run(stories, CacheConfig(mode="paged", page_size=4, policy="priority",
                                           policy_params={"budget": 80, "recent": 8}), 60, messages=msgs)
    kept = set(s.index.layer_log[0].tolist())
    system = set(range(*spans[0]))
    pinned = set(range(*spans[3]))
    assert system <= kept and pinned <= kept
    assert s.evicted_total > 0 and all(sn.tokens_per_layer.max() <= 80 for sn in snaps)
    assert (snaps[-1].token_state[list(pinned)] == snap.TOKEN_PINNED).all()
    evicted = set(range(s.index.next_pos)) - kept
    assert min(evicted) >= spans[1][0]  # evicted tokens come after the system prompt


@pytest.mark.parametrize("overflow", ["truncate_middle", "rolling"])
def test_context_overflow_choices_keep_generating(stories, overflow):
    s, r, snaps = run(stories, CacheConfig(mode="paged", page_size=8, overflow=overflow), 700)
    assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 700
    assert all(sn.tokens_per_layer.max() <= 512 for sn in snaps)
    assert any(sn.evict_reason == overflow for sn in snaps)
    if overflow == "rolling":
        assert s.index.layer_log[0][0] == 0  # the first (BOS) token stays


def test_context_overflow_stop_is_reported(stories):
    s = ChatSession(stories, CacheConfig(mode="paged"))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=600, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "context_full" and len(s.seq) == 512 and r.warnings


def test_enable_policy_mid_reply_evicts_now_and_disable_restores(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=120, ignore_eos=True))
    for _ in range(80):
        s.step()
    notes = s.apply(CacheConfig(mode="paged", page_size=4, policy="streaming", policy_params={"sinks": 4, "window": 28}))
    assert any("evicted" in n for n in notes) and s.cached_tokens <= 32
    r = s.step()
    assert r.snapshot.policy == "streaming" and r.snapshot.tokens_per_layer[0] <= 32
    notes = s.apply(CacheConfig(mode="paged", page_size=4))
    assert any("re-prefilled" in n for n in notes)
    r = s.step()  # re-prefills the evicted tokens from the text
    assert r.event.tokens_in_step > 50
    assert r.snapshot.tokens_per_layer[0] == len(s.seq) - 1
    assert (r.snapshot.token_state != snap.TOKEN_EVICTED).all()
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "max_tokens"


def test_cli_json_reports_every_eviction(stories_path, capsys):
    import json

    from engine.tools.cli import main

    rc = main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-new-tokens", "60",
               "--policy", "streaming", "--sinks", "4", "--window", "24", "--page-size", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["stop_reason"] == "max_tokens"
    positions = [p for e in out["evictions"] for p in e["positions"]]
    assert all(e["reason"] == "streaming" for e in out["evictions"])
    assert positions == list(range(4, 4 + len(positions)))  # oldest after the sinks, in order, each once
    # 5 prompt + 59 fed tokens under a budget of 28, evicted 3 at a time (slack) when the budget is reached
    assert out["evicted_tokens"] == len(positions)
    assert 5 + 59 - 28 <= len(positions) <= 5 + 59 - 28 + 3


def test_streaming_says_it_keeps_its_sinks_not_the_prompt(stories):
    """#19 item 12: StreamingLLM protects 4 sinks; its note said the budget was 'smaller than the protected
    prompt' as if it had promised to keep the prompt."""
    s = ChatSession(stories, CacheConfig(page_size=4, policy="streaming", policy_params={"sinks": 4, "window": 16}))
    s.start([{"role": "user", "content": "Once upon a time there was a little dog who liked to run in the park"}],
            SamplingConfig(max_new_tokens=60, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    notes = " ".join(r.warnings)
    assert "keeps the first 4 tokens (attention sinks) and the most recent ones, 20 in all" in notes
    assert "protected prompt" not in notes and "raise the budget" not in notes


def test_overflow_turns_drops_the_fewest_whole_messages_and_never_the_system_prompt_or_a_pin():
    """"Drop the oldest turns" (#49 item 3): whole messages, oldest first, skipping the system prompt and pinned
    messages and never the latest one; an overflow of a few tokens drops one message, not half the context."""
    import numpy as np

    from engine.policies import PINNED, PolicyState
    from engine.policies.streaming import OverflowPolicy

    # BOS, system [1, 11), user1 [11, 31), reply1 [31, 61), user2 pinned [61, 71), reply2 [71, 101), user3 [101, 111)
    starts = (1, 11, 31, 61, 71, 101)
    pri = np.full(120, 0, dtype=np.int64)
    pri[1:11] = PINNED
    pri[61:71] = PINNED
    pos = np.arange(120)[None, :]
    pol = OverflowPolicy.for_mode("turns", 112, 31)
    state = PolicyState(positions=pos, protected=31, priorities=pri, turns=starts)
    (drop,) = pol.select(state, 112)
    assert drop.tolist() == list(range(11, 31))  # 8 over: user1 (20 tokens) goes, nothing else
    (drop,) = pol.select(state, 60)
    assert drop.tolist() == list(range(11, 61)) + list(range(71, 101))  # whole messages: 40 stay, not 60
    assert not set(drop) & (set(range(1, 11)) | set(range(61, 71)) | {0} | set(range(101, 120)))


def test_a_chat_past_the_context_drops_whole_turns_and_keeps_the_system_prompt_and_a_pin(stories):
    """The app's default overflow on a real session: a chat of several turns goes past stories260K's 512 tokens;
    the system prompt and the pinned message stay cached, what went are whole messages, and each overflow kept all
    but an eighth of the context (rolling kept half)."""
    import dataclasses

    import numpy as np

    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession
    from engine.model.chat import message_spans
    from engine.snapshot import TOKEN_EVICTED

    lm = dataclasses.replace(stories, arenas=None)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16, overflow="turns"))
    msgs = [{"role": "system", "content": "You are a storyteller who writes about dogs."}]
    story = "The little dog ran to the park and played with a big red ball in the sun. " * 3
    for turn in range(6):
        msgs.append({"role": "user", "content": f"{turn}: {story}", **({"pinned": True} if turn == 1 else {})})
        s.start(msgs, SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True))
        while not (r := s.step()).done:
            pass
        msgs.append({"role": "assistant", "content": r.text})
    snap = r.snapshot
    assert snap.evicted_total > 0 and snap.seq_len > lm.info.context_length
    spans = message_spans(lm.tokenizer, msgs[:-1])
    state = np.asarray(snap.token_state)
    kept = lambda a, b: not np.any(state[a:b] == TOKEN_EVICTED)  # noqa: E731
    assert kept(*spans[0]) and kept(*spans[3])  # the system prompt, the pinned message
    for a, b in spans[1:-1]:  # every other message is either all there or all gone: whole turns
        gone = np.count_nonzero(state[a:b] == TOKEN_EVICTED)
        assert gone in (0, b - a), (a, b, gone)
    assert int(max(snap.tokens_per_layer)) >= lm.info.context_length // 2
    s.close()
