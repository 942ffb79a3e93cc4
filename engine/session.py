"""``ChatSession``: a conversation (``engine.sequence.Sequence``) with its KV cache (``engine.seq_cache.SeqCache``)
on a loaded model, generated step by step.

Life of a reply::

    s.start(messages, sampling, generation_id)   # render, reuse the cached prefix, plan the prefill
    while not (r := s.step()).done:               # one model forward per step (a long prefill: one chunk)
        show(r.event, r.snapshot)                 # r.event is None for a prefill chunk
    s.apply(CacheConfig(...))                     # allowed between any two steps, also mid-reply

One step implementation: ``step()`` is ``prepare()`` (plan and reserve the next forward: a ``Work`` item),
the model runner's forward (``engine.runner``), then ``finish(output)`` (commit, sample, stop checks,
snapshot) or ``abort(exc)`` (roll back). The engine core (``engine.scheduler``) runs the same three with
several sessions' items in one forward.

Every step finishes or ends the turn: an exception rolls the partial forward back, ends the reply and is
raised as a typed ``EngineError``; the next ``start()`` works.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterator, Sequence as Seq

import numpy as np
import torch

from engine import observe, reconfigure
from engine.chat import StreamDecoder, encode_prompt, message_spans, render_chat, validate_messages
from engine.config import CacheConfig, SamplingConfig
from engine.errors import ContextOverflowError, EngineError, SessionClosedError, as_engine_error
from engine.loader import LoadedModel
from engine.runner import Output, Work
from engine.sampling import Sampler
from engine.seq_cache import SeqCache
from engine.sequence import NullDecoder, Sequence, Status, TurnState, check_fits, prefill_chunk
from engine.snapshot import TOKEN_EVICTED, CacheSnapshot, StepResult, TurnStats
from engine.threads import apply as apply_threads

_session_ids = itertools.count(1)
_generation_ids = itertools.count(1)


def _via(part: str, name: str, doc: str = "") -> property:
    """A read-only view of ``self.<part>.<name>`` (the part owns it; callers read it here)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class ChatSession:
    """A conversation with a model and its own KV cache. Not thread-safe: drive it from one thread."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None) -> None:
        self.lm, self.model, self.tokenizer, self.info = loaded, loaded.model, loaded.tokenizer, loaded.info
        self.session_id = next(_session_ids)
        self.cache = SeqCache(loaded, cache or CacheConfig(), self.session_id)
        self.sequence = Sequence()
        self.prefill_chunk = prefill_chunk(sum(p.numel() for p in self.model.parameters()), loaded.device.type)
        self._open: tuple | None = None  # the prepared forward: (t0, tokens in the step, its chunk, eviction context)

    seq = _via("sequence", "ids", "every token of the conversation so far")
    turn, generation_id, turn_state = _via("sequence", "turn"), _via("sequence", "generation_id"), _via("sequence", "reply")
    notes, protected, priorities = _via("sequence", "notes"), _via("sequence", "protected"), _via("sequence", "priorities")
    last_stats = _via("sequence", "last_stats")
    store, index, policy, host = _via("cache", "store"), _via("cache", "index"), _via("cache", "policy"), _via("cache", "host")
    cache_config, evictor, evictions = _via("cache", "cache_config"), _via("cache", "evictor"), _via("cache", "evictions")
    written, batch_size, step_path = _via("cache", "written"), _via("cache", "batch_size"), _via("cache", "path")
    swapped_in_pages = _via("cache", "swapped_in_pages")
    n_phys = cached_tokens = _via("cache", "n", "tokens per layer in the cache now")

    @property
    def generating(self) -> bool:
        return self.sequence.running

    @property
    def closed(self) -> bool:
        return self.sequence.status is Status.CLOSED

    @property
    def offloaded(self) -> bool:
        return self.cache.host is not None

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @property
    def generated_ids(self) -> list[int]:
        return list(self.sequence.reply.generated)

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
        """Begin a reply to ``messages`` (the whole chat: system, history, the new user message).

        The cached prefix shared with the rendered chat is reused (regenerate and edit reuse exactly the
        common prefix). Messages may carry ``pinned``/``priority`` for the priority policy; the system
        prompt and the first user message are protected from eviction. Raises ``ContextOverflowError``
        when the chat cannot fit and the overflow setting is ``stop``.
        """
        self.check_open()
        messages = validate_messages(messages)
        ids = render_chat(self.tokenizer, messages)
        needs_spans = self.cache.policy is not None or self.cache.cache_config.overflow != "stop"
        spans = message_spans(self.tokenizer, messages) if needs_spans else []
        return self._begin(ids, sampling or SamplingConfig(), generation_id, messages, spans)

    def start_completion(self, prompt: str, sampling: SamplingConfig | None = None,
                         generation_id: int | None = None) -> TurnStats:
        """Raw completion of ``prompt`` (no chat template), reusing the cache the same way."""
        self.check_open()
        ids = encode_prompt(self.tokenizer, prompt)
        if not ids:
            raise ValueError("prompt: empty (nothing to complete)")
        return self._begin(ids, sampling or SamplingConfig(), generation_id)

    def start_ids(self, ids: Seq[int], sampling: SamplingConfig | None = None,
                  generation_id: int | None = None) -> TurnStats:
        """Begin a reply to a prompt given as token ids (benchmarks, tests)."""
        if not ids:
            raise ValueError("prompt: no tokens")
        return self._begin([int(i) for i in ids], sampling or SamplingConfig(), generation_id)

    def _begin(self, ids: list[int], sampling: SamplingConfig, generation_id: int | None,
               messages: Seq[dict] | None = None, spans: Seq[tuple[int, int]] = ()) -> TurnStats:
        self.check_open()
        if self.generating:
            raise EngineError("a reply is already in progress: cancel it or wait for it to finish")
        c, q = self.cache, self.sequence
        room_note = "" if c.can_overflow() else check_fits(len(ids), sampling.max_new_tokens, self.context_length)
        c.swap_in(q.ids)  # typed error, nothing changed, if there is no room
        cached = c.n
        keep, shared, common = c.reuse(q.ids, ids, owner=q.turn + 1)
        decoder = StreamDecoder(self.tokenizer) if self.tokenizer is not None else NullDecoder()
        reply = TurnState(sampling=sampling, sampler=Sampler(sampling, self.lm.device), decoder=decoder,
                          t_start=time.perf_counter(), prompt_len=len(ids), reused=keep,
                          recomputed=len(ids) - keep, divergence=common if cached > 0 else -1, shared=shared)
        c.evictions = []
        if self.lm.device.type == "cpu":  # another model may have changed it since this one was loaded
            apply_threads(self.info.threads)
            reply.threads = self.info.threads
        q.begin(ids, reply, generation_id if generation_id is not None else next(_generation_ids), messages, spans)
        if room_note:
            q.add_notes([room_note])
        return q.reply.stats("")

    def cancel(self) -> None:
        """Ask the reply to stop; the next ``step()`` ends it with stop_reason ``cancelled``."""
        self.sequence.reply.cancel = True

    # -- one step: prepare → the runner's forward → finish (or abort) ----------------------------------------
    def step(self) -> StepResult:
        """One model forward: a chunk of a long prefill (``event`` None), or the forward that gives a token."""
        work = self.prepare()
        if isinstance(work, StepResult):
            return work
        try:
            (out,) = self.lm.runner.run([work])
        except BaseException as e:
            raise self.abort(e) from e
        return self.finish(out)

    def pending_tokens(self) -> int:
        """Tokens the reply's next forwards still have to feed before its next token (1 while decoding)."""
        c = self.cache
        return len(self.seq) - c.index.next_pos if c.store is not None and self.generating else 1

    def decodes_one(self) -> bool:
        """Is the next step one token on a plain store, with no score-reading policy (may it share a forward)?"""
        c = self.cache
        return (self.generating and not self.sequence.reply.cancel and c.host is None and not self.closed
                and c.store is not None and not c.needs_scores and len(self.seq) - c.index.next_pos == 1)

    def prepare(self) -> Work | StepResult:
        """Plan and reserve the next forward: its ``Work``, or the reply's last ``StepResult`` when it ends without
        one (cancelled, context full). A typed error ends the reply (nothing reserved)."""
        self.check_open()
        if not self.generating:
            raise EngineError("no reply in progress: call start() first")
        q, c = self.sequence, self.cache
        if q.reply.cancel:
            return self._finish("cancelled", None)
        t0 = time.perf_counter()
        if q.reply.waited_ms < 0:  # the first forward: what came before it was waiting, not the model's work
            q.reply.waited_ms = (t0 - q.reply.t_start) * 1000.0
        c.evictions = []
        if c.store is None:
            self._open = (t0, len(q.ids), len(q.ids), None)
            return Work(tuple(q.ids), 0, None)
        n_in = len(q.ids) - c.index.next_pos
        try:
            cx = c.context(q.protected, q.priorities, len(q.ids), self.prefill_chunk)
            chunk = c.plan(n_in, cx)
            q.add_notes(cx.notes)
            start = c.index.next_pos
            c.reserve(chunk, owner=q.turn)
        except ContextOverflowError as e:
            q.add_notes([str(e)])
            return self._finish("context_full", None)
        except BaseException as e:
            raise self._fail(e) from e
        self._open = (t0, n_in, chunk, cx)
        return Work(tuple(q.ids[start:start + chunk]), c.index.next_rope, c.kv)

    def abort(self, exc: BaseException) -> BaseException:
        """The prepared forward failed: roll it back, end the reply; the typed error to report."""
        if self._open is not None and self.cache.store is not None:
            self.cache.rollback()
        return self._fail(exc)

    def finish(self, out: Output, written: tuple[int, ...] = ()) -> StepResult:
        """After the prepared forward (``out``; ``written``: pages a batched forward wrote in this pool): commit,
        then the prefill chunk's progress, or the token, its stop checks and the snapshot."""
        (t0, n_in, chunk, cx), self._open = self._open, None
        q, c = self.sequence, self.cache
        c.path = out.path
        try:
            if c.store is not None:
                c.commit(chunk, q.ids, out.path, out.batch, written)
                c.after_forward(cx)
                q.add_notes(cx.notes)
                if c.index.next_pos < len(q.ids):  # one chunk of a longer prefill: Stop can act before the next
                    ms = (time.perf_counter() - t0) * 1000.0
                    q.reply.prefill_ms += ms
                    return StepResult(event=None, snapshot=self.snapshot("prefill", ms), done=False,
                                      text=q.reply.decoder.text)
            t = q.reply
            ctx_ids = torch.tensor(q.ids, dtype=torch.long) if t.sampling.repetition_penalty != 1.0 else None
            token = t.sampler(out.logits, ctx_ids)
        except BaseException as e:
            raise self._fail(e) from e
        event, stop = q.accept(token, t0, n_in, out.path, self.lm.stop_ids)
        if not stop and c.store is None and len(q.ids) >= self.context_length:
            stop = "context_full"
        elif not stop and c.store is not None and c.index.next_rope + 1 >= self.context_length and not c.can_overflow():
            stop = "context_full"  # this token takes the context's last position: the text is C tokens, as HF's
        if stop:
            return self._finish(stop, event)
        return StepResult(event=event, snapshot=self.snapshot(event.phase, event.step_ms), done=False,
                          text=t.decoder.text)

    def _fail(self, exc: BaseException) -> BaseException:
        """End the turn after ``exc`` (the forward was rolled back already) and return the typed error."""
        self._open = None
        self.sequence.end("error")
        return as_engine_error(exc)

    def _finish(self, reason: str, event) -> StepResult:
        q, t = self.sequence, self.sequence.reply
        self._open = None
        tail = t.decoder.flush() if t.decoder is not None and reason != "eos" else ""
        if tail and event is not None:
            event = dataclasses.replace(event, text_delta=event.text_delta + tail)
        stats = q.end(reason)
        snapshot = self.snapshot(event.phase if event is not None else "decode", event.step_ms if event else 0.0)
        self.cache.written, self.cache.batch_size = (), 1  # an idle chat's picture shows no page being written
        return StepResult(event=event, snapshot=snapshot, done=True, stop_reason=reason,
                          text=t.decoder.text if t.decoder is not None else "", stats=stats, warnings=q.take_notes())

    # -- teacher forcing (quality scoring) ------------------------------------------------------------------
    def teacher_force(self, ids: Seq[int], prefill: int = 0) -> Iterator[torch.Tensor]:
        """Feed ``ids`` one token at a time through this session's cache (evicting and quantizing exactly as
        during a reply) and yield, after each, the logits predicting the next token. Starts a new text.
        The first ``prefill`` tokens go in as a prompt does (in chunks), with one yield after them."""
        self.check_open()
        if self.generating:
            raise EngineError("a reply is in progress: teacher forcing needs an idle session")
        self.reset()
        ids = [int(t) for t in ids]
        q = self.sequence
        q.status = Status.RUNNING  # each group is fed like a reply's prefill, then the turn ends
        try:
            for group in ([ids[:prefill]] if prefill > 0 else []) + [[t] for t in ids[max(prefill, 0):]]:
                q.ids.extend(group)
                while True:
                    work = self.prepare()
                    if isinstance(work, StepResult):  # the context filled up under "stop"
                        raise ContextOverflowError("; ".join(work.warnings) or "the model's context is full")
                    try:
                        (out,) = self.lm.runner.run([work])
                    except BaseException as e:
                        raise self.abort(e) from e
                    logits = self._feed_done(out)
                    if logits is not None:
                        break
                yield logits
        finally:
            if self.generating:
                q.status = Status.IDLE

    def _feed_done(self, out: Output) -> torch.Tensor | None:
        (_, _, chunk, cx), self._open = self._open, None
        c = self.cache
        if c.store is None:
            return out.logits
        c.commit(chunk, self.seq, out.path)
        c.after_forward(cx)
        return out.logits if c.index.next_pos >= len(self.seq) else None

    # -- live changes ------------------------------------------------------------------------------------
    def apply(self, cfg: CacheConfig) -> list[str]:
        """Switch the cache configuration between two steps (also in the middle of a reply): cached K/V are
        copied into the new store (quantized or dequantized page by page); a policy switched on evicts at once
        down to its budget; one switched off re-prefills what it evicted, when the chat still fits. A refusal
        (typed error) leaves the session on its old setting. Returns notes saying what happened and its cost."""
        self.check_open()
        return reconfigure.apply(self.cache, self.sequence, cfg, self.prefill_chunk)

    def swap_out(self) -> int:
        """Move this (idle) session's K/V to host memory and give its pages back. Returns bytes moved."""
        if self.generating:
            raise EngineError("cannot swap out during a reply")
        return self.cache.swap_out()

    def swap_in(self) -> None:
        """Bring swapped-out K/V back (called automatically before the next turn). A typed error and no change
        (the K/V stay in host memory) when the cache has no room."""
        self.cache.swap_in(self.seq)

    def fork(self) -> "ChatSession":
        """A new session with the same conversation; paged caches share full pages (copy-on-write)."""
        self.check_open()
        if self.generating:
            raise EngineError("cannot fork during a reply")
        self.cache.swap_in(self.seq)
        other = ChatSession(self.lm, CacheConfig(mode="off"))
        other.cache = self.cache.fork(other.session_id, self.turn)
        q, o = self.sequence, other.sequence
        o.ids, o.turn, o.protected = list(q.ids), q.turn, q.protected
        o.priorities = None if q.priorities is None else q.priorities.copy()
        return other

    def reset(self) -> None:
        """Forget the conversation and free its cache (the session stays usable)."""
        self.cache.reset()
        self.sequence.ids, self.sequence.turn, self.sequence.status = [], -1, Status.IDLE

    def close(self) -> None:
        """End any reply (as cancelled) and free the cache (pages go back to the shared arena). The session
        cannot be used afterwards (``SessionClosedError``)."""
        if self.closed:
            return
        if self.generating:
            self.sequence.end("cancelled")
        self._open = None
        self.cache.free()
        self.sequence.status = Status.CLOSED

    def snapshot(self, phase: str = "decode", step_ms: float = 0.0) -> CacheSnapshot:
        """A frozen picture of the cache now (read-only numpy copies)."""
        return observe.build(self.sequence, self.cache, phase, step_ms)
