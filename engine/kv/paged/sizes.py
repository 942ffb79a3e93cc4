"""Bytes the KV cache holds per token, for every precision: plain arithmetic, no torch.

The engine's quantized pages (``engine.kv.quantized.schemes``) and the app's memory estimate before a model is loaded
(``app/models/estimate.py``) both read these formulas, so the two can never disagree.

Which layout a role gets (``scheme_name``):

- values are always per token: int8 one scale per token and head (q8_0-like), int4 a scale and a zero per
  group of ``min(32, head_dim)`` channels;
- int4 keys are per channel over a whole page (KIVI);
- int8 keys are per channel over the page whenever that costs no more bytes than one scale per token:
  ``2*D*s/P <= s``, i.e. ``page_size >= 2 * head_dim`` (stories260K: 16 >= 2*8; a 64-wide head needs pages
  of 128).

Bytes per token and layer for one role, s = scale bytes (2: float16), H = kv heads, D = head_dim, P = page:

    int8 per token      H * (D + s)
    int8 keys, channel  H * (D + 2*D*s/P)
    int4 keys           H * (ceil(D/2) + 2*D*s/P)
    int4 values         H * (ceil(D/2) + 2*ceil(D/g)*s),  g = min(group, D)
    tqB (B = 4, 3, 2)   H * (codes(D, B) + s)                   rotated, B bits a coordinate, one norm a vector
    tqB-qjl (keys)      H * (codes(D, B-1) + ceil(D/8) + 2*s)   B-1 bits + a 1-bit QJL sign of the residual a
                                                                coordinate, the norm and the residual's norm

``codes(D, B)``: the B-bit codes packed in bit planes of 4, 2 or 1 bits (``TQ_PLANES``: 3 bits = a 2-bit plane and
a 1-bit plane), each plane ``ceil(D*w/8)`` bytes: ``D*B/8`` when D is a multiple of 8 (every real head dim).
At head_dim 64 against 128 bytes of bf16: tq4 34 B (0.266), tq3 26 B (0.203), tq2 18 B (0.141), tq3-qjl 28 B.
"""

from __future__ import annotations

TQ_KINDS = ("tq4", "tq3", "tq2")  # TurboQuant-class: rotated, Lloyd-Max codes, a norm per vector
QJL_KINDS = ("tq4-qjl", "tq3-qjl", "tq2-qjl")  # keys only: one of the bits is a QJL sign of the residual
KINDS = ("int8", "int4", *TQ_KINDS, *QJL_KINDS)
ROLES = ("k", "v")
TQ_PLANES = {4: (4,), 3: (2, 1), 2: (2,), 1: (1,)}  # bit planes (widths) the codes of B bits are packed in
SCALE_BYTES = 2  # float16 scales and zeros (the engine's default)
INT4_VALUE_GROUP = 32

INT8_TOKENS = "int8-token"
INT8_CHANNEL_KEYS = "int8-channel-keys"
INT4_KEYS = "int4-keys"
INT4_VALUES = "int4-values"
TQ_MSE = {b: f"tq{b}-mse" for b in (4, 3, 2)}  # rotated codes + norm, keys or values
TQ_QJL = {b: f"tq{b}-qjl-keys" for b in (4, 3, 2)}  # B-1 bits of codes + QJL signs of the residual, keys


def check(kind: str, role: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kv quantization: {kind!r} is not one of {', '.join(KINDS)}")
    if role not in ROLES:
        raise ValueError(f"kv role: {role!r} is not one of {', '.join(ROLES)}")
    if kind in QJL_KINDS and role != "k":
        raise ValueError(f"kv quantization: {kind!r} is for keys only (the QJL residual keeps query-key products "
                         "unbiased; values use " + kind.removesuffix("-qjl") + ")")


def tq_bits(kind: str) -> int:
    """Bits a coordinate of a tq kind: tq3 and tq3-qjl both 3 (the latter 2 of codes + 1 of QJL sign)."""
    return int(kind[2])


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one vector's ``bits``-bit codes packed in the bit planes of ``TQ_PLANES``."""
    return sum(-(-head_dim * w // 8) for w in TQ_PLANES[bits])


def int8_key_layout(head_dim: int, page_size: int) -> str:
    """"channel" when per-channel int8 keys cost no more bytes than per-token ones, else "token"."""
    return "channel" if page_size >= 2 * head_dim else "token"


def scheme_name(kind: str, role: str, head_dim: int, page_size: int) -> str:
    """The layout ``kind`` takes for ``role`` at this head dim and page size (one of the names above)."""
    check(kind, role)
    if kind in TQ_KINDS:
        return TQ_MSE[tq_bits(kind)]
    if kind in QJL_KINDS:
        return TQ_QJL[tq_bits(kind)]
    if kind == "int8":
        if role == "k" and int8_key_layout(head_dim, page_size) == "channel":
            return INT8_CHANNEL_KEYS
        return INT8_TOKENS
    return INT4_KEYS if role == "k" else INT4_VALUES


def value_groups(head_dim: int, group: int = INT4_VALUE_GROUP) -> int:
    """Number of int4 value groups along head_dim (the last one padded when D is not a multiple)."""
    g = min(group, head_dim)
    return -(-head_dim // g)


def bytes_per_token(kind: str, role: str, kv_heads: int, head_dim: int, page_size: int,
                    scale_bytes: int = SCALE_BYTES, group: int = INT4_VALUE_GROUP) -> float:
    """Bytes one token's K or V takes in one layer held as ``kind`` pages (exact: a page's bytes / P)."""
    if kv_heads < 1 or head_dim < 1 or page_size < 1:
        raise ValueError("bytes_per_token: kv_heads, head_dim and page_size must be >= 1")
    h, d, p, s = kv_heads, head_dim, page_size, scale_bytes
    name = scheme_name(kind, role, d, p)
    if name == INT8_TOKENS:
        return float(h * (d + s))
    if name == INT8_CHANNEL_KEYS:
        return h * (d * p + 2 * d * s) / p
    if kind in TQ_KINDS:
        return float(h * (code_bytes(d, tq_bits(kind)) + s))
    if kind in QJL_KINDS:
        return float(h * (code_bytes(d, tq_bits(kind) - 1) + code_bytes(d, 1) + 2 * s))
    codes = (d + 1) // 2
    if name == INT4_KEYS:
        return h * (codes * p + 2 * d * s) / p
    return float(h * (codes + 2 * value_groups(d, group) * s))


def full_bytes_per_token(kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes one token's K or V takes in one layer at the model's precision."""
    return kv_heads * head_dim * elem_bytes
