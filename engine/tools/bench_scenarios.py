"""Benchmark scenarios beyond one prompt: several sessions generating at once (batched decoding), requests
sharing a system prompt (automatic prefix caching) and the OpenAI server's overhead against the engine.

``python -m engine bench --concurrency 1,4``, ``--prefix-cache 8 --shared-prompt 1000`` and ``--server``
(a model with a tokenizer).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from engine.config import CacheConfig, SamplingConfig

QUESTION_TOKENS = 24


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _pages_in_use(lm) -> int:
    """Pages held by sessions in every arena of the model (cached pages nobody holds are free to take)."""
    return sum(arena.pool.num_used for arena in lm.kv_arenas)


def concurrency(lm, n: int, context: int, new_tokens: int, page_size: int, batched: bool = True) -> dict[str, Any]:
    """``n`` sessions, each with its own ``context``-token prompt, generating ``new_tokens`` at once as a
    server's requests do: every prompt is prefilled (each through a core of its own, to its first token), then
    all decode together in one core (its rounds batch them: ``engine.core.scheduler.step_all``), or, when not
    ``batched``, in a core each, one session after another per round. Throughput = all sessions' tokens over
    wall time."""
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    sampling = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    sessions = [ChatSession(lm, CacheConfig(mode="paged", page_size=page_size, prefix_reuse=False)) for _ in range(n)]
    ttft = []
    try:
        t0 = time.perf_counter()
        for i, s in enumerate(sessions):
            s.start_ids(_ids(lm.info.vocab_size, context, seed=200 + i), sampling)
            for r in drive(s):  # prefill chunks, then the first token: the reply goes on below
                if r.event is not None:
                    break
            ttft.append(s.turn_state.ttft_ms)
        t1 = time.perf_counter()
        _decode_together(lm, sessions, batched)
        t2 = time.perf_counter()
        tokens = sum(len(s.generated_ids) for s in sessions)
    finally:
        for s in sessions:
            s.close()
    return {"concurrency": n, "context": context, "new_tokens": new_tokens, "batched": batched,
            "throughput_tokens_per_s": round(tokens / (t2 - t0), 3),
            "decode_throughput_tokens_per_s": round((tokens - n) / (t2 - t1), 3) if t2 > t1 else 0.0,
            "ttft_ms_median": round(statistics.median(ttft), 2), "batch_refused": lm.runner.batch_refused or None}


def _decode_together(lm, sessions: list, batched: bool) -> None:
    """Every started reply of ``sessions`` to its end: one core for all (a round decodes them in one batched
    forward), or a core each, rounded in turn (one forward a session). The first failure is raised."""
    from engine.core.scheduler import EngineCore, Request

    failed: list[BaseException] = []
    sink = lambda r: failed.append(r) if isinstance(r, BaseException) else None  # noqa: E731
    cores = [EngineCore(lm)] if batched else [EngineCore(lm) for _ in sessions]
    for i, s in enumerate(sessions):
        cores[i % len(cores)].add(Request(s, sink))
    while any(c.busy for c in cores):
        for c in cores:
            c.round()
        if failed:
            raise failed[0]


def prefix_cache(lm, requests: int, shared: int, new_tokens: int, page_size: int) -> dict[str, Any]:
    """``requests`` sessions, alive together as a server's would be, each a ``shared``-token system prompt
    plus its own question: time to first token of each, and the pages they hold against one request's."""
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    system = _ids(lm.info.vocab_size, shared, seed=11)
    cache = CacheConfig(mode="paged", page_size=page_size)
    sessions, ttft, reused, pages_one = [], [], [], 0
    try:
        for i in range(requests):
            s = ChatSession(lm, cache)
            sessions.append(s)
            s.start_ids(system + _ids(lm.info.vocab_size, QUESTION_TOKENS, seed=100 + i),
                        SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True))
            for r in drive(s):
                pass
            ttft.append(r.stats.ttft_ms)
            reused.append(r.stats.reused_tokens)
            if i == 0:
                pages_one = _pages_in_use(lm)
        pages_all = _pages_in_use(lm)
    finally:
        for s in sessions:
            s.close()
    rest = statistics.median(ttft[1:]) if len(ttft) > 1 else 0.0
    return {"requests": requests, "shared_prompt": shared, "question": QUESTION_TOKENS, "new_tokens": new_tokens,
            "ttft_ms": [round(t, 2) for t in ttft], "reused_tokens": reused,
            "ttft_rest_over_first": round(rest / ttft[0], 4) if ttft and ttft[0] else None,
            "pages_one_request": pages_one, "pages_all_requests": pages_all,
            "pages_ratio": round(pages_all / pages_one, 3) if pages_one else None}


def server_overhead(lm, prompt: str, new_tokens: int, repeats: int = 3) -> dict[str, Any]:
    """Tokens per second of a whole completion (request to last token, prefill included) streamed through
    the OpenAI API by a real HTTP client on 127.0.0.1, against the same greedy completion run on a session
    directly; alternating, medians."""
    import httpx

    from engine.core.scheduler import drive
    from engine.server.service import KVServer, ServerThread
    from engine.core.session import ChatSession

    sampling = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)  # greedy: both stop at the same token
    thread = ServerThread(KVServer(lm, CacheConfig(prefix_reuse=False)))
    url = thread.start()
    api, direct = [], []
    try:
        for _ in range(repeats):
            api.append(_stream_rate(httpx, url, lm.info.name, prompt, new_tokens))
            s = ChatSession(lm, CacheConfig(prefix_reuse=False))
            t0 = time.perf_counter()
            s.start_completion(prompt, sampling)
            for _ in drive(s):  # a core of one request: the API's requests run through one too
                pass
            direct.append(len(s.generated_ids) / (time.perf_counter() - t0))
            s.close()
    finally:
        thread.stop()
    a, d = statistics.median(api), statistics.median(direct)
    return {"new_tokens": new_tokens, "api_tokens_per_s": round(a, 2), "direct_tokens_per_s": round(d, 2),
            "ratio": round(a / d, 4) if d else None}


def _stream_rate(httpx, url: str, model: str, prompt: str, n: int) -> float:
    """Completion tokens (``usage``) per second from sending the request to the stream's end."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens / (time.perf_counter() - t0)


def _chat_ttft(core, lm, chat_tokens: int, page_size: int, seed: int) -> float:
    """An app-style message (``Priority.FOREGROUND``) sent to ``core`` now: ms from sending to its first token."""
    import threading

    from engine.core.scheduler import Priority, Request
    from engine.core.session import ChatSession

    first, done = [], threading.Event()

    def start() -> None:
        s = ChatSession(lm, CacheConfig(page_size=page_size, prefix_reuse=False))
        s.start_ids(_ids(lm.info.vocab_size, chat_tokens, seed), SamplingConfig(max_new_tokens=4, ignore_eos=True))

        def sink(r) -> None:
            if not first and (isinstance(r, BaseException) or r.event is not None):
                first.append(time.perf_counter())
            if isinstance(r, BaseException) or r.done:
                s.close()
                done.set()
        core.add(Request(s, sink, Priority.FOREGROUND))
    sent = time.perf_counter()
    core.call(start)
    done.wait(600)
    return (first[0] - sent) * 1000.0


def _open_streams(core, lm, n: int, context: int, page_size: int) -> list:
    """``n`` API-style requests (``Priority.API``) that decode to the end of the context; returns them once
    every one is past its prefill."""
    from engine.core.scheduler import Priority, Request
    from engine.core.session import ChatSession

    api: list = []

    def start() -> None:
        for i in range(n):
            s = ChatSession(lm, CacheConfig(page_size=page_size, prefix_reuse=False))
            s.start_ids(_ids(lm.info.vocab_size, context, 300 + i), SamplingConfig(
                max_new_tokens=max(1, lm.info.context_length - context - 1), ignore_eos=True))
            api.append(core.add(Request(s, lambda r, s=s: s.close() if isinstance(r, BaseException) or r.done
                                        else None, Priority.API)))
    core.call(start).result(600)
    while core.call(lambda: sum(r.session.pending_tokens() > 1 for r in api)).result(600):
        time.sleep(0.05)  # every stream past its prefill: decoding
    return api


def mixed(lm, chat_tokens: int, api_context: int, page_size: int, streams: int = 4,
          repeats: int = 5) -> dict[str, Any]:
    """One engine core on its own thread (as ``engine serve``, or the app's worker): ``streams`` API-style
    requests (``api_context``-token prompts) decoding, and an app-style chat message of ``chat_tokens`` tokens
    sent at an arbitrary moment. Its time to first token from the moment it was sent, against the same message
    on an idle core; medians of ``repeats``."""
    from engine.core.scheduler import CoreThread, EngineCore

    core = EngineCore(lm)
    thread = CoreThread(core, name="kvscope-bench-core")
    thread.start()
    api: list = []
    try:
        _chat_ttft(core, lm, chat_tokens, page_size, 1)  # warm
        idle = [_chat_ttft(core, lm, chat_tokens, page_size, 10 + i) for i in range(repeats)]
        api = _open_streams(core, lm, streams, api_context, page_size)
        busy = []
        for i in range(repeats):
            time.sleep(0.013 * (i + 1))  # sent at an arbitrary point of a round
            busy.append(_chat_ttft(core, lm, chat_tokens, page_size, 20 + i))
        decoding = core.call(lambda: sum(not r.done for r in api)).result(600)
    finally:
        core.call(lambda: [r.cancel() for r in api]).result(600)
        while core.call(lambda: sum(not r.done for r in api)).result(600):
            time.sleep(0.01)
        thread.stop()
    i, b = statistics.median(idle), statistics.median(busy)
    return {"streams": streams, "streams_decoding": decoding, "chat_tokens": chat_tokens, "api_context": api_context,
            "idle_ttft_ms": round(i, 2), "busy_ttft_ms": round(b, 2), "busy_over_idle": round(b / i, 3),
            "idle_runs_ms": [round(x, 1) for x in idle], "busy_runs_ms": [round(x, 1) for x in busy]}
