"""Cache settings against a model: ``validate`` a ``CacheConfig``, build its store, and ``apply`` a new one to a
sequence's live cache (between two steps, also in the middle of a reply).

``apply`` asks before it acts: the setting is validated, the new store is built and filled before the old
one is freed, and a policy switched on evicts before it is installed, so any refusal (a typed error) leaves
the cache exactly as it was, still on its old setting.
"""

from __future__ import annotations

import dataclasses
import time

from typing import TYPE_CHECKING

from engine.config import CacheConfig
from engine.errors import CacheCapacityError, ContextOverflowError, UnsupportedModelError
from engine.kv.quantized.quant import int8_key_layout
from engine.kv.store.grouped import GroupedKV, Layout
from engine.kv.store.contiguous import ContiguousKV
from engine.kv.store.storage import KVStore, PagedKV, copy_kv
from engine.kv.store.window import WindowKV
from engine.policies import EvictionPolicy, get_policy
from engine.snapshot import MissReason
from engine.core import reprefill
from engine.core.vocab import Note, NoteKind

if TYPE_CHECKING:
    from engine.core.seq_cache import SeqCache
    from engine.core.sequence import Sequence

def validate(cfg: CacheConfig, lm) -> EvictionPolicy | None:
    """The policy ``cfg`` asks for, if ``cfg`` can run on this model (a ``LoadedModel``); ``ValueError`` says
    why not, before anything changes."""
    info = lm.info
    if info.unsupported:
        raise UnsupportedModelError(f"{info.name}: {info.unsupported}")
    policy = get_policy(cfg.policy, cfg.policy_params)
    if cfg.mode == "off" and (policy is not None or cfg.quantized):
        raise ValueError("cache off: KV precision and eviction policies need a cache (contiguous or paged)")
    if cfg.quantized and cfg.mode != "paged":
        raise ValueError("KV int8/int4/tq is kept per page: choose the paged cache mode")
    if cfg.overflow == "policy" and policy is None:
        raise ValueError("overflow 'policy' needs an eviction policy (streaming, h2o, expected or priority)")
    _check_layer_kinds(cfg, policy, lm)
    if cfg.mode == "off" and cfg.overflow_evicts:
        raise ValueError(f"cache off: overflow '{cfg.overflow}' evicts from a cache; choose contiguous or paged")
    if policy is not None and policy.budget >= info.context_length:
        what = "sinks + window" if policy.rope_in_cache else "budget"
        raise ValueError(f"policy {policy.name}: {what} {policy.budget} must be below the model's context of "
                         f"{info.context_length}")
    return policy


def _check_layer_kinds(cfg: CacheConfig, policy: EvictionPolicy | None, lm) -> None:
    """Refuse what cannot run on this model's layers. Evicting runs on the full-attention layers; the sliding
    windows and recurrent states go on as the model runs them (``engine.policies.layer_kinds``). Moving kept keys to
    in-cache positions (StreamingLLM, the truncate-middle / rolling overflow) re-rotates them on every layer that
    holds keys, the windows included, so it needs keys this module can re-rotate exactly."""
    from engine.kv.store.rope import keyless_layers, rerotation_refusal

    info = lm.info
    if cfg.mode == "off":
        return
    layout = Layout(info.layer_kinds, info.windows)
    sliding_only = bool(info.layer_kinds) and not layout.plain and not layout.full
    if policy is not None and sliding_only:
        raise ValueError(f"policy {policy.name}: every layer of this model slides; its windows already bound the "
                         "cache")
    moves = (policy is not None and policy.rope_in_cache) or cfg.overflow_evicts
    if not moves:
        return
    what = f"policy {policy.name}" if policy is not None and policy.rope_in_cache else f"overflow {cfg.overflow}"
    if sliding_only:
        raise ValueError(f"{what}: every layer of this model slides (its windows bound the cache), so nothing can "
                         "be evicted to go on past the context")
    why = rerotation_refusal(lm.model, keyless_layers(info.layer_kinds))  # cached per model
    if why:
        raise ValueError(f"{what} moves kept keys to new positions, but {why}")


def make_store(lm, cfg: CacheConfig, session_id: int) -> KVStore | None:
    """An empty store for ``cfg`` (None for cache off). Typed error (nothing allocated) if memory is short."""
    info = lm.info
    if cfg.mode == "off":
        return None
    layout = Layout(info.layer_kinds, info.windows)
    if info.layer_kinds and not layout.plain:
        return _grouped_store(lm, cfg, layout, session_id)
    if cfg.mode == "contiguous":
        return ContiguousKV(lm.kv_shape, initial_tokens=256)
    arena = lm.kv_arenas.get(cfg.page_size, cfg.max_pages, cfg.k_dtype, cfg.v_dtype)
    return PagedKV(arena, session_id)


def _grouped_store(lm, cfg: CacheConfig, layout: Layout, session_id: int) -> GroupedKV:
    """Full layers as ``cfg`` says; each sliding window in pages of its own (in every mode: that is how a
    window gives memory back), at ``cfg``'s page size and precision; the states of state layers."""
    from engine.kv.store.states import StateLayers

    shape = lm.kv_shape
    page = cfg.page_size if cfg.mode == "paged" else 16
    full = None
    if layout.full:
        group_shape = dataclasses.replace(shape, num_layers=len(layout.full))
        if cfg.mode == "contiguous":
            full = ContiguousKV(group_shape, initial_tokens=256)
        else:
            full = PagedKV(lm.kv_arenas.get(page, cfg.max_pages, cfg.k_dtype, cfg.v_dtype, "full", group_shape),
                           session_id)
    windows = {}
    for w, layers in layout.window_groups().items():
        arena = lm.kv_arenas.get(page, cfg.max_pages, cfg.k_dtype, cfg.v_dtype, f"sliding{w}",
                                 dataclasses.replace(shape, num_layers=len(layers)), tokens=4 * (w + page))
        windows[w] = WindowKV(arena, w, session_id)
    config = lm.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return GroupedKV(layout, full, windows, StateLayers(text, layout.states), cfg.checkpoints)


def describe(cfg: CacheConfig) -> str:
    if cfg.mode != "paged":
        return cfg.mode
    out = f"paged/{cfg.page_size}"
    if cfg.quantized:
        out += f" K:{cfg.k_dtype} V:{cfg.v_dtype}"
    return out


def apply(cache: "SeqCache", seq: "Sequence", cfg: CacheConfig, max_chunk: int) -> list[str]:
    """Move ``cache`` (the cache of ``seq``) to ``cfg``; returns notes saying what happened and what it cost."""
    old = cache.cache_config
    if cfg == old:
        return []
    policy = validate(cfg, cache.lm)
    ctx = cache.lm.info.context_length
    if cfg.mode == "off" and len(seq.ids) >= ctx:
        raise ContextOverflowError(
            f"cache off recomputes the whole conversation ({len(seq.ids)} tokens), which is longer than "
            f"the model's context ({ctx}): keep a cache with an eviction policy")
    cache.swap_in(seq.ids)
    fed = _fed(cache, seq)
    notes: list[str] = []
    if cache.store is not None and cache.index.n and not _keeps_evicted(cache.policy, policy):
        notes += _restore_evicted(cache, ctx)
    if _score_kind(cache.policy) != _score_kind(policy):  # H2O's sums and expected attention do not mix
        cache.evictor.scores.stop()
    if policy is None or not policy.needs_queries:
        cache.evictor.queries.clear()
    evicted = _evict_for(cache, seq, policy, max_chunk)
    notes += evicted
    if _needs_new_store(old, cfg):
        notes += _move_store(cache, seq, old, cfg)
    old_policy = cache.policy
    cache.cache_config, cache.policy = cfg, policy
    if policy is None or not policy.scored:
        cache.evictor.scores.stop()
    if policy is not None and not evicted and (old_policy is None or old_policy.describe() != policy.describe()):
        notes.append(Note(f"{policy.describe()} on", NoteKind.POLICY_ON, policy=policy.name,
                          params=dataclasses.asdict(policy.params)))
    regrouped = cfg.k_dtype != old.k_dtype or cfg.page_size != old.page_size or old.mode != "paged"
    if cfg.mode == "paged" and cfg.k_dtype == "int8" and regrouped:
        notes.append(int8_key_note(cache.lm.info.head_dim, cfg.page_size))
    if cfg.prefix_reuse != old.prefix_reuse:
        notes.append("prefix reuse " + ("on" if cfg.prefix_reuse else "off") + " from the next turn")
    _read_again(cache, seq, fed, old, cfg)
    return notes


def rereads(cache: "SeqCache", seq: "Sequence", cfg: CacheConfig) -> int:
    """Tokens ``apply(cfg)`` would have this chat's model read again — before a running reply goes on, or with an
    idle chat's next message — because the change cuts its cache back below what was read: what an eviction policy
    dropped comes back from the text (StreamingLLM → H2O, eviction off), a cache turned on reads the chat. Asked
    before applying, nothing changed (0 for a change that moves or keeps the cached tokens)."""
    old = cache.cache_config
    if cfg == old or cfg.mode == "off":
        return 0  # cache off reads the whole chat at every step anyway: its own note says so
    if cache.store is None:  # the cache turned on: everything read so far is read into it
        return _fed(cache, seq) if seq.running else max(0, len(seq.ids) - 1)
    try:
        policy = get_policy(cfg.policy, cfg.policy_params)
    except (TypeError, ValueError):
        return 0  # ``apply`` refuses it, saying why
    index = cache.index
    if not index.n or _keeps_evicted(cache.policy, policy) or index.intact == index.n == index.next_pos:
        return 0
    if index.next_pos > cache.lm.info.context_length - 1:
        return 0  # too long to restore: the kept window stays (``_restore_evicted``)
    try:
        kept = cache.store.reusable(index.intact)
    except Exception:  # noqa: BLE001 - a store swapped to host memory: its intact prefix is the estimate
        kept = index.intact
    return max(0, index.next_pos - kept)


def rereads_ms(cache: "SeqCache", tokens: int, cfg: CacheConfig) -> float:
    """What reading ``tokens`` again under ``cfg`` should take at the model's measured prefill rate."""
    if tokens <= 0:
        return 0.0
    try:
        policy = get_policy(cfg.policy, cfg.policy_params)
    except (TypeError, ValueError):
        policy = None
    return reprefill.estimate_ms(cache.lm, tokens, policy is not None and policy.scored)


def _fed(cache: "SeqCache", seq: "Sequence") -> int:
    """Positions of the running reply's sequence the model has read: the cache's fed tokens (cache off: every token
    before the last while it decodes, nothing before its first forward)."""
    if cache.store is not None:
        return cache.index.next_pos
    return len(seq.ids) - 1 if seq.running and seq.reply.generated else 0


def _read_again(cache: "SeqCache", seq: "Sequence", fed: int, old: CacheConfig, cfg: CacheConfig) -> None:
    """A running reply whose cache the change cut back below what it had read reads those tokens again before it
    goes on: tracked (``engine.core.reprefill``), with what that should take, so the reply says so while it runs and
    its time is not counted as TTFT. Cache off needs none: it reads the whole text every step anyway."""
    if not seq.running or cache.store is None or cache.index.next_pos >= fed:
        return
    start = cache.index.next_pos
    scores = cache.policy is not None and cache.policy.scored  # H2O, Expected Attention: the scored path, slower
    estimate = reprefill.estimate_ms(cache.lm, fed - start, scores)
    reprefill.begin(seq.reply, start, fed, estimate, old, cfg)


def _score_kind(policy: EvictionPolicy | None) -> str:
    """What a policy's per-token scores mean: "" none, "attention" (H2O), "expected" (Expected Attention)."""
    if policy is None or not policy.scored:
        return ""
    return "expected" if policy.needs_queries else "attention"


def _needs_new_store(old: CacheConfig, cfg: CacheConfig) -> bool:
    return (cfg.mode != old.mode or cfg.k_dtype != old.k_dtype or cfg.v_dtype != old.v_dtype or
            (cfg.mode == "paged" and (cfg.page_size != old.page_size or cfg.max_pages != old.max_pages)))


def _keeps_evicted(old: EvictionPolicy | None, new: EvictionPolicy | None) -> bool:
    """True if switching from ``old`` to ``new`` may keep what ``old`` evicted (same policy, budget not larger)."""
    return old is None or (new is not None and old.name == new.name and new.budget <= old.budget)


def _restore_evicted(cache: "SeqCache", ctx: int) -> list[str]:
    """Drop the cache back to its intact prefix so the evicted tokens are re-prefilled from the text."""
    index = cache.index
    if index.intact == index.n == index.next_pos:
        return []  # nothing was evicted
    total = index.next_pos
    if total > ctx - 1:
        return [f"{total - index.n} evicted tokens cannot be restored: the conversation ({total} tokens) is longer "
                f"than the model's context ({ctx}); the kept window stays"]
    kept = cache.store.reusable(index.intact)
    cache.cut_back(kept, MissReason.POLICY if cache.policy is not None else MissReason.EVICTED,
                   "evicted earlier, computed again from the text once the eviction setting was switched off")
    return [f"restoring evicted tokens: {total - kept} tokens re-prefilled from the text on the next step"]


def _evict_for(cache: "SeqCache", seq: "Sequence", policy: EvictionPolicy | None, max_chunk: int) -> list[str]:
    """A policy switched on (or tightened) evicts now, in the current store, before it is installed."""
    if policy is None or cache.store is None or cache.index.n <= policy.budget:
        return []
    before = cache.index.n
    cx = cache.context(seq.protected, seq.priorities, len(seq.ids), max_chunk)
    done = cache.evictor.evict_now(cache.store, cache.index, policy, policy.budget, cx)
    cache.record_evictions(done)
    seq.add_notes([n for e in done for n in e.notes])
    n = before - cache.index.n
    return [Note(f"{policy.describe()}: evicted {n} tokens now", NoteKind.POLICY_EVICTED, policy=policy.name,
                 params=dataclasses.asdict(policy.params), tokens=n, rest=f"evicted {n} tokens now")]


def _slot_owners(src, n: int) -> list[int]:
    """The turn that wrote each of the first ``n`` slots of a paged store (its page's owner); [] otherwise."""
    if not isinstance(src, PagedKV) or not n:
        return []
    owner, pages, P = src.arena.pool.owner, src.table.pages, src.page_size
    return [owner[pages[s // P]] for s in range(min(n, len(pages) * P))]


def _keep_owners(dst, owners: list[int]) -> None:
    """Each page of a rebuilt paged store keeps the turn of its first token (the page map colours pages by turn:
    after a page-size change they all took the current turn's colour)."""
    if not isinstance(dst, PagedKV) or not owners:
        return
    pool, P = dst.arena.pool, dst.page_size
    for j, page in enumerate(dst.table.pages):
        pool.set_owner(page, owners[min(j * P, len(owners) - 1)])


def _move_store(cache: "SeqCache", seq: "Sequence", old: CacheConfig, cfg: CacheConfig) -> list[str]:
    """Build the new store, copy the cached K/V into it, and only then free the old one."""
    t0 = time.perf_counter()
    src = cache.store
    n = cache.index.n if src is not None else 0
    dst = make_store(cache.lm, cfg, cache.owner_id)
    try:
        target = dst.full if isinstance(dst, GroupedKV) else dst  # windows hold their window, whatever n is
        if target is not None and n and not target.can_reserve(n):
            raise CacheCapacityError(
                f"{describe(cfg)} cannot hold this chat's {n} cached tokens within its limits: raise the page "
                "limit, close other chats, or choose an eviction policy first")
        owners = _slot_owners(src, n)  # read before the old pages go
        if isinstance(src, GroupedKV) and isinstance(dst, GroupedKV):
            copied = src.copy_into(dst, owner=seq.turn) if n else 0
        else:
            copied = copy_kv(src, dst, owner=seq.turn) if dst is not None and n else 0
            _keep_owners(dst, owners)
    except BaseException:
        if dst is not None:
            dst.free()
        raise
    if src is not None:
        src.free()
    fed = cache.index.next_pos if src is not None else 0
    cache.set_store(dst)
    ms = (time.perf_counter() - t0) * 1000.0
    if not seq.running and not copied:  # what the next prompt shares with the chat is computed again: say why
        held = fed or max(0, len(seq.ids) - 1)
        why = MissReason.OFF if dst is None or old.mode == "off" else MissReason.SETTINGS
        cache.lost = (held, why, "the cache was off" if why is MissReason.OFF else
                      f"the cache setting changed ({describe(old)} → {describe(cfg)}) and its tokens were not moved")
    if dst is None:
        cache.index.reset()
        cache.evictor.scores.stop()
        return [Note(f"cache off: {len(seq.ids)} tokens will be recomputed every step", NoteKind.CACHE_OFF,
                     tokens=len(seq.ids))]
    if copied:
        return [_switch_note(old, cfg, f"moved {copied} tokens of KV in {ms:.1f} ms")]
    cache.index.reset()
    if seq.ids:
        pending = len(seq.ids) - (0 if seq.running else 1)
        return [_switch_note(old, cfg, f"{pending} tokens re-prefilled on the next step")]
    return []


def _switch_note(old: CacheConfig, new: CacheConfig, rest: str) -> Note:
    return Note(f"{describe(old)} → {describe(new)}: {rest}", NoteKind.CACHE_SWITCH, old=old, new=new, rest=rest)


def int8_key_note(head_dim: int, page_size: int) -> str:
    """How int8 keys are grouped at this page size, and why (``engine.kv.paged.sizes.int8_key_layout``)."""
    layout = int8_key_layout(head_dim, page_size)
    if layout == "channel":
        rest = f"per channel over each {page_size}-token page (KIVI), no dearer than per token at head dim {head_dim}"
    else:
        rest = (f"one scale per token (q8_0-like); pages of {2 * head_dim}+ tokens would group them per channel at "
                "no extra cost, which keeps more precision")
    return Note(f"int8 keys: {rest}", NoteKind.INT8_KEYS, layout=layout, head_dim=head_dim, page_size=page_size,
                rest=rest)
