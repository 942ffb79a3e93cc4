"""The open chat's cache trace: every snapshot of every reply in the chat since it was opened, exportable
as JSON or CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from engine.snapshot import CacheSnapshot

CSV_FIELDS = (
    "generation_id", "step", "phase", "mode", "policy", "page_size", "num_pages", "pages_used", "seq_len",
    "tokens_held", "capacity_tokens", "kv_bytes", "weights_bytes", "device_bytes", "reused_tokens",
    "recomputed_tokens", "first_divergence", "evicted_total", "step_ms", "ttft_ms", "decode_tokens_per_s",
    "k_dtype", "v_dtype",
)


class CacheTrace:
    """Snapshots of the chat's replies, in arrival order (capped at ``limit``; the oldest steps go first,
    except the very first, which shows where the chat started)."""

    def __init__(self, limit: int = 20000) -> None:
        self.limit = limit
        self.generation_ids: list[int] = []
        self.snapshots: list[CacheSnapshot] = []
        self.notes: list[str] = []

    @property
    def generation_id(self) -> int:
        """The latest reply (0 before the first)."""
        return self.generation_ids[-1] if self.generation_ids else 0

    def reset(self) -> None:
        """Another chat is open: its trace starts empty."""
        self.generation_ids = []
        self.snapshots = []
        self.notes = []

    def begin(self, generation_id: int) -> None:
        """A reply of this chat starts: its snapshots are added to the chat's."""
        if generation_id not in self.generation_ids:
            self.generation_ids.append(generation_id)

    def add(self, snap: CacheSnapshot) -> None:
        if snap.generation_id not in self.generation_ids:
            return
        if len(self.snapshots) >= self.limit:
            del self.snapshots[1 : 1 + self.limit // 10]
        self.snapshots.append(snap)

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
            "snapshots": [s.to_dict() for s in self.snapshots],
        }
        Path(path).write_text(json.dumps(data))

    def write_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
            w.writeheader()
            for row in self.rows():
                w.writerow({k: row.get(k, "") for k in CSV_FIELDS})
