"""``ChatSession``: a conversation (``engine.core.sequence.Sequence``) with its KV cache (``engine.core.seq_cache.SeqCache``)
on a loaded model, generated step by step::

    s.start(messages, sampling, generation_id)   # render, reuse the cached prefix, plan the prefill
    while not (r := s.step()).done:               # one model forward per step (a long prefill: one chunk)
        show(r.event, r.snapshot)                 # r.event is None for a prefill chunk
    s.apply(CacheConfig(...))                     # allowed between any two steps, also mid-reply

One step implementation: ``step()`` is ``prepare()`` (the next forward planned and reserved: a ``Work``), the
model runner's forward, then ``finish(output)`` or ``abort(exc)``; the engine core (``engine.core.scheduler``) runs
the same three with several sessions' work in one forward. An exception rolls the forward back, ends the
reply and is raised typed (``EngineError``); the next ``start()`` works.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator, Sequence as Seq

import numpy as np
import torch

from engine.core import observe, reconfigure, reprefill
from engine.model.splice import splice
from engine.model.chat import (StreamDecoder, encode_prompt, last_message_at, message_spans, render_chat,
                               validate_messages)
from engine.config import CacheConfig, SamplingConfig
from engine.errors import EngineError, SessionClosedError
from engine.model.loaded import LoadedModel
from engine.core.sampling import Sampler
from engine.core.seq_cache import SeqCache
from engine.core.sequence import NullDecoder, Sequence, TurnState, check_fits, prefill_chunk
from engine.snapshot import TOKEN_EVICTED, CacheSnapshot, TurnStats
from engine.core import speculation_setup as spec_setup
from engine.core.verify import SpecConfig, Speculator
from engine.core.step import Stepping
from engine.model.threads import apply as apply_threads
from engine.quant.modules import parameter_count

_session_ids = itertools.count(1)
_generation_ids = itertools.count(1)


def _via(part: str, name: str, doc: str = "") -> property:
    """A read-only view of ``self.<part>.<name>`` (the part owns it; callers read it here)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class ChatSession(Stepping):
    """A conversation with a model and its own KV cache. Not thread-safe: drive it from one thread. Its steps
    (``step``, ``prepare`` / ``finish`` / ``abort``) are ``engine.core.step.Stepping``'s."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None) -> None:
        self.lm, self.model, self.tokenizer, self.info = loaded, loaded.model, loaded.tokenizer, loaded.info
        self.session_id = next(_session_ids)
        self.cache = SeqCache(loaded, cache or CacheConfig(), self.session_id)
        self.sequence = Sequence()
        self.prefill_chunk = prefill_chunk(parameter_count(self.model), loaded.device.type)
        self._open = None  # the prepared forward (``engine.core.step.OpenStep``)
        self.spec: Speculator | None = None  # speculative decoding (``speculate``)
        self._ready: list = []  # a verification's tokens still to hand out (``engine.core.step``)
        self._proposal = None  # the next forward's drafts, proposed once (``engine.core.step``)

    seq = _via("sequence", "ids", "every token of the conversation so far")
    turn, generation_id, turn_state = _via("sequence", "turn"), _via("sequence", "generation_id"), _via("sequence", "reply")
    notes, protected, priorities = _via("sequence", "notes"), _via("sequence", "protected"), _via("sequence", "priorities")
    last_stats = _via("sequence", "last_stats")
    store, index, policy, host = _via("cache", "store"), _via("cache", "index"), _via("cache", "policy"), _via("cache", "host")
    cache_config, evictor = _via("cache", "cache_config"), _via("cache", "evictor")
    cached_tokens = _via("cache", "n", "tokens per layer in the cache now")

    generating = property(lambda self: self.sequence.running, doc="a reply is in progress")
    closed = property(lambda self: self.sequence.closed)
    offloaded = property(lambda self: self.cache.host is not None, doc="the K/V are in host memory (swapped)")
    context_length = property(lambda self: self.info.context_length)
    generated_ids = property(lambda self: self.sequence.generated(), doc="the reply's tokens so far")

    @property
    def evicted_total(self) -> int:
        """Tokens fed so far that no layer holds any more (evicted, or dropped to fit the context)."""
        return int(np.count_nonzero(observe.token_state(self.sequence, self.cache) == TOKEN_EVICTED))

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this chat's session was closed: start a new one")

    # -- starting a reply ----------------------------------------------------------------------------------
    def start(self, messages: Seq[dict], sampling: SamplingConfig | None = None,
              generation_id: int | None = None) -> TurnStats:
        """Begin a reply to ``messages`` (system, history, the new user message), reusing the cached prefix the
        rendered chat shares (regenerate and edit: exactly the common prefix). ``pinned``/``priority`` on a message
        feed the priority policy; system prompt and first user message are protected from eviction.
        ``ContextOverflowError`` when the chat cannot fit and the overflow setting is ``stop``."""
        self.check_open()
        messages = validate_messages(messages)
        fresh = render_chat(self.tokenizer, messages, model=self.info.name)
        ids = self.with_fed_ids(fresh)
        spans = message_spans(self.tokenizer, messages) if self.cache_config.needs_spans else []
        mark = last_message_at(self.tokenizer, messages, len(ids), len(fresh)) if self.cache.wants_mark() else -1
        return self._begin(ids, sampling or SamplingConfig(), generation_id, messages, spans, mark)

    def fed_ids(self) -> list[int]:
        """The ids this chat's cache was fed, in order (its last reply's included, but the last token)."""
        return self.cache.fed_ids(self.sequence.ids)

    def with_fed_ids(self, ids: list[int]) -> list[int]:
        """``ids`` (the chat rendered afresh) holding the ids this chat's cache was fed wherever they spell the
        same text (``engine.model.splice``): a follow-up then reuses the reply, not only the prompt before it."""
        if not self.cache_config.prefix_reuse:
            return ids
        return splice(self.tokenizer, self.fed_ids(), ids).ids

    def start_rendered(self, ids: Seq[int], messages: Seq[dict], spans: Seq[tuple[int, int]] = (),
                       sampling: SamplingConfig | None = None, generation_id: int | None = None,
                       mark: int = -1) -> TurnStats:
        """``start`` for ``messages`` rendered already (``ids``; ``spans`` where a policy needs them; ``mark``: where
        the last message starts, -1 unknown): the server renders and tokenizes on a thread of its own, so the
        engine thread never waits for a tokenizer."""
        self.check_open()
        return self._begin([int(i) for i in ids], sampling or SamplingConfig(), generation_id,
                           validate_messages(messages), list(spans), mark)

    def start_completion(self, prompt: str, sampling: SamplingConfig | None = None,
                         generation_id: int | None = None) -> TurnStats:
        """Raw completion of ``prompt`` (no chat template), reusing the cache the same way."""
        self.check_open()
        return self.start_ids(encode_prompt(self.tokenizer, prompt), sampling, generation_id, "empty (nothing to complete)")

    def start_ids(self, ids: Seq[int], sampling: SamplingConfig | None = None, generation_id: int | None = None,
                  empty: str = "no tokens") -> TurnStats:
        """Begin a reply to a prompt given as token ids (benchmarks, tests)."""
        if not ids:
            raise ValueError(f"prompt: {empty}")
        return self._begin([int(i) for i in ids], sampling or SamplingConfig(), generation_id)

    def _begin(self, ids: list[int], sampling: SamplingConfig, generation_id: int | None,
               messages: Seq[dict] | None = None, spans: Seq[tuple[int, int]] = (), mark: int = -1) -> TurnStats:
        self.check_open()
        if self.generating:
            raise EngineError("a reply is already in progress: cancel it or wait for it to finish")
        c, q = self.cache, self.sequence
        c.mark = mark
        room_note = "" if c.can_overflow() else check_fits(len(ids), sampling.max_new_tokens, self.context_length)
        c.swap_in(q.ids)  # typed error, nothing changed, if there is no room
        cached = c.n
        keep, shared, common = c.reuse(q.ids, ids, owner=q.turn + 1)
        cpu = self.lm.device.type == "cpu"
        if cpu:  # another model may have changed it since this one was loaded
            apply_threads(self.info.threads)
        sampler = Sampler(sampling, self.lm.device, self.lm.stop_ids)
        reply = TurnState(sampling=sampling, sampler=sampler, t_start=time.perf_counter(),
                          decoder=StreamDecoder(self.tokenizer, context=ids) if self.tokenizer is not None
                          else NullDecoder(),
                          prompt_len=len(ids), reused=keep, recomputed=len(ids) - keep, shared=shared,
                          disk=c.reused.disk_tokens, account=c.reused.account,
                          divergence=common if cached > 0 else -1, threads=self.info.threads if cpu else 0)
        if reply.disk:  # restored from disk: against computing them again (the footer says both)
            reply.disk_ms, reply.disk_again_ms = c.reused.disk_ms, reprefill.estimate_ms(self.lm, reply.disk, False)
        continued = c.reused.continued
        if continued:  # the cache goes on as the policy left it: its evicted tokens are dropped, not recomputed
            reply.reused, reply.dropped = keep - continued, continued
        c.begin_step()
        q.begin(ids, reply, generation_id if generation_id is not None else next(_generation_ids), messages, spans)
        c.turn_starts = tuple(int(a) for a, _ in spans or ())
        q.add_notes(([room_note] if room_note else []) + c.disk_notes())
        if continued:
            q.add_notes([f"went on from the cache the policy left: {keep - continued} tokens kept, "
                         f"{continued} evicted earlier stay evicted, only the {len(ids) - keep} new ones computed"])
        self._ready, self._proposal = [], None
        if self.spec is not None:
            note = self.spec.new_reply()
            reply.spec, reply.spec_label = self.spec.stats, self.spec.label
            q.add_notes([note] if note else [])
        return reply.stats("")

    def cancel(self) -> None:
        """Ask the reply to stop; the next ``step()`` ends it with stop_reason ``cancelled``."""
        self.sequence.cancel()

    def teacher_force(self, ids: Seq[int], prefill: int = 0) -> Iterator[torch.Tensor]:
        """Logits predicting each next token of ``ids`` fed through this cache (``engine.core.teacher``)."""
        from engine.core.teacher import teacher_force

        return teacher_force(self, ids, prefill)

    # -- live changes ------------------------------------------------------------------------------------
    def apply(self, cfg: CacheConfig) -> list[str]:
        """Switch the cache setting between two steps, also mid-reply (``engine.core.reconfigure``): notes on what it
        did and cost; a refusal (typed error) leaves the session on its old setting."""
        self.check_open()
        return self.cache.apply(cfg, self.sequence, self.prefill_chunk)

    def rereads(self, cfg: CacheConfig) -> tuple[int, float]:
        """(tokens, ms): what ``apply(cfg)`` would have this chat read again, and what that should take at the model's
        measured prefill rate (``engine.core.reconfigure.rereads``); asked before applying, nothing changes."""
        if self.closed:
            return 0, 0.0
        n = reconfigure.rereads(self.cache, self.sequence, cfg)
        return n, reconfigure.rereads_ms(self.cache, n, cfg)

    def speculate(self, cfg: SpecConfig | None, drafter=None) -> str:
        """Turn speculative decoding on (``cfg``; a draft model's ``drafter`` from ``engine.speculation.draft_model``), change
        it or turn it off (None / method off); allowed between any two steps, also mid-reply. Returns a note. Built by
        ``engine.core.speculation_setup`` (a pool of sessions goes through its ``Speculation.onto``)."""
        self.check_open()
        self.spec = spec_setup.speculator(self.spec, cfg, drafter, self.runner.spec_verdicts)
        if self.spec is None:
            self.sequence.speculating(None)
        elif self.generating:  # mid-reply: the counts start now
            self.sequence.speculating(self.spec.stats, self.spec.label)
        return spec_setup.describe(cfg)

    def swap_out(self) -> int:
        """Move this (idle) session's K/V to host memory and give its pages back. Returns bytes moved."""
        if self.generating:
            raise EngineError("cannot swap out during a reply")
        return self.cache.swap_out()

    def fork(self) -> "ChatSession":
        """A new session with the same conversation; paged caches share full pages (copy-on-write)."""
        self.check_open()
        if self.generating:
            raise EngineError("cannot fork during a reply")
        self.cache.swap_in(self.seq)
        other = ChatSession(self.lm, CacheConfig(mode="off"))
        other.cache, other.sequence = self.cache.fork(other.session_id, self.turn), self.sequence.copy()
        return other

    def reset(self) -> None:
        """Forget the conversation and free its cache (the session stays usable)."""
        self.cache.reset()
        self.sequence.clear()

    def close(self) -> None:
        """End any reply (cancelled), free the cache; the session is done (``SessionClosedError`` after)."""
        if self.closed:
            return
        self._open, self._ready, self._proposal = None, [], None
        if self.spec is not None:
            self.spec.close()
            self.spec = None
        self.cache.free()
        self.sequence.close()

    def snapshot(self, phase: str = "decode", step_ms: float = 0.0) -> CacheSnapshot:
        """A frozen picture of the cache now (read-only numpy copies); a draft model's pool drawn after the model's."""
        draft = getattr(self.spec.drafter, "cache", None) if self.spec is not None else None
        return observe.build(self.sequence, self.cache, phase, step_ms, draft)
