"""One account, one record (#49 item 2): after each flow — a first message, a follow-up, a changed system prompt,
Regenerate, Edit & resend, a restart — the reply's footer, the Why readout's caption and the timing caption give
the same reused / computed / recomputed numbers, and the status bar's context is the same after the restart. The
real window on stories260K, the real history file."""

from __future__ import annotations

import html
import re

from app_helpers import close_window, open_window, wait_reply

from engine.config import SamplingConfig

SHORT = SamplingConfig(temperature=0.0, max_new_tokens=40)


def _plain(text: str) -> str:
    return re.sub("<[^>]+>", "", html.unescape(text))


def _numbers(qtbot, w) -> dict:
    """What each surface says of the chat on screen's last prompt."""
    qtbot.wait(300)  # the panels' last frame
    stats = w.last_stats
    footer = w.chat.bubbles[-1].cache_label.text()
    why = _plain(w.why.caption.text())
    timing = _plain(w.timing.caption.text())
    f = re.match(r"reused ([\d,]+) tokens?, computed ([\d,]+) \(([^)]*)\)", footer)
    y = re.search(r"prompt ([\d,]+) tokens: ([\d,]+) reused, ([\d,]+) computed \(([^)]*)\)", why)
    t = re.search(r"\(([\d,]+) of ([\d,]+) prompt tokens computed\)", timing)
    assert f and y and t, (footer, why, timing)
    n = lambda s: int(s.replace(",", ""))  # noqa: E731
    return {"stats": (stats["reused_tokens"], stats["recomputed_tokens"], stats["prompt_tokens"]),
            "footer": (n(f[1]), n(f[2]), f[3]), "why": (n(y[2]), n(y[3]), y[4]), "timing": (n(t[1]), n(t[2])),
            "prompt": n(y[1])}


def _agree(qtbot, w, flow: str) -> None:
    got = _numbers(qtbot, w)
    reused, computed, prompt = got["stats"]
    assert got["footer"] == got["why"], (flow, got)  # the same numbers and the same words (new / recomputed)
    assert got["footer"][:2] == (reused, computed) and got["prompt"] == prompt, (flow, got)
    assert got["timing"] == (computed, prompt), (flow, got)


def test_every_surface_gives_the_same_numbers_after_each_flow_and_a_restart(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.chat.system_prompt.setText("You are a kind storyteller.")
        w.conversation.set_system_prompt("You are a kind storyteller.")
        for flow, act in (("first message", lambda: w.send("Tell me about a cat.")),
                          ("follow-up", lambda: w.send("And a dog?")),
                          ("system prompt", lambda: (w.conversation.set_system_prompt("You're a kind storyteller."),
                                                     w.send("And a bird?"))),
                          ("regenerate", w.on_screen.regenerate),
                          ("edit & resend", lambda: w.on_screen.edit(w.history.messages(w.chat_id)[2].position,
                                                                     "And a fox?"))):
            act()
            wait_reply(qtbot, w)
            _agree(qtbot, w, flow)
        context = w.status.context.text()
        footer, why = w.chat.bubbles[-1].cache_label.text(), w.why.caption.text()
    finally:
        close_window(w)
    w.close()
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)  # a restart: the same record on screen
    try:
        qtbot.waitUntil(lambda: w.status.context.text() == context, timeout=10_000)
        assert w.chat.bubbles[-1].cache_label.text() == footer and w.why.caption.text() == why
    finally:
        close_window(w)
