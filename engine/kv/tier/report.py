"""What the KV disk tier (``engine.kv.tier.disk``) shows outside the engine: its ``/metrics`` rows, and its notes on
every surface. The writer thread finds a full or read-only disk after the reply that queued the pages has moved
on (``generate`` had printed its warnings and the notes were lost); ``settled_notes`` waits for the writes, so a
one-shot command ends with them, and ``problems`` picks out the notes an API reply carries (a problem with the
disk, never what the restore did: that is the request's own ``cached_tokens``).
"""

from __future__ import annotations

NOTE = "KV disk tier: "  # every note of a problem starts so


def problems(notes) -> list[str]:
    """The disk tier's problem notes among ``notes`` (dropped files, writes stopped, pages skipped)."""
    return [n for n in notes if n.startswith(NOTE)]


def settled_notes(lm) -> list[str]:
    """The notes of ``lm``'s disk tier once its queued pages are written (none without a tier). The engine
    thread waits for the writer: for one-shot commands, whose process ends after this reply anyway."""
    tier = getattr(getattr(lm, "kv_arenas", None), "disk", None)
    if tier is None:
        return []
    tier.flush()
    return tier.take_notes()


# /metrics rows (engine.server.metrics): name -> (Prometheus kind, help)
METRICS = {
    "kv_disk_hits_total": ("counter", "Prompt tokens restored from the KV disk tier"),
    "kv_disk_misses_total": ("counter", "Prompt tokens looked up on the KV disk tier and not found there"),
    "kv_disk_read_bytes_total": ("counter", "Bytes of pages read from the KV disk tier"),
    "kv_disk_written_bytes_total": ("counter", "Bytes of page files written to the KV disk tier"),
    "kv_disk_dropped_files_total": ("counter", "Damaged page files dropped (their tokens computed again)"),
    "kv_disk_bytes": ("gauge", "Bytes of page files in the KV disk tier"),
}


def gauges(registry) -> dict[str, float]:
    """``METRICS`` values of a model's arena registry's disk tier (none when it has no tier)."""
    tier = getattr(registry, "disk", None)
    if tier is None:
        return {}
    s = tier.stats()
    return {"kv_disk_hits_total": s["hit_tokens"], "kv_disk_misses_total": s["miss_tokens"],
            "kv_disk_read_bytes_total": s["bytes_read"], "kv_disk_written_bytes_total": s["bytes_written"],
            "kv_disk_dropped_files_total": s["dropped_files"], "kv_disk_bytes": s["bytes_on_disk"]}
