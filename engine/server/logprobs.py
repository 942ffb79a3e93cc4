"""Log-probabilities in OpenAI's shapes: the chosen token and its top alternatives (``engine.core.sampling`` records
them, from the model's own logits, when a request asks with ``logprobs``).

A token's ``bytes`` are its exact UTF-8 bytes, also when it holds part of a character (a byte-fallback token
``<0xE2>``, or a byte-level BPE token ending inside a character); its ``token`` text is those bytes decoded
with replacement characters, as OpenAI's own API shows such tokens.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of each byte."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class TokenText:
    """The bytes and text of single tokens of ``tokenizer`` (cached per id: a reply asks for the same ids often)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = _gpt2_bytes() if self.byte_level else {}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        b = self._cache.get(token)
        if b is None:
            b = self._cache[token] = self._bytes(token)
        return b

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        if not isinstance(piece, str):
            return b""
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        return piece.replace("\u2581", " ").encode("utf-8")  # sentencepiece's word mark is a space

    def entry(self, token: int, logprob: float, alts: list[tuple[int, float]]) -> dict[str, Any]:
        """One token of a chat reply's ``logprobs.content``."""
        return {**self._one(token, logprob), "top_logprobs": [self._one(t, lp) for t, lp in alts]}

    def _one(self, token: int, logprob: float) -> dict[str, Any]:
        b = self.bytes_of(token)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}


def chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    """A chat choice's ``logprobs``."""
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict[str, Any]:
    """A text completion choice's ``logprobs`` (the legacy shape); ``offset``: characters of text before the
    first of ``entries`` (a stream's earlier chunks)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
