"""#31 item 2: a cache change mid-reply that reads tokens again (StreamingLLM → H2O: what StreamingLLM evicted comes
back from the text) says so in the reply's bubble while it runs — what, how many tokens, how far — Stop ends it
between two of its forwards and leaves the chat able to go on, and its time is named apart in the footer, never
counted as TTFT.

The real window on stories260K. stories260K reads 400 tokens in milliseconds, so the model's forward is made 0.1 s
slower (``SlowForward``) while it re-prefills: then it takes more than the half second after which the bubble says
it, as it does for a real model. The engine thread is held (a direct connection, on its own thread) at the two
moments the test must act in — a token of the reply, a step of the re-prefill — so nothing depends on timing.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import Qt

from app_helpers import close_window, open_window, wait_reply
from slow_forward import SlowForward

from engine.config import CacheConfig, SamplingConfig

STREAMING = CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 64}, overflow="rolling")
H2O = CacheConfig(policy="h2o", policy_params={"budget": 256, "recent": 64}, overflow="rolling")
LONG = "the little dog ran to the park and played with a red ball in the sun. " * 15  # 390 tokens


class Hold:
    """Holds the engine thread inside a signal's emit (a direct connection runs on that thread) the first time
    ``when(*args)`` is true, until ``release()``; the GUI thread meanwhile sees everything emitted before."""

    def __init__(self, signal, when) -> None:
        self.when, self.held, self._go, self.args = when, threading.Event(), threading.Event(), None
        self.signal = signal
        signal.connect(self._on, Qt.ConnectionType.DirectConnection)

    def _on(self, *args) -> None:
        if not self.held.is_set() and self.when(*args):
            self.args = args
            self.held.set()
            self._go.wait(60)

    def release(self) -> None:
        self._go.set()
        self.signal.disconnect(self._on)


def _apply(qtbot, w, cfg: CacheConfig) -> None:
    w.apply_cache_config(cfg)
    qtbot.waitUntil(lambda: w.cache.applied == cfg, timeout=10_000)


def test_a_reprefill_is_said_while_it_runs_stop_ends_it_and_it_is_not_ttft(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=40, ignore_eos=True))
    try:
        _before_the_first_token(qtbot, w)
        w.new_chat()
        _mid_reply_then_stop(qtbot, w)
    finally:
        close_window(w)


def _before_the_first_token(qtbot, w) -> None:
    """StreamingLLM reads a long prompt a few tokens a forward; H2O chosen half way reads what it evicted again
    (0.2 s a forward here): the footer's TTFT leaves that time out and names it apart."""
    worker, model = w.engine.worker, w.engine.worker._loaded.model
    _apply(qtbot, w, STREAMING)
    chunks = []
    at_chunk = Hold(worker.snapshot, lambda s: s.phase == "prefill" and chunks.append(s) is None and len(chunks) == 8)
    t0 = time.perf_counter()
    w.send(LONG)
    qtbot.waitUntil(at_chunk.held.is_set, timeout=30_000)
    w.apply_cache_config(H2O)
    slow = SlowForward(model, 0.2)
    first = Hold(worker.token, lambda e: e.index == 0)
    at_chunk.release()
    try:
        qtbot.waitUntil(first.held.is_set, timeout=60_000)
        wall_ms = (time.perf_counter() - t0) * 1000.0  # the engine is held after it timed the first token
        slow.undo()
    finally:
        first.release()
    _gen, reason = wait_reply(qtbot, w)
    assert reason == "max_tokens"
    stats = w.last_stats
    assert stats["reprefilled_tokens"] > 16 and stats["reprefill_ms"] > 50  # its share of slowed forwards
    # By construction TTFT + the re-prefill fit in the time to the first token; counted in TTFT too, they would not
    assert stats["ttft_ms"] + stats["reprefill_ms"] <= wall_ms
    footer = w.chat.bubbles[-1].stats_label.text()
    assert f"TTFT {stats['ttft_ms']:.0f} ms · re-prefilled {stats['reprefilled_tokens']:,} tokens in " in footer
    assert footer.count("not in TTFT") == 1


def _mid_reply_then_stop(qtbot, w) -> None:
    """H2O chosen at the reply's 3rd token: the line in the bubble, Stop during it, the chat goes on."""
    worker, model = w.engine.worker, w.engine.worker._loaded.model
    _apply(qtbot, w, STREAMING)
    at_token = Hold(worker.token, lambda e: e.index == 2)  # the reply's 3rd token: mid-reply
    w.send(LONG)
    qtbot.waitUntil(at_token.held.is_set, timeout=30_000)
    gen = w.generation_id
    w.apply_cache_config(H2O)  # as the controls send it: queued, applied between two steps
    slow = SlowForward(model, 0.1)
    shown = Hold(worker.reprefilling, lambda g, r: g == gen and r.done and r.running and r.ms > 500)
    at_token.release()
    try:
        qtbot.waitUntil(shown.held.is_set, timeout=60_000)
        r = shown.args[1]
        bubble = w.chat.streaming
        qtbot.waitUntil(lambda: f"{r.done:,} of {r.tokens:,}" in bubble.progress_label.text(), timeout=10_000)
        line = bubble.progress_label.text()
        assert line.startswith(f"Re-prefilling {r.tokens:,} tokens after switching to Heavy hitters (H2O): "), line
        assert f"({100 * r.done // r.tokens}%)" in line and "Stop (Esc) cancels" in line
        assert bubble.progress_label.isVisible()
        assert w.status.wait.text() == f"Re-prefilling: {r.done:,} of {r.tokens:,} tokens · Esc stops"
        assert 300 < r.tokens < 512 and 0 < r.done < r.tokens
        w.chat.stop_button.click()  # Stop, while the re-prefill is held between two of its forwards
    finally:
        shown.release()
    gen2, reason = wait_reply(qtbot, w)
    slow.undo()
    assert (gen2, reason) == (gen, "cancelled")
    bubble = w.chat.bubbles[-1]
    footer = bubble.stats_label.text()
    assert not bubble.progress_label.isVisible() and not w.status.wait.isVisible()
    assert "stopped by you" in footer
    assert f"re-prefilled {r.done:,} of {r.tokens:,} tokens in " in footer, footer
    assert "after switching to Heavy hitters (H2O), not in TTFT" in footer
    saved = w.history.messages(w.chat_id)[-1].stats
    assert saved["reprefills"][0]["done"] == r.done and saved["reprefilled_tokens"] == r.done
    # the chat goes on from where Stop left its cache
    w.send("What did the dog do next?")
    assert wait_reply(qtbot, w)[1] == "max_tokens"
    assert w.chat.bubbles[-1].text.strip() and "re-prefilled" not in w.chat.bubbles[-1].stats_label.text()
