"""A reply that an engine error ends, and notes the engine sends during a reply, in the real window.

The fault is injected into the real stories260K model under a real ``ChatSession`` on the real worker
thread: the model's forward raises ``RuntimeError("injected")`` on its Nth call after the patch.
"""

from __future__ import annotations

from app_helpers import ScriptedSession, choose_overflow, close_window, make_info, open_window, wait_reply

from app.link.worker import EngineBackend
from engine.config import SamplingConfig

SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=40, ignore_eos=True)


class Fault:
    """Wraps a model's forward: the ``at``-th call after ``arm()`` raises, the others run the model."""

    def __init__(self, model, at: int) -> None:
        self.model, self.at, self.calls, self.armed = model, at, 0, False
        self._forward = model.forward

    def arm(self) -> "Fault":
        self.calls, self.armed = 0, True
        self.model.forward = self  # an instance attribute: nn.Module.__call__ finds it before the method
        return self

    def disarm(self) -> None:
        self.armed = False
        del self.model.forward

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.armed and self.calls == self.at:
            raise RuntimeError("injected")
        return self._forward(*args, **kwargs)


def _fail_a_reply(qtbot, w, failures: list, fault: Fault) -> None:
    """Send a message whose reply the fault ends after 5 tokens (the prefill is call 1)."""
    shown: list[str] = []
    w.error_shown.connect(shown.append)
    w.engine.worker.failed.connect(failures.append)
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.send("Once upon a time")
    assert done.args[1] == "error" and fault.calls == fault.at
    assert len(shown) == 1 and "injected" in shown[0]  # the status bar said it too


def test_an_engine_error_mid_reply_shows_its_reason_and_survives_a_restart(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SAMPLING)
    fault = Fault(w.engine.worker._loaded.model, at=6).arm()
    try:
        failures: list = []
        _fail_a_reply(qtbot, w, failures, fault)
        (failure,) = failures
        assert (failure.stage, failure.generation_id) == ("step", w.conversation._next_generation)
        assert failure.type in ("RuntimeError", "InternalError") and "injected" in failure.message
        assert w.last_stats["stop_reason"] == "error" and w.last_stats["generated_tokens"] == 5
        # the reply keeps what streamed and says an error stopped it, and why
        user, reply = w.chat.bubbles
        assert (user.role, reply.role) == ("user", "assistant") and reply.text.strip()
        assert reply.error_label.text() == f"Error: {failure.message}" and reply.error_label.isVisibleTo(w)
        assert "stopped by an error" in reply.stats_label.text()
        assert not w.chat.notice.isVisibleTo(w)  # the reply shows it; nothing unsaved elsewhere
        # the chat accepts the next message
        assert w.chat.send_button.isEnabled() and not w.chat.stop_button.isEnabled() and not w.generation_id
        saved = w.history.messages(w.chat_id)[1]
        assert saved.content == reply.text and saved.stats["error"] == failure.message
        text = reply.text
    finally:
        fault.disarm()
        close_window(w)
    w.close()

    w2 = open_window(qtbot, data_dir, str(stories_path), sampling=SAMPLING)
    try:
        reply = w2.chat.bubbles[1]
        assert reply.text == text and reply.error_label.text() == f"Error: {failure.message}"
        assert "stopped by an error" in reply.stats_label.text()
    finally:
        close_window(w2)


def test_the_next_message_after_an_engine_error_gets_a_normal_reply(qtbot, data_dir, stories_path, stories):
    from engine.core.session import ChatSession

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SAMPLING)
    fault = Fault(w.engine.worker._loaded.model, at=6).arm()
    try:
        _fail_a_reply(qtbot, w, [], fault)
        fault.disarm()
        w.send("The dog ran")
        gen, reason = wait_reply(qtbot, w)
        assert reason == "max_tokens" and "error" not in w.last_stats
        assert w.last_stats["generated_tokens"] == 40 and [b.role for b in w.chat.bubbles][-2:] == ["user", "assistant"]
        # the reply of a session whose first reply stopped after the same 5 tokens (greedy). Not a fresh one:
        # reused keys computed one token at a time differ from a re-prefill's in the last bits, and this
        # story has a tie at 1e-6 (12.738513 vs 12.738512) seven tokens in
        messages = w.conversation.engine_messages()[:-1]
        first = messages[:next(i for i, m in enumerate(messages) if m["role"] == "user") + 1]
        reference = ChatSession(stories, w.cache.applied)
        reference.start(first, SAMPLING)
        for _ in range(fault.at - 1):  # the forwards before the injected fault: 5 tokens
            reference.step()
        reference.cancel()
        assert reference.step().stop_reason == "cancelled" and len(reference.generated_ids) == fault.at - 1
        reference.start(messages, SAMPLING)
        result = reference.step()
        while not result.done:
            result = reference.step()
        reference.close()
        assert w.chat.bubbles[-1].text == result.text
    finally:
        if fault.armed:
            fault.disarm()
        close_window(w)


def test_a_reply_that_cannot_start_says_why_and_the_chat_goes_on(qtbot, data_dir, stories_path):
    """A prompt longer than stories260K's 512-token context (overflow "stop"): the app asks first and offers no
    "Send anyway" (#19 item 12: it could only fail); sent past the check all the same (as a message sent just
    before the settings changed would be), the engine's typed refusal ends that reply with its own reason; the
    chat goes on once the message is shortened (a reply that merely would pass the context is not refused: it
    stops when full)."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(max_new_tokens=600))
    try:
        choose_overflow(qtbot, w, "stop")  # the default drops the oldest: such a prompt would go out at once
        failures: list = []
        w.engine.worker.failed.connect(failures.append)
        w.send("the cat sat on the mat and " * 60)  # about 620 tokens
        qtbot.waitUntil(lambda: bool(w.chat.notice.action_buttons), timeout=10_000)
        assert [b.text() for b in w.chat.notice.action_buttons] == ["Drop the oldest turns and send", "New chat"]
        w.conversation.send(w.chat.input.toPlainText(), checked=True)
        assert wait_reply(qtbot, w)[1] == "error"
        (failure,) = failures
        assert (failure.stage, failure.type, failure.recoverable) == ("start", "ContextOverflowError", True)
        reply = w.chat.bubbles[-1]
        assert reply.error_label.text() == f"Error: {failure.message}" and "context" in failure.message
        assert reply.text == "" and "no text" in reply.body.text()
        assert w.history.messages(w.chat_id)[1].stats["error"] == failure.message
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        w.conversation.edit_and_resend(0, "The dog ran")
        assert wait_reply(qtbot, w)[1] == "max_tokens" and w.last_stats["generated_tokens"] == 10
        assert [m.role for m in w.history.messages(w.chat_id)] == ["user", "assistant"]
    finally:
        close_window(w)


def test_notes_show_under_the_reply_once_and_are_saved(qtbot, data_dir):
    """Notes from snapshots (pending, repeated every step) and the last step's warnings: each shown once,
    under the reply while it streams and after, in the status bar and trace, and saved with the reply.
    Token-less prefill steps are progress, not tokens."""
    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": make_info()})(),
                            make_session=lambda loaded, cache: ScriptedSession(chunks=3, tokens=30, delay_s=0.01))
    w = open_window(qtbot, data_dir, "demo", backend=backend)
    try:
        w.send("hello")
        qtbot.waitUntil(lambda: w.chat.streaming is not None
                        and w.chat.streaming.notes_label.text() == "• dropped 120", timeout=10_000)
        assert w.generation_id and w.chat.streaming.notes_label.isVisibleTo(w)
        gen, reason = wait_reply(qtbot, w)
        reply = w.chat.bubbles[-1]
        assert reason == "max_tokens" and reply.notes_label.text() == "• dropped 120\n• context full"
        assert w.statusBar().currentMessage() == "context full"
        assert w.trace.notes == ["dropped 120", "context full"]
        assert w.last_stats["generated_tokens"] == 30 == w.conversation.tokens_in_reply  # not 33
        assert w.history.messages(w.chat_id)[1].stats["notes"] == ["dropped 120", "context full"]
    finally:
        close_window(w)
    w.close()
    w2 = open_window(qtbot, data_dir, "demo", backend=backend)
    try:
        assert w2.chat.bubbles[1].notes_label.text() == "• dropped 120\n• context full"
    finally:
        close_window(w2)
