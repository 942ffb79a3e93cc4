"""Batched decoding: one model forward gives the next token of several sessions.

On this kind of machine a decode step is bound by reading the weights (SmolLM2-135M: ~540 MB per token,
~30 ms of its ~55 ms on 2 cores), so B sessions decoded in one forward pay for the weights once: the
linear layers see a [B, hidden] input instead of B separate [1, hidden] ones. Attention stays per session
(``engine.kv.attention.ragged_attention`` over each session's own store, lengths ragged, nothing padded),
and everything around the forward is each session's own: eviction plan, page reservation, commit, prefix
cache, sampling, stop checks, snapshot (``ChatSession.plan_forward`` / ``open_forward`` / ``close_forward``
/ ``take_token``).

"Can I?" first: ``ChatSession.batchable`` (one token to feed, a plain store, no score-reading policy) and
``batch_refusal`` (the model runs its attention on what the cache returns). A model whose attention turns
out not to (``RaggedUnsupported`` at the first try) is remembered and its sessions step one by one.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from engine.errors import ContextOverflowError
from engine.fast_step import no_compile_running
from engine.kv.attention import RAGGED_IMPL, use_attention
from engine.kv.hf_cache import BatchCache, RaggedUnsupported
from engine.snapshot import StepResult

MAX_BATCH = 16  # sessions per forward: past this the attention loop, not the weights, dominates a step


def batch_refusal(lm) -> str:
    """Why this model's sessions cannot decode together ("" when they can)."""
    info = lm.info
    if getattr(lm, "batch_refused", ""):
        return lm.batch_refused
    if info.attn_impl != "sdpa":
        return f"its attention runs as {info.attn_impl!r} (batched decoding uses sdpa)"
    if info.layer_kinds and any(k != "full" for k in info.layer_kinds):
        return "its layers are not all full attention (sliding windows or states are stepped one by one)"
    return ""


def batchable(sessions: Sequence) -> list:
    """The sessions that may decode together now: those whose next step is one token on a plain store, of
    one model that can batch. Fewer than two: none (one session steps as it always does)."""
    ready = [s for s in sessions if s.batchable()]
    if len(ready) < 2 or len({id(s.lm.model) for s in ready}) != 1 or batch_refusal(ready[0].lm):
        return []
    return ready[:MAX_BATCH]


def step_batch(sessions: Sequence) -> list[StepResult | BaseException]:
    """One forward for every session of ``sessions`` (all ``batchable``, one model): each gets its own
    ``StepResult``, or the typed error that ended its reply (the others go on). If the model turns out unable
    to batch, nothing is changed and each session takes a normal ``step()`` instead."""
    t0 = time.perf_counter()
    results: list[StepResult | BaseException | None] = [None] * len(sessions)
    joined: list[tuple[int, object, object]] = []
    for i, s in enumerate(sessions):
        results[i], cx = _open(s)
        if results[i] is None:
            joined.append((i, s, cx))
    if not joined:
        return results
    lm = joined[0][1].lm
    try:
        logits = _forward(lm, [s for _, s, _ in joined])  # [B, vocab]
    except RaggedUnsupported as e:
        lm.batch_refused = str(e)
        for i, s, _ in joined:
            s.undo_forward()
            results[i] = _single(s)
        return results
    except BaseException as e:  # noqa: BLE001 - every session of the forward ends with it
        for i, s, _ in joined:
            s.undo_forward()
            results[i] = s.fail(e)
        return results
    for _, s, _ in joined:
        s.close_forward(1)  # plain bookkeeping: counts the token every session's store now holds
    _share_written([s for _, s, _ in joined])
    for b, (i, s, cx) in enumerate(joined):
        try:
            s.after_forward(cx)
        except BaseException as e:  # noqa: BLE001 - this session's eviction failed: its reply ends, typed
            results[i] = s.fail(e)
            continue
        try:
            results[i] = s.take_token(logits[b], t0)
        except BaseException as e:  # noqa: BLE001 - typed by take_token, which ended the reply
            results[i] = e
    return results


def _share_written(sessions: list) -> None:
    """Each session's snapshot shows every page the forward wrote in its pool, and how many it decoded."""
    by_pool: dict[int, set[int]] = {}
    for s in sessions:
        arena = getattr(s.store, "arena", None)
        if arena is not None:
            by_pool.setdefault(id(arena), set()).update(s.written)
    for s in sessions:
        arena = getattr(s.store, "arena", None)
        s.written = tuple(sorted(by_pool.get(id(arena), ()))) if arena is not None else ()
        s.batch_size, s.step_path = len(sessions), "batched"


def _open(s):
    """Plan and reserve one token for ``s``: (None, eviction context) when it joins, (result, None) if not."""
    if s.turn_state.cancel:
        return s.finish_cancelled(), None
    s.evictions = []
    try:
        chunk, cx = s.plan_forward(1)
        s.open_forward(1)
    except ContextOverflowError as e:
        return s.end_context_full(e), None
    except BaseException as e:  # noqa: BLE001
        return s.fail(e), None
    return None, cx


def _forward(lm, sessions: list) -> torch.Tensor:
    dev = lm.device
    feed = [s.next_input() for s in sessions]
    ids = torch.tensor([[tok] for tok, _ in feed], dtype=torch.long, device=dev)  # [B, 1]
    pos = torch.tensor([[p] for _, p in feed], dtype=torch.long, device=dev)  # [B, 1] RoPE positions
    before = lm.model.config._attn_implementation
    use_attention(lm.model, RAGGED_IMPL)
    try:
        with no_compile_running(), torch.inference_mode():
            out = lm.model(input_ids=ids, cache=BatchCache([s.store for s in sessions]), position_ids=pos,
                           use_cache=True, logits_to_keep=1)
    finally:  # whoever calls the model next (HF generate, a session) finds it as it was (~0.3 ms each way)
        use_attention(lm.model, before)
    return out.logits[:, -1]  # [B, vocab]


def _single(s) -> StepResult | BaseException:
    try:
        return s.step()
    except BaseException as e:  # noqa: BLE001
        return e


def step_all(sessions: Sequence) -> list[StepResult | BaseException]:
    """Step every generating session once: those that can decode together in one forward, the rest alone."""
    group = {id(s) for s in batchable(sessions)}
    together = [s for s in sessions if id(s) in group]
    done = dict(zip(map(id, together), step_batch(together))) if together else {}
    return [done[id(s)] if id(s) in done else _single(s) for s in sessions]
