"""``bench --scenario branch``: what checkpoints buy on a hybrid or sliding-window model, and what they cost.

For each context: a chat of that many tokens and a short reply, then four prompts that a user makes next — a
follow-up (the chat, the reply and 32 new tokens), a regenerate (the same prompt), a branch (the chat and 32
other tokens: another second message) — timed to the first token with checkpoints (``CacheConfig.checkpoints``,
the default 8) and without (0), beside a fresh session that prefills the whole prompt. Memory: the checkpoints'
bytes (recurrent states copied, window pages held) against the KV pages of the chat.
"""

from __future__ import annotations

import time
from typing import Any

from engine.config import CacheConfig, SamplingConfig
from engine.core.scheduler import drive
from engine.core.session import ChatSession


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 8) + 4 for i in range(n)]


def _ttft(s: ChatSession, ids: list[int], n: int = 1) -> tuple[float, int, list[int]]:
    """(milliseconds to the first token, reused tokens, the reply) of ``ids`` on ``s``."""
    t0 = time.perf_counter()
    st = s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    first = None
    for _ in drive(s):
        first = first if first is not None else (time.perf_counter() - t0) * 1000.0
    return first or 0.0, st.reused_tokens, list(s.generated_ids)


def _cold(lm) -> None:
    """Forget the model's prefix cache (its idle arenas and the states shelf): each row starts cold."""
    lm.kv_arenas.drop_idle()
    lm.kv_arenas.states.clear()


def run(lm, context: int, page_size: int, reply: int = 16) -> dict[str, Any]:
    """One context's row: TTFT of each next prompt with and without checkpoints, and the bytes; then a new chat
    that shares the chat's start (the prefix cache across chats: its pages, window pages and states)."""
    vocab = lm.info.vocab_size
    chat = _ids(vocab, context, 1)
    out: dict[str, Any] = {"context": context}
    for checkpoints in (8, 0):
        _cold(lm)
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=page_size, checkpoints=checkpoints))
        _, _, g = _ttft(s, chat, reply)
        states, windows = s.store.checkpoint_bytes()
        kv = int(sum(s.store.bytes_per_layer()))
        prompts = {"follow_up": chat + g + _ids(vocab, 32, 2), "regenerate": None, "branch": chat + _ids(vocab, 32, 3)}
        row = {"checkpoint_state_bytes": states, "checkpoint_window_bytes": windows, "kv_bytes": kv,
               "checkpoints": len(s.store.checkpoint_positions()) if hasattr(s.store, "checkpoint_positions") else 0}
        if checkpoints:  # another chat, same start, after the first reply: from the prefix cache across chats
            other = ChatSession(lm, CacheConfig(mode="paged", page_size=page_size))
            ms, reused, _ = _ttft(other, chat + _ids(vocab, 32, 4))
            row["new_chat"] = {"ttft_ms": round(ms, 1), "prompt": context + 32, "reused": reused}
            other.close()
        for name, ids in prompts.items():
            ids = ids or prompts["follow_up"]  # regenerate: the follow-up again
            ms, reused, _ = _ttft(s, ids)
            row[name] = {"ttft_ms": round(ms, 1), "prompt": len(ids), "reused": reused}
        s.close()
        out["with" if checkpoints else "without"] = row
    _cold(lm)
    fresh = ChatSession(lm, CacheConfig(mode="paged", page_size=page_size, prefix_reuse=False))
    ms, _, _ = _ttft(fresh, chat + _ids(vocab, 32, 3))
    fresh.close()
    out["full_prefill_ms"] = round(ms, 1)
    return out


def rows(lm, a, log) -> list[dict[str, Any]]:
    out = []
    for ctx in a.contexts_list:
        r = run(lm, ctx, a.page_size)
        w, wo = r["with"], r["without"]
        log(f"  branch @ {ctx}: TTFT follow-up {w['follow_up']['ttft_ms']} ms, regenerate "
            f"{w['regenerate']['ttft_ms']} / {wo['regenerate']['ttft_ms']} ms (with / without checkpoints), branch "
            f"{w['branch']['ttft_ms']} / {wo['branch']['ttft_ms']} ms; new chat with the same start "
            f"{w['new_chat']['ttft_ms']} ms (reused {w['new_chat']['reused']} of {w['new_chat']['prompt']}); full prefill {r['full_prefill_ms']} ms; "
            f"checkpoints {w['checkpoints']}: {(w['checkpoint_state_bytes'] + w['checkpoint_window_bytes']) / 2**20:.1f}"
            f" MiB vs KV {w['kv_bytes'] / 2**20:.1f} MiB")
        out.append({"kind": "branch", **r})
    return out
