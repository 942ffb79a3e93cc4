"""vLLM's KV cache events on the wire: ZMQ multipart ``[topic, seq, payload]`` with ``seq`` an 8-byte big-endian
count and ``payload`` a msgpack ``KVEventBatch``. Read (the remote view) and written (KV Scope's own server).

vLLM 0.32 encodes with msgspec: a batch is an array ``[ts, [event, ...], data_parallel_rank]`` and an event a
map tagged by ``type`` (``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
[...], "block_size": 32, "medium": "GPU", "group_idx": 0, "kv_cache_spec_kind": "full_attention", ...}``). Other
releases send events as tagged arrays (tag first, fields in declaration order): ``decode_batch`` reads both.
Block hashes are 64-bit ints by default and bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: they are kept
as they come (both hash). A block whose hash is stored again (vLLM recomputed a block it had cached: both
copies live until removed) is one more stored block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
END_SEQ = -1  # the replay socket's "no more batches" marker


@dataclass(frozen=True)
class Stored:
    """Full blocks now cached: ``hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``; the first one's
    parent is ``parent`` (None: the chain starts at the request's first token)."""
    hashes: tuple
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"
    group_idx: int | None = None
    kind: str | None = None  # kv_cache_spec_kind: "full_attention", "sliding_window", ...


@dataclass(frozen=True)
class Removed:
    hashes: tuple
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass(frozen=True)
class Cleared:
    pass


@dataclass
class Batch:
    ts: float
    events: list = field(default_factory=list)
    rank: int = 0


class WireError(ValueError):
    """A payload that is not a KV event batch."""


def _fields(raw, names: tuple[str, ...]) -> dict:
    """A struct as msgspec sends it (tagged array, tag first; or a map with ``type``) → field dict."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def _hashes(value) -> tuple:
    return tuple(bytes(h) if isinstance(h, (bytes, bytearray)) else h for h in (value or ()))


def decode_event(raw):
    """One event → ``Stored`` / ``Removed`` / ``Cleared``; None for a kind this viewer does not draw."""
    tag = raw.get("type") if isinstance(raw, dict) else (raw[0] if raw else None)
    if isinstance(tag, bytes):
        tag = tag.decode("utf-8", "replace")
    if tag == "BlockStored":
        f = _fields(raw, STORED_FIELDS)
        parent = f.get("parent_block_hash")
        return Stored(_hashes(f.get("block_hashes")), bytes(parent) if isinstance(parent, bytearray) else parent,
                      tuple(f.get("token_ids") or ()), int(f.get("block_size") or 0), f.get("medium"),
                      f.get("group_idx"), f.get("kv_cache_spec_kind"))
    if tag == "BlockRemoved":
        f = _fields(raw, REMOVED_FIELDS)
        return Removed(_hashes(f.get("block_hashes")), f.get("medium"), f.get("group_idx"))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> Batch:
    """A msgpack ``KVEventBatch`` → ``Batch`` (``WireError`` when it is something else)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        raw = [raw.get(k) for k in BATCH_FIELDS]
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise WireError("not a KV event batch ([ts, events, rank])")
    events = [e for e in (decode_event(x) for x in raw[1] if x) if e is not None]
    rank = raw[2] if len(raw) > 2 and raw[2] is not None else 0
    return Batch(float(raw[0] or 0.0), events, int(rank))


def encode_event(event) -> dict:
    """An event as vLLM 0.32's msgspec sends it: a map tagged by ``type``, defaults (None) left out after the
    required fields."""
    if isinstance(event, Stored):
        out = {"type": "BlockStored", "block_hashes": list(event.hashes), "parent_block_hash": event.parent,
               "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": None,
               "medium": event.medium, "lora_name": None}
        extra = {"group_idx": event.group_idx, "kv_cache_spec_kind": event.kind}
    elif isinstance(event, Removed):
        out = {"type": "BlockRemoved", "block_hashes": list(event.hashes), "medium": event.medium}
        extra = {"group_idx": event.group_idx}
    else:
        return {"type": "AllBlocksCleared"}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def encode_batch(batch: Batch) -> bytes:
    return msgpack.packb([batch.ts, [encode_event(e) for e in batch.events], batch.rank], use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule for its publisher: ``tcp://*:PORT``, ``::`` and ipc / inproc endpoints bind, others connect.
    A subscriber does the opposite."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel rank ``rank``: tcp ports are offset by the rank (vLLM's rule)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}" if port.isdigit() else endpoint
