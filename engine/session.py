"""``ChatSession``: one conversation's tokens, its KV cache, and step-by-step generation.

Life of a reply::

    s.start(messages, sampling, generation_id)   # render, reuse the cached prefix, plan the prefill
    while not (r := s.step()).done:               # one model forward per step (a long prefill may chunk)
        show(r.event, r.snapshot)
    s.apply(CacheConfig(...))                     # allowed between any two steps, also mid-reply

Bookkeeping (all plain ints / numpy on the CPU):

- ``seq``: every token of the conversation, logical positions ``0..len-1``.
- ``n_fed``: tokens of ``seq`` whose K/V were computed (kept or since evicted); a step feeds ``seq[n_fed:]``
  (the prompt suffix, then the last sampled token, or everything after a switch that dropped the cache).
- The store holds ``n_phys`` tokens per layer. Until something is evicted, slot ``i`` holds token ``i``;
  after an eviction ``_log[l]`` (logical position) and ``_rope[l]`` (RoPE position the key was rotated
  to) say what each slot holds, per layer.
- ``_next_rope``: the RoPE position of the next fed token (``n_fed`` without eviction; the in-cache index
  once StreamingLLM-style compaction has re-rotated the kept keys).

In ``off`` mode nothing is cached and every step feeds the whole ``seq``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import numpy as np
import torch

from engine import snapshot as snap
from engine.chat import (
    StreamDecoder,
    encode_prompt,
    message_spans,
    render_chat,
    validate_messages,
)
from engine.config import CacheConfig, SamplingConfig
from engine.errors import ContextOverflowError, EngineError
from engine.kv.attention import SCORES_IMPL, Rerotator, use_attention
from engine.kv.hf_cache import KVCache
from engine.kv.pool import FLAG_OFFLOADED, FLAG_PINNED, FLAG_QUANTIZED
from engine.kv.quant import int8_key_layout
from engine.kv.storage import ContiguousKV, HostKV, KVStore, PageArena, PagedKV
from engine.loader import LoadedModel
from engine.policies import EvictionPolicy, PolicyState, StreamingPolicy, get_policy
from engine.sampling import Sampler
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
    """The page arena this model's paged sessions share, one per page size and KV precision."""
    key = (cfg.page_size, cfg.max_pages, cfg.k_dtype, cfg.v_dtype)
    arena = lm.arenas.get(key)
    if arena is None:
        for k in [k for k, a in lm.arenas.items() if a.pool.num_used == 0]:
            del lm.arenas[k]  # an arena no session uses any more gives its memory back
        info = lm.info
        tokens = min(info.context_length, 2048)
        arena = PageArena(info.num_layers, info.num_kv_heads, info.head_dim, lm.kv_dtype, lm.device,
                          page_size=cfg.page_size, num_pages=max(1, -(-tokens // cfg.page_size)),
                          max_pages=cfg.max_pages, k_kind=cfg.k_dtype, v_kind=cfg.v_dtype)
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
        cfg = cache or CacheConfig()
        self.policy: EvictionPolicy | None = self._make_policy(cfg)
        self.cache_config = cfg
        self.store: KVStore | None = None
        self._kv: KVCache | None = None
        self._make_store(cfg)
        self.seq: list[int] = []
        self.n_fed = 0
        self._log: np.ndarray | None = None  # [L, n_phys] logical positions, None while slot i == token i
        self._rope: np.ndarray | None = None  # [L, n_phys] RoPE positions of the cached keys
        self._next_rope = 0
        self._scores: list[torch.Tensor] | None = None  # per layer [Hkv, n_phys] accumulated attention
        self._rerotator: Rerotator | None = None
        self._host: HostKV | None = None  # swapped-out K/V (swap_out / swap_in)
        self.protected = 0  # logical [0, protected): system prompt + first message
        self._priorities: np.ndarray | None = None
        self.evicted_total = 0
        self._evicted_now: tuple[int, ...] = ()
        self._evict_reason = ""
        self._evicted_pages: set[int] = set()
        self._notes: list[str] = []
        self.turn = -1
        self.generating = False
        self.generation_id = 0
        self.last_stats: TurnStats | None = None
        self._reset_turn_state()

    # -- setup -------------------------------------------------------------------------------------------
    def _make_policy(self, cfg: CacheConfig) -> EvictionPolicy | None:
        policy = get_policy(cfg.policy, cfg.policy_params)
        if cfg.mode == "off" and (policy is not None or cfg.quantized):
            raise ValueError("cache off: KV precision and eviction policies need a cache (contiguous or paged)")
        if cfg.quantized and cfg.mode != "paged":
            raise ValueError("KV int8/int4 is kept per page: choose the paged cache mode")
        if cfg.overflow == "policy" and policy is None:
            raise ValueError("overflow 'policy' needs an eviction policy (streaming, h2o or priority)")
        if policy is not None and policy.budget >= self.info.context_length and not policy.rope_in_cache:
            raise ValueError(f"policy {policy.name}: budget {policy.budget} must be below the model's context "
                             f"of {self.info.context_length}")
        if policy is not None and policy.rope_in_cache and policy.budget >= self.info.context_length:
            raise ValueError(f"policy {policy.name}: sinks + window {policy.budget} must be below the model's "
                             f"context of {self.info.context_length}")
        return policy

    def _make_store(self, cfg: CacheConfig) -> None:
        info = self.info
        if cfg.mode == "off":
            self.store, self._kv = None, None
            return
        if cfg.mode == "contiguous":
            store: KVStore = ContiguousKV(info.num_layers, info.num_kv_heads, info.head_dim, self.lm.kv_dtype,
                                          self.lm.device, initial_tokens=256)
        elif cfg.quantized:
            from engine.kv.quant_paged import QuantPagedKV

            store = QuantPagedKV(arena_for(self.lm, cfg), self.session_id)
        else:
            store = PagedKV(arena_for(self.lm, cfg), self.session_id)
        self.store = store
        self._kv = KVCache(store)

    def _reset_turn_state(self) -> None:
        self._sampling = SamplingConfig()
        self._sampler: Sampler | None = None
        self._decoder: Any = None
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

    @property
    def n_phys(self) -> int:
        """Tokens per layer in the cache now."""
        return self.store.num_tokens if self.store is not None else 0

    @property
    def cached_tokens(self) -> int:
        return self.n_phys

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def _first_evicted(self) -> int:
        """Length of the prefix of ``seq`` that the cache holds intact (slot i == token i)."""
        if self._log is None:
            return self.n_phys
        n = self._log.shape[1]
        ident = np.arange(n)
        ok = (self._log == ident[None]).all(axis=0) & (self._rope == ident[None]).all(axis=0)
        bad = np.nonzero(~ok)[0]
        return int(bad[0]) if len(bad) else n

    # -- starting a reply ----------------------------------------------------------------------------------
    def start(self, messages: Sequence[dict], sampling: SamplingConfig | None = None,
              generation_id: int | None = None) -> TurnStats:
        """Begin a reply to ``messages`` (the whole chat: system, history, the new user message).

        The cached prefix shared with the rendered chat is reused (regenerate and edit reuse exactly the
        common prefix). Messages may carry ``pinned``/``priority`` for the priority policy; the system
        prompt and the first user message are protected from eviction. Raises ``ContextOverflowError``
        when the chat cannot fit and the overflow setting is ``stop``.
        """
        messages = validate_messages(messages)
        ids = render_chat(self.tokenizer, messages)
        spans = message_spans(self.tokenizer, messages) if self._needs_spans() else []
        return self._begin(ids, sampling or SamplingConfig(), generation_id, messages, spans)

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
        if not ids:
            raise ValueError("prompt: no tokens")
        return self._begin([int(i) for i in ids], sampling or SamplingConfig(), generation_id)

    def _needs_spans(self) -> bool:
        return self.policy is not None or self.cache_config.overflow != "stop"

    def _can_overflow(self) -> bool:
        return self.policy is not None or self.cache_config.overflow in ("truncate_middle", "rolling")

    def _begin(self, ids: list[int], sampling: SamplingConfig, generation_id: int | None,
               messages: Sequence[dict] | None = None, spans: Sequence[tuple[int, int]] = ()) -> TurnStats:
        if self.generating:
            raise EngineError("a reply is already in progress: cancel it or wait for it to finish")
        ctx = self.context_length
        if not self._can_overflow() or self.store is None:
            if len(ids) >= ctx:
                raise ContextOverflowError(
                    f"the prompt has {len(ids)} tokens but the model's context is {ctx}: "
                    "shorten the chat, start a new one, or choose an overflow policy"
                )
            if len(ids) + sampling.max_new_tokens > ctx:
                raise ContextOverflowError(
                    f"prompt {len(ids)} + max new tokens {sampling.max_new_tokens} = "
                    f"{len(ids) + sampling.max_new_tokens} tokens exceeds the model's context of {ctx}: "
                    f"lower max new tokens to {ctx - len(ids)} or less, or choose an overflow policy"
                )
        if self._host is not None:
            self.swap_in()
        self._reset_turn_state()
        cached = self.n_phys
        intact = self._first_evicted()
        common = _common_prefix(self.seq[:intact], ids)
        keep = min(common, len(ids) - 1) if self.cache_config.prefix_reuse else 0
        if self.store is not None:
            self._truncate(keep)
        else:
            keep = 0
        self.seq = list(ids)
        self.n_fed = keep
        self.turn += 1
        self._set_protection(messages, spans, len(ids))
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

    def _set_protection(self, messages, spans, n: int) -> None:
        self.protected = 0
        self._priorities = None
        if not messages or not spans:
            return
        # protect the system prompt(s) and the first user message (what "truncate the middle" keeps)
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is not None:
            self.protected = min(spans[first_user][1], n)
        pri = np.full(n, -1, dtype=np.int64)  # -1: the policy's default
        for m, (a, b) in zip(messages, spans):
            p = 100 if (m["role"] == "system" or m.get("pinned")) else m.get("priority")
            if p is not None:
                pri[a:min(b, n)] = p
        self._priorities = pri

    def cancel(self) -> None:
        """Ask the reply to stop; the next ``step()`` ends it with stop_reason ``cancelled``."""
        self._cancel = True

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one model forward (or a few, for a prefill longer than an eviction budget) and choose one token."""
        if not self.generating:
            raise EngineError("no reply in progress: call start() first")
        if self._cancel:
            return self._finish("cancelled", None)
        t0 = time.perf_counter()
        self._evicted_now, self._evict_reason = (), ""
        self._evicted_pages = set()
        n_in = len(self.seq) - self.n_fed if self.store is not None else len(self.seq)
        try:
            logits = self._advance()
        except ContextOverflowError as e:
            self._notes.append(str(e))
            return self._finish("context_full", None)
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
        elif self.store is None and len(self.seq) >= self.context_length:
            stop = "context_full"
        elif self.store is not None and self._next_rope >= self.context_length and not self._can_overflow():
            stop = "context_full"
        event = TokenEvent(self.generation_id, index, token, delta, phase, dt_ms, n_in)
        if stop:
            return self._finish(stop, event)
        return StepResult(event=event, snapshot=self.snapshot(phase, dt_ms), done=False, text=self._decoder.text)

    def _advance(self) -> torch.Tensor:
        """Feed ``seq[n_fed:]`` (in chunks when a budget or the context requires it); last logits [vocab]."""
        if self.store is None:
            return self._forward_off()
        logits = None
        ctx = self.context_length
        while self.n_fed < len(self.seq):
            todo = len(self.seq) - self.n_fed
            chunk = todo
            policy = self.policy
            if policy is not None:
                if self.n_phys >= policy.budget:
                    self._evict(policy.budget - policy.slack(self._page_size()), policy.name)
                chunk = max(1, min(todo, policy.budget - self.n_phys))
            if self._next_rope + chunk > ctx:
                if not self._can_overflow():
                    raise ContextOverflowError(f"the model's context of {ctx} tokens is full")
                self._evict(self._overflow_target(), self._overflow_reason(), force_rotate=True)
                chunk = max(1, min(chunk, ctx - self._next_rope))
            logits = self._forward(self.seq[self.n_fed:self.n_fed + chunk])
            if policy is not None and self.n_phys > policy.budget:
                self._evict(policy.budget - policy.slack(self._page_size()), policy.name)
        return logits

    def _page_size(self) -> int:
        return self.cache_config.page_size if self.cache_config.mode == "paged" else 16

    def _forward_off(self) -> torch.Tensor:
        dev = self.lm.device
        use_attention(self.model, "sdpa")
        with torch.inference_mode():
            ids = torch.tensor([self.seq], dtype=torch.long, device=dev)  # [1, n]
            pos = torch.arange(len(self.seq), device=dev)[None]  # [1, n]
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        return out.logits[0, -1]

    def _forward(self, feed: list[int]) -> torch.Tensor:
        """One forward over ``feed`` (the next tokens of ``seq``); returns the last position's logits."""
        dev = self.lm.device
        store = self.store
        q = len(feed)
        start_phys = store.num_tokens
        needs_scores = self.policy is not None and self.policy.needs_scores
        use_attention(self.model, SCORES_IMPL if needs_scores else "sdpa")
        if needs_scores:
            self._ensure_scores()
            for i, s in enumerate(self._scores):
                self._scores[i] = torch.cat([s, s.new_zeros(s.shape[0], q)], dim=1)  # [Hkv, n_phys + q]
            self._kv.score_sink = self._accumulate
        else:
            self._kv.score_sink = None
        store.begin_forward(q, owner=self.turn)
        ids = torch.tensor([feed], dtype=torch.long, device=dev)  # [1, q]
        pos = torch.arange(self._next_rope, self._next_rope + q, device=dev)[None]  # [1, q] RoPE positions
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids, cache=self._kv, position_ids=pos, use_cache=True,
                                 logits_to_keep=1)
        except BaseException:
            store._n_new = 0
            store.truncate(start_phys)  # roll back the reserved slots; nothing half-written is kept
            if needs_scores:
                self._scores = [s[:, :start_phys] for s in self._scores]
            raise
        store.end_forward()
        if self._log is not None:
            new_log = np.arange(self.n_fed, self.n_fed + q)
            new_rope = np.arange(self._next_rope, self._next_rope + q)
            L = self.info.num_layers
            self._log = np.concatenate([self._log, np.broadcast_to(new_log, (L, q))], axis=1)
            self._rope = np.concatenate([self._rope, np.broadcast_to(new_rope, (L, q))], axis=1)
        self.n_fed += q
        self._next_rope += q
        return out.logits[0, -1]  # [vocab]

    def _ensure_scores(self) -> None:
        n = self.n_phys
        if self._scores is None or self._scores[0].shape[1] != n:
            H = self.info.num_kv_heads
            self._scores = [torch.zeros((H, n), dtype=torch.float32, device=self.lm.device)
                            for _ in range(self.info.num_layers)]

    def _accumulate(self, layer: int, probs: torch.Tensor) -> None:
        """probs: [1, Hq, q, L] → add the attention each key received, summed per KV head."""
        H = self.info.num_kv_heads
        got = probs[0].sum(dim=1)  # [Hq, L]
        got = got.view(H, -1, got.shape[-1]).sum(dim=1)  # [Hkv, L]
        s = self._scores[layer]
        s[:, :got.shape[1]] += got.to(s.dtype)

    # -- eviction ----------------------------------------------------------------------------------------
    def _overflow_reason(self) -> str:
        if self.policy is not None:
            return self.policy.name
        return self.cache_config.overflow

    def _overflow_target(self) -> int:
        """How many tokens to keep when the context (not a policy budget) is full."""
        ctx = self.context_length
        if self.policy is not None and self.policy.budget < ctx:
            return self.policy.budget - self.policy.slack(self._page_size())
        return ctx // 2

    def _overflow_policy(self, target: int) -> EvictionPolicy:
        mode = self.cache_config.overflow
        sinks = self.protected if mode == "truncate_middle" else 1  # rolling keeps the first (BOS) token
        sinks = min(sinks, max(0, target - 1))
        return StreamingPolicy(sinks=sinks, window=max(1, target - sinks))

    def _evict(self, target: int, reason: str, force_rotate: bool = False) -> None:
        """Evict down to ``target`` tokens per layer: ask the policy which, then compact the store.

        ``force_rotate`` (the context is full): also re-rotate every kept key to its in-cache index, so the
        next token's RoPE position is ``n_keep`` again, whatever the policy."""
        n = self.n_phys
        if n <= target and not force_rotate:
            return
        L = self.info.num_layers
        if self._log is None:
            self._log = np.broadcast_to(np.arange(n), (L, n)).copy()
            self._rope = self._log.copy()
        policy = self.policy if self.policy is not None else self._overflow_policy(target)
        rotate = policy.rope_in_cache or force_rotate
        state = PolicyState(
            positions=self._log,
            scores=(np.stack([s.sum(dim=0).cpu().numpy() for s in self._scores])
                    if self._scores is not None and policy.needs_scores else None),
            protected=self.protected,
            priorities=self._priorities_for(policy),
            page_size=self._page_size(),
            seq_len=len(self.seq),
        )
        drops = policy.select(state, target)
        keep_idx = []
        for layer in range(L):
            mask = np.ones(n, dtype=bool)
            mask[drops[layer]] = False
            keep_idx.append(np.nonzero(mask)[0])
        n_keep = len(keep_idx[0])
        if any(len(k) != n_keep for k in keep_idx) or n_keep > target:
            raise EngineError(f"policy {policy.name} returned an invalid eviction ({n} → {n_keep}, target {target})")
        evicted_everywhere = set(self._log[0][drops[0]].tolist())
        for layer in range(1, L):
            evicted_everywhere &= set(self._log[layer][drops[layer]].tolist())
        old_pages = list(self.store.table.pages) if isinstance(self.store, PagedKV) else []
        owners = None
        if isinstance(self.store, PagedKV):
            P = self.store.page_size
            pool = self.store.arena.pool
            owners = [pool.owner[old_pages[i // P]] for i in keep_idx[0][::P].tolist()]
        keep_t = [torch.from_numpy(k) for k in keep_idx]
        rerotate = None
        if rotate:
            if self._rerotator is None:
                self._rerotator = Rerotator(self.model)
            target_rope = np.arange(n_keep)

            def rerotate(layer, k, idx, _old=self._rope):
                delta = torch.from_numpy(target_rope - _old[layer][idx.cpu().numpy()])
                return self._rerotator(k, delta)
        self.store.compact(keep_t, rotate=rerotate, owners=owners)
        self._log = np.stack([self._log[layer][keep_idx[layer]] for layer in range(L)])
        if rotate:
            self._rope = np.broadcast_to(np.arange(n_keep), (L, n_keep)).copy()
            self._next_rope = n_keep
        else:
            self._rope = np.stack([self._rope[layer][keep_idx[layer]] for layer in range(L)])
        if self._scores is not None:
            self._scores = [s[:, torch.from_numpy(keep_idx[i]).to(s.device)] for i, s in enumerate(self._scores)]
        self._evicted_now = tuple(sorted(int(p) for p in evicted_everywhere))
        self._evict_reason = reason
        self.evicted_total += n - n_keep
        if old_pages:
            new_pages = set(self.store.table.pages)
            self._evicted_pages = {p for p in old_pages if p not in new_pages}

    def _priorities_for(self, policy: EvictionPolicy) -> np.ndarray | None:
        if self._priorities is None:
            return None
        pri = self._priorities.copy()
        default = getattr(policy.params, "default_priority", 35)
        pri[pri < 0] = default
        if len(pri) < len(self.seq):
            pri = np.concatenate([pri, np.full(len(self.seq) - len(pri), default)])
        return pri

    def _truncate(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (only valid inside the intact prefix)."""
        self.store.truncate(n)
        if self._log is not None:
            self._log = self._log[:, :n]
            self._rope = self._rope[:, :n]
            if self._first_evicted() >= n:
                self._log = self._rope = None
        if self._scores is not None:
            self._scores = [s[:, :n] for s in self._scores]
        self._next_rope = n if self._log is None else int(self._rope[0, -1]) + 1 if n else 0

    # -- finishing ---------------------------------------------------------------------------------------
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
                          stop_reason=reason, text=text, stats=stats, warnings=tuple(self._take_notes()))

    def _take_notes(self) -> list[str]:
        notes, self._notes = self._notes, []
        return notes

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

        - mode / page size / K-V precision: the cached K/V are copied into the new store (quantized or
          dequantized page by page); switching from ``off`` re-prefills the sequence on the next step;
        - enabling a policy evicts at once down to its budget;
        - disabling one (or changing to a policy that keeps more) re-prefills what was evicted from the
          text on the next step, when the conversation still fits the context.
        Returns notes describing what happened and what it cost.
        """
        old = self.cache_config
        if cfg == old:
            return []
        policy = self._make_policy(cfg)  # validates
        if cfg.mode == "off" and len(self.seq) >= self.context_length:
            raise ContextOverflowError(
                f"cache off recomputes the whole conversation ({len(self.seq)} tokens), which is longer than "
                f"the model's context ({self.context_length}): keep a cache with an eviction policy")
        notes: list[str] = []
        if self._host is not None:
            self.swap_in()
        rebuild = (cfg.mode != old.mode or cfg.k_dtype != old.k_dtype or cfg.v_dtype != old.v_dtype or
                   (cfg.mode == "paged" and (cfg.page_size != old.page_size or cfg.max_pages != old.max_pages)))
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
            what = _describe(old), _describe(cfg)
            if self.store is None:
                self.n_fed = 0
                self._log = self._rope = None
                self._scores = None
                self._next_rope = 0
                notes.append(f"cache off: {len(self.seq)} tokens will be recomputed every step")
            elif copied:
                notes.append(f"{what[0]} → {what[1]}: moved {copied} tokens of KV in {ms:.1f} ms")
            elif self.seq:
                self.n_fed = 0
                self._next_rope = 0
                notes.append(f"{what[0]} → {what[1]}: {len(self.seq) - (0 if self.generating else 1)} "
                             "tokens re-prefilled on the next step")
        self.cache_config = cfg
        old_policy, self.policy = self.policy, policy
        keys_regrouped = cfg.k_dtype != old.k_dtype or cfg.page_size != old.page_size or old.mode != "paged"
        if rebuild and cfg.mode == "paged" and cfg.k_dtype == "int8" and keys_regrouped:
            notes.append(_int8_key_note(self.info.head_dim, cfg.page_size))
        if cfg.prefix_reuse != old.prefix_reuse:
            notes.append("prefix reuse " + ("on" if cfg.prefix_reuse else "off") + " from the next turn")
        if self.store is not None and self._log is not None and (policy is None or not _same_kind(old_policy, policy)):
            notes += self._restore_evicted()
        if policy is not None and self.store is not None and self.n_phys > policy.budget:
            before = self.n_phys
            self._evict(policy.budget, policy.name)
            notes.append(f"{policy.describe()}: evicted {before - self.n_phys} tokens now")
        elif policy is not None and (old_policy is None or old_policy.describe() != policy.describe()):
            notes.append(f"{policy.describe()} on")
        return notes

    def _restore_evicted(self) -> list[str]:
        """Drop the cache back to its intact prefix so the evicted tokens are re-prefilled from the text."""
        e = self._first_evicted()
        total = self.n_fed
        if total > self.context_length - 1:
            return [f"{total - e} evicted tokens cannot be restored: the conversation ({total} tokens) is longer "
                    f"than the model's context ({self.context_length}); the kept window stays"]
        self._truncate(e)
        self.n_fed = e
        self._log = self._rope = None
        self._next_rope = e
        return [f"restoring evicted tokens: {total - e} tokens re-prefilled from the text on the next step"]

    def _copy_kv(self, src: KVStore, dst: KVStore) -> int:
        n = src.num_tokens
        dst.begin_forward(n, owner=self.turn)
        for layer in range(src.num_layers):
            k, v = src.read_layer(layer)  # [H, n, D]
            dst.update(layer, k[None], v[None])
        dst.end_forward()
        return n

    # -- swap --------------------------------------------------------------------------------------------
    def swap_out(self) -> int:
        """Move this (idle) session's K/V to host memory and give its pages back. Returns bytes moved."""
        if self.generating:
            raise EngineError("cannot swap out during a reply")
        if self.store is None or self._host is not None or self.n_phys == 0:
            return 0
        # Quantized pages travel as they are held (codes + scales), so a swapped int8 chat costs int8 bytes.
        host = self.store.to_host(pin=self.lm.device.type == "cuda")
        self.store.free()
        self._host = host
        return host.nbytes

    def swap_in(self) -> None:
        """Bring swapped-out K/V back into the cache (called automatically before the next turn)."""
        if self._host is None:
            return
        host, self._host = self._host, None
        self.store.from_host(host)

    def fork(self) -> "ChatSession":
        """A new session with the same conversation; paged caches share full pages (copy-on-write)."""
        if self.generating:
            raise EngineError("cannot fork during a reply")
        if self._host is not None:
            self.swap_in()
        other = ChatSession.__new__(ChatSession)
        other.__dict__.update(self.__dict__)
        other.session_id = next(_session_ids)
        other.seq = list(self.seq)
        other._notes = []
        if isinstance(self.store, PagedKV):
            other.store = self.store.fork(other.session_id)
            other._kv = KVCache(other.store)
        elif self.store is not None:
            other._make_store(self.cache_config)
            self._copy_kv(self.store, other.store)
        if self._scores is not None:
            other._scores = [s.clone() for s in self._scores]
        other._reset_turn_state()
        return other

    def reset(self) -> None:
        """Forget the conversation and free its cache."""
        if self.store is not None:
            self.store.truncate(0)
        self._host = None
        self.seq = []
        self.n_fed = 0
        self._log = self._rope = None
        self._scores = None
        self._next_rope = 0
        self.generating = False
        self.turn = -1

    def close(self) -> None:
        """Free the cache (pages go back to the shared arena)."""
        if self.store is not None:
            self.store.free()
        self._host = None

    # -- observation -------------------------------------------------------------------------------------
    def snapshot(self, phase: str = "decode", step_ms: float = 0.0) -> CacheSnapshot:
        """A frozen picture of the cache now (numpy copies)."""
        info = self.info
        L = info.num_layers
        store = self.store
        cfg = self.cache_config
        n_phys = self.n_phys
        host_pages = 0
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
            for p in self._evicted_pages:
                if p < len(state) and ref[p] == 0:
                    state[p] = snap.PAGE_EVICTED
            owner = np.asarray(pool.owner, dtype=np.int32)
            fill = np.asarray(pool.fill, dtype=np.int32)
            if self._host is not None:  # swapped out: its pages live in host memory, shown after the pool
                P = store.page_size
                host_len = self._host.n
                host_pages = -(-host_len // P)
                state = np.concatenate([state, np.full(host_pages, snap.PAGE_OFFLOADED, dtype=np.int8)])
                owner = np.concatenate([owner, np.asarray(self._host.owners[:host_pages], dtype=np.int32)])
                fill = np.concatenate([fill, np.asarray([min(P, host_len - i * P) for i in range(host_pages)],
                                                        dtype=np.int32)])
                ref = np.concatenate([ref, np.ones(host_pages, dtype=np.int32)])
            num_pages = len(state)
            pages_used = np.full(L, len(store.table.pages) if self._host is None else host_pages, dtype=np.int64)
        else:
            num_pages = 0
            state = np.zeros(0, dtype=np.int8)
            owner = np.zeros(0, dtype=np.int32)
            fill = np.zeros(0, dtype=np.int32)
            ref = np.zeros(0, dtype=np.int32)
            pages_used = np.zeros(L, dtype=np.int64)
        if self._host is not None:
            bytes_per_layer = np.full(L, self._host.nbytes // L, dtype=np.int64)  # host bytes, all layers alike
            tokens_per_layer = np.full(L, self._host.n, dtype=np.int64)
        else:
            bytes_per_layer = np.asarray(store.bytes_per_layer() if store is not None else [0] * L, dtype=np.int64)
            tokens_per_layer = np.full(L, n_phys, dtype=np.int64)
        token_state = self._token_state()
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
            tokens_per_layer=tokens_per_layer,
            bytes_per_layer=bytes_per_layer,
            capacity_tokens=self._capacity(),
            page_state=state,
            page_owner=owner,
            page_fill=fill,
            page_refcount=ref,
            token_state=token_state,
            weights_bytes=info.weights_bytes,
            kv_bytes=int(bytes_per_layer.sum()) if self._host is None else 0,
            device_bytes=int(device_bytes),
            reused_tokens=self._reused,
            recomputed_tokens=self._recomputed,
            first_divergence=self._divergence,
            seq_len=len(self.seq),
            context_length=self.context_length,
            k_dtype=cfg.k_dtype,
            v_dtype=cfg.v_dtype,
            evicted_total=self.evicted_total,
            evicted_positions=self._evicted_now,
            evict_reason=self._evict_reason,
            phase=phase,
            step_ms=step_ms,
            prefill_ms=self._prefill_ms,
            ttft_ms=self._ttft_ms,
            decode_tokens_per_s=(n_decode / (self._decode_ms / 1000.0)) if self._decode_ms > 0 else 0.0,
            offloaded=self._host is not None,
            notes=tuple(self._notes),
        )

    def _capacity(self) -> int:
        if self.store is None:
            return 0
        if self.policy is not None:
            return self.policy.budget
        return min(self.store.capacity_tokens(), self.context_length)

    def _token_state(self) -> np.ndarray:
        """Per logical position: kept / sink / evicted / quantized / pinned (layer 0's view for 'kept')."""
        T = len(self.seq)
        state = np.full(T, snap.TOKEN_KEPT, dtype=np.int8)
        if self.store is None:
            return state
        n_fed = min(self.n_fed, T)
        if self._log is not None:
            kept_any = np.zeros(T, dtype=bool)
            kept_any[self._log[self._log < T]] = True
            ev = np.ones(T, dtype=bool)
            ev[n_fed:] = False
            ev &= ~kept_any
            state[ev] = snap.TOKEN_EVICTED
        cfg = self.cache_config
        if cfg.quantized and isinstance(self.store, PagedKV):
            P = self.store.page_size
            full = (self.n_phys // P) * P
            if self._log is None:
                state[:min(full, T)] = np.where(state[:min(full, T)] == snap.TOKEN_KEPT, snap.TOKEN_QUANTIZED,
                                                state[:min(full, T)])
            else:
                q = self._log[0][:full]
                q = q[q < T]
                state[q] = snap.TOKEN_QUANTIZED
        if self.policy is not None and self.policy.name == "streaming":
            sinks = min(self.policy.params.sinks, T)
            state[:sinks] = snap.TOKEN_SINK
        if self._priorities is not None:
            pinned = np.nonzero(self._priorities[:T] >= 100)[0]
            state[pinned[state[pinned] != snap.TOKEN_EVICTED]] = snap.TOKEN_PINNED
        return state


def _int8_key_note(head_dim: int, page_size: int) -> str:
    """How int8 keys are grouped at this page size, and why (``engine.kv.quant.int8_key_layout``)."""
    if int8_key_layout(head_dim, page_size) == "channel":
        return (f"int8 keys: per channel over each {page_size}-token page (KIVI), no dearer than per token "
                f"at head dim {head_dim}")
    return (f"int8 keys: one scale per token (q8_0-like); pages of {2 * head_dim}+ tokens would group them per "
            f"channel at no extra cost, which keeps more precision")


def _describe(cfg: CacheConfig) -> str:
    if cfg.mode != "paged":
        return cfg.mode
    out = f"paged/{cfg.page_size}"
    if cfg.quantized:
        out += f" K:{cfg.k_dtype} V:{cfg.v_dtype}"
    return out


def _same_kind(a: EvictionPolicy | None, b: EvictionPolicy | None) -> bool:
    """True if switching from ``a`` to ``b`` can keep what ``a`` evicted (same policy, budget not larger)."""
    return a is not None and b is not None and a.name == b.name and b.budget <= a.budget
