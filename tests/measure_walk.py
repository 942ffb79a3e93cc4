"""The walk of one decode round through the engine's files, traced: which files a round of the engine core enters
between ``EngineCore.round`` and the sinks, and how often control crosses from one file to another (a call into
another file, or a return to the caller's). With ``--app``, also the app's walk of a chat message: the worker
(``app.link.worker.EngineWorker``, on this thread) from ``submit`` to its ``finished`` signal. With ``--api``, an
API request's: ``POST /v1/chat/completions`` to the server (``engine serve``'s ``KVServer`` on its threads: HTTP,
tokenizing, the engine) until its response is read, every thread traced (crossings counted within each thread).

    python tests/measure_walk.py [--root CHECKOUT] [--sessions 2] [--app] [--api] [--list]

Two chats on stories260K decoding together (one batched forward), their first rounds run untraced, then one round
traced with ``sys.setprofile``: only frames of the checkout's ``engine/`` (and ``app/``) count (torch's and
transformers' own calls are inside the model's forward). ``files``: distinct files entered; ``crossings``:
file-to-file transitions, calls and returns; ``calls``: our functions called. The coarse count takes each room but
the core as one place (``kv``, ``model``): the orchestration's walk, without the stores' per-layer calls.
``--root`` measures another checkout (say, a worktree of an older commit) with this script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def trace(fn, root: Path, rooms: tuple[str, ...] = ("engine",)) -> list[tuple[str, str, str]]:
    """(event, file, function) of every call and return of a frame in ``root``'s ``rooms`` during ``fn()``; the
    file relative to its room (``core/scheduler.py``), an ``app/`` file with its room's name (``app/link/...``)."""
    events: list[tuple[str, str, str]] = []
    tops = {str(root / r) + "/": r for r in rooms}

    def prof(frame, event, arg):
        if event in ("call", "return"):
            f = frame.f_code.co_filename
            for top, room in tops.items():
                if f.startswith(top):
                    rel = f[len(top):]
                    events.append((event, rel if room == "engine" else f"{room}/{rel}", frame.f_code.co_name))
                    break

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return events


def _coarse(f: str) -> str:
    """A file of the core (or the app's link) as itself; any other file as its room (``kv/...`` -> ``kv``,
    ``app/chat/...`` -> ``app/chat``): the orchestration's walk."""
    if f.startswith(("core/", "app/link/")):
        return f
    parts = f.split("/")
    return "/".join(parts[:2]) if parts[0] == "app" else parts[0]


def walk(events: list[tuple[str, str, str]], coarse: bool = False) -> dict:
    files, crossings, stack, prev = set(), 0, [], None
    for event, f, _ in events:
        f = _coarse(f) if coarse else f
        if event == "call":
            stack.append(f)
            here = f
        else:
            stack.pop() if stack else None
            here = stack[-1] if stack else f
        files.add(f)
        if prev is not None and here != prev:
            crossings += 1
        prev = here
    return {"files": len(files), "crossings": crossings, "calls": sum(1 for e in events if e[0] == "call"),
            "file_list": sorted(files)}


def engine_walk(root: Path, sessions: int) -> list[tuple[str, str, str]]:
    from engine.config import CacheConfig, SamplingConfig
    from engine.core.scheduler import EngineCore, Request
    from engine.core.session import ChatSession
    from engine.model.loader import load_model

    lm = load_model(str(root / "resources/models/stories260K"))
    core = EngineCore(lm)
    sink: list = []
    for i in range(sessions):
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
        s.start([{"role": "user", "content": f"Once upon a time {i}"}], SamplingConfig(max_new_tokens=64, ignore_eos=True))
        core.add(Request(s, sink.append))
    for _ in range(4):  # prefills and the first decodes: the rounds after are the steady state
        core.round()
    return trace(core.round, root)


def app_walk(root: Path, new_tokens: int = 4) -> list[tuple[str, str, str]]:
    """A chat message of ``new_tokens`` tokens through the app's worker, on this thread: ``submit``, then the
    rounds its timer would run (``_pump``), until ``finished``. The model is loaded and one message answered first
    (untraced), so the walk is a message's, not the first one's."""
    from PySide6.QtCore import QCoreApplication

    from app.link.worker import EngineWorker
    from engine.config import CacheConfig, ModelSpec, SamplingConfig

    app = QCoreApplication.instance() or QCoreApplication([])  # noqa: F841 - signals need one
    w = EngineWorker()
    ended: list = []
    w.finished.connect(lambda *a: ended.append(a))
    w.load(ModelSpec(source=str(root / "resources/models/stories260K")), CacheConfig(mode="paged", page_size=16))
    sampling = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)

    def message(gen: int, text: str) -> None:
        w.submit(gen, [{"role": "user", "content": text}], sampling, "chat")
        while len(ended) < gen:
            w._pump()  # what the worker's timer runs each event-loop turn

    message(1, "Once upon a time")
    events = trace(lambda: message(2, "Once upon a time there was"), root, ("engine", "app"))
    w.stop()
    return events


def api_walk(root: Path, new_tokens: int = 4) -> dict[int, list[tuple[str, str, str]]]:
    """An API request of ``new_tokens`` tokens (greedy, not streamed) through the server on its threads, from the
    request sent (``http.client``, this thread) to its response read; one request answered first (untraced). Each
    thread's events apart (by thread id): a call on one thread and a return on another are no crossing."""
    import http.client
    import json
    import threading
    import time

    from engine.config import CacheConfig
    from engine.model.loader import load_model
    from engine.server.service import KVServer, ServerOptions, ServerThread

    top, tracing, events = str(root / "engine") + "/", [False], {}

    def prof(frame, event, arg):
        if tracing[0] and event in ("call", "return") and frame.f_code.co_filename.startswith(top):
            events.setdefault(threading.get_ident(), []).append(
                (event, frame.f_code.co_filename[len(top):], frame.f_code.co_name))

    threading.setprofile(prof)  # the server's threads start below, each with the hook (idle until ``tracing``)
    try:
        lm = load_model(str(root / "resources/models/stories260K"))
        served = ServerThread(KVServer(lm, CacheConfig(mode="paged", page_size=16), ServerOptions()))
        host, port = served.url.split("//")[1].split(":")

        def ask(text: str) -> None:
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            body = {"model": lm.info.name, "messages": [{"role": "user", "content": text}], "max_tokens": new_tokens,
                    "temperature": 0.0}
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 200, reply.read()
            reply.read()
            conn.close()

        served.start()
        ask("Once upon a time")
        time.sleep(0.2)  # the first request's round ends
        tracing[0] = True
        sys.setprofile(prof)
        ask("Once upon a time there was")
        sys.setprofile(None)
        tracing[0] = False
        served.stop()
    finally:
        threading.setprofile(None)
    return events


def _threads(by_thread: dict, coarse: bool = False) -> dict:
    """``walk`` of each thread's events, summed (files: those of any thread)."""
    rs = [walk(ev, coarse) for ev in by_thread.values()]
    files = sorted({f for r in rs for f in r["file_list"]})
    return {"files": len(files), "crossings": sum(r["crossings"] for r in rs), "calls": sum(r["calls"] for r in rs),
            "file_list": files}


def _say(label: str, events, listed: bool) -> None:
    if isinstance(events, dict):  # by thread
        r, c = _threads(events), _threads(events, coarse=True)
    else:
        r, c = walk(events), walk(events, coarse=True)
    print(f"{label}: {r['files']} files, {r['crossings']} crossings, {r['calls']} calls; the core's (link's) files "
          f"and the other rooms: {c['files']} places, {c['crossings']} crossings")
    if listed:
        print("\n".join("  " + f for f in r["file_list"]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--app", action="store_true", help="also the app's walk of a chat message")
    p.add_argument("--api", action="store_true", help="also the walk of an API request (the server's threads)")
    p.add_argument("--list", action="store_true")
    a = p.parse_args()
    root = a.root.resolve()
    sys.path.insert(0, str(root))
    import engine

    if not engine.__file__.startswith(str(root)):
        raise SystemExit(f"engine imported from {engine.__file__}, not {root}: run from {root}")
    _say(f"one decode round of {a.sessions} chats (engine)", engine_walk(root, a.sessions), a.list)
    if a.app:
        _say("a chat message of 4 tokens (app worker, submit to finished)", app_walk(root), a.list)
    if a.api:
        _say("an API request of 4 tokens (HTTP, tokenizing and engine threads, sent to response read)",
             api_walk(root), a.list)


if __name__ == "__main__":
    main()
