"""vLLM's KV cache events on the wire: ZMQ multipart ``[topic, seq, payload]`` with ``seq`` an 8-byte big-endian
count and ``payload`` a msgpack ``KVEventBatch``. Read (the remote view) and written (KV Scope's own server).

vLLM 0.32 encodes with msgspec: a batch is an array ``[ts, [event, ...], data_parallel_rank]`` and an event a
map tagged by ``type`` (``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
[...], "block_size": 32, "medium": "GPU", "group_idx": 0, "kv_cache_spec_kind": "full_attention", ...}``). Other
releases send events as tagged arrays (tag first, fields in declaration order): ``decode_batch`` reads both.
Block hashes are 64-bit ints by default and bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: they are kept
as they come (both hash). A block whose hash is stored again (vLLM recomputed a block it had cached: both
copies live until removed) is one more stored block.

The payload comes from a server we do not control: msgpack builds only bounded arrays and maps
(``UNPACK_LIMITS``), every field is checked for its type and range, and an event that fails is left out of its
batch and counted (``Batch.skipped``), never raised past ``decode_batch``.
"""

from __future__ import annotations

import math
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
    skipped: int = 0  # events left out because their fields were not what vLLM sends
    problem: str = ""  # the first one's reason


class WireError(ValueError):
    """A payload that is not a KV event batch, or an event whose fields are not what vLLM sends (one line)."""


# Bounds of what a batch may hold. vLLM sends one batch per engine step, and a step computes at most
# max_num_batched_tokens tokens (2,048-16,384 by default): a 128k-token prefill step stores 8,192 blocks of 16,
# so 65,536 hashes and 2^20 token ids per event leave 8x room; a bytes hash is a 32-byte SHA-256.
MAX_EVENT_BLOCKS = 1 << 16
MAX_EVENT_TOKENS = 1 << 20
MAX_BLOCK_SIZE = 1 << 16  # vLLM's block sizes are 1-256 (hybrid models pad theirs to a few thousand)
MAX_HASH_BYTES = 64
MAX_TOKEN_ID = (1 << 32) - 1  # the largest vocabularies are ~2^18
MAX_RANKS = 64  # data-parallel engines per server: vLLM deployments run 1-32
MAX_GROUPS = 1024  # KV cache groups of a hybrid model: a few
MAX_NAME = 64  # medium ("GPU", "CPU_LMCACHE", ...) and spec kind ("full_attention", ...) strings
# what msgpack may build from one payload before a field is looked at (its defaults scale with the payload: a
# 2 MiB frame of one-byte ints would be a list of 2 million): arrays up to one event's token ids, maps up to an
# event's dozen fields with room, no extension types (vLLM sends none)
UNPACK_LIMITS = {"max_array_len": MAX_EVENT_TOKENS, "max_map_len": 256, "max_str_len": 1 << 16,
                 "max_bin_len": 1 << 16, "max_ext_len": 0}


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(value, name: str, lo: int, hi: int, none: bool = True):
    if value is None and none:
        return None
    if type(value) is not int or not lo <= value <= hi:  # bool is an int subclass: refused too
        raise WireError(f"{name} {_show(value)} is not an integer from {lo} to {hi:,}")
    return value


def _name(value, name: str):
    if value is None or (isinstance(value, str) and len(value) <= MAX_NAME and value.isprintable()):
        return value
    raise WireError(f"{name} {_show(value)} is not a short name")


def _hash(value, name: str):
    if isinstance(value, (bytes, bytearray)) and 0 < len(value) <= MAX_HASH_BYTES:
        return bytes(value)
    if type(value) is int:  # msgpack ints are 64-bit at most: every one is a hash vLLM could send
        return value
    raise WireError(f"{name} {_show(value)} is not a block hash (an integer, or up to {MAX_HASH_BYTES} bytes)")


def _hashes(value) -> tuple:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_EVENT_BLOCKS:
        raise WireError(f"block_hashes {_show(value)} is not a list of at most {MAX_EVENT_BLOCKS:,} hashes")
    return tuple(_hash(h, "block hash") for h in value)


def _token_ids(value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_EVENT_TOKENS:
        raise WireError(f"token_ids {_show(value)} is not a list of at most {MAX_EVENT_TOKENS:,} token ids")
    if value and not (all(type(t) is int for t in value) and 0 <= min(value) and max(value) <= MAX_TOKEN_ID):
        raise WireError(f"token_ids {_show(value)} holds something other than token ids (0 to {MAX_TOKEN_ID:,})")
    return tuple(value)


def _fields(raw, names: tuple[str, ...]) -> dict:
    """A struct as msgspec sends it (tagged array, tag first; or a map with ``type``) → field dict."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def _stored(f: dict) -> Stored:
    hashes = _hashes(f.get("block_hashes"))
    block_size = _int(f.get("block_size"), "block_size", 0, MAX_BLOCK_SIZE) or 0
    tokens = _token_ids(f.get("token_ids"))
    if block_size and len(tokens) > len(hashes) * block_size:
        raise WireError(f"BlockStored has {len(tokens):,} token ids for {len(hashes):,} blocks of {block_size}")
    parent = f.get("parent_block_hash")
    return Stored(hashes, None if parent is None else _hash(parent, "parent_block_hash"), tokens, block_size,
                  _name(f.get("medium"), "medium"), _int(f.get("group_idx"), "group_idx", 0, MAX_GROUPS),
                  _name(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"))


def decode_event(raw):
    """One event → ``Stored`` / ``Removed`` / ``Cleared``; None for a kind this viewer does not draw (a newer
    vLLM's); ``WireError`` (one line naming the field) for an event whose fields are not what vLLM sends."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
    else:
        raise WireError(f"event {_show(raw)} is neither a map nor a tagged array")
    if isinstance(tag, bytes):
        tag = tag.decode("utf-8", "replace")
    if not isinstance(tag, str):
        raise WireError(f"event type {_show(tag)} is not a name")
    if tag == "BlockStored":
        return _stored(_fields(raw, STORED_FIELDS))
    if tag == "BlockRemoved":
        f = _fields(raw, REMOVED_FIELDS)
        return Removed(_hashes(f.get("block_hashes")), _name(f.get("medium"), "medium"),
                       _int(f.get("group_idx"), "group_idx", 0, MAX_GROUPS))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> Batch:
    """A msgpack ``KVEventBatch`` → ``Batch``. ``WireError`` when the payload is not a batch at all; an event
    with bad fields is left out and counted in ``skipped`` (``problem``: the first one's reason)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, **UNPACK_LIMITS)
    except Exception as e:  # noqa: BLE001 - untrusted bytes: msgpack raises ValueError, TypeError, StackError ...
        raise WireError(f"not msgpack ({type(e).__name__}: {str(e)[:80]})") from None
    if isinstance(raw, dict):
        raw = [raw.get(k) for k in BATCH_FIELDS]
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise WireError("not a KV event batch ([ts, events, rank])")
    ts = raw[0] if raw[0] is not None else 0.0
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise WireError(f"batch time {_show(ts)} is not a finite number")
    rank = _int(raw[2] if len(raw) > 2 else None, "data_parallel_rank", 0, MAX_RANKS - 1) or 0
    batch = Batch(float(ts), [], rank)
    for x in raw[1]:
        try:
            event = decode_event(x)
        except WireError as e:
            batch.skipped += 1
            batch.problem = batch.problem or str(e)
            continue
        if event is not None:
            batch.events.append(event)
    return batch


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
