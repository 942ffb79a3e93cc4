"""The seams of issue #30 (item 7), each as a user sees it on the real window (offscreen) with the real stories260K:
a reopened chat's context readout never says more than its context; returning to a chat replying in the background
shows its whole reply's timing, at the speed the status bar says; the captions change in the same frame as the
setting. The remote seams (regenerate acts on the remote chat; remote captions are remote) are in
test_seams_remote.py, against a real ``engine serve``."""

from __future__ import annotations

import re

from app_helpers import close_window, open_window, wait_reply

from engine.config import CacheConfig, SamplingConfig
from engine.policies.base import config_from_flags


LONG = SamplingConfig(temperature=0.0, max_new_tokens=560, ignore_eos=True)


def context_numbers(text: str) -> tuple[int, int]:
    """'Context: 324 of 512 tokens · chat 580 (256 dropped)' → (324, 512)."""
    m = re.match(r"Context: ([\d,]+) of ([\d,]+)", text)
    assert m, text
    return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))


def apply(qtbot, w, cfg: CacheConfig) -> None:
    with qtbot.waitSignal(w.engine.worker.applied, timeout=30_000):
        w.apply_cache_config(cfg)


def test_a_reopened_chat_says_at_most_its_context(qtbot, data_dir, stories_path):
    """A chat that dropped tokens past the model's 512 (StreamingLLM), reopened from history by a new window: the
    context readout is N of 512 with N <= 512 (it said 'Context: 581 of 512'), the chat's own count beside it."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=LONG)
    try:
        apply(qtbot, w, config_from_flags(policy="streaming", flags={"sinks": 4, "window": 120},
                                               mode="paged", page_size=16))
        w.send("Once upon a time")
        wait_reply(qtbot, w, 120_000)
        qtbot.wait(300)
        before = w.status.context.text()
        used, total = context_numbers(before)
        assert total == 512 and used <= total and "dropped" in before
        long_chat = w.chat_id
        w.new_chat()  # a short chat too, the one the new window opens first
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=20)
        w.send("A cat")
        wait_reply(qtbot, w)
        short_chat = w.chat_id
    finally:
        close_window(w)
        w.close()

    w = open_window(qtbot, data_dir, str(stories_path), sampling=LONG)
    try:
        assert w.chat_id == short_chat
        qtbot.waitUntil(lambda: w.status.context.text() != "Context: —", timeout=10_000)
        used, total = context_numbers(w.status.context.text())
        assert 0 < used < 100 and total == 512 and "dropped" not in w.status.context.text()
        w.open_chat(long_chat)

        def described() -> bool:
            return "dropped" in w.status.context.text()

        qtbot.waitUntil(described, timeout=10_000)
        text = w.status.context.text()
        used, total = context_numbers(text)
        assert used <= total == 512, text  # was 'Context: 581 of 512'
        chat = int(re.search(r"chat ([\d,]+)", text).group(1).replace(",", ""))
        assert chat > total  # the chat's own count says it is longer than the context
    finally:
        close_window(w)
        w.close()


def speed_of_status(w) -> str:
    return w.status.speed.text().removesuffix(" tokens/s")


def timing_numbers(caption: str) -> tuple[int, int, str]:
    """'… TTFT 12 ms (8 of 8 prompt tokens computed) · 299 decode tokens at <b>144.3 tok/s</b>' → (8, 299, '144.3')."""
    m = re.search(r"TTFT [\d,]+ ms \(([\d,]+) of [\d,]+ prompt tokens computed\) · ([\d,]+) decode tokens at "
                  r"<b>([\d.]+) tok/s", caption)
    assert m, caption
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_returning_to_a_chat_replying_in_the_background_shows_its_whole_reply(qtbot, data_dir, stories_path):
    """Another chat is opened while a reply runs, then the replying chat again: the timing caption counts the
    whole reply (its prompt and every decode token; it said 'TTFT 0 ms (0 prompt tokens) · 33 decode tokens') and
    its tok/s is the status bar's, during the reply and after it."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=480,
                                                                                ignore_eos=True))
    try:
        apply(qtbot, w, CacheConfig(mode="off"))  # O(n²): slow enough to leave and come back mid-reply
        w.send("Once upon a time")
        replying = w.chat_id
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= 5, timeout=30_000)
        w.new_chat()
        left_at = w.conversation.tokens_in_reply
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= left_at + 40, timeout=30_000)
        w.open_chat(replying)
        assert w.generation_id, "the reply ended before the chat was opened again"
        seen: list[tuple[str, str]] = []

        def agree_while_replying() -> bool:
            caption, status = w.timing.caption.text(), speed_of_status(w)
            if "decode tokens at" in caption and status:
                seen.append((timing_numbers(caption)[2], status))
            return not w.generation_id

        qtbot.waitUntil(agree_while_replying, timeout=120_000)
        wait_reply(qtbot, w, 5000) if w.generation_id else None
        qtbot.wait(300)  # the panels' last frame
        prompt, decode, tps = timing_numbers(w.timing.caption.text())
        stats = w.last_stats
        assert prompt > 0 and decode == stats["generated_tokens"] - 1 == 479
        assert tps == speed_of_status(w) == f"{stats['decode_tokens_per_s']:.1f}"
        assert seen and all(a == b for a, b in seen), seen[:5]
        caption, status = w.timing.caption.text(), w.status.speed.text()
        w.new_chat()
        assert "decode tokens" not in w.timing.caption.text()  # a new chat: no reply's timing
        w.open_chat(replying)  # idle now: its last reply's timing and speed come back with it
        assert w.timing.caption.text() == caption and w.status.speed.text() == status
    finally:
        close_window(w)
        w.close()


def page_size_said(text: str) -> str:
    m = re.search(r"page size (\d+)", text)
    return m.group(1) if m else ""


def test_captions_change_in_the_same_frame_as_the_setting(qtbot, data_dir, stories_path):
    """Page size 16 → 4, idle and mid-reply: at every turn of the event loop the page map's caption says the page
    size the status bar's cache field says (it read 'page size 16' just after the switch to 4), and the occupancy
    caption's tokens cached are the status bar's context used (less the one just generated)."""
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.docks["page_map"].raise_()  # in front of its tab group, as a user looking at it has it
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        qtbot.waitUntil(lambda: page_size_said(w.page_map.caption.text()) == "16", timeout=5000)
        bad: list[tuple[str, str, str]] = []

        def check() -> None:
            status = w.status.cache.text()
            pages = re.search(r"(\d+)-token pages", status).group(1)
            caption = w.page_map.caption.text()
            if page_size_said(caption) != pages:
                bad.append((status, caption, w.status.context.text()))
            cached = re.search(r"(\d+) tokens cached", w.occupancy.caption.text())
            used = context_numbers(w.status.context.text())[0]
            if cached and used - int(cached.group(1)) not in (0, 1):
                bad.append((w.status.context.text(), w.occupancy.caption.text(), ""))

        def settled(size: str):
            def done() -> bool:
                check()
                return page_size_said(w.page_map.caption.text()) == size

            return done

        w.controls.page_size.setValue(4)  # as the user does
        check()
        qtbot.waitUntil(settled("4"), timeout=10_000)
        for _ in range(10):
            qtbot.wait(20)
            check()
        assert not bad, bad[:3]

        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=480, ignore_eos=True)
        w.send("The little dog")
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= 3, timeout=30_000)
        w.controls.page_size.setValue(8)
        check()
        said_mid_reply = False
        while w.generation_id:
            qtbot.wait(15)
            check()
            said_mid_reply = said_mid_reply or bool(w.generation_id and page_size_said(w.page_map.caption.text()) == "8")
        assert w.cache.applied.page_size == 8 and said_mid_reply  # the caption followed before the reply ended
        assert not bad, bad[:3]
    finally:
        close_window(w)
        w.close()
