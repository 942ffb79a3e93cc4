"""``kvscope --self-test``: open the real window (offscreen), load the model, chat in every cache mode, switch
mode, eviction policy and KV precision in the middle of replies, check that every panel received data,
compare the cache settings, check a speculative reply (prompt lookup) against the plain one, optionally save
a screenshot, and print a short report. Exit code 0 only if every check passed.

Waiting uses a nested ``QEventLoop`` (never ``processEvents(flags)``, which leaks ``None`` references on
PySide6 6.12 + Python 3.11, see ``app._pyside_fix``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from app.selftest.quiet import LatencyProbe, QuietOffscreen
from app.selftest.spec import check_speculative_reply
from app.selftest.readouts import check_captions, check_context, check_wait
from engine.config import CacheConfig, SamplingConfig

MODES = ("off", "contiguous", "paged")
# Mid-reply eviction switches, none → streaming → h2o → priority → none. Budgets far below the chat's
# length, so each policy really evicts (and going back to none restores what they dropped).
PAGED = dict(mode="paged", page_size=8)
EVICTION_SWITCHES = (
    CacheConfig(**PAGED, policy="streaming", policy_params={"sinks": 4, "window": 20}),
    CacheConfig(**PAGED, policy="h2o", policy_params={"budget": 32, "recent": 8}),
    CacheConfig(**PAGED, policy="priority", policy_params={"budget": 32, "recent": 8}),
    CacheConfig(**PAGED),
)
PRECISION_SWITCHES = (  # KV auto → int8 → int4 → auto
    CacheConfig(mode="paged", page_size=16, k_dtype="int8", v_dtype="int8"),
    CacheConfig(mode="paged", page_size=16, k_dtype="int4", v_dtype="int4"),
    CacheConfig(mode="paged", page_size=16),
)
SWITCH_EVERY = 16  # tokens between two mid-reply switches, and after the last one before Stop
SHOT_SIZES = ((1280, 720), (1920, 1080))  # --screenshot: a laptop and a desktop screen
SWITCH_REPLY = 400  # at most: room for every switch to land mid-reply even at GPU speed (Stop ends it earlier)


def wait_until(cond: Callable[[], bool], timeout_s: float, step_ms: int = 10) -> bool:
    """Run the event loop until ``cond()`` or the timeout. Returns ``cond()``."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        loop = QEventLoop()
        QTimer.singleShot(step_ms, loop.quit)
        loop.exec()
    return True


class SelfTest:
    """Drives the window the way a user does and records PASS/FAIL lines."""

    def __init__(self, window, new_tokens: int) -> None:
        self.window = window
        self.new_tokens = new_tokens
        self.lines: list[str] = []
        self.ok = True

    def check(self, cond: bool, what: str) -> bool:
        self.lines.append(("PASS " if cond else "FAIL ") + what)
        self.ok = self.ok and bool(cond)
        return bool(cond)

    def sampling(self, tokens: int) -> None:
        self.window.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)

    def apply(self, cfg: CacheConfig) -> bool:
        """Apply ``cfg`` as the controls do; True once the worker confirmed it."""
        self.window.controls.set_config(cfg)
        self.window.apply_cache_config(cfg)
        return wait_until(lambda: self.window.cache.applied == cfg, 30)

    def _send(self, text: str) -> int:
        """Send ``text``; the reply's generation id once it started, 0 if it was not sent (a message that would
        leave too little of the context is held back while its tokens are counted, and then warned about)."""
        w = self.window
        before = w.generation_id
        w.chat.input.setPlainText(text)
        w.chat.submit()
        wait_until(lambda: w.generation_id not in (0, before), 10)
        gen = w.generation_id
        return gen if gen not in (0, before) else 0

    def reply(self, text: str, during: Callable[[], None] | None = None, at_token: int = 4) -> dict:
        """Send ``text`` and wait for the reply; ``during()`` runs once ``at_token`` tokens streamed."""
        w, done = self.window, []
        gen = self._send(text)
        if not gen:  # the chat leaves too little of the context for a reply (a small model): a new chat
            w.new_chat()
            gen = self._send(text)
        if not gen:
            return dict(w.last_stats or {}, finished=False, reason="not sent")
        w.reply_finished.connect(lambda g, reason: done.append(reason) if g == gen else None)
        if during is not None:
            wait_until(lambda: w.conversation.tokens_in_reply >= at_token or bool(done), 120)
            if not done:
                during()
        wait_until(lambda: bool(done), 300)
        w.reply_finished.disconnect()
        return dict(w.last_stats, finished=bool(done), reason=done[0] if done else "timeout")

    def reply_switching(self, text: str, configs: Sequence[CacheConfig]) -> tuple[dict, int]:
        """A reply during which each of ``configs`` is applied, ``SWITCH_EVERY`` tokens apart, then stopped
        ``SWITCH_EVERY`` tokens after the last (what follows would only repeat the last setting). Returns
        the reply's stats and how many switches landed while it streamed."""
        w, landed = self.window, []

        def streamed(n: int) -> bool:
            return wait_until(lambda: w.conversation.tokens_in_reply >= n or not w.generation_id, 120)

        def switch() -> None:
            for i, cfg in enumerate(configs):
                streamed((i + 1) * SWITCH_EVERY)
                if not w.generation_id or not self.apply(cfg) or not w.generation_id:
                    return
                landed.append(cfg)
            streamed(w.conversation.tokens_in_reply + SWITCH_EVERY)
            w.stop()

        return self.reply(text, during=switch, at_token=1), len(landed)

    def finished_well(self, r: dict) -> bool:
        return r["finished"] and r["reason"] not in ("error", "timeout") and not r.get("error")

    def next_turn(self, after: str, cfg: CacheConfig) -> None:
        """The chat goes on after ``after``: a normal reply of ``new_tokens`` under ``cfg`` (the last
        switch's setting, applied again in case a failed reply stopped the switches short)."""
        self.apply(cfg)
        self.sampling(self.new_tokens)
        r = self.reply("And then?")
        self.check(self.finished_well(r) and r.get("generated_tokens") == self.new_tokens,
                   f"next turn after {after}: {r['reason']}, {r.get('generated_tokens', 0)} tokens"
                   + (f" ({r['error']})" if r.get("error") else ""))


def run_self_test(app: QApplication, model: str = "demo", screenshot: str | None = None, t0: float | None = None,
                  data_dir: Path | None = None, new_tokens: int = 24, measure_panels: bool = True) -> int:
    """Run every check on a fresh window; print the report; 0 if all passed, 1 otherwise."""
    with QuietOffscreen():  # the offscreen platform's size-hint warnings, once per window shown, say nothing
        return _run(app, model, screenshot, time.perf_counter() if t0 is None else t0, data_dir, new_tokens,
                    measure_panels)


def _run(app, model, screenshot, t0, data_dir, new_tokens, measure_panels) -> int:
    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.settings.store import Settings

    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvscope-selftest-")
        data_dir = Path(tmp.name)
    history = HistoryStore.in_data_dir(data_dir)
    window = MainWindow(Settings.from_data_dir(data_dir), history, model=model)
    window.show()
    wait_until(lambda: window.isVisible(), 5)
    t = SelfTest(window, new_tokens)
    t.lines.append(f"time to visible window: {(time.perf_counter() - t0) * 1000.0:.0f} ms")
    errors: list[str] = []
    window.error_shown.connect(errors.append)
    probe = LatencyProbe(lambda: bool(window.generation_id))
    t_load = time.perf_counter()
    window.start()
    loaded = wait_until(lambda: window.info is not None or bool(errors), 300) and window.info is not None
    if t.check(loaded, f"load {model}" + (f": {errors[-1]}" if errors else "")):
        t.lines.append(f"model: {window.info.name} on {window.info.device} ({window.info.device_reason}), "
                       f"loaded in {(time.perf_counter() - t_load):.1f} s")
        _notice(t)
        _modes(t)
        _mode_switches(t)
        _panels(t, probe)
        _eviction_switches(t)
        _precision_switches(t)
        _compare(t)
        check_speculative_reply(t, wait_until)
        check_context(t, wait_until)
        check_wait(t, wait_until)
        check_captions(t, wait_until)
        if measure_panels:
            _measure_panels(t)
    return _finish(window, history, tmp, t.lines, t.ok, probe, screenshot)


def _notice(t: SelfTest) -> None:
    """A real notice ("No cache trace yet", before any reply) spans the message area and wraps, × in its
    top-right corner (it once wrapped a word a line in a column ~150 px wide)."""
    w = t.window
    w.exporter.export_trace("json")
    n = w.chat.notice
    wait_until(lambda: n.isVisible() and n.width() == w.chat.scroll.width(), 2)
    inner = n.contentsRect().marginsRemoved(n.layout().contentsMargins())
    close = n.close_button.geometry()
    t.check(n.width() == w.chat.scroll.width() and (close.right(), close.top()) == (inner.right(), inner.top())
            and n.label.width() + close.width() + n.layout().horizontalSpacing() == inner.width(),
            f"notice spans the message area ({n.width()} of {w.chat.scroll.width()} px, text {n.label.width()} px), "
            "× in its top-right corner")
    n.clear()


def _modes(t: SelfTest) -> None:
    """A reply in every cache mode; every live panel moves during each."""
    w = t.window
    t.sampling(t.new_tokens)
    for mode in MODES:
        if not t.check(t.apply(CacheConfig(mode=mode, page_size=16)), f"apply cache mode {mode}"):
            continue
        before = {p.objectName(): p.updates for p in w.panels}
        r = t.reply(f"Tell me a story about the {mode} cache.")
        t.check(t.finished_well(r) and r.get("generated_tokens", 0) > 0,
                f"reply with cache {mode}: {r.get('generated_tokens', 0)} tokens, "
                f"decode {r.get('decode_tokens_per_s', 0):.1f} tok/s, TTFT {r.get('ttft_ms', 0):.0f} ms, "
                f"reused {r.get('reused_tokens', 0)}")

        def updated_panels() -> list[str]:
            return [name for name, n in before.items() if w.panels_by_name()[name].updates > n]

        # The window refreshes every panel with the reply's final state just after the reply ends (a
        # zero-delay timer), so a reply shorter than one round-robin refresh cycle shows there.
        wait_until(lambda: len(updated_panels()) >= 4, 5)
        moved = updated_panels()
        t.check(len(moved) >= 4, f"panels updated during the {mode} reply ({', '.join(moved) or 'none'})")


def _mode_switches(t: SelfTest) -> None:
    """Cache mode and page size switched mid-reply: the reply's stats name every mode it ran under."""
    w = t.window
    # Long enough replies that the switch lands mid-reply even at hundreds of tokens per second.
    t.sampling(max(8 * t.new_tokens, 160))
    t.apply(CacheConfig(mode="paged", page_size=16))
    r = t.reply("Switch the cache while you talk.", during=lambda: t.apply(CacheConfig(mode="contiguous")))
    t.check(t.finished_well(r) and r.get("mode") == "paged → contiguous",
            f"switch paged → contiguous mid-reply: reply finished ({r['reason']}, {r.get('generated_tokens', 0)} "
            f"tokens, cache {r.get('mode')})")
    r = t.reply("And once more, back to pages.", during=lambda: t.apply(CacheConfig(mode="paged", page_size=8)))
    t.check(t.finished_well(r) and r.get("mode") == "contiguous → paged" and w.cache.applied.page_size == 8,
            f"switch contiguous → paged (page size 8) mid-reply ({r.get('generated_tokens', 0)} tokens, "
            f"cache {r.get('mode')})")


def _panels(t: SelfTest, probe: LatencyProbe) -> None:
    wait_until(lambda: False, 0.2)  # the final refresh
    p = t.window
    t.check(p.occupancy.updates > 0 and int(sum(v.sum() for v in p.occupancy.stack.values())) > 0,
            "occupancy panel has bars")
    t.check(p.page_map.updates > 0 and p.page_map.grid.size > 0 and bool((p.page_map.grid > 0).any()),
            "page map panel has pages")
    t.check(p.timing.updates > 0 and len(p.timing.curves()["latency"][1]) > 0, "timing panel has curves")
    t.check(p.memory.updates > 0 and p.memory.n > 0, "memory panel has points")
    t.check(p.model_card.updates > 0 and p.model_card.info is not None, "model card filled")
    t.check(len(p.trace) > 0, f"cache trace recorded ({len(p.trace)} snapshots)")
    t.lines.append(f"event-loop latency while streaming: p95 {probe.p95():.1f} ms over {len(probe.samples)} ticks; "
                   f"between replies: p95 {probe.p95(idle=True):.1f} ms over {len(probe.idle)} ticks")


def _eviction_switches(t: SelfTest) -> None:
    """Policy none → streaming → h2o → priority → none within one reply, in a new chat: each policy holds
    fewer tokens than the chat has, and back at none every token is held again; the next turn works."""
    w = t.window
    w.new_chat()
    t.apply(CacheConfig(**PAGED))
    t.sampling(SWITCH_REPLY)
    r, landed = t.reply_switching("Switch the eviction policy while you talk.", EVICTION_SWITCHES)
    snaps = list(w.trace.snapshots)

    def held(s) -> int:
        return int(np.max(s.tokens_per_layer, initial=0))

    evicted = [p for p in ("streaming", "h2o", "priority") if any(s.policy == p and held(s) < s.seq_len - 1
                                                                    for s in snaps)]
    restored = bool(snaps) and snaps[-1].policy == "none" and held(snaps[-1]) >= snaps[-1].seq_len - 1
    t.check(t.finished_well(r) and landed == len(EVICTION_SWITCHES) and len(evicted) == 3 and restored,
            f"eviction none → streaming → h2o → priority → none mid-reply: {r['reason']}, "
            f"{r.get('generated_tokens', 0)} tokens, {landed}/4 switches landed, evicted under "
            f"{', '.join(evicted) or 'none'}, {'all' if restored else 'not all'} tokens held again"
            + (f" ({r['error']})" if r.get("error") else ""))
    t.next_turn("the eviction switches", EVICTION_SWITCHES[-1])


def _precision_switches(t: SelfTest) -> None:
    """KV auto → int8 → int4 → auto within one reply; the cache really changes precision each time."""
    w = t.window
    w.new_chat()
    t.apply(CacheConfig(mode="paged", page_size=16))
    t.sampling(SWITCH_REPLY)
    r, landed = t.reply_switching("Switch the KV precision while you talk.", PRECISION_SWITCHES)
    seen = [s.k_dtype for s in w.trace.snapshots]
    order = [d for i, d in enumerate(seen) if i == 0 or d != seen[i - 1]]
    t.check(t.finished_well(r) and landed == len(PRECISION_SWITCHES) and order == ["auto", "int8", "int4", "auto"],
            f"KV precision auto → int8 → int4 → auto mid-reply: {r['reason']}, {r.get('generated_tokens', 0)} "
            f"tokens, {landed}/3 switches landed, cache held {' → '.join(order)}"
            + (f" ({r['error']})" if r.get("error") else ""))
    t.next_turn("the precision switches", PRECISION_SWITCHES[-1])


def _compare(t: SelfTest) -> None:
    """Tools ▸ Compare cache settings: the same reply under each setting; the lossless ones are identical."""
    t.sampling(t.new_tokens)
    dialog = t.window.open_compare()
    done = dialog is not None and wait_until(lambda: bool(dialog.finished_reason), 120)
    rows = dialog.rows if dialog is not None else []
    exact = ("paged (reference)", "paged, speculative (prompt lookup)", "contiguous", "cache off")  # greedy: identical
    lossless = [r for r in rows if r.get("label") in exact]
    t.check(done and dialog.finished_reason == "done" and len(rows) == 6 and len(lossless) == len(exact)
            and all(r["same_tokens"] == r["generated_tokens"] == t.new_tokens for r in lossless),
            "compare cache settings: " + ", ".join(f"{r.get('label')} {r.get('same_tokens')}/"
                                                   f"{r.get('generated_tokens')}" for r in rows))
    if dialog is not None:
        dialog.close()


def _measure_panels(t: SelfTest) -> None:
    """Decode speed with the live panels off and on: three alternating pairs of longer replies; medians,
    since other jobs on a shared CPU add noise."""
    w = t.window
    t.sampling(max(4 * t.new_tokens, 96))
    speeds: dict[bool, list[float]] = {True: [], False: []}
    share: list[float] = []
    for on in (False, True) * 3:
        w.set_panels_enabled(on)
        w.new_chat()  # short prompts: every sample measures the same work
        spent0, t_reply = w.panel_seconds, time.perf_counter()
        r = t.reply("Measure the panels.")
        if on:
            share.append((w.panel_seconds - spent0) / max(time.perf_counter() - t_reply, 1e-9))
        if r.get("decode_tokens_per_s"):
            speeds[on].append(r["decode_tokens_per_s"])
    w.set_panels_enabled(True)
    if speeds[True] and speeds[False]:
        on_s, off_s = float(np.median(speeds[True])), float(np.median(speeds[False]))
        t.lines.append(f"decode tok/s with panels off {off_s:.1f}, on {on_s:.1f} "
                       f"({100.0 * (on_s - off_s) / off_s:+.1f}%, medians of 3; panels took "
                       f"{100.0 * float(np.median(share)):.1f}% of the GUI thread)")


def screenshot_paths(screenshot: str) -> list[tuple[tuple[int, int], Path]]:
    """FILE at 1280×720 (a laptop), and FILE with "-1920x1080" before its suffix at 1920×1080."""
    path = Path(screenshot)
    return [(SHOT_SIZES[0], path)] + [((w, h), path.with_name(f"{path.stem}-{w}x{h}{path.suffix or '.png'}"))
                                      for w, h in SHOT_SIZES[1:]]


def _screenshots(window, screenshot: str, lines: list[str]) -> bool:
    """The window at each of ``SHOT_SIZES``, after its docks settled at that size."""
    ok = True
    for (w, h), path in screenshot_paths(screenshot):
        window.resize(w, h)
        wait_until(lambda: False, 0.6)  # the dock layout refits 150 ms after the size settles
        size = (window.width(), window.height())
        saved = window.grab().save(str(path), "PNG")
        lines.append(("PASS " if saved and size == (w, h) else "FAIL ") + f"screenshot {path} at {size[0]}×{size[1]}")
        ok = ok and saved and size == (w, h)
    return ok


def _finish(window, history, tmp, lines: list[str], ok: bool, probe: LatencyProbe, screenshot: str | None) -> int:
    probe.stop()
    if screenshot:
        ok = _screenshots(window, screenshot, lines) and ok
    t = time.perf_counter()
    joined = window.shutdown()
    lines.append(("PASS " if joined else "FAIL ") + f"worker joined in {(time.perf_counter() - t) * 1000:.0f} ms")
    ok = ok and joined
    window.close()
    history.close()
    if tmp is not None:
        tmp.cleanup()
    print("kvscope self-test: " + ("OK" if ok else "FAILED"))
    for line in lines:
        print("  " + line)
    return 0 if ok else 1
