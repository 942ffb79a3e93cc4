"""Shared helpers for the app tests: synthetic snapshots and a window on the real engine."""

from __future__ import annotations

import types

import time
from pathlib import Path

import numpy as np

from engine.config import SamplingConfig
from engine.core.records import Demand
from engine.core.sequence import TurnState
from engine.core.vocab import RequestStatus
from engine.errors import ContextOverflowError, InternalError, SessionClosedError
from engine.snapshot import CacheSnapshot, ModelInfo, StepResult, TokenEvent

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=40)


def make_snapshot(**over) -> CacheSnapshot:
    """A small paged-cache snapshot: 3 layers, 8 pages of 4 tokens; override any field."""
    base = dict(
        generation_id=1, step=3, mode="paged", policy="none", page_size=4, num_pages=8,
        pages_used_per_layer=np.array([3, 3, 3]), tokens_per_layer=np.array([10, 10, 10]),
        bytes_per_layer=np.array([640, 640, 640]), capacity_tokens=32,
        page_state=np.array([1, 1, 2, 0, 3, 4, 6, 0], dtype=np.int8),
        page_owner=np.array([0, 1, 0, -1, 1, 2, -1, -1], dtype=np.int32),
        page_fill=np.array([4, 2, 4, 0, 4, 4, 0, 0], dtype=np.int32),
        page_refcount=np.array([1, 1, 2, 0, 1, 1, 0, 0], dtype=np.int32),
        token_state=np.zeros(11, dtype=np.int8), weights_bytes=1 << 20, kv_bytes=1920, device_bytes=0,
        reused_tokens=0, recomputed_tokens=11, first_divergence=-1, seq_len=11, context_length=512,
    )
    base.update(over)
    return CacheSnapshot(**base)


def make_info(**over) -> ModelInfo:
    base = dict(name="tiny", source="tiny", architecture="LlamaForCausalLM", model_type="llama", num_layers=4,
                num_q_heads=8, num_kv_heads=2, head_dim=16, hidden_size=128, vocab_size=100, context_length=1024,
                dtype="float32", kv_dtype="float32", device="cpu", device_reason="CPU: no CUDA device",
                quantization="none", weights_bytes=4 << 20, kv_bytes_per_token=2 * 4 * 2 * 16 * 4)
    base.update(over)
    return ModelInfo(**base)


def open_window(qtbot, data_dir: Path, model: str, timeout_ms: int = 120_000, backend=None,
                sampling: SamplingConfig | None = GREEDY):
    """A shown MainWindow with ``model`` loaded on the real engine (or ``backend``)."""
    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.settings.store import Settings

    settings = Settings.from_data_dir(data_dir)
    history = HistoryStore.in_data_dir(data_dir)
    window = MainWindow(settings, history, model=model, backend=backend)
    qtbot.addWidget(window)
    window.sampling_override = sampling
    window.show()
    with qtbot.waitSignal(window.model_loaded, timeout=timeout_ms):
        window.start()
    return window


def choose_overflow(qtbot, window, overflow: str) -> None:
    """Choose "When the context is full" in the cache controls as the user does, and wait until it is in force
    (the app's default drops the oldest; tests of what "Stop the reply" does choose it first)."""
    box = window.controls.overflow
    box.setCurrentIndex(box.findData(overflow))
    qtbot.waitUntil(lambda: window.cache.applied.overflow == overflow, timeout=10_000)


def use_lossy(qtbot, window) -> str:
    """A lossy setting was chosen in the controls: it asks first (what it was measured to cost here); answer
    "Use it" as the user does. Returns what it said."""
    strip = window.controls.asking_strip
    qtbot.waitUntil(lambda: strip.isVisibleTo(window.controls), timeout=10_000)
    said = strip.text.text()
    strip.yes.click()
    return said


def close_window(window) -> None:
    window.shutdown()
    window.history.close()


def wait_reply(qtbot, window, timeout_ms: int = 60_000):
    """Wait for the current reply to finish; returns (generation_id, stop_reason)."""
    gen = window.generation_id
    if not gen:
        return None
    with qtbot.waitSignal(window.reply_finished, timeout=timeout_ms,
                          check_params_cb=lambda g, _reason: g == gen) as blocker:  # not a background reply's
        pass
    return tuple(blocker.args)


def send_and_wait(qtbot, window, text: str, timeout_ms: int = 60_000):
    """Send ``text`` and wait for its reply: (generation_id, stop_reason). A chat that may be nearly full is sent
    only after the worker counted its tokens (``app.chat.send_check``), so the reply starts after ``send`` returns."""
    with qtbot.waitSignal(window.reply_finished, timeout=timeout_ms) as blocker:
        window.send(text)
    return tuple(blocker.args)


class SessionFake:
    """What the engine core asks of a session (``engine.core.scheduler.Steppable``), for the fakes: a token a step,
    alone (never batched), no pages to make room for."""

    generating = True
    closed = False  # its owner has not closed it (the core's KV manager asks, of ended replies)
    cache = types.SimpleNamespace(store=None)
    lm = runner = None

    def demand(self) -> Demand:  # one token a forward, never shared
        return Demand(pending=1, limit=512, shares=0, runner=None)

    def prepare(self, tokens=None):  # a fake needs no model forward: its step's result is what the core delivers
        return self.step()

    def room_for(self, n: int) -> bool:
        return True

    @property
    def turn_state(self) -> TurnState:
        """Its reply's record (a new one once the last reply finished, as a real session's ``start`` makes)."""
        t = self.__dict__.get("_turn")
        if t is None or t.status is RequestStatus.FINISHED:
            t = self.__dict__["_turn"] = TurnState()
        return t


class ScriptedSession(SessionFake):
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
