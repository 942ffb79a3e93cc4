"""Counters of the server and their Prometheus text exposition (format 0.0.4).

Counters are bumped by the engine thread and read by the HTTP thread under one lock; the KV gauges are
measured on the engine thread when ``/metrics`` asks (``Scheduler.kv_gauges``).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from engine.kv.tier.disk import METRICS as DISK_METRICS
from engine.snapshot import MissReason

RATE_WINDOW_S = 10.0
OUTCOMES = ("stop", "length", "cancelled", "error", "rejected")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens looked up in a session's cache
        self.prefix_hits = 0  # prompt tokens found there (not prefilled again)
        self.evicted_tokens = 0  # tokens a cache policy or the context limit dropped
        self.session_evictions = 0  # idle sessions closed to keep the idle pool small
        self.runner = None  # engine.model.runner.ModelRunner: its batched-forward counters are read at render
        self.kv_events = None  # engine.server.kv_events.KVEventPublisher: its counters are read at render
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.stalls = {"paused": 0, "cancelled": 0}  # streams whose reader stopped (``engine.server.jobs``)
        # speculative decoding, as vLLM counts it: verifications, draft tokens, accepted ones (and by position)
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
        self.spec_by_pos: list[int] = []
        self.recomputed = dict.fromkeys((r.value for r in MissReason), 0)  # prompt tokens computed, by reason
        self.closed = dict.fromkeys(("header_timeout", "body_timeout", "evicted", "over_limit"), 0)  # ``server.conn``
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s

    def request_started(self, prompt_tokens: int, reused_tokens: int,
                        recomputed: dict[str, int] | None = None) -> None:
        """A request's prompt: its tokens, those reused, and those computed by reason (its cache account's)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.prefix_queries += prompt_tokens
            self.prefix_hits += reused_tokens
            for reason, n in (recomputed or {}).items():
                self.recomputed[reason] = self.recomputed.get(reason, 0) + n

    def tokens(self, n: int, evicted: int = 0) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += n
            self.evicted_tokens += evicted
            if n:
                self._recent.append((now, n))
            self._trim(now)

    def speculated(self, stats) -> None:
        """A finished reply's speculation (``TurnStats``); usage and tokens are counted as without it."""
        if not stats.draft_tokens:
            return
        with self._lock:
            self.spec["drafts"] += stats.verifications
            self.spec["draft_tokens"] += stats.draft_tokens
            self.spec["accepted"] += stats.accepted_draft_tokens
            by = stats.accepted_by_position
            self.spec_by_pos += [0] * (len(by) - len(self.spec_by_pos))
            for i, n in enumerate(by):
                self.spec_by_pos[i] += n

    def outcome(self, name: str) -> None:
        with self._lock:
            self.outcomes[name] = self.outcomes.get(name, 0) + 1

    def connection_closed(self, reason: str) -> None:
        """A connection the server closed: ``header_timeout``, ``body_timeout``, ``evicted`` (at the limit, for a new
        one: it had no request in flight) or ``over_limit`` (a new one, when every connection had a request)."""
        with self._lock:
            self.closed[reason] = self.closed.get(reason, 0) + 1

    def stall(self, action: str) -> None:
        """A stream whose reader fell behind was ``paused`` (held) or, still behind, ``cancelled``."""
        with self._lock:
            self.stalls[action] = self.stalls.get(action, 0) + 1

    @property
    def batched_forwards(self) -> int:
        """Forwards that decoded several sequences together (API requests, and the app's chats beside them)."""
        return getattr(self.runner, "batched_forwards", 0)

    @property
    def batched_tokens(self) -> int:
        return getattr(self.runner, "batched_tokens", 0)

    def session_evicted(self) -> None:
        with self._lock:
            self.session_evictions += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, gauges: dict[str, float]) -> str:
        """Prometheus text: the counters here plus ``gauges`` (running, waiting, KV bytes and pages, ...)."""
        rate = self.tokens_per_s()
        with self._lock:
            rows = [
                ("kvscope_requests_running", "gauge", "Requests being generated", gauges.get("running", 0)),
                ("kvscope_requests_waiting", "gauge", "Requests queued for the engine", gauges.get("waiting", 0)),
                ("kvscope_sessions_idle", "gauge", "Finished conversations kept with their KV cache",
                 gauges.get("idle_sessions", 0)),
                ("kvscope_kv_bytes_used", "gauge", "KV cache bytes held by the server's sessions",
                 gauges.get("kv_bytes_used", 0)),
                ("kvscope_kv_bytes_allocated", "gauge", "Bytes of the model's page arenas",
                 gauges.get("kv_bytes_allocated", 0)),
                ("kvscope_kv_pages_used", "gauge", "Pages in use in the model's page pools", gauges.get("kv_pages_used", 0)),
                ("kvscope_kv_pages_total", "gauge", "Pages in the model's page pools", gauges.get("kv_pages_total", 0)),
                ("kvscope_kv_pages_cached", "gauge", "Pages no session holds, kept in the prefix cache",
                 gauges.get("kv_pages_cached", 0)),
                ("kvscope_prompt_tokens_total", "counter", "Prompt tokens of started requests", self.prompt_tokens),
                ("kvscope_generation_tokens_total", "counter", "Tokens generated", self.generation_tokens),
                ("kvscope_generation_tokens_per_second", "gauge",
                 f"Tokens generated per second over the last {RATE_WINDOW_S:g} s", round(rate, 3)),
                ("kvscope_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache",
                 self.prefix_queries),
                ("kvscope_prefix_cache_hits_total", "counter", "Prompt tokens taken from the prefix cache",
                 self.prefix_hits),
                ("kvscope_kv_evicted_tokens_total", "counter", "Tokens evicted from the KV cache by its policy",
                 self.evicted_tokens),
                ("kvscope_batched_forwards_total", "counter", "Forwards that decoded several sequences together",
                 self.batched_forwards),
                ("kvscope_batched_tokens_total", "counter", "Tokens generated by those forwards", self.batched_tokens),
                ("kvscope_session_evictions_total", "counter", "Idle sessions closed (least recently used first)",
                 self.session_evictions),
            ]
            rows += [
                ("kvscope_spec_decode_num_drafts_total", "counter", "Speculative verifications run",
                 self.spec["drafts"]),
                ("kvscope_spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified",
                 self.spec["draft_tokens"]),
                ("kvscope_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens the model accepted",
                 self.spec["accepted"]),
            ]
            by_pos = list(self.spec_by_pos)
            outcomes, stalls, closed = dict(self.outcomes), dict(self.stalls), dict(self.closed)
            recomputed = dict(self.recomputed)
        rows += [(f"kvscope_{n}", kind, text, gauges[n]) for n, (kind, text) in DISK_METRICS.items() if n in gauges]
        out = []
        for name, kind, text, value in rows:
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]
        out += self._vllm_rows(gauges, by_pos)
        return "\n".join(out + self._labelled_rows(by_pos, outcomes, stalls, recomputed, closed)) + "\n"

    def _labelled_rows(self, by_pos: list, outcomes: dict, stalls: dict, recomputed: dict, closed: dict) -> list[str]:
        """The counters with a label (draft position, outcome, stall action, recompute reason, close reason)."""
        out = _labelled("kvscope_spec_decode_num_accepted_tokens_per_pos_total", "Draft tokens accepted at each "
                        "draft position (0: the first)", "position", dict(enumerate(by_pos)))
        out += _labelled("kvscope_requests_total", "Requests by outcome (finish reason, cancelled, error, rejected)",
                         "outcome", outcomes)
        out += _labelled("kvscope_streams_stalled_total", "Streams whose client stopped reading: held (paused), then "
                         "cancelled if it did not catch up", "action", stalls)
        out += _labelled("kvscope_prompt_tokens_recomputed_total", "Prompt tokens computed instead of read from the "
                         "cache, by reason (the requests' cache accounts)", "reason", recomputed)
        out += self._event_rows()
        out += self._thread_rows()
        out += _labelled("kvscope_connections_closed_total", "Connections the server closed: a request head or body "
                         "not complete in time, one without a request in flight making room, or a new one over the "
                         "limit", "reason", closed)
        return out

    def _event_rows(self) -> list[str]:
        """The KV events publisher's state (nothing when events are off): up or stopped, batches sent, replay
        requests answered, malformed, or over the rate limit (``engine.server.kv_replay``)."""
        pub = self.kv_events
        if pub is None:
            return []
        out = ["# HELP kvscope_kv_events_up 1 while the KV events publisher runs, 0 once it stopped",
               "# TYPE kvscope_kv_events_up gauge", f"kvscope_kv_events_up {int(pub.alive)}",
               "# HELP kvscope_kv_events_batches_total KV event batches published",
               "# TYPE kvscope_kv_events_batches_total counter", f"kvscope_kv_events_batches_total {pub.sent}"]
        if pub.replay is not None:
            out += _labelled("kvscope_kv_events_replay_requests_total", "Replay requests: answered, malformed "
                             "(dropped), limited (over the rate, dropped)", "outcome", dict(pub.replay.counts))
        return out

    def _vllm_rows(self, gauges: dict[str, float], by_pos: list[int]) -> list[str]:
        """The same facts under vLLM's names, so dashboards and KV Scope's remote view read this server as vLLM
        (prefix-cache queries and hits count tokens there as here; this engine never preempts)."""
        model = 'model_name="kvscope"'
        rows = [("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                 round(gauges.get("kv_usage", 0.0), 6)),
                ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens", self.prefix_queries),
                ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens", self.prefix_hits),
                ("vllm:num_preemptions_total", "counter", "Preemptions (none: requests wait instead)", 0),
                ("vllm:num_requests_running", "gauge", "Requests in model execution batches", gauges.get("running", 0)),
                ("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed", gauges.get("waiting", 0)),
                ("vllm:spec_decode_num_drafts_total", "counter", "Speculative verifications", self.spec["drafts"]),
                ("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens", self.spec["draft_tokens"]),
                ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Accepted draft tokens", self.spec["accepted"])]
        out = []
        for name, kind, text, value in rows:
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{model}}} {_num(value)}"]
        info = (f'block_size="{int(gauges.get("block_size", 0))}",cache_dtype="auto",enable_prefix_caching="True",'
                f'num_gpu_blocks="{int(gauges.get("num_gpu_blocks", 0))}"')
        out += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1.0"]
        out += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position",
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
        out += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{model},position="{i}"}} {n}'
                for i, n in enumerate(by_pos)]
        return out


    def _thread_rows(self) -> list[str]:
        """The CPU threads torch runs the model on, and why (``engine.model.threads.for_server``), as a label."""
        info = getattr(getattr(self.runner, "lm", None), "info", None)
        if info is None or not info.threads:
            return []
        why = info.threads_reason.replace("\\", "\\\\").replace('"', '\\"')
        return ["# HELP kvscope_cpu_threads CPU threads the model runs on (why: the label)",
                "# TYPE kvscope_cpu_threads gauge", f'kvscope_cpu_threads{{reason="{why}"}} {info.threads}']


def _labelled(name: str, text: str, label: str, values: dict) -> list[str]:
    """A counter with one sample per ``label`` value."""
    return [f"# HELP {name} {text}", f"# TYPE {name} counter"] + [f'{name}{{{label}="{k}"}} {v}'
                                                                    for k, v in values.items()]


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def parse(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page (``name`` or ``name{labels}`` → value): for tests and tools."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
