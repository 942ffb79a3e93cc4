"""The open chat's cache trace: every snapshot of every reply in the chat on screen written while the app runs
(kept when another chat is opened, for when it comes back), exportable as JSON or CSV."""

from __future__ import annotations

import csv
import json
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.snapshot import CacheSnapshot

CSV_FIELDS = (
    "generation_id", "step", "phase", "mode", "policy", "page_size", "num_pages", "pages_used", "seq_len",
    "tokens_held", "capacity_tokens", "kv_bytes", "weights_bytes", "device_bytes", "reused_tokens",
    "recomputed_tokens", "first_divergence", "evicted_total", "step_ms", "ttft_ms", "decode_tokens_per_s",
    "k_dtype", "v_dtype",
)


def strip_runs(token_state: np.ndarray) -> np.ndarray:
    """The token strip run-length encoded: [runs, 2] int64 rows of (TOKEN_* code, count), in order. A
    StreamingLLM strip of any length is 3-4 runs (sinks, evicted middle, kept window, not yet cached)."""
    states = np.asarray(token_state)
    if not len(states):
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, states[1:] != states[:-1]])
    counts = np.diff(np.r_[starts, len(states)])
    return np.stack([states[starts].astype(np.int64), counts], axis=1)


def strip_from_runs(runs: np.ndarray) -> np.ndarray:
    """The token strip (int8 codes) back from ``strip_runs``."""
    return np.repeat(runs[:, 0], runs[:, 1]).astype(np.int8) if len(runs) else np.zeros(0, dtype=np.int8)


_NO_STRIP = np.zeros(0, dtype=np.int8)
KEPT = 16  # chats whose traces are kept while others are on screen (each at most ``limit`` steps)


class CacheTrace:
    """Snapshots of the chat's replies, in arrival order (capped at ``limit``; the oldest steps go first,
    except the very first, which shows where the chat started).

    Each snapshot is kept without its token strip, which is kept run-length encoded beside it (``strips``):
    a strip has one entry per token of the chat, so 20,000 steps of a 120k-token StreamingLLM chat held
    2.4 GB of strips that are 4 runs each. ``strip(i)`` gives a step's strip back."""

    def __init__(self, limit: int = 20000) -> None:
        self.limit = limit
        self.generation_ids: list[int] = []
        self.snapshots: list[CacheSnapshot] = []  # token_state emptied: see ``strips``
        self.strips: list[np.ndarray] = []  # [runs, 2] per snapshot (``strip_runs``)
        self.notes: list[str] = []
        self.key: Any = None  # the chat this trace is of (``open``)
        self._kept: OrderedDict[Any, tuple] = OrderedDict()  # other chats' traces, least recently shown first

    def watch(self, screen) -> None:
        """Record what the screen's record (``app.ground.screen.Screen``) says of the chat on screen: which chat it is,
        its replies as they begin, every snapshot of them, and the engine's notes."""
        screen.connect("chat", self.open)
        screen.connect("reply", lambda view: view.running and self.begin(view.generation_id))
        screen.connect("latest", lambda snap: (snap is not None and snap.generation_id == screen.generation
                                               and self.add(snap)))  # a reply's steps, not an idle description
        screen.connect("said", lambda notes: self.notes.extend(notes))

    @property
    def generation_id(self) -> int:
        """The latest reply (0 before the first)."""
        return self.generation_ids[-1] if self.generation_ids else 0

    def reset(self) -> None:
        """The trace starts empty (the chat it belonged to keeps nothing)."""
        self.generation_ids = []
        self.snapshots = []
        self.strips = []
        self.notes = []

    def open(self, key: Any) -> None:
        """Another chat (``key``) is on screen: the trace so far stays with the chat it belongs to, and ``key``'s
        comes back — a chat switched away from and back to exports all its replies (the last ``KEPT`` chats)."""
        if key == self.key:
            return
        if self.snapshots or self.notes:
            self._kept[self.key] = (self.generation_ids, self.snapshots, self.strips, self.notes)
            self._kept.move_to_end(self.key)
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)
        self.reset()
        self.key = key
        if key in self._kept:
            self.generation_ids, self.snapshots, self.strips, self.notes = self._kept.pop(key)

    def begin(self, generation_id: int) -> None:
        """A reply of this chat starts: its snapshots are added to the chat's."""
        if generation_id not in self.generation_ids:
            self.generation_ids.append(generation_id)

    def add(self, snap: CacheSnapshot) -> None:
        if snap.generation_id not in self.generation_ids:
            return
        if len(self.snapshots) >= self.limit:
            del self.snapshots[1 : 1 + self.limit // 10]
            del self.strips[1 : 1 + self.limit // 10]
        self.strips.append(strip_runs(snap.token_state))
        self.snapshots.append(replace(snap, token_state=_NO_STRIP))

    def strip(self, i: int) -> np.ndarray:
        """Snapshot ``i``'s token strip, as it arrived."""
        return strip_from_runs(self.strips[i])

    def __len__(self) -> int:
        return len(self.snapshots)

    def rows(self) -> list[dict]:
        out = []
        for s in self.snapshots:
            row = {k: getattr(s, k) for k in CSV_FIELDS if hasattr(s, k)}
            row["pages_used"] = s.pages_used
            row["tokens_held"] = int(np.max(s.tokens_per_layer, initial=0))
            out.append(row)
        return out

    def write_json(self, path: str | Path) -> None:
        data = {
            "generation_ids": self.generation_ids,
            "notes": self.notes,
            "snapshots": [_exported(s, runs) for s, runs in zip(self.snapshots, self.strips)],
        }
        Path(path).write_text(json.dumps(data))

    def write_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
            w.writeheader()
            for row in self.rows():
                w.writerow({k: row.get(k, "") for k in CSV_FIELDS})


def _exported(snap: CacheSnapshot, runs: np.ndarray) -> dict:
    """A trace step as JSON: the snapshot's fields, its token strip as ``token_state_runs`` [[code, count], ...]
    (a strip per step in full would make the file quadratic in the chat's length)."""
    d = snap.to_dict()
    d.pop("token_state", None)
    d["token_state_runs"] = runs.tolist()
    return d
