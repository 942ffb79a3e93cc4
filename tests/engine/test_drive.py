"""engine.core.scheduler.drive: a one-request core for the tools' loops (CLI, bench, quality) — the same
results as stepping the session, its errors raised, and a loop that leaves early leaves the reply going."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.scheduler import drive
from engine.core.session import ChatSession
from engine.errors import EngineError

PROMPT = [1, 403, 407, 261, 378, 285, 429, 337, 280, 301]
GREEDY = SamplingConfig(max_new_tokens=24, ignore_eos=True)


def _stepped(lm, cfg: CacheConfig, sampling=GREEDY) -> tuple[list, list]:
    s = ChatSession(lm, cfg)
    try:
        s.start_ids(PROMPT, sampling)
        events = []
        while not (r := s.step()).done:
            events.append(r.event is not None)
        return s.generated_ids, events + [r.event is not None]
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["paged", "contiguous", "off"])
def test_drive_gives_what_stepping_gives(stories, mode):
    cfg = CacheConfig(mode=mode, page_size=4, prefix_reuse=False)
    ids, events = _stepped(stories, cfg)
    s = ChatSession(stories, cfg)
    try:
        s.start_ids(PROMPT, GREEDY)
        results = list(drive(s))
        assert s.generated_ids == ids and len(ids) == 24
        assert [r.event is not None for r in results] == events  # one result per step, in order
        assert results[-1].done and not any(r.done for r in results[:-1]) and not s.generating
        assert results[-1].stats.generated_tokens == 24 and results[-1].stop_reason == "max_tokens"
    finally:
        s.close()


def test_leaving_early_leaves_the_reply_for_the_next_core(stories):
    cfg = CacheConfig(mode="paged", page_size=4, prefix_reuse=False)
    ids, _ = _stepped(stories, cfg)
    s = ChatSession(stories, cfg)
    try:
        s.start_ids(PROMPT, GREEDY)
        for r in drive(s):
            if r.event is not None:
                break  # the first token
        assert s.generating and len(s.generated_ids) == 1
        rest = list(drive(s))
        assert s.generated_ids == ids and rest[-1].done and len(rest) == 23
    finally:
        s.close()


def test_the_error_that_ends_the_reply_is_raised_and_no_reply_is_refused(stories, monkeypatch):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    try:
        with pytest.raises(EngineError, match="no reply in progress"):
            next(drive(s))  # as ``step()`` refuses it (the core would skip a session with no reply)

        def boom(works):
            raise RuntimeError("the forward failed")

        monkeypatch.setattr(s.lm.runner, "run", boom)
        s.start_ids(PROMPT, GREEDY)
        with pytest.raises(Exception) as stepped:
            s.step()
        s.start_ids(PROMPT, GREEDY)
        with pytest.raises(Exception) as driven:
            list(drive(s))
        assert type(driven.value) is type(stepped.value) and str(driven.value) == str(stepped.value)
        assert not s.generating  # the reply ended, rolled back
    finally:
        s.close()
