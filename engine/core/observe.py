"""Building the ``CacheSnapshot`` of a sequence (``engine.core.sequence.Sequence``) and its cache
(``engine.core.seq_cache.SeqCache``): from the cache index, the page pool and this step's evictions, never from raw
lists kept on the side.

What a snapshot promises (tested after every step of a random walk through every setting):

- ``len(token_state) == seq_len``; a token is *kept* (or sink / quantized / pinned) iff some layer holds it,
  *evicted* iff it was fed and no layer holds it, *not cached* otherwise (cache off, or still to be fed);
- ``evicted_total`` is the number of evicted tokens in the strip;
- tokens per layer never exceed ``capacity_tokens``;
- ``pages_used_per_layer`` is exactly the number of pages in the session's block table, and the page map's
  "just evicted" pages are the pages this step's eviction gave back (still free).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import snapshot as snap
from engine.snapshot import CacheSnapshot

if TYPE_CHECKING:
    from engine.core.seq_cache import SeqCache
    from engine.core.sequence import Sequence


def page_map(cache: "SeqCache") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, tuple]:
    """(state, owner, fill, refcount, pages of this sequence, groups) over every pool the cache's layers use
    (one for plain models; full layers then each sliding window for models whose layers differ), plus host
    pages when swapped. ``groups``: (label, pages) in that order, for the page map's captions."""
    parts = cache.store.page_groups() if hasattr(cache.store, "page_groups") else [("", cache.store)]
    if not parts:  # no paged part (contiguous full layers, state layers)
        empty = np.zeros(0, dtype=np.int32)
        return np.zeros(0, dtype=np.int8), empty, empty, empty, 0, ()
    if len(parts) == 1 and parts[0][0] == "":
        return (*_one_pool(cache, parts[0][1], cache.host), ())
    maps = [_one_pool(cache, store, None) for _, store in parts]  # swapped: its pages are simply free
    groups = tuple((label, len(m[0])) for (label, _), m in zip(parts, maps))
    return (*(np.concatenate([m[i] for m in maps]) for i in range(4)), sum(m[4] for m in maps), groups)


def _one_pool(cache: "SeqCache", store, host) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    pool = store.arena.pool
    state = pool.page_states()  # [num_pages] int8, this snapshot's own
    freed = {p for e in cache.last.evictions for p in e.freed_pages}
    for p in freed:
        if p < len(state) and state[p] == snap.PAGE_FREE:
            state[p] = snap.PAGE_EVICTED
    owner = np.asarray(pool.owner, dtype=np.int32)
    fill = np.asarray(pool.fill, dtype=np.int32)
    ref = np.asarray(pool.ref, dtype=np.int32)
    if host is None:
        return state, owner, fill, ref, len(store.table.pages)
    P = store.page_size
    pages = -(-host.n // P)  # swapped out: its pages live in host memory, shown after the pool
    state = np.concatenate([state, np.full(pages, snap.PAGE_OFFLOADED, dtype=np.int8)])
    owner = np.concatenate([owner, np.asarray((host.owners + [-1] * pages)[:pages], dtype=np.int32)])
    fill = np.concatenate([fill, np.asarray([min(P, host.n - i * P) for i in range(pages)], dtype=np.int32)])
    ref = np.concatenate([ref, np.ones(pages, dtype=np.int32)])
    return state, owner, fill, ref, pages


def own_pages(cache: "SeqCache", num_pages: int, groups: tuple) -> np.ndarray:
    """[num_pages] bool over the page map: the pages this cache's block tables hold (its swapped-out pages,
    shown after the pool, too). The rest of a shared pool's held pages belong to other chats."""
    mine = np.zeros(num_pages, dtype=bool)
    parts = cache.store.page_groups() if hasattr(cache.store, "page_groups") else [("", cache.store)]
    sizes = [n for _, n in groups] if groups else [num_pages]
    offset = 0
    for (_, store), size in zip(parts, sizes):
        pages = np.asarray(store.table.pages, dtype=np.int64)
        mine[offset + pages[pages < size]] = True
        offset += size
    if cache.host is not None and not groups and parts:
        mine[parts[0][1].arena.pool.num_pages:] = True
    return mine


def token_state(seq: "Sequence", cache: "SeqCache") -> np.ndarray:
    """Per logical position of the conversation: TOKEN_* codes (layer 0's view for "quantized")."""
    T = len(seq.ids)
    state = np.full(T, snap.TOKEN_NOT_CACHED, dtype=np.int8)
    if cache.store is None:
        return state
    index = cache.index
    fed = min(index.next_pos, T)
    held = index.held(T)
    for a, b in getattr(cache.store, "held_ranges", list)():  # what the sliding windows still show
        held[a:min(b, T)] = True
    state[:fed] = snap.TOKEN_EVICTED
    state[held] = snap.TOKEN_KEPT
    cfg = cache.cache_config
    if cfg.quantized and cfg.mode == "paged" and index.num_layers:
        full = (index.n // cfg.page_size) * cfg.page_size
        q = index.log[0][:, :full]  # [H, full]: layer 0's tokens in whole (quantized) pages
        state[q[q < T]] = snap.TOKEN_QUANTIZED
    if index.split:  # a per-head eviction: some heads of every layer dropped these
        state[held & ~index.held_by_all(T)] = snap.TOKEN_PARTIAL
    if cache.policy is not None:
        sinks = cache.policy.sink_count(T)
        state[:sinks][held[:sinks]] = snap.TOKEN_SINK
    if seq.priorities is not None:
        from engine.policies import PINNED

        pri = seq.priorities[:T]
        pinned = np.nonzero((pri >= PINNED) & held[:len(pri)])[0]
        state[pinned] = snap.TOKEN_PINNED
    return state


def capacity(cache: "SeqCache") -> int:
    """Tokens the cache may hold per layer now: a policy's budget, else the store (or pool limit) and the
    context, whichever is lower."""
    if cache.store is None:
        return 0
    cap = min(cache.store.capacity_tokens(), cache.lm.info.context_length)
    return min(cap, cache.policy.budget) if cache.policy is not None else cap


def restored_pages(cache: "SeqCache") -> tuple[int, ...]:
    """The pages the chat's turn took from the KV disk tier that it still holds (a plain paged store's only)."""
    pages = cache.reused.disk_pages
    held = set(getattr(getattr(cache.store, "table", None), "pages", ())) if pages else set()
    return tuple(p for p in pages if p in held)


def checkpoint_fields(store, groups: tuple) -> dict:
    """The snapshot's checkpoint facts (``engine.kv.store.checkpoints``; none for a plain store): their positions,
    the bytes of each (its states' copy and the window pages the live windows no longer hold), all of them
    together (pages two checkpoints share counted once: ``checkpoint_bytes``) and the page map's pages they alone
    hold (in the map's order: the full pool, then each sliding group)."""
    cps = getattr(store, "checkpoints", None)
    if store is None or not cps or not hasattr(store, "checkpoint_positions"):
        return {}
    starts, at = {}, 0
    for label, n in groups:
        starts[label], at = at, at + n
    sizes, pages = [], set()
    for cp in cps:
        own = cp.nbytes
        for w, kept in cp.windows.items():
            live = store.windows[w]
            extra = kept.pages() - live.pages() if hasattr(kept, "pages") else set()
            own += len(extra) * live.arena.page_bytes
            if f"sliding {w}" in starts:
                pages |= {starts[f"sliding {w}"] + p for p in extra}
        sizes.append(own)
    return dict(checkpoints=tuple(store.checkpoint_positions()), checkpoint_sizes=tuple(sizes),
                checkpoint_bytes=int(sum(store.checkpoint_bytes())), checkpoint_pages=tuple(sorted(pages)))


def build(seq: "Sequence", cache: "SeqCache", phase: str = "decode", step_ms: float = 0.0,
          draft: "SeqCache | None" = None) -> CacheSnapshot:
    """A frozen picture of ``seq``'s cache now (read-only numpy copies); ``draft``'s pool after it (``with_draft_pool``)."""
    lm = cache.lm
    info, cfg, store, t = lm.info, cache.cache_config, cache.store, seq.reply
    L = info.num_layers
    paged = store is not None and (cfg.mode == "paged" or hasattr(store, "page_groups"))
    if paged:
        state, owner, fill, ref, pages, groups = page_map(cache)
    else:
        state, owner, fill, ref, pages, groups = (np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.int32),
                                                  np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), 0, ())
    held = cache.index.n if store is not None else 0
    per_layer_tokens = store.layer_tokens() if hasattr(store, "layer_tokens") else [held] * L
    if cache.host is not None:
        per_layer = [cache.host.nbytes // L] * L  # host bytes, all layers alike
    else:
        per_layer = store.bytes_per_layer() if store is not None else [0] * L
    n_decode = max(0, len(t.generated) - 1)
    last = cache.last
    evs = last.evictions
    tokens = token_state(seq, cache)
    # positions this step evicted that are still evicted (a switch since may have restored them)
    evicted_now = tuple(sorted(p for p in {p for e in evs for p in e.positions}
                               if p < len(tokens) and tokens[p] == snap.TOKEN_EVICTED))
    fast = lm.fast_step
    return with_draft_pool(CacheSnapshot(
        generation_id=seq.generation_id, step=t.step, mode=cfg.mode, policy=cfg.policy,
        page_size=cfg.page_size if cfg.mode == "paged" else 0, num_pages=len(state),
        pages_used_per_layer=np.asarray(store.layer_pages() if hasattr(store, "layer_pages") else [pages] * L,
                                        dtype=np.int64),
        tokens_per_layer=np.asarray(per_layer_tokens, dtype=np.int64),
        bytes_per_layer=np.asarray(per_layer, dtype=np.int64),
        capacity_tokens=capacity(cache),
        page_state=state, page_owner=owner, page_fill=fill, page_refcount=ref,
        token_state=tokens,
        weights_bytes=info.weights_bytes,
        kv_bytes=int(sum(per_layer)) if cache.host is None else 0,
        device_bytes=int(torch.cuda.memory_allocated()) if lm.device.type == "cuda" else 0,
        reused_tokens=t.reused, recomputed_tokens=t.recomputed, first_divergence=t.divergence,
        seq_len=len(seq.ids), context_length=info.context_length,
        k_dtype=cfg.k_dtype, v_dtype=cfg.v_dtype,
        evicted_total=int(np.count_nonzero(tokens == snap.TOKEN_EVICTED)),
        evicted_positions=evicted_now,
        evict_reason=evs[-1].reason if evs else "",
        phase=phase, step_ms=step_ms, prefill_ms=t.prefill_ms, ttft_ms=t.ttft_ms,
        decode_tokens_per_s=(n_decode / (t.decode_ms / 1000.0)) if t.decode_ms > 0 else 0.0,
        policy_ms=last.policy_ms, policy_prefill_ms=t.policy_prefill_ms, policy_decode_ms=t.policy_decode_ms,
        offloaded=cache.host is not None,
        notes=tuple(seq.notes),
        page_groups=groups,
        layer_kinds=tuple(info.layer_kinds),
        written_pages=tuple(p for p in last.written if p < len(state)) if paged else (),
        restored_pages=restored_pages(cache),
        page_mine=own_pages(cache, len(state), groups) if paged else None,
        batch_size=last.batch_size,
        verified=last.verified, rolled_back=last.rolled_back,
        step_path=last.path, account=t.account, **checkpoint_fields(store, groups),
        fast_step=fast.describe() if fast is not None else "",
    ), draft)


def with_draft_pool(snapshot: CacheSnapshot, draft: "SeqCache | None") -> CacheSnapshot:
    """``snapshot`` with the draft model's pool drawn after the model's own (a second group of the page map:
    "draft model: pages 32–63") when there is a ``draft`` cache; else ``snapshot`` itself. The draft model's
    pages are its own arena's, shared by every chat's drafter: this chat's are marked as its own."""
    if draft is None or draft.store is None or not snapshot.num_pages:
        return snapshot
    state, owner, fill, ref, _held, groups = page_map(draft)
    if groups or not len(state):  # a draft model whose layers differ: not drawn (its pools would not line up)
        return snapshot
    s, n = snapshot, snapshot.num_pages
    mine = s.page_mine if s.page_mine is not None else np.ones(n, dtype=bool)
    return dataclasses.replace(
        s, num_pages=n + len(state),
        page_state=np.concatenate([s.page_state, state]), page_owner=np.concatenate([s.page_owner, owner]),
        page_fill=np.concatenate([s.page_fill, fill]), page_refcount=np.concatenate([s.page_refcount, ref]),
        page_groups=tuple(s.page_groups or (("model", n),)) + (("draft model", len(state)),),
        page_mine=np.concatenate([mine, own_pages(draft, len(state), ())]))
