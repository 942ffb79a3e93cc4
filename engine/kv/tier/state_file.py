"""The state file of the KV disk tier (``engine.kv.tier.disk``): a hybrid model's recurrent / convolution states at one
named page boundary (what ``engine.kv.store.state_shelf`` keeps in memory), so a restarted app, another chat or
another process goes on from a shared prefix of a model with state layers as it does from pages.

A page alone is not enough there: LFM2's conv layers, Falcon-H1's Mamba layers, Qwen3-Next's linear attention keep
a state that summarises every token before the boundary and cannot be recomputed from the attention pages. The
file holds that state under the name of the page that ends at the boundary, beside the pages' own files, on a
shelf of its own (``states_shelf``: the model, the page size, the state layers).

Layout: a magic line, a little-endian uint32 header length, a JSON header — the name, the shelf, one entry per
state tensor ``[layer, field, index, dtype, shape]``, the layers' flags ``[layer, flag, index, value]``, the payload
bytes and an HMAC-SHA256 of name, shelf, header entries and payload under the folder's key — padded so the payload
starts on a 64-byte boundary, then the tensors in the entries' order. Reading trusts nothing, as for page files:
``read_page`` opens without following links or blocking and reads only a regular file no larger than the
shelf's budget; ``parse_states`` checks the magic, the header's length and nesting, the HMAC, that the entries
name exactly the model's state layers and fields, the shapes' bytes against the payload, and that every value
is finite. Every failure is a ``PageFileError`` naming what does not match: the tier drops the file and the
tokens are computed again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct

import torch

from engine.kv.tier.folder import STATE_SUFFIX as SUFFIX
from engine.kv.tier.page_file import ALIGN, PageFileError, dtype_name, read_header

MAGIC = b"KVSCOPE-STATE-1\n"
MAX_HEADER = 64 << 10  # bytes: ~60 per tensor entry; Qwen3-Next-80B's 36 linear layers x 2 fields fit in ~5 KB
MAX_DEPTH = 4  # an object holding lists of entries, an entry holding its shape (a list)
MAX_DIMS = 6
FIELDS = ("conv_states", "recurrent_states")
FLAGS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size")
DTYPES = {dtype_name(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def states_shelf(model_fp: str, page_size: int, layer_ids: list[int]) -> str:
    """The folder name of a model's state files: its fingerprint (weights, config, dtype), the page size (a name
    depends on it) and the state layers."""
    key = f"{model_fp}\0states\0{page_size}\0{','.join(map(str, layer_ids))}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _entries(saved: dict) -> tuple[list, list, list[torch.Tensor]]:
    """(tensor entries, flag entries, host tensors in the entries' order) of a ``StateLayers.snapshot``."""
    entries, flags, tensors = [], [], []
    for layer in sorted(saved):
        entry = saved[layer]
        for field in FIELDS:
            for idx in sorted(entry[field]):
                t = entry[field][idx]
                if t is not None:
                    t = t.detach().to("cpu").contiguous()
                    entries.append([int(layer), field, int(idx), dtype_name(t.dtype), list(t.shape)])
                    tensors.append(t)
        for flag in FLAGS:
            for idx, value in sorted(entry["flags"].get(flag, {}).items()):
                flags.append([int(layer), flag, int(idx), value if value is None else int(value)])
    return entries, flags, tensors


def mac(key: bytes, name: bytes, shelf: str, entries: list, flags: list, *payload) -> str:
    """HMAC-SHA256 (hex) of a state file's name, shelf, entries, flags and payload under the folder's ``key``."""
    h = hmac.new(key, name + b"\0" + shelf.encode() + b"\0", hashlib.sha256)
    h.update(json.dumps([entries, flags]).encode() + b"\0")
    for part in payload:
        h.update(part)
    return h.hexdigest()


def encode_states(name: bytes, shelf: str, saved: dict, key: bytes) -> tuple:
    """(magic + length + header bytes, then each tensor's bytes) of the state file of ``saved``."""
    entries, flags, tensors = _entries(saved)
    parts = [t.view(torch.uint8).numpy() for t in tensors]
    nbytes = sum(p.nbytes for p in parts)
    header = json.dumps({"name": name.hex(), "shelf": shelf, "entries": entries, "flags": flags, "bytes": nbytes,
                         "hmac": mac(key, name, shelf, entries, flags, *parts)}).encode()
    header += b" " * (-(len(MAGIC) + 4 + len(header)) % ALIGN)
    return (MAGIC + struct.pack("<I", len(header)) + header, *parts)


def _span(entry) -> int:
    """Bytes of one tensor entry; ``PageFileError`` for anything that is not ``[int, str, int, dtype, [dims]]``."""
    if not (isinstance(entry, list) and len(entry) == 5 and entry[3] in DTYPES and isinstance(entry[4], list)
            and len(entry[4]) <= MAX_DIMS and all(isinstance(d, int) and 0 <= d < 1 << 31 for d in entry[4])):
        raise PageFileError("damaged header (a tensor entry)")
    return math.prod(entry[4]) * DTYPES[entry[3]].itemsize


def parse_states(buf: bytearray, name: bytes, shelf: str, layers: dict, key: bytes, device) -> dict:
    """The ``StateLayers.snapshot`` of a state file's bytes, its tensors on the host and its layers' place
    ``device``; ``layers``: the model's state layers (``StateLayers.layers``: which layers and state indices a
    snapshot must hold). ``PageFileError`` (and nothing else) saying what does not match."""
    h, off = read_header(buf, MAGIC, MAX_HEADER, MAX_DEPTH, "a state file")
    if h.get("name") != name.hex() or h.get("shelf") != shelf:
        raise PageFileError("name does not match")
    entries, flags = h.get("entries"), h.get("flags")
    if not isinstance(entries, list) or not isinstance(flags, list):
        raise PageFileError("damaged header")
    if not isinstance(h.get("hmac"), str) or not hmac.compare_digest(
            mac(key, name, shelf, entries, flags, memoryview(buf)[off:]), h["hmac"]):
        raise PageFileError("checksum mismatch: altered, or written under another folder's key")
    spans = [_span(e) for e in entries]
    if sum(spans) != h["bytes"]:
        raise PageFileError("shapes do not match the payload")
    saved = {i: {"conv_states": dict.fromkeys(layer.conv_states), "recurrent_states":
                 dict.fromkeys(layer.recurrent_states), "flags": {f: {} for f in FLAGS}} for i, layer in layers.items()}
    raw, at, dtypes = torch.frombuffer(buf, dtype=torch.uint8, offset=off) if h["bytes"] else None, 0, {}
    for (layer, field, idx, dt, shape), n in zip(entries, spans):
        if layer not in saved or field not in FIELDS or idx not in saved[layer][field]:
            raise PageFileError("state layers do not match this model")
        t = raw[at:at + n].view(DTYPES[dt]).reshape(shape)  # a view of the file's bytes: copied onto the device
        at += n
        if not math.isfinite(float(t.sum(dtype=torch.float32))):
            raise PageFileError("values not finite (NaN or inf)")
        saved[layer][field][idx] = t
        dtypes.setdefault(layer, DTYPES[dt])
    for entry in flags:
        if not (isinstance(entry, list) and len(entry) == 4 and entry[0] in saved and entry[1] in FLAGS
                and (entry[3] is None or isinstance(entry[3], int))):
            raise PageFileError("damaged header (a flag)")
        layer, flag, idx, value = entry
        saved[layer]["flags"][flag][idx] = value if value is None or flag == "conv_kernel_size" else bool(value)
    for i, entry in saved.items():
        entry["where"] = (torch.device(device), dtypes.get(i, layers[i].dtype))
    return saved
