"""CPU threads per model: one for small models, the idle cores for large ones, the user's variable wins."""

from __future__ import annotations

import os

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
    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 0.0, 0.0))
    assert threads.choose(135_000_000, "cpu") == (5, "5 of 8 cores (load 2.6)")
    monkeypatch.setattr(os, "getloadavg", lambda: (30.0, 0.0, 0.0))
    assert threads.choose(135_000_000, "cpu")[0] == 1  # a saturated machine: one thread, never zero
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert threads.choose(135_000_000, "cpu")[0] == 8


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
