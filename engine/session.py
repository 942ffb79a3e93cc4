"""``ChatSession``: one conversation's tokens, its KV cache, and step-by-step generation.

Life of a reply::

    s.start(messages, sampling, generation_id)   # render, reuse the cached prefix, plan the prefill
    while not (r := s.step()).done:               # one model forward per step
        show(r.event, r.snapshot)
    s.apply(CacheConfig(...))                     # allowed between any two steps, also mid-reply

Bookkeeping: ``self.seq`` is every token of the conversation the model has seen or will see next; the
store holds the KV of ``seq[:store.num_tokens]``; each step feeds ``seq[store.num_tokens:]`` (the prompt
suffix on the first step of a turn, the last sampled token afterwards, or everything after a switch that
dropped the cache). In ``off`` mode nothing is cached and every step feeds the whole ``seq``.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

import numpy as np
import torch

from engine.chat import StreamDecoder, encode_prompt, render_chat
from engine.config import CacheConfig, SamplingConfig
from engine.errors import CacheCapacityError, ContextOverflowError, EngineError
from engine.kv.hf_cache import KVCache
from engine.kv.pool import FLAG_OFFLOADED, FLAG_PINNED, FLAG_QUANTIZED
from engine.kv.storage import ContiguousKV, KVStore, PageArena, PagedKV
from engine.loader import LoadedModel
from engine.sampling import Sampler
from engine import snapshot as snap
from engine.snapshot import CacheSnapshot, StepResult, TokenEvent, TurnStats

_session_ids = itertools.count(1)
_generation_ids = itertools.count(1)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def arena_for(lm: LoadedModel, cfg: CacheConfig) -> PageArena:
    """The page arena this model's paged sessions share, one per page size."""
    key = (cfg.page_size, cfg.max_pages)
    arena = lm.arenas.get(key)
    if arena is None:
        info = lm.info
        tokens = min(info.context_length, 2048)
        arena = PageArena(info.num_layers, info.num_kv_heads, info.head_dim, lm.kv_dtype, lm.device,
                          page_size=cfg.page_size, num_pages=max(1, -(-tokens // cfg.page_size)),
                          max_pages=cfg.max_pages)
        lm.arenas[key] = arena
    return arena


class _NullDecoder:
    """Stands in for ``StreamDecoder`` when a model has no tokenizer (benchmark shapes): ids only."""

    text = ""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class ChatSession:
    """A conversation with a model and its own KV cache. Not thread-safe: drive it from one thread."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None) -> None:
        self.lm = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.session_id = next(_session_ids)
        self.cache_config = cache or CacheConfig()
        self._check_supported(self.cache_config)
        self.store: KVStore | None = None
        self._kv: KVCache | None = None
        self._make_store(self.cache_config)
        self.seq: list[int] = []
        self.turn = -1
        self.generating = False
        self.generation_id = 0
        self.last_stats: TurnStats | None = None
        self._reset_turn_state()

    # -- setup -------------------------------------------------------------------------------------------
    def _check_supported(self, cfg: CacheConfig) -> None:
        if cfg.policy != "none" or cfg.quantized:
            from engine.errors import EngineError as _E

            raise _E("KV quantization and eviction policies are not available in this build")

    def _make_store(self, cfg: CacheConfig) -> None:
        info = self.info
        if cfg.mode == "off":
            self.store, self._kv = None, None
            return
        if cfg.mode == "contiguous":
            store: KVStore = ContiguousKV(info.num_layers, info.num_kv_heads, info.head_dim, self.lm.kv_dtype,
                                          self.lm.device, initial_tokens=256)
        else:
            store = PagedKV(arena_for(self.lm, cfg), self.session_id)
        self.store = store
        self._kv = KVCache(store)

    def _reset_turn_state(self) -> None:
        self._sampling = SamplingConfig()
        self._sampler: Sampler | None = None
        self._decoder: StreamDecoder | None = None
        self._generated: list[int] = []
        self._cancel = False
        self._step = 0
        self._t_start = 0.0
        self._prefill_ms = 0.0
        self._decode_ms = 0.0
        self._ttft_ms = 0.0
        self._prompt_len = 0
        self._reused = 0
        self._recomputed = 0
        self._divergence = -1
        self._phase_next = "prefill"

    @property
    def cached_tokens(self) -> int:
        return self.store.num_tokens if self.store is not None else 0

    @property
    def context_length(self) -> int:
        return self.info.context_length

    def room(self, prompt_tokens: int) -> int:
        """How many new tokens still fit after a prompt of ``prompt_tokens``."""
        return max(0, self.context_length - prompt_tokens)

    # -- starting a reply ----------------------------------------------------------------------------------
    def start(self, messages: Sequence[dict], sampling: SamplingConfig | None = None,
              generation_id: int | None = None) -> TurnStats:
        """Begin a reply to ``messages`` (the whole chat: system, history, the new user message).

        The cached prefix shared with the rendered chat is reused (regenerate and edit reuse exactly the
        common prefix). Raises ``ContextOverflowError`` when prompt + max new tokens exceed the context
        and the overflow policy is ``stop``.
        """
        ids = render_chat(self.tokenizer, messages)
        return self._begin(ids, sampling or SamplingConfig(), generation_id)

    def start_completion(self, prompt: str, sampling: SamplingConfig | None = None,
                         generation_id: int | None = None) -> TurnStats:
        """Raw completion of ``prompt`` (no chat template), reusing the cache the same way."""
        ids = encode_prompt(self.tokenizer, prompt)
        if not ids:
            raise ValueError("prompt: empty (nothing to complete)")
        return self._begin(ids, sampling or SamplingConfig(), generation_id)

    def start_ids(self, ids: Sequence[int], sampling: SamplingConfig | None = None,
                  generation_id: int | None = None) -> TurnStats:
        """Begin a reply to a prompt given as token ids (benchmarks, tests)."""
        return self._begin([int(i) for i in ids], sampling or SamplingConfig(), generation_id)

    def _begin(self, ids: list[int], sampling: SamplingConfig, generation_id: int | None) -> TurnStats:
        if self.generating:
            raise EngineError("a reply is already in progress: cancel it or wait for it to finish")
        ctx = self.context_length
        if len(ids) >= ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the model's context is {ctx}: "
                "shorten the chat or start a new one"
            )
        if len(ids) + sampling.max_new_tokens > ctx and self.cache_config.overflow == "stop":
            raise ContextOverflowError(
                f"prompt {len(ids)} + max new tokens {sampling.max_new_tokens} = "
                f"{len(ids) + sampling.max_new_tokens} tokens exceeds the model's context of {ctx}: "
                f"lower max new tokens to {ctx - len(ids)} or less"
            )
        self._reset_turn_state()
        cached = self.cached_tokens
        common = _common_prefix(self.seq[:cached], ids)
        keep = min(common, len(ids) - 1) if self.cache_config.prefix_reuse else 0
        if self.store is not None:
            self.store.truncate(keep)
        else:
            keep = 0
        self.seq = list(ids)
        self.turn += 1
        self.generation_id = generation_id if generation_id is not None else next(_generation_ids)
        self._sampling = sampling
        self._sampler = Sampler(sampling, self.lm.device)
        self._decoder = StreamDecoder(self.tokenizer) if self.tokenizer is not None else _NullDecoder()
        self._prompt_len = len(ids)
        self._reused = keep
        self._recomputed = len(ids) - keep
        self._divergence = common if cached > 0 else -1
        self.generating = True
        self._t_start = time.perf_counter()
        return self._stats("")

    def cancel(self) -> None:
        """Ask the reply to stop; the next ``step()`` ends it with stop_reason ``cancelled``."""
        self._cancel = True

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one model forward and choose one token. Cheap to call after ``done`` (returns done again)."""
        if not self.generating:
            raise EngineError("no reply in progress: call start() first")
        if self._cancel:
            return self._finish("cancelled", None)
        t0 = time.perf_counter()
        n_in = len(self.seq) - self.cached_tokens if self.store is not None else len(self.seq)
        logits = self._forward()
        ctx_ids = None
        if self._sampling.repetition_penalty != 1.0:
            ctx_ids = torch.tensor(self.seq, dtype=torch.long)
        token = self._sampler(logits, ctx_ids)
        dt_ms = (time.perf_counter() - t0) * 1000.0
        phase = "prefill" if not self._generated else "decode"
        if phase == "prefill":
            self._prefill_ms = dt_ms
            self._ttft_ms = (time.perf_counter() - self._t_start) * 1000.0
        else:
            self._decode_ms += dt_ms
        index = len(self._generated)
        self._generated.append(token)
        self.seq.append(token)
        self._step += 1

        stop = ""
        is_stop_token = token in self.lm.stop_ids and not self._sampling.ignore_eos
        delta = "" if is_stop_token else self._decoder.push(token)
        if is_stop_token:
            stop = "eos"
        elif self._sampling.stop_strings and any(s in self._decoder.text for s in self._sampling.stop_strings):
            stop = "stop_string"
        elif len(self._generated) >= self._sampling.max_new_tokens:
            stop = "max_tokens"
        elif len(self.seq) >= self.context_length:
            stop = "context_full"
        event = TokenEvent(self.generation_id, index, token, delta, phase, dt_ms, n_in)
        if stop:
            return self._finish(stop, event)
        return StepResult(event=event, snapshot=self.snapshot(phase, dt_ms), done=False, text=self._decoder.text)

    def _forward(self) -> torch.Tensor:
        """One forward over the tokens the cache lacks; returns the last position's logits [vocab]."""
        dev = self.lm.device
        with torch.inference_mode():
            if self.store is None:  # off: recompute the whole sequence, O(n) tokens per step
                ids = torch.tensor([self.seq], dtype=torch.long, device=dev)  # [1, n]
                pos = torch.arange(len(self.seq), device=dev)[None]  # [1, n]
                out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
                return out.logits[0, -1]
            store = self.store
            start = store.num_tokens
            feed = self.seq[start:]
            q = len(feed)
            try:
                store.begin_forward(q, owner=self.turn)
            except CacheCapacityError:
                raise
            ids = torch.tensor([feed], dtype=torch.long, device=dev)  # [1, q]
            pos = torch.arange(start, start + q, device=dev)[None]  # [1, q] logical positions
            try:
                out = self.model(input_ids=ids, cache=self._kv, position_ids=pos, use_cache=True, logits_to_keep=1)
            except BaseException:
                store._n_new = 0
                store.truncate(start)  # roll back the reserved slots; nothing half-written is kept
                raise
            store.end_forward()
            return out.logits[0, -1]  # [vocab]

    def _finish(self, reason: str, event: TokenEvent | None) -> StepResult:
        tail = self._decoder.flush() if self._decoder is not None and reason != "eos" else ""
        if tail and event is not None:
            event = TokenEvent(event.generation_id, event.index, event.token_id, event.text_delta + tail,
                               event.phase, event.step_ms, event.tokens_in_step)
        self.generating = False
        stats = self._stats(reason)
        self.last_stats = stats
        text = self._decoder.text if self._decoder is not None else ""
        phase = event.phase if event is not None else "decode"
        return StepResult(event=event, snapshot=self.snapshot(phase, event.step_ms if event else 0.0), done=True,
                          stop_reason=reason, text=text, stats=stats)

    def _stats(self, reason: str) -> TurnStats:
        n = len(self._generated)
        decode_n = max(0, n - 1)
        return TurnStats(
            prompt_tokens=self._prompt_len,
            reused_tokens=self._reused,
            recomputed_tokens=self._recomputed,
            first_divergence=self._divergence,
            generated_tokens=n,
            ttft_ms=self._ttft_ms,
            prefill_ms=self._prefill_ms,
            decode_ms=self._decode_ms,
            decode_tokens_per_s=(decode_n / (self._decode_ms / 1000.0)) if self._decode_ms > 0 else 0.0,
            prefill_tokens_per_s=(self._recomputed / (self._prefill_ms / 1000.0)) if self._prefill_ms > 0 else 0.0,
            stop_reason=reason,
        )

    @property
    def generated_ids(self) -> list[int]:
        return list(self._generated)

    # -- live changes ------------------------------------------------------------------------------------
    def apply(self, cfg: CacheConfig) -> list[str]:
        """Switch the cache configuration between two steps (also in the middle of a reply).

        Lossless switches copy the cached K/V into the new store; switching from ``off`` re-prefills the
        sequence on the next step. Returns notes describing what happened and what it cost.
        """
        old = self.cache_config
        self._check_supported(cfg)
        notes: list[str] = []
        if cfg == old:
            return notes
        rebuild = (cfg.mode != old.mode or (cfg.mode == "paged" and
                   (cfg.page_size != old.page_size or cfg.max_pages != old.max_pages)))
        if rebuild:
            old_store = self.store
            t0 = time.perf_counter()
            self._make_store(cfg)
            copied = 0
            if old_store is not None and self.store is not None and old_store.num_tokens:
                copied = self._copy_kv(old_store, self.store)
            if old_store is not None:
                old_store.free()
            ms = (time.perf_counter() - t0) * 1000.0
            if self.store is None:
                notes.append(f"cache off: {len(self.seq)} tokens will be recomputed every step")
            elif copied:
                notes.append(f"{old.mode} → {cfg.mode}: copied {copied} tokens of KV in {ms:.1f} ms")
            elif self.seq and self.generating:
                notes.append(f"{old.mode} → {cfg.mode}: {len(self.seq) - 1} tokens re-prefilled on the next step")
        if cfg.prefix_reuse != old.prefix_reuse:
            notes.append("prefix reuse " + ("on" if cfg.prefix_reuse else "off") + " from the next turn")
        self.cache_config = cfg
        return notes

    def _copy_kv(self, src: KVStore, dst: KVStore) -> int:
        n = src.num_tokens
        dst.begin_forward(n, owner=self.turn)
        for layer in range(src.num_layers):
            k, v = src.read_layer(layer)  # [H, n, D]
            dst.update(layer, k[None], v[None])
        dst.end_forward()
        return n

    def fork(self) -> "ChatSession":
        """A new session with the same conversation; paged caches share full pages (copy-on-write)."""
        if self.generating:
            raise EngineError("cannot fork during a reply")
        other = ChatSession.__new__(ChatSession)
        other.__dict__.update(self.__dict__)
        other.session_id = next(_session_ids)
        other.seq = list(self.seq)
        if isinstance(self.store, PagedKV):
            other.store = self.store.fork(other.session_id)
            other._kv = KVCache(other.store)
        elif self.store is not None:
            other._make_store(self.cache_config)
            self._copy_kv(self.store, other.store)
        other._reset_turn_state()
        return other

    def reset(self) -> None:
        """Forget the conversation and free its cache."""
        if self.store is not None:
            self.store.truncate(0)
        self.seq = []
        self.generating = False
        self.turn = -1

    def close(self) -> None:
        """Free the cache (pages go back to the shared arena)."""
        if self.store is not None:
            self.store.free()

    # -- observation -------------------------------------------------------------------------------------
    def snapshot(self, phase: str = "decode", step_ms: float = 0.0) -> CacheSnapshot:
        """A frozen picture of the cache now (numpy copies)."""
        info = self.info
        L = info.num_layers
        store = self.store
        cfg = self.cache_config
        n_cached = store.num_tokens if store is not None else 0
        if isinstance(store, PagedKV):
            pool = store.arena.pool
            ref = np.asarray(pool.ref, dtype=np.int32)
            flags = np.asarray(pool.flags, dtype=np.int32)
            state = np.full(pool.num_pages, snap.PAGE_ACTIVE, dtype=np.int8)
            state[ref > 1] = snap.PAGE_SHARED
            state[(flags & FLAG_QUANTIZED) != 0] = snap.PAGE_QUANTIZED
            state[(flags & FLAG_PINNED) != 0] = snap.PAGE_PINNED
            state[(flags & FLAG_OFFLOADED) != 0] = snap.PAGE_OFFLOADED
            state[ref == 0] = snap.PAGE_FREE
            owner = np.asarray(pool.owner, dtype=np.int32)
            fill = np.asarray(pool.fill, dtype=np.int32)
            num_pages = pool.num_pages
            pages_used = np.full(L, len(store.table.pages), dtype=np.int64)
        else:
            num_pages = 0
            state = np.zeros(0, dtype=np.int8)
            owner = np.zeros(0, dtype=np.int32)
            fill = np.zeros(0, dtype=np.int32)
            ref = np.zeros(0, dtype=np.int32)
            pages_used = np.zeros(L, dtype=np.int64)
        bytes_per_layer = np.asarray(store.bytes_per_layer() if store is not None else [0] * L, dtype=np.int64)
        token_state = np.zeros(len(self.seq), dtype=np.int8)
        n_decode = max(0, len(self._generated) - 1)
        device_bytes = torch.cuda.memory_allocated() if self.lm.device.type == "cuda" else 0
        return CacheSnapshot(
            generation_id=self.generation_id,
            step=self._step,
            mode=cfg.mode,
            policy=cfg.policy,
            page_size=cfg.page_size if cfg.mode == "paged" else 0,
            num_pages=num_pages,
            pages_used_per_layer=pages_used,
            tokens_per_layer=np.full(L, n_cached, dtype=np.int64),
            bytes_per_layer=bytes_per_layer,
            capacity_tokens=store.capacity_tokens() if store is not None else 0,
            page_state=state,
            page_owner=owner,
            page_fill=fill,
            page_refcount=ref,
            token_state=token_state,
            weights_bytes=info.weights_bytes,
            kv_bytes=int(bytes_per_layer.sum()),
            device_bytes=int(device_bytes),
            reused_tokens=self._reused,
            recomputed_tokens=self._recomputed,
            first_divergence=self._divergence,
            seq_len=len(self.seq),
            context_length=self.context_length,
            k_dtype=cfg.k_dtype,
            v_dtype=cfg.v_dtype,
            phase=phase,
            step_ms=step_ms,
            prefill_ms=self._prefill_ms,
            ttft_ms=self._ttft_ms,
            decode_tokens_per_s=(n_decode / (self._decode_ms / 1000.0)) if self._decode_ms > 0 else 0.0,
        )
