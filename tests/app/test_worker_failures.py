"""EngineWorker with scripted sessions (the engine's contract, not its internals): typed failures by stage,
token-less prefill steps, and notes sent once per reply."""

from __future__ import annotations

import pytest
from app_helpers import ScriptedSession

from app.ground.failure import Failure
from app.link.engine_thread import EngineThread
from app.link.worker import EngineBackend
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.errors import OutOfMemoryError

SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=2)


def _thread(qtbot, make_session, make_pool=None) -> EngineThread:
    from app_helpers import make_info

    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": make_info()})(),
                            make_session=make_session, make_pool=make_pool)
    thread = EngineThread(backend)
    with qtbot.waitSignal(thread.worker.loaded, timeout=10_000):
        thread.load(ModelSpec(source="demo"))
    return thread


def _record(w) -> list[tuple]:
    events: list[tuple] = []
    w.started.connect(lambda g: events.append(("started", g)))
    w.token.connect(lambda e: events.append(("token", e.index)))
    w.snapshot.connect(lambda s: events.append(("snapshot", s.step)))
    w.noted.connect(lambda g, n: events.append(("noted", g, n)))
    w.failed.connect(lambda f: events.append(("failed", f)))
    w.finished.connect(lambda g, r, st, t: events.append(("finished", g, r, t)))
    return events


def _submit(qtbot, thread, gen: int, text: str) -> None:
    with qtbot.waitSignal(thread.worker.finished, timeout=10_000):
        thread.submit(gen, [{"role": "user", "content": text}], SAMPLING, None)


def test_prefill_chunks_are_progress_and_notes_come_once(qtbot):
    thread = _thread(qtbot, lambda loaded, cache: ScriptedSession())
    try:
        events = _record(thread.worker)
        _submit(qtbot, thread, 4, "hello")
        # three token-less prefill steps: snapshots only; then two tokens; each note once, before finished
        assert events == [("started", 4), ("snapshot", 1), ("snapshot", 2), ("noted", 4, ["dropped 120"]),
                          ("snapshot", 3), ("token", 0), ("snapshot", 4), ("token", 1), ("snapshot", 5),
                          ("noted", 4, ["context full"]), ("finished", 4, "max_tokens", "xx")]
        events.clear()
        _submit(qtbot, thread, 5, "again")  # a new reply: its notes are news again
        assert [e for e in events if e[0] == "noted"] == [("noted", 5, ["dropped 120"]), ("noted", 5, ["context full"])]
    finally:
        assert thread.shutdown(2000)


def test_stop_takes_effect_between_prefill_chunks(qtbot):
    thread = _thread(qtbot, lambda loaded, cache: ScriptedSession(chunks=10**6, delay_s=0.002))
    try:
        events = _record(thread.worker)
        with qtbot.waitSignal(thread.worker.snapshot, timeout=10_000):
            thread.submit(6, [{"role": "user", "content": "a very long prompt"}], SAMPLING, None)
        with qtbot.waitSignal(thread.worker.finished, timeout=10_000) as blocker:
            thread.cancel(6)
        assert blocker.args[:2] == [6, "cancelled"]
        assert not [e for e in events if e[0] in ("token", "failed")]
    finally:
        assert thread.shutdown(2000)


def test_failures_are_typed_by_stage(qtbot):
    sessions: list[ScriptedSession] = []
    thread = _thread(qtbot, lambda loaded, cache: sessions.append(ScriptedSession()) or sessions[-1])
    try:
        events = _record(thread.worker)
        _submit(qtbot, thread, 1, "start:overflow")
        assert [e[0] for e in events] == ["started", "failed", "finished"]
        assert events[1][1] == Failure(1, "start", "the prompt has 600 tokens but the model's context is 512: "
                                       "shorten the chat", "ContextOverflowError", recoverable=True)
        assert events[2] == ("finished", 1, "error", "")

        events.clear()
        _submit(qtbot, thread, 2, "step:internal")  # a bug the engine caught and rolled back: the cause is named
        assert events[1][1] == Failure(2, "step", "an unexpected error ended the reply (RuntimeError: injected)",
                                       "InternalError", recoverable=True)
        assert len(sessions) == 1 and not sessions[0].closed  # a rolled-back session goes on

        events.clear()
        _submit(qtbot, thread, 3, "step:closed")  # a closed session cannot go on: the next reply gets a new one
        assert (events[1][1].type, events[1][1].recoverable) == ("SessionClosedError", False)
        assert sessions[0].closed
        _submit(qtbot, thread, 4, "hello")
        assert len(sessions) == 2 and events[-1] == ("finished", 4, "max_tokens", "xx")

        events.clear()
        with qtbot.waitSignal(thread.worker.failed, timeout=10_000) as blocker:
            thread.apply_cache_config(CacheConfig(mode="contiguous"))
        assert blocker.args[0] == Failure(0, "apply", "Cache settings not applied: page size: 999 is outside 1..256",
                                          "ValueError", recoverable=True)
        qtbot.wait(50)
        assert [e[0] for e in events] == ["failed"]  # no reply ran, so none finished
    finally:
        assert thread.shutdown(2000)


class FailingPool:
    """A session pool whose chat switch runs out of memory (say, swapping a chat's cache back in)."""

    def __init__(self) -> None:
        self.session = ScriptedSession()

    def activate(self, chat):
        if chat == "big":
            raise OutOfMemoryError("out of memory bringing chat big back: close other chats")
        return self.session, []

    def __contains__(self, chat):
        return False

    def get(self, chat):
        return None  # no chat has a session yet (so none is swapped out)


def test_a_failed_chat_switch_is_the_swap_stage(qtbot):
    thread = _thread(qtbot, lambda loaded, cache: None, make_pool=lambda loaded, cache: FailingPool())
    try:
        events = _record(thread.worker)
        with qtbot.waitSignal(thread.worker.finished, timeout=10_000):
            thread.submit(8, [{"role": "user", "content": "hi"}], SAMPLING, "big")
        failure = events[1][1]
        assert (failure.stage, failure.type, failure.recoverable) == ("swap", "OutOfMemoryError", True)
        assert failure.ends_reply and "close other chats" in failure.message
    finally:
        assert thread.shutdown(2000)


@pytest.mark.parametrize("exc, message", [
    (MemoryError(), "out of memory"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore"), "out of memory: CUDA out of memory. "
                                                                          "Tried to allocate 2 GiB"),
    (KeyError("layer"), "KeyError: 'layer'"),
])
def test_untyped_exceptions_become_one_line(exc, message):
    failure = Failure.from_exception(3, "step", exc)
    assert (failure.message, failure.recoverable, failure.ends_reply) == (message, False, True)


class Row(dict):
    def as_dict(self) -> dict:
        return dict(self)


class ScriptedComparison:
    """``settings`` rows of ``steps`` steps each; raises at step ``raise_at`` (0: never)."""

    def __init__(self, settings: int = 2, steps: int = 3, raise_at: int = 0) -> None:
        self.settings, self.steps, self.raise_at = settings, steps, raise_at
        self.n, self.rows, self.cancelled, self.closed = 0, [], False, False

    @property
    def done(self) -> bool:
        return self.cancelled or len(self.rows) == self.settings

    def step(self):
        self.n += 1
        if self.n == self.raise_at:
            raise RuntimeError("comparison exploded")
        if self.n % self.steps:
            return None
        self.rows.append(Row(label=f"setting {len(self.rows)}", step=self.n))
        return self.rows[-1]

    def cancel(self) -> None:
        self.cancelled = True

    def close(self) -> None:
        self.closed = True


def test_comparisons_are_tagged_replaced_and_cancelled_by_id(qtbot):
    from app_helpers import make_info

    made: list[ScriptedComparison] = []

    def make_comparison(loaded, messages, sampling):
        made.append(ScriptedComparison(steps=10**6 if messages == "forever" else 3,
                                       raise_at=2 if messages == "raise" else 0))
        return made[-1]

    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": make_info()})(),
                            make_session=lambda loaded, cache: ScriptedSession(), make_comparison=make_comparison)
    thread = EngineThread(backend)
    events: list[tuple] = []
    w = thread.worker
    w.compared.connect(lambda cid, row: events.append(("row", cid, row["label"], row["step"])))
    w.compare_finished.connect(lambda cid, reason: events.append(("end", cid, reason)))
    w.failed.connect(lambda f: events.append(("failed", f.stage, f.message, f.generation_id)))
    try:
        with qtbot.waitSignal(w.loaded, timeout=10_000):
            thread.load(ModelSpec(source="demo"))
        with qtbot.waitSignal(w.compare_finished, timeout=10_000):
            thread.compare(1, "chat", SAMPLING)
        assert events == [("row", 1, "setting 0", 3), ("row", 1, "setting 1", 6), ("end", 1, "done")]
        assert made[0].closed

        events.clear()
        thread.compare(2, "forever", SAMPLING)
        thread.cancel_compare(99)  # not this comparison: nothing happens
        with qtbot.waitSignal(w.compare_finished, timeout=10_000):
            thread.compare(3, "chat", SAMPLING)  # replaces comparison 2
        qtbot.waitUntil(lambda: ("end", 3, "done") in events, timeout=10_000)
        assert events[0] == ("end", 2, "cancelled") and made[1].closed
        assert [e for e in events if e[0] == "row"] == [("row", 3, "setting 0", 3), ("row", 3, "setting 1", 6)]

        events.clear()
        thread.compare(4, "forever", SAMPLING)
        with qtbot.waitSignal(w.compare_finished, timeout=10_000):
            thread.cancel_compare(4)
        assert events == [("end", 4, "cancelled")] and made[3].cancelled

        events.clear()
        with qtbot.waitSignal(w.compare_finished, timeout=10_000):
            thread.compare(5, "raise", SAMPLING)
        assert events == [("failed", "compare", "RuntimeError: comparison exploded", 0),
                          ("end", 5, "RuntimeError: comparison exploded")]
    finally:
        assert thread.shutdown(2000)
