"""The walk of one decode round through the engine's files, traced: which files a round of the engine core enters
between ``EngineCore.round`` and the sinks, and how often control crosses from one file to another (a call into
another file, or a return to the caller's).

    python tests/measure_walk.py [--sessions 2] [--list]

Two chats on stories260K decoding together (one batched forward), their first rounds run untraced, then one round
traced with ``sys.setprofile``: only frames of ``engine/`` count (torch's and transformers' own calls are inside
the model's forward). ``files``: distinct engine files entered; ``crossings``: file-to-file transitions, calls and
returns; ``calls``: engine functions called. The coarse count takes each room but the core as one place (``kv``,
``model``): the orchestration's walk, without the stores' per-layer calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = str(ROOT / "engine")


def trace_round(core) -> list[tuple[str, str, str]]:
    """(event, file, function) of every engine frame's call and return during one ``core.round()``."""
    events: list[tuple[str, str, str]] = []

    def prof(frame, event, arg):
        if event in ("call", "return"):
            f = frame.f_code.co_filename
            if f.startswith(ENGINE):
                events.append((event, f[len(ENGINE) + 1:], frame.f_code.co_name))

    sys.setprofile(prof)
    try:
        core.round()
    finally:
        sys.setprofile(None)
    return events


def _coarse(f: str) -> str:
    """A file of the core as itself; any other file as its room (``kv/...`` -> ``kv``): the orchestration's walk."""
    return f if f.startswith("core/") else f.split("/")[0]


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--list", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine.config import CacheConfig, SamplingConfig
    from engine.core.scheduler import EngineCore, Request
    from engine.core.session import ChatSession
    from engine.model.loader import load_model

    lm = load_model(str(ROOT / "resources/models/stories260K"))
    core = EngineCore(lm)
    sink: list = []
    for i in range(a.sessions):
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
        s.start([{"role": "user", "content": f"Once upon a time {i}"}],
                SamplingConfig(max_new_tokens=64, ignore_eos=True) if "ignore_eos" in SamplingConfig.__dataclass_fields__
                else SamplingConfig(max_new_tokens=64))
        core.add(Request(s, sink.append))
    for _ in range(4):  # prefills and the first decodes: the rounds after are the steady state
        core.round()
    events = trace_round(core)
    r, c = walk(events), walk(events, coarse=True)
    print(f"one decode round of {a.sessions} chats: {r['files']} engine files, {r['crossings']} crossings, "
          f"{r['calls']} calls; the core's files and the other rooms: {c['files']} places, {c['crossings']} crossings")
    if a.list:
        print("\n".join(r["file_list"]))


if __name__ == "__main__":
    main()
