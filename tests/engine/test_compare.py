"""engine.tools.compare: the same reply under each cache setting, lossless ones identical to the reference."""

from __future__ import annotations

import threading

from engine.tools.compare import DEFAULT_SETTINGS, compare_settings
from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession

MSGS = [{"role": "user", "content": "Tell me a story about a dog."}]


def test_lossless_settings_match_the_reference_and_rows_report_the_cache(stories):
    seen = []
    rows = compare_settings(stories, MSGS, SamplingConfig(temperature=0.9, max_new_tokens=60, ignore_eos=True),
                            on_row=seen.append)
    assert [r.label for r in rows] == [setting[0] for setting in DEFAULT_SETTINGS] and seen == rows
    ref, spec, contiguous, int8, int4, off = rows
    # greedy whatever the form says: the reference is the model's greedy reply, as a plain session gives it
    s = ChatSession(stories, CacheConfig(mode="paged"))
    s.start(MSGS, SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True))
    while not s.step().done:
        pass
    assert ref.generated_tokens == 60 and ref.same_tokens == 60 and s.generated_ids and not ref.error
    s.close()
    for lossless in (spec, contiguous, off):
        assert lossless.same_tokens == lossless.generated_tokens == 60
    assert spec.speculative == "ngram" and spec.tokens_per_forward >= 1.0 and ref.speculative == ""
    assert spec.tokens_per_forward == round(60 / (60 - spec.accepted_draft_tokens), 3)
    assert off.kv_bytes == 0 < int8.kv_bytes < ref.kv_bytes
    assert int4.kv_bytes < int8.kv_bytes and 0 <= int4.same_tokens <= 60
    assert all(r.prompt_tokens == ref.prompt_tokens > 0 and r.ttft_ms > 0 and r.decode_tokens_per_s > 0 for r in rows)


def test_a_failing_setting_is_a_row_and_cancel_stops(stories):
    long_chat = [{"role": "user", "content": "word " * 600}]  # longer than stories260K's 512-token context
    rows = compare_settings(stories, long_chat, SamplingConfig(max_new_tokens=4),
                            settings=[("paged", CacheConfig(mode="paged"))])
    assert rows[0].error and "context" in rows[0].error
    cancel = threading.Event()
    rows = compare_settings(stories, MSGS, SamplingConfig(max_new_tokens=40, ignore_eos=True),
                            on_row=lambda r: cancel.set(), cancel=cancel)
    assert len(rows) == 1  # the first row finished, then the comparison stopped


def test_a_comparison_runs_one_forward_per_step_and_matches_compare_settings(stories, monkeypatch):
    from engine.tools.compare import Comparison

    settings = [("paged", CacheConfig(mode="paged")), ("contiguous", CacheConfig(mode="contiguous"))]
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    calls = []
    forward = stories.model.forward
    monkeypatch.setattr(stories.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    comparison = Comparison(stories, MSGS, sampling, settings)
    rows, steps = [], 0
    while not comparison.done:
        before = len(calls)
        row = comparison.step()
        steps += 1
        assert len(calls) - before <= 1  # never more than one forward: a caller can interleave other work
        if row is not None:
            rows.append(row)
    # one warm-up step (a one-token reply), then 12 steps per setting, its row on its last step
    assert steps == 1 + 2 * 12 and len(calls) == steps and comparison.step() is None
    assert rows == comparison.rows and [r.label for r in rows] == ["paged", "contiguous"]
    assert all(r.same_tokens == r.generated_tokens == 12 and r.stop_reason == "max_tokens" for r in rows)
    assert [r.same_tokens for r in compare_settings(stories, MSGS, sampling, settings)] == [12, 12]


def test_cancel_ends_the_setting_in_flight_and_close_frees_it(stories):
    from engine.tools.compare import Comparison

    sampling = SamplingConfig(max_new_tokens=50, ignore_eos=True)
    comparison = Comparison(stories, MSGS, sampling)
    for _ in range(5):  # the warm-up, then 4 tokens of the first setting
        assert comparison.step() is None
    comparison.cancel()
    row = comparison.step()
    assert comparison.done and comparison.cancelled and row.stop_reason == "cancelled" and row.generated_tokens == 4
    assert comparison.step() is None and comparison.rows == [row]
    other = Comparison(stories, MSGS, sampling)
    other.step()
    other.step()  # the first setting's prefill: a session in flight
    other.close()  # frees it; no row comes for it
    assert other.done and other.cancelled and other.step() is None and other.rows == []
