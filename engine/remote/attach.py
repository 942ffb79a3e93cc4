"""A remote OpenAI-compatible engine attached (vLLM, or KV Scope's own ``engine serve``): its HTTP client, one
KV event subscriber per engine (data-parallel rank) and the view they feed. Qt-free: the app's remote chats and
``python -m engine attach`` both use ``RemoteEngine``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from functools import partial

from engine.kv.paged.tenants import block_hashes
from engine.remote.budget import fit
from engine.remote.client import ContextRefused, RemoteClient, RemoteError, Reply
from engine.remote.subscriber import EndpointRefused, EventSubscriber
from engine.remote.view import RemoteView, malformed_text, view_note
from engine.remote.why import Before, account_dict, fates, message_change, remote_account
from engine.inputs import read_json

JOIN_S = 0.3  # a ZMQ subscriber misses what is published before its connection is up ("slow joiner")
WATCH_MAX_S = 7 * 86400.0  # --watch and --events-timeout: a week at most (inf would sleep forever)
MAX_NEW_TOKENS = 1 << 20
ACCOUNT_WAIT_S = 0.3  # how long an account waits for the events of the prompt's blocks (they come within ms)


class RemoteEngine:
    """``url``'s server: ``RemoteError`` (one line) when it cannot be used. ``events``: the KV events endpoint
    when ``/kv_event_sources`` does not say (or to override it)."""

    def __init__(self, url: str, api_key: str | None = None, events: str | None = None, timeout: float = 10.0,
                 topic: str | None = None) -> None:
        self.client = RemoteClient(url, api_key, timeout)
        self.models = self.client.models()
        if not self.models:
            raise RemoteError(f"{self.client.url} serves no model (GET /v1/models is empty)")
        self.metrics = self.client.metrics()
        try:
            self.view = RemoteView(self.metrics.block_size, self.metrics.num_blocks, self.metrics.engines)
        except ValueError as e:  # a pool no server has: refused, with the number
            raise RemoteError(f"{self.client.url}: {e}") from None
        # KV Scope's server publishes no token ids for a keyed or salted request: the chat's blocks are found by
        # the hashes it names them with, from this key (vLLM names them otherwise, and sends token ids)
        self.view.names = partial(block_hashes, key=api_key)
        sources = {r: c for r, c in self.client.event_sources().items() if c.get("enable_kv_cache_events", True)}
        if events:
            base = sources.get(0, {})
            sources = {0: {**base, "endpoint": events, "topic": topic if topic is not None else base.get("topic", "")}}
        self.subscribers: list[EventSubscriber] = []
        self.detokenizes = True  # the server answers /detokenize (until it does not)
        refused = ""
        try:
            for rank, cfg in sorted(sources.items()):
                try:
                    sub = EventSubscriber(self.view, cfg.get("endpoint") or "tcp://*:5557", self.client.url,
                                          cfg.get("topic") or "", cfg.get("replay_endpoint"), rank,
                                          given=bool(events), engines=len(sources))
                except EndpointRefused as e:
                    if events:
                        raise
                    refused = refused or str(e)  # the server's say-so: the chat works, the page map stays empty
                    continue
                sub.start()
                self.subscribers.append(sub)
        except ValueError as e:
            self.close()
            raise RemoteError(str(e)) from None
        if self.subscribers:
            time.sleep(JOIN_S)
        self.note = refused if refused and not self.subscribers else "" if self.subscribers else (
            "this server publishes no KV events (start vLLM with --kv-events-config and --enable-prefix-caching, "
            "or give the events endpoint): the page map stays empty; occupancy and hit rate come from /metrics")

    @property
    def model(self) -> str:
        return self.models[0]

    def refresh(self) -> None:
        """Read ``/metrics`` again (occupancy, hit counters, the pool's size)."""
        metrics = self.client.metrics()
        try:
            self.view.set_shape(metrics.block_size, metrics.num_blocks, metrics.engines)
        except ValueError as e:
            raise RemoteError(f"{self.client.url}: {e}") from None
        self.metrics = metrics

    def chat(self, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.0,
             on_delta=None, cancel=None, reply: Reply | None = None, model: str | None = None) -> Reply:
        """Stream one reply from ``model`` (default: the first the server lists), ``max_tokens`` fitted to the
        model's context (``engine.remote.budget``: the reply's ``budget`` says when it was lowered)."""
        model = model or self.model
        budget = fit(max_tokens, self.client.contexts.get(model))
        sent = budget.sent if budget is not None else max_tokens
        reply = reply if reply is not None else Reply()
        try:
            reply = self.client.chat(model, messages, sent, temperature, on_delta, cancel, reply)
        except ContextRefused:
            if budget is None or sent is None:
                raise  # the prompt alone is over the context: nothing left to lower
            budget = dataclasses.replace(budget, sent=None, refused=True)
            reply = self.client.chat(model, messages, None, temperature, on_delta, cancel, reply)
        if budget is not None and budget.lowered:
            reply.budget = dataclasses.replace(budget, prompt_tokens=len(reply.prompt_ids))
        return reply

    def account(self, reply: Reply, before: Before | None = None, messages: list | None = None,
                model: str | None = None):
        """Why ``reply``'s prompt was recomputed, as a ``CacheAccount`` (``engine.remote.why``); ``before``: this
        chat's last request, ``messages``: this one's. None without the prompt's ids or KV events. Waits up to
        ``ACCOUNT_WAIT_S`` for the events of the prompt's blocks; may ask the server to decode the tokens where the
        prompt parts from ``before``."""
        ids, B = list(reply.prompt_ids), self.view.block_size or self.metrics.block_size
        if not ids or B < 1 or not self.subscribers:
            return None
        end = time.monotonic() + ACCOUNT_WAIT_S
        hist, cleared_at, resynced_at = self.view.history(ids)
        while len(hist) < len(ids) // B and self.view.batches and time.monotonic() < end:  # (events flow)
            time.sleep(0.02)
            hist, cleared_at, resynced_at = self.view.history(ids)
        details = reply.usage.get("prompt_tokens_details")
        cached = reply.cached_tokens if isinstance(details, dict) and "cached_tokens" in details else None
        b = before or Before()
        change = message_change(b.messages, messages) if b.messages and messages is not None else None
        return remote_account(ids, list(b.ids), B, fates(hist, reply.sent_at), cached,
                              cleared=bool(b.ids) and cleared_at >= b.ended,
                              missed=bool(b.ids) and resynced_at >= b.ended,
                              decode=partial(self._decode, model or self.model), change=change)

    def _decode(self, model: str, ids: list[int]) -> str | None:
        text = self.client.detokenize(model, ids) if self.detokenizes else None
        self.detokenizes = text is not None
        return text

    def fixed_settings(self) -> dict[str, str]:
        """What the server fixed at start (shown read-only, with why)."""
        info = self.metrics.cache_info
        return {"block size": info.get("block_size", "?"), "KV dtype": info.get("cache_dtype", "?"),
                "prefix caching": info.get("enable_prefix_caching", "?"),
                "eviction": "least recently used free blocks (the server's own policy)"}

    def wait_events(self, timeout: float) -> bool:
        """True once any KV event batch has arrived, well-formed or not (False after ``timeout`` s)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.view.batches or self.view.malformed:
                return True
            time.sleep(0.05)
        return bool(self.view.batches or self.view.malformed)

    def came_back(self) -> None:
        """The server answered again after failing to: each event stream may begin anew (``EventSubscriber.came_back``)."""
        for sub in self.subscribers:
            sub.came_back()

    def close(self) -> None:
        for sub in self.subscribers:
            sub.stop()
        self.subscribers = []


def _messages(a) -> list[dict]:
    if a.messages:
        hint = "give a JSON list of {role, content}"
        msgs = read_json(a.messages, "messages file", hint=hint)
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError(f"messages file {a.messages}: {hint}")
        return msgs
    return [{"role": "user", "content": a.prompt}]


def _check_numbers(a) -> None:
    """One line for a number attach cannot use (``--watch inf`` would sleep forever, ``nan`` not at all)."""
    for flag, value in (("--watch", a.watch), ("--events-timeout", a.events_timeout)):
        if not (math.isfinite(value) and 0 <= value <= WATCH_MAX_S):
            raise ValueError(f"{flag} {value}: give seconds from 0 to {WATCH_MAX_S:.0f} (a week)")
    if not 1 <= a.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens}: give 1 to {MAX_NEW_TOKENS:,}")


def run_attach(a) -> int:
    """``python -m engine attach``: chat once (or only watch) and print what the view saw as JSON."""
    _check_numbers(a)
    messages = _messages(a) if a.prompt is not None or a.messages else None  # a bad file fails before the network
    eng = RemoteEngine(a.url, a.api_key, a.events)
    model = getattr(a, "model", None) or eng.model
    try:
        if model not in eng.models:
            more = f" and {len(eng.models) - 10:,} more" if len(eng.models) > 10 else ""
            listed = ", ".join(eng.models[:10]) + more
            raise RemoteError(f"{eng.client.url} does not serve {model!r}; it serves: {listed}")
        reply = None
        if messages is not None:
            reply = eng.chat(messages, a.max_new_tokens, model=model)
            if reply.error:
                raise RemoteError(reply.error)
        if a.watch:
            time.sleep(a.watch)
        if eng.subscribers and not eng.wait_events(a.events_timeout) and _computed_a_block(reply, eng):
            raise RemoteError(f"no KV events arrived from {eng.subscribers[0].endpoint} in {a.events_timeout:g} s "
                              "though the reply filled new blocks: is --kv-events-config on, and the endpoint "
                              "reachable from here?")
        time.sleep(0.2)  # the last step's batch
        if eng.subscribers and not eng.view.batches and eng.view.malformed and _computed_a_block(reply, eng):
            raise RemoteError(f"every KV event from {eng.subscribers[0].endpoint} was malformed: "
                              f"{malformed_text(eng.view.malformed, eng.view.problem)}")
        eng.refresh()
        out = report(eng, reply, model)
        account = eng.account(reply, messages=messages, model=model) if reply is not None else None
        out["cache"] = account_dict(account) if account is not None else None  # why the prompt was recomputed
    finally:
        eng.close()
    text = json.dumps(out, indent=1)
    print(text if a.json else _human(out))
    return 0


def _computed_a_block(reply: Reply | None, eng: RemoteEngine) -> bool:
    """Did the reply compute at least one full block (so a server with events on must have published)? Only
    watching, silence is no proof (an idle vLLM publishes nothing; KV Scope's server sends a batch a second)."""
    if reply is None:
        return False
    u = reply.usage
    computed = int(u.get("prompt_tokens", 0)) - reply.cached_tokens + int(u.get("completion_tokens", 0))
    return computed >= max(1, eng.view.block_size or eng.metrics.block_size or 1)


def report(eng: RemoteEngine, reply: Reply | None, model: str | None = None) -> dict:
    ids = (reply.prompt_ids + reply.token_ids) if reply is not None else []
    snaps = eng.view.snapshots(ids)
    lat = sorted(eng.view.latencies)
    m = eng.metrics
    return {
        "url": eng.client.url, "model": model or eng.model, "models": eng.models, "text": reply.text if reply else None,
        "usage": ({**reply.usage, "cached_tokens": reply.cached_tokens} if reply else None),
        "block_size": m.block_size or eng.view.block_size, "num_blocks": m.num_blocks,
        "events": {"stored": sum(s.stored for s in snaps), "removed": sum(s.removed for s in snaps),
                   "cleared": sum(s.cleared for s in snaps), "gaps": sum(s.gaps for s in snaps),
                   "resyncs": sum(s.resyncs for s in snaps), "batches": eng.view.batches,
                   "dropped": sum(s.dropped for s in eng.subscribers), "malformed": eng.view.malformed,
                   "latency_ms_p50": round(lat[len(lat) // 2] * 1e3, 2) if lat else None},
        "engines": len(snaps), "cached_blocks": sum(s.cached_blocks for s in snaps),
        "chat_blocks": sum(s.chat_blocks for s in snaps), "chat_tokens": len(ids),
        "prefix_cache": {"queries": m.prefix_queries, "hits": m.prefix_hits}, "kv_usage": m.kv_usage,
        "preemptions": m.preemptions,
        "ttft_ms": round(reply.ttft_s * 1e3, 2) if reply and reply.ttft_s is not None else None,
        "decode_tokens_per_s": round(reply.decode_tokens_per_s, 2) if reply else None,
        "note": eng.note or view_note(snaps, eng.view.malformed, eng.view.problem) or (
            None if eng.view.batches or not eng.subscribers else
            "no KV events arrived (an idle server publishes none)"),
    }


def _human(out: dict) -> str:
    lines = []
    if out["text"] is not None:  # the model's text as it came, but no terminal escapes (a server chose it)
        lines.append("".join(c if c.isprintable() or c in "\n\t" else "?" for c in out["text"]))
    e = out["events"]
    lines.append(f"{out['model']} at {out['url']}: blocks of {out['block_size']} tokens, {out['num_blocks']} in the "
                 f"pool; {out['cached_blocks']} cached ({out['chat_blocks']} this chat's); events: {e['stored']} "
                 f"stored, {e['removed']} removed, {e['gaps']} missed, {e['malformed']} malformed; prefix cache "
                 f"{out['prefix_cache']['hits']:.0f} of {out['prefix_cache']['queries']:.0f} tokens hit; KV usage "
                 f"{out['kv_usage']:.1%}")
    if out.get("cache"):
        c = out["cache"]
        lines.append(f"prompt: {c['reused']:,} of {c['prompt']:,} tokens reused, {c['recomputed']:,} recomputed"
                     + "".join(f"\n  {m['start']:,}–{m['end']:,} {m['reason']}: {m['detail']}" for m in c["misses"]))
    if out["note"]:
        lines.append(f"note: {out['note']}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m engine attach URL ...")
