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
