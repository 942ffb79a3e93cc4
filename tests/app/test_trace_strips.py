"""The open chat's cache trace keeps each step's token strip run-length encoded (#20 item 18).

Every step's snapshot carries the token strip, one entry per token of the chat; the trace keeps up to
20,000 steps, so a long StreamingLLM chat's trace grew with steps x tokens (2.4 GB at 120k tokens). The
strips are fed here from a real StreamingLLM session on stories260K and must come back exactly.
"""

from __future__ import annotations

import json

import numpy as np

from app.panels.trace import CacheTrace, strip_from_runs, strip_runs
from engine.config import CacheConfig, SamplingConfig
from engine.policies.base import config_from_flags
from engine.core.session import ChatSession
from engine.snapshot import TOKEN_EVICTED, TOKEN_KEPT, TOKEN_SINK

STREAMING = config_from_flags(policy="streaming", flags={"sinks": 4, "window": 40}, mode="paged", page_size=16)


def _snapshots(lm, tokens: int):
    s = ChatSession(lm, STREAMING)
    try:
        s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=tokens, ignore_eos=True))
        for _ in range(tokens + 20):  # bounded: one step per token plus the prefill's
            r = s.step()
            if r.snapshot is not None:
                yield r.snapshot
            if r.done:
                return
    finally:
        s.close()


def test_strips_come_back_exactly_and_stay_a_few_runs(stories, tmp_path):
    trace = CacheTrace()
    snaps = []
    for snap in _snapshots(stories, 300):
        if not trace.generation_ids or trace.generation_ids[-1] != snap.generation_id:
            trace.begin(snap.generation_id)
        trace.add(snap)
        snaps.append(snap)
    assert len(trace) == len(snaps) == 300  # one per token (the prompt is one prefill chunk)
    for i, snap in enumerate(snaps):
        assert np.array_equal(trace.strip(i), snap.token_state)
        assert len(trace.snapshots[i].token_state) == 0 and trace.snapshots[i].seq_len == snap.seq_len
    last = snaps[-1]
    assert len(last.token_state) > 300 and set(np.unique(last.token_state)) >= {TOKEN_SINK, TOKEN_EVICTED, TOKEN_KEPT}
    assert max(len(r) for r in trace.strips) <= 5  # sinks, evicted middle, kept window (+ a quantized / pinned run)
    path = tmp_path / "trace.json"
    trace.write_json(path)
    data = json.loads(path.read_text())
    exported = data["snapshots"][-1]
    assert "token_state" not in exported
    assert np.array_equal(strip_from_runs(np.array(exported["token_state_runs"])), last.token_state)


def test_runs_of_edge_cases_and_the_cap_keeps_strips_with_their_steps():
    for states in ([], [2], [1, 1, 1], [0, 1, 1, 0, 0, 2]):
        a = np.array(states, dtype=np.int8)
        assert np.array_equal(strip_from_runs(strip_runs(a)), a)
    assert strip_runs(np.array([3, 3, 1], dtype=np.int8)).tolist() == [[3, 2], [1, 1]]
    from app_helpers import make_snapshot

    trace = CacheTrace(limit=20)
    trace.begin(1)
    for step in range(45):
        trace.add(make_snapshot(generation_id=1, step=step, token_state=np.full(step + 1, 1, dtype=np.int8)))
    assert len(trace.snapshots) == len(trace.strips) <= 20
    for i, snap in enumerate(trace.snapshots):  # each strip still belongs to its own step
        assert len(trace.strip(i)) == snap.step + 1
