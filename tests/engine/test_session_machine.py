"""Every transition a user can make on chats, as a hypothesis state machine over real ``ChatSession`` objects on
the real stories260K model: new turn / regenerate / edit, steps, cache settings switched mid-reply and between
turns (every mode, page sizes 1-64, every precision pair, every policy with small budgets, page caps),
fork, swap out / in, cancel, close, several chats stepped together (batched decoding). After every rule the snapshot promises and the page bookkeeping are
checked; any error must be typed, and after one the chat must still take a new turn.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core import scheduler as batch
from engine import snapshot as snap
from engine.config import CacheConfig, SamplingConfig
from engine.kv.tier import disk as kv_disk
from engine.kv.paged.prefix import extend_chain
from engine.errors import CacheCapacityError, ContextOverflowError, EngineError, InternalError, SessionClosedError
from engine.model.fast_step import machine_refusal
from engine.core.session import ChatSession
from engine.core.vocab import RequestStatus

WORDS = ("once upon a time there was a little girl named lily she loved to play outside in the sun one day "
         "saw big red ball park tim dog max ran fast happy").split()
REFUSALS = (ContextOverflowError, CacheCapacityError)
SHARED_SYSTEM = ("You tell short stories about a little girl named Lily who loved to play outside in the sun with her "
                 "dog Max. ") * 2  # typed answers to requests that cannot fit
_MODEL: dict = {}
NO_COMPILE = machine_refusal(torch.device("cpu"))
STORIES_PATH = Path(os.environ.get("KVSCOPE_STORIES") or Path(__file__).resolve().parents[2] / "resources" / "models"
                    / "stories260K")  # as tests/conftest.py: the shipped copy


def stories_model(path):
    if "lm" not in _MODEL:
        from engine.model.fast_step import FastStep
        from engine.model.loader import load_model

        lm = load_model(str(path))
        lm.runner.fast = FastStep(lm, mode="off")  # one compiled step for every walk (the ``fast_step`` rule)
        _MODEL["lm"] = lm
    return _MODEL["lm"]


def _compiled_calls(fast) -> int:
    """Forwards run by a compiled package: the single step's and the batched step's."""
    return fast.calls.get("compiled", 0) + (fast.batch.calls.get("compiled", 0) if fast.batch is not None else 0)


@st.composite
def cache_configs(draw) -> CacheConfig:
    mode = draw(st.sampled_from(["off", "contiguous", "paged", "paged", "paged"]))
    page = draw(st.sampled_from([1, 2, 3, 4, 7, 8, 16, 33, 64]))
    kinds = ["auto", "int8", "int4", "tq4", "tq3", "tq2"] if mode == "paged" else ["auto"]
    k = draw(st.sampled_from(kinds + (["tq3-qjl"] if mode == "paged" else [])))  # QJL: keys only
    v = draw(st.sampled_from(kinds))
    policy = "none" if mode == "off" else draw(st.sampled_from(["none", "streaming", "h2o", "expected", "priority"]))
    params: dict = {}
    if policy == "streaming":
        params = {"sinks": draw(st.integers(0, 8)), "window": draw(st.integers(2, 96))}
    elif policy == "h2o":
        budget = draw(st.integers(8, 120))
        params = {"budget": budget, "recent": draw(st.integers(1, budget - 1))}
    elif policy == "expected":
        budget = draw(st.integers(8, 120))
        sinks = draw(st.integers(0, min(8, budget - 2)))
        params = {"budget": budget, "recent": draw(st.integers(1, budget - sinks - 1)), "sinks": sinks,
                  "queries": draw(st.sampled_from([1, 8, 128]))}
    elif policy == "priority":
        budget = draw(st.integers(8, 120))
        params = {"budget": budget, "recent": draw(st.integers(0, 16)),
                  "default_priority": draw(st.integers(0, 99))}
    overflows = ["stop"] if mode == "off" else ["stop", "truncate_middle", "rolling"]
    overflow = draw(st.sampled_from(overflows + (["policy"] if policy != "none" else [])))
    max_pages = draw(st.one_of(st.none(), st.none(), st.integers(2, 48))) if mode == "paged" else None
    return CacheConfig(mode=mode, page_size=page, k_dtype=k, v_dtype=v, policy=policy, policy_params=params,
                       overflow=overflow, max_pages=max_pages, prefix_reuse=draw(st.booleans()),
                       checkpoints=draw(st.sampled_from([8, 8, 1, 0])))


def _no_bug(r) -> None:
    """An ``InternalError`` is a bug in the engine (nothing in these walks simulates one): fail with its cause's
    traceback, which the walk's other checks (a forward the runner did not count, a reply that ended) would hide."""
    if isinstance(r, InternalError):
        cause = "".join(traceback.format_exception(r.__cause__)) if r.__cause__ is not None else "no cause"
        raise AssertionError(f"{r}\n{cause}")


@dataclass
class Chat:
    session: ChatSession
    history: list[dict] = field(default_factory=list)  # finished messages (ends with an assistant reply)
    asked: list[dict] | None = None  # the messages of the reply in progress


class ChatMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lm = dataclasses.replace(stories_model(STORIES_PATH), arenas=None)  # its own page arenas
        self.chats: list[Chat] = [Chat(ChatSession(self.lm, CacheConfig()))]
        self.draft_lm = None  # a draft model for speculation: this one, with its own page arena

    def _chat(self, i: int) -> Chat:
        return self.chats[i % len(self.chats)]

    # -- rules ---------------------------------------------------------------------------------------
    @rule(i=st.integers(0, 99), kind=st.sampled_from(["new", "new", "regenerate", "edit"]),
          words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=90), n=st.integers(1, 40),
          system=st.booleans(), pinned=st.booleans(), ignore_eos=st.booleans())
    def start(self, i, kind, words, n, system, pinned, ignore_eos):
        chat = self._chat(i)
        text = " ".join(words)
        hist = list(chat.history)
        if kind == "new" or not hist:
            msgs = hist + [{"role": "user", "content": text, "pinned": pinned}]
            if system and not hist:
                msgs.insert(0, {"role": "system", "content": "You tell short stories about " + words[0] + "."})
        elif kind == "regenerate":
            msgs = hist[:-1]
        else:
            msgs = hist[:-2] + [{"role": "user", "content": text}]
        sampling = SamplingConfig(max_new_tokens=n, ignore_eos=ignore_eos)
        if chat.session.generating:
            with pytest.raises(EngineError, match="already in progress"):
                chat.session.start(msgs, sampling)
            return
        try:
            chat.session.start(msgs, sampling)
        except REFUSALS:
            chat.history = []  # the user starts over (the chat no longer fits this setting)
            assert not chat.session.generating
            return
        chat.asked = msgs

    @rule(i=st.integers(0, 99), words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
          n=st.integers(1, 20), new=st.booleans(), page=st.sampled_from([16, 16, 4]))
    def start_shared(self, i, words, n, new, page):
        """A reply to a chat that starts with the one long system prompt every such chat shares (prefix cache):
        in a new chat of default settings, or in an existing one (whatever its settings)."""
        if new and len(self.chats) < 5:
            self.chats.append(Chat(ChatSession(self.lm, CacheConfig(page_size=page))))
            i = len(self.chats) - 1
        chat = self._chat(i)
        if chat.session.generating:
            return
        msgs = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": " ".join(words)}]
        try:
            st_ = chat.session.start(msgs, SamplingConfig(max_new_tokens=n))
        except REFUSALS:
            chat.history = []
            return
        assert 0 <= st_.disk_restored_tokens <= st_.shared_tokens <= st_.reused_tokens < st_.prompt_tokens
        chat.asked = msgs
        self._one_step(chat)  # the prefill: its full pages are named now

    @rule(i=st.integers(0, 99), n=st.integers(1, 12))
    def step(self, i, n):
        chat = self._chat(i)
        if not chat.session.generating:
            with pytest.raises(EngineError, match="no reply in progress"):
                chat.session.step()
            return
        for _ in range(n):
            if not self._one_step(chat):
                return

    @rule(i=st.integers(0, 99))
    def finish(self, i):
        chat = self._chat(i)
        for _ in range(400):
            if not chat.session.generating or not self._one_step(chat):
                break
        assert not chat.session.generating

    def _one_step(self, chat: Chat) -> bool:
        """One step; False once the reply ended (normally or with a typed error, then proven not wedged)."""
        try:
            r = chat.session.step()
        except EngineError as e:
            r = e
        return self._take(chat, r)

    def _take(self, chat: Chat, r) -> bool:
        _no_bug(r)
        if isinstance(r, EngineError):
            assert not chat.session.generating, f"{type(r).__name__} left the reply running"
            self._prove_not_wedged(chat)
            return False
        if isinstance(r, BaseException):
            raise r
        assert r.snapshot is not None
        if r.event is None:
            assert not r.done and r.snapshot.phase == "prefill"
        if r.done:
            assert r.stop_reason in ("eos", "stop_string", "max_tokens", "cancelled", "context_full")
            chat.history = chat.asked + [{"role": "assistant", "content": r.text}]
            chat.asked = None
            return False
        return True

    def _prove_not_wedged(self, chat: Chat) -> None:
        s = chat.session
        s.apply(CacheConfig(mode="paged", page_size=16))
        s.start([{"role": "user", "content": "Hi."}], SamplingConfig(max_new_tokens=3))
        while not s.step().done:
            pass
        chat.history, chat.asked = [], None

    @rule(n=st.integers(1, 8))
    def step_together(self, n):
        """Every chat with a reply in progress takes ``n`` steps; those that can, in one batched forward."""
        for _ in range(n):
            live = [c for c in self.chats if c.session.generating]
            if not live:
                return
            for chat, r in zip(live, batch.step_all([c.session for c in live])):
                self._take(chat, r)

    @precondition(lambda self: not NO_COMPILE)
    @rule(on=st.booleans())
    def fast_step(self, on):
        """Tools ▸ Compiled decode step, between or in the middle of replies: later one-token forwards of
        eligible chats run compiled (the compile is waited for here, once per test process; a model the step
        cannot serve says so and stays eager)."""
        fast = self.lm.fast
        fast.set_mode("on" if on else "off")
        if on and fast.model_refusal():
            assert fast.state == "off" and fast.reason == fast.model_refusal()
        elif on:
            fast.start()
            assert fast.wait(300) and fast.state == "on", fast.describe()

    @rule(i=st.integers(0, 99), cfg=cache_configs())
    def apply(self, i, cfg):
        s = self._chat(i).session
        old = s.cache_config
        try:
            notes = s.apply(cfg)
        except (ValueError, *REFUSALS) as e:
            assert s.cache_config == old, f"refused ({e}) but the setting changed"
            return
        assert s.cache_config == cfg and isinstance(notes, list)

    @rule(i=st.integers(0, 99), n=st.integers(0, 6), stop=st.booleans())
    def switch_with_reprefill(self, i, n, stop):
        """Mid-reply, a change that cuts the cache back below what the reply has read (eviction off after evicting:
        the evicted tokens come back; or the cache off and on again: every token read again): the re-prefill is
        tracked from the cut to what was read (or to the end of one still running), moves on with every forward,
        may be stopped between two of its forwards, and its time and tokens are the reply's re-prefill — not its
        TTFT, prompt or decode."""
        chat = self._chat(i)
        s = chat.session
        if not s.generating or s._ready or s.store is None or not s.index.next_pos:
            return
        cfg, fed, records = s.cache_config, s.index.next_pos, len(s.turn_state.reprefills)
        rs = s.turn_state.reprefills
        prev = rs[-1] if rs and rs[-1].running else None  # one still running: the new one reads through its end too
        until = max(fed, prev.start + prev.tokens) if prev is not None else fed
        try:
            if s.index.intact < s.index.n and s.policy is not None:
                s.apply(cfg.replace(policy="none", policy_params={}, overflow="stop"))
            elif s.turn_state.generated:  # (before its first token, cache off reads the prompt anew: no re-prefill)
                s.apply(CacheConfig(mode="off"))
                s.apply(cfg)
            else:
                return
        except (ValueError, *REFUSALS):
            return  # the chat no longer fits the context with the cache off, or the policy's refusal
        rs = s.turn_state.reprefills
        r = rs[-1] if rs and (len(rs) > records or prev is not None) else None
        if s.index.next_pos >= fed:
            assert r is None or not r.running or r.start + r.tokens >= fed
            return
        assert r is not None and r.running and r.start == s.index.next_pos and r.start + r.tokens == until
        assert r.estimate_ms > 0 and r.done == 0 and r.new == s.cache_config
        done = 0
        for k in range(n):
            if stop and k == n - 1:  # Stop after k forwards of it: it lands between two
                self.cancel(i)  # (tokens a verification already accepted go out first, as the cancel rule knows)
                st_ = s.last_stats
                assert not s.generating and st_.reprefilled_tokens == sum(x.done for x in st_.reprefills) >= done
                return
            try:
                res = s.step()
            except EngineError as e:
                self._take(chat, e)
                return
            if res.reprefill is not None:
                assert res.reprefill.done >= done and res.reprefill.tokens == r.tokens
                done = res.reprefill.done
                assert res.event is None or not res.reprefill.running  # no token before it is read again
            if res.done:
                st_ = s.last_stats
                assert st_.reprefilled_tokens == sum(x.done for x in st_.reprefills) >= done
                assert st_.reprefill_ms >= 0 and st_.ttft_ms >= 0
                assert res.stop_reason != "cancelled"
                chat.history, chat.asked = chat.asked + [{"role": "assistant", "content": res.text}], None
                return
            self._take(chat, res)

    @invariant()
    def reprefills_add_up(self):
        for chat in self.chats:
            rs = chat.session.turn_state.reprefills
            assert all(0 <= r.done <= r.tokens and r.ms >= 0 for r in rs)
            assert not any(r.running for r in rs[:-1]), "only the last re-prefill may still run"

    @rule(i=st.integers(0, 99))
    def apply_invalid(self, i):
        s = self._chat(i).session
        old = s.cache_config
        with pytest.raises(ValueError):
            s.apply(CacheConfig(mode="contiguous", k_dtype="int8"))
        assert s.cache_config == old

    @precondition(lambda self: len(self.chats) < 5)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        chat = self._chat(i)
        if chat.session.generating:
            with pytest.raises(EngineError):
                chat.session.fork()
            return
        try:
            other = chat.session.fork()
        except REFUSALS:
            return
        assert other.seq == chat.session.seq
        self.chats.append(Chat(other, list(chat.history)))

    @rule(i=st.integers(0, 99))
    def swap_out(self, i):
        s = self._chat(i).session
        if s.generating:
            with pytest.raises(EngineError):
                s.swap_out()
            return
        held = s.cached_tokens
        moved = s.swap_out()
        assert (moved > 0) == (held > 0 and s.store is not None) or s.offloaded

    @rule(i=st.integers(0, 99))
    def cancel(self, i):
        chat = self._chat(i)
        verified = len(chat.session._ready)  # a verification's tokens still to hand out go out first
        chat.session.cancel()
        if chat.session.generating:
            got = []
            while not (got and got[-1].done) and len(got) <= verified:
                got.append(chat.session.step())
            r = got[-1]
            assert r.done
            assert all(not x.done and x.event is not None for x in got[:got.index(r)])
            # cancelled, or a stop the verification had already reached (its last token was the reply's last)
            assert r.stop_reason == "cancelled" or (verified and got.index(r) == verified - 1)
            chat.history, chat.asked = chat.asked + [{"role": "assistant", "content": r.text}], None

    @rule(i=st.integers(0, 99), method=st.sampled_from(["off", "ngram", "ngram", "draft"]),
          k=st.sampled_from([0, 1, 3, 8]))
    def speculate(self, i, method, k):
        """Speculative decoding on, off, another drafter or k — mid-reply or between turns."""
        self._speculate(self._chat(i).session, method, k)

    def _speculate(self, s: ChatSession, method: str, k: int) -> None:
        from engine.speculation.draft_model import ModelDrafter
        from engine.core.verify import SpecConfig

        cfg = SpecConfig(method=method, draft_tokens=k, draft_path="stories260K" if method == "draft" else "")
        if method == "draft" and self.draft_lm is None:  # the model drafting for itself, on its own cache
            self.draft_lm = dataclasses.replace(self.lm, arenas=None)
        drafter = ModelDrafter(self.draft_lm, self.lm) if method == "draft" else None
        note = s.speculate(cfg, drafter)
        assert (s.spec is None) == (method == "off") and note

    @precondition(lambda self: len(self.chats) > 1)
    @rule(i=st.integers(0, 99))
    def close(self, i):
        chat = self.chats.pop(i % len(self.chats))
        was = chat.session.generating
        chat.session.close()
        if was:
            with pytest.raises(SessionClosedError):
                chat.session.step()

    @precondition(lambda self: len(self.chats) < 5)
    @rule(cfg=cache_configs())
    def new_chat(self, cfg):
        try:
            self.chats.append(Chat(ChatSession(self.lm, cfg)))
        except ValueError as e:  # a setting this model cannot run, refused with its reason
            assert str(e)

    @rule(on=st.booleans())
    def disk_tier(self, on):
        """The KV disk tier on (a folder of this walk: full pages written, later prompts restore them) or off."""
        if getattr(self, "disk_dir", None) is None:
            self.disk_dir = tempfile.mkdtemp(prefix="kvscope-machine-")
        kv_disk.configure(self.lm, self.disk_dir if on else None)

    @rule()
    def disk_restart(self):
        """As after a restart: pages nobody holds leave memory, so the next prompts take them from disk (or prefill)."""
        if self.lm.arenas is not None and self.lm.arenas.disk is not None:
            self.lm.arenas.disk.flush()
        for arena in self.lm.arenas or []:
            for p in arena.pool.cached_pages():
                arena.pool.unhash(p)

    @rule(i=st.integers(0, 99), n=st.integers(1, 12))
    def disk_reopen(self, i, n):
        """A chat reopened after a restart (disk tier on): a new session on its setting, its messages and a new
        question; its pages come from disk where the tier has them, the rest is prefilled."""
        chat = self._chat(i)
        if chat.session.generating or not chat.history or id(chat) in getattr(self, "on_core", {}):
            return
        if self.lm.arenas is None or self.lm.arenas.disk is None:
            self.disk_tier(True)
        cfg = chat.session.cache_config
        chat.session.close()
        self.disk_restart()
        chat.session = ChatSession(self.lm, cfg)
        msgs = chat.history + [{"role": "user", "content": "then what"}]
        try:
            st_ = chat.session.start(msgs, SamplingConfig(max_new_tokens=n))
        except REFUSALS:
            chat.history = []
            return
        assert 0 <= st_.disk_restored_tokens <= st_.shared_tokens <= st_.reused_tokens < st_.prompt_tokens
        chat.asked = msgs

    @rule(k=st.integers(0, 999), how=st.sampled_from(["flip", "truncate", "delete"]))
    def disk_damage(self, k, how):
        """A page file altered, cut short or deleted: the page is dropped and recomputed, never read."""
        tier = self.lm.arenas.disk if self.lm.arenas is not None else None
        if tier is None:
            return
        tier.flush()
        files = sorted(Path(self.disk_dir).glob("*/*.kvp"))
        if not files:
            return
        f = files[k % len(files)]
        raw = f.read_bytes()
        if how == "delete":
            f.unlink()
        else:
            f.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0x40]) if how == "flip" else raw[:len(raw) // 2])

    # -- invariants ----------------------------------------------------------------------------------
    @invariant()
    def snapshots_tell_the_truth(self):
        for chat in self.chats:
            check_snapshot(chat.session)

    @invariant()
    def pages_are_conserved(self):
        check_pages(self.lm, [c.session for c in self.chats])

    @invariant()
    def no_provisional_slot_survives_a_step(self):
        """A verification's rejected slots are cut back in the step that wrote them: the store holds exactly the
        index's tokens, and an intact cache holds only tokens of the chat (the last one still unfed)."""
        for chat in self.chats:
            s = chat.session
            if s.store is None or s.offloaded:
                continue
            assert s.store.num_tokens == s.index.n
            if s.index.intact == s.index.n and s.index.n:
                assert s.index.n <= len(s.seq) - (1 if s.generating and not s._ready else 0)

    @invariant()
    def the_compiled_step_never_failed(self):
        fast = self.lm.fast_step
        assert fast is None or fast.state != "failed", fast.describe()

    def teardown(self):
        if self.lm.fast_step is not None:
            self.lm.fast_step.set_mode("off")
        for chat in self.chats:
            chat.session.close()
        if getattr(self, "disk_dir", None) is not None:
            kv_disk.configure(self.lm, None)
            shutil.rmtree(self.disk_dir, ignore_errors=True)
        for lm in (self.lm, self.draft_lm):
            for arena in (lm.arenas or []) if lm is not None else []:
                assert arena.pool.num_used == 0, "pages still held after every session closed"
                arena.pool.check()


class SlidingChatMachine(ChatMachine):
    """The same walks on a model whose layers differ: a tiny Gemma 3 (3 sliding layers, window 8, and a full
    one) with stories260K's tokenizer, so windows slide, pages come and go in two pools and prefix reuse is cut
    back to what the windows still hold."""

    model_type = "gemma3_text"
    layer_types = ["sliding_attention"] * 3 + ["full_attention"]

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.lm = tiny_model(self.model_type, self.layer_types)
        self.chats = [Chat(ChatSession(self.lm, CacheConfig()))]
        self.draft_lm = None


    @rule(i=st.integers(0, 99), back=st.integers(0, 60), words=st.lists(st.sampled_from(WORDS), max_size=6),
          n=st.integers(1, 8))
    def branch_from_cache(self, i, back, words, n):
        """A branch from a point of what the chat's cache was fed (a checkpoint, the live end, or neither): its
        greedy tokens equal a fresh session's that recomputes the whole prompt — tokens never depend on whether
        a checkpoint was used — and its account sums up."""
        chat = self._chat(i)
        s = chat.session
        cfg = s.cache_config
        if s.generating or s.closed or s.store is None or cfg.k_dtype != "auto" or cfg.v_dtype != "auto" \
                or cfg.policy != "none" or cfg.overflow != "stop":
            return
        fed = s.fed_ids()
        extra = s.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"] if words else []
        ids = fed[:max(1, len(fed) - back)] + list(extra) + [13]
        if len(ids) + n >= s.context_length:
            return
        sampling = SamplingConfig(max_new_tokens=n, ignore_eos=True)
        got = self._greedy(s, ids, sampling)
        a = s.last_stats.cache
        assert a.reused + a.recomputed + a.dropped == a.prompt == len(ids)
        assert sum(m.tokens for m in a.misses) == a.recomputed
        fresh = ChatSession(self.lm, CacheConfig(mode="paged", page_size=cfg.page_size, prefix_reuse=False))
        try:
            assert got == self._greedy(fresh, ids, sampling), "a checkpoint changed the tokens"
        finally:
            fresh.close()
        chat.history = []  # the chat's messages no longer say what its cache holds

    @staticmethod
    def _greedy(s: ChatSession, ids, sampling) -> list[int]:
        s.start_ids(ids, sampling)
        while not s.step().done:
            pass
        return list(s.generated_ids)


class StateChatMachine(SlidingChatMachine):
    """A hybrid model: a tiny LFM2 (two short-convolution layers with a fixed state, two full attention)."""

    model_type = "lfm2"
    layer_types = ["conv", "full_attention", "conv", "full_attention"]


def tiny_model(model_type: str, layer_types: list[str]):
    """A fresh-arena copy of a tiny seeded model of ``model_type`` with stories260K's tokenizer."""
    if model_type not in _MODEL:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from engine.config import ModelSpec
        from engine.model.loaded import wrap_model

        cfg = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, sliding_window=8, layer_types=layer_types)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        _MODEL[model_type] = wrap_model(model, stories_model(STORIES_PATH).tokenizer, ModelSpec(source="test"),
                                        "cpu", "CPU", name=f"tiny {model_type}", path=None, is_demo=True)
    return dataclasses.replace(_MODEL[model_type], arenas=None)


def check_snapshot(s: ChatSession) -> None:
    sn = s.snapshot()
    for f in dataclasses.fields(sn):
        v = getattr(sn, f.name)
        if isinstance(v, np.ndarray):
            assert not v.flags.writeable, f"snapshot.{f.name} is writable"
    assert len(sn.token_state) == sn.seq_len == len(s.seq)
    states = sn.token_state
    if s.store is None:
        assert (states == snap.TOKEN_NOT_CACHED).all() and sn.kv_bytes == 0 and sn.tokens_per_layer.max() == 0
        return
    s.index.check()
    assert sn.evicted_total == int(np.count_nonzero(states == snap.TOKEN_EVICTED))
    assert not set(sn.evicted_positions) & set(np.nonzero(states != snap.TOKEN_EVICTED)[0].tolist())
    if s.offloaded:
        assert s.host.n == s.index.n and s.store.num_tokens == 0
        return
    kinds = s.info.layer_kinds or ("full",) * s.info.num_layers
    full = sn.tokens_per_layer[[i for i, k in enumerate(kinds) if k == "full"]]
    assert s.store.num_tokens == s.index.n and (len(full) == 0 or full.max() == s.index.n)
    assert len(full) == 0 or full.max() <= sn.capacity_tokens, (full.max(), sn.capacity_tokens)
    if sn.mode == "paged" and not hasattr(s.store, "page_groups"):
        pages = s.store.table.pages
        assert sn.pages_used_per_layer[0] == len(pages) == -(-s.index.n // sn.page_size)
        assert all(s.store.arena.pool.ref[p] >= 1 for p in pages)
        assert (sn.page_state[pages] != snap.PAGE_FREE).all()
        model = sn.page_groups[0][1] if sn.page_groups else sn.num_pages  # a draft model's pool comes after
        assert set(np.flatnonzero(sn.page_mine[:model]).tolist()) == set(pages)  # "this chat's" pages are its own
        check_draft_pool(s, sn, model)
    for w, win in getattr(s.store, "windows", {}).items():  # a window holds its window, from whole pages
        page = win.arena.page_size
        assert win.held <= w - 1 + page - 1 or win.base == 0, (w, page, win.base, win.held)
        assert len(win.inner.table.pages) == -(-win.held // page)


def check_draft_pool(s: ChatSession, sn, model: int) -> None:
    """A chat drafting with a draft model shows that model's pool after its own, its own draft pages marked."""
    draft = getattr(s.spec.drafter, "cache", None) if s.spec is not None else None
    if draft is None or draft.store is None:
        assert len(sn.page_groups) < 2 or sn.page_groups[-1][0] != "draft model"
        return
    assert sn.page_groups[-1] == ("draft model", sn.num_pages - model)
    assert set(np.flatnonzero(sn.page_mine[model:]).tolist()) == set(draft.store.table.pages)


def check_pages(lm, sessions: list[ChatSession]) -> None:
    if lm.arenas is None:
        return
    for arena in lm.arenas:
        pool = arena.pool
        pool.check()
        counts = [0] * pool.num_pages
        for s in sessions:
            parts = s.store.page_groups() if hasattr(s.store, "page_groups") else [("", s.store)]
            for cp in getattr(s.store, "checkpoints", ()):  # a checkpoint's windows share pages too
                parts += [("checkpoint", kept.inner) for kept in cp.windows.values()]
            for _, store in parts:
                if getattr(store, "arena", None) is arena:
                    for p in store.table.pages:
                        counts[p] += 1
        assert counts == pool.ref, "page reference counts do not match the block tables"
        assert pool.num_free + sum(1 for c in counts if c) == pool.num_pages
        cached = set(pool.cached_pages())
        for p in range(pool.num_pages):  # free, cached with no owner, or held by exactly `ref` tables
            if counts[p] == 0:
                assert (pool.hash[p] is None) != (p in cached), f"page {p}: neither free nor cached"
                assert pool.session[p] == -1 and pool.owner[p] == -1
            else:
                assert p not in cached and pool.ref[p] == counts[p]
            if pool.hash[p] is not None:
                assert pool.lookup(pool.hash[p]) == p and pool.fill[p] == pool.page_size
        for s in sessions:  # a held page's name is the chain of the tokens this session holds there, intact
            store = s.store
            if getattr(store, "arena", None) is not arena or not hasattr(store, "table"):
                continue
            P = pool.page_size
            chain = extend_chain([], s.seq, P, s.index.intact // P)
            pages = store.table.pages
            for j, p in enumerate(pages):
                if pool.hash[p] is None:
                    continue
                if j == len(pages) - 1 and store.num_tokens % P:
                    continue  # cut back into a named page: still whole; unnamed (or copied, if shared) before a write
                assert j < len(chain) and chain[j] == pool.hash[p], f"page {p} named for other tokens"


@dataclass
class ApiReq:
    """An API-style request on the engine core: a fresh lossless session, greedy, its tokens checked against HF."""

    session: ChatSession
    request: object
    prompt: list[int]
    n: int
    results: list = field(default_factory=list)


class CoreMachine(ChatMachine):
    """The same chats, plus the engine core (``engine.core.scheduler.EngineCore``) with several sources at once: chats
    handed to it as requests (the app's chat, at any priority), API requests (fresh lossless sessions, greedy,
    cancelled at random) and a comparison task, stepped by ``round`` among every other rule. Invariants beyond
    the chat machine's: every model forward went through the runner; an API request's tokens are HF's greedy
    ones whatever shared its forwards; a cancelled request's pages are free by the next step."""

    def __init__(self) -> None:
        super().__init__()
        from engine.core.scheduler import EngineCore

        self.core = EngineCore(self.lm)
        self.api: list[ApiReq] = []
        self.on_core: dict[int, object] = {}  # id(chat) -> its request
        self.comparison = None
        self.hf_calls = 0
        self.hooked = [0]
        self.hook = self.lm.model.register_forward_pre_hook(lambda *a: self.hooked.__setitem__(0, self.hooked[0] + 1))
        self.base = (self.lm.runner.forwards, _compiled_calls(self.lm.fast))

    @precondition(lambda self: len(self.api) < 4)
    @rule(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=30), n=st.integers(1, 24),
          priority=st.sampled_from([0, 1, 2]), spec=st.sampled_from(["off", "off", "ngram", "draft"]))
    def api_request(self, words, n, priority, spec, cfg: CacheConfig | None = None):
        from engine.core.scheduler import Priority, Request

        s = ChatSession(self.lm, cfg or CacheConfig())
        if spec != "off":
            self._speculate(s, spec, 0)
        ids = self.lm.tokenizer(" ".join(words))["input_ids"]
        try:
            s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True, temperature=0.0))
        except REFUSALS:
            s.close()
            return
        req = ApiReq(s, None, ids, n)
        req.request = self.core.add(Request(s, req.results.append, Priority(priority)))
        self.api.append(req)

    @precondition(lambda self: len(self.api) < 4)
    @rule(i=st.integers(0, 99), words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=30),
          n=st.integers(1, 24), priority=st.sampled_from([0, 1, 2]))
    def api_request_in_a_chats_pool(self, i, words, n, priority):
        """An API request (lossless) on a chat's page pool, its page cap too: where the chat's reply ended on the
        core and holds the pages the request needs, the KV manager swaps them to host memory (the chat's next
        message brings them back); the invariants check both."""
        c = self._chat(i).session.cache_config
        paged = c.mode == "paged"
        self.api_request(words, n, priority, "off", CacheConfig(page_size=c.page_size, max_pages=c.max_pages)
                         if paged else CacheConfig())

    @precondition(lambda self: len(self.api) < 4)
    @rule(pages=st.integers(12, 40), words=st.lists(st.sampled_from(WORDS), min_size=4, max_size=30),
          n=st.integers(8, 40), priority=st.sampled_from([0, 1, 2]))
    def api_request_beside_an_ended_chat(self, pages, words, n, priority):
        """A chat on a small pool (4-token pages, ``pages`` of them) replies on the core and its reply ends (the
        chat kept open); then an API request on that pool: the pages it needs come from the ended chat's idle cache
        (swapped to host memory) before a "KV cache full" — it fails only when it cannot fit the pool alone."""
        cfg = CacheConfig(page_size=4, max_pages=pages, prefix_reuse=False)
        self.chats.append(Chat(ChatSession(self.lm, cfg)))
        i = len(self.chats) - 1
        self.start(i, "new", words, n, False, False, True)
        self.chat_on_core(i, 2)
        while self.chats[i].session.generating:
            self._round()
        self.api_request(words[::-1], n, priority, "off", cfg)
        req = self.api[-1] if self.api and self.api[-1].session.cache_config == cfg else None
        key = req.session.pool_key() if req is not None else None
        for _ in range(400):  # the chat's reply and the request's each end within their tokens' rounds
            if req is None or req not in self.api:
                break
            self._round()
        assert req is None or req not in self.api, "a request waited forever"
        held = any(c.session.generating and c.session.pool_key() == key for c in self.chats)  # replies going on
        if req is not None and isinstance(req.results[-1], CacheCapacityError) and not held:
            assert len(req.prompt) + req.n > pages * 4 - 4, (len(req.prompt), req.n, pages)  # it alone did not fit

    @precondition(lambda self: len(self.api) < 4)
    @rule(pages=st.integers(49, 60), words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
          n=st.integers(8, 40), priority=st.sampled_from([0, 1, 2]), first=st.booleans())
    def api_request_beside_the_chat_on_screen(self, pages, words, n, priority, first):
        """The chat on screen (on the core, its reply filling its pool but 4 slots: ``pages`` pages of 2 tokens, a
        pool of this rule's own) and an API request there that fits the pool alone, started before the chat
        (``first``: it holds pages first) or after it: the one that comes second (a lower priority, or as high
        and younger) waits while the other holds the pages it needs (preempted, holding none) and goes on once
        they are free. Neither fails, both end by their own stop, the request's tokens HF's greedy ones; no
        livelock (as high a priority: the older goes first)."""
        from engine.core.scheduler import Priority, Request

        cfg = CacheConfig(page_size=2, max_pages=pages, prefix_reuse=False)
        front, ends, ids = ChatSession(self.lm, cfg), [], self.lm.tokenizer(" ".join(words))["input_ids"]
        try:
            for turn in ("api", "chat") if first else ("chat", "api"):
                if turn == "api":
                    self.api_request(words[::-1], n, priority, "off", cfg)
                    req = self.api[-1]
                else:
                    front.start_ids(ids, SamplingConfig(max_new_tokens=pages * 2 - len(ids) - 3, ignore_eos=True))
                    self.core.add(Request(front, ends.append, Priority.FOREGROUND))
                self._round(), self._round()
            for _ in range(4 * pages):
                if req not in self.api and not front.generating:
                    break
                if req in self.api and req.request.status is RequestStatus.PREEMPTED:
                    assert req.session.cached_tokens == 0  # a waiting request holds no page
                self._round()
            assert req not in self.api and not front.generating, "two requests waited on each other"
            last = req.results[-1]
            assert not isinstance(last, BaseException) and last.stop_reason == "max_tokens", last
            assert [r.event.token_id for r in req.results if r.event is not None] == self._hf(req.prompt, n)
            assert not isinstance(ends[-1], BaseException) and ends[-1].stop_reason == "max_tokens", ends[-1]
        finally:
            front.close()

    @rule(i=st.integers(0, 99), priority=st.sampled_from([0, 1, 2]))
    def chat_on_core(self, i, priority):
        """The chat's reply is stepped by the core from now on (as the app's worker does)."""
        from engine.core.scheduler import Priority, Request

        chat = self._chat(i)
        if not chat.session.generating or id(chat) in self.on_core:
            return
        self.on_core[id(chat)] = self.core.add(
            Request(chat.session, lambda r, chat=chat: self._take(chat, r), Priority(priority)))

    @precondition(lambda self: self.comparison is None)
    @rule(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=8))
    def compare(self, words):
        from engine.tools.compare import Comparison
        from engine.core.scheduler import Task

        comp = Comparison(self.lm, [{"role": "user", "content": " ".join(words)}],
                          SamplingConfig(max_new_tokens=4), settings=(("paged", CacheConfig()),
                                                                      ("contiguous", CacheConfig(mode="contiguous"))))
        self.comparison = comp
        self.core.add_task(Task(comp, lambda row: None, self._compare_failed))

    def _compare_failed(self, e: BaseException) -> None:
        _no_bug(e)
        assert isinstance(e, EngineError), e

    @rule(i=st.integers(0, 99), method=st.sampled_from(["off", "ngram", "draft"]), k=st.sampled_from([0, 2, 5]))
    def speculate_api(self, i, method, k):
        """An API request's speculation changes mid-reply: its tokens must stay HF's."""
        if self.api:
            self._speculate(self.api[i % len(self.api)].session, method, k)

    @rule(i=st.integers(0, 99))
    def cancel_api(self, i):
        """A client goes away: its request ends (cancelled) in the next round — after the tokens a verification
        already took, one a round — and its pages are free after it."""
        if not self.api:
            return
        req = self.api[i % len(self.api)]
        verified = len(req.session._ready)  # a verification's tokens still to hand out go out first, one a round
        req.request.cancel()
        for _ in range(verified + 1):
            self._round()
            if req not in self.api:
                break
        assert req not in self.api  # ended and closed by the round
        # cancelled, or a stop the verification had already reached (its last token was the reply's last)
        assert req.results[-1].stop_reason == "cancelled" or verified

    @rule(n=st.integers(1, 10))
    def core_round(self, n):
        for _ in range(n):
            self._round()

    def _round(self) -> None:
        self.core.round()
        for req in list(self.api):
            if req.request.done:
                self._end_api(req)
        for key, request in list(self.on_core.items()):
            if request.done or not request.session.generating:
                del self.on_core[key]
        if self.comparison is not None and self.comparison.done:
            self.comparison = None

    def _end_api(self, req: ApiReq) -> None:
        """As the server does: a finished request's reply is checked, its session closed (pages freed now)."""
        self.api.remove(req)
        last = req.results[-1]
        if isinstance(last, BaseException):
            _no_bug(last)
            assert isinstance(last, EngineError), last
        elif last.stop_reason == "max_tokens" and not req.request.preempted:
            got = req.session.generated_ids
            assert got == self._hf(req.prompt, req.n), "a request's tokens depended on what shared its forwards"
        req.session.close()
        assert req.session.cached_tokens == 0

    def _hf(self, ids: list[int], n: int) -> list[int]:
        before = self.hooked[0]
        with torch.inference_mode():
            out = self.lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        self.hf_calls += self.hooked[0] - before
        return out[0, len(ids):].tolist()

    @invariant()
    def every_forward_went_through_the_runner(self):
        runner, fast = self.lm.runner, self.lm.fast
        ours = runner.forwards - self.base[0]
        compiled = _compiled_calls(fast) - self.base[1]  # the packages' calls skip the model's hook
        assert self.hooked[0] - self.hf_calls == ours - compiled, (self.hooked[0], self.hf_calls, ours, compiled)

    @invariant()
    def one_lifecycle(self):
        """A request's status is its reply's: its session replies exactly while the request is not finished."""
        for request in [r.request for r in self.api] + list(self.on_core.values()):
            if request.reply is request.session.turn_state:
                assert request.done == (not request.session.generating), (request.status, request.session.closed)

    @invariant()
    def a_waiting_request_holds_no_page(self):
        """A preempted request (waiting for room) gave its pages up: the requests before it have them."""
        for req in self.api:
            if req.request.status is RequestStatus.PREEMPTED:
                assert req.session.cached_tokens == 0, req.session.cached_tokens

    @invariant()
    def pages_are_conserved(self):
        extra = [r.session for r in self.api]
        if self.comparison is not None and self.comparison._session is not None:
            extra.append(self.comparison._session)
        check_pages(self.lm, [c.session for c in self.chats] + extra)

    def teardown(self):
        self.hook.remove()
        for req in self.api:
            req.session.close()
        if self.comparison is not None:
            self.comparison.close()
        super().teardown()


TestChatMachine = ChatMachine.TestCase
# CI runs a fixed set of walks (derandomized: a red CI run is a reproducible bug, not luck); set
# KVSCOPE_FUZZ=N to explore N random walks instead.
_FUZZ = int(os.environ.get("KVSCOPE_FUZZ", "0"))
TestChatMachine.settings = settings(max_examples=_FUZZ or 150, stateful_step_count=40, deadline=None,
                                    derandomize=not _FUZZ, suppress_health_check=list(HealthCheck))


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=_FUZZ or 60, stateful_step_count=40, deadline=None,
                                    derandomize=not _FUZZ, suppress_health_check=list(HealthCheck))


TestSlidingChatMachine = SlidingChatMachine.TestCase
TestSlidingChatMachine.settings = settings(max_examples=_FUZZ or 60, stateful_step_count=40, deadline=None,
                                           derandomize=not _FUZZ, suppress_health_check=list(HealthCheck))
TestStateChatMachine = StateChatMachine.TestCase
TestStateChatMachine.settings = TestSlidingChatMachine.settings
