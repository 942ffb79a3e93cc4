"""EngineWorker with scripted sessions (the engine's contract, not its internals): typed failures by stage,
token-less prefill steps, and notes sent once per reply."""

from __future__ import annotations

import time

import pytest
from app_helpers import make_snapshot

from app.failure import Failure
from app.worker import EngineBackend, EngineThread
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.errors import ContextOverflowError, InternalError, OutOfMemoryError, SessionClosedError
from engine.snapshot import StepResult, TokenEvent

SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=2)


class ScriptedSession:
    """``chunks`` token-less prefill steps, then ``tokens`` tokens. From step 2 every snapshot repeats the
    pending note "dropped 120"; the last step warns "dropped 120" and "context full". A user message
    naming an exception makes ``start`` (``start:NAME``) or the first step (``step:NAME``) raise it."""

    def __init__(self, chunks: int = 3, tokens: int = 2, delay_s: float = 0.0) -> None:
        self.chunks, self.tokens, self.delay_s = chunks, tokens, delay_s
        self.closed = False

    def start(self, messages, sampling, generation_id):
        self.gen, self.n, self.cancelled = generation_id, 0, False
        self.script = messages[-1]["content"]
        if self.script == "start:overflow":
            raise ContextOverflowError("the prompt has 600 tokens but the model's context is 512: shorten the chat")

    def step(self):
        time.sleep(self.delay_s)
        if self.script == "step:internal":
            raise InternalError("an unexpected error ended the reply") from RuntimeError("injected")
        if self.script == "step:closed":
            raise SessionClosedError("the session was closed: start a new one")
        self.n += 1
        snap = make_snapshot(generation_id=self.gen, step=self.n, notes=("dropped 120",) if self.n >= 2 else ())
        if self.cancelled:
            return StepResult(None, snap, True, "cancelled", "")
        if self.n <= self.chunks:
            return StepResult(None, snap, False)
        i = self.n - self.chunks - 1
        done = i + 1 == self.tokens
        return StepResult(TokenEvent(self.gen, i, 5, "x", "prefill" if i == 0 else "decode", 1.0, 1), snap, done,
                          "max_tokens" if done else "", text="x" * (i + 1),
                          warnings=("dropped 120", "context full") if done else ())

    def cancel(self):
        self.cancelled = True

    def apply(self, cfg):
        raise ValueError("page size: 999 is outside 1..256")

    def snapshot(self):
        return None

    def close(self):
        self.closed = True


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
