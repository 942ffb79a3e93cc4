"""A remote OpenAI-compatible engine attached (vLLM, or KV Scope's own ``engine serve``): its HTTP client, one
KV event subscriber per engine (data-parallel rank) and the view they feed. Qt-free: the app's remote chats and
``python -m engine attach`` both use ``RemoteEngine``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine.remote.client import RemoteClient, RemoteError, Reply
from engine.remote.subscriber import EventSubscriber
from engine.remote.view import RemoteView, view_note

JOIN_S = 0.3  # a ZMQ subscriber misses what is published before its connection is up ("slow joiner")


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
        self.view = RemoteView(self.metrics.block_size, self.metrics.num_blocks)
        sources = {r: c for r, c in self.client.event_sources().items() if c.get("enable_kv_cache_events", True)}
        if events:
            base = sources.get(0, {})
            sources = {0: {**base, "endpoint": events, "topic": topic if topic is not None else base.get("topic", "")}}
        self.subscribers: list[EventSubscriber] = []
        try:
            for rank, cfg in sorted(sources.items()):
                sub = EventSubscriber(self.view, cfg.get("endpoint") or "tcp://*:5557", self.client.url,
                                      cfg.get("topic") or "", cfg.get("replay_endpoint"), rank)
                sub.start()
                self.subscribers.append(sub)
        except ValueError as e:
            self.close()
            raise RemoteError(str(e)) from None
        if self.subscribers:
            time.sleep(JOIN_S)
        self.note = "" if self.subscribers else (
            "this server publishes no KV events (start vLLM with --kv-events-config and --enable-prefix-caching, "
            "or give the events endpoint): the page map stays empty; occupancy and hit rate come from /metrics")

    @property
    def model(self) -> str:
        return self.models[0]

    def refresh(self) -> None:
        """Read ``/metrics`` again (occupancy, hit counters, the pool's size)."""
        self.metrics = self.client.metrics()
        self.view.set_shape(self.metrics.block_size, self.metrics.num_blocks)

    def chat(self, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.0,
             on_delta=None, cancel=None, reply: Reply | None = None, model: str | None = None) -> Reply:
        """Stream one reply from ``model`` (default: the first the server lists)."""
        return self.client.chat(model or self.model, messages, max_tokens, temperature, on_delta, cancel, reply)

    def fixed_settings(self) -> dict[str, str]:
        """What the server fixed at start (shown read-only, with why)."""
        info = self.metrics.cache_info
        return {"block size": info.get("block_size", "?"), "KV dtype": info.get("cache_dtype", "?"),
                "prefix caching": info.get("enable_prefix_caching", "?"),
                "eviction": "least recently used free blocks (the server's own policy)"}

    def wait_events(self, timeout: float) -> bool:
        """True once any KV event batch has arrived (False after ``timeout`` s)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.view.batches:
                return True
            time.sleep(0.05)
        return bool(self.view.batches)

    def close(self) -> None:
        for sub in self.subscribers:
            sub.stop()
        self.subscribers = []


def _messages(a) -> list[dict]:
    if a.messages:
        try:
            msgs = json.loads(Path(a.messages).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--messages {a.messages}: {e}") from None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError(f"--messages {a.messages}: expected a JSON list of {{role, content}}")
        return msgs
    return [{"role": "user", "content": a.prompt}]


def run_attach(a) -> int:
    """``python -m engine attach``: chat once (or only watch) and print what the view saw as JSON."""
    eng = RemoteEngine(a.url, a.api_key, a.events)
    model = getattr(a, "model", None) or eng.model
    try:
        if model not in eng.models:
            raise RemoteError(f"{eng.client.url} does not serve {model!r}; it serves: {', '.join(eng.models)}")
        reply = None
        if a.prompt is not None or a.messages:
            reply = eng.chat(_messages(a), a.max_new_tokens, model=model)
            if reply.error:
                raise RemoteError(reply.error)
        if a.watch:
            time.sleep(a.watch)
        if eng.subscribers and not eng.wait_events(a.events_timeout) and _computed_a_block(reply, eng):
            raise RemoteError(f"no KV events arrived from {eng.subscribers[0].endpoint} in {a.events_timeout:g} s "
                              "though the reply filled new blocks: is --kv-events-config on, and the endpoint "
                              "reachable from here?")
        time.sleep(0.2)  # the last step's batch
        eng.refresh()
        out = report(eng, reply, model)
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
                   "dropped": sum(s.dropped for s in eng.subscribers),
                   "latency_ms_p50": round(lat[len(lat) // 2] * 1e3, 2) if lat else None},
        "engines": len(snaps), "cached_blocks": sum(s.cached_blocks for s in snaps),
        "chat_blocks": sum(s.chat_blocks for s in snaps), "chat_tokens": len(ids),
        "prefix_cache": {"queries": m.prefix_queries, "hits": m.prefix_hits}, "kv_usage": m.kv_usage,
        "preemptions": m.preemptions,
        "ttft_ms": round(reply.ttft_s * 1e3, 2) if reply and reply.ttft_s is not None else None,
        "decode_tokens_per_s": round(reply.decode_tokens_per_s, 2) if reply else None,
        "note": eng.note or view_note(snaps) or (None if eng.view.batches or not eng.subscribers else
                                                 "no KV events arrived (an idle server publishes none)"),
    }


def _human(out: dict) -> str:
    lines = []
    if out["text"] is not None:
        lines.append(out["text"])
    e = out["events"]
    lines.append(f"{out['model']} at {out['url']}: blocks of {out['block_size']} tokens, {out['num_blocks']} in the "
                 f"pool; {out['cached_blocks']} cached ({out['chat_blocks']} this chat's); events: {e['stored']} "
                 f"stored, {e['removed']} removed, {e['gaps']} missed; prefix cache {out['prefix_cache']['hits']:.0f}"
                 f" of {out['prefix_cache']['queries']:.0f} tokens hit; KV usage {out['kv_usage']:.1%}")
    if out["note"]:
        lines.append(f"note: {out['note']}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m engine attach URL ...")
