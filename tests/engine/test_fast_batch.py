"""The compiled batched decode step (engine.model.fast_batch): several chats' one token each in one call of a package
built in a child process — HF's greedy ids for every chat whatever shares the batch, chats joining and leaving,
refused where it cannot run, a failed call answered by the eager batch, built only when asked for.

The stories260K package is built once for the module (~20-30 s on the project's 2-core machine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core import scheduler as batch
from engine.core.session import ChatSession
from engine.kv.store.attention import padded_attention
from engine.model.fast_step import EARLY_STEPS, TRIAL_STEPS, FastStep, machine_refusal
from test_exact import hf_greedy

NO_COMPILE = machine_refusal(torch.device("cpu"))
needs_compile = pytest.mark.skipif(bool(NO_COMPILE), reason=f"cannot compile here: {NO_COMPILE}")
PROMPTS = ["Once upon a time", "The cat sat on", "Lily and Tom went to the park. They", "A big red ball"]


@pytest.fixture(scope="module")
def lm(stories_path):
    from engine.model.loader import load_model

    m = load_model(str(stories_path))
    m.runner.fast = FastStep(m, mode="on")
    return m


@pytest.fixture()
def built(lm):
    b = lm.fast.batch
    b.set_mode("on")
    b.start()  # the single step is not needed for these: its build is left idle
    assert b.wait(600) and b.state == "on", b.describe()
    return b


def _run(lm, cfgs, lengths, prompts=PROMPTS):
    """Each chat's reply (greedy, ``lengths`` tokens) stepped together; (ids per chat, paths per chat)."""
    sessions = [ChatSession(lm, c) for c in cfgs]
    paths = {id(s): [] for s in sessions}
    try:
        for s, p, n in zip(sessions, prompts, lengths):
            s.start_ids(lm.tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=n, ignore_eos=True))
        while live := [s for s in sessions if s.generating]:
            for s, r in zip(live, batch.step_all(live)):
                if r.event is not None:
                    paths[id(s)].append(r.event.path)
        return [s.generated_ids for s in sessions], [paths[id(s)] for s in sessions]
    finally:
        for s in sessions:
            s.close()


def test_padded_attention_equals_each_sequences_own_sdpa():
    """Three sequences of 5, 9 and 2 cached keys padded to 9 (+ the new one), GQA 6 query heads over 2 K/V heads:
    each row equals SDPA over that sequence's own keys alone."""
    g = torch.Generator().manual_seed(0)
    lens, n, hq, hk, d = [5, 9, 2], 9, 6, 2, 16
    q = torch.randn(3, hq, 1, d, generator=g)  # [B, Hq, 1, D]
    k = torch.randn(3, hk, n + 1, d, generator=g)  # [B, Hk, n + 1, D]: padding, then the new token's key last
    v = torch.randn(3, hk, n + 1, d, generator=g)
    at = torch.arange(n + 1)[None]
    keep = ((at < torch.tensor(lens)[:, None]) | (at == n))[:, None, None]  # [B, 1, 1, n + 1]
    k[0, :, 5:n] = 1e4  # padding that would dominate any softmax it leaked into
    got, _ = padded_attention(None, q, k, v, keep)  # [B, 1, Hq, D]
    for b, m in enumerate(lens):
        own = torch.cat([torch.arange(m), torch.tensor([n])])
        want = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, own], v[b:b + 1, :, own],
                                                                enable_gqa=True)  # [1, Hq, 1, D]
        torch.testing.assert_close(got[b:b + 1], want.transpose(1, 2), rtol=1e-5, atol=1e-5)


@needs_compile
def test_four_chats_decoded_by_the_compiled_batch_get_hf_greedy_ids(lm, built):
    """Four chats of different lengths on one arena (page sizes equal), one leaving after 60 tokens, another
    after 150: every token after the prompts comes from the compiled batch while two or more decode, the
    last chat alone goes on without it, and every chat's ids are HF's."""
    lengths = [300, 60, 150, 300]
    got, paths = _run(lm, [CacheConfig(page_size=16)] * 4, lengths)
    for ids, p, n, prompt in zip(got, paths, lengths, PROMPTS):
        assert ids == hf_greedy(lm, lm.tokenizer(prompt)["input_ids"], n), prompt
    assert paths[1][1:] == ["compiled batch"] * 59  # the prompt's token, then always in the batch
    assert paths[0].count("compiled batch") >= 290, paths[0].count("compiled batch")
    assert built.state == "on"


@needs_compile
def test_evicting_policies_in_the_batch_give_what_the_eager_batch_gives(lm, built):
    """StreamingLLM (re-rotated keys, scattered pages) and priority eviction beside plain chats: their slot lists
    are gathered per chat, so each chat's tokens equal those of the eager batched forward."""
    cfgs = [CacheConfig(page_size=8, policy="streaming", policy_params={"sinks": 4, "window": 40}),
            CacheConfig(page_size=8, policy="priority", policy_params={"budget": 48, "recent": 8}),
            CacheConfig(page_size=8), CacheConfig(page_size=8)]
    got, paths = _run(lm, cfgs, [120] * 4)
    assert all(p.count("compiled batch") == 119 for p in paths)
    built.set_mode("off")
    try:
        want, eager = _run(lm, cfgs, [120] * 4)
    finally:
        built.set_mode("on")
    assert all(set(p[1:]) == {"batched"} for p in eager)
    assert got == want


@needs_compile
@pytest.mark.parametrize("other, why", [
    (CacheConfig(page_size=16, k_dtype="int8", v_dtype="int8"), "quantized"),
    (CacheConfig(page_size=8), "different arenas"),
])
def test_a_batch_the_step_cannot_run_goes_eager(lm, built, other, why):
    cfgs = [CacheConfig(page_size=16), other]
    sessions = [ChatSession(lm, c) for c in cfgs]
    try:
        assert why in built.refusal_of([s.store for s in sessions])
    finally:
        for s in sessions:
            s.close()
    got, paths = _run(lm, cfgs, [30, 30])
    assert all(set(p[1:]) == {"batched"} for p in paths)


@needs_compile
def test_a_failed_compiled_batch_falls_back_to_the_eager_batch_exactly(lm, built, monkeypatch):
    real, calls = built._fn, []

    def boom(*args):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(built, "_fn", boom)
    try:
        got, paths = _run(lm, [CacheConfig(page_size=16)] * 2, [40, 40])
        for ids, prompt in zip(got, PROMPTS):
            assert ids == hf_greedy(lm, lm.tokenizer(prompt)["input_ids"], 40)
        assert paths[0][1:10] == ["compiled batch"] * 9 and set(paths[0][10:]) == {"batched"}
        assert built.state == "failed" and "injected failure" in built.reason
    finally:
        monkeypatch.setattr(built, "_fn", real)
        built.state, built.reason = "on", ""


@needs_compile
def test_auto_mode_measures_the_batch_both_ways_then_keeps_one(lm, built):
    built.set_mode("auto")
    try:
        assert built.state == "trial"
        got, paths = _run(lm, [CacheConfig(page_size=16)] * 3, [TRIAL_STEPS + 20] * 3)
        n = built.trial_steps  # TRIAL_STEPS, or from EARLY_STEPS on where compiled is plainly faster
        assert EARLY_STEPS <= n <= TRIAL_STEPS, n
        trial = paths[0][1:n + 1]
        assert abs(trial.count("batched") - n / 4) < 1  # one round in four runs eager while measuring
        assert built.state in ("on", "slower"), built.describe()
        assert "compiled" in built.reason and "ms a sequence" in built.reason  # rounds of any size, per sequence
        kept = "compiled batch" if built.state == "on" else "batched"
        assert set(paths[0][n + 1:]) == {kept}
        for ids, prompt in zip(got, PROMPTS):
            assert ids == hf_greedy(lm, lm.tokenizer(prompt)["input_ids"], TRIAL_STEPS + 20)
    finally:
        built.set_mode("on")


def test_the_batched_step_is_built_only_after_the_single_step_was_asked_for(stories, tmp_path, monkeypatch):
    """Nobody started compiled steps (a test, ``--eager``): chats decoding together never start a build."""
    monkeypatch.setenv("KVSCOPE_COMPILE_CACHE", str(tmp_path))
    lm = dataclasses.replace(stories, model_runner=None, arenas=None)
    lm.runner.fast = FastStep(lm, mode="on")
    _, paths = _run(lm, [CacheConfig(page_size=16)] * 2, [10, 10])
    assert lm.fast.batch.state == "idle" and lm.fast.batch._proc is None
    assert all(set(p[1:]) == {"batched"} for p in paths)
    assert not list(tmp_path.iterdir())


def test_the_environment_switch_is_off_or_warned_about(stories, monkeypatch, caplog):
    from engine.model.fast_batch import BatchStep

    monkeypatch.setenv("KVSCOPE_FAST_BATCH", "off")
    b = BatchStep(stories, "on")
    assert b.state == "off" and b.reason == "KVSCOPE_FAST_BATCH=off"
    b.start()
    assert b._proc is None and b.state == "off"
    monkeypatch.setenv("KVSCOPE_FAST_BATCH", "of")
    with caplog.at_level("WARNING", logger="kvscope"):
        assert BatchStep(stories, "on").state != "off"
    assert "KVSCOPE_FAST_BATCH='of' is not one of on, auto, off" in caplog.text
