"""EngineWorker on its QThread, with the real engine on stories260K (a fake only for the raising case)."""

from __future__ import annotations

import time

import pytest

from app.link.engine_thread import EngineThread
from app.link.worker import EngineBackend
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from app_helpers import SessionFake

SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture
def engine(qtbot, stories_path):
    thread = EngineThread()
    with qtbot.waitSignal(thread.worker.loaded, timeout=120_000) as blocker:
        thread.load(ModelSpec(source=str(stories_path)), CacheConfig(mode="paged", page_size=4))
    assert blocker.args[0].name == "stories260K"
    yield thread
    assert thread.shutdown(2000)


def _record(w) -> list[tuple]:
    events: list[tuple] = []
    w.started.connect(lambda g: events.append(("started", g)))
    w.token.connect(lambda e: events.append(("token", e.generation_id, e)))
    w.snapshot.connect(lambda s: events.append(("snapshot", s.generation_id, s)))
    w.failed.connect(lambda f: events.append(("failed", f.generation_id, f)))
    w.noted.connect(lambda g, n: events.append(("noted", g, n)))
    w.finished.connect(lambda g, r, st, t: events.append(("finished", g, r, st, t)))
    return events


def test_reply_signals_in_strict_order(qtbot, engine):
    w = engine.worker
    events = _record(w)
    with qtbot.waitSignal(w.finished, timeout=60_000):
        engine.submit(7, MESSAGES, SAMPLING, "chat-a")
    events[:] = [e for e in events if e[1] == 7]  # the idle snapshot after loading belongs to no reply
    kinds = [e[0] for e in events]
    # started, then (token, snapshot) per step, then finished; nothing else, nothing after
    assert kinds == ["started"] + ["token", "snapshot"] * 12 + ["finished"]
    assert all(e[1] == 7 for e in events)
    tokens = [e[2] for e in events if e[0] == "token"]
    assert [t.index for t in tokens] == list(range(12))
    assert tokens[0].phase == "prefill" and all(t.phase == "decode" for t in tokens[1:])
    _, gen, reason, stats, text = events[-1]
    assert (gen, reason) == (7, "max_tokens")
    assert stats.generated_tokens == 12 and text == "".join(t.text_delta for t in tokens)
    qtbot.wait(100)
    assert len([e for e in events if e[1] == 7]) == 26


def test_each_chat_keeps_its_own_cache(qtbot, engine):
    """Chats get their own sessions: going back to chat A reuses A's cache although B ran in between."""
    w = engine.worker
    finished = []
    w.finished.connect(lambda g, r, st, t: finished.append(st))
    a1 = [{"role": "user", "content": "Once upon a time"}]
    for gen, chat, msgs in ((1, "A", a1), (2, "B", [{"role": "user", "content": "The dog"}])):
        with qtbot.waitSignal(w.finished, timeout=60_000):
            engine.submit(gen, msgs, SAMPLING, chat)
    a2 = a1 + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "More"}]
    with qtbot.waitSignal(w.finished, timeout=60_000):
        engine.submit(3, a2, SAMPLING, "A")
    assert finished[2].reused_tokens > 0  # chat A's prefix was still cached (swapped back in)
    engine.forget_chat("B")
    qtbot.waitUntil(lambda: "B" not in w._pool, timeout=5000)
    assert "A" in w._pool


def test_cancel_stops_output(qtbot, engine):
    w = engine.worker
    tokens = []
    w.token.connect(tokens.append)
    with qtbot.waitSignal(w.token, timeout=60_000):
        engine.submit(1, MESSAGES, SAMPLING.replace(max_new_tokens=400))
    with qtbot.waitSignal(w.finished, timeout=10_000) as blocker:
        engine.cancel(1)
    assert blocker.args[0] == 1 and blocker.args[1] == "cancelled"
    n = len(tokens)
    assert n < 400
    qtbot.wait(200)
    assert len(tokens) == n  # nothing after finished


def test_apply_mid_reply_changes_the_cache(qtbot, engine):
    w = engine.worker
    snaps, notes = [], []
    w.snapshot.connect(snaps.append)
    w.applied.connect(lambda cfg, n: notes.extend(n))
    with qtbot.waitSignal(w.token, timeout=60_000):
        engine.submit(3, MESSAGES, SAMPLING.replace(max_new_tokens=30))
    engine.apply_cache_config(CacheConfig(mode="contiguous"))
    with qtbot.waitSignal(w.finished, timeout=60_000) as blocker:
        pass
    assert blocker.args[1] == "max_tokens"
    assert snaps[0].mode == "paged" and snaps[-1].mode == "contiguous"
    assert any("contiguous" in n for n in notes)


class Boom(RuntimeError):
    pass


class RaisingSession(SessionFake):
    """The only fake: a session whose third step raises."""

    def __init__(self) -> None:
        self.steps = 0

    def start(self, messages, sampling, generation_id):
        self.steps = 0

    def step(self):
        from engine.snapshot import StepResult, TokenEvent

        self.steps += 1
        if self.steps == 3:
            raise Boom("kernel exploded")
        return StepResult(TokenEvent(9, self.steps - 1, 1, "a", "decode", 1.0, 1), None, False, text="a" * self.steps)

    def cancel(self):
        pass

    def apply(self, cfg):
        return []

    def snapshot(self):
        return None


def test_raising_engine_becomes_failed_then_finished(qtbot):
    from app.ground.failure import Failure

    sessions = []
    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": None})(),
                            make_session=lambda loaded, cache: sessions.append(RaisingSession()) or sessions[-1])
    thread = EngineThread(backend)
    try:
        with qtbot.waitSignal(thread.worker.loaded, timeout=10_000):
            thread.load(ModelSpec(source="demo"))
        w = thread.worker
        events = _record(w)
        with qtbot.waitSignal(w.finished, timeout=10_000):
            thread.submit(9, MESSAGES, SAMPLING)
        assert [e[0] for e in events] == ["started", "token", "token", "failed", "finished"]
        # an untyped exception: not recoverable, so the worker drops that session
        assert events[3][2] == Failure(9, "step", "Boom: kernel exploded", "Boom", recoverable=False)
        assert events[4][1:3] == (9, "error") and events[4][4] == "aa"  # the text streamed so far
        # the worker still works after a failure, in a fresh session (the raising one is never used again)
        with qtbot.waitSignal(w.failed, timeout=10_000) as blocker:
            thread.submit(10, MESSAGES, SAMPLING)
        assert blocker.args[0].generation_id == 10 and len(sessions) == 2 and sessions[0].steps == 3
    finally:
        assert thread.shutdown(2000)


def test_load_failure_is_a_message(qtbot, tmp_path):
    thread = EngineThread()
    try:
        with qtbot.waitSignal(thread.worker.failed, timeout=120_000) as blocker:
            thread.load(ModelSpec(source=str(tmp_path / "missing")))
        (failure,) = blocker.args
        assert (failure.generation_id, failure.stage, failure.type) == (-1, "load", "ModelNotFoundError")
        assert "missing" in failure.message and "\n" not in failure.message and failure.recoverable
    finally:
        assert thread.shutdown(2000)


def test_shutdown_during_reply_joins_fast(qtbot, engine):
    with qtbot.waitSignal(engine.worker.token, timeout=60_000):
        engine.submit(5, MESSAGES, SAMPLING.replace(max_new_tokens=400))
    t = time.perf_counter()
    assert engine.shutdown(2000)
    assert time.perf_counter() - t < 2.0
    assert not engine.thread.isRunning()
