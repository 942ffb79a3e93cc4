"""``ChatSession``: one conversation's tokens, its KV cache, and step-by-step generation.

Life of a reply::

    s.start(messages, sampling, generation_id)   # render, reuse the cached prefix, plan the prefill
    while not (r := s.step()).done:               # one model forward per step (a long prefill: one chunk)
        show(r.event, r.snapshot)                 # r.event is None for a prefill chunk
    s.apply(CacheConfig(...))                     # allowed between any two steps, also mid-reply

Who owns what: ``seq`` (every token of the conversation) is the session's; what the cache holds is the
``CacheIndex`` (``engine.kv.positions``), changed only together with the store, by the session's forward
or by the ``Evictor`` (``engine.eviction``); settings change through ``engine.reconfigure``; snapshots
are built by ``engine.observe``.

Every step finishes or ends the turn: an exception inside ``step()`` rolls the partial forward back, ends
the reply and is raised as a typed ``EngineError`` (``InternalError`` for bugs, ``OutOfMemoryError`` and
``CacheCapacityError`` for memory); the next ``start()`` works.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator, Sequence

import numpy as np
import torch

from engine import observe, reconfigure
from engine.chat import (
    StreamDecoder,
    encode_prompt,
    message_spans,
    render_chat,
    validate_messages,
)
from engine.config import CacheConfig, SamplingConfig
from engine.errors import (
    ContextOverflowError,
    EngineError,
    SessionClosedError,
    as_engine_error,
)
from engine.eviction import Eviction, EvictionContext, Evictor
from engine.fast_step import no_compile_running
from engine.kv.attention import SCORES_IMPL, use_attention
from engine.kv.hf_cache import KVCache
from engine.kv.positions import CacheIndex
from engine.kv.prefix import cached_run, extend_chain
from engine.kv.storage import ContiguousKV, HostKV, KVStore, PagedKV, copy_kv
from engine.loader import LoadedModel
from engine.sampling import Sampler
from engine.snapshot import CacheSnapshot, StepResult, TokenEvent, TurnStats
from engine.threads import apply as apply_threads
from engine.turn import NullDecoder, TurnState, check_fits, common_prefix, prefill_chunk, protection

_session_ids = itertools.count(1)
_generation_ids = itertools.count(1)


class ChatSession:
    """A conversation with a model and its own KV cache. Not thread-safe: drive it from one thread."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None) -> None:
        self.lm, self.model, self.tokenizer, self.info = loaded, loaded.model, loaded.tokenizer, loaded.info
        self.session_id = next(_session_ids)
        cfg = cache or CacheConfig()
        self.policy = reconfigure.validate(cfg, loaded)
        self.cache_config = cfg
        self.store: KVStore | None = None
        self._kv: KVCache | None = None
        self.set_store(reconfigure.make_store(loaded, cfg, self.session_id))
        L = self.info.num_layers  # the cache index and the scores follow the full-attention layers
        if self.info.layer_kinds:
            L = sum(1 for k in self.info.layer_kinds if k.split("+")[0] == "full")
        self.index = CacheIndex(L)
        self.evictor = Evictor(self.model, L, self.info.num_kv_heads, loaded.device)
        self.seq: list[int] = []
        self._chain: list[bytes] = []  # prefix-cache names of seq's first full pages (engine.kv.prefix)
        self.host: HostKV | None = None  # swapped-out K/V (swap_out / swap_in)
        self.protected = 0  # logical [0, protected): system prompt + first message
        self.priorities: np.ndarray | None = None  # [T] per logical position, -1: the policy's default
        self.evictions: list[Eviction] = []  # what this step evicted
        self.written: tuple[int, ...] = ()  # pages the last forward wrote (with a batch: its other sessions' too)
        self.swapped_in_pages = 0  # pages the last swap-in took back from the prefix cache instead of copying
        self.batch_size = 1  # sessions that forward decoded (engine.batch)
        self.step_path = "eager"  # what ran the last forward: eager | compiled | batched (TokenEvent.path)
        self.notes: list[str] = []  # for the user, handed out with the reply's last step
        self.turn = -1
        self.generating = False
        self.closed = False
        self.generation_id = 0
        self.turn_state = TurnState()
        self.last_stats: TurnStats | None = None
        self.prefill_chunk = prefill_chunk(sum(p.numel() for p in self.model.parameters()), loaded.device.type)

    # -- plumbing used by engine.reconfigure / engine.eviction ---------------------------------------------
    def set_store(self, store: KVStore | None) -> None:
        self.store = store
        self._kv = KVCache(store) if store is not None else None
        self._chain = []  # page names depend on the page size: a new store names its pages afresh

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this chat's session was closed: start a new one")

    def eviction_context(self) -> EvictionContext:
        cfg = self.cache_config
        return EvictionContext(protected=self.protected, priorities=self.priorities,
                               page_size=cfg.page_size if cfg.mode == "paged" else 16, seq_len=len(self.seq),
                               overflow=cfg.overflow, context_length=self.context_length,
                               max_chunk=self.prefill_chunk)

    def add_notes(self, notes: Sequence[str]) -> None:
        self.notes += [n for n in notes if n not in self.notes]

    def prefix_cache_store(self) -> PagedKV | None:
        """The store whose full pages take part in automatic prefix caching, or None. Lossless settings only:
        a plain paged store (not a model with sliding-window or state layers) at the model's own K/V precision
        and no eviction policy. Its pages are registered while the cache index is intact (every cached token at
        its own logical and RoPE position), and a new prompt takes the pages named by its tokens."""
        store = self.store
        if type(store) is not PagedKV or self.policy is not None:
            return None
        if store.arena.kinds != {"k": "auto", "v": "auto"}:
            return None
        return store

    def _register_pages(self, before: int) -> None:
        """Put the pages that became full since ``before`` cached tokens into the prefix cache (intact ones)."""
        store = self.prefix_cache_store()
        if store is None:
            return
        P = store.page_size
        first, last = before // P, self.index.intact // P
        if last <= first:
            return
        extend_chain(self._chain, self.seq, P, last)
        pool, pages = store.arena.pool, store.table.pages
        for j in range(first, min(last, len(self._chain))):
            pool.register(pages[j], self._chain[j])

    def _take_cached(self, ids: list[int], keep: int) -> tuple[list[int], int]:
        """Pages of the prefix cache that extend the ``keep`` reused tokens of ``ids`` further: (pages, first
        page index), empty when they would not cover more than ``keep`` tokens. At least one token of ``ids`` is
        left to prefill (its logits give the first reply token)."""
        store = self.prefix_cache_store()
        self._chain = []
        if store is None or not self.cache_config.prefix_reuse or self.host is not None:
            return [], 0
        P = store.page_size
        limit, base = (len(ids) - 1) // P, keep // P
        if limit <= base:
            return [], base
        extend_chain(self._chain, ids, P, limit)
        run = cached_run(store.arena.pool, self._chain, base)
        if (base + len(run)) * P <= keep:
            return [], base
        return run, base

    def truncate_cache(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (within the intact prefix): store, index and scores together."""
        self.store.truncate(n)
        self.index.truncate(n)
        self.evictor.scores.truncate(n)

    @property
    def n_phys(self) -> int:
        """Tokens per layer in the cache now."""
        return self.index.n if self.store is not None else 0

    cached_tokens = n_phys

    @property
    def evicted_total(self) -> int:
        """Tokens fed so far that no layer holds any more (evicted, or dropped to fit the context)."""
        from engine.snapshot import TOKEN_EVICTED

        return int(np.count_nonzero(observe.token_state(self) == TOKEN_EVICTED))

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    @property
    def generated_ids(self) -> list[int]:
        return list(self.turn_state.generated)

    # -- starting a reply ----------------------------------------------------------------------------------
    def start(self, messages: Sequence[dict], sampling: SamplingConfig | None = None,
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
        spans = message_spans(self.tokenizer, messages) if self._needs_spans() else []
        return self._begin(ids, sampling or SamplingConfig(), generation_id, messages, spans)

    def start_completion(self, prompt: str, sampling: SamplingConfig | None = None,
                         generation_id: int | None = None) -> TurnStats:
        """Raw completion of ``prompt`` (no chat template), reusing the cache the same way."""
        self.check_open()
        ids = encode_prompt(self.tokenizer, prompt)
        if not ids:
            raise ValueError("prompt: empty (nothing to complete)")
        return self._begin(ids, sampling or SamplingConfig(), generation_id)

    def start_ids(self, ids: Sequence[int], sampling: SamplingConfig | None = None,
                  generation_id: int | None = None) -> TurnStats:
        """Begin a reply to a prompt given as token ids (benchmarks, tests)."""
        if not ids:
            raise ValueError("prompt: no tokens")
        return self._begin([int(i) for i in ids], sampling or SamplingConfig(), generation_id)

    def _needs_spans(self) -> bool:
        return self.policy is not None or self.cache_config.overflow != "stop"

    def _can_overflow(self) -> bool:
        return self.store is not None and (self.policy is not None or
                                           self.cache_config.overflow in reconfigure.OVERFLOW_EVICTS)

    def _begin(self, ids: list[int], sampling: SamplingConfig, generation_id: int | None,
               messages: Sequence[dict] | None = None, spans: Sequence[tuple[int, int]] = ()) -> TurnStats:
        self.check_open()
        if self.generating:
            raise EngineError("a reply is already in progress: cancel it or wait for it to finish")
        room_note = "" if self._can_overflow() else check_fits(len(ids), sampling.max_new_tokens, self.context_length)
        if self.host is not None:
            self.swap_in()  # typed error, nothing changed, if there is no room
        cached = self.index.n if self.store is not None else 0
        common = common_prefix(self.seq[:self.index.intact], ids)
        keep = min(common, len(ids) - 1) if self.cache_config.prefix_reuse and self.store is not None else 0
        if self.store is not None:
            keep = self.store.reusable(keep)  # sliding windows and recurrent states limit what can be kept
        self._chain = []
        shared_pages, base = self._take_cached(ids, keep) if self.store is not None else ([], 0)
        if shared_pages:
            keep = base * self.store.page_size  # cut back to a page boundary; the cached pages go on from it
        if self.store is not None:
            self.truncate_cache(keep)
        self.seq = list(ids)
        self.turn += 1
        shared = 0
        if shared_pages:
            shared = len(shared_pages) * self.store.page_size
            self.store.adopt(shared_pages, owner=self.turn)  # ref + 1 each: as if this session had prefilled them
            self.index.append(shared)
            self.evictor.scores.grow(shared)
            keep += shared
        self.protected, self.priorities = protection(messages, spans, len(ids))
        self.generation_id = generation_id if generation_id is not None else next(_generation_ids)
        decoder = StreamDecoder(self.tokenizer) if self.tokenizer is not None else NullDecoder()
        self.turn_state = TurnState(sampling=sampling, sampler=Sampler(sampling, self.lm.device), decoder=decoder,
                                    t_start=time.perf_counter(), prompt_len=len(ids), reused=keep,
                                    recomputed=len(ids) - keep, divergence=common if cached > 0 else -1,
                                    shared=shared)
        self.evictions = []
        if self.lm.device.type == "cpu":  # another model may have changed it since this one was loaded
            apply_threads(self.info.threads)
            self.turn_state.threads = self.info.threads
        self.generating = True
        if room_note:
            self.add_notes([room_note])
        return self._stats("")

    def cancel(self) -> None:
        """Ask the reply to stop; the next ``step()`` ends it with stop_reason ``cancelled``."""
        self.turn_state.cancel = True

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One model forward: a chunk of a long prefill (``event`` None), or the forward that gives a token."""
        self.check_open()
        if not self.generating:
            raise EngineError("no reply in progress: call start() first")
        t = self.turn_state
        if t.cancel:
            return self._finish("cancelled", None)
        t0 = time.perf_counter()
        self.evictions = []
        n_in = len(self.seq) - self.index.next_pos if self.store is not None else len(self.seq)
        try:
            logits = self._advance()
            if logits is None:  # one chunk of a longer prefill: Stop can act before the next one
                t.prefill_ms += (time.perf_counter() - t0) * 1000.0
                return StepResult(event=None, snapshot=self.snapshot("prefill", (time.perf_counter() - t0) * 1e3),
                                  done=False, text=t.decoder.text)
            ctx_ids = torch.tensor(self.seq, dtype=torch.long) if t.sampling.repetition_penalty != 1.0 else None
            token = t.sampler(logits, ctx_ids)
        except ContextOverflowError as e:
            self.add_notes([str(e)])
            return self._finish("context_full", None)
        except BaseException as e:
            raise self._fail(e) from e
        return self._after_token(token, t0, n_in)

    def _after_token(self, token: int, t0: float, n_in: int) -> StepResult:
        t = self.turn_state
        dt_ms = (time.perf_counter() - t0) * 1000.0
        phase = "prefill" if not t.generated else "decode"
        if phase == "prefill":
            t.prefill_ms += dt_ms
            t.ttft_ms = (time.perf_counter() - t.t_start) * 1000.0
        else:
            t.decode_ms += dt_ms
        index = len(t.generated)
        t.generated.append(token)
        self.seq.append(token)
        t.step += 1
        is_stop_token = token in self.lm.stop_ids and not t.sampling.ignore_eos
        delta = "" if is_stop_token else t.decoder.push(token)
        stop = ""
        if is_stop_token:
            stop = "eos"
        elif t.sampling.stop_strings and any(s in t.decoder.text for s in t.sampling.stop_strings):
            stop = "stop_string"
        elif len(t.generated) >= t.sampling.max_new_tokens:
            stop = "max_tokens"
        elif self.store is None and len(self.seq) >= self.context_length:
            stop = "context_full"
        elif self.store is not None and self.index.next_rope + 1 >= self.context_length and not self._can_overflow():
            stop = "context_full"  # this token takes the context's last position: the text is C tokens, as HF's
        event = TokenEvent(self.generation_id, index, token, delta, phase, dt_ms, n_in, self.step_path)
        if stop:
            return self._finish(stop, event)
        return StepResult(event=event, snapshot=self.snapshot(phase, dt_ms), done=False, text=t.decoder.text)

    def _fail(self, exc: BaseException) -> BaseException:
        """End the turn after ``exc`` (the forward was rolled back already) and return the typed error."""
        self.generating = False
        self.turn_state.cancel = False
        self.last_stats = self._stats("error")
        return as_engine_error(exc)

    def _advance(self) -> torch.Tensor | None:
        """Feed the next chunk of ``seq[next_pos:]``; the last position's logits once all is fed, else None."""
        if self.store is None:
            return self._forward_off()
        chunk, cx = self.plan_forward(len(self.seq) - self.index.next_pos)
        start = self.index.next_pos
        logits = self._forward(self.seq[start:start + chunk])
        self.after_forward(cx)
        return logits if self.index.next_pos >= len(self.seq) else None

    def plan_forward(self, todo: int) -> tuple[int, EvictionContext]:
        """How many of the ``todo`` unfed tokens the next forward takes (evicting first where a policy says so)."""
        cx = self.eviction_context()
        chunk, done = self.evictor.plan(self.store, self.index, self.policy, todo, cx)
        self.evictions += done
        return chunk, cx

    def after_forward(self, cx: EvictionContext) -> None:
        self.evictions += self.evictor.after_forward(self.store, self.index, self.policy, cx)
        self.add_notes(cx.notes)

    def _forward_off(self) -> torch.Tensor:
        dev = self.lm.device
        use_attention(self.model, self.info.attn_impl)
        self.step_path = "eager"
        with no_compile_running(), torch.inference_mode():
            ids = torch.tensor([self.seq], dtype=torch.long, device=dev)  # [1, n]
            pos = torch.arange(len(self.seq), device=dev)[None]  # [1, n]
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        return out.logits[0, -1]

    def _forward(self, feed: list[int]) -> torch.Tensor:
        """One forward over ``feed`` (the next tokens of ``seq``); returns the last position's logits.
        All or nothing: if it fails, the store, the index and the scores are as before."""
        dev, index = self.lm.device, self.index
        q = len(feed)
        self.open_forward(q)
        needs_scores = self._kv.score_sink is not None
        use_attention(self.model, SCORES_IMPL if needs_scores else self.info.attn_impl)
        fast = self.lm.fast
        path = fast.choose(self) if q == 1 and not needs_scores else ""
        t0 = time.perf_counter()
        try:
            with no_compile_running():
                logits = self._forward_compiled(feed[0]) if path == "compiled" else None
                if logits is None:
                    ids = torch.tensor([feed], dtype=torch.long, device=dev)  # [1, q]
                    pos = torch.arange(index.next_rope, index.next_rope + q, device=dev)[None]  # [1, q] positions
                    with torch.inference_mode():
                        out = self.model(input_ids=ids, cache=self._kv, position_ids=pos, use_cache=True,
                                         logits_to_keep=1)
                    logits, path = out.logits[0, -1], path and "eager"  # [vocab]
        except BaseException:
            self.undo_forward()
            raise
        if path:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the trial times the forward, not its launch
            fast.record(path, (time.perf_counter() - t0) * 1000.0)
        self.step_path = path or "eager"
        self.close_forward(q)
        return logits

    def _forward_compiled(self, token: int) -> torch.Tensor | None:
        """The model's compiled decode step (``engine.fast_step``); None if it failed (the eager forward then
        runs instead: nothing was written)."""
        try:
            return self.lm.fast.forward(self, token, self.index.next_rope)
        except Exception as e:  # noqa: BLE001 - the eager path answers; the reason is kept and shown
            self.lm.fast.fail(e)
            return None

    def open_forward(self, q: int) -> None:
        """Take room for ``q`` tokens before a forward (typed error, nothing changed, if there is none)."""
        scores = self.evictor.scores
        needs_scores = self.policy is not None and self.policy.needs_scores
        if needs_scores and not scores.tracking:
            scores.start(self.index.n)
        elif not needs_scores:
            scores.stop()
        self._kv.score_sink = scores.add if needs_scores else None
        self.store.reserve(q, owner=self.turn)
        try:
            scores.grow(q)
        except BaseException:
            self.store.rollback()
            raise

    def undo_forward(self) -> None:
        """The forward failed: store, index and scores back to where ``open_forward`` found them."""
        self.store.rollback()
        if self.store.num_tokens != self.index.n:  # the store could not undo it (a recurrent state): start over
            self.index.truncate(0)
        self.evictor.scores.truncate(self.index.n)

    def close_forward(self, q: int) -> None:
        """The forward wrote ``q`` tokens' K/V: count them as cached."""
        self.store.commit()
        self.index.append(q)
        self._register_pages(self.index.n - q)
        self.written, self.batch_size = self.pages_written(q), 1

    def pages_written(self, q: int) -> tuple[int, ...]:
        """Pages holding the last ``q`` cached tokens (a plain paged store; else none)."""
        store, n = self.store, self.index.n
        if type(store) is not PagedKV or q <= 0 or n <= 0:
            return ()
        P = store.page_size
        return tuple(store.table.pages[(n - q) // P:(n - 1) // P + 1])

    # -- batched decoding (engine.batch) ------------------------------------------------------------------
    def batchable(self) -> bool:
        """Can this session's next step join a forward with other sessions (``engine.batch``)? A reply with
        exactly one token to feed, a plain store (paged or contiguous, any K/V precision) and no policy that
        reads attention scores."""
        t = self.turn_state
        return (self.generating and not t.cancel and self.host is None and not self.closed
                and type(self.store) in (PagedKV, ContiguousKV)
                and (self.policy is None or not self.policy.needs_scores)
                and len(self.seq) - self.index.next_pos == 1)

    def next_input(self) -> tuple[int, int]:
        """(token id, RoPE position) the next one-token forward feeds."""
        return self.seq[self.index.next_pos], self.index.next_rope

    def take_token(self, logits: torch.Tensor, t0: float) -> StepResult:
        """Sample from the logits of a forward this session took part in, then finish its step."""
        t = self.turn_state
        try:
            ctx_ids = torch.tensor(self.seq, dtype=torch.long) if t.sampling.repetition_penalty != 1.0 else None
            token = t.sampler(logits, ctx_ids)
        except BaseException as e:
            raise self._fail(e) from e
        return self._after_token(token, t0, 1)

    def end_context_full(self, exc: BaseException) -> StepResult:
        self.add_notes([str(exc)])
        return self._finish("context_full", None)

    def fail(self, exc: BaseException) -> BaseException:
        """End the turn after ``exc`` (already rolled back); the typed error to report."""
        return self._fail(exc)

    def finish_cancelled(self) -> StepResult:
        return self._finish("cancelled", None)

    # -- finishing ---------------------------------------------------------------------------------------
    def _finish(self, reason: str, event: TokenEvent | None) -> StepResult:
        t = self.turn_state
        tail = t.decoder.flush() if t.decoder is not None and reason != "eos" else ""
        if tail and event is not None:
            event = TokenEvent(event.generation_id, event.index, event.token_id, event.text_delta + tail,
                               event.phase, event.step_ms, event.tokens_in_step)
        self.generating = False
        stats = self._stats(reason)
        self.last_stats = stats
        text = t.decoder.text if t.decoder is not None else ""
        phase = event.phase if event is not None else "decode"
        snapshot = self.snapshot(phase, event.step_ms if event else 0.0)
        self.written, self.batch_size = (), 1  # an idle chat's picture shows no page as being written
        notes, self.notes = tuple(self.notes), []
        return StepResult(event=event, snapshot=snapshot, done=True, stop_reason=reason, text=text, stats=stats,
                          warnings=notes)

    def _stats(self, reason: str) -> TurnStats:
        return self.turn_state.stats(reason)

    # -- teacher forcing (quality scoring) ------------------------------------------------------------------
    def teacher_force(self, ids: Sequence[int], prefill: int = 0) -> Iterator[torch.Tensor]:
        """Feed ``ids`` one token at a time through this session's cache (evicting and quantizing exactly as
        during a reply) and yield, after each, the logits predicting the next token. Starts a new text.
        The first ``prefill`` tokens go in as a prompt does (in chunks), with one yield after them."""
        self.check_open()
        if self.generating:
            raise EngineError("a reply is in progress: teacher forcing needs an idle session")
        self.reset()
        ids = [int(t) for t in ids]
        for group in ([ids[:prefill]] if prefill > 0 else []) + [[t] for t in ids[max(prefill, 0):]]:
            self.seq.extend(group)
            try:
                logits = None
                while logits is None:
                    logits = self._advance()
            except BaseException as e:
                raise self._fail(e) from e
            yield logits

    # -- live changes ------------------------------------------------------------------------------------
    def apply(self, cfg: CacheConfig) -> list[str]:
        """Switch the cache configuration between two steps (also in the middle of a reply).

        - mode / page size / K-V precision: the cached K/V are copied into the new store (quantized or
          dequantized page by page); switching from ``off`` re-prefills the sequence on the next step;
        - enabling a policy evicts at once down to its budget, before it is installed;
        - disabling one (or changing to a policy that keeps more) re-prefills what was evicted from the
          text on the next step, when the conversation still fits the context.
        A refusal (typed error) leaves the session on its old setting. Returns notes describing what
        happened and what it cost.
        """
        return reconfigure.apply(self, cfg)

    # -- swap --------------------------------------------------------------------------------------------
    def swap_out(self) -> int:
        """Move this (idle) session's K/V to host memory and give its pages back. Returns bytes moved."""
        if self.generating:
            raise EngineError("cannot swap out during a reply")
        if self.store is None or self.host is not None or self.index.n == 0:
            return 0
        # Quantized pages travel as they are held (codes + scales), so a swapped int8 chat costs int8 bytes.
        host = self.store.to_host(pin=self.lm.device.type == "cuda")
        self.store.free()
        self.host = host
        return host.nbytes

    def swap_in(self) -> None:
        """Bring swapped-out K/V back (called automatically before the next turn). A typed error and no change
        (the K/V stay in host memory) when the cache has no room."""
        if self.host is None:
            return
        adopt = self._cached_pages_of_host()  # only a plain paged store has any (other stores take one argument)
        if not (self.store.can_restore(self.host, adopt) if adopt else self.store.can_restore(self.host)):
            from engine.errors import CacheCapacityError

            raise CacheCapacityError(f"no room to bring this chat's {self.host.n} cached tokens back: close other "
                                     "chats or raise the cache's limits")
        if adopt:
            self.store.from_host(self.host, adopt)
        else:
            self.store.from_host(self.host)
        self.swapped_in_pages = len(adopt)
        self.host = None

    def _cached_pages_of_host(self) -> list[int]:
        """Full pages of the swapped-out tokens still in the prefix cache (named by the same tokens from the
        start, in this arena): swap-in takes them back instead of copying their K/V again."""
        store = self.prefix_cache_store()
        if store is None or self.host is None:
            return []
        P = store.page_size
        chain: list[bytes] = []
        extend_chain(chain, self.seq, P, min(self.host.n, self.index.intact) // P)
        pages = cached_run(store.arena.pool, chain, 0)
        self._chain = chain[:len(pages)]
        return pages

    def fork(self) -> "ChatSession":
        """A new session with the same conversation; paged caches share full pages (copy-on-write)."""
        self.check_open()
        if self.generating:
            raise EngineError("cannot fork during a reply")
        if self.host is not None:
            self.swap_in()
        other = ChatSession(self.lm, CacheConfig(mode="off"))
        if hasattr(self.store, "fork"):
            other.set_store(self.store.fork(other.session_id))
        elif self.store is not None:
            store = reconfigure.make_store(self.lm, self.cache_config, other.session_id)
            copy_kv(self.store, store, owner=self.turn)
            other.set_store(store)
        other.cache_config, other.policy = self.cache_config, reconfigure.validate(self.cache_config, self.lm)
        other.index = self.index.copy()
        if self.evictor.scores.tracking:
            other.evictor.scores.t = [s.clone() for s in self.evictor.scores.t]
        other.seq = list(self.seq)
        other.protected = self.protected
        other.priorities = None if self.priorities is None else self.priorities.copy()
        other.turn = self.turn
        return other

    def reset(self) -> None:
        """Forget the conversation and free its cache (the session stays usable)."""
        if self.store is not None:
            self.store.truncate(0)
        self.host = None
        self.index.reset()
        self.evictor.scores.stop()
        self.seq = []
        self._chain = []
        self.evictions = []
        self.generating = False
        self.turn = -1

    def close(self) -> None:
        """End any reply (as cancelled) and free the cache (pages go back to the shared arena). The session
        cannot be used afterwards (``SessionClosedError``)."""
        if self.closed:
            return
        if self.generating:
            self.generating = False
            self.last_stats = self._stats("cancelled")
        if self.store is not None:
            self.store.free()
        self.host = None
        self.index.reset()
        self.evictor.scores.stop()
        self.closed = True

    # -- observation -------------------------------------------------------------------------------------
    def snapshot(self, phase: str = "decode", step_ms: float = 0.0) -> CacheSnapshot:
        """A frozen picture of the cache now (read-only numpy copies)."""
        return observe.build(self, phase, step_ms)
