"""Faults and hostile inputs: each row of the engine issue's fault table, as a test on the real model.

Every case ends with the chat (and every other chat of the model) taking its next turn.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.errors import CacheCapacityError, EngineError, OutOfMemoryError, SessionClosedError
from engine.kv.store.arena import ArenaRegistry, PageArena
from engine.kv.quantized.roles import FullRole, KVShape
from engine.kv.store.storage import PagedKV
from engine.core.session import ChatSession

SHORT = SamplingConfig(max_new_tokens=8)


def own_arenas(lm, memory_limit=-1):
    """The same model with page arenas of its own (pages counted exactly, limits set per test)."""
    lm = dataclasses.replace(lm, arenas=None)
    if memory_limit != -1:
        i = lm.info
        lm.arenas = ArenaRegistry(KVShape(i.num_layers, i.num_kv_heads, i.head_dim, lm.kv_dtype, lm.device),
                                  i.context_length, memory_limit=memory_limit)
    return lm


def reply(s: ChatSession, text: str = "Tell me a story.", sampling=SHORT):
    s.start([{"role": "user", "content": text}], sampling)
    while not (r := s.step()).done:
        pass
    return r


def test_out_of_memory_while_the_arena_grows_leaves_every_chat_usable(stories, monkeypatch):
    lm = own_arenas(stories)
    a, b = ChatSession(lm), ChatSession(lm)
    reply(a), reply(b)
    arena = a.store.arena
    pages, tensors = arena.pool.num_pages, [t.shape for t in arena.roles["k"].layers]

    def no_memory(self, num_pages):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(FullRole, "allocate", no_memory)
    c = ChatSession(lm)
    c.start_ids(list(range(1, 480)), SHORT)  # needs more pages than are free: the arena must grow
    with pytest.raises(OutOfMemoryError, match="out of memory growing the KV cache") as err:
        while not c.step().done:
            pass
    assert isinstance(err.value, CacheCapacityError) and not c.generating
    assert arena.pool.num_pages == pages and [t.shape for t in arena.roles["k"].layers] == tensors
    assert c.cached_tokens == 0 and c.store.num_tokens == 0  # the partial prefill was rolled back
    for s in (a, b):  # memory is still short, but the chats that fit keep answering
        assert reply(s, "And then?").stop_reason in ("max_tokens", "eos")
    monkeypatch.undo()
    assert reply(c, "Hi.").stop_reason in ("max_tokens", "eos")  # memory is back: the failed chat works too
    for s in (a, b, c):
        s.close()
    assert arena.pool.num_used == 0


def test_h2o_switched_on_mid_chat_longer_than_its_budget_evicts_and_keeps_going(stories):
    s = ChatSession(stories, CacheConfig(page_size=8))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=150, ignore_eos=True))
    for _ in range(120):
        s.step()
    notes = s.apply(CacheConfig(page_size=8, policy="h2o", policy_params={"budget": 64, "recent": 16}))
    assert any("evicted" in n for n in notes) and s.cached_tokens <= 64
    while not (r := s.step()).done:
        assert r.snapshot.tokens_per_layer.max() <= 64
    assert r.stop_reason == "max_tokens"
    assert any("no attention scores yet" in w for w in r.warnings)  # the user is told how it chose
    assert reply(s, "And then?").stop_reason in ("max_tokens", "eos")  # the next message works
    s.close()


@pytest.mark.parametrize("policy,params", [("h2o", {"budget": 256, "recent": 64}), ("priority", {"budget": 256})])
def test_budget_smaller_than_the_protected_prompt_protects_less_and_says_so(demo_model, policy, params):
    s = ChatSession(demo_model, CacheConfig(policy=policy, policy_params=params))
    first = "Please remember every detail of the following story. " * 7  # ~380 bytes: more than the budget
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": first}]
    s.start(msgs, SamplingConfig(max_new_tokens=12, ignore_eos=True))
    assert s.protected > 256
    while not (r := s.step()).done:
        assert r.snapshot.tokens_per_layer.max() <= 256
    assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 12
    assert any("smaller than the protected prompt" in w for w in r.warnings)
    s.close()


def test_close_during_a_reply_ends_it_and_frees_its_pages(stories):
    lm = own_arenas(stories)
    s = ChatSession(lm)
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=100, ignore_eos=True))
    for _ in range(10):
        s.step()
    pool = s.store.arena.pool
    assert pool.num_used > 0
    s.close()
    assert not s.generating and pool.num_used == 0 and s.last_stats.stop_reason == "cancelled"
    with pytest.raises(SessionClosedError):
        s.step()  # never generates again from a truncated cache
    with pytest.raises(SessionClosedError):
        s.start_completion("Hello", SHORT)
    assert pool.num_used == 0


def test_sessions_without_limit_meet_a_typed_memory_limit_and_give_memory_back(stories):
    i = stories.info
    page_bytes = i.num_layers * 2 * 16 * i.num_kv_heads * i.head_dim * 4  # float32 K+V of one 16-token page
    lm = own_arenas(stories, memory_limit=100 * page_bytes)
    sessions, error = [], None
    for n in range(200):
        s = ChatSession(lm)
        sessions.append(s)
        try:  # prompts that differ from their first tokens: no session shares another's pages (prefix cache)
            reply(s, f"{n} Tell me a story about a dog and a cat.")
        except CacheCapacityError as e:
            error = e
            break
    assert error is not None and "memory limit" in str(error) and not sessions[-1].generating
    arena = next(iter(lm.arenas))
    assert arena.nbytes <= 100 * page_bytes
    assert reply(sessions[0], "And then?").stop_reason in ("max_tokens", "eos")  # old chats still answer
    for s in sessions:
        s.close()
    assert arena.pool.num_used == 0 and arena.pool.num_pages == arena.initial_pages  # memory given back


def count_forward_tokens(lm, monkeypatch) -> list[int]:
    seen: list[int] = []
    real = lm.model.forward

    def forward(*args, **kwargs):
        seen.append(int(kwargs["input_ids"].shape[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(lm.model, "forward", forward)
    return seen


@pytest.mark.parametrize("cache", [CacheConfig(overflow="truncate_middle"), CacheConfig(overflow="rolling"),
                                   CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 200})],
                         ids=["truncate_middle", "rolling", "streaming"])
def test_a_5mb_message_is_fed_in_chunks_and_stop_works_between_them(stories, monkeypatch, cache):
    lm = own_arenas(stories)
    text = "The little dog ran to the park and played with a big red ball. " * 80_000  # 5.1 MB
    s = ChatSession(lm, cache)
    s.start([{"role": "user", "content": text}], SamplingConfig(max_new_tokens=4))
    seen = count_forward_tokens(lm, monkeypatch)
    r = s.step()
    assert seen and max(seen) <= s.prefill_chunk  # one bounded forward per step
    if cache.policy == "streaming":
        assert r.event is None and not r.done  # still prefilling: Stop can act now
        s.cancel()
        r = s.step()
        assert r.done and r.stop_reason == "cancelled" and len(seen) == 1
    else:
        while not r.done:
            r = s.step()
        assert r.stop_reason in ("max_tokens", "eos") and max(seen) <= s.prefill_chunk
        assert any("dropped to fit the context" in w for w in r.warnings)
        assert r.snapshot.evicted_total > 1_000_000
    assert reply(s, "Hi.").stop_reason in ("max_tokens", "eos", "context_full")
    s.close()


def test_quantized_pages_read_back_in_table_order_after_fork_and_free():
    """Pages [0, 3, 2]: first and last look like the run 0..2, but page 1 belongs to another session."""
    shape = KVShape(1, 1, 4, torch.float32, torch.device("cpu"))
    arena = PageArena(shape, page_size=8, num_pages=8, k_kind="int8", v_kind="int8")

    def write(store, n, start_value):
        x = (torch.arange(n, dtype=torch.float32) + start_value)[None, None, :, None].expand(1, 1, n, 4)
        store.reserve(n)
        store.update(0, x, x)
        store.commit()

    a, x, y = PagedKV(arena, 1), PagedKV(arena, 2), PagedKV(arena, 3)
    write(a, 8, 1)  # a: page 0
    write(x, 8, 100), write(y, 8, 200)  # pages 1, 2
    write(a, 8, 9)  # a: page 3
    y.free()  # page 2 free again
    write(a, 8, 17)  # a: page 2
    b = a.fork(4)
    assert a.table.pages == b.table.pages == [0, 3, 2]
    for store in (a, b):
        k, v = store.read_layer(0)  # [1, 24, 4]
        want = torch.arange(1, 25, dtype=torch.float32)[None, :, None].expand(1, 24, 4)
        assert torch.allclose(k, want, atol=0.05) and torch.allclose(v, want, atol=0.1)


def test_max_pages_is_honoured_and_checked_before_the_forward(stories):
    lm = own_arenas(stories)
    cfg = CacheConfig(page_size=16, max_pages=2)
    s = ChatSession(lm, cfg)
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=60, ignore_eos=True))
    with pytest.raises(CacheCapacityError, match="page limit of 2 pages") as err:
        while True:
            r = s.step()
            assert r.snapshot.tokens_per_layer.max() <= r.snapshot.capacity_tokens == 32
    assert not s.generating and s.cached_tokens == 32 and "eviction policy" in str(err.value)
    assert s.store.arena.pool.num_pages == 2
    s.apply(cfg.replace(overflow="rolling"))  # the overflow setting may now make room
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=60, ignore_eos=True))
    while not (r := s.step()).done:
        assert r.snapshot.tokens_per_layer.max() <= 32
    assert r.stop_reason == "max_tokens" and s.store.arena.pool.num_pages == 2
    s.close()


def test_snapshot_arrays_are_read_only_copies(stories):
    s = ChatSession(stories)
    r = reply(s)
    with pytest.raises(ValueError):
        r.snapshot.page_state[0] = 3
    with pytest.raises(ValueError):
        r.snapshot.token_state[:] = 0
    assert not np.shares_memory(r.snapshot.page_refcount, np.asarray(s.store.arena.pool.ref))
    s.close()


def test_any_exception_in_a_step_ends_the_turn_typed_and_the_next_start_works(stories, monkeypatch):
    s = ChatSession(stories, CacheConfig(page_size=4))
    reply(s)
    calls = {"n": 0}
    real = s.model.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(s.model, "forward", flaky)
    s.start([{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once."},
             {"role": "user", "content": "More."}], SamplingConfig(max_new_tokens=20, ignore_eos=True))
    held = s.cached_tokens
    with pytest.raises(EngineError, match="internal error in the reply.*injected failure") as err:
        while not s.step().done:
            held = s.cached_tokens
    assert isinstance(err.value.__cause__, RuntimeError) and not s.generating
    assert s.cached_tokens == held == s.store.num_tokens  # the failed forward left nothing behind
    assert reply(s, "Again.").stop_reason in ("max_tokens", "eos")
    s.close()


def test_prefill_chunks_are_sized_per_model_and_stop_acts_between_them(stories, monkeypatch):
    from engine.core.sequence import prefill_chunk
    from test_exact import hf_greedy

    assert [prefill_chunk(n, "cpu") for n in (260_000, 135_000_000, 1_000_000_000, 8_000_000_000)] == [2048, 2048, 256, 64]
    assert prefill_chunk(8_000_000_000, "cuda") == 1024
    ids = stories.tokenizer("Once upon a time, there was a little girl named Lily. " * 20)["input_ids"][:300]
    ref = hf_greedy(stories, ids, 20)
    s = ChatSession(own_arenas(stories))  # no pages other tests left in the prefix cache
    s.prefill_chunk = 64  # as for a model of a few billion parameters
    seen = count_forward_tokens(stories, monkeypatch)
    s.start_ids(ids, SamplingConfig(max_new_tokens=20, ignore_eos=True))
    results = [s.step() for _ in range(4)]
    assert [r.event is None for r in results] == [True, True, True, True] and seen == [64] * 4
    assert all(r.snapshot.phase == "prefill" and not r.done for r in results)
    while not s.step().done:
        pass
    assert seen[:5] == [64, 64, 64, 64, 44] and s.generated_ids == ref  # chunked, still HF's tokens
    s.start_ids(ids, SamplingConfig(max_new_tokens=20, ignore_eos=True))  # a prefix hit: nothing to chunk
    s.cancel()
    assert s.step().stop_reason == "cancelled"
    s.prefill_chunk = 64
    s.start_ids(ids[:1] + ids[2:], SamplingConfig(max_new_tokens=20, ignore_eos=True))
    assert s.step().event is None  # re-prefill after the edit goes in chunks too
    s.cancel()
    assert s.step().stop_reason == "cancelled" and not s.generating
    s.close()
