"""One lifecycle per request (``engine.core.vocab.RequestStatus``): the reply's record holds it, so the session (is
a reply in progress?) and the engine core's ``Request`` (is it done? preempted?) read one value; every move is
checked against the lifecycle's."""

from __future__ import annotations

import itertools

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.scheduler import EngineCore, Priority, Request
from engine.core.session import ChatSession
from engine.core.vocab import RequestStatus as S

PROMPT = [1, 403, 407, 261, 378, 285, 429, 337, 280, 301]
LEGAL = {(S.WAITING, S.RUNNING), (S.WAITING, S.PREEMPTED), (S.WAITING, S.FINISHED), (S.RUNNING, S.PREEMPTED),
         (S.RUNNING, S.FINISHED), (S.PREEMPTED, S.RUNNING), (S.PREEMPTED, S.FINISHED)}


@pytest.mark.parametrize("old,new", list(itertools.product(S, S)))
def test_every_move_is_the_lifecycles_or_refused(old, new):
    if old is new or (old, new) in LEGAL:
        assert old.to(new) is new
    else:
        with pytest.raises(ValueError, match=f"from {old.value} to {new.value}"):
            old.to(new)


def test_a_chat_and_its_request_read_one_status_from_start_to_end(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4, prefix_reuse=False))
    try:
        assert not s.generating and s.turn_state.status is S.FINISHED  # no reply yet
        s.start_ids(PROMPT, SamplingConfig(max_new_tokens=6, ignore_eos=True))
        core, seen = EngineCore(stories), []
        request = core.add(Request(s, lambda r: seen.append((request.status, s.generating, r.done))))
        assert request.status is S.WAITING and s.generating
        while not request.done:
            core.round()
        assert [x[0] for x in seen[:-1]] == [S.RUNNING] * (len(seen) - 1)  # each step's result, while running
        assert seen[-1] == (S.FINISHED, False, True)  # the reply ended: the session and the request say so at once
        assert request.finish_reason == "max_tokens" and not core.requests
        with pytest.raises(ValueError, match="from finished to running"):
            request.status = S.RUNNING  # a finished request never runs again
        s.start_ids(PROMPT, SamplingConfig(max_new_tokens=2, ignore_eos=True))
        assert request.done and s.generating  # the next reply has a record (and a request) of its own
        s.close()
        assert not s.generating and s.turn_state.status is S.FINISHED
    finally:
        s.close()


def test_a_preempted_request_runs_again_and_gives_the_same_tokens(stories):
    """Two chats on a pool too small for both (8 pages of 4 tokens): the background one (22 tokens) is preempted
    for the chat on screen's last token (its cache given up), recomputed once that chat closed, and its reply is
    the one it gives alone."""
    cfg = CacheConfig(mode="paged", page_size=4, prefix_reuse=False, max_pages=8)
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    alone = ChatSession(stories, cfg)
    alone.start_ids(PROMPT, sampling)
    while not alone.step().done:
        pass
    want = alone.generated_ids
    alone.close()
    back, front = ChatSession(stories, cfg), ChatSession(stories, cfg)
    try:
        core = EngineCore(stories)
        back.start_ids(PROMPT, sampling)
        low = core.add(Request(back, lambda r: None, Priority.BACKGROUND))
        for _ in range(4):
            core.round()
        front.start_ids(PROMPT[:6], SamplingConfig(max_new_tokens=8, ignore_eos=True))
        core.add(Request(front, lambda r: front.close() if r.done else None, Priority.FOREGROUND))
        while core.requests:
            core.round()
        assert low.preempted == 1 and core.preemptions == 1
        assert back.generated_ids == want and low.finish_reason == "max_tokens" and low.status is S.FINISHED
    finally:
        back.close()
        front.close()


def test_a_cancel_stops_the_reply_it_was_asked_of_and_no_later_one(stories):
    """``cancel`` asks the reply in progress to stop (its next step ends it, ``cancelled``); asked between two
    replies, it stops none: the next reply runs to its own end."""
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4, prefix_reuse=False))
    try:
        s.start_ids(PROMPT, SamplingConfig(max_new_tokens=6, ignore_eos=True))
        assert not s.step().done
        s.cancel()
        last = s.step()
        assert last.done and last.stop_reason == "cancelled" and len(s.generated_ids) == 1
        s.cancel()  # no reply in progress
        s.start_ids(PROMPT, SamplingConfig(max_new_tokens=3, ignore_eos=True))
        while not (r := s.step()).done:
            pass
        assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 3
    finally:
        s.close()


def test_the_chat_on_screen_never_fails_for_pages_an_ended_reply_holds(stories):
    """A background chat (20-token prompt, 60 tokens: 20 pages of 4) and the chat on screen (9, 100: 28 pages) on
    one core, its pool 28-50 pages, both chats left open when their replies end (no source of the core holds
    them). The chat on screen fits any of these pools alone: it always gets HF's greedy reply, whether the
    pages it needs are the running background request's (preempted) or an ended reply's (swapped to host memory,
    brought back by that chat's next message). Before, with the background chat's reply ended (by its stop, or
    failed), its idle cache stayed put and the chat on screen ended with "KV cache full" on pools of 30-46 pages.
    The background chat fits alone too: where the chat on screen holds what it needs it waits (preempted, its
    pages given up) and goes on once they are free, to HF's greedy reply; before, it ended with "KV cache full"
    on pools of 30-36 pages."""
    import dataclasses

    from test_exact import hf_greedy

    story = stories.tokenizer("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    ids = story["input_ids"]
    back_prompt, front_prompt = ids[:20], ids[:9]
    want_back, want_front = hf_greedy(stories, back_prompt, 60), hf_greedy(stories, front_prompt, 100)
    outcomes = {}
    for pages in range(28, 51):
        lm = dataclasses.replace(stories, arenas=None, model_runner=None)  # a pool of its own
        cfg = CacheConfig(mode="paged", page_size=4, prefix_reuse=False, max_pages=pages)
        back, front = ChatSession(lm, cfg), ChatSession(lm, cfg)
        ends, seen = {}, set()
        try:
            core, requests = EngineCore(lm), []
            for s, prompt, n, priority in ((back, back_prompt, 60, Priority.BACKGROUND),
                                           (front, front_prompt, 100, Priority.FOREGROUND)):
                s.start_ids(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
                requests.append(core.add(Request(s, lambda r, s=s: ends.setdefault(id(s), r)
                                                 if isinstance(r, BaseException) or r.done else None, priority)))
                core.round(), core.round()  # the background chat holds its pages first
            while core.requests:
                core.round()
                seen.add(requests[0].status)
            for s, want in ((front, want_front), (back, want_back)):
                last = ends[id(s)]
                assert not isinstance(last, BaseException), (pages, last)
                assert last.stop_reason == "max_tokens" and s.generated_ids == want, pages
            outcomes[pages] = (S.PREEMPTED in seen, back.offloaded)
            if back.offloaded:  # swapped, not lost: its next message goes on
                front.close()
                more = back.seq + [back.seq[-1]]
                back.start_ids(more, SamplingConfig(max_new_tokens=2, ignore_eos=True))
                while not back.step().done:
                    pass
                assert not back.offloaded and back.generated_ids == hf_greedy(lm, more, 2), pages
        finally:
            back.close(), front.close()
    assert any(o[1] for o in outcomes.values())  # an ended reply's cache gave its pages, kept
    assert outcomes[30][0] and outcomes[36][0] and not outcomes[50][0], outcomes  # it waited where it had to


def test_a_request_larger_than_its_whole_pool_fails_at_once_and_never_waits(stories):
    """Waiting cannot give a request more than its pool holds (12 pages of 4: 48 slots), beside a chat on screen
    holding pages there: a 60-token prompt ends with the typed error when its prefill's 49th token would not fit,
    never preempted to wait; a 9-token prompt asked for 41 tokens waits while the chat on screen needs the pages,
    then ends with it when its 49th slot would not fit the pool alone (its 40 tokens given). The chat on screen
    goes on, each time."""
    import dataclasses

    from engine.errors import CacheCapacityError

    long = stories.tokenizer("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 4)
    assert len(long["input_ids"][:60]) == 60
    for prompt, n, waits, given in ((long["input_ids"][:60], 4, False, 0), (PROMPT[:9], 41, True, 40)):
        lm = dataclasses.replace(stories, arenas=None, model_runner=None)
        cfg = CacheConfig(mode="paged", page_size=4, prefix_reuse=False, max_pages=12)
        big, front = ChatSession(lm, cfg), ChatSession(lm, cfg)
        try:
            core, ends, seen = EngineCore(lm), {}, set()
            for s, ids, k, priority in ((front, PROMPT[:9], 20, Priority.FOREGROUND),
                                        (big, prompt, n, Priority.BACKGROUND)):
                s.start_ids(ids, SamplingConfig(max_new_tokens=k, ignore_eos=True))
                request = core.add(Request(s, lambda r, s=s: ends.setdefault(id(s), r)
                                           if isinstance(r, BaseException) or r.done else None, priority))
            while id(big) not in ends:
                core.round()
                seen.add(request.status)
            err = ends[id(big)]
            assert isinstance(err, CacheCapacityError) and "KV cache full" in str(err), err
            assert (S.PREEMPTED in seen) == waits and len(big.generated_ids) == given, (seen, len(big.generated_ids))
            assert big.cached_tokens <= 48
            while core.requests:
                core.round()
            assert ends[id(front)].stop_reason == "max_tokens" and len(front.generated_ids) == 20
        finally:
            big.close(), front.close()
