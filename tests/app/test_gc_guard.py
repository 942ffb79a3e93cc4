"""Cyclic garbage is collected on the GUI thread only while a window is open (app/shell/gc_guard.py)."""

from __future__ import annotations

import gc
import threading
import weakref

from app_helpers import close_window, open_window

from app.shell.gc_guard import MainThreadGC


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_worker_thread_never_collects_and_the_gui_tick_does(qtbot, data_dir):
    users = MainThreadGC._users  # windows other tests left open (normally none)
    window = open_window(qtbot, data_dir, "demo")
    try:
        assert not gc.isenabled() and MainThreadGC.active()
        # Allocations on another thread far past the gen-0 threshold start no collection there.
        freed_on_thread: list[int] = []

        def churn() -> None:
            before = gc.get_stats()[0]["collections"]
            junk = [_Node() for _ in range(20 * gc.get_threshold()[0])]
            del junk
            freed_on_thread.append(gc.get_stats()[0]["collections"] - before)

        t = threading.Thread(target=churn)
        t.start()
        t.join()
        assert freed_on_thread == [0]
        # The GUI thread's timer collects them within a few ticks.
        probe = _Node()
        ref = weakref.ref(probe)
        del probe
        qtbot.waitUntil(lambda: ref() is None, timeout=5000)
    finally:
        close_window(window)
    assert MainThreadGC._users == users and gc.isenabled() == (users == 0)


def test_check_runs_python_own_generations(qtbot):
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        assert MainThreadGC.check() == 0  # nothing allocated since: below the gen-0 threshold
        nodes = [_Node() for _ in range(gc.get_threshold()[0] + 10)]
        refs = [weakref.ref(n) for n in nodes[:5]]
        del nodes
        assert MainThreadGC.check() >= 5
        assert all(r() is None for r in refs)
    finally:
        if was:
            gc.enable()
