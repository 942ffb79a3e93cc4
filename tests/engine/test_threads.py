"""CPU threads per model: one for small models, the idle cores for large ones (other programs' work measured
without this process's), the user's variable wins."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

from engine.model import threads
from engine.config import SamplingConfig
from engine.core.session import ChatSession


def test_small_models_run_on_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("KVSCOPE_THREADS", raising=False)
    n, why = threads.choose(260_032, "cpu")
    assert n == 1 and "under 50M" in why


def test_large_models_take_the_idle_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("KVSCOPE_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 8)
    monkeypatch.setattr(threads, "busy_elsewhere", lambda since=None: 2.6)
    assert threads.choose(135_000_000, "cpu") == (5, "5 of 8 cores (2.6 cores busy with other programs as it loaded)")
    monkeypatch.setattr(threads, "busy_elsewhere", lambda since=None: 30.0)
    assert threads.choose(135_000_000, "cpu")[0] == 1  # a saturated machine: one thread, never zero
    monkeypatch.setattr(threads, "busy_elsewhere", lambda since=None: 0.0)
    assert threads.choose(135_000_000, "cpu") == (8, "8 of 8 cores (none busy with other programs as it loaded)")
    # no CPU counters: the load average, said as such
    monkeypatch.setattr(threads, "busy_elsewhere", lambda since=None: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 0.0, 0.0))
    assert threads.choose(135_000_000, "cpu") == (5, "5 of 8 cores (load 2.6)")


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_other_programs_count_and_this_process_does_not():
    """The idle cores are measured without this process's own work (a load, a reply just before it): the load
    average counted it, and a 2-core machine's second load in a minute took one thread. A normal-priority program
    busy beside it counts; a niced one, which yields to the model, does not."""
    base = threads.busy_elsewhere(window=0.4)
    assert base is not None and base >= 0.0
    since = threads.sample()
    workers = [threading.Thread(target=_spin, args=(0.4,)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert threads.busy_elsewhere(since) < base + 0.4  # two of our own threads spun the whole window

    def other(nice: int) -> float:
        code = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"
        child = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", code])
        try:
            time.sleep(0.5)  # started and spinning
            return threads.busy_elsewhere(window=0.5)
        finally:
            child.kill()
            child.wait()

    assert other(0) >= base + 0.4  # another program on a core of its own
    assert other(15) < base + 0.4  # a niced one: it yields to the model's threads


def test_a_short_load_is_read_over_a_tenth_of_a_second():
    """The counters tick every 10 ms: a load over in 20 ms would read one tick of another program as half a core
    busy. The window is stretched to 0.1 s before it is read, and the figure is over the whole of it."""
    since = threads.sample()
    start = time.monotonic()
    assert threads.busy_elsewhere(since) is not None
    assert time.monotonic() - since.at >= 0.1 and time.monotonic() - start >= 0.09
    _spin(0.15)  # a load longer than the window waits no more
    start = time.monotonic()
    threads.busy_elsewhere(since)
    assert time.monotonic() - start < 0.08


def test_the_users_variable_wins(monkeypatch):
    monkeypatch.setenv("KVSCOPE_THREADS", "3")
    assert threads.choose(260_032, "cpu") == (3, "3 (KVSCOPE_THREADS)")
    monkeypatch.delenv("KVSCOPE_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose(7_000_000_000, "cpu")[0] == 2


def test_a_reply_runs_with_its_models_threads(stories):
    """Another model (or anyone) changing torch's threads does not stick to this model's next reply."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        s = ChatSession(stories)
        s.start_completion("Once", SamplingConfig(max_new_tokens=3))
        while not (r := s.step()).done:
            pass
        assert torch.get_num_threads() == stories.info.threads and r.stats.threads == stories.info.threads
        assert stories.info.threads_reason
    finally:
        torch.set_num_threads(old)
