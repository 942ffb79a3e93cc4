"""engine.compare: the same reply under each cache setting, lossless ones identical to the reference."""

from __future__ import annotations

import threading

from engine.compare import DEFAULT_SETTINGS, compare_settings
from engine.config import CacheConfig, SamplingConfig
from engine.session import ChatSession

MSGS = [{"role": "user", "content": "Tell me a story about a dog."}]


def test_lossless_settings_match_the_reference_and_rows_report_the_cache(stories):
    seen = []
    rows = compare_settings(stories, MSGS, SamplingConfig(temperature=0.9, max_new_tokens=60, ignore_eos=True),
                            on_row=seen.append)
    assert [r.label for r in rows] == [label for label, _ in DEFAULT_SETTINGS] and seen == rows
    ref, contiguous, int8, int4, off = rows
    # greedy whatever the form says: the reference is the model's greedy reply, as a plain session gives it
    s = ChatSession(stories, CacheConfig(mode="paged"))
    s.start(MSGS, SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True))
    while not s.step().done:
        pass
    assert ref.generated_tokens == 60 and ref.same_tokens == 60 and s.generated_ids and not ref.error
    s.close()
    for lossless in (contiguous, off):
        assert lossless.same_tokens == lossless.generated_tokens == 60
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
