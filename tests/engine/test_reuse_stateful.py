"""Reuse on models whose cache cannot be cut back anywhere: sliding-window layers (Gemma 2/3, gpt-oss, Mistral's
SWA) and recurrent / convolution state layers (LFM2, Falcon-H1, Qwen3-Next). A follow-up goes on from the cache;
a regenerate, a branch and an edit go back to a checkpoint (``engine.kv.store.checkpoints``) — and the tokens
are HF's greedy tokens for the same prompt whether a checkpoint was used or not."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.scheduler import drive
from engine.core.session import ChatSession
from engine.config import ModelSpec
from engine.model.loaded import wrap_model
from arch_zoo import tiny_model
from test_layer_kinds import CONFIGS, hf_greedy, tiny

# sliding windows (8 tokens) | recurrent / conv states beside attention
TYPES = ["gemma3_text", "gemma2", "mistral", "gpt_oss", "lfm2", "falcon_h1", "qwen3_next"]
STATES = ("lfm2", "falcon_h1", "qwen3_next")
N = 12


def build(model_type: str):
    if model_type in CONFIGS:
        return tiny(model_type)
    m, _ = tiny_model(model_type)  # the zoo's tiny config: one layer of each kind the architecture has
    return m, wrap_model(m, None, ModelSpec(source="test"), "cpu", "CPU", name=model_type, path=None, is_demo=True)


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    m, lm = build(request.param)
    return request.param, m, lm


def reply(s: ChatSession, ids, n=N):
    stats = s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    for _ in drive(s):
        pass
    return stats.reused_tokens, list(s.generated_ids)


@pytest.mark.parametrize("page_size", [4, 16])
def test_follow_up_regenerate_branch_reuse_and_tokens(model, page_size):
    name, m, lm = model
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=page_size))
    p1 = list(range(5, 45))  # longer than the windows (8): they slide during the prompt
    reused, g1 = reply(s, p1)
    assert reused == 0 and g1 == hf_greedy(m, p1, N)
    fed = p1 + g1[:-1]  # the last sampled token is never fed
    p2 = p1 + g1 + list(range(60, 80))  # a follow-up
    reused, g2 = reply(s, p2)
    assert reused == len(fed), f"{name}: follow-up reused {reused} of {len(fed)} fed"
    assert g2 == hf_greedy(m, p2, N)
    reused, again = reply(s, p2)  # regenerate: the whole prompt but its last token
    assert reused == len(p2) - 1 and again == g2
    p3 = p1 + g1 + list(range(90, 100))  # a branch from turn 2's start (another second message)
    reused, g3 = reply(s, p3)
    # a state goes back to the checkpoint at turn 2's start; a window to any position it still holds
    expected = len(fed)
    assert reused == expected, f"{name}: branch reused {reused}, turn 2 started at {len(fed)}"
    assert g3 == hf_greedy(m, p3, N)
    p4 = p1[:-3] + [7, 8, 9]  # an edit of the first message: before any checkpoint but the sequence's start
    reused, g4 = reply(s, p4)
    assert g4 == hf_greedy(m, p4, N)
    # before every checkpoint but the sequence's start: what goes on is the prefix cache's, at its last whole page
    # (36) of the 37 tokens the edit shares — the states kept there by the first prompt's prefill, a window's pages
    # while its pool has not given them to newer pages (its least recently used go first)
    P = page_size
    assert reused == (37 // P * P if name in STATES else reused) and reused in (0, 37 // P * P)


def test_no_checkpoints_recomputes_and_gives_the_same_tokens(model):
    name, m, lm = model
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, checkpoints=0, prefix_reuse=False))
    p1 = list(range(5, 45))
    _, g1 = reply(s, p1)
    reused, again = reply(s, p1)
    assert again == g1 and reused == 0  # nothing to go back to


def test_without_checkpoints_the_prefix_cache_still_serves_whole_pages(model):
    """Checkpoints off: a regenerate goes back to the prefix cache's last whole page before the prompt's last
    token (the states the prefill kept there, the window's pages still in its pool), with the same tokens."""
    name, m, lm = model
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, checkpoints=0))
    p1 = list(range(6, 46))
    _, g1 = reply(s, p1)
    reused, again = reply(s, p1)
    assert again == g1 == hf_greedy(m, p1, N) and reused == 36
    assert s.last_stats.cache.misses[0].start == 36


@pytest.mark.parametrize("model_type", ["lfm2", "gemma3_text"])
def test_bench_branch_scenario(model_type):
    """``bench --scenario branch``: with checkpoints a regenerate and a branch reuse what they share; without, a
    hybrid recomputes them whole (a sliding model keeps its follow-up)."""
    from engine.tools import bench_branch

    _, lm = build(model_type)
    r = bench_branch.run(lm, 40, 4, reply=6)
    w, wo = r["with"], r["without"]
    follow = w["follow_up"]["prompt"]
    assert w["follow_up"]["reused"] == wo["follow_up"]["reused"] == 40 + 6 - 1
    # right after the follow-up a sliding window still holds its end: only a state needs the checkpoint; without
    # one, the states the follow-up's prefill left on the shelf at its last whole page (76)
    assert w["regenerate"]["reused"] == follow - 1
    assert wo["regenerate"]["reused"] == ((follow - 1) // 4 * 4 if model_type == "lfm2" else follow - 1)
    # the branch shares the chat (40 tokens, 10 whole pages): a window's pages are all named, so the prefix cache
    # serves all 40; the states were shelved at the chat's last whole page before its last token (36), which the
    # checkpoint before that last token (39) beats
    assert w["branch"]["reused"] == (39 if model_type == "lfm2" else 40)
    assert wo["branch"]["reused"] == (36 if model_type == "lfm2" else 40)
    assert w["new_chat"]["reused"] == (36 if model_type == "lfm2" else 40)  # another chat, the same 40 tokens
    assert w["checkpoints"] == 1 and wo["checkpoints"] == 0  # after the first turn: before its last token
    assert (w["checkpoint_state_bytes"] > 0) == (model_type == "lfm2") and wo["checkpoint_state_bytes"] == 0


@pytest.mark.parametrize("model_type", ["lfm2", "llama"])
def test_an_api_branch_forks_the_conversation_and_keeps_it(model_type):
    """The server's pool: a request that shares the start of an idle conversation (another second message)
    goes on from a fork — the conversation keeps its cache for its own follow-up; on a hybrid the fork goes
    back to the checkpoint at the second turn's start."""
    from engine.core.session_pool import CLOSE, SessionPool

    _, lm = build(model_type)
    pool = SessionPool(lm, CacheConfig(page_size=4), evict=CLOSE)
    p1 = list(range(5, 45))
    s, _ = pool.take(p1)
    _, g1 = reply(s, p1)
    p2 = p1 + g1 + list(range(60, 140))  # a long second turn: the branch shares less than half
    _, g2 = reply(s, p2)
    pool.put(s)
    branch = p1 + g1 + list(range(120, 130))
    b, shared = pool.take(branch)
    assert b is not s and len(pool) == 1  # a fork: the conversation stays in the pool
    fed1 = len(p1) + len(g1) - 1
    assert shared == (fed1 if model_type == "lfm2" else (len(p1) + len(g1)) // 4 * 4)
    reused, got = reply(b, branch)
    assert reused == shared and got == hf_greedy(lm.model, branch, N)
    follow = p2 + g2 + [7, 8]  # the conversation's own follow-up still reuses all it was fed
    s2, shared2 = pool.take(follow)
    assert s2 is s and shared2 == len(p2) + len(g2) - 1
    b.close(), s2.close()


def test_another_message_goes_on_from_where_the_last_message_started(model):
    """A checkpoint where the prompt's last message starts (``mark``: the app and the server find it by rendering the
    chat without that message): another message in its place (a branch, an edit) goes on from there on a model that
    can go back only to checkpoints, not from the turn's start — with HF's greedy tokens."""
    name, m, lm = model
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    # ids no other test of this module sends: the model (and its prefix cache) is the module's, and a prompt another
    # chat already prefilled is served from that chat's pages past the mark, so no prefill passes it to checkpoint
    p1 = list(range(150, 190))
    _, g1 = reply(s, p1)
    head = p1 + g1 + [200, 201]  # the next message's template header, say
    msgs = [{"role": "user", "content": "-"}]
    s.start_rendered(head + list(range(202, 220)), msgs, mark=len(head),
                     sampling=SamplingConfig(max_new_tokens=N, ignore_eos=True))
    for _ in drive(s):
        pass
    other = head + list(range(230, 240))
    stats = s.start_rendered(other, msgs, sampling=SamplingConfig(max_new_tokens=N, ignore_eos=True))
    for _ in drive(s):
        pass
    assert stats.reused_tokens >= len(head) and list(s.generated_ids) == hf_greedy(m, other, N)
    assert s.cache.store.checkpoint_positions().count(len(head)) <= 1


def test_last_message_at_finds_where_the_last_message_starts(stories):
    from engine.model.chat import last_message_at, render_chat

    tok = stories.tokenizer
    msgs = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Tell me a story."}]
    ids = render_chat(tok, msgs)
    at = last_message_at(tok, msgs, len(ids), len(ids))
    assert tok.decode(ids[at:]).startswith("User: Tell me a story.")
    assert last_message_at(tok, msgs, len(ids) + 5, len(ids)) == at + 5  # a splice before it: the tail is the same
    assert last_message_at(tok, msgs[-1:], len(ids), len(ids)) == -1


@pytest.mark.parametrize("first,cut", [(106, 104), (60, 40), (120, 100)])
def test_a_branch_from_the_prefix_cache_outlives_the_checkpoints_it_drops(first, cut):
    """A branch before the live window, served by the prefix cache: going there drops the chat's checkpoints,
    and the window pages only a checkpoint still held go back to their arena, which may shrink then and forget
    the named free pages above those in use. The pages are held by name before that: the window holds them
    after, and the tokens are HF's (before, the window came back empty and the branch read no window)."""
    m, lm = tiny("gemma3_text", vocab_size=256)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    p1 = [5 + (i * 7) % 200 for i in range(first)]
    _, g1 = reply(s, p1, 2)
    fed = p1 + g1[:1]
    branch = fed[:cut] + [13]
    reused, got = reply(s, branch, 3)
    assert got == hf_greedy(m, branch, 3) and reused == cut
    win = next(iter(s.cache.store.windows.values()))
    assert win.held >= 8 - 1 and win.end == len(branch) + 2  # its window, then the 3 tokens' feeds but the last
    s.close()
    for arena in lm.arenas:
        assert arena.pool.num_used == 0


def test_a_setting_whose_page_limit_cannot_hold_the_checkpoints_drops_them_and_keeps_the_count():
    """A new setting whose page limit holds the chat but not its checkpoints' windows: the checkpoints that do
    not fit are left out (a later branch recomputes more), the switch goes through, and no page is left held
    by nobody (before, the pages copied for the first checkpoints stayed taken after the switch failed)."""
    from test_session_machine import check_pages

    m, lm = tiny("gemma3_text", vocab_size=256)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    p1 = [5 + (i * 7) % 200 for i in range(20)]
    _, g1 = reply(s, p1, 4)
    p2 = p1 + g1 + [9, 10]
    _, g2 = reply(s, p2, 2)
    before = s.cache.store.checkpoint_positions()
    assert len(before) >= 2 and s.cache.index.n <= 32
    s.apply(CacheConfig(mode="paged", page_size=16, max_pages=2))  # the chat: 2 pages; the window: 1 of its own
    check_pages(lm, [s])
    after = s.cache.store.checkpoint_positions()
    assert set(after) < set(before)  # the newest that fit are kept
    follow = p2 + g2 + [12, 13]
    reused, got = reply(s, follow, 3)
    assert reused == len(p2) + len(g2) - 1 and got == hf_greedy(m, follow, 3)
    s.close()
    for arena in lm.arenas:
        assert arena.pool.num_used == 0
