"""#31 item 3's measure: decode tok/s of a reply with a 100 KB message on screen ÷ the same reply without it, and the
longest GUI-thread stall while it streams. Not a test (timings are never asserted); run it and read it:

    QT_QPA_PLATFORM=offscreen python tests/app/measure_big_text.py [--rounds 4] [--tokens 200]

The real window on stories260K, greedy, "Drop the middle": two chats whose first message is longer than the context
— 100 KB, and 3 KB — so the engine reads the same number of tokens for both (the context, the middle dropped) and
only what is on screen differs. Each round regenerates each chat's reply in turn: the 100 KB chat with its message
collapsed (as it opens) and expanded (Show all: every piece laid out), the 3 KB chat (the baseline), and the 100 KB
chat's reply with another chat on screen (nothing drawn). A 10 ms timer's lateness while tokens stream is the GUI
thread's stall.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import app  # noqa: E402,F401 - the PySide6 fix first
from PySide6.QtWidgets import QApplication  # noqa: E402

BIG = "The little dog ran to the park and played with a big red ball. " * 1560 + "The very last words."


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=200)
    a = p.parse_args()
    qa = QApplication.instance() or QApplication([])
    from app.history.store import HistoryStore
    from app.selftest.quiet import LatencyProbe, QuietOffscreen
    from app.selftest.run import wait_until
    from app.settings.store import Settings
    from app.ground.theme import apply_theme
    from app.shell.window import MainWindow
    from engine.config import CacheConfig, SamplingConfig

    apply_theme(qa)
    data = Path(tempfile.mkdtemp(prefix="kvscope-bigtext-"))
    with QuietOffscreen():
        w = MainWindow(Settings.from_data_dir(data), HistoryStore.in_data_dir(data), model="stories260K")
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=a.tokens, ignore_eos=True)
        w.show()
        w.resize(1280, 720)
        w.start()
        wait_until(lambda: w.info is not None, 120)
        w.apply_cache_config(CacheConfig(overflow="truncate_middle"))
        wait_until(lambda: w.cache.applied.overflow == "truncate_middle", 10)
        chats = {}
        for name, text in (("3 KB", BIG[:3000]), ("100 KB", BIG)):
            w.new_chat()
            w.send(text)
            wait_until(lambda: w.generation_id == 0 and len(w.history.messages(w.chat_id)) == 2, 300)
            chats[name] = w.chat_id
        runs = ("100 KB collapsed", "100 KB expanded", "3 KB", "off screen")
        speeds: dict[str, list[float]] = {r: [] for r in runs}
        stalls = dict.fromkeys(runs, 0.0)
        for _ in range(a.rounds):
            for run in runs:
                chat = chats["3 KB" if run == "3 KB" else "100 KB"]
                w.open_chat(chat)
                wait_until(lambda: False, 0.3)
                if run.startswith("100 KB"):
                    body = next(b for b in w.chat.bubbles if b.role == "user").body
                    if body.expanded != (run == "100 KB expanded"):
                        body.toggle.click()
                    wait_until(lambda: not body.pending, 30)
                probe = LatencyProbe(lambda: w.conversation.running is not None and w.conversation.running.tokens > 0)
                w.conversation.regenerate()
                if run == "off screen":
                    w.open_chat(chats["3 KB"])  # the reply goes on in the background
                wait_until(lambda: w.conversation.running is None, 300)
                probe.stop()
                speeds[run].append(float(w.history.messages(chat)[-1].stats.get("decode_tokens_per_s") or 0))
                stalls[run] = max(stalls[run], max(probe.samples, default=0.0))
        w.shutdown()
    base = statistics.median(speeds["3 KB"])
    for run in runs:
        m = statistics.median(speeds[run])
        print(f"{run:>17}: decode median {m:6.1f} tok/s (÷ 3 KB {m / base:.2f}) of {[round(x) for x in speeds[run]]}; "
              f"longest stall while it streamed {stalls[run]:.0f} ms")


if __name__ == "__main__":
    main()
