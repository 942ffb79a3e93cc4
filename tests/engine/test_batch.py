"""Batched decoding (``engine.batch``): sessions decoded in one forward get exactly their own tokens, their own
cache settings and policies, and their own errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.core import scheduler as batch
from engine.config import CacheConfig, SamplingConfig
from engine.errors import CacheCapacityError, EngineError
from engine.kv.store import attention
from engine.kv.hf_cache import RaggedUnsupported
from engine.core.session import ChatSession
from test_exact import hf_greedy

PROMPTS = ["Once upon a time", "The cat sat on", "Lily and Tom went to the park. They", "A big red ball"]


@pytest.fixture()
def lm(stories):
    return dataclasses.replace(stories, arenas=None, model_runner=None)  # its own arenas and batch verdict


def _start(lm, cfgs, n, prompts=PROMPTS):
    sessions = [ChatSession(lm, c) for c in cfgs]
    for s, p in zip(sessions, prompts):
        s.start_ids(lm.tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=n, ignore_eos=True))
    return sessions


def _run(sessions, counts=None):
    """Step all until done; returns per session its results; ``counts`` gets the batch size of each step."""
    out = {id(s): [] for s in sessions}
    while live := [s for s in sessions if s.generating]:
        if counts is not None:
            counts.append(sum(map(len, batch.batchable(live))))
        for s, r in zip(live, batch.step_all(live)):
            out[id(s)].append(r)
    return out


def _alone(lm, cfgs, n) -> list[list[int]]:
    """Each setting's reply to its prompt when its session runs by itself."""
    out = []
    for c, p in zip(cfgs, PROMPTS):
        (s,) = _start(lm, [c], n, [p])
        _run([s])
        out.append(s.generated_ids)
    return out


def test_four_sessions_with_different_settings_decode_together_exactly(lm):
    n = 300
    cfgs = [CacheConfig(mode="paged", page_size=16), CacheConfig(mode="paged", page_size=3),
            CacheConfig(mode="contiguous"), CacheConfig(mode="paged", page_size=1)]
    sessions = _start(lm, cfgs, n)
    counts: list[int] = []
    _run(sessions, counts)
    assert counts.count(4) >= n - 2  # after the prefills every step decoded all four together
    for s, p in zip(sessions, PROMPTS):
        assert s.generated_ids == hf_greedy(lm, lm.tokenizer(p)["input_ids"], n)
        assert s.last_stats.stop_reason == "max_tokens"


def test_lossy_and_policy_sessions_get_what_they_get_alone(lm):
    """int8 K/V and StreamingLLM (no attention scores) join the batch; H2O (scores) steps alone; each reply is
    the one its session gives when it runs by itself."""
    cfgs = [CacheConfig(mode="paged", page_size=4, k_dtype="int8", v_dtype="int8"),
            CacheConfig(mode="paged", page_size=8, policy="streaming", policy_params={"sinks": 4, "window": 24}),
            CacheConfig(mode="paged", page_size=8, policy="h2o", policy_params={"budget": 32, "recent": 8}),
            CacheConfig(mode="paged", page_size=16)]
    n = 80
    alone = _alone(lm, cfgs, n)
    sessions = _start(lm, cfgs, n)
    counts: list[int] = []
    _run(sessions, counts)
    assert max(counts) == 3  # H2O never joined
    assert [s.generated_ids for s in sessions] == alone
    assert sessions[1].evicted_total > 0  # the window moved while batched


def test_tq_sessions_batched_read_their_pages_as_alone(lm, monkeypatch):
    """Rotated low-bit sessions join the batch with their pages read as alone: rotated, a decode token's straight
    from the codes (the fused kernel where it is built), so each reply is the one its session gives by itself."""
    from engine.kv.quantized import native, tq_attend

    cfgs = [CacheConfig(mode="paged", page_size=8, k_dtype="tq4", v_dtype="tq4"),
            CacheConfig(mode="paged", page_size=4, k_dtype="tq3-qjl", v_dtype="tq2"),
            CacheConfig(mode="paged", page_size=16, k_dtype="int4", v_dtype="tq3"),
            CacheConfig(mode="paged", page_size=16)]
    n = 60
    alone = _alone(lm, cfgs, n)
    calls = []
    run = tq_attend.run
    monkeypatch.setattr(tq_attend, "run", lambda *a: calls.append(1) or run(*a))
    sessions = _start(lm, cfgs, n)
    counts: list[int] = []
    _run(sessions, counts)
    assert counts.count(4) >= n - 2
    assert [s.generated_ids for s in sessions] == alone
    if native.library() is not None:  # the two all-tq sessions, 5 layers, every batched decode step
        assert len(calls) >= 2 * 5 * (n - 2)


def test_replies_of_different_lengths_and_a_cancel(lm):
    sessions = _start(lm, [CacheConfig()] * 3, 40)
    sessions[1].turn_state.sampling = dataclasses.replace(sessions[1].turn_state.sampling, max_new_tokens=7)
    results = {id(s): [] for s in sessions}
    for step in range(60):
        live = [s for s in sessions if s.generating]
        if not live:
            break
        if step == 12:
            sessions[2].cancel()
        for s, r in zip(live, batch.step_all(live)):
            results[id(s)].append(r)
    assert [s.last_stats.stop_reason for s in sessions] == ["max_tokens", "max_tokens", "cancelled"]
    assert len(sessions[1].generated_ids) == 7
    ref = hf_greedy(lm, lm.tokenizer(PROMPTS[0])["input_ids"], 40)
    assert sessions[0].generated_ids == ref
    mine = results[id(sessions[0])]
    assert "".join(r.event.text_delta for r in mine if r.event is not None) == mine[-1].text != ""


def test_a_session_without_room_fails_alone(lm):
    """Pages of 4, four in the arena: the 8-token prompt's session needs a third page for its next token and
    gets a typed error; the 6-token one has room in its second page and goes on; both can start again."""
    cfg = CacheConfig(mode="paged", page_size=4, max_pages=4, prefix_reuse=False)
    a, b = ChatSession(lm, cfg), ChatSession(lm, cfg)
    a.start_ids(list(range(10, 18)), SamplingConfig(max_new_tokens=5, ignore_eos=True))
    b.start_ids(list(range(30, 36)), SamplingConfig(max_new_tokens=2, ignore_eos=True))
    for s in (a, b):
        while s.step().event is None:
            pass
    ra, rb = batch.step_all([a, b])
    assert isinstance(ra, CacheCapacityError) and not a.generating
    assert not isinstance(rb, BaseException) and rb.event is not None and rb.done
    assert a.cached_tokens == 8 and b.cached_tokens == 7  # a's failed token left nothing behind
    b.close()
    a.start_ids(list(range(10, 18)), SamplingConfig(max_new_tokens=3, ignore_eos=True))
    while not (r := a.step()).done:
        pass
    assert r.stop_reason == "max_tokens"


def test_a_failed_forward_ends_every_reply_it_carried_and_wedges_none(lm, monkeypatch):
    sessions = _start(lm, [CacheConfig(), CacheConfig(mode="contiguous")], 20)
    for _ in range(6):
        batch.step_all(sessions)
    before = [(s.cached_tokens, len(s.seq)) for s in sessions]
    real = attention.ragged_attention  # the registered function looks it up at each call

    def broken(*a, **k):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(attention, "ragged_attention", broken)
    results = batch.step_all(sessions)
    monkeypatch.setattr(attention, "ragged_attention", real)
    assert all(isinstance(r, EngineError) for r in results)
    assert [(s.cached_tokens, len(s.seq)) for s in sessions] == before and not any(s.generating for s in sessions)
    for s, p in zip(sessions, PROMPTS):  # the next turn works and is exact
        s.start_ids(lm.tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=10, ignore_eos=True))
    _run(sessions)
    assert [s.generated_ids for s in sessions] == [hf_greedy(lm, lm.tokenizer(p)["input_ids"], 10)
                                                  for p in PROMPTS[:2]]


def test_a_model_that_cannot_batch_steps_one_by_one(lm, monkeypatch):
    def refuse(*a, **k):
        raise RaggedUnsupported("simulated: cached keys do not match")

    monkeypatch.setattr(attention, "ragged_attention", refuse)
    sessions = _start(lm, [CacheConfig()] * 2, 12)
    counts: list[int] = []
    _run(sessions, counts)
    assert "simulated" in lm.runner.batch_refused and lm.runner.batch_refusal() == lm.runner.batch_refused
    assert counts.count(0) >= 10  # once refused, never tried again
    assert [s.generated_ids for s in sessions] == [hf_greedy(lm, lm.tokenizer(p)["input_ids"], 12)
                                                  for p in PROMPTS[:2]]


def test_random_weights_batched_logits_match_single(lm):
    """A random-weight Llama with a wider layer (the batched linear takes another BLAS path): the batched
    forward's logits agree with one session's to float32 rounding."""
    from engine.model.shapes import build_shape

    big = build_shape("tiny-llama", device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, big.info.vocab_size, (n,), generator=g).tolist() for n in (9, 23, 17)]
    solo = []
    for p in prompts:
        s = ChatSession(big, CacheConfig())
        s.start_ids(p, SamplingConfig(max_new_tokens=2, ignore_eos=True))
        while s.step().event is None:
            pass
        (out,) = big.runner.run([s.prepare()])
        assert out.path != "batched"
        solo.append(out.logits)
        s.close()
    sessions = [ChatSession(big, CacheConfig()) for _ in prompts]
    for s, p in zip(sessions, prompts):
        s.start_ids(p, SamplingConfig(max_new_tokens=2, ignore_eos=True))
        while s.step().event is None:
            pass
    outs = big.runner.run([s.prepare() for s in sessions])
    assert {o.path for o in outs} == {"batched"} and outs[0].batch == 3
    batched = [o.logits for o in outs]
    for s, o in zip(sessions, outs):
        s.finish(o)
    for b, ref in enumerate(solo):
        assert torch.allclose(batched[b], ref, atol=1e-4, rtol=1e-4), (batched[b] - ref).abs().max()


def test_snapshots_show_every_page_the_batched_forward_wrote(lm):
    sessions = _start(lm, [CacheConfig(mode="paged", page_size=4)] * 2 + [CacheConfig(mode="contiguous")], 6)
    for s in sessions:
        while s.step().event is None:
            pass
    results = batch.step_all(sessions)
    last = [s.store.table.pages[(s.cached_tokens - 1) // 4] for s in sessions[:2]]
    assert last[0] != last[1]
    for i, r in enumerate(results[:2]):
        assert r.snapshot.batch_size == 3 and set(r.snapshot.written_pages) == set(last)
        mine = set(np.flatnonzero(r.snapshot.page_mine).tolist())
        assert mine == set(sessions[i].store.table.pages) and last[1 - i] not in mine  # the other's: not mine
    assert results[2].snapshot.written_pages == () and results[2].snapshot.batch_size == 3
    (r,) = batch.step_all(sessions[:1])  # alone: its own page only
    assert r.snapshot.batch_size == 1 and r.snapshot.written_pages == (sessions[0].store.table.pages[-1],)


def test_an_eviction_failure_after_the_forward_ends_that_reply_only(lm, monkeypatch):
    sessions = _start(lm, [CacheConfig()] * 3, 12)
    for _ in range(3):
        batch.step_all(sessions)

    def broken(*a, **k):
        raise RuntimeError("simulated eviction bug")

    monkeypatch.setattr(sessions[1].evictor, "after_forward", broken)
    results = batch.step_all(sessions)
    assert isinstance(results[1], EngineError) and not sessions[1].generating
    assert all(not isinstance(r, BaseException) for r in (results[0], results[2]))
    monkeypatch.undo()
    _run([sessions[0], sessions[2]])
    assert [sessions[i].generated_ids for i in (0, 2)] == [hf_greedy(lm, lm.tokenizer(PROMPTS[i])["input_ids"], 12)
                                                          for i in (0, 2)]
    sessions[1].start_ids(lm.tokenizer(PROMPTS[1])["input_ids"], SamplingConfig(max_new_tokens=5, ignore_eos=True))
    _run([sessions[1]])
    assert sessions[1].generated_ids == hf_greedy(lm, lm.tokenizer(PROMPTS[1])["input_ids"], 5)


def test_a_prefill_shares_the_forward_of_decoding_chats_and_every_reply_stays_exact(lm):
    """Chunked-prefill mixing: a new prompt's chunk joins the forward of three chats decoding (the tokens laid
    end to end); its first token and the others' next tokens come out of that one forward, and every reply is
    HF's greedy one."""
    sessions = _start(lm, [CacheConfig()] * 3, 30)
    for _ in range(3):
        batch.step_all(sessions)  # prefills, then decoding together
    late = ChatSession(lm, CacheConfig(page_size=8))
    prompt = lm.tokenizer(PROMPTS[3] + " and a little dog ran to the park")["input_ids"]
    late.start_ids(prompt, SamplingConfig(max_new_tokens=30, ignore_eos=True))
    everyone = [late] + sessions  # the new prompt first: it has the highest priority
    assert [len(g) for g in batch.batchable(everyone)] == [4]
    results = batch.step_all(everyone)
    first = results[0]
    assert first.event is not None and first.event.tokens_in_step == len(prompt)  # its whole prompt, one forward
    assert first.snapshot.batch_size == 4 and all(r.snapshot.batch_size == 4 for r in results[1:])
    assert lm.runner.batched_tokens >= 4
    _run(everyone)
    assert late.generated_ids == hf_greedy(lm, prompt, 30)
    for s, p in zip(sessions, PROMPTS):
        assert s.generated_ids == hf_greedy(lm, lm.tokenizer(p)["input_ids"], 30)


def test_speculating_chats_verify_in_the_forward_of_the_others_and_stay_exact(lm):
    """Speculation with everyone else: two chats drafting by prompt lookup and two decoding plainly share one
    forward a step — each verification's token and drafts laid beside the others' tokens (its logits read at every
    position) — and every reply is HF's greedy one, whatever its page size."""
    from engine.config import SpecConfig

    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a "
             "big dog. Once upon a time, there was a little girl named Lily. She loved")
    prompts = [story, PROMPTS[0], story + " to play", PROMPTS[2]]
    cfgs = [CacheConfig(page_size=16), CacheConfig(page_size=8), CacheConfig(page_size=4),
            CacheConfig(mode="contiguous")]
    sessions = [ChatSession(lm, c) for c in cfgs]
    for i in (0, 2):
        sessions[i].speculate(SpecConfig(method="ngram", draft_tokens=4, auto_off=False))
    n = 60
    for s, p in zip(sessions, prompts):
        s.start_ids(lm.tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=n, ignore_eos=True))
    shared = []
    while live := [s for s in sessions if s.generating]:
        groups = batch.batchable(live)
        for s, r in zip(live, batch.step_all(live)):
            assert not isinstance(r, BaseException), r
            ev = r.event
            if ev is not None and ev.path == "speculative" and r.snapshot.batch_size > 1 and groups:
                shared.append(ev.tokens_in_step)
    assert shared and max(shared) > 1  # verifications of drafts rode in the others' forwards
    for s, p in zip(sessions, prompts):
        assert s.generated_ids == hf_greedy(lm, lm.tokenizer(p)["input_ids"], n), p[:20]
        assert s.store.num_tokens == s.index.n  # no provisional slot left behind
    assert sum(s.spec.stats.accepted for s in (sessions[0], sessions[2])) > 0


def test_the_round_grants_a_verification_its_drafts_and_the_kv_manager_room_for_exactly_them(lm):
    """Speculation is scheduled: a speculating chat's drafts are proposed once a forward, in the demand the round
    asks (however often it is asked), the round grants its verification's tokens (its token and drafts) and the
    KV manager is asked room for exactly those; handing out a verification's later tokens asks for none. The
    reply is HF's greedy one."""
    from engine.config import SpecConfig
    from engine.core.scheduler import EngineCore, Request

    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a "
             "big dog. Once upon a time, there was a little girl named Lily. She loved")
    ids, n = lm.tokenizer(story)["input_ids"], 40
    s = ChatSession(lm, CacheConfig(page_size=8))
    s.speculate(SpecConfig(method="ngram", draft_tokens=4, auto_off=False))
    proposed, propose = [], s.spec.drafter.propose
    s.spec.drafter.propose = lambda ids, k, sampler=None: proposed.append(propose(ids, k, sampler)) or proposed[-1]
    core, asked, results = EngineCore(lm), [], []
    make_room = core.kv.make_room
    core.kv.make_room = lambda session, tokens, priority: asked.append(tokens) or make_room(session, tokens, priority)
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    core.add(Request(s, results.append))
    while core.requests:
        for _ in range(3):
            s.demand()  # asked again before its forward runs: the same drafts, no second proposal
        core.round()
    fed = [r.event.tokens_in_step for r in results if r.event is not None and r.event.tokens_in_step]
    assert [a for a in asked if a] == fed and fed[0] == len(ids)  # the prompt, then each forward's grant
    verifications = [f for f in fed[1:] if f > 1]
    assert verifications and len(proposed) <= len(fed) - 1  # one proposal at most a forward
    assert sorted(verifications) == sorted(len(d) + 1 for d in proposed if d)  # each proposal verified, once
    assert s.generated_ids == hf_greedy(lm, ids, n)
    s.close()


@pytest.mark.parametrize("pages", [29, 32])
def test_drafts_never_cost_another_requests_pages(lm, pages):
    """A pool too small for three chats (4-token pages): when pages an earlier request of the round took leave no
    room for a speculating request's drafts, its grant falls back to its one decode token (on 32 pages; on 29 the
    background chat waits for the pages while the others hold them); a verification's grant never preempts a
    request (without the fallback, these pools each preempt one for drafts). Each reply ends by its own stop, with
    the tokens it gives alone (a request that waits for room is never failed for it)."""
    from engine.config import SpecConfig
    from engine.core.scheduler import EngineCore, Priority, Request

    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a "
             "big dog. Once upon a time, there was a little girl named Lily. She loved")
    ids = lm.tokenizer(story)["input_ids"]
    cfg = CacheConfig(page_size=4, max_pages=pages, prefix_reuse=False)
    runs = [(ids[:20], 30, Priority.BACKGROUND), (ids[:9], 40, Priority.FOREGROUND), (ids, 30, Priority.API)]
    sessions = [ChatSession(lm, cfg) for _ in runs]
    spec = sessions[2]
    spec.speculate(SpecConfig(method="ngram", draft_tokens=4, auto_off=False))
    core, grants, asked = EngineCore(lm), [], []
    make_room, demand = core.kv.make_room, spec.demand

    def room(session, tokens, priority):
        before = core.preemptions
        ok = make_room(session, tokens, priority)
        if session is spec and asked[-1]:
            grants.append((tokens, len(asked[-1]) + 1, core.preemptions - before))
        return ok

    core.kv.make_room = room
    spec.demand = lambda: asked.append((d := demand()).drafts) or d
    ends = {}
    try:
        for i, (prompt, n, priority) in enumerate(runs):
            sessions[i].start_ids(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
            core.add(Request(sessions[i], lambda r, i=i: ends.setdefault(i, r) if isinstance(r, BaseException)
                             or r.done else None, priority))
            if i == 0:
                core.round(), core.round()  # the background chat holds its pages first
        while core.requests:
            core.round()
        assert any(t == 1 for t, _, _ in grants) == (pages == 32)  # drafts dropped for room: one decode token
        assert all(p == 0 for t, _, p in grants if t > 1)  # no verification's grant preempted anyone
        for i, (prompt, n, _) in enumerate(runs):  # each ends by its stop
            assert not isinstance(ends[i], BaseException), ends[i]
            assert sessions[i].generated_ids == hf_greedy(lm, prompt, n), i
    finally:
        for s in sessions:
            s.close()


def test_speculating_chats_on_quantized_pages_get_in_a_batch_what_they_get_alone(lm):
    """int4 and tq3 pages under speculation, beside an int8 chat decoding plainly: a verification in the shared
    forward reads its pages as it does alone (drafts never complete a quantized page), so each reply is the one
    the same setting gives by itself."""
    from engine.config import SpecConfig

    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a "
             "big dog. Once upon a time, there was a little girl named Lily. She loved")
    prompts = [story, PROMPTS[1], story + " to play"]
    cfgs = [CacheConfig(page_size=8, k_dtype="int4", v_dtype="int4"),
            CacheConfig(page_size=16, k_dtype="int8", v_dtype="int8"),
            CacheConfig(page_size=16, k_dtype="tq3", v_dtype="tq3")]
    spec = SpecConfig(method="ngram", draft_tokens=4, auto_off=False)

    def start(cfg, prompt):
        s = ChatSession(lm, cfg)
        if cfg.k_dtype != "int8":
            s.speculate(spec)
        s.start_ids(lm.tokenizer(prompt)["input_ids"], SamplingConfig(max_new_tokens=50, ignore_eos=True))
        return s

    alone = []
    for c, p in zip(cfgs, prompts):
        s = start(c, p)
        _run([s])
        alone.append(s.generated_ids)
    together = [start(c, p) for c, p in zip(cfgs, prompts)]
    sizes = []
    while live := [s for s in together if s.generating]:
        for s, r in zip(live, batch.step_all(live)):
            assert not isinstance(r, BaseException), r
            if r.event is not None and r.event.path == "speculative":
                sizes.append(r.snapshot.batch_size)
    assert max(sizes) > 1  # verifications shared the forward
    assert [s.generated_ids for s in together] == alone
