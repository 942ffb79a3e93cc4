"""A streamed chat reply (server-sent events) read from a server we do not control.

Every bound is the reply's own: lines of at most ``LINE_MAX_BYTES``; a line that has begun must end within
``LINE_S`` (servers write an event whole, so the rest of a line comes within milliseconds; a server dripping a
byte every 5 s is cut here); no read waits longer than the idle timeout (a long prefill, a queue); at most
``max_tokens + TOKEN_MARGIN`` tokens, ``TEXT_PER_TOKEN`` characters per token on average, ``LINES_PER_TOKEN``
lines per token; and one deadline over the whole reply. Each chunk is checked for the types the OpenAI API
gives; anything else ends the reply with ``error`` naming the field (the text so far is kept).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from engine.remote.guard import printable

LINE_MAX_BYTES = 8 << 20  # the first chunk carries the prompt's token ids: a 1M-token prompt is ~7 MB of JSON
LINE_S = 10.0
TOKEN_MARGIN = 64  # tokens past max_tokens a reply may stream (a stop string's tail, special tokens)
DEFAULT_MAX_TOKENS = 1 << 17  # no max_tokens asked: the server stops at its context, 128k tokens at most here
TEXT_PER_TOKEN = 32  # characters per token on average (English is ~4; vocabularies' longest tokens are ~100)
LINES_PER_TOKEN = 4  # a chunk is "data: ..." and an empty line; keep-alive comments and the usage chunk too
LINES_SPARE = 256
SECONDS_PER_TOKEN = 1.0  # the whole reply's deadline: slower than 1 token/s is no server's decode
MAX_CHOICES = 16
FINISH_MAX = 64


class StreamError(Exception):
    """The stream broke a bound or sent something that is not an OpenAI chunk: the message says which."""


@dataclass(frozen=True)
class StreamCaps:
    tokens: int
    text_chars: int
    lines: int
    deadline_s: float  # from the request being sent

    @classmethod
    def of(cls, max_tokens: int | None, first_byte_s: float) -> "StreamCaps":
        tokens = (max_tokens if max_tokens and max_tokens > 0 else DEFAULT_MAX_TOKENS) + TOKEN_MARGIN
        return cls(tokens, tokens * TEXT_PER_TOKEN + (1 << 16), tokens * LINES_PER_TOKEN + LINES_SPARE,
                   first_byte_s + tokens * SECONDS_PER_TOKEN)


def lines(resp, watchdog, idle_s: float, deadline: float, what: str):
    """The lines of ``resp`` as (number of the read that completed it, bytes without the newline), each read under
    ``watchdog``: a read waits at most ``idle_s``, a begun line ends within ``LINE_S``, nothing goes past
    ``deadline`` (monotonic). The read's number tells which chunks came together (buffered on the way)."""
    buf = bytearray()
    reads = 0
    started = 0.0  # when the partial line in ``buf`` began
    total = f"{what} did not finish the reply within {deadline - time.monotonic():.0f} s"
    while True:
        now = time.monotonic()
        if buf:
            watchdog.arm(min(deadline, started + LINE_S), total if deadline < started + LINE_S else
                         f"{what} sent part of a line and not the rest within {LINE_S:g} s (a stalled or dripping "
                         "stream)")
        else:
            watchdog.arm(min(deadline, now + idle_s), total if deadline < now + idle_s else
                         f"{what} sent nothing for {idle_s:g} s")
        data = resp.read1(1 << 16)
        if watchdog.fired:  # the read was cut by the deadline: what came is not the server's whole line
            raise StreamError(watchdog.fired)
        if not data:
            break
        reads += 1
        had_partial = bool(buf)
        buf += data
        start = 0
        while (i := buf.find(b"\n", start)) >= 0:
            yield reads, bytes(buf[start:i])
            start = i + 1
        if start:
            del buf[:start]
        if buf and (start or not had_partial):
            started = time.monotonic()
        if len(buf) > LINE_MAX_BYTES:
            raise StreamError(f"{what} sent a line longer than {LINE_MAX_BYTES >> 20} MiB")
    if buf:
        yield reads, bytes(buf)


def _ids(value, where: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in value):
        raise StreamError(f"a chunk's {where} is not a list of token ids")
    return value


def _usage(raw) -> dict:
    """The usage object with its counts (non-negative ints) only: other keys and types are dropped."""
    if not isinstance(raw, dict):
        return {}
    out = {k: v for k, v in raw.items() if k in ("prompt_tokens", "completion_tokens", "total_tokens")
           and type(v) is int and 0 <= v < 1 << 40}
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(cached) is int and 0 <= cached < 1 << 40:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def parse_chunk(data: str):
    """One ``data:`` payload as a JSON object (``StreamError`` when it is not one)."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise StreamError(f"the server sent a chunk that is not JSON ({type(e).__name__})") from None
    if not isinstance(chunk, dict):
        raise StreamError("the server sent a chunk that is not a JSON object")
    return chunk


def apply_chunk(reply, chunk: dict, sent: float, caps: StreamCaps, on_delta, read: int = 0) -> None:
    """Add one chunk to ``reply`` (``engine.remote.client.Reply``), checking every field it reads; ``read``: the
    socket read it came in."""
    prompt = chunk.get("prompt_token_ids")
    if prompt is not None:
        reply.prompt_ids = _ids(prompt, "prompt_token_ids") or reply.prompt_ids
    if chunk.get("usage"):
        reply.usage = _usage(chunk["usage"])
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or len(choices) > MAX_CHOICES or not all(isinstance(c, dict) for c in choices):
        raise StreamError("a chunk's choices are not a list of objects")
    for choice in choices:
        delta = choice.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
        if text is not None and not isinstance(text, str):
            raise StreamError("a chunk's delta.content is not text")
        text = text or ""
        ids = _ids(choice.get("token_ids"), "token_ids")
        finish = choice.get("finish_reason")
        if finish is not None and not (isinstance(finish, str) and len(finish) <= FINISH_MAX):
            raise StreamError("a chunk's finish_reason is not a short name")
        if len(reply.token_ids) + len(ids) > caps.tokens or len(reply.token_times) + bool(text or ids) > caps.tokens:
            raise StreamError(f"the server streamed more than {caps.tokens:,} tokens (max_tokens and a margin of "
                              f"{TOKEN_MARGIN}): the reply was cut there")
        if len(reply.text) + len(text) > caps.text_chars:
            raise StreamError(f"the server streamed more than {caps.text_chars:,} characters for "
                              f"{caps.tokens:,} tokens: the reply was cut there")
        reply.token_ids += ids
        if text or ids:
            now = time.monotonic()
            reply.token_times.append(now)
            reply.token_reads.append(read)
            if reply.ttft_s is None:
                reply.ttft_s = now - sent
        reply.text += text
        reply.finish_reason = "".join(c if c.isprintable() else "?" for c in finish) if finish else \
            reply.finish_reason
        if on_delta is not None and (text or ids):
            on_delta(text, ids)


def read_stream(resp, reply, sent: float, on_delta, cancel, watchdog, caps: StreamCaps, idle_s: float,
                what: str) -> bool:
    """Read the reply's events into ``reply``; True once the stream ended as a stream does (``[DONE]``, an error
    chunk, Stop). ``StreamError`` for a bound broken or a chunk that is not what the API sends."""
    count = 0
    for read, raw in lines(resp, watchdog, idle_s, sent + caps.deadline_s, what):
        if cancel is not None and cancel.is_set():
            reply.finish_reason = "cancelled"
            return True
        count += 1
        if count > caps.lines:
            raise StreamError(f"{what} sent more than {caps.lines:,} lines for {caps.tokens:,} tokens")
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # "event:", "id:", ": keep-alive" and the empty line between events
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        chunk = parse_chunk(data)
        if "error" in chunk:
            reply.error = f"the server ended the reply: {error_message(chunk)}"
            return True
        apply_chunk(reply, chunk, sent, caps, on_delta, read)
    return False


def error_message(err) -> str:
    """The message of an OpenAI error object (``{"error": {"message": ...}}`` or a bare one), one safe line."""
    err = err.get("error", err) if isinstance(err, dict) else err
    msg = err.get("message") if isinstance(err, dict) else err
    return printable(str(msg or "no message").splitlines()[0] if str(msg or "").strip() else "no message")
