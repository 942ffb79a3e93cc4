"""``kvscope --self-test``: open the real window (offscreen), load the model, chat in every cache mode, switch
mode in the middle of a reply, check that every panel received data, optionally save a screenshot, and
print a short report. Exit code 0 only if everything worked.

Waiting uses a nested ``QEventLoop`` (never ``processEvents(flags)``, which leaks ``None`` references on
PySide6 6.12 + Python 3.11, see ``app._pyside_fix``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from engine.config import CacheConfig, SamplingConfig

MODES = ("off", "contiguous", "paged")


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


class LatencyProbe:
    """A 10 ms QTimer that records how late each tick runs while ``active()`` is true."""

    def __init__(self, active: Callable[[], bool], interval_ms: int = 10) -> None:
        self.active = active
        self.interval = interval_ms
        self.samples: list[float] = []
        self._last = time.perf_counter()
        self.timer = QTimer()
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.active():
            self.samples.append(max(0.0, (now - self._last) * 1000.0 - self.interval))
        self._last = now

    def p95(self) -> float:
        return float(np.percentile(self.samples, 95)) if self.samples else 0.0

    def stop(self) -> None:
        self.timer.stop()


def run_self_test(app: QApplication, model: str = "demo", screenshot: str | None = None, t0: float | None = None,
                  data_dir: Path | None = None, new_tokens: int = 24, measure_panels: bool = True) -> int:
    from app.history import HistoryStore
    from app.main_window import MainWindow
    from app.settings import Settings

    t0 = time.perf_counter() if t0 is None else t0
    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvscope-selftest-")
        data_dir = Path(tmp.name)
    settings = Settings.from_data_dir(data_dir)
    history = HistoryStore.in_data_dir(data_dir)
    window = MainWindow(settings, history, model=model)
    window.show()
    wait_until(lambda: window.isVisible(), 5)
    visible_ms = (time.perf_counter() - t0) * 1000.0
    errors: list[str] = []
    window.error_shown.connect(errors.append)
    lines = [f"time to visible window: {visible_ms:.0f} ms"]
    ok = True

    def check(cond: bool, what: str) -> bool:
        nonlocal ok
        lines.append(("PASS " if cond else "FAIL ") + what)
        ok = ok and cond
        return cond

    probe = LatencyProbe(lambda: bool(window.generation_id))
    t_load = time.perf_counter()
    window.start()
    if not check(wait_until(lambda: window.info is not None or bool(errors), 300) and window.info is not None,
                 f"load {model}" + (f": {errors[-1]}" if errors else "")):
        return _finish(window, history, tmp, lines, ok, probe, screenshot)
    lines.append(f"model: {window.info.name} on {window.info.device} ({window.info.device_reason}), "
                 f"loaded in {(time.perf_counter() - t_load):.1f} s")
    window.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    def apply(cfg: CacheConfig) -> bool:
        window.controls.set_config(cfg)
        window.apply_cache_config(cfg)
        return wait_until(lambda: window._applied_cache == cfg, 30)

    def reply(text: str, during: Callable[[], None] | None = None, at_token: int = 4) -> dict:
        done: list[str] = []
        window.reply_finished.connect(lambda _g, reason: done.append(reason))
        window.chat.input.setPlainText(text)
        window.chat.submit()
        if during is not None:
            wait_until(lambda: window.conversation.tokens_in_reply >= at_token or bool(done), 120)
            if not done:
                during()
        wait_until(lambda: bool(done), 300)
        window.reply_finished.disconnect()
        return dict(window.last_stats, finished=bool(done), reason=done[0] if done else "timeout")

    for mode in MODES:
        if not check(apply(CacheConfig(mode=mode, page_size=16)), f"apply cache mode {mode}"):
            continue
        before = {p.objectName(): p.updates for p in window.panels}
        r = reply(f"Tell me a story about the {mode} cache.")
        check(r["finished"] and r["reason"] not in ("error", "timeout") and r.get("generated_tokens", 0) > 0,
              f"reply with cache {mode}: {r.get('generated_tokens', 0)} tokens, "
              f"decode {r.get('decode_tokens_per_s', 0):.1f} tok/s, TTFT {r.get('ttft_ms', 0):.0f} ms, "
              f"reused {r.get('reused_tokens', 0)}")

        def updated_panels() -> list[str]:
            return [name for name, n in before.items() if window.panels_by_name()[name].updates > n]

        # The window refreshes every panel with the reply's final state just after the reply ends (a
        # zero-delay timer), so a reply shorter than one round-robin refresh cycle shows there.
        wait_until(lambda: len(updated_panels()) >= 4, 5)
        moved = updated_panels()
        check(len(moved) >= 4, f"panels updated during the {mode} reply ({', '.join(moved) or 'none'})")

    switched: list[str] = []

    def switch() -> None:
        switched.append("yes")
        cfg = CacheConfig(mode="contiguous")
        window.controls.set_config(cfg)
        window.apply_cache_config(cfg)

    # Long enough replies that the switch lands mid-reply even at hundreds of tokens per second; the
    # reply's stats name every mode it ran under ("paged → contiguous"), which proves it did.
    window.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=max(8 * new_tokens, 160),
                                              ignore_eos=True)
    apply(CacheConfig(mode="paged", page_size=16))
    r = reply("Switch the cache while you talk.", during=switch)
    check(bool(switched) and r["finished"] and r["reason"] not in ("error", "timeout")
          and r.get("mode") == "paged → contiguous",
          f"switch paged → contiguous mid-reply: reply finished ({r['reason']}, {r.get('generated_tokens', 0)} "
          f"tokens, cache {r.get('mode')})")
    r = reply("And once more, back to pages.", during=lambda: apply(CacheConfig(mode="paged", page_size=8)))
    check(r["finished"] and r["reason"] not in ("error", "timeout") and r.get("mode") == "contiguous → paged"
          and window._applied_cache.page_size == 8,
          f"switch contiguous → paged (page size 8) mid-reply ({r.get('generated_tokens', 0)} tokens, "
          f"cache {r.get('mode')})")
    window.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    wait_until(lambda: False, 0.2)  # the final refresh
    p = window
    check(p.occupancy.updates > 0 and int(sum(v.sum() for v in p.occupancy.stack.values())) > 0, "occupancy panel has bars")
    check(p.page_map.updates > 0 and p.page_map.grid.size > 0 and bool((p.page_map.grid > 0).any()),
          "page map panel has pages")
    check(p.timing.updates > 0 and len(p.timing.curves()["latency"][1]) > 0, "timing panel has curves")
    check(p.memory.updates > 0 and p.memory.n > 0, "memory panel has points")
    check(p.model_card.updates > 0 and p.model_card.info is not None, "model card filled")
    check(len(p.trace) > 0, f"cache trace recorded ({len(p.trace)} snapshots)")
    lines.append(f"event-loop latency while streaming: p95 {probe.p95():.1f} ms over {len(probe.samples)} ticks")

    # Tools ▸ Compare cache settings: the same reply under each setting; the lossless ones are identical.
    window.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    dialog = window.open_compare()
    done = dialog is not None and wait_until(lambda: bool(dialog.finished_reason), 120)
    rows = dialog.rows if dialog is not None else []
    lossless = [r for r in rows if r.get("label") in ("paged (reference)", "contiguous", "cache off")]
    check(done and dialog.finished_reason == "done" and len(rows) == 5 and len(lossless) == 3
          and all(r["same_tokens"] == r["generated_tokens"] == new_tokens for r in lossless),
          "compare cache settings: " + ", ".join(f"{r.get('label')} {r.get('same_tokens')}/{r.get('generated_tokens')}"
                                                 for r in rows))
    if dialog is not None:
        dialog.close()

    if measure_panels:
        # Three alternating pairs of longer replies; medians, since other jobs on a shared CPU add noise.
        window.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=max(4 * new_tokens, 96),
                                                  ignore_eos=True)
        speeds: dict[bool, list[float]] = {True: [], False: []}
        share: list[float] = []
        for on in (False, True) * 3:
            window.set_panels_enabled(on)
            window.new_chat()  # short prompts: every sample measures the same work
            spent0, t_reply = window.panel_seconds, time.perf_counter()
            r = reply("Measure the panels.")
            if on:
                share.append((window.panel_seconds - spent0) / max(time.perf_counter() - t_reply, 1e-9))
            if r.get("decode_tokens_per_s"):
                speeds[on].append(r["decode_tokens_per_s"])
        window.set_panels_enabled(True)
        if speeds[True] and speeds[False]:
            on_s, off_s = float(np.median(speeds[True])), float(np.median(speeds[False]))
            lines.append(f"decode tok/s with panels off {off_s:.1f}, on {on_s:.1f} "
                         f"({100.0 * (on_s - off_s) / off_s:+.1f}%, medians of 3; panels took "
                         f"{100.0 * float(np.median(share)):.1f}% of the GUI thread)")
    return _finish(window, history, tmp, lines, ok, probe, screenshot)


def _finish(window, history, tmp, lines: list[str], ok: bool, probe: LatencyProbe, screenshot: str | None) -> int:
    probe.stop()
    if screenshot:
        wait_until(lambda: False, 0.2)
        saved = window.grab().save(str(screenshot), "PNG")
        lines.append(("PASS " if saved else "FAIL ") + f"screenshot {screenshot}")
        ok = ok and saved
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
